"""block128 (1x128 activations, 128x128 weight tiles) forward at DeepGEMM's contiguous-layout shapes,
operands already quantized, on a Hopper GPU: the warp-specialized Gluon block128 kernel (two warpgroups on
the halves of each tile) in a few launch variants, against the Triton FP8 ragged-M kernel's block128
candidates (best of them), BF16, and the rowwise Gluon kernel with its 128x256 tiles and with 128x128.
Each kernel's output is checked against the Triton kernel's first.

    PYTHONPATH=src python benchmarks/probe_block128_deepgemm.py
"""

from __future__ import annotations

import os

os.environ.setdefault("DROPLESS_AUTOTUNE", "0")

import torch
from triton.runtime.errors import OutOfResources
from triton.testing import do_bench

import dropless
from dropless.kernels import tuning
from dropless.kernels.config import GemmConfig
from dropless.kernels.launch import launch_info
from dropless.kernels.ragged_m_block128_hopper import ragged_m_block128_hopper
from dropless.kernels.ragged_m_hopper import ragged_m_mm_hopper
from dropless.ops.fp8_launch import launch_ragged_m_fp8
from dropless.quantized import get_recipe

DEV = torch.device("cuda")
# (groups, rows per group, N, K) as DeepGEMM's README lists its contiguous-layout grouped GEMMs.
SHAPES = [(4, 8192, 4096, 7168), (4, 8192, 7168, 2048), (8, 4096, 4096, 7168), (8, 4096, 7168, 2048)]
# Gluon block128 variants: (stages, activation scales stored along M: ``[cdiv(K, 128), M]`` transposed, each
# step's load contiguous).
VARIANTS = [(4, False), (5, False), (6, False), (4, True)]


def ms(fn) -> float:
    """Median ms of ``fn``; NaN where its kernel does not fit the device (a config past shared memory)."""
    try:
        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    except OutOfResources:
        return float("nan")


def main() -> None:
    programs = launch_info(DEV).num_programs
    heads = ["bf16", "rowwise 128x256", "rowwise 128x128", "block128 Triton (best)"]
    heads += [f"block128 Gluon s{stages}" + (" M-major scales" if m_major else "") for stages, m_major in VARIANTS]
    print("| groups x rows, N, K | " + " | ".join(heads) + " | max rel diff |")
    for E, rows, N, K in SHAPES:
        M = E * rows
        offsets = torch.full((E,), rows, device=DEV).cumsum(0).to(torch.int32)
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
        w = (torch.randn(E, N, K, device=DEV, dtype=torch.bfloat16) * K ** -0.5).transpose(1, 2)
        y = torch.empty(M, N, device=DEV, dtype=torch.bfloat16)
        flops = 2 * M * N * K
        cells = [flops / ms(lambda: dropless.grouped_mm(x, w, offsets)) / 1e9]
        xr = dropless.quantize(x, get_recipe("rowwise"), dim=1)
        wr, _ = dropless.quantize_weight(w, get_recipe("rowwise"))
        scales = (xr.scale.reshape(-1).contiguous(), wr.scale.reshape(E, -1).contiguous())
        for config in (GemmConfig(128, 256, 128, num_warps=8, num_stages=3, gluon=True),
                       GemmConfig(128, 128, 128, num_warps=8, num_stages=5, gluon=True)):
            cells.append(flops / ms(lambda: ragged_m_mm_hopper(xr.data, wr.data, offsets, y, config, programs,
                                                               scales)) / 1e9)
        recipe = get_recipe("block128")
        xq = dropless.quantize(x, recipe, dim=1)
        wq, _ = dropless.quantize_weight(w, recipe)
        triton_times = [ms(lambda: launch_ragged_m_fp8(xq, wq, offsets, y, config))
                        for config in tuning._RAGGED_M_FP8_STEP128.candidates]
        cells.append(flops / min(t for t in triton_times if t == t) / 1e9)
        launch_ragged_m_fp8(xq, wq, offsets, y, tuning._RAGGED_M_FP8_STEP128.candidates[0])
        want = y.float().clone()
        diff = 0.0
        for stages, m_major in VARIANTS:
            config = GemmConfig(128, 128, 128, num_warps=4, num_stages=stages, gluon=True)
            sa = xq.scale.t().contiguous().t() if m_major else xq.scale

            def gluon() -> None:
                ragged_m_block128_hopper(xq.data, sa, wq.data, wq.scale, offsets, y, programs, config)

            y.fill_(float("nan"))
            try:
                gluon()
            except OutOfResources:
                cells.append(float("nan"))
                continue
            diff = max(diff, ((y.float() - want).norm() / want.norm()).item())
            cells.append(flops / ms(gluon) / 1e9)
        print(f"| {E}x{rows}, {N}, {K} | " + " | ".join(f"{c:.0f}" for c in cells) + f" | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
