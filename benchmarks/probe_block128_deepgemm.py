"""block128 (1x128 activations, 128x128 weight tiles) forward at DeepGEMM's contiguous-layout shapes,
operands already quantized, on an H100: the Triton FP8 ragged-M kernel's candidates, against BF16 and
the rowwise Gluon kernel on the same shapes.

    PYTHONPATH=src python benchmarks/probe_block128_deepgemm.py
"""

from __future__ import annotations

import os

os.environ.setdefault("DROPLESS_AUTOTUNE", "0")

import torch
from triton.testing import do_bench

import dropless
from dropless.kernels import tuning
from dropless.ops.fp8_launch import launch_ragged_m_fp8
from dropless.quantized import get_recipe

DEV = torch.device("cuda")
# (groups, rows per group, N, K) as DeepGEMM's README lists its contiguous-layout grouped GEMMs.
SHAPES = [(4, 8192, 4096, 7168), (4, 8192, 7168, 2048), (8, 4096, 4096, 7168), (8, 4096, 7168, 2048)]


def ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def main() -> None:
    configs = tuning._RAGGED_M_FP8_STEP128.candidates
    print("| groups x rows, N, K | bf16 | rowwise (Gluon) | " + " | ".join(f"block128 {c}" for c in configs) + " |")
    for E, rows, N, K in SHAPES:
        M = E * rows
        offsets = torch.full((E,), rows, device=DEV).cumsum(0).to(torch.int32)
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
        w = (torch.randn(E, N, K, device=DEV, dtype=torch.bfloat16) * K ** -0.5).transpose(1, 2)
        y = torch.empty(M, N, device=DEV, dtype=torch.bfloat16)
        flops = 2 * M * N * K
        cells = [flops / ms(lambda: dropless.grouped_mm(x, w, offsets)) / 1e9]
        for name in ("rowwise", "block128"):
            recipe = get_recipe(name)
            xq = dropless.quantize(x, recipe, dim=1)
            wk, _ = dropless.quantize_weight(w, recipe)
            if name == "rowwise":
                cells.append(flops / ms(lambda: launch_ragged_m_fp8(xq, wk, offsets, y)) / 1e9)
                continue
            for config in configs:
                cells.append(flops / ms(lambda: launch_ragged_m_fp8(xq, wk, offsets, y, config)) / 1e9)
        print(f"| {E}x{rows}, {N}, {K} | " + " | ".join(f"{c:.0f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
