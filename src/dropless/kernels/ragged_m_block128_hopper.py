"""Ragged-M FP8 grouped GEMM with block128 scales for Hopper, warp-specialized, in Gluon.

    c[s_e:t_e, n] = sum_j sa[m, j] * sb[e, j, n // 128] * sum_{k in block j} a[m, k] b[e, k, n]

a ``[M, K]`` e4m3 with 1x128 scales ``sa [M, cdiv(K, 128)]`` (DeepSeek-V3's activations), b ``[E, K, N]``
e4m3 with K contiguous and 128x128 scales ``sb [E, cdiv(K, 128), cdiv(N, 128)]`` (its weights), c
``[M, N]`` in bf16 or fp16; the rows past ``offsets[-1]`` are written as zeros (left alone with
``tail=False``). Each 128-deep step's product starts from zero on the tensor cores and is promoted
into an fp32 accumulator with its scales, as DeepGEMM does: the tensor cores' short FP8 accumulation
never spans more than one block.

The promotion is register arithmetic that the tensor cores would wait for if one warpgroup did both.
So each 128x128 tile is shared by two compute partitions of one warpgroup each, the tile's upper and
lower 64 rows, with nothing synchronizing them but the stage ring: while one scales and adds its
product the other's MMA runs, and the tensor cores' queue keeps them half a step apart. A loader
warpgroup fills the ring with TMA loads of both halves' rows and the weight tile they share; a stage
goes back once both partitions are done with it. The loader also copies each step's column of the row
scales into the stage (asynchronous copies, counted by the stage's ready barrier), so the partitions
read them from shared memory: loaded from global memory in the partitions, the scales cost ~15% of
the kernel's rate. The tile numbering, raster order and loader are the rowwise kernel's
(``ragged_m_hopper``).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from dropless.kernels.config import GemmConfig
from dropless.kernels.direct_launch import DirectLaunch
from dropless.kernels.hopper import descriptor, release, stage_barriers
from dropless.kernels.launch import cdiv, next_power_of_2
from dropless.kernels.ragged_m_hopper import (
    LOADER_WARPS,
    _group_table,
    _loader,
    _locate,
    _store_from,
    _tiles_to_run,
)

# Rows of a tile per compute partition: one warpgroup's wgmma height.
HALF_M: gl.constexpr = gl.constexpr(64)


@gluon.jit
def _half(c_desc, c_ptr, stride_cm, sb_ptr, stride_sbe, stride_sbk, stride_sbn,
          a_bufs, b_bufs, s_bufs, c_buf, ready, empty, offsets_ptr, M, N, K, E,
          HALF: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
          GROUP_M: gl.constexpr, STAGES: gl.constexpr, E_POW2: gl.constexpr, ZERO_TAIL: gl.constexpr):
    """One compute partition: rows ``HALF * 64`` to ``HALF * 64 + 63`` of every tile of the program,
    its whole 64-row blocks stored through its own shared buffer ``c_buf``."""
    WARPS: gl.constexpr = 4
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    starts, ends, tiles, tiles_end = _group_table(offsets_ptr, E, M, N, BLOCK_M, BLOCK_N, E_POW2, WARPS)
    total_tiles = _tiles_to_run(tiles, tiles_end, E, ZERO_TAIL)
    step = 0
    for tile_id in range(gl.program_id(0), total_tiles, gl.num_programs(0)):
        group, row0, end, col0 = _locate(tile_id, starts, ends, tiles, tiles_end, N, BLOCK_M, BLOCK_N,
                                         GROUP_M)
        first = row0 + HALF * HALF_M
        rows = first + gl.arange(0, HALF_M, layout=row_layout)
        live = rows < end
        k_end = gl.where(group < E, K, 0)  # the unrouted tail's tiles are zeros: nothing to multiply
        sb_tile = sb_ptr + group.to(gl.int64) * stride_sbe + (col0 // 128) * stride_sbn
        acc = gl.zeros((HALF_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        # Each step's product starts from zero in the registers of the last one, already added: no
        # copy of the accumulator into the MMA's registers.
        part = gl.zeros((HALF_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        for k0 in range(0, k_end, BLOCK_K):
            slot = step % STAGES
            sb = gl.load(sb_tile + (k0 // 128) * stride_sbk)
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            a_half = a_bufs.index(slot).slice(HALF * HALF_M, HALF_M)
            part = warpgroup_mma(a_half, b_bufs.index(slot).permute((1, 0)), part, use_acc=False, is_async=True)
            # The step's row scales (0 past the group), read before the stage goes back.
            scale = s_bufs.index(slot).slice(HALF * HALF_M, HALF_M).load(row_layout) * sb
            part = warpgroup_mma_wait(num_outstanding=0, deps=(part, ))
            release(empty, step, STAGES)
            acc += part * scale[:, None]
            step += 1
        out = acc.to(c_desc.dtype)
        if first + HALF_M <= end:
            # The previous tile's store must have read c_buf before it is overwritten.
            tma.store_wait(pendings=0)
            _store_from(c_desc, c_buf, out, first, col0)
        else:
            cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            ptrs = c_ptr + rows.to(gl.int64)[:, None] * stride_cm + cols[None, :]
            gl.store(ptrs, out, mask=live[:, None] & (cols < N)[None, :])
    tma.store_wait(pendings=0)


@gluon.jit
def _ragged_m_block128_kernel(a_desc, b_desc, c_desc, c_ptr, stride_cm, sa_ptr, sb_ptr, stride_sam, stride_sak,
                              stride_sbe, stride_sbk, stride_sbn, offsets_ptr, M, N, K, E,
                              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                              GROUP_M: gl.constexpr, STAGES: gl.constexpr, E_POW2: gl.constexpr,
                              ZERO_TAIL: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_K], dtype))
    c_upper = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    c_lower = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    # Each stage's row scales, copied in by every loader thread (each thread's arrival counted).
    s_bufs = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    ready, empty = stage_barriers(STAGES, 2, 1 + 32 * LOADER_WARPS)
    gl.warp_specialize([
        (_half, (c_desc, c_ptr, stride_cm, sb_ptr, stride_sbe, stride_sbk, stride_sbn, a_bufs, b_bufs, s_bufs,
                 c_upper, ready, empty, offsets_ptr, M, N, K, E, 0, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES,
                 E_POW2, ZERO_TAIL)),
        (_half, (c_desc, c_ptr, stride_cm, sb_ptr, stride_sbe, stride_sbk, stride_sbn, a_bufs, b_bufs, s_bufs,
                 c_lower, ready, empty, offsets_ptr, M, N, K, E, 1, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES,
                 E_POW2, ZERO_TAIL)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, M, N, K, E, sa_ptr, stride_sam,
                   stride_sak, s_bufs, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, E_POW2, True, ZERO_TAIL, True)),
    ], [4, LOADER_WARPS], [232, 40])


_LAUNCH = DirectLaunch(_ragged_m_block128_kernel)
# 128x128 tiles (one weight scale per tile and step), 128-deep steps, four stages.
BLOCK128_CONFIG = GemmConfig(128, 128, 128, num_warps=4, num_stages=4, gluon=True)


def ragged_m_block128_hopper(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor,
                             offsets: torch.Tensor, c: torch.Tensor, num_programs: int,
                             config: GemmConfig = BLOCK128_CONFIG, tail: bool = True) -> None:
    """Launch on e4m3 ``a [M, K]`` (TMA-readable) with fp32 ``sa [M, cdiv(K, 128)]``, e4m3 ``b [E, K, N]``
    with K contiguous and fp32 ``sb [E, cdiv(K, 128), cdiv(N, 128)]`` (scales at any strides), int32
    ``offsets [E]`` and bf16/fp16 ``c [M, N]``, on an sm_90 GPU. ``config``: 128x128 tiles, 128-deep
    steps (ValueError otherwise). ``tail``: write zeros over the rows past ``offsets[-1]``."""
    if (config.block_m, config.block_n, config.block_k) != (128, 128, 128):
        raise ValueError(f"the block128 kernel runs 128x128 tiles in 128-deep steps, got {config}")
    M, K = a.shape
    E, _, N = b.shape
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    max_tiles = (cdiv(M, bm) + E + 1) * cdiv(N, bn)
    grid = (max(1, min(num_programs, max_tiles)), )
    _LAUNCH(grid, a_desc=descriptor(a, [bm, bk]), b_desc=descriptor(b.transpose(1, 2), [1, bn, bk]),
            c_desc=descriptor(c, [HALF_M.value, bn]), c_ptr=c, stride_cm=c.stride(0), sa_ptr=sa, sb_ptr=sb,
            stride_sam=sa.stride(0), stride_sak=sa.stride(1), stride_sbe=sb.stride(0), stride_sbk=sb.stride(1),
            stride_sbn=sb.stride(2), offsets_ptr=offsets, M=M, N=N, K=K, E=E, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            GROUP_M=config.group_m, STAGES=config.num_stages, E_POW2=next_power_of_2(E + 1), ZERO_TAIL=tail,
            num_warps=4)
