"""Ragged-K FP8 grouped GEMM (weight gradient) with block128 scales for Hopper, warp-specialized, in Gluon.

    c[e] (+)= sum_j (sa[r_j, :, None] * sb[r_j, None, :]) * (a[block j of e]^T @ b[block j of e])

a ``[Mp, K]`` and b ``[Mp, N]`` e4m3 quantized per group along the tokens in blocks of 128 tokens, laid out
as ``dropless.quantized`` says (views of ``[K, Mp]`` and ``[N, Mp]`` storage, group e from the aligned row
``p_e = 128 (s_e // 128 + e)``, zeros after its rows up to the next aligned row); the scales
``sa [cdiv(Mp - 128 E, 128) + E, K]`` and ``sb`` likewise with N, block j of group e at row
``r_j = (p_e + 128 j) // 128``. c ``[E, K, N]`` bf16, fp16 or fp32, written, or added to (all experts, or
those whose flag is set).

Each 128-token step's product starts from zero on the tensor cores and is promoted into an fp32
accumulator scaled by its block's column scales of a and b (an outer product), as DeepGEMM's weight
gradient does. As in the block128 forward (``ragged_m_block128_hopper``), two compute warpgroups share
each 128x128 output tile, its rows 0-63 and 64-127 (the K side), unsynchronized but by the stage ring,
so one promotes while the other's MMA runs. The loader also copies each step's scales of the tile's
columns of a and b into the stage (asynchronous copies counted by its ready barrier), so the partitions
read them from shared memory: loaded from global memory in the partitions (32 columns of b a thread
each step), they cost ~30% of the kernel's rate. The loader and the tile numbering are the
weight-gradient kernel's (``ragged_k_hopper``, static schedule).
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
from dropless.kernels.hopper import descriptor, release, stage_barriers
from dropless.kernels.launch import cdiv
from dropless.kernels.ragged_k_hopper import _data_rows, _group_rows, _loader, _tile_of
from dropless.quantized import GROUP_ALIGN

HALF_K: gl.constexpr = gl.constexpr(64)  # output rows (the K side) per compute partition
QUEUE: gl.constexpr = gl.constexpr(1)  # the loader's tile queue (its by-work schedule), unused here


@gluon.jit
def _half(c_desc, flags_ptr, a_bufs, b_bufs, sa_bufs, sb_bufs, c_buf, prior_bar, ready, empty,
          offsets_ptr, M, total_tiles, tiles_k, tiles_n,
          HALF: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr,
          GROUP_M: gl.constexpr, STAGES: gl.constexpr, ACCUMULATE: gl.constexpr):
    """One compute partition: output rows ``HALF * 64`` to ``HALF * 64 + 63`` of every tile of the program."""
    WARPS: gl.constexpr = 4
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    step = 0
    priors = 0
    for tile_id in range(gl.program_id(0), total_tiles, gl.num_programs(0)):
        group, pid_k, pid_n = _tile_of(tile_id, tiles_k, tiles_n, GROUP_M)
        k0 = pid_k * BLOCK_K + HALF * HALF_K
        n0 = pid_n * BLOCK_N
        start, end = _group_rows(offsets_ptr, group, M)
        start, end = _data_rows(start, end, group, True)
        acc = gl.zeros((HALF_K, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        part = gl.zeros((HALF_K, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        for row in range(start, end, BLOCK_M):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            a_half = a_bufs.index(slot).slice(HALF * HALF_K, HALF_K)
            part = warpgroup_mma(a_half, b_bufs.index(slot).permute((1, 0)), part, use_acc=False, is_async=True)
            # The block's scales of the tile's rows and columns (0 past K and N), read before the stage goes back.
            sa = sa_bufs.index(slot).slice(HALF * HALF_K, HALF_K).load(gl.SliceLayout(1, acc_layout))
            sb = sb_bufs.index(slot).load(gl.SliceLayout(0, acc_layout))
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            release(empty, step, STAGES)
            acc += part * sa[:, None] * sb[None, :]
            step += 1
        # The previous tile's store must have read c_buf before it is overwritten.
        tma.store_wait(pendings=0)
        if ACCUMULATE != 0:
            # The tile's current values come in through c_buf by TMA (pointers to a whole tile would
            # take more registers than the partition has).
            added = True
            if ACCUMULATE == 2:
                added = gl.load(flags_ptr + group) != 0
            if added:
                mbarrier.expect(prior_bar, c_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(c_desc, [group, k0, n0], prior_bar, c_buf.reshape([1, HALF_K, BLOCK_N]))
                mbarrier.wait(prior_bar, priors & 1)
                priors += 1
                acc += c_buf.load(acc_layout).to(gl.float32)
                gl.thread_barrier()
        c_buf.store(acc.to(c_desc.dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(c_desc, [group, k0, n0], c_buf.reshape([1, HALF_K, BLOCK_N]))
    tma.store_wait(pendings=0)


@gluon.jit
def _ragged_k_block128_kernel(a_desc, b_desc, c_desc, flags_ptr, sa_ptr, sb_ptr, stride_sa, stride_sb, offsets_ptr,
                              M, N, K, E,
                              BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr,
                              GROUP_M: gl.constexpr, STAGES: gl.constexpr, ACCUMULATE: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_M], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_M], b_desc.layout)
    c_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HALF_K, BLOCK_N], c_desc.dtype)
    c_upper = gl.allocate_shared_memory(c_desc.dtype, [HALF_K, BLOCK_N], c_layout)
    c_lower = gl.allocate_shared_memory(c_desc.dtype, [HALF_K, BLOCK_N], c_layout)
    # Each stage's scales of the tile's rows and columns, copied in by the loader warp's 32 threads.
    scale_layout: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    sa_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_K], scale_layout)
    sb_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], scale_layout)
    ready, empty = stage_barriers(STAGES, 2, 1 + 32)
    prior_bars, _ = stage_barriers(2)  # each partition's: its tile's current values loaded (ACCUMULATE)
    # The loader's queue of drawn tiles is for its by-work schedule, unused here (static schedule).
    tile_ids = gl.allocate_shared_memory(gl.int32, [QUEUE, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    tile_ready, tile_empty = stage_barriers(QUEUE, readers=2)
    tiles_k = gl.cdiv(K, BLOCK_K)
    tiles_n = gl.cdiv(N, BLOCK_N)
    total_tiles = E * tiles_k * tiles_n
    gl.warp_specialize([
        (_half, (c_desc, flags_ptr, a_bufs, b_bufs, sa_bufs, sb_bufs, c_upper,
                 prior_bars.index(0), ready, empty, offsets_ptr, M, total_tiles, tiles_k, tiles_n, 0,
                 BLOCK_M, BLOCK_K, BLOCK_N, GROUP_M, STAGES, ACCUMULATE)),
        (_half, (c_desc, flags_ptr, a_bufs, b_bufs, sa_bufs, sb_bufs, c_lower,
                 prior_bars.index(1), ready, empty, offsets_ptr, M, total_tiles, tiles_k, tiles_n, 1,
                 BLOCK_M, BLOCK_K, BLOCK_N, GROUP_M, STAGES, ACCUMULATE)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_ids, tile_ready, tile_empty, offsets_ptr, M,
                   total_tiles, tiles_k, tiles_n, sa_ptr, sb_ptr, stride_sa, stride_sb, sa_bufs, sb_bufs, K, N,
                   BLOCK_M, BLOCK_K, BLOCK_N, GROUP_M, STAGES, False, QUEUE, True, True)),
    ], [4, 1], [232, 40])


_LAUNCH = DirectLaunch(_ragged_k_block128_kernel)
# 128-token steps (one scale block each), 128x128 output tiles, four stages.
BLOCK128_WGRAD_CONFIG = GemmConfig(128, 128, 128, num_warps=4, num_stages=4, gluon=True)


def ragged_k_block128_hopper(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                             offsets: torch.Tensor, c: torch.Tensor, accumulate: int, flags: torch.Tensor | None,
                             num_programs: int, config: GemmConfig = BLOCK128_WGRAD_CONFIG) -> None:
    """Launch on e4m3 ``a [Mp, K]`` and ``b [Mp, N]`` laid out per group along the tokens (views of ``[K, Mp]``
    and ``[N, Mp]`` storage, TMA-readable), fp32 block scales ``sa`` and ``sb`` (unit stride along K and N),
    int32 ``offsets [E]``, and ``c [E, K, N]`` (N contiguous, TMA-writable) in bf16, fp16 or fp32, on an
    sm_90 GPU. ``accumulate``: 0 writes, 1 adds, 2 adds where the bool ``flags [E]`` are set."""
    if (config.block_m, config.block_k, config.block_n) != (128, 128, 128):
        raise ValueError(f"the block128 weight gradient runs 128x128 tiles in 128-token steps, got {config}")
    E = c.shape[0]
    M = a.shape[0] - GROUP_ALIGN * E
    K, N = a.shape[1], b.shape[1]
    bm, bk, bn = config.block_m, config.block_k, config.block_n
    total_tiles = E * cdiv(K, bk) * cdiv(N, bn)
    grid = (max(1, min(num_programs, total_tiles)), )
    _LAUNCH(grid, a_desc=descriptor(a.t(), [bk, bm]), b_desc=descriptor(b.t(), [bn, bm]),
            c_desc=descriptor(c, [1, HALF_K.value, bn]), flags_ptr=flags if flags is not None else offsets, sa_ptr=sa,
            sb_ptr=sb, stride_sa=sa.stride(0), stride_sb=sb.stride(0), offsets_ptr=offsets, M=M, N=N, K=K, E=E,
            BLOCK_M=bm, BLOCK_K=bk, BLOCK_N=bn, GROUP_M=config.group_m, STAGES=config.num_stages,
            ACCUMULATE=accumulate, num_warps=4)
