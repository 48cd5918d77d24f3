"""Tile configurations of the grouped GEMM kernels."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GemmConfig:
    """One tile shape and schedule: ``BLOCK_M x BLOCK_N`` output tiles stepping ``BLOCK_K``.

    For the ragged-K kernel (``dw[e] = x_e^T @ dy_e``), ``block_k x block_n`` tiles the ``[K, N]``
    output and ``block_m`` steps over the group's rows (the reduction).
    """

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3

    def __str__(self) -> str:
        return (f"{self.block_m}x{self.block_n}x{self.block_k}"
                f"/g{self.group_m}/w{self.num_warps}/s{self.num_stages}")
