"""The MoE GEMM shapes the project measures (BASELINES.md), and tiny ones for smoke runs.

Shapes come in named groups: ``training`` (the default of every run) and ``decode`` (at most 16 rows
per expert, run with ``--shapes decode``); ``--shapes`` takes group names and shape names alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dropless.bench.routing import ALL_ROUTINGS, ROUTINGS


@dataclass(frozen=True)
class Shape:
    """One grouped GEMM: E experts, M routed rows in all, K in-features, N out-features; ``routings``:
    those it runs under unless a run names others."""

    name: str
    E: int
    M: int
    K: int
    N: int
    routings: tuple[str, ...] = ROUTINGS


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

# One decode step of the same models: M = tokens in flight x top-k / EP size, chosen so that a GPU's
# experts get at most 16 rows each on average, where a grouped GEMM is bound by reading the weights
# and tiles sized for training leave most of their rows empty. Mixtral-8x7B at EP=2 (4 of 8 experts,
# top-2): 64 tokens give M = 64, 16 rows per expert. DeepSeek-V3 at EP=8 (32 of 256 experts, top-8):
# 512 tokens over the EP group give M = 512, 16 per expert. Qwen3-30B-A3B (128 experts, top-8): 192
# tokens give M = 1536, 12 per expert; under all-to-one this is the case of 1-2k rows and over 100
# experts with every row on one expert. Every routing, all-to-one included.
DECODE_SHAPES = (
    Shape("mixtral8x7b-ep2-decode-up", 4, 64, 4096, 14336, ALL_ROUTINGS),
    Shape("mixtral8x7b-ep2-decode-down", 4, 64, 14336, 4096, ALL_ROUTINGS),
    Shape("dsv3-ep8-decode-up", 32, 512, 7168, 4096, ALL_ROUTINGS),
    Shape("dsv3-ep8-decode-down", 32, 512, 2048, 7168, ALL_ROUTINGS),
    Shape("qwen3-30b-a3b-decode-up", 128, 1536, 2048, 1536, ALL_ROUTINGS),
    Shape("qwen3-30b-a3b-decode-down", 128, 1536, 768, 2048, ALL_ROUTINGS),
)

# Small enough for the reference backend on a CPU in seconds; one few-expert and one many-expert case
# in each group, the decode ones at 16 and 12 rows per expert.
QUICK_SHAPES = (
    Shape("tiny-few", 4, 256, 64, 96),
    Shape("tiny-many", 16, 512, 48, 32),
)
QUICK_DECODE_SHAPES = (
    Shape("tiny-decode-few", 4, 64, 64, 96, ALL_ROUTINGS),
    Shape("tiny-decode-many", 128, 1536, 32, 48, ALL_ROUTINGS),
)

GROUPS = {"training": SHAPES, "decode": DECODE_SHAPES}
QUICK_GROUPS = {"training": QUICK_SHAPES, "decode": QUICK_DECODE_SHAPES}


def select_shapes(names: Sequence[str] | None, quick: bool) -> list[Shape]:
    """The shapes named, a group's name standing for its shapes (the ``training`` group when ``names``
    is None), from the quick groups if ``quick``; in the order named, each once."""
    groups = QUICK_GROUPS if quick else GROUPS
    if names is None:
        return list(groups["training"])
    by_name = {shape.name: shape for shapes in groups.values() for shape in shapes}
    unknown = [n for n in names if n not in groups and n not in by_name]
    if unknown:
        raise ValueError(f"unknown shape(s) {unknown}; choose from the groups {list(groups)} or {list(by_name)}")
    chosen = [shape for n in names for shape in (groups[n] if n in groups else (by_name[n],))]
    return list(dict.fromkeys(chosen))
