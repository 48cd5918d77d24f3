"""The expert-parallel benchmark: ``torchrun --nproc-per-node P -m dropless.bench ep`` (or plain
``python -m dropless.bench ep``, one process).

Two parts, every rank running the same cases in the same order:

**exchange** (``ep_exchange``): dispatch and combine of token copies between the P ranks, for each
``dropless.parallel.dispatch`` backend the probe finds accepted (``dropless_<backend>``, and with
``--fp8`` its rowwise FP8 dispatch), against NCCL ``all_to_all_single`` with its count exchange
(``a2a_with_counts``) and with the sizes known (``a2a_data_only``), on the same tokens and routing.
A backend dispatch refuses is not a method; the result's ``meta.backends`` says why. On GPUs the backends
with no host sync are also timed replayed from CUDA graphs (``dropless_<backend>_graph``).

- bytes crossing ranks, per rank: dispatch = copies this rank sends to other ranks x bytes of a row on
  the wire (``d`` elements in the rows' dtype; FP8 data and scales with ``--fp8``); combine = the rows it
  received from other ranks, sent back (``d`` elements in the rows' dtype). Rows a rank keeps never cross.
- time per rank: before every timed call all ranks meet (an all-reduce of a one-element flag, which
  also decides together whether to go on) and wait for their GPU (``torch.cuda.synchronize``), so each
  call starts with the ranks aligned and nothing queued; the call is timed with CUDA events on the
  rank's stream (host clock on the CPU), host syncs inside it included. A rank's time for a case is the
  median of its calls over ``--rep`` ms (at least MIN_ITERS calls, after ``--warmup`` ms), and its
  figure the median of ``--rounds`` rounds, each timing every case in a seeded shuffled order.
  Aligning every call keeps one rank's lead from being counted as another's exchange time, at the
  price of the pipelining a training step might get between consecutive layers. No L2 flush: the
  full-size cases' rows (67 MB and more per rank) do not fit in L2.
- GB/s per rank: a rank's bytes over its time; rows give the mean over ranks (``gbps_per_rank``) and
  the slowest rank (``gbps_slowest_rank``), and ``ms`` is the slowest rank's time. ``dispatch+combine``
  rows add the two passes' bytes and times, rank by rank.

**layer** (``ep_layer``): the DeepSeek-V3 MoE layer, forward and backward (``y = layer(x)``, then
``torch.autograd.grad`` of x and every parameter with a random upstream gradient), in BF16 and FP8
rowwise: ``dropless_ep`` (``MoE(ep_group=<all ranks>)``) against ``dropless_one_gpu``, the same per-GPU
work with no communication: E/P experts (the same weights), the same T tokens, each routed to k of the
layer's experts drawn the same way, so ``T * k`` copies per GPU as the EP layer's ranks take on
average, and the same router and shared-expert work. Every rank times both, the reference with no
exchange between ranks. On GPUs, the symmetric-memory layer (no host sync) and the reference are also
captured in CUDA graphs and timed as replays (``_graph``), and weighed against each other. Time: as
above (barrier and sync before every step); ``ms`` is the slowest rank's (a data-parallel step waits for
its slowest rank, with or without EP). Weak-scaling efficiency = one-GPU time / P-GPU time =
``dropless_one_gpu.ms / dropless_ep.ms``; gradients of replicated weights are not reduced across ranks
in either (that is data parallelism's work, not the layer's).

Routing: every rank draws its own tokens' experts from a fixed seed and its rank (``routing.draw_topk``):
``balanced`` (uniform, balanced in expectation; the bars are judged on it) and, with ``--routing
skewed``, a Zipf popularity shared by the ranks, so that some ranks receive far more copies.
"""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dropless.bench import ep_exchange, ep_layer, ep_report
from dropless.bench.check import TOLERANCE
from dropless.bench.environment import describe, device_name
from dropless.bench.fp8 import FP8_TOLERANCE
from dropless.bench.gemm import _describe_error
from dropless.bench.options import RunOptions
from dropless.bench.timing import round_order
from dropless.kernels.tuning import tuned_configs

__all__ = ["BARS", "EpOptions", "MIN_ITERS", "Ranks", "process_group", "run_ep"]

MIN_ITERS = 5  # timed calls per case and round at the least, whatever --rep allows
ROUTINGS = ("balanced", "skewed")
PARTS = ("exchange", "layer")
# The bars this benchmark judges (ep_report.judge_bars), recorded in the result's meta.
BARS = {
    # dropless dispatch+combine GB/s per rank over a2a_with_counts', at 2 and 4 GPUs
    "vs_a2a_with_counts": 1.2, "vs_a2a_with_counts_gpus": [2, 4],
    # dropless dispatch+combine GB/s per rank, on 4 H200s
    "gbps_per_rank": 350.0, "gbps_gpus": 4, "gbps_device": "H200",
    # the EP layer's weak-scaling efficiency at P = 2 and 4
    "weak_scaling": 0.85, "weak_scaling_gpus": [2, 4],
    "judged_on": "GPU runs, balanced routing; GB/s as the mean over ranks (gbps_per_rank); dropless methods "
                 "with rows in their own dtype (the FP8 dispatch is shown beside them, by time)",
}


@dataclass
class EpOptions(RunOptions):
    """Which cases, layer configs, routings and parts to run, and how (see ``RunOptions``)."""

    cases: Sequence[str] | None = None
    configs: Sequence[str] | None = None
    routings: Sequence[str] = ("balanced",)
    parts: Sequence[str] = PARTS
    backends: Sequence[str] = ep_exchange.DISPATCH_BACKENDS
    fp8: bool = False
    recipes: Sequence[str] = ep_layer.RECIPES
    dtype: torch.dtype | None = None  # default: bf16 on a GPU, fp32 on the CPU

    def validate(self) -> None:
        """ValueError for anything unknown (before any collective, so every rank raises alike)."""
        for what, values, known in (("routing", self.routings, ROUTINGS), ("part", self.parts, PARTS),
                                    ("recipe", self.recipes, ep_layer.RECIPES)):
            unknown = [v for v in values if v not in known]
            if unknown or not values:
                raise ValueError(f"unknown or no {what}(s) {list(unknown)}; choose from {list(known)}")
        ep_exchange.select_cases(self.cases, self.quick)
        ep_layer.select_configs(self.configs, self.quick)
        if self.dtype is None:
            self.dtype = self.default_dtype()


class Ranks:
    """This process's place in the benchmark's process group, and what every rank does together."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank: an all-reduce every rank calls, then a wait for this rank's
        GPU, so it is also the barrier before each timed call."""
        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return bool(t.item())

    def gather(self, obj: object) -> list:
        """Every rank's ``obj``, in rank order (on every rank)."""
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def agreed(self, build: Callable[[], object]) -> tuple[object | None, str | None]:
        """``(build(), None)`` if it returned on every rank, else ``(None, why)`` on every rank: a case that
        fails on one rank is skipped by all, so no rank waits alone in a collective."""
        try:
            value, error = build(), None
        except Exception as exc:  # recorded as the row's error; the benchmark goes on
            value, error = None, _describe_error(exc)
            _release(self.device)
        if self.any(error is not None):
            return None, error or "raised on another rank"
        return value, None

    def median_ms(self, fn: Callable[[], object], warmup: float, rep: float) -> float:
        """This rank's median milliseconds of ``fn()``, each call after a barrier and a sync (see the
        module docstring). Every rank calls it; the ranks decide together when warm-up and timing end."""
        start = time.perf_counter()
        fn()
        while self.any(time.perf_counter() - start < warmup / 1e3):
            fn()
        times: list[float] = []
        start = time.perf_counter()
        while self.any(len(times) < MIN_ITERS or time.perf_counter() - start < rep / 1e3):
            times.append(self._once(fn))
        return statistics.median(times)

    def _once(self, fn: Callable[[], object]) -> float:
        if self.device.type != "cuda":
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end)


@contextlib.contextmanager
def process_group(device: str = "auto") -> Iterator[Ranks]:
    """The world's process group: the one already initialized, else one from torchrun's environment
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...), else a group of this one process. NCCL on GPUs (one per
    rank, ``cuda:LOCAL_RANK``), gloo on the CPU (``device="cpu"``, or no GPU). A group made here is
    destroyed on the way out."""
    made = False
    if dist.is_initialized():
        cuda = dist.get_backend() == "nccl"
    else:
        cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    where = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(where)
    if not dist.is_initialized():
        options = {"backend": "nccl" if cuda else "gloo", "timeout": timedelta(minutes=10)}
        if cuda:
            options["device_id"] = where
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(**options)
        else:
            dist.init_process_group(**options, store=dist.HashStore(), rank=0, world_size=1)
        made = True
    try:
        yield Ranks(dist.group.WORLD, where)
    finally:
        if made:
            dist.destroy_process_group()


def run_ep(opts: EpOptions, ranks: Ranks, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)
           ) -> dict | None:
    """Run the benchmark on every rank; return ``{"meta": {...}, "rows": [...]}`` on rank 0, None elsewhere."""
    opts.validate()
    say = log if ranks.rank == 0 else (lambda s: None)
    started = time.perf_counter()
    backends = {b: ep_exchange.probe_backend(b, ranks.group, ranks.device) for b in opts.backends}
    # A backend runs only where it ran on every rank.
    ran_everywhere = [not any(r) for r in zip(*ranks.gather([backends[b] is not None for b in opts.backends]))]
    accepted = [b for b, ok in zip(opts.backends, ran_everywhere) if ok]
    status = {b: "ok" if b in accepted else f"skipped: {backends[b] or 'failed on another rank'}"
              for b in opts.backends}
    for b in opts.backends:
        if b not in accepted:
            say(f"dispatch backend {b}: {status[b]}")
    graphs = ranks.device.type == "cuda"  # graph-replayed methods: GPUs only
    methods = ep_exchange.method_names(accepted, opts.fp8, graphs=graphs)
    per_rank = {"records": {}, "samples": {}}
    if "exchange" in opts.parts:
        _run_exchange(opts, ranks, methods, per_rank, say)
    if "layer" in opts.parts:
        _run_layers(opts, ranks, ep_layer.layer_methods(graphs), per_rank, say)
    gathered = ranks.gather({**per_rank, "device": device_name(ranks.device)})
    if ranks.rank != 0:
        return None
    rows = (_exchange_rows(opts, ranks.world, methods, gathered)
            + _layer_rows(opts, ranks.world, ep_layer.layer_methods(graphs), gathered))
    meta = _meta(opts, ranks, gathered, methods, status)
    meta["tuned_configs"] = tuned_configs()  # rank 0's
    meta["seconds"] = round(time.perf_counter() - started, 1)
    result = {"meta": meta, "rows": rows}
    result["bars"] = ep_report.judge_bars(result)
    return result


Key = tuple[str, ...]


def _time_rounds(items: dict[Key, Callable[[], object]], opts: EpOptions, ranks: Ranks,
                 after: dict[Key, Callable[[], None]] | None = None) -> dict[Key, list[float]]:
    """This rank's median ms of each item, per round; ``after[key]()`` runs after each of its timings."""
    samples: dict[Key, list[float]] = {key: [] for key in items}
    for round_ in range(opts.rounds):
        for key in round_order(list(items), round_, opts.seed):
            samples[key].append(ranks.median_ms(items[key], opts.warmup, opts.rep))
            if after and key in after:
                after[key]()
    return samples


def _checked(ranks: Ranks, err: float, tolerance: float) -> str | None:
    """None if ``err`` is within ``tolerance`` on every rank, else why not (on every rank)."""
    bad = not err <= tolerance  # NaN fails
    if ranks.any(bad):
        return f"off the expected result by {err:.3g} (tolerance {tolerance:g})" if bad else "off on another rank"
    return None


def _run_exchange(opts: EpOptions, ranks: Ranks, methods: Sequence[str], out: dict, say: Callable[[str], None]) -> None:
    items: dict[Key, Callable[[], object]] = {}
    for case in ep_exchange.select_cases(opts.cases, opts.quick):
        for routing in opts.routings:
            inp, error = ranks.agreed(lambda: ep_exchange.make_inputs(case, routing, ranks.group, ranks.device,
                                                                      opts.dtype, opts.seed))
            for method in methods:
                built, build_error = (ranks.agreed(lambda: ep_exchange.build_method(method, inp)) if inp is not None
                                      else (None, error))
                for pass_ in ep_exchange.PASSES:
                    key = ("exchange", case.name, routing, method, pass_)
                    record = {"bytes": None, "max_rel_err": None, "error": build_error}
                    out["records"][key] = record
                    if built is None:
                        say(f"{case.name} {routing} {method} {pass_}: {build_error}")
                        continue
                    record["bytes"] = inp.bytes_out(pass_, built.row_bytes[pass_])
                    record["max_rel_err"] = built.errors[pass_]
                    fp8 = method.endswith("_fp8") and pass_ == "dispatch"
                    tolerance = FP8_TOLERANCE if fp8 else TOLERANCE[opts.dtype]
                    record["error"] = _checked(ranks, built.errors[pass_], tolerance)
                    if record["error"] is None:
                        items[key] = built.fns[pass_]
                    else:
                        say(f"{case.name} {routing} {method} {pass_}: {record['error']}")
    with torch.no_grad():
        out["samples"].update(_time_rounds(items, opts, ranks))
    del items
    _release(ranks.device)


def _run_layers(opts: EpOptions, ranks: Ranks, methods: Sequence[str], out: dict,
                say: Callable[[str], None]) -> None:
    for cfg in ep_layer.select_configs(opts.configs, opts.quick):
        weights, error = ranks.agreed(lambda: ep_layer.make_weights(cfg, ranks.group, ranks.device, opts.dtype,
                                                                    opts.seed))
        for routing in opts.routings:
            drawn, routing_error = (ranks.agreed(lambda: ep_layer.draw_routing(cfg, routing, ranks.group, ranks.device,
                                                                               opts.seed))
                                    if weights is not None else (None, error))
            for recipe in opts.recipes:
                # Timed a recipe at a time: each graph holds its step's memory while it lives.
                items: dict[Key, Callable[[], object]] = {}
                after: dict[Key, Callable[[], None]] = {}
                for method in methods:
                    key = ("layer", cfg.name, routing, method, recipe)
                    record = {"rows": None, "error": routing_error}
                    out["records"][key] = record
                    if drawn is None:
                        continue
                    record["rows"] = drawn.rows_ep if method in ep_layer.EP_METHODS else drawn.rows_one_gpu
                    layer, record["error"] = ranks.agreed(
                        lambda: ep_layer.build_layer(cfg, method, recipe, weights, drawn, ranks.group))
                    if layer is not None:
                        step = _layer_step(layer, weights.x, weights.dy)
                        finite, record["error"] = ranks.agreed(lambda: _all_finite(step()))
                        if record["error"] is None and ranks.any(not finite):
                            record["error"] = ("non-finite output or gradient" if not finite
                                               else "non-finite on another rank")
                        if record["error"] is None and method.endswith(ep_layer.GRAPHED):
                            step, record["error"] = ranks.agreed(lambda: ep_exchange.graphed(step))
                        else:
                            ep_layer.release_caches(layer)
                    if record["error"] is not None:
                        say(f"{cfg.name} {routing} {method} {recipe}: {record['error']}")
                        continue
                    items[key] = step
                    if not method.endswith(ep_layer.GRAPHED):  # a graph keeps its buffers between replays
                        after[key] = lambda layer=layer: (ep_layer.release_caches(layer), _release(ranks.device))
                out["samples"].update(_time_rounds(items, opts, ranks, after))
                del items, after
                _release(ranks.device)


def _layer_step(layer: torch.nn.Module, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], tuple]:
    x = x.detach().requires_grad_()
    inputs = [x, *layer.parameters()]

    def step() -> tuple:
        y = layer(x)
        # autograd.grad, not backward: nothing accumulates into .grad between repetitions.
        return (y, *torch.autograd.grad(y, inputs, dy))

    return step


def _all_finite(tensors: Sequence[torch.Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------
# rows, on rank 0


def _per_rank(gathered: list[dict], key: Key) -> tuple[list[float] | None, list[list[float]] | None]:
    """Each rank's median over rounds of its time for ``key``, and its times per round; None if untimed."""
    rounds = [g["samples"].get(key) for g in gathered]
    if any(not r for r in rounds):
        return None, None
    return [statistics.median(r) for r in rounds], rounds


def _error(gathered: list[dict], key: Key) -> str | None:
    """The first rank's own error for ``key`` (one that says it happened elsewhere only if none does)."""
    errors = [g["records"][key]["error"] for g in gathered if g["records"][key]["error"]]
    own = [e for e in errors if "another rank" not in e]
    return (own or errors or [None])[0]


def _bandwidth(ms: list[float] | None, nbytes: list[int | None]) -> dict:
    """``ms`` (the slowest rank's), ``gbps_per_rank`` (mean over ranks) and ``gbps_slowest_rank``, with
    each rank's GB/s; GB/s are None where no bytes cross (one rank)."""
    if ms is None:
        return {"ms": None, "gbps_per_rank": None, "gbps_slowest_rank": None, "gbps_each_rank": None}
    each = [b / t / 1e6 if b and t > 0 else None for b, t in zip(nbytes, ms)]
    known = [g for g in each if g is not None]
    return {"ms": max(ms), "gbps_per_rank": statistics.mean(known) if len(known) == len(each) else None,
            "gbps_slowest_rank": min(known) if len(known) == len(each) else None, "gbps_each_rank": each}


def _exchange_rows(opts: EpOptions, world: int, methods: Sequence[str], gathered: list[dict]) -> list[dict]:
    if "exchange" not in opts.parts:
        return []
    rows = []
    for case in ep_exchange.select_cases(opts.cases, opts.quick):
        for routing in opts.routings:
            for method in methods:
                base = {"part": "exchange", "case": case.name, "routing": routing, "gpus": world, "T": case.T,
                        "d": case.d, "k": case.k, "E": case.E, "method": method,
                        "backend": method.removeprefix("dropless_").removesuffix("_fp8").removesuffix("_graph")
                        if method.startswith("dropless_") else None}
                passes = {}
                for pass_ in ep_exchange.PASSES:
                    key = ("exchange", case.name, routing, method, pass_)
                    ms, rounds = _per_rank(gathered, key)
                    nbytes = [g["records"][key]["bytes"] for g in gathered]
                    errs = [g["records"][key]["max_rel_err"] for g in gathered]
                    passes[pass_] = (ms, nbytes)
                    error = _error(gathered, key)
                    fp8 = method.endswith("_fp8") and pass_ == "dispatch"
                    wire = f"fp8 {ep_exchange.FP8_RECIPE}" if fp8 else str(opts.dtype).removeprefix("torch.")
                    rows.append({**base, "pass": pass_, "wire": wire,
                                 **_bandwidth(ms, nbytes), "ms_per_rank": ms, "ms_rounds_per_rank": rounds,
                                 "bytes_per_rank": nbytes,
                                 "max_rel_err": max(errs) if None not in errs else None,
                                 "failed": error is not None or ms is None, "error": error})
                (d_ms, d_bytes), (c_ms, c_bytes) = passes["dispatch"], passes["combine"]
                both_ms = [a + b for a, b in zip(d_ms, c_ms)] if d_ms and c_ms else None
                both_bytes = [a + b if a is not None and b is not None else None for a, b in zip(d_bytes, c_bytes)]
                rows.append({**base, "pass": "dispatch+combine", "wire": None, **_bandwidth(both_ms, both_bytes),
                             "ms_per_rank": both_ms, "ms_rounds_per_rank": None, "bytes_per_rank": both_bytes,
                             "max_rel_err": None, "failed": both_ms is None,
                             "error": None if both_ms else "dispatch or combine was not timed"})
    return rows


def _layer_rows(opts: EpOptions, world: int, methods: Sequence[str], gathered: list[dict]) -> list[dict]:
    if "layer" not in opts.parts:
        return []
    rows = []
    for cfg in ep_layer.select_configs(opts.configs, opts.quick):
        for routing in opts.routings:
            for recipe in opts.recipes:
                timed = {}
                for method in methods:
                    key = ("layer", cfg.name, routing, method, recipe)
                    ms, rounds = _per_rank(gathered, key)
                    error = _error(gathered, key)
                    timed[method] = max(ms) if ms else None
                    rows.append({"part": "layer", "case": cfg.name, "routing": routing, "gpus": world, "T": cfg.T,
                                 "d": cfg.d, "d_ff": cfg.d_ff, "E": cfg.E, "k": cfg.k, "shared_d_ff": cfg.shared_d_ff,
                                 "method": method, "backend": ep_layer.EP_METHODS.get(method),
                                 "recipe": recipe, "pass": "layer_fwd+bwd", "ms": timed[method], "ms_per_rank": ms,
                                 "ms_rounds_per_rank": rounds,
                                 "rows_per_rank": [g["records"][key]["rows"] for g in gathered],
                                 "tflops": cfg.useful_flops / timed[method] / 1e9 if timed[method] else None,
                                 "weak_scaling": None, "failed": error is not None or ms is None, "error": error})
                for row in rows[-len(methods):]:
                    one = timed.get(ep_layer.reference(row["method"]))
                    if row["method"] in ep_layer.EP_METHODS and row["ms"] and one:
                        row["weak_scaling"] = one / row["ms"]
    return rows


def _meta(opts: EpOptions, ranks: Ranks, gathered: list[dict], methods: Sequence[str], backends: dict) -> dict:
    cases = ep_exchange.select_cases(opts.cases, opts.quick)
    configs = ep_layer.select_configs(opts.configs, opts.quick)
    meta = {"benchmark": "ep", **describe(ranks.device, opts.dtype, opts.commit), "world_size": ranks.world,
            "devices": [g["device"] for g in gathered], "process_group_backend": dist.get_backend(ranks.group),
            "backends": backends, "methods": list(methods), "parts": list(opts.parts), "routings": list(opts.routings),
            "recipes": list(opts.recipes), "fp8_dispatch": opts.fp8,
            "warmup_ms": opts.warmup, "rep_ms": opts.rep, "rounds": opts.rounds, "min_iters": MIN_ITERS,
            "seed": opts.seed, "quick": opts.quick}
    meta.update(
        timing="per rank: before every timed call an all-reduce of a one-element flag (a barrier; the ranks also "
               "decide together whether to go on) and torch.cuda.synchronize; the call timed with CUDA events "
               "(host clock on the CPU), no L2 flush; a rank's time = median over its rounds of the median of "
               "its calls; ms = the slowest rank's",
        bytes="per rank and pass, bytes sent to other ranks: dispatch = copies sent to other ranks x row bytes on "
              "the wire; combine = rows received from other ranks, sent back, x row bytes; dispatch+combine = "
              "both (the count exchanges' few bytes not counted)",
        gbps="bytes / time, per rank; gbps_per_rank = the mean over ranks, gbps_slowest_rank = the lowest",
        peers="a2a_with_counts: the [P, E/P] count table from the expert ids, all_to_all_single, read on the host, "
              "then the data all_to_all_single of copies already in send order; its combine sends the rows back "
              "with the sizes the dispatch read. a2a_data_only: the data exchanges alone, sizes known on the host",
        layer="dropless_ep: MoE(ep_group=all ranks), T tokens per rank routed to k of E experts; dropless_one_gpu: "
              "MoE with this rank's E/P experts (the same weights), the same T tokens routed to k of them, no "
              "communication; both: step = y = layer(x), torch.autograd.grad(y, [x, *params], dy); the routers' "
              "choice replaced by the seeded draw (weights: the router's sigmoid scores at the drawn experts, "
              "renormalized, x routed_scaling); replicated weights' gradients not reduced; *_graph: the step "
              "captured in a CUDA graph and timed as its replay (an FP8 layer quantizes its weights inside the graph, "
              "every replay)",
        weak_scaling="dropless_one_gpu ms / dropless_ep ms (slowest ranks, same recipe and routing); "
                     "dropless_one_gpu_graph's for a _graph method",
        tflops="useful expert-GEMM FLOPs of one GPU's forward+backward on average, "
               "3 * T * 6 * d * (k * d_ff + shared_d_ff), over ms",
        routing="per rank, seeded by seed and rank: each token's k distinct experts drawn uniformly (balanced) "
                "or without replacement from a Zipf(1.2) popularity shared by the ranks, ceil(E/8) experts never "
                "drawn (skewed); routing weights of the exchange: uniform random, each token's summing to 1",
        check="exchange: dispatch's rows (and group sizes) against the rows each rank must receive, computed from "
              "all ranks' tokens gathered; combine of the dispatched rows against x (weights sum to 1); the "
              "peers' round trip; layer: outputs and gradients finite (tests/test_parallel_moe.py checks the "
              "EP layer against one process)",
        tolerance=TOLERANCE[opts.dtype], fp8_tolerance=FP8_TOLERANCE,
        bars=BARS,
        cases={c.name: {"label": c.label, "T": c.T, "d": c.d, "k": c.k, "E": c.E}
               for c in cases} if "exchange" in opts.parts else {},
        layer_configs={c.name: {"label": c.label, "T": c.T, "d": c.d, "d_ff": c.d_ff, "E": c.E, "k": c.k,
                                "shared_d_ff": c.shared_d_ff, "routed_scaling": c.routed_scaling}
                       for c in configs} if "layer" in opts.parts else {},
    )
    return meta
