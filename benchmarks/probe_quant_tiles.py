"""The quantization kernels' launch shapes, swept on one GPU: which tile, warps and column tiles a
program walks move the most bytes.

    PYTHONPATH=src python benchmarks/probe_quant_tiles.py [--quick] [SECTION ...]

Each call timed replayed from a CUDA graph (the GPU's time alone). GB/s of the bytes each call must move at the least (the bf16 input read once, each FP8 copy written),
next to a device copy's (bytes read + written), for:
1. activations per group along the tokens (block128, mxfp8, rowwise: its two launches), and both
   orientations from one launch (``quantize_pair``), for each ``(BLOCK_R, BLOCK_C, warps)``;
2. 3D weights, both orientations in one call, at E = 8 and 128, for each tile shape (block128x128:
   each ``(CHUNK_R, warps)`` of its own kernel);
3. activations along K: the tile kernel's shapes (blockwise) and the rowwise kernel's ``(BLOCK_M, BLOCK_K,
   warps)``.
"""

from __future__ import annotations

import importlib
import os
import sys

os.environ.setdefault("DROPLESS_AUTOTUNE", "0")

import torch
import dropless
from dropless.bench.fp8 import hbm_gbps
from dropless.bench.timing import graphed_median_ms
from dropless.bench.routing import group_sizes
from dropless.kernels import quantize as qk
from dropless.kernels.launch import next_power_of_2
from dropless.ops.quantize import quantize_pair

DEV = torch.device("cuda")
QUICK = "--quick" in sys.argv
SECTIONS = {int(a) for a in sys.argv[1:] if a.isdigit()} or {1, 2, 3}


QUANTIZE = importlib.import_module("dropless.ops.quantize")


def ms(fn) -> float:
    """The GPU's time of one call, replayed from a CUDA graph (a call's host time can exceed its kernel's)."""
    return graphed_median_ms(fn, DEV, 10, 30)


def swept(attribute: str, value, fn) -> float:
    """``fn``'s time with ``qk.<attribute>`` answering ``value`` (a launch shape), or NaN where the
    compiler refuses the shape."""
    original = getattr(qk, attribute)
    setattr(qk, attribute, lambda *args: value)
    QUANTIZE._PLANS.clear()  # a call signature's plan keeps the launch shape it was made with
    try:
        return ms(fn)
    except Exception as error:
        print(f"  {value}: {type(error).__name__}: {str(error)[:80]}", flush=True)
        return float("nan")
    finally:
        setattr(qk, attribute, original)
        QUANTIZE._PLANS.clear()


def row(label: str, least_bytes: int, attribute: str, shapes, fn, copy_gbps: float) -> None:
    rates = [least_bytes / swept(attribute, shape, fn) / 1e6 for shape in shapes]
    best = max(range(len(shapes)), key=lambda i: rates[i] if rates[i] == rates[i] else -1)
    cells = " ".join(f"{r:6.0f}" for r in rates)
    print(f"{label:34s} {cells}   best {shapes[best]} {rates[best]:.0f} GB/s = {rates[best] / copy_gbps:.2f} of copy",
          flush=True)


def main() -> None:
    copy = hbm_gbps(DEV, 10, 30)
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s (bytes read + written)")

    group_shapes = [(128, 64, 4), (128, 32, 4), (128, 64, 8), (128, 128, 8)]
    tensors = [("qwen3 x", 128, 65536, 2048), ("qwen3-down x", 128, 65536, 768), ("dsv3 dy", 32, 32768, 7168),
               ("mixtral dy", 4, 16384, 14336)]
    if QUICK:
        tensors = tensors[:2]
    if 1 not in SECTIONS:
        tensors = []
    print("\n1. per group along the tokens; shapes " + " ".join(map(str, group_shapes)))
    for name, E, M, C in tensors:
        offsets = torch.tensor(group_sizes(E, M, "skewed", 0, 16), device=DEV).cumsum(0).to(torch.int32)
        x = torch.randn(M, C, device=DEV, dtype=torch.bfloat16)
        for recipe in ("block128", "mxfp8", "rowwise"):
            row(f"{name} {recipe}", 3 * M * C, "_tile_shape", group_shapes,
                lambda: dropless.quantize(x, recipe, dim=0, offsets=offsets), copy)
        for recipe in ("block128", "mxfp8", "rowwise"):
            shapes = [s for s in group_shapes if s[1] == 128 or recipe != "block128"] + [(128, 128, 16)]
            row(f"{name} pair {recipe}", 4 * M * C, "_tile_shape", shapes,
                lambda: quantize_pair(x, recipe, offsets), copy)
        del x

    weight_shapes = [(64, 128, 4), (32, 128, 4), (64, 64, 4), (32, 64, 4), (64, 128, 8)]
    tile128_shapes = [(32, 4), (16, 4), (64, 4), (32, 8), (64, 8), (128, 16)]
    print("\n2. weights, both orientations; shapes " + " ".join(map(str, weight_shapes)) +
          "; block128x128 " + " ".join(map(str, tile128_shapes)))
    for E in (8, 128) if 2 in SECTIONS else ():
        w = torch.randn(E, 1536, 2048, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
        for recipe in ("mxfp8", "rowwise"):
            row(f"E={E} {recipe}", 4 * w.numel(), "_tile_shape", weight_shapes,
                lambda: dropless.quantize_weight(w, recipe), copy)
        row(f"E={E} block128x128", 4 * w.numel(), "_tile128_shape", tile128_shapes,
            lambda: dropless.quantize_weight(w, "block128x128"), copy)
        del w

    along_k_shapes = [(64, 128, 8), (64, 128, 4), (32, 128, 4), (32, 256, 8), (32, 256, 4), (16, 512, 8),
                      (16, 512, 4), (8, 1024, 8), (8, 1024, 4), (128, 128, 8), (64, 256, 8)]
    print("\n3. along K; tile shapes " + " ".join(map(str, along_k_shapes)))
    for name, M, K in [("qwen3-down x", 65536, 768), ("gptoss x", 32768, 2880), ("qwen3 x", 65536, 2048),
                       ("dsv3 dy", 32768, 7168), ("mixtral x", 16384, 4096), ("mixtral h", 16384, 14336)
                       ] if 3 in SECTIONS else []:
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
        for recipe in ("block128", "mxfp8"):
            row(f"{name} {recipe}", 3 * M * K, "_tile_shape", along_k_shapes,
                lambda: dropless.quantize(x, recipe, dim=1), copy)
        shapes = [(max(2048 // b, 1), b, 4) for b in (min(next_power_of_2(K), 8192), 1024, 256)] + \
            [(max(8192 // b, 1), b, 8) for b in (min(next_power_of_2(K), 8192), 1024, 256)]
        row(f"{name} rowwise", 3 * M * K, "_rowwise_shape", shapes, lambda: dropless.quantize(x, "rowwise", dim=1), copy)
        del x


if __name__ == "__main__":
    main()
