"""Candidate tile configurations of the grouped GEMM kernels, and the config each call runs with."""

from __future__ import annotations

import torch

from dropless.kernels.autotune import Autotuner, problem_class
from dropless.kernels.config import GemmConfig
from dropless.kernels.launch import launch_info
from dropless.kernels.ragged_k import ragged_k_mm
from dropless.kernels.ragged_m import ragged_m_mm

# Output tile BLOCK_M x BLOCK_N, reduction step BLOCK_K. Measured winners on an H100 (benchmarks/NOTES.md):
# flattened 128x256 tiles for short K, warp-specialized ones with TMA stores for long K, two 128x128
# programs per SM for some transposed layouts; the small tiles are what fits fp32 operands.
_RAGGED_M = Autotuner(
    "ragged_m",
    candidates=[
        GemmConfig(128, 256, 64, num_warps=8, num_stages=4, flatten=True),
        GemmConfig(128, 256, 64, num_warps=8, num_stages=3, flatten=True),
        GemmConfig(128, 256, 64, num_warps=8, num_stages=3, warp_specialize=True, tma_store=True),
        GemmConfig(128, 256, 64, num_warps=8, num_stages=3, warp_specialize=True),
        GemmConfig(128, 128, 64, num_warps=4, num_stages=3, flatten=True, programs_per_sm=2),
        GemmConfig(64, 256, 64, num_warps=4, num_stages=4, flatten=True),
        GemmConfig(64, 128, 32, num_warps=4, num_stages=3),
    ],
    default=GemmConfig(128, 256, 64, num_warps=8, num_stages=4, flatten=True),
    small_default=GemmConfig(64, 128, 32, num_warps=4, num_stages=3),
    interpreter_config=GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1),
)

# Output tile BLOCK_K x BLOCK_N of dw[e], reduction step BLOCK_M rows.
_RAGGED_K = Autotuner(
    "ragged_k",
    candidates=[
        GemmConfig(64, 256, 128, num_warps=8, num_stages=4, flatten=True),
        GemmConfig(64, 256, 128, num_warps=8, num_stages=4),
        GemmConfig(64, 256, 128, num_warps=8, num_stages=3, warp_specialize=True, tma_store=True),
        GemmConfig(64, 256, 128, num_warps=8, num_stages=3, by_work=True, tma_store=True),
        GemmConfig(64, 128, 128, num_warps=4, num_stages=3, programs_per_sm=2),
        GemmConfig(64, 128, 128, num_warps=8, num_stages=3, flatten=True, programs_per_sm=2),
        GemmConfig(32, 128, 64, num_warps=4, num_stages=3),
    ],
    default=GemmConfig(64, 256, 128, num_warps=8, num_stages=4, flatten=True),
    small_default=GemmConfig(32, 128, 64, num_warps=4, num_stages=3),
    interpreter_config=GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1),
)


def run_ragged_m(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, c: torch.Tensor,
                 tma: bool | None = None) -> None:
    """``c = ragged-M product of a [M, K] and b [E, K, N]`` with the tuned config of its class."""
    info = launch_info(a.device, tma)
    key = problem_class(a.device, a.dtype, b.stride(1) == 1, info.tma, a.shape[1], b.shape[2], b.shape[0],
                        M=a.shape[0])

    def run(config: GemmConfig, out: torch.Tensor = c) -> None:
        ragged_m_mm(a, b, offsets, out, config, info)

    flops = 2 * a.shape[0] * a.shape[1] * b.shape[2]
    config = _RAGGED_M.choose(key, a.device, a.element_size(), flops, lambda cfg: run(cfg, torch.empty_like(c)))
    run(config)


def run_ragged_k(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, c: torch.Tensor,
                 accumulate: int, flags: torch.Tensor | None, tma: bool | None = None) -> None:
    """``c[e] (+)= a_e^T @ b_e`` for a [M, K], b [M, N], c [E, K, N], with the tuned config."""
    info = launch_info(a.device, tma)
    key = problem_class(a.device, a.dtype, c.dtype, c.stride(1) == 1, info.tma, a.shape[1], b.shape[1],
                        c.shape[0], M=a.shape[0])

    def run(config: GemmConfig, out: torch.Tensor = c) -> None:
        ragged_k_mm(a, b, offsets, out, accumulate, flags, config, info)

    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    config = _RAGGED_K.choose(key, a.device, a.element_size(), flops, lambda cfg: run(cfg, torch.empty_strided(
        c.shape, c.stride(), dtype=c.dtype, device=c.device)))
    run(config)


def tuned_configs() -> dict[str, dict[str, str]]:
    """The configuration chosen so far for each problem class, by kernel: for logs and benchmarks."""
    return {tuner.name: {repr(key): str(config) for key, config in tuner.cache.items()}
            for tuner in (_RAGGED_M, _RAGGED_K)}
