"""Where the FP8 rowwise fwd+bwd (weights cached) spends its time, part by part, against BF16.

    PYTHONPATH=src python benchmarks/probe_fp8_parts.py
"""

from __future__ import annotations

import os

os.environ.setdefault("DROPLESS_AUTOTUNE", "0")

import torch
from triton.testing import do_bench

import dropless
from dropless.bench.routing import group_sizes
from dropless.ops.grouped_mm_fp8 import quantized_mm, quantized_wgrad, swap_weight
from dropless.quantized import get_recipe

SHAPES = [("dsv3-down", 32, 32768, 2048, 7168), ("qwen3-up", 128, 65536, 2048, 1536)]


def ms(fn) -> float:
    return do_bench(fn, warmup=50, rep=100, return_mode="median")


def main() -> None:
    dev = torch.device("cuda")
    r = get_recipe("rowwise")
    print("| shape | q x along K | q x tokens | q dy along N | q dy tokens | fwd | dgrad | wgrad fp8 | bf16 fwd | "
          "bf16 dgrad | bf16 wgrad |")
    for name, E, M, K, N in SHAPES:
        sizes = group_sizes(E, M, "skewed", 0, 16)
        offsets = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        w = (torch.randn(E, K, N, device=dev, dtype=torch.bfloat16) * K ** -0.5).transpose(1, 2).contiguous().transpose(1, 2)
        wk, wn = dropless.quantize_weight(w, "rowwise")
        xq, xt = dropless.quantize(x, r, dim=1), dropless.quantize(x, r, dim=0, offsets=offsets)
        dyq, dyt = dropless.quantize(dy, r, dim=1), dropless.quantize(dy, r, dim=0, offsets=offsets)
        parts = [ms(lambda: dropless.quantize(x, r, dim=1)), ms(lambda: dropless.quantize(x, r, dim=0, offsets=offsets)),
                 ms(lambda: dropless.quantize(dy, r, dim=1)),
                 ms(lambda: dropless.quantize(dy, r, dim=0, offsets=offsets)),
                 ms(lambda: quantized_mm(xq, wk, offsets, r, torch.bfloat16)),
                 ms(lambda: quantized_mm(dyq, swap_weight(wn), offsets, r, torch.bfloat16)),
                 ms(lambda: quantized_wgrad(xt, dyt, offsets, r, None, None, False, torch.bfloat16, True)),
                 ms(lambda: dropless.grouped_mm(x, w, offsets)),
                 ms(lambda: dropless.grouped_mm(dy, w.transpose(1, 2), offsets)),
                 ms(lambda: dropless.grouped_mm_wgrad(x, dy, offsets))]
        print(f"| {name} | " + " | ".join(f"{p:.3f}" for p in parts) + " |")


if __name__ == "__main__":
    main()
