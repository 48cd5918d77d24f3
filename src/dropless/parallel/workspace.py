"""A buffer of the same size on every rank of a process group, which every rank can read and write.

On GPUs it is torch's symmetric memory (``torch.distributed._symmetric_memory``): each rank's buffer is
mapped into its peers' address spaces (over NVLink), and the barrier is a kernel on the stream, so
nothing waits for the host. On the CPU (gloo) each rank's buffer is a shared-memory file that the other
processes map, and the barrier is the group's; the same kernels (under Triton's interpreter) and the
same algorithm run there.

Its size is set when it is made: a collective of the whole group, the only point where the host waits.
``Workspace.peers(offset)`` gives the addresses of one region on every rank (int64 ``[P]`` on the
device), ``view`` the local region as a tensor.
"""

from __future__ import annotations

import math
import os
import tempfile
import uuid
import weakref

import torch
import torch.distributed as dist

_ALIGN = 256


def align(nbytes: int) -> int:
    """``nbytes`` rounded up to a multiple of 256 (each region starts aligned)."""
    return -(-nbytes // _ALIGN) * _ALIGN


class Workspace:
    """``nbytes`` bytes on each rank of ``group`` (collective: every rank makes it, with the same size)."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, nbytes: int) -> None:
        group = group if group is not None else dist.group.WORLD
        # Held weakly: a process group kept alive past destroy_process_group would be torn down at the
        # interpreter's exit, which aborts the process.
        self._group = weakref.ref(group)
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = device
        self.nbytes = nbytes
        if device.type == "cuda":
            import torch.distributed._symmetric_memory as symm_mem

            self.buffer = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
            self._handle = symm_mem.rendezvous(self.buffer, group)
            addresses = list(self._handle.buffer_ptrs)
        else:
            self._handle = None
            addresses = self._map_shared_files()
        # Made once, with the workspace: the copy from the host list waits for nothing else.
        self._addresses = torch.tensor(addresses, dtype=torch.int64).to(device)
        self._peers: dict[int, torch.Tensor] = {}

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group, or None once it has been destroyed."""
        return self._group()

    def _map_shared_files(self) -> list[int]:
        """Each rank's buffer as a shared-memory file, mapped by every rank; the files are removed once
        all are mapped (the mappings stay)."""
        names = [uuid.uuid4().hex if self.rank == 0 else None]
        dist.broadcast_object_list(names, src=dist.get_global_rank(self.group, 0), group=self.group)
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        paths = [os.path.join(folder, f"dropless-{names[0]}-{r}") for r in range(self.world)]
        self.buffer = torch.from_file(paths[self.rank], shared=True, size=self.nbytes, dtype=torch.uint8)
        dist.barrier(group=self.group)
        self._mapped = [self.buffer if r == self.rank else
                        torch.from_file(p, shared=True, size=self.nbytes, dtype=torch.uint8)
                        for r, p in enumerate(paths)]
        dist.barrier(group=self.group)
        os.unlink(paths[self.rank])
        return [t.data_ptr() for t in self._mapped]

    def peers(self, offset: int) -> torch.Tensor:
        """int64 ``[P]``: the address of byte ``offset`` of each rank's buffer."""
        if offset not in self._peers:
            self._peers[offset] = self._addresses + offset
        return self._peers[offset]

    def view(self, offset: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """This rank's bytes from ``offset`` as a contiguous tensor of ``shape`` and ``dtype``."""
        nbytes = math.prod(shape) * dtype.itemsize
        if offset % _ALIGN or offset + nbytes > self.nbytes:
            raise ValueError(f"region [{offset}, {offset + nbytes}) is not an aligned part of {self.nbytes} bytes")
        return self.buffer[offset:offset + nbytes].view(dtype).view(shape)

    def barrier(self) -> None:
        """Every rank's work queued before this point is done before any rank's work queued after it
        starts (on GPUs: on the current stream, with the memory it wrote visible to the peers)."""
        if self._handle is not None:
            self._handle.barrier(channel=0)
        else:
            dist.barrier(group=self.group)
