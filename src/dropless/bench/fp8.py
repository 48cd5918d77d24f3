"""The FP8 grouped GEMM benchmark: dropless BF16 and FP8 (per recipe, weights quantized in the call or
cached), torchao's FP8 rowwise, ``torch._scaled_grouped_mm`` and a dense ``torch._scaled_mm`` ceiling,
every pass, on the GEMM benchmark's shapes and inputs (group sizes multiples of 16, which torchao and
``_scaled_grouped_mm`` need).

Each FP8 row also gets a roofline: its FLOPs at the dense-FP8 rate measured in the same run, plus the
bytes its quantization must move (bf16 read, FP8 and scales written, per pass) at the HBM bandwidth
measured in the same run (a device-to-device copy, bytes read + written).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

import dropless
from dropless.bench.fp8_peers import FP8_METHODS
from dropless.bench.gemm import GemmOptions, run_gemm
from dropless.bench.report import index_rows
from dropless.bench.routing import group_sizes
from dropless.bench.shapes import select_shapes
from dropless.bench.timing import graphed_median_ms, median_ms
from dropless.quantized import GEMM_RECIPES, get_recipe, operand_recipes

FP8_TOLERANCE = 0.1  # relative Frobenius error (SQNR 20 dB); e4m3 with good scales gives ~0.035 (29 dB)
ALIGN = 16
# Expert weights of the quantization rows: E experts of [K, N] = Qwen3-30B-A3B's gate+up projection, in
# nn.Linear storage; E as many as DeepSeek-V3 has in all.
WEIGHT_EXPERTS = (8, 32, 128, 256)
WEIGHT_SHAPE = (2048, 1536)
QUICK_WEIGHT_EXPERTS = (2, 4)
QUICK_WEIGHT_SHAPE = (64, 96)
# Bytes per element of an FP8 copy's scales: one fp32 per row (about nothing), per 128, or one byte per 32.
_SCALE_BYTES = {"rowwise": 0.0, "block128": 4 / 128, "mxfp8": 1 / 32}


@dataclass
class Fp8Options(GemmOptions):
    """The GEMM benchmark's options with the FP8 methods (see ``FP8_METHODS``). ``quantization``: which
    quantization rows to time: ``all``, ``activations`` (of the shapes run; for runs split by shape,
    all but one of which leave the weights out) or ``none``."""

    quantization: str = "all"

    def __post_init__(self) -> None:
        self.registry = dict(FP8_METHODS)
        self.tolerance = FP8_TOLERANCE
        self.align = ALIGN


def method_recipe(method: str) -> tuple[str, str | None]:
    """``(recipe, weights)`` of a method: ``bf16`` and None for BF16 ones; ``cached`` or ``in_call``."""
    if method.startswith("dropless_"):
        name = method.removeprefix("dropless_")
        return name.removesuffix("_cached"), "cached" if name.endswith("_cached") else "in_call"
    if method in ("torchao_rowwise", "torch_scaled_grouped_mm"):
        return "rowwise", "in_call"
    if method == "dense_fp8":
        return "rowwise", "cached"
    return "bf16", None


def quantization_bytes(E: int, M: int, K: int, N: int, pass_: str, recipe: str, weights: str) -> float:
    """Bytes the quantization of one pass must move at the least: each bf16 operand read once per
    orientation it is quantized in (twice for a rowwise weight: its amax, then its values) and each FP8
    copy and its scales written; a cached weight costs nothing."""
    out = 1 + _SCALE_BYTES[recipe]
    act = 2 + out  # one orientation of an activation: read bf16, write FP8
    weight = 0.0 if weights == "cached" else E * K * N * ((4 if recipe == "rowwise" else 2) + 2 * out)
    return {"fwd": act * M * K + weight, "dgrad": act * M * N + weight, "wgrad": act * (M * K + M * N),
            "fwd+bwd": 2 * act * (M * K + M * N) + weight}[pass_]


def hbm_gbps(device: torch.device, warmup: float, rep: float) -> float | None:
    """Bandwidth of a 2 GiB device-to-device copy, bytes read + written per second, in GB/s."""
    if device.type != "cuda":
        return None
    src = torch.empty(2**30, dtype=torch.int16, device=device).random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, warmup, rep)
    return 2 * src.numel() * src.element_size() / ms / 1e6


def run_fp8(opts: Fp8Options, log: Callable[[str], None] | None = None) -> dict:
    """Run the benchmark; the GEMM benchmark's result with the FP8 keys added to every row,
    ``hbm_gbps`` to the meta, and the quantization kernels' rows as ``quantization``."""
    result = run_gemm(opts) if log is None else run_gemm(opts, log)
    bandwidth = hbm_gbps(opts.device, opts.warmup, opts.rep)
    result["meta"]["hbm_gbps"] = bandwidth
    result["meta"]["fp8_tolerance"] = FP8_TOLERANCE
    add_fp8_keys(result["rows"], bandwidth)
    result["quantization"] = quantization_rows(opts, bandwidth)
    result["meta"]["quantization_timing"] = "graph" if opts.device.type == "cuda" else "host"
    return result


def _quantization_row(opts: Fp8Options, bandwidth: float | None, run: Callable[[], object], elements: int,
                      copies: int, recipe: str, **keys: object) -> dict:
    """One timed quantization: its least bytes (the bf16 input read once, ``copies`` FP8 copies and their
    scales written) over its kernels' median time (replayed from a CUDA graph: a small call's host time,
    which the fwd+bwd rows count, would hide its kernels' bandwidth), and that over the measured bandwidth."""
    ms = graphed_median_ms(run, opts.device, opts.warmup, opts.rep)
    scale_bytes = _SCALE_BYTES["block128" if recipe == "block128x128" else recipe]
    moved = elements * (2 + copies * (1 + scale_bytes))
    gbps = moved / ms / 1e6
    return {**keys, "recipe": recipe, "ms": ms, "bytes": moved, "gbps": gbps,
            "ratio_to_hbm": gbps / bandwidth if bandwidth else None}


def quantization_rows(opts: Fp8Options, bandwidth: float | None) -> list[dict]:
    """The quantization kernels on their own: 3D expert weights (both orientations in one call) for each
    weight recipe at every E of ``WEIGHT_EXPERTS``, and each shape's activations along K and, per
    group, along the tokens, for each activation recipe and routing."""
    rows: list[dict] = []
    if opts.quantization == "none":
        return rows
    K, N = QUICK_WEIGHT_SHAPE if opts.quick else WEIGHT_SHAPE
    for name in GEMM_RECIPES if opts.quantization == "all" else ():
        recipe = operand_recipes(get_recipe(name))[1]
        for E in QUICK_WEIGHT_EXPERTS if opts.quick else WEIGHT_EXPERTS:
            w = torch.randn(E, N, K, device=opts.device, dtype=opts.dtype).transpose(1, 2)
            rows.append(_quantization_row(opts, bandwidth, lambda w=w: dropless.quantize_weight(w, recipe), w.numel(),
                                          2, recipe.name, operand="weight", E=E, K=K, N=N))
            del w
    for shape in select_shapes(opts.shapes, opts.quick):
        x = torch.randn(shape.M, shape.K, device=opts.device, dtype=opts.dtype)
        for routing in opts.routings or shape.routings:
            sizes = group_sizes(shape.E, shape.M, routing, opts.seed, opts.align)
            offsets = torch.tensor(sizes, device=opts.device).cumsum(0).to(torch.int32)
            for name in GEMM_RECIPES:
                keys = dict(operand="activation", shape=shape.name, E=shape.E, M=shape.M, K=shape.K, routing=routing)
                along_k = functools.partial(dropless.quantize, x, name, dim=1)
                per_group = functools.partial(dropless.quantize, x, name, dim=0, offsets=offsets)
                rows.append(_quantization_row(opts, bandwidth, along_k, x.numel(), 1, name, dim=1, **keys))
                rows.append(_quantization_row(opts, bandwidth, per_group, x.numel(), 1, name, dim=0, **keys))
        del x
    return rows


def format_quantization_table(result: dict) -> str:
    """Per recipe: the weights' GB/s (share of the bandwidth) at each E and the spread of time per byte
    over E; then the activations' range of GB/s along K and along the tokens."""
    rows = result.get("quantization", [])
    # Results from before the key timed each call from Python, host time included.
    timing = {"graph": "the kernels replayed from a CUDA graph", "host": "a host clock"}.get(
        result.get("meta", {}).get("quantization_timing"), "each call from Python")
    lines = [f"Quantization ({timing}), GB/s (share of HBM); weights: both orientations in one call",
             "| recipe | weights by E | time/byte max/min over E | activations along K | along tokens |",
             "|---|---|---|---|---|"]
    for recipe in dict.fromkeys(r["recipe"] for r in rows if r["operand"] == "weight"):
        weights = [r for r in rows if r["operand"] == "weight" and r["recipe"] == recipe]
        acts = [r for r in rows if r["operand"] == "activation" and r["recipe"] == recipe.replace("block128x128",
                                                                                               "block128")]
        per_byte = [r["ms"] / r["bytes"] for r in weights]
        cells = ", ".join(f"{r['E']}: {r['gbps']:.0f}" + (f" ({r['ratio_to_hbm']:.2f})" if r["ratio_to_hbm"] else "")
                          for r in weights)
        along = {dim: [r["gbps"] for r in acts if r["dim"] == dim] for dim in (1, 0)}
        spans = [f"{min(v):.0f}-{max(v):.0f}" if v else "-" for v in along.values()]
        lines.append(f"| {recipe} | {cells} | {max(per_byte) / min(per_byte):.2f} | {spans[0]} | {spans[1]} |")
    return "\n".join(lines)


def add_fp8_keys(rows: list[dict], bandwidth: float | None) -> None:
    """``recipe``, ``weights``, ``ratio_to_bf16`` (over dropless BF16, same row), ``sqnr_db`` (from
    ``max_rel_err``) and ``roofline_tflops`` (FP8 rows, where the dense FP8 ceiling and the bandwidth
    were measured)."""
    at = index_rows(rows)
    for r in rows:
        recipe, weights = method_recipe(r["method"])
        r["recipe"], r["weights"] = recipe, weights
        bf16 = at.get((r["shape"], r["routing"], r["pass"], "dropless"))
        r["ratio_to_bf16"] = (r["tflops"] / bf16["tflops"] if r["tflops"] is not None and bf16
                              and bf16["tflops"] else None)
        err = r["max_rel_err"]
        r["sqnr_db"] = -20 * math.log10(err) if err else None
        dense_fp8 = at.get((r["shape"], r["routing"], r["pass"], "dense_fp8"))
        r["roofline_tflops"] = None
        if recipe != "bf16" and dense_fp8 and dense_fp8["tflops"] and bandwidth:
            flops = (6 if r["pass"] == "fwd+bwd" else 2) * r["M"] * r["K"] * r["N"]
            seconds = flops / (dense_fp8["tflops"] * 1e12) + quantization_bytes(
                r["E"], r["M"], r["K"], r["N"], r["pass"], recipe, weights) / (bandwidth * 1e9)
            r["roofline_tflops"] = flops / seconds / 1e12


def format_fp8_table(result: dict) -> str:
    """The stdout table: per shape, routing and pass, each method's TFLOP/s with its ratio to dropless
    BF16, and each FP8 dropless method's share of its roofline."""
    rows = result["rows"]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    bandwidth = result["meta"].get("hbm_gbps") or 0
    lines = [f"FP8 grouped GEMM, TFLOP/s (x dropless BF16) [of roofline]; HBM {bandwidth:.0f} GB/s",
             "| shape | routing | pass | " + " | ".join(methods) + " |",
             "|" + "---|" * (3 + len(methods))]
    at = index_rows(rows)
    keys = list(dict.fromkeys((r["shape"], r["routing"], r["pass"]) for r in rows))
    for shape, routing, pass_ in keys:
        cells = []
        for m in methods:
            r = at.get((shape, routing, pass_, m))
            if r is None or r["tflops"] is None:
                cells.append("-" if r is None else ("ERR" if r["error"] else "FAIL"))
                continue
            cell = f"{r['tflops']:.0f}" if r["tflops"] >= 10 else f"{r['tflops']:.3g}"
            if r["ratio_to_bf16"] is not None and m != "dropless":
                cell += f" ({r['ratio_to_bf16']:.2f}x)"
            if r["roofline_tflops"] and m.startswith("dropless_"):
                cell += f" [{r['tflops'] / r['roofline_tflops']:.2f}]"
            cells.append(cell)
        lines.append(f"| {shape} | {routing} | {pass_} | " + " | ".join(cells) + " |")
    return "\n".join(lines)

