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
    flatten: bool = False  # software-pipeline across tiles, so loads of the next overlap this epilogue
    warp_specialize: bool = False  # producer warps issue loads while consumer warps compute
    by_work: bool = False  # ragged-K: largest groups first, tiles drawn from a counter
    tma_store: bool = False  # write output tiles through TMA where the layout allows
    programs_per_sm: int = 1  # 2: one program's epilogue overlaps the other's main loop
    gluon: bool = False  # the Hopper warp-specialized Gluon kernel (loader warp, asynchronous TMA stores)
    split_k: int = 1  # ragged-M: split K over up to this many programs where tiles are few

    def __str__(self) -> str:
        extra = "".join(tag for tag, on in (("/flat", self.flatten), ("/ws", self.warp_specialize),
                                            ("/lpt", self.by_work), ("/tmast", self.tma_store),
                                            (f"/x{self.programs_per_sm}", self.programs_per_sm > 1),
                                            ("/gluon", self.gluon), (f"/k{self.split_k}", self.split_k > 1))
                         if on)
        return (f"{self.block_m}x{self.block_n}x{self.block_k}"
                f"/g{self.group_m}/w{self.num_warps}/s{self.num_stages}{extra}")
