"""Ragged-M grouped GEMM (forward and input gradient) for Hopper, warp-specialized, in Gluon.

    c[s_e:t_e, :] = a[s_e:t_e, :] @ b[e]          for every group e, with s_e = offsets[e-1], t_e = offsets[e]
    c[offsets[E-1]:M, :] = 0                       (rows that belong to no expert; left alone with tail=False)

Same contract as ``ragged_m.py`` for 16-bit operands that TMA can read: a ``[M, K]`` row-major, b
``[E, K, N]`` with N or K contiguous, c ``[M, N]`` row-major, all of one dtype. Or FP8 (e4m3) a and b,
b with K contiguous (the K-major operand FP8 wgmma reads), with rowwise scales applied in the epilogue:

    c[m, n] = sa[m] * sb[e, n] * sum_k a[m, k] b[e, k, n]          (fp32 accumulation, c in bf16/fp16/fp32)

Tiles are numbered group after group (group E is the unrouted tail, written as zeros); every
partition derives that numbering from ``offsets`` on the device. One loader warp runs ahead through
the program's tiles filling a ring of shared-memory stages, so the next tile's operands are already
on chip when a tile ends; the compute warps write each tile that lies inside its group through an
asynchronous TMA store and wait for it a tile later. A group's last block of rows usually ends
inside the tile: those rows are written by masked stores, so the next group's rows are not touched.

Split K (``config.split_k > 1``, as in ``ragged_m.py``): where the tiles are at most half the programs
(one group of a few rows: a decode step), each tile's K steps are split over ``min(split_k, programs //
tiles, K steps)`` programs, chosen on the device; each part leaves its fp32 tile in a workspace
``[split_k, M, N]`` and the part that arrives last adds them in order and writes the tile.
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
from dropless.kernels.hopper import (SHARED_MEMORY_BYTES, descriptor, group_bounds, pick, raster, release, scan_add,
                                    stage_barriers)
from dropless.kernels.launch import cdiv, next_power_of_2, weight_nk
from dropless.kernels.ragged_m import zeroed_counters

# The loader is a whole warpgroup (registers are handed out per warpgroup anyway), so the group table
# it keeps in registers, [E_POW2] vectors, is spread over 128 threads.
LOADER_WARPS: gl.constexpr = gl.constexpr(4)


@gluon.jit
def _group_table(offsets_ptr, E, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, E_POW2: gl.constexpr,
                 WARPS: gl.constexpr):
    """Row ranges ``[starts, ends)`` of the groups (``hopper.group_bounds``; entry E: the unrouted
    tail) and the running total of their tiles, as ``[E_POW2]`` vectors."""
    starts, ends = group_bounds(offsets_ptr, E, M, E_POW2, WARPS)
    tiles = gl.cdiv(ends - starts, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    return starts, ends, tiles, gl.associative_scan(tiles, 0, scan_add)


@gluon.jit
def _tiles_to_run(tiles, tiles_end, E, ZERO_TAIL: gl.constexpr):
    """The tiles the programs share: every group's and, with ZERO_TAIL, the unrouted tail's (its zeros)."""
    if ZERO_TAIL:
        total = gl.sum(tiles, axis=0)
    else:
        total = pick(tiles_end, E - 1)
    return total


@gluon.jit
def _locate(tile_id, starts, ends, tiles, tiles_end, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            GROUP_M: gl.constexpr):
    """Tile number -> (group, first row, group end, first column)."""
    group = gl.sum((tiles_end <= tile_id).to(gl.int32), axis=0)
    start = pick(starts, group)
    end = pick(ends, group)
    local = tile_id - pick(tiles_end - tiles, group)
    pid_m, pid_n = raster(local, gl.cdiv(end - start, BLOCK_M), gl.cdiv(N, BLOCK_N), GROUP_M)
    return group, start + pid_m * BLOCK_M, end, pid_n * BLOCK_N


@gluon.jit
def _split_of(total_tiles, K, BLOCK_K: gl.constexpr, MAX_SPLIT: gl.constexpr):
    """Split K: the parts each tile's K steps are split into, ``min(MAX_SPLIT, programs // tiles, K
    steps)``, at least 1; 1 unless MAX_SPLIT > 1. Where the tiles are many (balanced routing) it is 1."""
    split = 1
    if MAX_SPLIT > 1:
        split = gl.maximum(gl.minimum(gl.minimum(gl.num_programs(0) // gl.maximum(total_tiles, 1), MAX_SPLIT),
                                      gl.cdiv(K, BLOCK_K)), 1)
    return split


@gluon.jit
def _unit(unit, split, K, BLOCK_K: gl.constexpr):
    """Work unit number -> (tile number, part, the part's first K and the K it ends at before the tile's
    own end: a whole number of BLOCK_K steps each, the last part the rest)."""
    tile_id = unit // split
    part = unit % split
    k_part = gl.cdiv(gl.cdiv(K, BLOCK_K), split) * BLOCK_K
    k_begin = part * k_part
    return tile_id, part, k_begin, gl.minimum(k_begin + k_part, K)


@gluon.jit
def _add_parts(acc, partials_ptr, counters_ptr, tile_id, part, split, row0, end, col0, M, N, c_ptr, stride_cm,
               acc_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """Split K: this part's fp32 tile into the workspace ``partials [split, M, N]``, then a count on the
    tile's counter (release, after every warp's stores). The part that makes the count ``split`` (acquire)
    adds the parts in split order, 64 columns at a time (two whole fp32 tiles would not fit the registers),
    writes them to ``c``, and zeroes the counter for the next launch."""
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    mask = (rows < end)[:, None] & (cols < N)[None, :]
    tile = rows.to(gl.int64)[:, None] * N + cols[None, :]
    gl.store(partials_ptr + part.to(gl.int64) * M * N + tile, acc, mask=mask)
    gl.thread_barrier()
    arrived = gl.atomic_add(counters_ptr + tile_id, 1, sem="acq_rel") + 1
    if arrived == split:
        piece_layout: gl.constexpr = gl.BlockedLayout([1, 2], [2, 16], [num_warps, 1], [1, 0])
        piece_rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, piece_layout))
        for first in gl.static_range(0, BLOCK_N, 64):
            piece_cols = col0 + first + gl.arange(0, 64, layout=gl.SliceLayout(0, piece_layout))
            piece_mask = (piece_rows < end)[:, None] & (piece_cols < N)[None, :]
            piece = piece_rows.to(gl.int64)[:, None] * N + piece_cols[None, :]
            total = gl.zeros([BLOCK_M, 64], gl.float32, piece_layout)
            for other in range(split):
                total += gl.load(partials_ptr + other.to(gl.int64) * M * N + piece, mask=piece_mask, other=0.0,
                                 cache_modifier=".cg")
            gl.store(c_ptr + piece_rows.to(gl.int64)[:, None] * stride_cm + piece_cols[None, :],
                     total.to(c_ptr.dtype.element_ty), mask=piece_mask)
        gl.store(counters_ptr + tile_id, 0)


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, M, N, K, E, sa_ptr, stride_sam, stride_sak,
            s_bufs, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
            STAGES: gl.constexpr, E_POW2: gl.constexpr, B_NK: gl.constexpr, ZERO_TAIL: gl.constexpr,
            STEP_SCALES: gl.constexpr = False, MAX_SPLIT: gl.constexpr = 1):
    """TMA loads of the K blocks of every tile of this program, into the stage ring. STEP_SCALES: also
    each step's column of the row scales, ``sa[rows, k0 // BLOCK_K]`` (0 past the group), into ``s_bufs
    [STAGES, BLOCK_M]`` by each thread's asynchronous copies, whose arrivals the ready barriers count."""
    starts, ends, tiles, tiles_end = _group_table(offsets_ptr, E, M, N, BLOCK_M, BLOCK_N, E_POW2, LOADER_WARPS)
    total_tiles = _tiles_to_run(tiles, tiles_end, E, ZERO_TAIL)
    split = _split_of(total_tiles, K, BLOCK_K, MAX_SPLIT)
    step = 0
    for unit in range(gl.program_id(0), total_tiles * split, gl.num_programs(0)):
        tile_id, part, k_begin, k_end = _unit(unit, split, K, BLOCK_K)
        group, row0, end, col0 = _locate(tile_id, starts, ends, tiles, tiles_end, N, BLOCK_M, BLOCK_N,
                                         GROUP_M)
        # The unrouted tail has no weight: nothing to load, its tiles are zeros.
        k_end = gl.where(group < E, k_end, k_begin)
        if STEP_SCALES:
            rows = row0 + gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([BLOCK_M // (32 * LOADER_WARPS)], [32],
                                                                        [LOADER_WARPS], [0]))
            sa_rows = sa_ptr + rows.to(gl.int64) * stride_sam
        for k0 in range(k_begin, k_end, BLOCK_K):
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
            if STEP_SCALES:
                async_copy.async_copy_global_to_shared(s_bufs.index(slot), sa_rows + (k0 // BLOCK_K) * stride_sak,
                                                       mask=rows < end)
                async_copy.mbarrier_arrive(bar, increment_count=False)
            step += 1


@gluon.jit
def _store_from(c_desc, buffer, block, row0, col0):
    """An asynchronous TMA store of ``block`` at ``[row0, col0]`` through the free shared buffer ``buffer``."""
    buffer.store(block)
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(c_desc, [row0, col0], buffer)


@gluon.jit
def _scales(sa_ptr, sb_ptr, stride_sbe, group, row0, end, col0, N, E, acc_layout: gl.constexpr,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """A tile's row scales ``sa[rows]`` and column scales ``sb[group, cols]``, 0 outside the group's rows
    and columns (and for the unrouted tail, whose rows may hold anything): loaded before the tile's MMAs
    so their latency hides behind them."""
    rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
    cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    routed = group < E
    sa = gl.load(sa_ptr + rows, mask=(rows < end) & routed, other=0.0)
    sb = gl.load(sb_ptr + group.to(gl.int64) * stride_sbe + cols, mask=(cols < N) & routed, other=0.0)
    return sa, sb


@gluon.jit
def _compute(c_desc, c_ptr, stride_cm, sa_ptr, sb_ptr, stride_sbe, a_bufs, b_bufs, c_smem, ready, empty,
             offsets_ptr, partials_ptr, counters_ptr, M, N, K, E,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
             STAGES: gl.constexpr, E_POW2: gl.constexpr, B_NK: gl.constexpr, EPI_HALVES: gl.constexpr,
             SCALED: gl.constexpr, INSTR_K: gl.constexpr, ZERO_TAIL: gl.constexpr, MAX_SPLIT: gl.constexpr,
             num_warps: gl.constexpr):
    """The default partition: the MMAs of each tile, then its epilogue.

    With EPI_HALVES, ``c_smem`` holds half a tile: a whole tile leaves in two halves of columns, the
    left through ``c_smem``, the right through the weight buffer of the tile's last stage. That stage
    goes back to the loader only after the next tile's first MMA is issued, once the store has read it,
    so neither half waits for the other. A tile whose K is split (``_split_of``) leaves through
    ``_add_parts`` instead.
    """
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, INSTR_K])
    starts, ends, tiles, tiles_end = _group_table(offsets_ptr, E, M, N, BLOCK_M, BLOCK_N, E_POW2, num_warps)
    total_tiles = _tiles_to_run(tiles, tiles_end, E, ZERO_TAIL)
    split = _split_of(total_tiles, K, BLOCK_K, MAX_SPLIT)
    step = 0
    held = False  # the previous tile's last stage is still being read by its store
    for unit in range(gl.program_id(0), total_tiles * split, gl.num_programs(0)):
        tile_id, part, k_begin, k_end = _unit(unit, split, K, BLOCK_K)
        group, row0, end, col0 = _locate(tile_id, starts, ends, tiles, tiles_end, N, BLOCK_M, BLOCK_N,
                                         GROUP_M)
        k_end = gl.where(group < E, k_end, k_begin)
        if SCALED:
            sa, sb = _scales(sa_ptr, sb_ptr, stride_sbe, group, row0, end, col0, N, E, acc_layout, BLOCK_M, BLOCK_N)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        for k0 in range(k_begin, k_end, BLOCK_K):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            b_buf = b_bufs.index(slot)
            if B_NK:
                b_buf = b_buf.permute((1, 0))
            acc = warpgroup_mma(a_bufs.index(slot), b_buf, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if k0 > k_begin:
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
        # The tile's last stage goes back now, unless a whole tile's right half leaves through it.
        if k_end > k_begin:
            if not EPI_HALVES:
                release(empty, step - 1, STAGES)
            elif not whole or split > 1:
                release(empty, step - 1, STAGES)
        if SCALED:
            acc = acc * sa[:, None] * sb[None, :]
        out = acc.to(c_desc.dtype)
        if MAX_SPLIT > 1 and split > 1:
            _add_parts(acc, partials_ptr, counters_ptr, tile_id, part, split, row0, end, col0, M, N, c_ptr, stride_cm,
                       acc_layout, BLOCK_M, BLOCK_N, num_warps)
        elif whole:
            # The previous tile's stores must have read c_smem before it is overwritten.
            tma.store_wait(pendings=0)
            if EPI_HALVES:
                left, right = out.reshape([BLOCK_M, 2, BLOCK_N // 2]).permute(0, 2, 1).split()
                _store_from(c_desc, c_smem, left, row0, col0)
                if k_end > k_begin:
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
            gl.store(ptrs, out, mask=(rows < end)[:, None] & (cols < N)[None, :])
    tma.store_wait(pendings=0)


@gluon.constexpr_function
def _b_block(BLOCK_K, BLOCK_N, B_NK):
    """The shape of one weight block in shared memory: as stored, K or N contiguous."""
    return [BLOCK_N, BLOCK_K] if B_NK else [BLOCK_K, BLOCK_N]


@gluon.jit
def _ragged_m_hopper_kernel(a_desc, b_desc, c_desc, c_ptr, stride_cm, sa_ptr, sb_ptr, stride_sbe, offsets_ptr,
                            partials_ptr, counters_ptr, M, N, K, E,
                            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                            GROUP_M: gl.constexpr, STAGES: gl.constexpr, E_POW2: gl.constexpr,
                            B_NK: gl.constexpr, EPI_HALVES: gl.constexpr, SCALED: gl.constexpr,
                            ZERO_TAIL: gl.constexpr, MAX_SPLIT: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    # One wgmma multiplies 32 bytes of K per row: 16 elements of 16 bits, 32 of FP8.
    INSTR_K: gl.constexpr = 256 // dtype.primitive_bitwidth
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_block: gl.constexpr = _b_block(BLOCK_K, BLOCK_N, B_NK)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, b_block[0], b_block[1]],
                                       gl.NVMMASharedLayout.get_default_for(b_block, dtype))
    c_smem = gl.allocate_shared_memory(c_desc.dtype, c_desc.block_type.shape, c_desc.layout)
    ready, empty = stage_barriers(STAGES)
    gl.warp_specialize([
        (_compute, (c_desc, c_ptr, stride_cm, sa_ptr, sb_ptr, stride_sbe, a_bufs, b_bufs, c_smem, ready, empty,
                    offsets_ptr, partials_ptr, counters_ptr, M, N, K, E, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES,
                    E_POW2, B_NK, EPI_HALVES, SCALED, INSTR_K, ZERO_TAIL, MAX_SPLIT, num_warps)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, M, N, K, E, sa_ptr, 0, 0, a_bufs,
                   BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, E_POW2, B_NK, ZERO_TAIL, False, MAX_SPLIT)),
    ], [LOADER_WARPS], [40])


_LAUNCH = DirectLaunch(_ragged_m_hopper_kernel)


def output_in_halves(config: GemmConfig, element_size: int, out_element_size: int | None = None) -> bool:
    """Whether the output tile leaves in two halves of columns: the whole tile's staging buffer does not
    fit in shared memory beside the stage ring, half of it does, and a stage's weight buffer holds the
    other half. ``element_size``: bytes per operand element; ``out_element_size``: per output element
    (default: the same). ValueError if the config fits neither way."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    out_size = out_element_size or element_size
    ring = config.num_stages * (bm + bn) * bk * element_size
    tile = bm * bn * out_size
    if ring + tile <= SHARED_MEMORY_BYTES:
        return False
    if ring + tile // 2 <= SHARED_MEMORY_BYTES and 2 * bk * element_size >= bm * out_size:
        return True
    raise ValueError(f"tile config {config} does not fit in shared memory ({ring + tile // 2} bytes or more)")


def ragged_m_mm_hopper(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, c: torch.Tensor,
                       config: GemmConfig, num_programs: int,
                       scales: tuple[torch.Tensor, torch.Tensor] | None = None, tail: bool = True) -> None:
    """Launch on ``a [M, K]``, ``b [E, K, N]``, int32 ``offsets [E]``, ``c [M, N]``, which
    ``launch.hopper_kernels_ok`` accepts (b as stored: along N, or along K for an nn.Linear view).

    FP8 operands (b with K contiguous) take ``scales = (sa, sb)``: fp32 ``sa`` with one scale per row of a
    (``M`` contiguous values) and ``sb [E, N]`` with unit stride along N, applied in the epilogue.
    tail: write zeros over the rows past ``offsets[-1]`` (False: leave them as they are).
    ``config.split_k > 1``: split K where the tiles are few, into a workspace of ``split_k * M * N`` floats.
    """
    M, K = a.shape
    E, _, N = b.shape
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    halves = output_in_halves(config, a.element_size(), c.element_size())
    b_nk = weight_nk(b)
    b_desc = descriptor(b.transpose(1, 2), [1, bn, bk]) if b_nk else descriptor(b, [1, bk, bn])
    max_tiles = (cdiv(M, bm) + E + 1) * cdiv(N, bn)
    split = config.split_k if M > 0 else 1
    grid = (max(1, min(num_programs, max_tiles * split)), )
    sa, sb = scales if scales is not None else (c, c)
    if split > 1:
        partials = torch.empty(split, M, N, dtype=torch.float32, device=c.device)
        counters = zeroed_counters(c.device, num_programs)
    else:
        partials = counters = offsets
    # Everything the launch's specialization depends on, for DirectLaunch's per-call key.
    call_key = ("ragged_m", a.shape, a.stride(), a.dtype, b.shape, b.stride(), c.shape, c.stride(), c.dtype, config,
                tail, offsets.dtype, offsets.data_ptr() % 16, c.data_ptr() % 16, partials.data_ptr() % 16,
                counters.data_ptr() % 16)
    if scales is not None:
        call_key += (sa.dtype, sa.data_ptr() % 16, sb.dtype, sb.stride(0), sb.data_ptr() % 16)
    _LAUNCH(grid, call_key, a_desc=descriptor(a, [bm, bk]), b_desc=b_desc,
            c_desc=descriptor(c, [bm, bn // 2 if halves else bn]), c_ptr=c, stride_cm=c.stride(0),
            sa_ptr=sa, sb_ptr=sb, stride_sbe=sb.stride(0) if scales is not None else 0,
            offsets_ptr=offsets, partials_ptr=partials, counters_ptr=counters, M=M, N=N, K=K, E=E, BLOCK_M=bm,
            BLOCK_N=bn, BLOCK_K=bk,
            GROUP_M=config.group_m, STAGES=config.num_stages, E_POW2=next_power_of_2(E + 1),
            B_NK=b_nk, EPI_HALVES=halves, SCALED=scales is not None, ZERO_TAIL=tail, MAX_SPLIT=split,
            num_warps=config.num_warps)
