"""Pick a tile configuration per problem class by timing the candidates, then cache it.

A problem class is (kernel, device, dtype, layout, K, N, E, M rounded up to a power of two). Tuning
runs real launches on scratch outputs, so it never touches the caller's tensors, and it never runs
while a CUDA graph is being captured: a class first seen under capture takes the default config.
Each candidate is timed in three interleaved rounds and keeps the median of its three medians (a
GPU that starts cool runs its first timings at higher clocks than it holds under load, so the best
round would favour whichever candidate ran first); the default config stays unless another candidate
is more than 3% faster. A timing is the GPU's time alone (``gpu_time_ms``): in a training step the host
runs ahead of the GPU, so a config that launches more slowly but computes faster is the better one.
Set ``DROPLESS_AUTOTUNE=0`` to always take the default; launches made inside ``untimed()`` (from a
running XLA computation, where a timing would stall it) take it too.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from collections.abc import Callable, Hashable, Iterator, Sequence

import torch

from dropless.kernels.config import GemmConfig
from dropless.kernels.launch import interpreting, next_power_of_2


MIN_TUNED_FLOPS = 2**30
TUNING_ROUNDS = 3
DEFAULT_MARGIN = 0.03  # another config must beat the default by this fraction to replace it
_untimed = threading.local()
FLUSH_BYTES = 256 << 20  # written before each timed run, so that no operand is still in the L2 cache
TIMING_BUDGET_MS = 25.0
MAX_TIMED_RUNS = 50
MAX_SLEEP_US = 3000.0  # the sleep before a run, at most (a launch slowed by something else once)
_sleep_cycles_per_us: dict[int, float] = {}


def _cycles_per_us(device: torch.device) -> float:
    """Clock cycles of ``torch.cuda._sleep`` a microsecond on ``device``, measured once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sleep_cycles_per_us:
        cycles = 2_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1000)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        _sleep_cycles_per_us[index] = cycles / (1e3 * start.elapsed_time(end))
    return _sleep_cycles_per_us[index]


def gpu_time_ms(fn: Callable[[], object], device: torch.device) -> float:
    """The median GPU time of ``fn()`` in milliseconds, without its host's launch cost.

    Each run follows a write of ``FLUSH_BYTES`` (a cold L2 cache) and a device-side sleep three times as
    long as the host takes to launch ``fn`` (at most ``MAX_SLEEP_US``), so the run's kernels are queued
    before the GPU reaches them and the events around them read the GPU's time only. Runs: as many as fit
    ``TIMING_BUDGET_MS``, 3 to ``MAX_TIMED_RUNS``.
    """
    with torch.cuda.device(device):
        fn()
        torch.cuda.synchronize()
        began = time.perf_counter()
        fn()
        host_us = 1e6 * (time.perf_counter() - began)
        sleep_cycles = int(min(3 * (host_us + 20.0), MAX_SLEEP_US) * _cycles_per_us(device))
        flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device=device)

        def timed(runs: int) -> list[float]:
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                      for _ in range(runs)]
            for start, end in events:
                flush.zero_()
                torch.cuda._sleep(sleep_cycles)
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize()
            return [start.elapsed_time(end) for start, end in events]

        estimate = max(statistics.median(timed(3)), 1e-3)
        runs = max(3, min(MAX_TIMED_RUNS, int(TIMING_BUDGET_MS / estimate)))
        return statistics.median(timed(runs))


@contextlib.contextmanager
def untimed() -> Iterator[None]:
    """Within this block (on this thread), every tuner takes its default config for a class it has not
    timed, instead of timing the candidates."""
    before = getattr(_untimed, "on", False)
    _untimed.on = True
    try:
        yield
    finally:
        _untimed.on = before


def problem_class(*parts: Hashable, M: int) -> tuple:
    """A cache key: the given parts and M rounded up to a power of two."""
    return (*parts, next_power_of_2(max(M, 1)))


class Autotuner:
    """Chooses among ``candidates`` for each problem class; ``default`` wherever it cannot time.

    When it times, the default is kept unless another candidate is more than ``DEFAULT_MARGIN``
    faster: a class is timed on the group sizes of its first call, and the default is the config
    that holds up under other routings.
    """

    def __init__(self, name: str, candidates: Sequence[GemmConfig], default: GemmConfig,
                 small_default: GemmConfig | None = None, interpreter_config: GemmConfig | None = None) -> None:
        self.name = name
        self.candidates = list(candidates)
        self.default = default
        # For 4-byte operands (fits the shared memory) and for the interpreter; the default where a
        # tuner never sees those (the Hopper kernels take 16-bit CUDA operands only).
        self.small_default = small_default or default
        self.interpreter_config = interpreter_config or default
        self.cache: dict[tuple, GemmConfig] = {}

    def choose(self, key: tuple, device: torch.device, element_size: int, flops: int,
               run: Callable[[GemmConfig], None], also: Callable[[GemmConfig], None] | None = None) -> GemmConfig:
        """The cached config for ``key``; on a miss, time ``run(config)`` for every candidate, and with
        ``also`` (the same product under another routing) add each candidate's two times as fractions of
        the best candidate's under the same routing: the config chosen is the best over both routings, each
        counting alike however long its product takes, not only under the routing the class is first
        called with.

        A candidate that does not compile for this problem (too much shared memory for fp32
        operands, a schedule the compiler rejects for this layout) is skipped. Problems of fewer
        than ``MIN_TUNED_FLOPS`` (microseconds of work, where launch latency dominates and tuning
        would cost seconds, as in token-by-token generation) take the default.
        """
        config = self.cache.get(key)
        if config is not None:
            return config
        if interpreting() and device.type != "cuda":
            return self.interpreter_config
        default = self.default if element_size <= 2 else self.small_default
        if (os.environ.get("DROPLESS_AUTOTUNE", "1") == "0" or flops < MIN_TUNED_FLOPS
                or getattr(_untimed, "on", False) or torch.cuda.is_current_stream_capturing()):
            return default
        calls = [run] if also is None else [run, also]
        samples: dict[GemmConfig, list[list[float]]] = {}
        failed: dict[GemmConfig, Exception] = {}
        # Rounds over all candidates, each keeping the median of its rounds: a clock or neighbour
        # slowdown (or a cool start) during one candidate's turn does not decide the choice.
        for _ in range(TUNING_ROUNDS):
            for config in self.candidates:
                if config in failed:
                    continue
                try:
                    medians = [gpu_time_ms(lambda: call(config), device) for call in calls]
                except Exception as error:  # noqa: BLE001 - a config this problem cannot compile
                    failed[config] = error
                    continue
                for times, median in zip(samples.setdefault(config, [[] for _ in calls]), medians):
                    times.append(median)
        if not samples:
            raise RuntimeError(f"{self.name}: no tile configuration compiled for {key}") from next(
                iter(failed.values()))
        medians = {config: [statistics.median(times) for times in per_call] for config, per_call in samples.items()}
        fastest = [min(times[i] for times in medians.values()) for i in range(len(calls))]
        timings = {config: sum(t / f for t, f in zip(times, fastest)) for config, times in medians.items()}
        best = min(timings, key=timings.get)
        if default in timings and timings[best] * (1 + DEFAULT_MARGIN) >= timings[default]:
            best = default
        self.cache[key] = best
        return best
