"""Group sizes for a routing pattern, and token-level draws of experts that follow it, made on the host at
setup time (seeded, so runs compare)."""

from __future__ import annotations

import math

import numpy as np
import torch

ROUTINGS = ("balanced", "skewed")  # what a shape runs under unless it names others (Shape.routings)
ALL_ROUTINGS = (*ROUTINGS, "all-to-one")
ZIPF_EXPONENT = 1.2


def group_sizes(E: int, M: int, routing: str, seed: int = 0, align: int = 1) -> list[int]:
    """Rows per expert, ``E`` ints summing to ``M``, each a multiple of ``align`` (which must divide M).

    ``balanced``: equal groups, the remainder spread one row each over the first experts.
    ``skewed``: ``ceil(E / 8)`` experts empty (at least one, never all), the others ranked by a Zipf(1.2)
    popularity, ``rows ~ M * rank^-1.2``; the seed decides which experts are empty and which rank
    each of the others takes.
    ``all-to-one``: every row to one expert, the seed's pick, and the other ``E - 1`` empty (the worst
    case of a router that collapses, and of a decode step whose tokens all pick one expert).
    """
    if align > 1:
        if M % align:
            raise ValueError(f"align={align} must divide M={M}")
        return [align * size for size in group_sizes(E, M // align, routing, seed)]
    if routing == "balanced":
        base, extra = divmod(M, E)
        return [base + (e < extra) for e in range(E)]
    if routing == "all-to-one":
        sizes = [0] * E
        sizes[int(np.random.default_rng(seed).integers(E))] = M
        return sizes
    if routing != "skewed":
        raise ValueError(f"routing must be one of {ALL_ROUTINGS}, got {routing!r}")
    if E < 2:
        raise ValueError("skewed routing needs at least two experts (one of them empty)")
    active = E - min(math.ceil(E / 8), E - 1)
    popularity = np.arange(1, active + 1, dtype=np.float64) ** -ZIPF_EXPONENT
    rows = _round_to_total(M * popularity / popularity.sum(), M)
    sizes = np.zeros(E, dtype=np.int64)
    sizes[np.random.default_rng(seed).permutation(E)[:active]] = rows
    return [int(s) for s in sizes]


def _round_to_total(quotas: np.ndarray, total: int) -> np.ndarray:
    """Largest-remainder rounding: integers within one of ``quotas`` that sum to ``total`` exactly."""
    rows = np.floor(quotas).astype(np.int64)
    short = total - int(rows.sum())
    rows[np.argsort(rows - quotas, kind="stable")[:short]] += 1
    return rows


# Rows per expert behind the popularity of draw_topk's skewed routing: enough that rounding is immaterial.
_POPULARITY_ROWS_PER_EXPERT = 1000


def draw_topk(T: int, E: int, k: int, routing: str, seed: int, draw_seed: int) -> torch.Tensor:
    """int64 ``[T, k]`` expert ids on the host: each token's k distinct experts, drawn at random.

    ``balanced``: uniformly (every expert has ``T * k / E`` copies in expectation). ``skewed``: without
    replacement in proportion to the popularity of ``group_sizes(E, ., "skewed", seed)`` (Gumbel top-k),
    so the experts it leaves empty are never drawn and the popular ones are the same for every
    ``draw_seed``. ``seed`` fixes the popularity, ``draw_seed`` the draw (one per rank: every rank draws
    its own tokens from the same popularity). ValueError if fewer than k experts can be drawn.
    """
    if routing == "balanced":
        log_popularity = torch.zeros(E, dtype=torch.float64)
    elif routing == "skewed":
        sizes = group_sizes(E, E * _POPULARITY_ROWS_PER_EXPERT, "skewed", seed)
        log_popularity = torch.tensor(sizes, dtype=torch.float64).log()
    else:
        raise ValueError(f"routing must be balanced or skewed for token draws, got {routing!r}")
    if not 1 <= k <= int(torch.isfinite(log_popularity).sum()):
        raise ValueError(f"{routing} routing over {E} experts cannot give each token {k} distinct experts")
    gen = torch.Generator().manual_seed(draw_seed)
    # -log(Exp(1)) is a Gumbel variable: the top k of log p + Gumbel draw k experts without replacement.
    keys = log_popularity - torch.empty(T, E, dtype=torch.float64).exponential_(generator=gen).log()
    return keys.topk(k, dim=1).indices
