"""The MoE GEMM shapes the project measures (BASELINES.md), and tiny ones for smoke runs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dropless.bench.options import select_by_name


@dataclass(frozen=True)
class Shape:
    """One grouped GEMM: E experts, M routed rows in all, K in-features, N out-features."""

    name: str
    E: int
    M: int
    K: int
    N: int


# Routed rows on one GPU (tokens x top-k / EP size); the "up" GEMMs fuse gate and up, so N = 2 x d_ff.
SHAPES = (
    Shape("mixtral8x7b-ep2-up", 4, 16384, 4096, 14336),
    Shape("mixtral8x7b-ep2-down", 4, 16384, 14336, 4096),
    Shape("dsv3-ep8-up", 32, 32768, 7168, 4096),
    Shape("dsv3-ep8-down", 32, 32768, 2048, 7168),
    Shape("qwen3-30b-a3b-up", 128, 65536, 2048, 1536),
    Shape("qwen3-30b-a3b-down", 128, 65536, 768, 2048),
    Shape("gptoss20b-up", 32, 32768, 2880, 5760),
)

# Small enough for the reference backend on a CPU in seconds; one few-expert and one many-expert case.
QUICK_SHAPES = (
    Shape("tiny-few", 4, 256, 64, 96),
    Shape("tiny-many", 16, 512, 48, 32),
)


def select_shapes(names: Sequence[str] | None, quick: bool) -> list[Shape]:
    """The shapes named (all of the set when ``names`` is None), from the quick set if ``quick``."""
    return select_by_name(names, SHAPES, QUICK_SHAPES, quick, "shape")
