"""Experimental ragged-M Gluon kernel: SUBS compute warpgroups, each its own partition owning a 64-row
slice of a (64*SUBS) x BLOCK_N tile; a slice past its group's end skips its loads and MMAs."""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from dropless.kernels.hopper import descriptor, release, stage_barriers
from dropless.kernels.launch import cdiv, next_power_of_2, weight_nk
from dropless.kernels.ragged_m_hopper import LOADER_WARPS, _b_block, _group_table, _locate

SUB_M: gl.constexpr = gl.constexpr(64)


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, M, N, K, E,
            SUBS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
            STAGES: gl.constexpr, E_POW2: gl.constexpr, B_NK: gl.constexpr):
    BLOCK_M: gl.constexpr = SUBS * SUB_M
    starts, ends, tiles, tiles_end = _group_table(offsets_ptr, E, M, N, BLOCK_M, BLOCK_N, E_POW2, LOADER_WARPS)
    total_tiles = gl.sum(tiles, axis=0)
    A_BYTES: gl.constexpr = a_desc.block_type.nbytes
    B_BYTES: gl.constexpr = b_desc.block_type.nbytes
    step = 0
    for tile_id in range(gl.program_id(0), total_tiles, gl.num_programs(0)):
        group, row0, end, col0 = _locate(tile_id, starts, ends, tiles, tiles_end, N, BLOCK_M, BLOCK_N,
                                         GROUP_M, E_POW2, LOADER_WARPS)
        k_end = gl.where(group < E, K, 0)
        active = gl.minimum(gl.cdiv(end - row0, SUB_M), SUBS)
        for k0 in range(0, k_end, BLOCK_K):
            slot = step % STAGES
            mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            for s in gl.static_range(1, SUBS + 1):
                mbarrier.expect(bar, s * A_BYTES + B_BYTES, pred=active == s)
            for s in gl.static_range(SUBS):
                if s < active:
                    tma.async_copy_global_to_shared(a_desc, [row0 + s * SUB_M, k0], bar,
                                                    a_bufs.index(slot * SUBS + s))
            if B_NK:
                tma.async_copy_global_to_shared(b_desc, [group, col0, k0], bar,
                                                b_bufs.index(slot).reshape([1, BLOCK_N, BLOCK_K]))
            else:
                tma.async_copy_global_to_shared(b_desc, [group, k0, col0], bar,
                                                b_bufs.index(slot).reshape([1, BLOCK_K, BLOCK_N]))
            step += 1


@gluon.jit
def _compute(SUB: gl.constexpr, c_desc, c_ptr, stride_cm, a_bufs, b_bufs, c_smem, ready, empty, lead, offsets_ptr,
             M, N, K, E, SUBS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
             STAGES: gl.constexpr, E_POW2: gl.constexpr, B_NK: gl.constexpr, EPI_SPLIT: gl.constexpr,
             LEAD: gl.constexpr):
    BLOCK_M: gl.constexpr = SUBS * SUB_M
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    starts, ends, tiles, tiles_end = _group_table(offsets_ptr, E, M, N, BLOCK_M, BLOCK_N, E_POW2, 4)
    total_tiles = gl.sum(tiles, axis=0)
    step = 0
    if LEAD > 0:
        if SUB == 1:
            mbarrier.wait(lead, 0)
    for tile_id in range(gl.program_id(0), total_tiles, gl.num_programs(0)):
        group, row0, end, col0 = _locate(tile_id, starts, ends, tiles, tiles_end, N, BLOCK_M, BLOCK_N,
                                         GROUP_M, E_POW2, 4)
        k_end = gl.where(group < E, K, 0)
        sub_row0 = row0 + SUB * SUB_M
        if sub_row0 < end:
            acc = gl.zeros((SUB_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
            for k0 in range(0, k_end, BLOCK_K):
                slot = step % STAGES
                mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
                b_buf = b_bufs.index(slot)
                if B_NK:
                    b_buf = b_buf.permute((1, 0))
                acc = warpgroup_mma(a_bufs.index(slot * SUBS + SUB), b_buf, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
                if k0 > 0:
                    release(empty, step - 1, STAGES)
                step += 1
                if LEAD > 0:
                    if SUB == 0:
                        mbarrier.arrive(lead, pred=step == LEAD)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            if k_end > 0:
                release(empty, step - 1, STAGES)
            out = acc.to(c_desc.dtype)
            if sub_row0 + SUB_M <= end:
                PART: gl.constexpr = BLOCK_N // EPI_SPLIT
                if EPI_SPLIT == 1:
                    tma.store_wait(pendings=0)
                    c_smem.store(out)
                    fence_async_shared()
                    gl.thread_barrier()
                    tma.async_copy_shared_to_global(c_desc, [sub_row0, col0], c_smem)
                else:
                    left, right = out.reshape([SUB_M, 2, PART]).permute(0, 2, 1).split()
                    tma.store_wait(pendings=0)
                    c_smem.store(left)
                    fence_async_shared()
                    gl.thread_barrier()
                    tma.async_copy_shared_to_global(c_desc, [sub_row0, col0], c_smem)
                    tma.store_wait(pendings=0)
                    c_smem.store(right)
                    fence_async_shared()
                    gl.thread_barrier()
                    tma.async_copy_shared_to_global(c_desc, [sub_row0, col0 + PART], c_smem)
            else:
                rows = sub_row0 + gl.arange(0, SUB_M, layout=gl.SliceLayout(1, acc_layout))
                cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
                ptrs = c_ptr + rows.to(gl.int64)[:, None] * stride_cm + cols[None, :]
                gl.store(ptrs, out, mask=(rows < end)[:, None] & (cols < N)[None, :])
        else:
            for k0 in range(0, k_end, BLOCK_K):
                slot = step % STAGES
                mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
                release(empty, step, STAGES)
                step += 1
                if LEAD > 0:
                    if SUB == 0:
                        mbarrier.arrive(lead, pred=step == LEAD)
    if LEAD > 0:
        if SUB == 0:
            mbarrier.arrive(lead, pred=step < LEAD)
    tma.store_wait(pendings=0)


@gluon.jit
def _ragged_m_sub_kernel(a_desc, b_desc, c_desc, c_ptr, stride_cm, offsets_ptr, M, N, K, E,
                         SUBS: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                         GROUP_M: gl.constexpr, STAGES: gl.constexpr, E_POW2: gl.constexpr,
                         B_NK: gl.constexpr, EPI_SPLIT: gl.constexpr, WORKER_REGS: gl.constexpr,
                         LEAD: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES * SUBS, SUB_M, BLOCK_K], a_desc.layout)
    b_block: gl.constexpr = _b_block(BLOCK_K, BLOCK_N, B_NK)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, b_block[0], b_block[1]],
                                       gl.NVMMASharedLayout.get_default_for(b_block, dtype))
    c_smem = gl.allocate_shared_memory(dtype, [SUBS, SUB_M, BLOCK_N // EPI_SPLIT], c_desc.layout)
    ready, empty = stage_barriers(STAGES, SUBS)
    lead = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(lead, count=1)
    if SUBS == 2:
        gl.warp_specialize([
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, M, N, K, E,
                       SUBS, BLOCK_N, BLOCK_K, GROUP_M, STAGES, E_POW2, B_NK)),
            (_compute, (0, c_desc, c_ptr, stride_cm, a_bufs, b_bufs, c_smem.index(0), ready, empty, lead,
                        offsets_ptr, M, N, K, E, SUBS, BLOCK_N, BLOCK_K, GROUP_M, STAGES, E_POW2, B_NK, EPI_SPLIT, LEAD)),
            (_compute, (1, c_desc, c_ptr, stride_cm, a_bufs, b_bufs, c_smem.index(1), ready, empty, lead,
                        offsets_ptr, M, N, K, E, SUBS, BLOCK_N, BLOCK_K, GROUP_M, STAGES, E_POW2, B_NK, EPI_SPLIT, LEAD)),
        ], [4, 4], [WORKER_REGS, WORKER_REGS])
    else:
        gl.warp_specialize([
            (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, M, N, K, E,
                       SUBS, BLOCK_N, BLOCK_K, GROUP_M, STAGES, E_POW2, B_NK)),
            (_compute, (0, c_desc, c_ptr, stride_cm, a_bufs, b_bufs, c_smem.index(0), ready, empty, lead,
                        offsets_ptr, M, N, K, E, SUBS, BLOCK_N, BLOCK_K, GROUP_M, STAGES, E_POW2, B_NK, EPI_SPLIT, LEAD)),
            (_compute, (1, c_desc, c_ptr, stride_cm, a_bufs, b_bufs, c_smem.index(1), ready, empty, lead,
                        offsets_ptr, M, N, K, E, SUBS, BLOCK_N, BLOCK_K, GROUP_M, STAGES, E_POW2, B_NK, EPI_SPLIT, LEAD)),
            (_compute, (2, c_desc, c_ptr, stride_cm, a_bufs, b_bufs, c_smem.index(2), ready, empty, lead,
                        offsets_ptr, M, N, K, E, SUBS, BLOCK_N, BLOCK_K, GROUP_M, STAGES, E_POW2, B_NK, EPI_SPLIT, LEAD)),
        ], [4, 4, 4], [WORKER_REGS, WORKER_REGS, WORKER_REGS])


def ragged_m_sub(a, b, offsets, c, subs=2, stages=3, epi_split=1, lead=0, group_m=8, num_programs=132, bn=256,
                 bk=64, worker_regs=None):
    M, K = a.shape
    E, _, N = b.shape
    bm = 64 * subs
    b_nk = weight_nk(b)
    b_desc = descriptor(b.transpose(1, 2), [1, bn, bk]) if b_nk else descriptor(b, [1, bk, bn])
    max_tiles = (cdiv(M, bm) + E + 1) * cdiv(N, bn)
    grid = (max(1, min(num_programs, max_tiles)), )
    regs = worker_regs or (152 if subs == 3 else 232)
    return _ragged_m_sub_kernel[grid](
        descriptor(a, [64, bk]), b_desc, descriptor(c, [64, bn // epi_split]), c, c.stride(0), offsets,
        M, N, K, E, SUBS=subs, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, STAGES=stages,
        E_POW2=next_power_of_2(E + 1), B_NK=b_nk, EPI_SPLIT=epi_split, WORKER_REGS=regs, LEAD=lead, num_warps=4)
