"""FP8 quantization: one scale per block, the elements divided by it and cast to float8_e4m3fn (the
arithmetic, bit for bit ``dropless.reference.quantize``'s, is ``fp8_math``'s). The layouts of data and
scales are ``dropless.quantized``'s.

Three kernels over a 3D view ``x [BATCH, R, C]`` (a 2D operand is ``[1, M, K]``, a weight ``[E, K, N]``),
any strides. Each program addresses its tile from 64-bit scalar bases with 32-bit offsets inside it
(64-bit only when a stride or extent makes them reach 2**31), which keeps registers per element few:
- ``_tile_kernel``: one program per ``BLOCK_R x BLOCK_C`` tile, reading each element once. It
  quantizes along C (the last dim: ``data_c`` row-major ``[BATCH, R, C]``), along R (``data_r`` stored
  ``[BATCH, C, R]``: the tile is transposed in registers and written R-contiguous), or both at once
  (a weight's two orientations). With ``offsets`` (2D, along R = tokens), tiles are numbered per group:
  group g owns the program slots ``starts[g] // BLOCK_R + g`` onwards, so ``cdiv(M, BLOCK_R) + E`` slots
  cover every group and the tail past ``offsets[-1]`` (index E, written as zeros) whatever the group
  sizes, which the host never reads. Quantizing along C too (an activation's two orientations), the
  tail's slots read its rows and write them along C, since that output holds every row of x. Each group
  also owns at least one slot, which writes the scale rows of its empty blocks (1). A first launch
  (``_slot_table_kernel``) looks each slot's group and rows up once, so that the programs of its column
  tiles read them rather than each scanning the offsets. Group g's data starts
  at row ``p_g = A * (starts[g] // A + g)`` (A = ``GROUP_ALIGN`` = 128) of the ``[C, Mp]`` storage; its
  slots write rows ``p_g`` up to ``p_{g+1}`` (its own rows, then zeros), the tail's up to Mp, so every
  byte of the data is written, in runs of A rows that start A-aligned: the compiler sees it
  (``tl.multiple_of``) and stores 16 bytes at a time. The slots reach that far: group g spans
  ``p_{g+1} - p_g = A * (starts[g+1] // A - starts[g] // A + 1)`` rows and owns
  ``starts[g+1] // BLOCK_R - starts[g] // BLOCK_R + 1`` slots of BLOCK_R = A rows, as many (likewise
  the tail, whose slots also write the scale rows up to ``cdiv(Mp - A E, block) + E``). Rowwise scales span the whole R or C extent: a first launch
  (``AMAX_PASS``) takes each tile's partial amax into int32 buffers with ``atomic_max`` on the bits of
  the (non-negative) magnitudes, and a second launch quantizes, reading x again.
- ``_tile128_kernel``: block128x128, one program per 128x128 tile, which it walks twice in chunks of
  rows (the amax, then the values, the second read from L2), so that it holds a chunk at a time.
- ``_rowwise_kernel``: rowwise along the last dim of a 2D x; each program owns ``BLOCK_M`` rows, held in
  registers when they are a power of two up to 8192 long; others it walks twice in steps, once for the
  amax and once to write (the second read from L1 or L2).

On an sm_90 GPU a 16-bit x that TMA can read, quantized per group along the tokens (directly or by
index), goes to ``quantize_hopper``'s Gluon kernel instead, and a 16-bit weight's two orientations
(mxfp8, block128x128) to ``quantize_weight_hopper``'s; both write the same bytes.

The interpreter's own float-to-fp8 cast rounds ties away from zero and mishandles mantissa carries, so
under ``TRITON_INTERPRET=1`` the kernels round to e4m3 with integer operations (``EMULATE_FP8``); on
the GPU the cast is the hardware's ``cvt.rn.satfinite``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from dropless.kernels.direct_launch import DirectLaunch
from dropless.kernels.fp8_math import E8M0_ONE, block_amax, block_scale, magnitude, to_fp8
from dropless.kernels.groups import group_bounds
from dropless.kernels.launch import cdiv, interpreting, launch_info, next_power_of_2
from dropless.kernels.quantize_hopper import quantize_groups_hopper, quantize_groups_hopper_ok
from dropless.kernels.quantize_weight_hopper import quantize_weight_hopper, quantize_weight_hopper_ok
from dropless.quantized import GROUP_ALIGN, Recipe, grouped_rows, grouped_scale_rows

_GROUP_ALIGN = tl.constexpr(GROUP_ALIGN)  # rows: every group of per-group data starts at a multiple of it


@triton.jit
def _slot_table_kernel(offsets_ptr, table, R, E, SLOTS, DATA_ROWS_R,
                       BLOCK_R: tl.constexpr, E_POW2: tl.constexpr, SLOT_BLOCK: tl.constexpr):
    """``_tile_kernel``'s per-group slots, looked up once a slot rather than by each of its column tiles'
    programs: row ``s`` of ``table [SLOTS, 8]`` (int32) holds slot s's group (E for the tail), the group's
    first and end rows, the slot's place in the group, and the first and end data rows it writes (the
    numbering and layout of the module docstring); columns 6 and 7 are unused."""
    starts, ends = group_bounds(offsets_ptr, E, R, E_POW2)
    e = tl.arange(0, E_POW2)
    firsts = starts // BLOCK_R + e
    data_starts = (starts // _GROUP_ALIGN + e) * _GROUP_ALIGN
    slot = tl.program_id(0) * SLOT_BLOCK + tl.arange(0, SLOT_BLOCK)
    group = tl.sum((firsts[None, :] <= slot[:, None]).to(tl.int32), axis=1) - 1
    this = e[None, :] == group[:, None]
    local = slot - tl.sum(tl.where(this, firsts[None, :], 0), axis=1)
    data_end = tl.sum(tl.where(e[None, :] == group[:, None] + 1, data_starts[None, :], 0), axis=1)
    row = table + slot.to(tl.int64) * 8
    ok = slot < SLOTS
    tl.store(row, group, mask=ok)
    tl.store(row + 1, tl.sum(tl.where(this, starts[None, :], 0), axis=1), mask=ok)
    tl.store(row + 2, tl.sum(tl.where(this, ends[None, :], 0), axis=1), mask=ok)
    tl.store(row + 3, local, mask=ok)
    tl.store(row + 4, tl.sum(tl.where(this, data_starts[None, :], 0), axis=1) + local * BLOCK_R, mask=ok)
    tl.store(row + 5, tl.where(group < E, data_end, DATA_ROWS_R), mask=ok)


@triton.jit
def _tile_kernel(
    x, data_r, scale_r, data_c, scale_c, amax_r, amax_c, slot_table, rows_ptr, bound_ptr,
    R, C, E, SLOTS, SCALE_ROWS_R, DATA_ROWS_R,
    stride_xb, stride_xr, stride_xc,
    ALONG_R: tl.constexpr, ALONG_C: tl.constexpr, GROUPED: tl.constexpr, BOUNDED: tl.constexpr,
    AMAX_PASS: tl.constexpr,
    BLOCK: tl.constexpr, MX: tl.constexpr, POW2: tl.constexpr, RCEIL: tl.constexpr,
    EMULATE_FP8: tl.constexpr, WIDE: tl.constexpr, GATHER: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Quantize one tile of ``x [BATCH, R, C]`` along R and/or C.

    BLOCK: elements per scale (0: rowwise, scales from ``amax_r [G, C]`` / ``amax_c [BATCH, R]``, G the
    groups or BATCH).
    data_r: storage ``[BATCH, C, DATA_ROWS_R]`` (``[C, Mp]`` per group, ``[BATCH, C, R]`` otherwise);
    data_c: ``[BATCH, R, C]``. scale_r: ``[BATCH, SCALE_ROWS_R, C]`` (``[G, C]`` rowwise); scale_c:
    ``[BATCH, R, cdiv(C, BLOCK)]`` (``[BATCH, R]`` rowwise). WIDE: offsets inside the tile are 64-bit.
    GATHER: row i of the quantized operand is row ``rows_ptr[i]`` of x (R rows, read by index).
    slot_table: with GROUPED, ``_slot_table_kernel``'s table of the slots. BOUNDED: rows from
    ``bound_ptr[0]`` on are not written (with GROUPED: the tail past the last group writes nothing).
    """
    pid = tl.program_id(0)
    batch = pid // SLOTS
    slot = pid - batch * SLOTS
    if GROUPED:
        info = slot_table + slot.to(tl.int64) * 8
        group = tl.load(info)
        group_start = tl.load(info + 1)
        end = tl.load(info + 2)
        local = tl.load(info + 3)
        row0 = group_start + local * BLOCK_R
        # The tail past offsets[-1] (group E) belongs to no group: its tiles write zeros along R, and read
        # its rows only for the output along C, which quantizes every row.
        live = (row0 < end) & (group < E)
        reads = live
        if ALONG_C:
            reads = row0 < end
        # Group g's data rows start at A * (starts[g] // A + g), A-aligned (dropless.quantized), and its
        # tiles write every row up to the next group's start, zeros past its own rows: the tiles of
        # all groups and the tail write each of the DATA_ROWS_R rows once, in whole runs of A rows.
        out_row0 = tl.multiple_of(tl.load(info + 4), _GROUP_ALIGN)
        out_rows = tl.load(info + 5) - out_row0
        if BOUNDED:
            out_rows = tl.where(group < E, out_rows, 0)
        out_rows = tl.multiple_of(out_rows, _GROUP_ALIGN)
    else:
        group = batch
        end = R
        if BOUNDED:
            end = tl.minimum(end, tl.load(bound_ptr).to(tl.int32))
        local = slot
        row0 = slot * BLOCK_R
        live = row0 < end
        reads = live
        out_row0 = row0
        out_rows = end - row0
    if BOUNDED:
        # Programs with nothing to write stop before any work: a buffer sized for the worst case is mostly
        # such tail, and quantizing its masked-off tiles cost as much as real ones (v26).
        if GROUPED:
            idle = group >= E
        else:
            idle = row0 >= end
        if idle:
            return
    col0 = tl.program_id(1) * BLOCK_C
    r = tl.arange(0, BLOCK_R)
    c = tl.arange(0, BLOCK_C)
    if WIDE:
        r = r.to(tl.int64)
        c = c.to(tl.int64)
    row_ok = r < end - row0
    col_ok = c < C - col0
    mask = row_ok[:, None] & col_ok[None, :]
    out_mask = col_ok[:, None] & (r < out_rows)[None, :]  # of the transposed tile written along R
    batch64 = batch.to(tl.int64)
    group64 = group.to(tl.int64)
    row64 = row0.to(tl.int64)
    col64 = col0.to(tl.int64)
    if GATHER:
        source = tl.load(rows_ptr + row64 + r, mask=row_ok & reads, other=0).to(tl.int64)
        x_rows = x + batch64 * stride_xb + source[:, None] * stride_xr
        v = tl.load(x_rows + (col64 + c)[None, :] * stride_xc, mask=mask & reads, other=0.0).to(tl.float32)
    else:
        x_tile = x + batch64 * stride_xb + row64 * stride_xr + col64 * stride_xc
        v = tl.load(x_tile + r[:, None] * stride_xr + c[None, :] * stride_xc, mask=mask & reads,
                    other=0.0).to(tl.float32)
    data_r_tile = data_r + (batch64 * C + col64) * DATA_ROWS_R + out_row0.to(tl.int64)
    data_c_tile = data_c + (batch64 * R + row64) * C + col64  # storage [BATCH, R, C]

    if AMAX_PASS:
        mags = magnitude(v)
        if ALONG_R:
            col_amax = tl.max(mags, axis=0).to(tl.int32, bitcast=True)
            tl.atomic_max(amax_r + group64 * C + col64 + c, col_amax, mask=col_ok & live, sem="relaxed")
        if ALONG_C:
            row_amax = tl.max(mags, axis=1).to(tl.int32, bitcast=True)
            tl.atomic_max(amax_c + batch64 * R + row64 + r, row_amax, mask=row_ok, sem="relaxed")
    else:
        if ALONG_R:
            v_r = v
            if GROUPED and ALONG_C:
                v_r = tl.where(live, v, 0.0)  # the tail's rows, read for the output along C, are zeros here
            if BLOCK == 0:
                # The first slot of each group (or batch) writes its scales; the tail has none.
                in_scale = col_ok
                if GROUPED:
                    in_scale = in_scale & (group < E)
                amax = tl.load(amax_r + group64 * C + col64 + c, mask=in_scale, other=0).to(tl.float32, bitcast=True)
                scale = block_scale(amax, False, POW2, False)
                q = to_fp8(v_r, scale[None, :], False, EMULATE_FP8)
                tl.store(scale_r + group64 * C + col64 + c, scale, mask=in_scale & (local == 0))
            else:
                v3 = tl.reshape(v_r, (BLOCK_R // BLOCK, BLOCK, BLOCK_C))
                scale = block_scale(block_amax(v3, 1, EMULATE_FP8), MX, POW2, RCEIL)
                q = tl.reshape(to_fp8(v3, scale[:, None, :], MX, EMULATE_FP8), (BLOCK_R, BLOCK_C))
                # The tile's blocks are blocks local * BLOCK_R / BLOCK onwards of its group (or batch).
                b = tl.arange(0, BLOCK_R // BLOCK)
                if GROUPED:
                    first_row = group_start // BLOCK + group + local * (BLOCK_R // BLOCK)
                    # The group's scale rows end where the next group's begin; the tail's at the last.
                    rows_end = tl.where(group < E, end // BLOCK + group + 1, first_row if BOUNDED else SCALE_ROWS_R)
                    has_rows = (b * BLOCK < end - row0) & live
                else:
                    first_row = local * (BLOCK_R // BLOCK)
                    rows_end = SCALE_ROWS_R
                    has_rows = b < rows_end - first_row
                if MX:
                    # A block with no rows holds 2**0, as the layout asks (an fp32 one gets 1 from its amax).
                    scale = tl.where(has_rows[:, None], scale, E8M0_ONE)
                scale_tile = scale_r + (batch64 * SCALE_ROWS_R + first_row) * C + col64
                tl.store(scale_tile + b[:, None] * C + c[None, :], scale.to(scale_r.dtype.element_ty),
                         mask=(b < rows_end - first_row)[:, None] & col_ok[None, :])
            tl.store(data_r_tile + c[:, None] * DATA_ROWS_R + r[None, :], tl.trans(q), mask=out_mask)
        if ALONG_C:
            if BLOCK == 0:
                amax = tl.load(amax_c + batch64 * R + row64 + r, mask=row_ok, other=0).to(tl.float32, bitcast=True)
                scale = block_scale(amax, False, POW2, False)
                q = to_fp8(v, scale[:, None], False, EMULATE_FP8)
                tl.store(scale_c + batch64 * R + row64 + r, scale, mask=row_ok & (tl.program_id(1) == 0))
            else:
                v3 = tl.reshape(v, (BLOCK_R, BLOCK_C // BLOCK, BLOCK))
                scale = block_scale(block_amax(v3, 2, EMULATE_FP8), MX, POW2, RCEIL)
                q = tl.reshape(to_fp8(v3, scale[:, :, None], MX, EMULATE_FP8), (BLOCK_R, BLOCK_C))
                blocks_c = tl.cdiv(C, BLOCK)
                b = tl.arange(0, BLOCK_C // BLOCK)
                scale_tile = scale_c + (batch64 * R + row64) * blocks_c + col0 // BLOCK
                tl.store(scale_tile + r[:, None] * blocks_c + b[None, :], scale.to(scale_c.dtype.element_ty),
                         mask=row_ok[:, None] & (b < blocks_c - col0 // BLOCK)[None, :])
            tl.store(data_c_tile + r[:, None] * C + c[None, :], q, mask=mask)


@triton.jit
def _tile128_kernel(
    x, data_r, data_c, scale, R, C, stride_xb, stride_xr, stride_xc,
    ALONG_R: tl.constexpr, ALONG_C: tl.constexpr, POW2: tl.constexpr, EMULATE_FP8: tl.constexpr,
    WIDE: tl.constexpr, CHUNK_R: tl.constexpr,
):
    """One scale per 128x128 tile of ``x [BATCH, R, C]`` (block128x128): ``scale [BATCH, cdiv(R, 128),
    cdiv(C, 128)]``, data along R into ``data_r`` (storage ``[BATCH, C, R]``) and/or along C into ``data_c``
    (``[BATCH, R, C]``). A program walks its tile twice in ``CHUNK_R x 128`` chunks, the amax first and
    then the values (the second read from L2), so it holds a chunk at a time and several programs share
    a multiprocessor. Writing both orientations, it reads each chunk of values twice, once each way."""
    tiles_r = tl.cdiv(R, 128)
    batch = tl.program_id(0) // tiles_r
    tile_r = tl.program_id(0) - batch * tiles_r
    row0 = tile_r * 128
    col0 = tl.program_id(1) * 128
    r = tl.arange(0, CHUNK_R)
    c = tl.arange(0, 128)
    if WIDE:
        r = r.to(tl.int64)
        c = c.to(tl.int64)
    col_ok = c < C - col0
    batch64 = batch.to(tl.int64)
    x_tile = x + batch64 * stride_xb + row0.to(tl.int64) * stride_xr + col0.to(tl.int64) * stride_xc
    amax = tl.zeros((CHUNK_R, 128), dtype=tl.float32)
    for r0 in tl.static_range(0, 128, CHUNK_R):
        mask = (r < R - row0 - r0)[:, None] & col_ok[None, :]
        v = tl.load(x_tile + (r0 + r)[:, None] * stride_xr + c[None, :] * stride_xc, mask=mask, other=0.0)
        amax = tl.maximum(amax, magnitude(v.to(tl.float32)))
    s = block_scale(tl.max(tl.max(amax, axis=1), axis=0), False, POW2, False)
    tl.store(scale + (batch64 * tiles_r + tile_r) * tl.cdiv(C, 128) + tl.program_id(1), s,
             mask=(row0 < R) & (col0 < C))
    for r0 in tl.static_range(0, 128, CHUNK_R):
        row_ok = r < R - row0 - r0
        if ALONG_C:
            mask = row_ok[:, None] & col_ok[None, :]
            v = tl.load(x_tile + (r0 + r)[:, None] * stride_xr + c[None, :] * stride_xc, mask=mask, other=0.0)
            data_c_rows = data_c + (batch64 * R + row0 + r0) * C + col0
            tl.store(data_c_rows + r[:, None] * C + c[None, :], to_fp8(v.to(tl.float32), s, False, EMULATE_FP8),
                     mask=mask)
        if ALONG_R:
            # The chunk read again as [128, CHUNK_R] rather than an fp8 tl.trans of the values above: from
            # fp32 inputs of sizes that are multiples of 16, Triton 3.6's bundled ptxas (12.8) compiled
            # that transpose into wrong bytes (a quarter of the columns; CUDA 13's ptxas did not).
            mask_t = col_ok[:, None] & row_ok[None, :]
            v_t = tl.load(x_tile + c[:, None] * stride_xc + (r0 + r)[None, :] * stride_xr, mask=mask_t, other=0.0)
            data_r_cols = data_r + (batch64 * C + col0) * R + row0 + r0
            tl.store(data_r_cols + c[:, None] * R + r[None, :], to_fp8(v_t.to(tl.float32), s, False, EMULATE_FP8),
                     mask=mask_t)


@triton.jit
def _rowwise_kernel(
    x, data, scale, bound_ptr, M, K, stride_xm, stride_xk,
    POW2: tl.constexpr, EMULATE_FP8: tl.constexpr, WIDE: tl.constexpr, BOUNDED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One scale per row of ``x [M, K]``: ``data [M, K]`` row-major, ``scale [M]``. Rows of at most BLOCK_K
    are read once and held in registers; longer ones are walked twice (the second read from L2).
    BOUNDED: rows from ``bound_ptr[0]`` on are neither read nor written."""
    if BOUNDED:
        M = tl.minimum(M, tl.load(bound_ptr).to(tl.int32))
    row0 = tl.program_id(0).to(tl.int64) * BLOCK_M
    if BOUNDED:
        if row0 >= M:
            return
    r = tl.arange(0, BLOCK_M)
    c = tl.arange(0, BLOCK_K)
    if WIDE:
        r = r.to(tl.int64)
        c = c.to(tl.int64)
    row_ok = r < M - row0
    x_rows = x + row0 * stride_xm + r[:, None] * stride_xm
    data_rows = data + row0 * K + r[:, None] * K
    if K <= BLOCK_K:
        mask = row_ok[:, None] & (c < K)[None, :]
        v = tl.load(x_rows + c[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
        s = block_scale(block_amax(v, 1, EMULATE_FP8), False, POW2, False)
        tl.store(data_rows + c[None, :], to_fp8(v, s[:, None], False, EMULATE_FP8), mask=mask)
    else:
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mask = row_ok[:, None] & (c < K - k0)[None, :]
            v = tl.load(x_rows + (k0 + c)[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, block_amax(v, 1, EMULATE_FP8))
        s = block_scale(amax, False, POW2, False)
        for k0 in range(0, K, BLOCK_K):
            mask = row_ok[:, None] & (c < K - k0)[None, :]
            v = tl.load(x_rows + (k0 + c)[None, :] * stride_xk, mask=mask, other=0.0).to(tl.float32)
            tl.store(data_rows + (k0 + c)[None, :], to_fp8(v, s[:, None], False, EMULATE_FP8), mask=mask)
    tl.store(scale + row0 + r, s, mask=row_ok)


_ROWWISE = DirectLaunch(_rowwise_kernel)


def _rowwise_shape(K: int) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_K, num_warps)`` of ``_rowwise_kernel`` for rows of K. Rows of a power of two up
    to 8192 (or longer than 4096) are read once in 2048-element programs over 4 warps (v13: no shape ran
    over 6% faster). Other rows padded to a power of two ran at 0.42 (K = 768) and 0.54 (K = 2880) of a
    copy on an H100; walked twice in steps of at most half a row they ran at 0.73 and 0.71 (v23): steps of
    the largest power of two up to K / 2 (at most 1024), in 2048-element programs over 4 warps (K = 768
    on an H200: 0.83 of a copy against 0.71 for v23's 8192-element programs over 8 warps, v46)."""
    if K & (K - 1) == 0 or K > 4096:
        block_k = min(max(next_power_of_2(K), 16), 8192)
        return max(2048 // block_k, 1), block_k, 4
    block_k = min(max(1 << ((K // 2).bit_length() - 1), 16), 1024)
    return 2048 // block_k, block_k, 4


def _tile_shape(recipe: Recipe, along_r: bool, along_c: bool, grouped: bool, C: int) -> tuple[int, int, int]:
    """``(BLOCK_R, BLOCK_C, num_warps)`` for ``x [BATCH, R, C]``: tiles a multiple of the block along every
    quantized dim, chosen by measurement (benchmarks/NOTES.md, v13, v23 and v46). Along C alone (blockwise
    activations along K): 8x1024 tiles on 4 warps where C is a multiple of 1024, else 32x256 (on an H200,
    0.80-0.96 of a copy against 0.62-0.83 for v23's 64x128 on 8 warps). Along R, fp32-scaled recipes run 8
    warps (32 elements a thread); mxfp8, the per-group tiles and a weight's two orientations run 4, which
    kept their block and group reductions inside fewer warps (8 warps lost up to 40% there, v13, while
    each per-group program still looked its group up itself). Both orientations of block128's 1x128
    blocks need 128x128 tiles, on 8 warps."""
    if along_r and along_c:
        if recipe.block == 128:
            return 128, 128, 8
        if grouped:
            return 128, 64, 4  # tiles numbered per group are GROUP_ALIGN (128) rows (the module docstring)
        # A weight's two orientations: mxfp8 ran 64x128 at 1.2-1.6x 64x64 (E = 128); rowwise 32x128 at
        # 1.05x 64x128 (v23).
        return (32, 128, 4) if recipe.block is None else (64, 128, 4)
    if along_c:
        return (8, 1024, 4) if C % 1024 == 0 else (32, 256, 4)
    return (128, 64, 4 if grouped or recipe.name == "mxfp8" else 8)


_SLOT_BLOCK = 64  # slots a program of _slot_table_kernel looks up


def _tile128_shape() -> tuple[int, int]:
    """``(CHUNK_R, num_warps)`` of ``_tile128_kernel``: 32x128 chunks over 8 warps, 16 elements a thread,
    the best of six shapes on an H100 (v23: 1.4x the one-pass 128x128 program of 16 warps)."""
    return 32, 8


def _launch_tile128(x: torch.Tensor, scale: torch.Tensor, data_r: torch.Tensor | None,
                    data_c: torch.Tensor | None, recipe: Recipe) -> None:
    """Run ``_tile128_kernel`` over ``x [BATCH, R, C]`` (block128x128): along R into ``data_r`` (storage
    ``[BATCH, C, R]``) and/or along C into ``data_c`` (``[BATCH, R, C]``), one scale per tile into ``scale``."""
    BATCH, R, C = x.shape
    if x.numel() == 0:
        return
    chunk_r, num_warps = _tile128_shape()
    _tile128_kernel[(BATCH * cdiv(R, 128), cdiv(C, 128))](
        x, x if data_r is None else data_r, x if data_c is None else data_c, scale, R, C,
        x.stride(0), x.stride(1), x.stride(2),
        ALONG_R=data_r is not None, ALONG_C=data_c is not None, POW2=recipe.pow2, EMULATE_FP8=interpreting(),
        WIDE=_wide(*(256 * n for n in (*x.shape, *x.stride()))), CHUNK_R=chunk_r, num_warps=num_warps,
    )


def _wide(*largest_offsets: int) -> bool:
    """Whether offsets from a program's 64-bit base can reach 2**31 (then they are 64-bit too)."""
    return max(largest_offsets, default=0) >= 2**31


def scale_bits(scale: torch.Tensor) -> torch.Tensor:
    """Scales as the kernels take them: fp32 ones as they are, E8M0 ones as their bytes."""
    return scale.view(torch.uint8) if scale.element_size() == 1 else scale


def _launch_tiles(x: torch.Tensor, recipe: Recipe, *, data_r: torch.Tensor | None = None,
                  scale_r: torch.Tensor | None = None, data_c: torch.Tensor | None = None,
                  scale_c: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                  rows: torch.Tensor | None = None, bound: torch.Tensor | None = None) -> None:
    """Run ``_tile_kernel`` over ``x [BATCH, R, C]``: along R when ``data_r`` is given (storage
    ``[BATCH, C, R]``), along C when ``data_c`` is (storage ``[BATCH, R, C]``). A 128x128 recipe runs
    ``_tile128_kernel`` instead, writing its one scale tensor through ``scale_r``. Rowwise runs twice
    (amax, then quantize) over zeroed int32 amax buffers it allocates. ``rows`` (int ``[R']``): the
    operand is ``x[:, rows]``, read by index (R' rows; along R per group only). ``bound`` (int ``[1]``):
    rows from ``bound[0]`` on are not written; per group, the tail past the last group writes nothing."""
    if recipe.tile:
        _launch_tile128(x, scale_r, data_r, data_c, recipe)
        return
    BATCH, R, C = x.shape
    if rows is not None:
        R = rows.shape[0]
    along_r, along_c = data_r is not None, data_c is not None
    grouped = offsets is not None
    block_r, block_c, num_warps = _tile_shape(recipe, along_r, along_c, grouped, C)
    E = offsets.shape[0] if grouped else 0
    # Every batch (or group) gets a slot even when R is 0: rowwise scales of an empty extent are written as 1.
    slots = cdiv(R, block_r) + E if grouped else max(cdiv(R, block_r), 1)
    grid = (BATCH * slots, max(cdiv(C, block_c), 1))
    if BATCH == 0:
        return
    rowwise = recipe.block is None
    data_rows_r = grouped_rows(R, E) if grouped else R
    scale_rows_r = 0 if rowwise else grouped_scale_rows(R, E, recipe.block) if grouped else cdiv(R, recipe.block)
    amax_r = torch.zeros(E if grouped else BATCH, C, dtype=torch.int32, device=x.device) if rowwise and along_r else x
    amax_c = torch.zeros(BATCH, R, dtype=torch.int32, device=x.device) if rowwise and along_c else x
    slot_table = x
    if grouped:
        slot_table = torch.empty(slots, 8, dtype=torch.int32, device=x.device)
        _slot_table_kernel[(cdiv(slots, _SLOT_BLOCK),)](
            offsets, slot_table, R, E, slots, data_rows_r,
            BLOCK_R=block_r, E_POW2=next_power_of_2(E + 1), SLOT_BLOCK=_SLOT_BLOCK, num_warps=4)
    for amax_pass in (True, False) if rowwise else (False,):
        _tile_kernel[grid](
            x, x if data_r is None else data_r, x if scale_r is None else scale_bits(scale_r),
            x if data_c is None else data_c, x if scale_c is None else scale_bits(scale_c), amax_r, amax_c,
            slot_table, x if rows is None else rows, x if bound is None else bound,
            R, C, E, slots, scale_rows_r, data_rows_r,
            x.stride(0), x.stride(1), x.stride(2),
            ALONG_R=along_r, ALONG_C=along_c, GROUPED=grouped, BOUNDED=bound is not None, AMAX_PASS=amax_pass,
            BLOCK=recipe.block or 0, MX=recipe.name == "mxfp8", POW2=recipe.pow2,
            RCEIL=recipe.mx_rounding == "rceil", EMULATE_FP8=interpreting(),
            WIDE=_wide(*(2 * max(block_r, block_c) * n for n in (*x.shape, *x.stride(), data_rows_r, R))),
            GATHER=rows is not None,
            BLOCK_R=block_r, BLOCK_C=block_c, num_warps=num_warps,
        )


def quantize_along(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, recipe: Recipe, dim: int,
                   offsets: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                   bound: torch.Tensor | None = None) -> None:
    """Write ``x`` quantized along ``dim`` into ``data`` and ``scale``; arguments are already checked by
    the caller.

    x: ``[M, K]`` (dim 0 or 1) or ``[E, K, N]`` (dim 1 or 2); bf16, fp16 or fp32, any strides (a unit
    last stride reads coalesced), on a CUDA device or the CPU under the interpreter. data:
    float8_e4m3fn of x's shape, a view of storage whose last dim is ``dim`` (row-major along the last
    dim; for dim 0 of a 2D x, a transposed view of ``[K, M]`` storage; with offsets ``[Mp, K]``, a view of
    ``[K, Mp]`` storage, ``Mp = 128 * (cdiv(M, 128) + E)``, each group from a 128-aligned row, zeros between
    and after the groups). scale: contiguous, shaped as ``dropless.quantized`` lays it out for
    ``(recipe, dim, offsets)``, fp32 or float8_e8m0fnu (mxfp8).
    offsets: int32/int64 ``[E]`` cumulative group ends (2D x, dim 0, not block128x128), read on the
    device: nothing syncs. Every element of data and scale is written. Rowwise along the last dim of a
    2D x reads each row block twice in one program; per group on the Gluon kernel, each group's strip
    twice in one program; other rowwise cases run two launches over a zeroed int32 amax buffer they
    allocate (``[E or 1, K]`` along the tokens).
    rows: int32/int64 ``[M']`` (2D x, dim 0 with offsets): quantize ``x[rows]`` (data and scale shaped for
    M' rows), each row read by index from x: the permuted rows of a layer, never written in x's dtype.
    bound: int ``[1]`` on x's device (2D x, not block128x128), read there: rows from ``bound[0]`` on are
    left unwritten, data and scales (with offsets, the tail past the last group), for a product that
    reads no row past its last group.
    """
    quantize_launcher(x, data, recipe, dim, offsets, rows)(x, data, scale, offsets, rows, bound)


QuantizeLaunch = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None", "torch.Tensor | None",
                           "torch.Tensor | None"], None]


def quantize_launcher(x: torch.Tensor, data: torch.Tensor, recipe: Recipe, dim: int,
                      offsets: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> QuantizeLaunch:
    """``quantize_along``'s choice of kernel and launch shape for these operands, as a function
    ``launch(x, data, scale, offsets, rows, bound)`` that runs it (``quantize_along``'s arguments).

    The choice depends only on what a call signature fixes (shapes, strides, dtypes, device, 16-byte
    alignment of x, the recipe, dim, whether offsets and rows are given, rows' and offsets' sizes), so a
    caller may keep the function and run it on later operands of the same signature, with fresh outputs
    laid out as these."""
    launch_info(x.device)  # a clear error for a CPU tensor outside the interpreter
    if offsets is not None and dim == 0 and quantize_groups_hopper_ok(x, data, recipe, rows):
        M = x.shape[0] if rows is None else rows.shape[0]
        scale_rows = grouped_scale_rows(M, offsets.shape[0], recipe.block)
        return lambda x, data, scale, offsets, rows, bound: quantize_groups_hopper(
            x, data, scale_bits(scale), recipe, offsets, bound is not None, scale_rows, rows)
    if dim == x.dim() - 2:
        return lambda x, data, scale, offsets, rows, bound: _launch_tiles(
            x if x.dim() == 3 else x.unsqueeze(0), recipe, data_r=data, scale_r=scale, offsets=offsets, rows=rows,
            bound=bound)
    if recipe.block is not None or x.dim() == 3:
        scale_name = "scale_r" if recipe.tile else "scale_c"
        return lambda x, data, scale, offsets, rows, bound: _launch_tiles(
            x if x.dim() == 3 else x.unsqueeze(0), recipe, data_c=data, bound=bound, **{scale_name: scale})
    M, K = x.shape
    if M == 0:
        return lambda x, data, scale, offsets, rows, bound: None
    block_m, block_k, num_warps = _rowwise_shape(K)
    grid = (cdiv(M, block_m),)
    constants = dict(M=M, K=K, stride_xm=x.stride(0), stride_xk=x.stride(1), POW2=recipe.pow2,
                     EMULATE_FP8=interpreting(), WIDE=_wide(K * x.stride(1), block_m * x.stride(0), block_m * K),
                     BLOCK_M=block_m, BLOCK_K=block_k, num_warps=num_warps)
    return lambda x, data, scale, offsets, rows, bound: _ROWWISE(
        grid, x=x, data=data, scale=scale, bound_ptr=x if bound is None else bound, BOUNDED=bound is not None,
        **constants)


def quantize_both(x: torch.Tensor, data_k: torch.Tensor, scale_k: torch.Tensor, data_m: torch.Tensor,
                  scale_m: torch.Tensor, recipe: Recipe, offsets: torch.Tensor) -> None:
    """Write ``x [M, K]`` quantized along K (every row) and along M per group, reading x once (rowwise:
    twice); arguments are already checked by the caller.

    One launch of ``_tile_kernel``, its tiles numbered per group (``quantize_along``'s dim 0 with offsets),
    whose tail slots also write the rows past ``offsets[-1]`` along K; rowwise runs two, the amaxes of
    both orientations first. recipe: rowwise, block128 or mxfp8 (not block128x128). x: bf16, fp16 or fp32,
    any strides. data_k / scale_k: as ``quantize_along``'s dim 1
    (data row-major ``[M, K]``, scale ``[M, cdiv(K, block)]``, rowwise ``[M, 1]``); data_m / scale_m: as its dim 0 with
    ``offsets`` (data ``[Mp, K]``, a view of ``[K, Mp]`` storage, scale ``[cdiv(Mp - 128 E, block) + E, K]``).
    offsets: int32/int64 ``[E]``, read on the device. Every element of the four outputs is written.
    """
    launch_info(x.device)
    _launch_tiles(x.unsqueeze(0), recipe, data_r=data_m, scale_r=scale_m, data_c=data_k, scale_c=scale_k,
                  offsets=offsets)


def quantize_weight_3d(w: torch.Tensor, data_k: torch.Tensor, data_n: torch.Tensor, scale_k: torch.Tensor,
                       scale_n: torch.Tensor, recipe: Recipe) -> None:
    """Write ``w [E, K, N]`` quantized along K and along N in one pass over w; arguments are already
    checked by the caller.

    w: bf16, fp16 or fp32, any strides (a transposed view of nn.Linear-layout ``[E, N, K]`` storage or
    contiguous ``[E, K, N]`` read coalesced), on a CUDA device or the CPU under the interpreter.
    data_k: float8_e4m3fn ``[E, K, N]``, a view of ``[E, N, K]`` storage (K contiguous); data_n:
    float8_e4m3fn ``[E, K, N]`` contiguous. scale_k / scale_n: their scales as ``dropless.quantized``
    lays them out (dims 1 and 2); block128x128 writes its one scale per tile into ``scale_k`` and leaves
    ``scale_n`` alone (pass the same tensor). Rowwise reads w twice (the amax along both dims first, into
    int32 buffers ``[E, N]`` and ``[E, K]`` it allocates); the other recipes read it once, on an sm_90 GPU
    through the Gluon kernel where ``quantize_weight_hopper_ok`` says so. Programs cover ``E * tiles``:
    the time per byte does not depend on E. Nothing syncs.
    """
    launch_info(w.device)
    if quantize_weight_hopper_ok(w, data_k, data_n, recipe):
        quantize_weight_hopper(w, data_k, data_n, scale_bits(scale_k), scale_bits(scale_k if recipe.tile else scale_n), recipe)
    else:
        _launch_tiles(w, recipe, data_r=data_k, scale_r=scale_k, data_c=data_n,
                      scale_c=None if recipe.tile else scale_n)
