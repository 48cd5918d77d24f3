"""The grouped GEMM benchmark: every method, pass and routing of each shape, on shared inputs.

For each (shape, routing) the operands are drawn once and shared by all methods. Each (method, pass)
runs once, is checked against the fp32 reference, and only if it passes is it timed. A method that
raises (including running out of memory) gets a row with its error, and the run goes on.
"""

from __future__ import annotations

import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from dropless.bench.options import RunOptions
from dropless.bench.check import TOLERANCE, References, max_rel_err
from dropless.bench.environment import describe
from dropless.bench.peers import METHODS, Case, Method
from dropless.bench.problem import PASSES, Problem, make_problem, useful_flops
from dropless.bench.routing import ALL_ROUTINGS, group_sizes
from dropless.bench.shapes import Shape, select_shapes
from dropless.bench.timing import median_ms, round_order
from dropless.kernels.tuning import tuned_configs

# How a case is timed: (its run, the device, warm-up ms, repetition ms) -> median ms.
Timer = Callable[[Callable[[], Any], torch.device, float, float], float]


@dataclass
class GemmOptions(RunOptions):
    """Which shapes, routings, passes and methods to run, and how (see ``RunOptions``)."""

    shapes: Sequence[str] | None = None  # shape and group names (see ``select_shapes``); None: the training set
    routings: Sequence[str] | None = None  # None: each shape's own (``Shape.routings``)
    passes: Sequence[str] = PASSES
    methods: Sequence[str] = tuple(METHODS)
    registry: dict[str, Callable[[Problem], Method]] = field(default_factory=lambda: dict(METHODS))
    tolerance: float | None = None  # largest max_rel_err passed (None: the dtype's TOLERANCE)
    align: int = 1  # every group size a multiple of this (peers that need 16-row groups)
    timer: Timer = median_ms  # every method of a run is timed by the same one

    @property
    def dtype(self) -> torch.dtype:
        return self.default_dtype()


def run_gemm(opts: GemmOptions, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> dict:
    """Run the benchmark; return ``{"meta": {...}, "rows": [...]}`` (one row per shape, routing,
    method and pass, in that nesting order)."""
    shapes = select_shapes(opts.shapes, opts.quick)
    for name, given, known in (("routing", opts.routings or (), ALL_ROUTINGS), ("pass", opts.passes, PASSES),
                               ("method", opts.methods, tuple(opts.registry))):
        unknown = [g for g in given if g not in known]
        if unknown:
            raise ValueError(f"unknown {name}(s) {unknown}; choose from {list(known)}")
    meta = describe(opts.device, opts.dtype, opts.commit)
    meta.update(warmup_ms=opts.warmup, rep_ms=opts.rep, rounds=opts.rounds, seed=opts.seed, quick=opts.quick,
                max_rel_err="||out - ref||_F / ||ref||_F against an fp32 reference, largest over the "
                            "pass's results (y, dx, dw)",
                tolerance=_tolerance(opts), group_sizes={})
    rows = []
    started = time.perf_counter()
    for shape in shapes:
        for routing in opts.routings or shape.routings:
            sizes = group_sizes(shape.E, shape.M, routing, opts.seed, opts.align)
            meta["group_sizes"].setdefault(shape.name, {})[routing] = sizes
            tic = time.perf_counter()
            rows += _run_case(shape, routing, sizes, opts)
            log(f"{shape.name} {routing}: max_group {max(sizes)}, {time.perf_counter() - tic:.1f} s")
    _fill_ratios(rows)
    meta["tuned_configs"] = tuned_configs()
    meta["seconds"] = round(time.perf_counter() - started, 1)
    return {"meta": meta, "rows": rows}


def _run_case(shape: Shape, routing: str, sizes: list[int], opts: GemmOptions) -> list[dict]:
    """All rows of one (shape, routing): fresh operands; every method checked, then timed in rounds.

    The timing runs ``opts.rounds`` times over all (method, pass) cases, each round in its own
    shuffled order, and keeps each case's median (``ms``) and its per-round times (``ms_rounds``), so
    a drift of the machine's clocks during the run, or a hot predecessor, falls on every method
    alike rather than on whichever happened to run then.
    """
    base = {"shape": shape.name, "E": shape.E, "M": shape.M, "K": shape.K, "N": shape.N,
            "routing": routing, "max_group": max(sizes)}
    problem = make_problem(shape, sizes, opts.dtype, opts.device, opts.seed)
    refs = References(problem)
    rows, timed = [], []
    methods = {name: _build(opts.registry[name], problem) for name in opts.methods}
    for name, (method, error) in methods.items():
        for pass_ in opts.passes:
            row = {**base, "method": name, "pass": pass_, "ms": None, "ms_rounds": None, "tflops": None,
                   "ratio_to_dense": None, "max_rel_err": None, "failed": error is not None, "error": error}
            case = _check(method, pass_, refs, opts, row) if method is not None else None
            if case is not None:
                timed.append((row, case, useful_flops(shape, pass_), []))
            rows.append(row)
            _release(opts.device)
    for round_ in range(opts.rounds):
        for row, case, _flops, samples in round_order(timed, round_, opts.seed):
            if row["failed"]:
                continue
            try:
                samples.append(opts.timer(case.run, opts.device, opts.warmup, opts.rep))
            except Exception as exc:  # recorded as the row's error; the benchmark goes on
                row["failed"] = True
                row["error"] = _describe_error(exc)
    for row, _case, flops, samples in timed:
        if not row["failed"]:
            row["ms"] = statistics.median(samples)
            row["ms_rounds"] = samples
            row["tflops"] = flops / row["ms"] / 1e9
    del methods, timed, problem, refs
    _release(opts.device)
    return rows


def _build(builder: Callable[[Problem], Method], problem: Problem) -> tuple[Method | None, str | None]:
    try:
        return builder(problem), None
    except Exception as exc:  # an unsupported peer or out of memory: recorded, the run goes on
        return None, _describe_error(exc)


def _check(method: Method, pass_: str, refs: References, opts: GemmOptions, row: dict) -> Case | None:
    """Run ``method``'s ``pass_`` once against the reference; the case to time if it passed.

    ``failed`` is set for a result off the reference by more than the tolerance (NaN included) and
    for a method that raised (then ``error`` says what); a failed row has no timing.
    """
    try:
        case = method.case(pass_)
        outputs = case.unpack(case.run())
        err = max_rel_err(outputs, refs.get(method.oracle, pass_))
        del outputs
    except Exception as exc:  # recorded as the row's error; the benchmark goes on with the next case
        row["failed"] = True
        row["error"] = _describe_error(exc)
        return None
    row["max_rel_err"] = err if math.isfinite(err) else None
    if not err <= _tolerance(opts):
        row["failed"] = True
        row["error"] = None if math.isfinite(err) else "non-finite result"
        return None
    return case


def _tolerance(opts: GemmOptions) -> float:
    return TOLERANCE[opts.dtype] if opts.tolerance is None else opts.tolerance


def _fill_ratios(rows: list[dict]) -> None:
    """``ratio_to_dense``: a row's TFLOP/s over the dense row's of the same shape, routing and pass."""
    dense = {(r["shape"], r["routing"], r["pass"]): r["tflops"] for r in rows if r["method"] == "dense"}
    for r in rows:
        ceiling = dense.get((r["shape"], r["routing"], r["pass"]))
        if r["tflops"] is not None and ceiling:
            r["ratio_to_dense"] = r["tflops"] / ceiling


def _describe_error(exc: BaseException) -> str:
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first_line[:300]}"


def _release(device: torch.device) -> None:
    """Hand cached blocks back so the next case (and padded_bmm's large buffers) can allocate."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
