"""What the Hopper (sm_90) Gluon kernels share: the dtype map, the TMA descriptors, the raster order.

Both kernels are warp-specialized: a loader partition walks the program's tiles issuing TMA loads into
a ring of shared-memory stages (``ready`` / ``empty`` mbarriers per stage), and the default partition
(two warpgroups) runs the MMAs and writes each finished tile through an asynchronous TMA store.
They are written against Triton 3.6's Gluon; ``launch.hopper_kernels_ok`` says when they apply.
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32,
             torch.float8_e4m3fn: gl.float8e4nv}
# What one program may allocate on sm_90 (227 KB), less room for the mbarriers and the compiler's scratch.
SHARED_MEMORY_BYTES = 227 * 1024 - 2048


class _CheckedDescriptor(TensorDescriptor):
    """A TMA descriptor of a tensor that ``launch.hopper_kernels_ok`` (or ``hopper_wgrad_ok``) accepted:
    its construction skips re-checking what those checked, a few microseconds a descriptor."""

    def __post_init__(self) -> None:
        pass


def descriptor(t: torch.Tensor, block_shape: list[int]) -> TensorDescriptor:
    """A TMA descriptor of ``t`` (non-empty, TMA-readable as ``launch.LaunchInfo.tma_ok`` says) loading
    ``block_shape`` blocks into swizzled shared memory."""
    return _CheckedDescriptor(t, t.shape, t.stride(), block_shape, _shared_layout(tuple(block_shape), t.dtype))


@functools.cache
def _shared_layout(block_shape: tuple[int, ...], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The swizzled layout of ``block_shape`` blocks, computed once per shape and dtype (it costs as much
    host time as the rest of a descriptor)."""
    return gl.NVMMASharedLayout.get_default_for(list(block_shape), GL_DTYPES[dtype])


@gluon.jit
def raster(local_tile, tiles_m, tiles_n, GROUP_M: gl.constexpr):
    """Tile number inside one group -> ``(pid_m, pid_n)``, GROUP_M block rows at a time, so programs
    working at the same time share a few A row blocks and B column blocks in L2."""
    width = GROUP_M * tiles_n
    first_m = (local_tile // width) * GROUP_M
    rows_here = gl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (local_tile % width) % rows_here
    pid_n = (local_tile % width) // rows_here
    return pid_m, pid_n


@gluon.jit
def scan_max(a, b):
    return gl.maximum(a, b)


@gluon.jit
def scan_add(a, b):
    return a + b


@gluon.constexpr_function
def group_layout(E_POW2, WARPS, REPLICATED):
    """The layout of ``[E_POW2]`` group vectors: spread over WARPS warps, or (REPLICATED) held whole by
    each warp, so that picking an entry needs no exchange between warps."""
    if REPLICATED:
        return gl.BlockedLayout([max(E_POW2 // 32, 1)], [32], [WARPS], [0])
    return gl.BlockedLayout([1], [32], [WARPS], [0])


@gluon.jit
def group_bounds(offsets_ptr, E, M, E_POW2: gl.constexpr, WARPS: gl.constexpr, REPLICATED: gl.constexpr = False):
    """Row ranges ``[starts, ends)`` of the groups as ``[E_POW2]`` vectors in ``group_layout``.
    Entry E (if E_POW2 > E) is the unrouted tail ``[offsets[E-1], M)``; entries past it are empty.
    Bounds are clamped into ``[0, M]`` and made non-decreasing, so malformed offsets can neither
    address outside the operands nor make groups overlap."""
    layout: gl.constexpr = group_layout(E_POW2, WARPS, REPLICATED)
    e = gl.arange(0, E_POW2, layout=layout)
    ends = gl.load(offsets_ptr + e, mask=e < E, other=M)
    ends = gl.associative_scan(gl.minimum(gl.maximum(ends, 0), M), 0, scan_max)
    starts = gl.load(offsets_ptr + e - 1, mask=(e > 0) & (e <= E), other=0)
    starts = gl.associative_scan(gl.minimum(gl.maximum(starts, 0), M), 0, scan_max)
    starts = gl.where(e > E, M, starts)
    return starts, gl.maximum(ends, starts)


@gluon.jit
def pick(values, index):
    """``values[index]`` of a register vector (a group table)."""
    e = gl.arange(0, values.shape[0], layout=values.type.layout)
    return gl.sum(gl.where(e == index, values, 0), axis=0)


@gluon.jit
def stage_barriers(STAGES: gl.constexpr, readers: gl.constexpr = 1, arrivals: gl.constexpr = 1):
    """Per stage of a ring, a ``ready`` barrier (it was filled: ``arrivals`` arrivals, such as a TMA
    expect and each thread's asynchronous-copy arrive) and an ``empty`` one (each of its ``readers``
    partitions is done with it)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=arrivals)
        mbarrier.init(empty.index(i), count=readers)
    return ready, empty


@gluon.jit
def release(empty, step, STAGES: gl.constexpr):
    """Mark the stage of ``step`` consumed, once every warp of the partition is past its MMA."""
    gl.thread_barrier()
    mbarrier.arrive(empty.index(step % STAGES), count=1)


@gluon.jit
def post_item(ids, ready, empty, n, item, QUEUE: gl.constexpr, WARPS: gl.constexpr = 1):
    """Put work item number ``item`` in slot ``n % QUEUE`` of a queue of drawn items (``ids [QUEUE, 1]``
    int32 in shared memory, ``ready`` / ``empty`` barriers a slot), once its readers freed it."""
    slot = n % QUEUE
    mbarrier.wait(empty.index(slot), ((n // QUEUE) & 1) ^ 1)
    ids.index(slot).store(gl.full([1], item, gl.int32, gl.BlockedLayout([1], [32], [WARPS], [0])))
    release(ready, n, QUEUE)


@gluon.jit
def take_item(ids, ready, empty, n, QUEUE: gl.constexpr, WARPS: gl.constexpr):
    """The work item number in slot ``n % QUEUE`` of a queue that ``post_item`` fills (-1: no more)."""
    slot = n % QUEUE
    mbarrier.wait(ready.index(slot), (n // QUEUE) & 1)
    item = gl.max(ids.index(slot).load(gl.BlockedLayout([1], [32], [WARPS], [0])), axis=0)
    release(empty, n, QUEUE)
    return item
