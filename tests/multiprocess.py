"""Running a test body on several CPU processes over gloo, bounded in time."""

from __future__ import annotations

import gc
import os
import tempfile
import time
from collections.abc import Callable

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 120


def run_ranks(world: int, target: Callable, *args) -> None:
    """Run ``target(rank, world, *args)`` on ``world`` spawned processes inside a gloo process group; the
    test fails if any raises, or if they have not all finished within TIMEOUT_S (a hang)."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(_in_group, args=(world, os.path.join(tmp, "init"), target, args),
                                     nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + TIMEOUT_S
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"{world} processes did not finish within {TIMEOUT_S} s")


def _in_group(rank: int, world: int, init_file: str, target: Callable, args: tuple) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        target(rank, world, *args)
    finally:
        gc.collect()  # FSDP2's modules hold cycles that keep gloo work alive past teardown (an abort at exit)
        dist.destroy_process_group()
