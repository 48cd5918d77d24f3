"""Ragged-M grouped GEMM (forward and input gradient) for Hopper, warp-specialized, in Gluon.

    c[s_e:t_e, :] = a[s_e:t_e, :] @ b[e]          for every group e, with s_e = offsets[e-1], t_e = offsets[e]
    c[offsets[E-1]:M, :] = 0                       (rows that belong to no expert)

Same contract as ``ragged_m.py`` for 16-bit operands that TMA can read: a ``[M, K]`` row-major, b
``[E, K, N]`` with N or K contiguous, c ``[M, N]`` row-major, all of one dtype.

Tiles are numbered group after group (group E is the unrouted tail, written as zeros); every
partition derives that numbering, and which program computes which tile, from ``offsets`` on the
device (``ragged_m_schedule``; with ``stream_k`` the tiles of a last, partial wave are cut along K
and their pieces summed by ``_fixup_kernel``). One loader warp runs ahead through
the program's tiles filling a ring of shared-memory stages, so the next tile's operands are already
on chip when a tile ends; the compute warps write each tile that lies inside its group through an
asynchronous TMA store and wait for it a tile later. A group's last block of rows usually ends
inside the tile: those rows are written by masked stores, so the next group's rows are not touched.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from dropless.kernels.config import GemmConfig
from dropless.kernels.direct_launch import DirectLaunch
from dropless.kernels.hopper import SHARED_MEMORY_BYTES, descriptor, release, stage_barriers
from dropless.kernels.ragged_m_schedule import contributors, group_table, item_count, locate, split_plan, work_item
from dropless.kernels.launch import cdiv, next_power_of_2, weight_nk

# The loader is a whole warpgroup (registers are handed out per warpgroup anyway), so the group table
# it keeps in registers, [E_POW2] vectors, is spread over 128 threads.
LOADER_WARPS: gl.constexpr = gl.constexpr(4)


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, M, N, K, E,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
            STAGES: gl.constexpr, E_POW2: gl.constexpr, B_NK: gl.constexpr, STREAM_K: gl.constexpr,
            SPLIT_MAX: gl.constexpr):
    """TMA loads of the k-steps of every work item of this program, into the stage ring."""
    starts, ends, tiles, tiles_end, real = group_table(offsets_ptr, E, M, N, BLOCK_M, BLOCK_N, E_POW2,
                                                      LOADER_WARPS)
    total = gl.sum(tiles, axis=0)
    programs = gl.num_programs(0)
    whole, span, k_steps = split_plan(real, programs, K, BLOCK_K, STREAM_K, SPLIT_MAX)
    step = 0
    for v in range(item_count(whole, real, total, programs)):
        tile_id, k_begin, k_end = work_item(v, whole, real, span, k_steps, programs)
        if tile_id >= 0:
            group, row0, end, col0 = locate(tile_id, starts, ends, tiles, tiles_end, N, BLOCK_M, BLOCK_N,
                                            GROUP_M, E_POW2, LOADER_WARPS)
            for k0 in range(k_begin * BLOCK_K, k_end * BLOCK_K, BLOCK_K):
                slot = step % STAGES
                mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
                bar = ready.index(slot)
                mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(a_desc, [row0, k0], bar, a_bufs.index(slot))
                if B_NK:
                    tma.async_copy_global_to_shared(b_desc, [group, col0, k0], bar,
                                                    b_bufs.index(slot).reshape([1, BLOCK_N, BLOCK_K]))
                else:
                    tma.async_copy_global_to_shared(b_desc, [group, k0, col0], bar,
                                                    b_bufs.index(slot).reshape([1, BLOCK_K, BLOCK_N]))
                step += 1


@gluon.jit
def _store_from(c_desc, buffer, block, row0, col0):
    """An asynchronous TMA store of ``block`` at ``[row0, col0]`` through the free shared buffer ``buffer``."""
    buffer.store(block)
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(c_desc, [row0, col0], buffer)


@gluon.jit
def _compute(c_desc, c_ptr, stride_cm, ws_ptr, a_bufs, b_bufs, c_smem, ready, empty, offsets_ptr, M, N, K, E,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
             STAGES: gl.constexpr, E_POW2: gl.constexpr, B_NK: gl.constexpr, EPI_HALVES: gl.constexpr,
             STREAM_K: gl.constexpr, SPLIT_MAX: gl.constexpr, num_warps: gl.constexpr):
    """The default partition: the MMAs of each work item, then its epilogue.

    With EPI_HALVES, ``c_smem`` holds half a tile: a whole tile leaves in two halves of columns, the
    left through ``c_smem``, the right through the weight buffer of the tile's last stage. That stage
    goes back to the loader only after the next tile's first MMA is issued, once the store has read it,
    so neither half waits for the other. A piece of a split tile (STREAM_K) leaves as fp32 into its
    workspace slot instead, for ``_fixup_kernel`` to sum.
    """
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    starts, ends, tiles, tiles_end, real = group_table(offsets_ptr, E, M, N, BLOCK_M, BLOCK_N, E_POW2, num_warps)
    total = gl.sum(tiles, axis=0)
    programs = gl.num_programs(0)
    whole_tiles, span, k_steps = split_plan(real, programs, K, BLOCK_K, STREAM_K, SPLIT_MAX)
    step = 0
    held = False  # the previous tile's last stage is still being read by its store
    for v in range(item_count(whole_tiles, real, total, programs)):
        tile_id, k_begin, k_end = work_item(v, whole_tiles, real, span, k_steps, programs)
        if tile_id >= 0:
            group, row0, end, col0 = locate(tile_id, starts, ends, tiles, tiles_end, N, BLOCK_M, BLOCK_N,
                                            GROUP_M, E_POW2, num_warps)
            loaded = k_end > k_begin
            acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
            for k0 in range(k_begin * BLOCK_K, k_end * BLOCK_K, BLOCK_K):
                slot = step % STAGES
                mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
                b_buf = b_bufs.index(slot)
                if B_NK:
                    b_buf = b_buf.permute((1, 0))
                acc = warpgroup_mma(a_bufs.index(slot), b_buf, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                if k0 > k_begin * BLOCK_K:
                    release(empty, step - 1, STAGES)
                elif held:
                    tma.store_wait(pendings=0)
                    release(empty, step - 1, STAGES)
                    held = False
                step += 1
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            if held:
                # This tile loaded nothing (the unrouted tail), so the stage is returned here.
                tma.store_wait(pendings=0)
                release(empty, step - 1, STAGES)
                held = False
            whole = row0 + BLOCK_M <= end
            piece = (tile_id >= whole_tiles) & (tile_id < real)  # never, without STREAM_K
            # The item's last stage goes back now, unless a whole tile's right half leaves through it.
            if loaded:
                if not EPI_HALVES:
                    release(empty, step - 1, STAGES)
                elif not whole:
                    release(empty, step - 1, STAGES)
                elif piece:
                    release(empty, step - 1, STAGES)
            if piece:
                rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
                cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
                slot = gl.program_id(0) + tile_id - whole_tiles
                gl.store(ws_ptr + slot.to(gl.int64) * (BLOCK_M * BLOCK_N) + (rows * BLOCK_N)[:, None] + cols[None, :],
                         acc)
            elif whole:
                out = acc.to(c_desc.dtype)
                # The previous tile's stores must have read c_smem before it is overwritten.
                tma.store_wait(pendings=0)
                if EPI_HALVES:
                    left, right = out.reshape([BLOCK_M, 2, BLOCK_N // 2]).permute(0, 2, 1).split()
                    _store_from(c_desc, c_smem, left, row0, col0)
                    if loaded:
                        last = b_bufs.index((step - 1) % STAGES)._reinterpret(c_desc.dtype, c_desc.block_type.shape,
                                                                              c_desc.layout)
                        _store_from(c_desc, last, right, row0, col0 + BLOCK_N // 2)
                        held = True
                    else:
                        tma.store_wait(pendings=0)
                        _store_from(c_desc, c_smem, right, row0, col0 + BLOCK_N // 2)
                else:
                    _store_from(c_desc, c_smem, out, row0, col0)
            else:
                rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
                cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
                ptrs = c_ptr + rows.to(gl.int64)[:, None] * stride_cm + cols[None, :]
                gl.store(ptrs, acc.to(c_desc.dtype), mask=(rows < end)[:, None] & (cols < N)[None, :])
    tma.store_wait(pendings=0)


@gluon.jit
def _fixup_kernel(ws_ptr, c_ptr, stride_cm, offsets_ptr, M, N, K, E, programs, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr, E_POW2: gl.constexpr,
                  SPLIT_MAX: gl.constexpr, ROWS: gl.constexpr, num_warps: gl.constexpr):
    """Sums the pieces of split tile ``program_id(0)`` (rows ``ROWS * program_id(1)`` on) in program
    order, so the result does not depend on timing, and writes them in c's dtype."""
    starts, ends, tiles, tiles_end, real = group_table(offsets_ptr, E, M, N, BLOCK_M, BLOCK_N, E_POW2, num_warps)
    whole_tiles, span, k_steps = split_plan(real, programs, K, BLOCK_K, True, SPLIT_MAX)
    split_tile = gl.program_id(0)
    if whole_tiles + split_tile < real:
        group, row0, end, col0 = locate(whole_tiles + split_tile, starts, ends, tiles, tiles_end, N, BLOCK_M,
                                        BLOCK_N, GROUP_M, E_POW2, num_warps)
        layout: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [num_warps, 1], [1, 0])
        rows = ROWS * gl.program_id(1) + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        inside = (rows * BLOCK_N)[:, None] + cols[None, :]
        first, last = contributors(split_tile, span, k_steps)
        acc = gl.zeros((ROWS, BLOCK_N), dtype=gl.float32, layout=layout)
        for p in range(first, last + 1):
            acc += gl.load(ws_ptr + (p + split_tile).to(gl.int64) * (BLOCK_M * BLOCK_N) + inside)
        rows += row0
        cols += col0
        ptrs = c_ptr + rows.to(gl.int64)[:, None] * stride_cm + cols[None, :]
        gl.store(ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows < end)[:, None] & (cols < N)[None, :])


@gluon.constexpr_function
def _b_block(BLOCK_K, BLOCK_N, B_NK):
    """The shape of one weight block in shared memory: as stored, K or N contiguous."""
    return [BLOCK_N, BLOCK_K] if B_NK else [BLOCK_K, BLOCK_N]


@gluon.jit
def _ragged_m_hopper_kernel(a_desc, b_desc, c_desc, c_ptr, stride_cm, ws_ptr, offsets_ptr, M, N, K, E,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                            GROUP_M: gl.constexpr, STAGES: gl.constexpr, E_POW2: gl.constexpr,
                            B_NK: gl.constexpr, EPI_HALVES: gl.constexpr, STREAM_K: gl.constexpr,
                            SPLIT_MAX: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_block: gl.constexpr = _b_block(BLOCK_K, BLOCK_N, B_NK)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, b_block[0], b_block[1]],
                                       gl.NVMMASharedLayout.get_default_for(b_block, dtype))
    c_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
    ready, empty = stage_barriers(STAGES)
    gl.warp_specialize([
        (_compute, (c_desc, c_ptr, stride_cm, ws_ptr, a_bufs, b_bufs, c_smem, ready, empty, offsets_ptr, M, N, K,
                    E, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, E_POW2, B_NK, EPI_HALVES, STREAM_K, SPLIT_MAX,
                    num_warps)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, M, N, K, E,
                   BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, E_POW2, B_NK, STREAM_K, SPLIT_MAX)),
    ], [LOADER_WARPS], [40])


_LAUNCH = DirectLaunch(_ragged_m_hopper_kernel)
_FIXUP = DirectLaunch(_fixup_kernel)
# A tile is cut into at most this many pieces (each at least 1/SPLIT_MAX of its k-steps), so summing the
# pieces stays a small fraction of the tile's work.
SPLIT_MAX = 8
FIXUP_ROWS = 16


def output_in_halves(config: GemmConfig, element_size: int) -> bool:
    """Whether the output tile leaves in two halves of columns: the whole tile's staging buffer does not
    fit in shared memory beside the stage ring, half of it does, and a stage's weight buffer holds the
    other half. ValueError if the config fits neither way."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    ring = config.num_stages * (bm + bn) * bk * element_size
    tile = bm * bn * element_size
    if ring + tile <= SHARED_MEMORY_BYTES:
        return False
    if ring + tile // 2 <= SHARED_MEMORY_BYTES and 2 * bk >= bm:
        return True
    raise ValueError(f"tile config {config} does not fit in shared memory ({ring + tile // 2} bytes or more)")


def ragged_m_mm_hopper(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, c: torch.Tensor,
                       config: GemmConfig, num_programs: int) -> None:
    """Launch on ``a [M, K]``, ``b [E, K, N]``, int32 ``offsets [E]``, ``c [M, N]``, which
    ``launch.hopper_kernels_ok`` accepts (b as stored: along N, or along K for an nn.Linear view)."""
    M, K = a.shape
    E, _, N = b.shape
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    halves = output_in_halves(config, a.element_size())
    b_nk = weight_nk(b)
    b_desc = descriptor(b.transpose(1, 2), [1, bn, bk]) if b_nk else descriptor(b, [1, bk, bn])
    max_tiles = (cdiv(M, bm) + E + 1) * cdiv(N, bn)
    programs = max(1, min(num_programs, max_tiles))
    # Each program's run touches at most two split tiles: slots program + split tile < 2 * programs.
    ws = torch.empty(2 * programs, bm, bn, dtype=torch.float32, device=a.device) if config.stream_k else c
    _LAUNCH((programs, ), a_desc=descriptor(a, [bm, bk]), b_desc=b_desc,
            c_desc=descriptor(c, [bm, bn // 2 if halves else bn]), c_ptr=c, stride_cm=c.stride(0), ws_ptr=ws,
            offsets_ptr=offsets, M=M, N=N, K=K, E=E, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            GROUP_M=config.group_m, STAGES=config.num_stages, E_POW2=next_power_of_2(E + 1),
            B_NK=b_nk, EPI_HALVES=halves, STREAM_K=config.stream_k, SPLIT_MAX=SPLIT_MAX,
            num_warps=config.num_warps)
    if config.stream_k:
        _FIXUP((programs, bm // FIXUP_ROWS), ws_ptr=ws, c_ptr=c, stride_cm=c.stride(0), offsets_ptr=offsets,
               M=M, N=N, K=K, E=E, programs=programs, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
               E_POW2=next_power_of_2(E + 1), SPLIT_MAX=SPLIT_MAX, ROWS=FIXUP_ROWS, num_warps=4)
