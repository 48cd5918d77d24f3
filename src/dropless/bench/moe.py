"""The whole MoE layer benchmark: forward+backward of each method on the same weights and tokens.

For each layer config one ``Weights`` (router, experts, shared experts, ``x``, ``dy``) is drawn and
every method is built from it, one at a time (a method's copy of the weights is freed before the next
is built: Mixtral-8x7B's experts are 2.8 GB per bf16 copy). Each method runs once and its output,
input gradient and all weight gradients (router, experts, shared experts) are checked against an
fp32 reference; only if it passes is it timed (the dense ceiling is not checked). Timing runs
``opts.rounds`` rounds over all methods of the config, each round in its own shuffled order (each
round builds the method afresh), and keeps each method's median and per-round times, so a drift of
the machine's clocks, or a hot predecessor, falls on every method alike. A method that raises
(including running out of memory, or a block this transformers lacks) gets a row with its error, and
the run goes on.

The timed step is ``y = layer(x)`` then ``torch.autograd.grad(y, [x, *params], dy)``: forward and the
full backward, weight gradients written fresh each time (nothing accumulates into ``.grad``).

FP8 methods (``dropless_<recipe>``: ``dropless.MoE(recipe=...)``, asked for with ``fp8``) are checked
against the same reference with the FP8 benchmark's tolerance. Their weights do not change between
steps, so every timed step reuses the weights' FP8 copies, as the micro-batches of a training step do;
the copies' size is the row's ``weight_cache_gib``, beside ``peak_gib`` (which, as for every method,
counts what one step allocates).

Memory, measured on one step after the check: ``peak_gib`` is the step's peak above what was allocated
just before it; ``layer_gib``, the layer's own memory, is the peak above what the weights and inputs
hold (everything allocated before the method was built, plus the layer's parameters and buffers), so
it also counts what a layer keeps between steps beyond its weights (FP8 weight copies, workspaces).
Weight gradients are made fresh in every step (``autograd.grad``, as after ``zero_grad(set_to_none=True)``,
PyTorch's default), so every method's peaks count them alike: ``grad_gib`` says how much they are, and
``layer_gib - grad_gib`` is what the layer itself adds: the activations it saves for the backward and
its workspace.
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dropless.bench.check import TOLERANCE, rel_err
from dropless.bench.environment import describe
from dropless.bench.fp8 import FP8_TOLERANCE
from dropless.bench.gemm import _describe_error
from dropless.bench.options import RunOptions
from dropless.bench.moe_layers import (Built, LayerConfig, Weights, build_dropless, build_hf, build_torch_grouped_mm,
                                       make_weights, reference, select_configs)
from dropless.bench.timing import median_ms, round_order
from dropless.kernels.tuning import tuned_configs
from dropless.quantized import GEMM_RECIPES

__all__ = ["METHODS", "MoEOptions", "run_moe"]


class Dense:
    """The ceiling: ``y = x @ w``, ``dx = dy @ w^T``, ``dw = x^T @ dy`` with torch.mm on
    ``LayerConfig.dense_shape``, the same FLOPs as the layer's expert GEMMs."""

    def __init__(self, cfg: LayerConfig, w: Weights) -> None:
        M, K, N = cfg.dense_shape
        gen = torch.Generator(device=w.x.device).manual_seed(1)
        factory = {"generator": gen, "device": w.x.device, "dtype": w.x.dtype}
        self.x = torch.randn(M, K, **factory)
        self.w = torch.randn(K, N, **factory).mul_(K ** -0.5)
        self.dy = torch.randn(M, N, **factory)
        self.flops = 6 * M * K * N

    def step(self) -> tuple[torch.Tensor, ...]:
        return torch.mm(self.x, self.w), torch.mm(self.dy, self.w.t()), torch.mm(self.x.t(), self.dy)


Builder = Callable[[LayerConfig, Weights], "Built | Dense"]
METHODS: dict[str, Builder] = {
    "dense": Dense,
    "dropless": build_dropless,
    "dropless_recompute": lambda cfg, w: build_dropless(cfg, w, recompute_activation=True),
    "dropless_recompute_all": lambda cfg, w: build_dropless(cfg, w, recompute_activation=True, recompute_permute=True),
    "torch_grouped_mm": build_torch_grouped_mm,
    "hf_grouped_mm": lambda cfg, w: build_hf(cfg, w, "grouped_mm"),
    "hf_eager": lambda cfg, w: build_hf(cfg, w, "eager"),
    "hf_dropless": lambda cfg, w: build_hf(cfg, w, "dropless"),
}
BF16_METHODS = tuple(METHODS)
METHODS |= {f"dropless_{recipe}": (lambda cfg, w, recipe=recipe: build_dropless(cfg, w, recipe))
            for recipe in GEMM_RECIPES}
# The results checked against the fp32 reference: output, input gradient, every weight gradient.
CHECKED = ("y", "dx", "router", "gate_up", "down", "shared_gate_up", "shared_down")


@dataclass
class MoEOptions(RunOptions):
    """Which layer configs and methods to run, and how (see ``RunOptions``)."""

    configs: Sequence[str] | None = None
    methods: Sequence[str] = BF16_METHODS
    dtype: torch.dtype | None = None  # default: bf16 on a GPU, fp32 on the CPU
    fp8: Sequence[str] = ()  # recipes whose dropless FP8 method runs besides ``methods``

    def __post_init__(self) -> None:
        if self.dtype is None:
            self.dtype = self.default_dtype()
        unknown = [r for r in self.fp8 if r not in GEMM_RECIPES]
        if unknown:
            raise ValueError(f"unknown FP8 recipe(s) {unknown}; choose from {list(GEMM_RECIPES)}")
        extra = [f"dropless_{r}" for r in self.fp8 if f"dropless_{r}" not in self.methods]
        self.methods = (*self.methods, *extra)


def run_moe(opts: MoEOptions, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> dict:
    """Run the benchmark; return ``{"meta": {...}, "rows": [...]}``, one row per (config, method)."""
    configs = select_configs(opts.configs, opts.quick)
    unknown = [m for m in opts.methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {list(METHODS)}")
    meta = {"benchmark": "moe", **describe(opts.device, opts.dtype, opts.commit)}
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        meta["transformers"] = None
    meta.update(
        warmup_ms=opts.warmup, rep_ms=opts.rep, rounds=opts.rounds, seed=opts.seed, quick=opts.quick,
        step="y = layer(x); torch.autograd.grad(y, [x, *params], dy): forward and full backward",
        flops="3 * T * k * 6 * d * d_ff (expert GEMMs: gate+up and down, fwd + dgrad + wgrad) "
              "+ 3 * T * 6 * d * shared_d_ff (shared experts); the router GEMM is not counted",
        dense="torch.mm fwd+bwd (y = x @ w, dx = dy @ w^T, dw = x^T @ dy) of [M, d] @ [d, 3*d_ff], "
              "M = T*k + T*shared_d_ff/d_ff: the layer's useful FLOPs as one dense GEMM, timed in the "
              "same rounds; fraction_of_dense = tflops / that GEMM's tflops",
        dense_shapes={c.name: list(c.dense_shape) for c in configs},
        peak_gib="torch.cuda.max_memory_allocated() during one step minus memory_allocated() before it "
                 "(peak stats reset first; weights, x and dy not counted, weight gradients counted); "
                 "null on the CPU",
        layer_gib="the layer's own memory: torch.cuda.max_memory_allocated() during the same step minus what "
                  "the weights and inputs hold (memory_allocated() before the method was built, plus the bytes "
                  "of its parameters and buffers): activations saved for the backward, workspace, the "
                  "gradients the step makes, and whatever the layer keeps between steps beyond its weights "
                  "(FP8 weight copies included); no gradient buffers are kept between steps "
                  "(autograd.grad, as after zero_grad(set_to_none=True)); null on the CPU",
        grad_gib="GiB of the gradients one step returns (dx and every weight gradient), counted in peak_gib "
                 "and layer_gib alike for every method",
        max_rel_err="||out - ref||_F / ||ref||_F against an fp32 reference layer (host loop over experts), "
                    f"largest over {list(CHECKED)} (weight gradients in the layouts of dropless.MoE); "
                    "rel_errs has each",
        tolerance=TOLERANCE[opts.dtype], fp8_tolerance=FP8_TOLERANCE,
        weight_cache_gib="FP8 methods: GiB of the experts' cached FP8 weight copies (both orientations, with "
                         "scales), held between steps and made again only when the weights change",
        routing="random router weights, softmax in fp32 in every method from the same bf16 weights and "
                "input, so every method picks the same experts",
        hf_router="transformers' Mixtral and Qwen3-MoE routers run on fp32 inputs and weights (wrapped; "
                  "transformers computes their logits in the model dtype), giving their top-k weights "
                  "back in the dtype transformers does (Mixtral fp32, Qwen3-MoE the model's); "
                  "DeepSeek-V2's router is transformers' own (fp32 already)",
        configs={c.name: {"label": c.label, "T": c.T, "E": c.E, "k": c.k, "d": c.d, "d_ff": c.d_ff,
                          "shared_d_ff": c.shared_d_ff, "renormalize": c.renormalize} for c in configs},
    )
    rows = []
    started = time.perf_counter()
    for cfg in configs:
        tic = time.perf_counter()
        rows += _run_config(cfg, opts, log)
        log(f"{cfg.name}: {time.perf_counter() - tic:.1f} s")
    dense = {r["config"]: r["tflops"] for r in rows if r["method"] == "dense"}
    for r in rows:
        if r["tflops"] is not None and dense.get(r["config"]):
            r["fraction_of_dense"] = r["tflops"] / dense[r["config"]]
    meta["tuned_configs"] = tuned_configs()
    meta["seconds"] = round(time.perf_counter() - started, 1)
    return {"meta": meta, "rows": rows}


def _run_config(cfg: LayerConfig, opts: MoEOptions, log: Callable[[str], None]) -> list[dict]:
    """All rows of one config: shared weights, the fp32 reference, then rounds of build-check-time."""
    base = {"config": cfg.name, "T": cfg.T, "E": cfg.E, "k": cfg.k, "d": cfg.d, "d_ff": cfg.d_ff,
            "shared_d_ff": cfg.shared_d_ff}
    rows = {m: {**base, "method": m, "ms": None, "ms_rounds": None, "tflops": None, "fraction_of_dense": None,
                "peak_gib": None, "layer_gib": None, "grad_gib": None, "weight_cache_gib": None,
                "max_rel_err": None, "rel_errs": None,
                "failed": False, "error": None}
            for m in opts.methods}
    samples: dict[str, list[float]] = {m: [] for m in opts.methods}
    weights = make_weights(cfg, opts.dtype, opts.device, opts.seed)
    ref = reference(cfg, weights)
    _release(opts.device)
    x = weights.x.detach().requires_grad_()
    for round_ in range(opts.rounds):
        for method in round_order(opts.methods, round_, opts.seed):
            row = rows[method]
            if row["failed"]:
                continue
            built = None
            try:
                held = _allocated(opts.device)  # the weights and inputs every method shares
                built = METHODS[method](cfg, weights)
                step = _step(built, x, weights.dy)
                if round_ == 0:
                    if not _check(step, built, ref, opts, row):
                        log(f"{cfg.name} {method}: failed the check ({row['error'] or row['max_rel_err']})")
                        continue
                    row["peak_gib"], row["layer_gib"] = _memory_gib(step, opts.device, held, built)
                    row["grad_gib"] = _gib(sum(t.numel() * t.element_size() for t in _grad_inputs(built, x)))
                    row["weight_cache_gib"] = _weight_cache_gib(built)
                samples[method].append(median_ms(step, opts.device, opts.warmup, opts.rep))
            except Exception as exc:  # recorded as the row's error; the benchmark goes on
                row["failed"] = True
                row["error"] = _describe_error(exc)
                log(f"{cfg.name} {method}: {row['error']}")
            finally:
                del built
                step = None
                _release(opts.device)
    flops = {m: cfg.useful_flops for m in opts.methods}
    if "dense" in rows:
        M, K, N = cfg.dense_shape
        flops["dense"] = 6 * M * K * N
    for method, row in rows.items():
        if not row["failed"] and samples[method]:
            row["ms"] = statistics.median(samples[method])
            row["ms_rounds"] = samples[method]
            row["tflops"] = flops[method] / row["ms"] / 1e9
    del weights, ref, x
    _release(opts.device)
    return list(rows.values())


def _step(built: Built | Dense, x: torch.Tensor, dy: torch.Tensor) -> Callable[[], tuple]:
    """The timed work: forward and backward, returning ``(y, dx, *weight grads)``."""
    if isinstance(built, Dense):
        return built.step
    inputs = [x, *built.leaves]

    def step() -> tuple:
        y = built.forward(x)
        # autograd.grad, not backward: nothing accumulates into .grad between repetitions.
        return (y, *torch.autograd.grad(y, inputs, dy, allow_unused=True))

    return step


def _check(step: Callable[[], tuple], built: Built | Dense, ref: dict[str, torch.Tensor], opts: MoEOptions,
           row: dict) -> bool:
    """Run ``step`` once against the reference; sets ``max_rel_err``, ``rel_errs`` and, if off by more
    than the tolerance (NaN included) or missing a gradient, ``failed``. The dense GEMM is not checked."""
    if isinstance(built, Dense):
        return True
    y, dx, *grads = step()
    missing = [i for i, g in enumerate(grads) if g is None]
    if dx is None or missing:
        row["failed"] = True
        row["error"] = "no gradient for x" if dx is None else f"no gradient for parameters {missing}"
        return False
    results = {"y": y, "dx": dx, **built.canonical(grads)}
    errs = {name: rel_err(out, ref[name]) for name, out in results.items()}
    del y, dx, grads, results
    row["rel_errs"] = {n: (e if math.isfinite(e) else None) for n, e in errs.items()}
    checked = [errs[n] for n in CHECKED if n in errs]
    err = math.nan if any(math.isnan(e) for e in checked) else max(checked)
    row["max_rel_err"] = err if math.isfinite(err) else None
    if not err <= (FP8_TOLERANCE if row["method"].startswith("dropless_") else TOLERANCE[opts.dtype]):
        row["failed"] = True
        row["error"] = None if math.isfinite(err) else "non-finite result"
        return False
    return True


def _allocated(device: torch.device) -> int | None:
    """Bytes allocated on ``device`` now, once its queued work is done; None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _memory_gib(step: Callable[[], tuple], device: torch.device, held: int | None,
                built: Built | Dense) -> tuple[float | None, float | None]:
    """``(peak_gib, layer_gib)`` of one step: GiB allocated at its peak above what was allocated just
    before it, and above ``held`` (allocated before ``built`` was made) plus ``built``'s weights;
    None off CUDA."""
    if device.type != "cuda" or held is None:
        return None, None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    out = step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del out
    return _gib(peak - before), _gib(peak - held - _storage_bytes(_weights(built)))


def _weights(built: Built | Dense) -> list[torch.Tensor]:
    """What a method holds as its weights: the layer's parameters and buffers; the dense ceiling's
    operands (its x, w and dy, made when it was built)."""
    if isinstance(built, Dense):
        return [built.x, built.w, built.dy]
    return [*built.module.parameters(), *built.module.buffers()]


def _grad_inputs(built: Built | Dense, x: torch.Tensor) -> list[torch.Tensor]:
    """The tensors one step returns a gradient of, each in its own size and dtype."""
    return [built.x, built.w] if isinstance(built, Dense) else [x, *built.leaves]


def _storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the storages under ``tensors``, each storage counted once."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _gib(nbytes: int) -> float:
    return nbytes / 2**30


def _weight_cache_gib(built: Built | Dense) -> float | None:
    """GiB of the FP8 weight copies the layer's GroupedLinears hold; None where it holds none."""
    if isinstance(built, Dense):
        return None
    total = 0
    for module in built.module.modules():
        pair = getattr(getattr(module, "weight_cache", None), "_pair", None)
        for q in pair or ():
            total += q.data.untyped_storage().nbytes() + q.scale.untyped_storage().nbytes()
    return total / 2**30 if total else None


def _release(device: torch.device) -> None:
    """Free what the last method held (its weights, gradients and cached blocks) before the next.

    A full collection (in case a reference cycle holds a layer) takes ~0.2 s with transformers
    imported: on the GPU only, where the memory matters."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
