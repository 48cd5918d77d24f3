"""Ragged-K grouped GEMM (weight gradient) for Hopper, warp-specialized, in Gluon.

    c[e] = a[s_e:t_e, :]^T @ b[s_e:t_e, :]     for every group e, with s_e = offsets[e-1], t_e = offsets[e]

Same contract as ``ragged_k.py`` for 16-bit a ``[M, K]`` and b ``[M, N]`` read through TMA, and c
``[E, K, N]`` of their dtype or fp32 (a ``main_grad``) written through TMA: overwritten, or added to
(every expert, or those whose flag is set), the current values being loaded while the tile reduces.

Why a second kernel: with short groups (a few hundred rows per expert) each output tile is a short
reduction followed by a 64 KB store, and a kernel whose warps both compute and store leaves the
tensor cores idle during every store and every pipeline refill. Here one loader warp runs ahead
through the program's tiles, filling a ring of shared-memory stages; the compute warps only wait
on it. Each finished tile is written to shared memory and stored by TMA asynchronously: the compute
warps go straight on to the next tile, and wait for that store only when the buffer comes round
again a whole tile later.

FP8 operands (``TOKENS_MAJOR``) come quantized per group along the tokens, laid out as
``dropless.quantized`` says: a ``[Mp, K]`` and b ``[Mp, N]``, views of ``[K, Mp]`` and ``[N, Mp]`` storage
(the tokens contiguous: the K-major layout of FP8 tensor cores), group e in rows ``[p_e, p_e + n_e)``,
``p_e = A * (s_e // A + e)`` (A = ``GROUP_ALIGN`` = 128); ``M`` is then the ``Mp - A E`` tokens the data
can hold. The stages hold ``[BLOCK_K, BLOCK_M]`` and ``[BLOCK_N, BLOCK_M]`` tiles (BLOCK_M divides A), and
the tensor cores accumulate the whole group in their fast FP8 mode. Every window of BLOCK_M rows starts
aligned and ends before the next group's rows (the layout's guarantee), so the rows past a group's end
in its last window are the layout's zeros and need no clearing. With one scale per group and column (rowwise, ``SCALED``), the epilogue
scales the tile once, ``c[e] = acc * sa[e, :, None] * sb[e, None, :]``.

The last row block of a group is partial: TMA reads whole blocks, so the rows past the group's end
(another group's, or unrouted rows that may hold anything) are zeroed in shared memory, in both
operands, before that block's MMA.

Each output tile's work is its group's row count, so with skewed routing the tiles of one big group
can be a few times longer than the rest. With a static schedule (program p takes every
num_programs-th tile) the programs that drew them finish long after the others. The by-work schedule
(``config.by_work``) hands tiles out one at a time from a counter shared by all programs, largest
groups first: a program that drew a long tile draws nothing more until it is done, and the short
tiles at the end fill the gaps. A scheduler warp draws each program's next tile while the current one
runs and queues its number for the loader and the compute warps, so the counter's latency stays off
their path.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    async_copy,
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from dropless.kernels.config import GemmConfig
from dropless.kernels.direct_launch import DirectLaunch
from dropless.kernels.launch import cdiv, next_power_of_2
from dropless.kernels.hopper import descriptor, group_bounds, post_item, raster, release, stage_barriers, take_item
from dropless.kernels.ragged_m import zeroed_counters
from dropless.quantized import GROUP_ALIGN

# By-work schedule: how many drawn tiles the scheduler warp may queue ahead of the loader.
QUEUE = 2
_GROUP_ALIGN = gl.constexpr(GROUP_ALIGN)  # rows: where each group of FP8 operands starts


@gluon.jit
def _tile_of(tile_id, tiles_k, tiles_n, GROUP_M: gl.constexpr):
    """Tile number -> (group, block row along K, block column along N)."""
    tiles_per_group = tiles_k * tiles_n
    pid_k, pid_n = raster(tile_id % tiles_per_group, tiles_k, tiles_n, GROUP_M)
    return tile_id // tiles_per_group, pid_k, pid_n


@gluon.jit
def _group_rows(offsets_ptr, group, M):
    """Row range ``[start, end)`` of ``group``, clamped into ``[0, M]`` with ``end >= start``."""
    start = gl.load(offsets_ptr + gl.maximum(group - 1, 0))
    start = gl.where(group > 0, start, 0)
    start = gl.minimum(gl.maximum(start, 0), M)
    end = gl.minimum(gl.maximum(gl.load(offsets_ptr + group), start), M)
    return start, end


@gluon.jit
def _data_rows(start, end, group, TOKENS_MAJOR: gl.constexpr):
    """Where the tokens ``[start, end)`` of ``group`` sit in the operands' rows: the same rows, or, for
    FP8 operands laid out per group, from the aligned row ``A * (start // A + group)``."""
    if TOKENS_MAJOR:
        row_start = (start // _GROUP_ALIGN + group) * _GROUP_ALIGN
        return row_start, row_start + (end - start)
    return start, end


@gluon.jit
def _size_ranks(offsets_ptr, E, M, E_POW2: gl.constexpr):
    """Each group's place when groups are taken largest first (ties: lower index first), as an
    ``[E_POW2]`` vector over one warp, -1 from entry E on. Sizes are the clamped row ranges of
    ``hopper.group_bounds``, which the loop over the groups recomputes one scalar at a time."""
    e = gl.arange(0, E_POW2, layout=gl.BlockedLayout([1], [32], [1], [0]))
    starts, ends = group_bounds(offsets_ptr, E, M, E_POW2, 1)
    sizes = ends - starts
    rank = gl.zeros_like(e)
    done = M - M
    for j in range(E):
        end_j = gl.maximum(done, gl.minimum(gl.maximum(gl.load(offsets_ptr + j), 0), M))
        size_j = end_j - done
        done = end_j
        rank += ((size_j > sizes) | ((size_j == sizes) & (j < e))).to(gl.int32)
    return gl.where(e < E, rank, -1)


@gluon.jit
def _scheduler(tile_ids, tile_ready, tile_empty, counter_ptr, offsets_ptr, M, E, total_tiles, tiles_k, tiles_n,
               BY_WORK: gl.constexpr, E_POW2: gl.constexpr, QUEUE: gl.constexpr):
    """One warp (BY_WORK only): draws tiles one at a time from a counter shared by all programs, groups
    largest first, and queues their numbers for the loader and the compute partition, ending with -1.
    It runs up to QUEUE tiles ahead, so the counter's latency is off the loader's path."""
    if BY_WORK:
        layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        e = gl.arange(0, E_POW2, layout=layout)
        rank = _size_ranks(offsets_ptr, E, M, E_POW2)
        tiles_per_group = tiles_k * tiles_n
        n = 0
        drawn = gl.atomic_add(counter_ptr, 1, sem="relaxed")
        while drawn < total_tiles:
            group = gl.sum(gl.where(rank == drawn // tiles_per_group, e, 0), axis=0)
            post_item(tile_ids, tile_ready, tile_empty, n, group * tiles_per_group + drawn % tiles_per_group, QUEUE)
            n += 1
            drawn = gl.atomic_add(counter_ptr, 1, sem="relaxed")
        # Every program ends on one draw past the tiles: the program whose draw is the launch's last
        # sets the counter back to zero for the next launch on the stream (no memset before each).
        if drawn == total_tiles + gl.num_programs(0) - 1:
            gl.atomic_xchg(counter_ptr, 0, sem="relaxed")
        post_item(tile_ids, tile_ready, tile_empty, n, -1, QUEUE)


@gluon.jit
def _load_tile(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, M, tile_id, step, tiles_k, tiles_n,
               sa_ptr, sb_ptr, stride_sa, stride_sb, sa_bufs, sb_bufs, K, N,
               BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
               STAGES: gl.constexpr, TOKENS_MAJOR: gl.constexpr, STEP_SCALES: gl.constexpr):
    """TMA loads of every row block of one tile into the stage ring; returns the next step number.
    STEP_SCALES: also each row block's scales of the tile's columns of a and b, ``sa[block, k0:]`` and
    ``sb[block, n0:]`` (0 past K and N), into ``sa_bufs [STAGES, BLOCK_K]`` and ``sb_bufs [STAGES, BLOCK_N]``
    by the warp's asynchronous copies, whose arrivals (one a thread) the ready barriers count."""
    group, pid_k, pid_n = _tile_of(tile_id, tiles_k, tiles_n, GROUP_M)
    start, end = _group_rows(offsets_ptr, group, M)
    start, end = _data_rows(start, end, group, TOKENS_MAJOR)
    if STEP_SCALES:
        ks = pid_k * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.BlockedLayout([BLOCK_K // 32], [32], [1], [0]))
        ns = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0]))
    for row in range(start, end, BLOCK_M):
        slot = step % STAGES
        # A slot is free once the MMA that read it completed; the ring starts out free.
        mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
        bar = ready.index(slot)
        mbarrier.expect(bar, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
        if TOKENS_MAJOR:
            tma.async_copy_global_to_shared(a_desc, [pid_k * BLOCK_K, row], bar, a_bufs.index(slot))
            tma.async_copy_global_to_shared(b_desc, [pid_n * BLOCK_N, row], bar, b_bufs.index(slot))
        else:
            tma.async_copy_global_to_shared(a_desc, [row, pid_k * BLOCK_K], bar, a_bufs.index(slot))
            tma.async_copy_global_to_shared(b_desc, [row, pid_n * BLOCK_N], bar, b_bufs.index(slot))
        if STEP_SCALES:
            block = (row // BLOCK_M).to(gl.int64)
            async_copy.async_copy_global_to_shared(sa_bufs.index(slot), sa_ptr + block * stride_sa + ks, mask=ks < K)
            async_copy.async_copy_global_to_shared(sb_bufs.index(slot), sb_ptr + block * stride_sb + ns, mask=ns < N)
            async_copy.mbarrier_arrive(bar, increment_count=False)
        step += 1
    return step


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_ids, tile_ready, tile_empty, offsets_ptr, M,
            total_tiles, tiles_k, tiles_n, sa_ptr, sb_ptr, stride_sa, stride_sb, sa_bufs, sb_bufs, K, N,
            BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
            STAGES: gl.constexpr, BY_WORK: gl.constexpr, QUEUE: gl.constexpr, TOKENS_MAJOR: gl.constexpr,
            STEP_SCALES: gl.constexpr = False):
    """One warp: TMA loads of every row block of every tile of this program, into the stage ring (with
    STEP_SCALES, each block's scales too: ``_load_tile``). The tiles are those the scheduler queues
    (BY_WORK), or every ``num_programs``-th tile in group order."""
    step = 0
    if BY_WORK:
        n = 0
        tile_id = take_item(tile_ids, tile_ready, tile_empty, n, QUEUE, 1)
        while tile_id >= 0:
            step = _load_tile(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, M, tile_id, step,
                              tiles_k, tiles_n, sa_ptr, sb_ptr, stride_sa, stride_sb, sa_bufs, sb_bufs, K, N,
                              BLOCK_M, BLOCK_K, BLOCK_N, GROUP_M, STAGES, TOKENS_MAJOR, STEP_SCALES)
            n += 1
            tile_id = take_item(tile_ids, tile_ready, tile_empty, n, QUEUE, 1)
    else:
        for tile_id in range(gl.program_id(0), total_tiles, gl.num_programs(0)):
            step = _load_tile(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, M, tile_id, step,
                              tiles_k, tiles_n, sa_ptr, sb_ptr, stride_sa, stride_sb, sa_bufs, sb_bufs, K, N,
                              BLOCK_M, BLOCK_K, BLOCK_N, GROUP_M, STAGES, TOKENS_MAJOR, STEP_SCALES)


@gluon.jit
def _zero_rows_past(buf, row0, end, BLOCK_M: gl.constexpr, WIDTH: gl.constexpr, num_warps: gl.constexpr):
    """Zero the rows ``row0 + i >= end`` of a ``[BLOCK_M, WIDTH]`` stage buffer in place."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, layout))
    values = buf.load(layout)
    values = gl.where((rows < end)[:, None], values, gl.zeros_like(values))
    buf.store(values)


@gluon.jit
def _group_scales(sa_ptr, sb_ptr, stride_sa, stride_sb, group, k0, n0, K, N, has_rows, layout: gl.constexpr,
                  BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr):
    """The tile's scales ``sa[group, k0:]`` and ``sb[group, n0:]`` (fp32), 0 for an empty group, whose
    scales may be anything."""
    ks = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, layout))
    ns = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    sa = gl.load(sa_ptr + group.to(gl.int64) * stride_sa + ks, mask=(ks < K) & has_rows, other=0.0)
    sb = gl.load(sb_ptr + group.to(gl.int64) * stride_sb + ns, mask=(ns < N) & has_rows, other=0.0)
    return sa, sb


@gluon.jit
def _prior_values(c_ptr, flags_ptr, group, k0, n0, K, N, stride_ce, stride_ck, layout: gl.constexpr,
                  BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, ACCUMULATE: gl.constexpr):
    """The output tile's current values in fp32, to add to: all of them (ACCUMULATE 1), or only where
    the group's flag is set (ACCUMULATE 2, zeros elsewhere)."""
    ks = k0 + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, layout))
    ns = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
    mask = (ks < K)[:, None] & (ns < N)[None, :]
    if ACCUMULATE == 2:
        mask = mask & (gl.load(flags_ptr + group) != 0)
    ptrs = c_ptr + group.to(gl.int64) * stride_ce + ks.to(gl.int64)[:, None] * stride_ck + ns[None, :]
    return gl.load(ptrs, mask=mask, other=0.0).to(gl.float32)


@gluon.jit
def _compute_tile(c_desc, c_ptr, flags_ptr, stride_ce, stride_ck, sa_ptr, sb_ptr, stride_sa, stride_sb, a_bufs, b_bufs,
                  c_smem, ready, empty, offsets_ptr, M, N, K, tile_id, step, tiles_k, tiles_n,
                  BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                  STAGES: gl.constexpr, ACCUMULATE: gl.constexpr, TOKENS_MAJOR: gl.constexpr, SCALED: gl.constexpr,
                  INSTR_K: gl.constexpr, num_warps: gl.constexpr):
    """The MMAs of one tile, then its epilogue through an asynchronous TMA store; returns the next step number."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, INSTR_K])
    group, pid_k, pid_n = _tile_of(tile_id, tiles_k, tiles_n, GROUP_M)
    start, end = _group_rows(offsets_ptr, group, M)
    if SCALED:
        sa, sb = _group_scales(sa_ptr, sb_ptr, stride_sa, stride_sb, group, pid_k * BLOCK_K, pid_n * BLOCK_N, K, N,
                               end > start, acc_layout, BLOCK_K, BLOCK_N)
    start, end = _data_rows(start, end, group, TOKENS_MAJOR)
    if ACCUMULATE != 0:
        # Loaded before the reduction, so the loads complete while the MMAs run.
        prior = _prior_values(c_ptr, flags_ptr, group, pid_k * BLOCK_K, pid_n * BLOCK_N, K, N, stride_ce,
                              stride_ck, acc_layout, BLOCK_K, BLOCK_N, ACCUMULATE)
    acc = gl.zeros((BLOCK_K, BLOCK_N), dtype=gl.float32, layout=acc_layout)
    for row in range(start, end, BLOCK_M):
        slot = step % STAGES
        mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
        a_buf = a_bufs.index(slot)
        b_buf = b_bufs.index(slot)
        if TOKENS_MAJOR:
            acc = warpgroup_mma(a_buf, b_buf.permute((1, 0)), acc, is_async=True)
        else:
            if row + BLOCK_M > end:
                _zero_rows_past(a_buf, row, end, BLOCK_M, BLOCK_K, num_warps)
                _zero_rows_past(b_buf, row, end, BLOCK_M, BLOCK_N, num_warps)
                fence_async_shared()
                gl.thread_barrier()
            acc = warpgroup_mma(a_buf.permute((1, 0)), b_buf, acc, is_async=True)
        # At most one MMA in flight: the previous step's is done, so its slot can be refilled.
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
        if row > start:
            release(empty, step - 1, STAGES)
        step += 1
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    if end > start:
        release(empty, step - 1, STAGES)
    if SCALED:
        acc = acc * sa[:, None] * sb[None, :]
    if ACCUMULATE != 0:
        acc += prior
    # The previous tile's store must have read c_smem before it is overwritten.
    tma.store_wait(pendings=0)
    c_smem.store(acc.to(c_desc.dtype))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(c_desc, [group, pid_k * BLOCK_K, pid_n * BLOCK_N],
                                    c_smem.reshape([1, BLOCK_K, BLOCK_N]))
    return step


@gluon.jit
def _compute(c_desc, c_ptr, flags_ptr, stride_ce, stride_ck, sa_ptr, sb_ptr, stride_sa, stride_sb, a_bufs, b_bufs,
             c_smem, ready, empty, tile_ids, tile_ready, tile_empty, offsets_ptr, M, N, K, total_tiles, tiles_k, tiles_n,
             BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
             STAGES: gl.constexpr, ACCUMULATE: gl.constexpr, BY_WORK: gl.constexpr, QUEUE: gl.constexpr,
             TOKENS_MAJOR: gl.constexpr, SCALED: gl.constexpr, INSTR_K: gl.constexpr, num_warps: gl.constexpr):
    """The default partition: every tile of this program, in the loader's order."""
    step = 0
    if BY_WORK:
        n = 0
        tile_id = take_item(tile_ids, tile_ready, tile_empty, n, QUEUE, num_warps)
        while tile_id >= 0:
            step = _compute_tile(c_desc, c_ptr, flags_ptr, stride_ce, stride_ck, sa_ptr, sb_ptr, stride_sa, stride_sb,
                                 a_bufs, b_bufs, c_smem, ready, empty, offsets_ptr, M, N, K, tile_id, step, tiles_k,
                                 tiles_n, BLOCK_M, BLOCK_K, BLOCK_N, GROUP_M, STAGES, ACCUMULATE, TOKENS_MAJOR, SCALED,
                                 INSTR_K, num_warps)
            n += 1
            tile_id = take_item(tile_ids, tile_ready, tile_empty, n, QUEUE, num_warps)
    else:
        for tile_id in range(gl.program_id(0), total_tiles, gl.num_programs(0)):
            step = _compute_tile(c_desc, c_ptr, flags_ptr, stride_ce, stride_ck, sa_ptr, sb_ptr, stride_sa, stride_sb,
                                 a_bufs, b_bufs, c_smem, ready, empty, offsets_ptr, M, N, K, tile_id, step, tiles_k,
                                 tiles_n, BLOCK_M, BLOCK_K, BLOCK_N, GROUP_M, STAGES, ACCUMULATE, TOKENS_MAJOR, SCALED,
                                 INSTR_K, num_warps)
    tma.store_wait(pendings=0)


@gluon.jit
def _ragged_k_hopper_kernel(a_desc, b_desc, c_desc, c_ptr, flags_ptr, stride_ce, stride_ck, sa_ptr, sb_ptr, stride_sa,
                            stride_sb, offsets_ptr, counter_ptr, M, N, K, E,
                            BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr,
                            GROUP_M: gl.constexpr, STAGES: gl.constexpr, ACCUMULATE: gl.constexpr,
                            BY_WORK: gl.constexpr, E_POW2: gl.constexpr, QUEUE: gl.constexpr,
                            TOKENS_MAJOR: gl.constexpr, SCALED: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    INSTR_K: gl.constexpr = 256 // dtype.primitive_bitwidth
    if TOKENS_MAJOR:
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_K, BLOCK_M], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, BLOCK_M], b_desc.layout)
    else:
        a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
        b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_N], b_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BLOCK_K, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], c_desc.dtype))
    ready, empty = stage_barriers(STAGES)
    # The queue of drawn tile numbers (BY_WORK): a slot is free again once the loader and the compute
    # partition have both read it.
    tile_ids = gl.allocate_shared_memory(gl.int32, [QUEUE, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    tile_ready, tile_empty = stage_barriers(QUEUE, readers=2)

    tiles_k = gl.cdiv(K, BLOCK_K)
    tiles_n = gl.cdiv(N, BLOCK_N)
    total_tiles = E * tiles_k * tiles_n
    gl.warp_specialize([
        (_compute, (c_desc, c_ptr, flags_ptr, stride_ce, stride_ck, sa_ptr, sb_ptr, stride_sa, stride_sb, a_bufs,
                    b_bufs, c_smem, ready, empty, tile_ids, tile_ready, tile_empty, offsets_ptr, M, N, K, total_tiles,
                    tiles_k, tiles_n, BLOCK_M, BLOCK_K, BLOCK_N, GROUP_M, STAGES, ACCUMULATE, BY_WORK, QUEUE,
                    TOKENS_MAJOR, SCALED, INSTR_K, num_warps)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_ids, tile_ready, tile_empty, offsets_ptr, M,
                   total_tiles, tiles_k, tiles_n, sa_ptr, sb_ptr, stride_sa, stride_sb, a_bufs, b_bufs, K, N,
                   BLOCK_M, BLOCK_K, BLOCK_N, GROUP_M, STAGES, BY_WORK, QUEUE, TOKENS_MAJOR)),
        (_scheduler, (tile_ids, tile_ready, tile_empty, counter_ptr, offsets_ptr, M, E, total_tiles, tiles_k, tiles_n,
                      BY_WORK, E_POW2, QUEUE)),
    ], [1, 1], [24, 48])


_LAUNCH = DirectLaunch(_ragged_k_hopper_kernel)


def ragged_k_mm_hopper(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, c: torch.Tensor,
                       accumulate: int, flags: torch.Tensor | None, config: GemmConfig, num_programs: int,
                       scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Launch on 16-bit ``a [M, K]`` and ``b [M, N]``, int32 ``offsets [E]``, and ``c [E, K, N]`` (N
    contiguous) of a's dtype or fp32, all of which ``launch.hopper_wgrad_ok`` accepts. ``accumulate``
    as in ``ragged_k.ragged_k_mm``: 0 writes, 1 adds, 2 adds where the bool ``flags [E]`` are set.
    ``config.by_work``: tiles drawn from a counter (``ragged_m.zeroed_counters``, left zeroed), largest
    groups first.

    float8_e4m3fn ``a [Mp, K]`` and ``b [Mp, N]`` are quantized per group along the tokens (the module
    docstring's layout: views of ``[K, Mp]`` and ``[N, Mp]`` storage, TMA-readable), c bf16, fp16 or
    fp32; ``scales = (sa, sb)``: fp32 ``sa [E, K]`` and ``sb [E, N]`` with unit stride along K and N,
    one per group and column, applied in the epilogue.
    """
    E = c.shape[0]
    tokens_major = a.element_size() == 1
    M = a.shape[0] - GROUP_ALIGN * E if tokens_major else a.shape[0]
    K, N = a.shape[1], b.shape[1]
    bm, bk, bn = config.block_m, config.block_k, config.block_n
    if tokens_major and GROUP_ALIGN % bm:
        raise ValueError(f"FP8 operands need token steps that divide {GROUP_ALIGN}, got block_m={bm}")
    total_tiles = E * cdiv(K, bk) * cdiv(N, bn)
    grid = (max(1, min(num_programs, total_tiles)), )
    counter = zeroed_counters(a.device, 1) if config.by_work else offsets
    if tokens_major:
        a_desc, b_desc = descriptor(a.t(), [bk, bm]), descriptor(b.t(), [bn, bm])
    else:
        a_desc, b_desc = descriptor(a, [bm, bk]), descriptor(b, [bm, bn])
    sa, sb = scales if scales is not None else (c, c)
    # Everything the launch's specialization depends on, for DirectLaunch's per-call key.
    call_key = ("ragged_k", a.shape, a.stride(), a.dtype, b.shape, b.stride(), c.shape, c.stride(), c.dtype, config,
                accumulate, offsets.dtype, offsets.data_ptr() % 16, c.data_ptr() % 16, counter.data_ptr() % 16)
    if flags is not None:
        call_key += (flags.dtype, flags.data_ptr() % 16)
    if scales is not None:
        call_key += (sa.dtype, sa.stride(0), sa.data_ptr() % 16, sb.dtype, sb.stride(0), sb.data_ptr() % 16)
    _LAUNCH(grid, call_key, a_desc=a_desc, b_desc=b_desc, c_desc=descriptor(c, [1, bk, bn]),
            c_ptr=c, flags_ptr=flags if flags is not None else offsets, stride_ce=c.stride(0), stride_ck=c.stride(1),
            sa_ptr=sa, sb_ptr=sb, stride_sa=sa.stride(0) if scales is not None else 0,
            stride_sb=sb.stride(0) if scales is not None else 0,
            offsets_ptr=offsets, counter_ptr=counter, M=M, N=N, K=K, E=E, BLOCK_M=bm, BLOCK_K=bk, BLOCK_N=bn,
            GROUP_M=config.group_m, STAGES=config.num_stages, ACCUMULATE=accumulate, BY_WORK=config.by_work,
            E_POW2=next_power_of_2(E), QUEUE=QUEUE, TOKENS_MAJOR=tokens_major, SCALED=scales is not None,
            num_warps=config.num_warps)
