"""Median time of a callable: CUDA events through ``triton.testing.do_bench`` on a GPU, or the host
clock over batches of queued calls (for work that CUDA events on torch's stream cannot see)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from triton.testing import do_bench

T = TypeVar("T")


def median_ms(fn: Callable[[], Any], device: torch.device, warmup: float, rep: float) -> float:
    """Median milliseconds of ``fn()`` after ``warmup`` ms of warm-up, over about ``rep`` ms of runs.

    On CUDA: ``do_bench`` (events around each run, L2 flushed before each). Elsewhere: a host clock
    over ``warmup`` ms of warm-up and ``rep`` ms of timed runs, for smoke runs only.
    """
    if device.type == "cuda":
        return float(do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    return _host_median_ms(fn, warmup, rep)


def graphed_median_ms(fn: Callable[[], Any], device: torch.device, warmup: float, rep: float,
                      calls: int = 10) -> float:
    """``median_ms`` of one call of ``fn`` replayed from a CUDA graph of ``calls`` calls: the GPU's time
    alone, where a call from Python can take longer on the host than its kernels on the GPU. Elsewhere
    ``median_ms``."""
    if device.type != "cuda":
        return median_ms(fn, device, warmup, rep)
    fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    ms = median_ms(graph.replay, device, warmup, rep) / calls
    del graph
    return ms


def back_to_back_ms(fn: Callable[[], Any], n: int) -> float:
    """Milliseconds per call of ``fn`` over ``n`` calls queued back to back on the current CUDA stream,
    by CUDA events around all of them (no sync between calls: the rate a stream of them sustains)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def _host_median_ms(fn: Callable[[], Any], warmup: float, rep: float) -> float:
    # Bounded by wall time rather than by a count from an estimate: host clocks on a shared CPU
    # jump, and a count taken from one fast estimate can run for minutes.
    deadline = time.perf_counter() + warmup / 1e3
    fn()
    while time.perf_counter() < deadline:
        fn()
    times: list[float] = []
    deadline = time.perf_counter() + rep / 1e3
    while not times or time.perf_counter() < deadline:
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def queued_median_ms(fn: Callable[[], T], wait: Callable[[T], Any], warmup: float, rep: float,
                     batches: int = 5) -> float:
    """Median milliseconds per call of ``fn()`` over batches of calls queued back to back, each batch
    ended by one ``wait(result)`` of its last call, after ``warmup`` ms of such batches.

    For timing work on streams torch does not own (JAX's) beside torch's own, every method alike: the
    host clock around a batch counts the device time and whatever host time the device could not hide,
    as a training step sees it, and waiting once per batch keeps the wait's own latency out of it. A
    batch is sized to last about ``rep / batches`` ms; the timed batches run for about ``rep`` ms (one
    at the least).
    """
    deadline = time.perf_counter() + warmup / 1e3
    per_call = _batch_ms(fn, wait, 1)
    while time.perf_counter() < deadline:
        per_call = _batch_ms(fn, wait, _batch_size(rep / batches, per_call))
    size = _batch_size(rep / batches, per_call)
    times: list[float] = []
    deadline = time.perf_counter() + rep / 1e3
    while not times or time.perf_counter() < deadline:
        times.append(_batch_ms(fn, wait, size))
    return statistics.median(times)


def _batch_ms(fn: Callable[[], T], wait: Callable[[T], Any], calls: int) -> float:
    """Milliseconds per call of ``calls`` queued calls and one wait for the last."""
    start = time.perf_counter()
    for _ in range(calls):
        result = fn()
    wait(result)
    return (time.perf_counter() - start) * 1e3 / calls


def _batch_size(batch_ms: float, per_call_ms: float) -> int:
    return max(1, round(batch_ms / per_call_ms)) if per_call_ms > 0 else 1


def round_order(cases: Sequence[T], round_: int, seed: int) -> list[T]:
    """The cases in the order round ``round_`` times them: a seeded shuffle, different each round.

    Under a power limit a case's clock depends on what ran just before it; a fixed order would give
    each method the same predecessor in every round, and so the same bias.
    """
    order = list(cases)
    random.Random(seed * 1_000_003 + round_).shuffle(order)
    return order
