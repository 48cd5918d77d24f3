"""What every benchmark run takes: timing, seed, commit and device."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import torch

# do_bench warm-up and repetition, ms. At the benchmark's shapes an H100 runs at its power limit: its
# clock starts at boost and settles ~300 ms into a sustained load (benchmarks/NOTES.md, v7), so the
# warm-up is long enough for every case to be timed at the clock a training step runs at.
FULL_TIMING = (300.0, 150.0)
QUICK_TIMING = (2.0, 10.0)
ROUNDS = 3  # timing rounds over all cases; each case reports the median of its rounds
T = TypeVar("T")


@dataclass
class RunOptions:
    """``warmup`` and ``rep`` are milliseconds per timed case (``do_bench``'s meaning); every case is
    timed once per round, in ``rounds`` rounds."""

    quick: bool = False
    warmup: float = FULL_TIMING[0]
    rep: float = FULL_TIMING[1]
    rounds: int = ROUNDS
    seed: int = 0
    commit: str | None = None
    device: torch.device = field(default_factory=lambda: torch.device(
        "cuda" if torch.cuda.is_available() else "cpu"))

    def default_dtype(self) -> torch.dtype:
        """bf16 on a GPU; fp32 on the CPU, whose bf16 matmul is too slow even for smoke runs."""
        return torch.bfloat16 if self.device.type == "cuda" else torch.float32


def select_by_name(names: Sequence[str] | None, full: Sequence[T], quick_set: Sequence[T], quick: bool,
                   what: str) -> list[T]:
    """The items named (all when ``names`` is None), from ``quick_set`` if ``quick``; items have ``.name``."""
    pool = quick_set if quick else full
    if names is None:
        return list(pool)
    by_name = {item.name: item for item in pool}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise ValueError(f"unknown {what}(s) {unknown}; choose from {list(by_name)}")
    return [by_name[n] for n in names]
