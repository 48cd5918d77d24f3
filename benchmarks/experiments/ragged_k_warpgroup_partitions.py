"""Experimental ragged-K (wgrad) Gluon kernel: two compute partitions, each one warpgroup owning 64 rows
(along K) of a 128 x BLOCK_N dw tile, with an optional lead (sub 1 starts after sub 0 has done LEAD
steps) so that one partition's epilogue overlaps the other's MMAs. Written in the operands' dtype only."""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from dropless.kernels.hopper import descriptor, release, stage_barriers
from dropless.kernels.launch import cdiv, next_power_of_2
from dropless.kernels.ragged_k_hopper import (
    QUEUE, _group_rows, _scheduler, _take_tile, _tile_of, _zero_rows_past)

SUB_K: gl.constexpr = gl.constexpr(64)


@gluon.jit
def _load_tile(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, M, tile_id, step, tiles_k, tiles_n,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    group, pid_k, pid_n = _tile_of(tile_id, tiles_k, tiles_n, GROUP_M)
    start, end = _group_rows(offsets_ptr, group, M)
    for row in range(start, end, BLOCK_M):
        slot = step % STAGES
        mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(a_desc, [row, pid_k * 2 * SUB_K], bar, a_bufs.index(2 * slot))
        tma.async_copy_global_to_shared(a_desc, [row, pid_k * 2 * SUB_K + SUB_K], bar, a_bufs.index(2 * slot + 1))
        tma.async_copy_global_to_shared(b_desc, [row, pid_n * BLOCK_N], bar, b_bufs.index(slot))
        step += 1
    return step


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_ids, tile_ready, tile_empty, offsets_ptr, M,
            total_tiles, tiles_k, tiles_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
            STAGES: gl.constexpr, BY_WORK: gl.constexpr, QUEUE: gl.constexpr):
    step = 0
    if BY_WORK:
        n = 0
        tile_id = _take_tile(tile_ids, tile_ready, tile_empty, n, QUEUE, 1)
        while tile_id >= 0:
            step = _load_tile(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, M, tile_id, step,
                              tiles_k, tiles_n, BLOCK_M, BLOCK_N, GROUP_M, STAGES)
            n += 1
            tile_id = _take_tile(tile_ids, tile_ready, tile_empty, n, QUEUE, 1)
    else:
        for tile_id in range(gl.program_id(0), total_tiles, gl.num_programs(0)):
            step = _load_tile(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, M, tile_id, step,
                              tiles_k, tiles_n, BLOCK_M, BLOCK_N, GROUP_M, STAGES)


@gluon.jit
def _compute_tile(SUB: gl.constexpr, c_desc, a_bufs, b_bufs, c_smem, ready, empty, zeroed, lead, offsets_ptr,
                  M, tile_id, step, tiles_k, tiles_n, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  GROUP_M: gl.constexpr, STAGES: gl.constexpr, LEAD: gl.constexpr):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    group, pid_k, pid_n = _tile_of(tile_id, tiles_k, tiles_n, GROUP_M)
    start, end = _group_rows(offsets_ptr, group, M)
    acc = gl.zeros((SUB_K, BLOCK_N), dtype=gl.float32, layout=acc_layout)
    for row in range(start, end, BLOCK_M):
        slot = step % STAGES
        a_buf = a_bufs.index(2 * slot + SUB)
        b_buf = b_bufs.index(slot)
        if SUB == 0:
            # Partition 0 zeroes the rows past the group's end in its A block and in the shared B block,
            # then tells partition 1 (which waits for that instead of the load) the stage is ready.
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            if row + BLOCK_M > end:
                _zero_rows_past(a_buf, row, end, BLOCK_M, SUB_K, 4)
                _zero_rows_past(b_buf, row, end, BLOCK_M, BLOCK_N, 4)
                fence_async_shared()
                gl.thread_barrier()
            mbarrier.arrive(zeroed.index(slot), count=1)
        else:
            mbarrier.wait(zeroed.index(slot), (step // STAGES) & 1)
            if row + BLOCK_M > end:
                _zero_rows_past(a_buf, row, end, BLOCK_M, SUB_K, 4)
                fence_async_shared()
                gl.thread_barrier()
        acc = warpgroup_mma(a_buf.permute((1, 0)), b_buf, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        if row > start:
            release(empty, step - 1, STAGES)
        step += 1
        if LEAD > 0:
            if SUB == 0:
                mbarrier.arrive(lead, pred=step == LEAD)
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    if end > start:
        release(empty, step - 1, STAGES)
    tma.store_wait(pendings=0)
    c_smem.store(acc.to(c_desc.dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(c_desc, [group, pid_k * 2 * SUB_K + SUB * SUB_K, pid_n * BLOCK_N],
                                    c_smem.reshape([1, SUB_K, BLOCK_N]))
    return step


@gluon.jit
def _compute(SUB: gl.constexpr, c_desc, a_bufs, b_bufs, c_smem, ready, empty, zeroed, lead, tile_ids, tile_ready,
             tile_empty, offsets_ptr, M, total_tiles, tiles_k, tiles_n, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, BY_WORK: gl.constexpr,
             QUEUE: gl.constexpr, LEAD: gl.constexpr):
    step = 0
    if LEAD > 0:
        if SUB == 1:
            mbarrier.wait(lead, 0)
    if BY_WORK:
        n = 0
        tile_id = _take_tile(tile_ids, tile_ready, tile_empty, n, QUEUE, 4)
        while tile_id >= 0:
            step = _compute_tile(SUB, c_desc, a_bufs, b_bufs, c_smem, ready, empty, zeroed, lead, offsets_ptr,
                                 M, tile_id, step, tiles_k, tiles_n, BLOCK_M, BLOCK_N, GROUP_M, STAGES, LEAD)
            n += 1
            tile_id = _take_tile(tile_ids, tile_ready, tile_empty, n, QUEUE, 4)
    else:
        for tile_id in range(gl.program_id(0), total_tiles, gl.num_programs(0)):
            step = _compute_tile(SUB, c_desc, a_bufs, b_bufs, c_smem, ready, empty, zeroed, lead, offsets_ptr,
                                 M, tile_id, step, tiles_k, tiles_n, BLOCK_M, BLOCK_N, GROUP_M, STAGES, LEAD)
    if LEAD > 0:
        if SUB == 0:
            mbarrier.arrive(lead, pred=step < LEAD)
    tma.store_wait(pendings=0)


@gluon.jit
def _rk_sub_kernel(a_desc, b_desc, c_desc, offsets_ptr, counter_ptr, M, N, K, E,
                   BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                   BY_WORK: gl.constexpr, E_POW2: gl.constexpr, QUEUE: gl.constexpr, LEAD: gl.constexpr,
                   WORKER_REGS: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [2 * STAGES, BLOCK_M, SUB_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_N], b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [2, SUB_K, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([SUB_K, BLOCK_N], c_desc.dtype))
    ready, empty = stage_barriers(STAGES, 2)
    zeroed, unused = stage_barriers(STAGES)
    lead = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(lead, count=1)
    tile_ids = gl.allocate_shared_memory(gl.int32, [QUEUE, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    tile_ready, tile_empty = stage_barriers(QUEUE, readers=3)
    tiles_k = gl.cdiv(K, 2 * SUB_K)
    tiles_n = gl.cdiv(N, BLOCK_N)
    total_tiles = E * tiles_k * tiles_n
    gl.warp_specialize([
        (_compute, (0, c_desc, a_bufs, b_bufs, c_smem.index(0), ready, empty, zeroed, lead, tile_ids, tile_ready,
                    tile_empty, offsets_ptr, M, total_tiles, tiles_k, tiles_n, BLOCK_M, BLOCK_N, GROUP_M, STAGES,
                    BY_WORK, QUEUE, LEAD)),
        (_compute, (1, c_desc, a_bufs, b_bufs, c_smem.index(1), ready, empty, zeroed, lead, tile_ids, tile_ready,
                    tile_empty, offsets_ptr, M, total_tiles, tiles_k, tiles_n, BLOCK_M, BLOCK_N, GROUP_M, STAGES,
                    BY_WORK, QUEUE, LEAD)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_ids, tile_ready, tile_empty, offsets_ptr, M,
                   total_tiles, tiles_k, tiles_n, BLOCK_M, BLOCK_N, GROUP_M, STAGES, BY_WORK, QUEUE)),
        (_scheduler, (tile_ids, tile_ready, tile_empty, counter_ptr, offsets_ptr, M, E, total_tiles, tiles_k, tiles_n,
                      BY_WORK, E_POW2, QUEUE)),
    ], [4, 1, 1], [WORKER_REGS, 24, 48])


def rk_sub(a, b, offsets, c, block_m=32, stages=6, by_work=True, lead=0, group_m=8, num_programs=132, bn=256,
           worker_regs=232):
    """c[e] = a_e^T @ b_e for a [M, K], b [M, N], c [E, K, N] of a's dtype (written, not added)."""
    M, K = a.shape
    N = b.shape[1]
    E = c.shape[0]
    total_tiles = E * cdiv(K, 128) * cdiv(N, bn)
    grid = (max(1, min(num_programs, total_tiles)), )
    counter = torch.zeros(1, dtype=torch.int32, device=a.device) if by_work else offsets
    return _rk_sub_kernel[grid](descriptor(a, [block_m, 64]), descriptor(b, [block_m, bn]),
                                descriptor(c, [1, 64, bn]), offsets, counter, M, N, K, E, BLOCK_M=block_m,
                                BLOCK_N=bn, GROUP_M=group_m, STAGES=stages, BY_WORK=by_work,
                                E_POW2=next_power_of_2(E), QUEUE=QUEUE, LEAD=lead, WORKER_REGS=worker_regs,
                                num_warps=4)
