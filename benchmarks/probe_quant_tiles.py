"""The tile quantization kernel's shapes, pass by pass, on an H100.

    PYTHONPATH=src python benchmarks/probe_quant_tiles.py

1. Rowwise per group along the tokens (two passes over x: the amax, then the values) at the fwd+bwd's
   tensors: the whole call, and its amax pass alone, for each tile shape (BLOCK_R is the layout's 128).
2. 3D weights, both orientations in one call, per recipe at E = 8 and 128, for each tile shape.
GB/s of the bytes each call must move at the least (the bf16 input read once, each FP8 copy written),
next to a device copy's (bytes read + written).
"""

from __future__ import annotations

import os

os.environ.setdefault("DROPLESS_AUTOTUNE", "0")

import torch
from triton.testing import do_bench

import dropless
from dropless.bench.routing import group_sizes
from dropless.kernels import quantize as qk
from dropless.kernels.launch import cdiv, next_power_of_2
from dropless.quantized import get_recipe, grouped_rows

DEV = torch.device("cuda")
ROWWISE = get_recipe("rowwise")


def ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=60, return_mode="median")


def amax_pass(x: torch.Tensor, offsets: torch.Tensor, shape: tuple[int, int, int]) -> None:
    """The first of the rowwise per-group launches alone, as ``quantize._launch_tiles`` makes it."""
    R, C = x.shape
    E = offsets.shape[0]
    block_r, block_c, warps = shape
    slots = cdiv(R, block_r) + E
    amax = torch.zeros(E, C, dtype=torch.int32, device=x.device)
    qk._tile_kernel[(slots, cdiv(C, block_c))](
        x, x, x, x, x, amax, x, offsets, R, C, E, slots, 0, grouped_rows(R, E), 0, x.stride(0), x.stride(1),
        ALONG_R=True, ALONG_C=False, GROUPED=True, AMAX_PASS=True, BLOCK=0, TILE=False, MX=False, POW2=False,
        RCEIL=False, EMULATE_FP8=False, WIDE=False, BLOCK_R=block_r, BLOCK_C=block_c,
        E_POW2=next_power_of_2(E + 1), num_warps=warps)


def with_shape(shape, fn):
    original = qk._tile_shape
    qk._tile_shape = lambda *args: shape
    try:
        return ms(fn)
    except Exception as error:  # a shape the compiler refuses
        print(f"  {shape}: {type(error).__name__}")
        return float("nan")
    finally:
        qk._tile_shape = original


def main() -> None:
    src = torch.empty(2**30, dtype=torch.int16, device=DEV)
    dst = torch.empty_like(src)
    print(f"copy: {4 * 2**30 / ms(lambda: dst.copy_(src)) / 1e6:.0f} GB/s")
    del src, dst
    token_shapes = [(128, 32, 4), (128, 64, 4), (128, 64, 8), (128, 128, 4), (128, 128, 8), (128, 256, 8)]
    print("| tensor | " + " | ".join(f"{a}x{b}/w{w} call, amax" for a, b, w in token_shapes) + " |")
    for name, E, M, C in [("dsv3 x", 32, 32768, 2048), ("dsv3 dy", 32, 32768, 7168), ("qwen3 x", 128, 65536, 2048),
                          ("qwen3 dy", 128, 65536, 1536), ("mixtral dy", 4, 16384, 14336)]:
        offsets = torch.tensor(group_sizes(E, M, "skewed", 0, 16), device=DEV).cumsum(0).to(torch.int32)
        x = torch.randn(M, C, device=DEV, dtype=torch.bfloat16)
        once, read = 3 * M * C, 2 * M * C
        cells = []
        for shape in token_shapes:
            call = with_shape(shape, lambda: dropless.quantize(x, ROWWISE, dim=0, offsets=offsets))
            alone = ms(lambda: amax_pass(x, offsets, shape))
            cells.append(f"{once / call / 1e6:.0f}, {read / alone / 1e6:.0f}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    weight_shapes = [(64, 64, 4), (128, 64, 4), (64, 128, 4), (128, 128, 8), (128, 128, 16), (32, 128, 4)]
    print("| weights | " + " | ".join(f"{a}x{b}/w{w}" for a, b, w in weight_shapes) + " |")
    for recipe in ("rowwise", "block128x128", "mxfp8"):
        for E in (8, 128):
            w = torch.randn(E, 1536, 2048, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
            moved = 4 * w.numel()
            cells = []
            for shape in weight_shapes:
                if recipe == "block128x128" and shape[:2] != (128, 128):
                    cells.append("-")
                    continue
                t = with_shape(shape, lambda: dropless.quantize_weight(w, recipe))
                cells.append(f"{moved / t / 1e6:.0f}")
            print(f"| {recipe} E={E} | " + " | ".join(cells) + " |", flush=True)
            del w


if __name__ == "__main__":
    main()
