"""Running a test body on several processes, bounded in time: CPU processes over gloo, or one process per
GPU over NCCL."""

from __future__ import annotations

import gc
import os
import tempfile
import time
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 120


def run_ranks(world: int, target: Callable, *args, backend: str = "gloo") -> None:
    """Run ``target(rank, world, *args)`` on ``world`` spawned processes inside a process group of
    ``backend`` (``"nccl"``: rank r on GPU r, its current device); the test fails if any raises, or if
    they have not all finished within TIMEOUT_S (a hang)."""
    if backend == "nccl" and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(_in_group, args=(world, os.path.join(tmp, "init"), target, args, backend),
                                     nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + TIMEOUT_S
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"{world} processes did not finish within {TIMEOUT_S} s")


def rank_device() -> torch.device:
    """The device of this rank's tensors: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _in_group(rank: int, world: int, init_file: str, target: Callable, args: tuple, backend: str) -> None:
    device = None
    if backend == "nccl":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            device_id=device)
    try:
        target(rank, world, *args)
    finally:
        gc.collect()  # FSDP2's modules hold cycles that keep gloo work alive past teardown (an abort at exit)
        dist.destroy_process_group()
