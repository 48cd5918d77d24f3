"""Data-parallel training over the processes ``torchrun`` starts: the device, the process group, DDP.

``torchrun --nproc-per-node N -m dropless train ...`` sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``;
each process then trains a replica of the model on its own batches (NCCL between GPUs, gloo between
CPU processes) and rank 0 alone prints and writes files.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from dropless.train.errors import TrainError


@dataclass(frozen=True)
class Ranks:
    """This process's place among the training processes (rank 0 of 1 without torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def ranks_from_environment() -> Ranks:
    """The ranks torchrun put in the environment, or a single process."""
    if "WORLD_SIZE" not in os.environ:
        return Ranks()
    return Ranks(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))


def resolve_device(name: str, ranks: Ranks) -> torch.device:
    """``auto`` is the GPU when there is one, else the CPU; under torchrun each process takes the GPU
    of its local rank."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise TrainError(f"--device {name}: not a device PyTorch knows (cpu, cuda, cuda:N)") from None
    if device.type not in ("cpu", "cuda"):
        raise TrainError(f"--device {name}: dropless trains on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise TrainError(f"--device {name}: no CUDA GPU is visible to PyTorch")
        if ranks.world_size > 1:
            device = torch.device("cuda", ranks.local_rank)
        elif device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def start(ranks: Ranks, device: torch.device) -> None:
    """Join the process group of a multi-process run (NCCL on GPUs, gloo on CPUs); nothing for one process."""
    if ranks.world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                device_id=device if device.type == "cuda" else None)


def wait_for_all() -> None:
    """Block until every rank gets here (no-op for one process). Called before leaving the group after
    a run: a gloo rank that tears its connections down while a peer is still writing its report can
    be aborted."""
    if dist.is_initialized():
        dist.barrier()


def stop() -> None:
    """Leave the process group, if one was joined. Objects in reference cycles (FSDP2's modules) are
    collected first: one that outlives the group keeps gloo work whose teardown at exit aborts."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def data_parallel(model: nn.Module, ranks: Ranks, device: torch.device) -> nn.Module:
    """The model wrapped in DDP for a multi-process run, else the model itself.

    The only buffers, the routers' expert bias and load counts, are equal on every rank at the start
    of each forward (the loads are summed over ranks before each bias update, then reset), so DDP's
    broadcast of rank 0's buffers changes nothing.
    """
    if ranks.world_size == 1:
        return model
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)


def sum_across_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over the ranks in place (no-op for one process); returns it."""
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor


def check_replicas_identical(model: nn.Module, exclude: frozenset[int] = frozenset()) -> None:
    """Raise RuntimeError if any rank's parameters or buffers differ from rank 0's (one all-gather of
    per-tensor fp64 sums; a no-op for one process). ``exclude``: ids of tensors that differ by design
    (an expert-parallel rank's experts)."""
    if not dist.is_initialized():
        return
    tensors = [t for t in (*model.parameters(), *model.buffers()) if id(t) not in exclude]
    local = torch.stack([torch.stack([t.double().sum(), t.double().square().sum()]) for t in tensors])
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    differing = [rank for rank, other in enumerate(gathered) if not torch.equal(other, gathered[0])]
    if differing:
        raise RuntimeError(f"the model replicas of ranks {differing} differ from rank 0's")
