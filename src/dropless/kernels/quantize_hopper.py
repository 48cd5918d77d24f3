"""FP8 quantization per group along the tokens on Hopper, in Gluon: what ``quantize(x, recipe, dim=0,
offsets)`` runs for a 16-bit ``x [M, K]`` that TMA can read (``quantize_groups_hopper_ok``), or its rows
by index (``rows=``: the permuted copies of a layer's tokens).

The numbering of the work, the layouts and every byte written are those of ``quantize._tile_kernel``'s
per-group tiles (``kernels/quantize.py``): slot s of group g reads x's rows from ``start_g + 128 * local``
(``local`` its place in the group), writes data rows ``128 * s`` to ``128 * s + 127`` of the ``[K, Mp]``
storage (the group's rows, then zeros) and the scale rows of its blocks; a slot past its group's rows
writes zeros and the scales of empty blocks; the tail's slots (past ``offsets[-1]``) write zeros, or
nothing at all when BOUNDED. How a tile moves:
- persistent programs take contiguous shares of the tiles ``(slot, 64 columns)``, numbered slot-major,
  and look a slot's group up once for all its column tiles, from the offsets they hold in registers
  (every warp holds the whole table: no table launch, no exchange between warps);
- a loader warpgroup brings each tile that has rows in its group, ``[128, 64]`` (128 bytes a row), into a
  ring of shared-memory stages by TMA, or, reading rows by index, by 16-byte asynchronous copies;
- four compute warps read a stage in a layout where a thread holds pairs of neighbouring rows of four
  columns, 16 rows in all, with 8 lanes down the rows: a column's amax is taken inside the thread and
  across 8 lanes of one warp (no exchange between warps), and the 8-byte shared-memory reads meet no
  more bank conflicts than their width asks under the 128-byte swizzle;
- the FP8 tile is written transposed into shared memory (a thread's row pairs are neighbouring bytes of
  the output) and leaves by an asynchronous TMA store while the next tile is computed; tiles with no
  rows leave from a buffer of zeros.
Rowwise (one scale per group and column) hands out strips instead, a group's rows of 64 columns: a
program reads a strip's tiles twice, for their column amaxes and then for their values, the second time
mostly from L2 where the strips running together fit in it, in one launch with no amax buffer. A strip's
work is its group's row count, so with skewed routing one group's strips can be several times the
rest. Where the loads are TMA's and the groups more than ``STATIC_MAX_GROUPS``, work is drawn instead
(``ragged_k_hopper``'s by-work schedule): a scheduler warp draws items one at a time from a counter that
all programs share, large groups' first, and queues each for the loader and the compute warps, so a
program that drew a long item draws no more until it is done and short ones fill the gaps at the end. An item is a strip, or, for a strip longer than
``chunk_rows``, one of its chunks of equal rows: each chunk's program adds its partial amaxes into the
strip's (a zeroed int32 buffer) and waits on the strip's counter for its siblings' before it quantizes
(``_chunks_amax``, ``_strip_scheduler`` for why the wait ends). Rows read by index, and strips of a few
groups, keep every ``num_programs``-th strip in group order, whole, two programs a multiprocessor: those
leave no registers for a scheduler warp, and with few groups a counter has no imbalance to win back.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier, tma

from dropless.kernels import fp8_math
from dropless.kernels.direct_launch import DirectLaunch
from dropless.kernels.hopper import (
    descriptor,
    group_bounds,
    group_layout,
    pick,
    post_item,
    release,
    scan_add,
    stage_barriers,
    take_item,
)
from dropless.kernels.launch import LaunchInfo, cdiv, hopper_kernels_ok, launch_info, next_power_of_2
from dropless.quantized import GROUP_ALIGN, Recipe

ROWS: gl.constexpr = gl.constexpr(GROUP_ALIGN)  # token rows a tile: one run of the per-group data
COLUMNS: gl.constexpr = gl.constexpr(64)  # columns a tile: 128 bytes of a 16-bit x
STAGES = 4
PROGRAMS_PER_SM = 2  # 4 stages of 16 KB and 24 KB of output buffers a program
# Rowwise strips read by TMA run one program a multiprocessor, whose stage ring can be deeper: 8 stages
# (152 KB in all) keep twice the bytes in flight, which the long strips of skewed routing need once the
# other programs are done (benchmarks/NOTES.md, v36).
STRIP_STAGES = 8
# A register target of 128 a thread for the Gluon quantizers (up to 256 threads), so that two programs
# share a multiprocessor (warp_specialize's default target is the whole register file, 255 a thread: one
# program): blockwise recipes 1.04-1.13x where two runs agree; gathered rows, whose loads then have twice
# the copies in flight, 1.1-1.3x at DeepSeek-V3 and Qwen3 in both runs (Mixtral's moved both ways); rowwise
# strips read by TMA keep one program, whose strips' second read is served by L2 only while the strips in
# flight fit in it (benchmarks/NOTES.md, v30).
MAX_REGISTERS = 128
LOADER_WARPS = 4  # gathered rows and rowwise strips: a warpgroup, 16 bytes a thread a copy of gathered rows
# Blockwise tiles read by TMA: the loader partition's warps (one issues the loads; one or four measured
# the same, benchmarks/NOTES.md, v47).
TMA_LOADER_WARPS = 4
# Blockwise tiles: neighbouring rows a thread holds, bytes a shared-memory store of the transposed tile.
TILE_THREAD_ROWS = 2
QUEUE: gl.constexpr = gl.constexpr(2)  # rowwise: drawn items the scheduler may queue ahead
CHUNK_SLOTS: gl.constexpr = gl.constexpr(1024)  # rowwise: an item is strip * CHUNK_SLOTS + chunk
# The least rows of a chunk of a rowwise strip drawn by work (``chunk_rows``; benchmarks/NOTES.md, v37).
MIN_CHUNK_ROWS = 2048
# Rowwise strips of at most this many groups keep the static order, two programs a multiprocessor: with
# few groups the counter has no imbalance to win back, and Mixtral's four lost 2-26% drawn by work (v37, v39).
STATIC_MAX_GROUPS = 8


@gluon.jit
def _group_table(offsets_ptr, E, M, E_POW2: gl.constexpr, WARPS: gl.constexpr):
    """Per group (entry E: the tail past ``offsets[-1]``) its rows ``[starts, ends)`` and its first slot,
    ``[E_POW2]`` vectors every warp holds whole."""
    starts, ends = group_bounds(offsets_ptr, E, M, E_POW2, WARPS, True)
    firsts = starts // ROWS + gl.arange(0, E_POW2, layout=group_layout(E_POW2, WARPS, True))
    return starts, ends, firsts


@gluon.jit
def _slot(slot, starts, ends, firsts):
    """Slot -> (its group, its place in the group, the group's first row and end)."""
    group = gl.sum((firsts <= slot).to(gl.int32), axis=0) - 1
    local = slot - pick(firsts, group)
    return group, local, pick(starts, group), pick(ends, group)


@gluon.jit
def _slots_to_run(firsts, E, SLOTS, BOUNDED: gl.constexpr):
    """All the slots, or with BOUNDED those before the tail's first."""
    if BOUNDED:
        slots = pick(firsts, E)
    else:
        slots = SLOTS
    return slots


@gluon.jit
def _tile_range(tiles):
    """This program's tiles: a contiguous share of all of them, so that it looks a slot up once for all
    the slot's column tiles it takes."""
    return gl.program_id(0) * tiles // gl.num_programs(0), (gl.program_id(0) + 1) * tiles // gl.num_programs(0)


@gluon.jit
def _loader(x_desc, x_ptr, rows_ptr, stride_x, x_bufs, ready, empty, offsets_ptr, M, C, E, SLOTS,
            GATHER: gl.constexpr, BOUNDED: gl.constexpr, E_POW2: gl.constexpr, STAGES: gl.constexpr,
            LOADERS: gl.constexpr):
    """Loads (``_load``) of the program's tiles that have rows in their group, into the stage ring, by the
    partition's ``LOADERS`` warps."""
    starts, ends, firsts = _group_table(offsets_ptr, E, M, E_POW2, LOADERS)
    col_tiles = gl.cdiv(C, COLUMNS)
    slots = _slots_to_run(firsts, E, SLOTS, BOUNDED)
    first, last = _tile_range(slots * col_tiles)
    looked_up = first // col_tiles
    group, local, start, end = _slot(looked_up, starts, ends, firsts)
    step = 0
    for tile in range(first, last):
        slot = tile // col_tiles
        if slot != looked_up:
            group, local, start, end = _slot(slot, starts, ends, firsts)
            looked_up = slot
        row0 = start + local * ROWS
        if (row0 < end) & (group < E):
            _load(x_desc, x_ptr, rows_ptr, stride_x, C, x_bufs, ready, empty, step, row0, end,
                  (tile - slot * col_tiles) * COLUMNS, GATHER, STAGES, LOADERS)
            step += 1


@gluon.jit
def _strip_work(C, E, BOUNDED: gl.constexpr):
    """Rowwise: the strips of all groups, then (unless BOUNDED) the tail's, which write its zeros."""
    work = (E + 1) * gl.cdiv(C, COLUMNS)
    if BOUNDED:
        work -= gl.cdiv(C, COLUMNS)
    return work


@gluon.jit
def _item_of(n, strip_ids, strip_ready, strip_empty, work, BY_WORK: gl.constexpr, WARPS: gl.constexpr):
    """The ``n``-th item of this program, ``strip * CHUNK_SLOTS + chunk``: the scheduler's ``n``-th draw
    (BY_WORK), or every ``num_programs``-th strip in group order, whole; -1 past the last."""
    if BY_WORK:
        item = take_item(strip_ids, strip_ready, strip_empty, n, QUEUE, WARPS)
    else:
        strip = gl.program_id(0) + n * gl.num_programs(0)
        item = gl.where(strip < work, strip * CHUNK_SLOTS, -1)
    return item


@gluon.jit
def _prefix(values):
    """An int vector's exclusive prefix sum and its total."""
    return gl.associative_scan(values, 0, scan_add) - values, gl.sum(values, axis=0)


@gluon.jit
def _chunk_count(rows, CHUNK):
    """How many chunks a strip of ``rows`` rows (a scalar or a vector) is cut into: at least one, and as
    many as chunks of at most CHUNK rows take (``_chunk_rows`` makes them of equal rows)."""
    return gl.maximum(gl.cdiv(rows, CHUNK), 1)


@gluon.jit
def _draw_table(offsets_ptr, E, M, CHUNK, col_tiles, E_POW2: gl.constexpr):
    """Per group, ``[E_POW2]`` vectors over one warp: its chunk count (``_chunk_count``; 0 from entry E on)
    and the first of its items in the draw order (each
    item a chunk of one of its strips, strip-major); and the groups' item count. Groups are drawn by size
    class: those of more than 8 times the mean size first, then those of more than twice it, then the
    rest, each class in group order. That is largest first to within a class, from three prefix sums; an
    exact ranking (a loop over the groups) cost ~15 us at E = 128 before the first draw (v36)."""
    e = gl.arange(0, E_POW2, layout=group_layout(E_POW2, 1, False))
    starts, ends = group_bounds(offsets_ptr, E, M, E_POW2, 1)
    routed = e < E
    sizes = gl.where(routed, ends - starts, 0)
    chunks = gl.where(routed, _chunk_count(sizes, CHUNK), 0)
    items = chunks * col_tiles
    mean = gl.sum(sizes, axis=0) // E
    huge = sizes > 8 * mean
    large = (sizes > 2 * mean) & (sizes <= 8 * mean)
    first_huge, huge_items = _prefix(gl.where(huge, items, 0))
    first_large, large_items = _prefix(gl.where(large, items, 0))
    first_rest, rest_items = _prefix(gl.where(sizes <= 2 * mean, items, 0))
    firsts = gl.where(huge, first_huge, gl.where(large, huge_items + first_large, huge_items + large_items + first_rest))
    return chunks, firsts, huge_items + large_items + rest_items


@gluon.jit
def _strip_scheduler(strip_ids, strip_ready, strip_empty, chunk_done, counter_ptr, offsets_ptr, M, C, E, CHUNK,
                     BOUNDED: gl.constexpr, E_POW2: gl.constexpr):
    """Rowwise, one warp: draws items one at a time from a counter that all programs share (the groups'
    chunks of strips in ``_draw_table``'s order, then the tail's strips, which read nothing), and queues
    them for the loader and the compute partition, ending with -1. It runs up to QUEUE items ahead, so the
    counter's latency is off the loader's path, except after a chunk of a strip cut into several: that
    chunk waits for its siblings' amaxes (``_chunks_amax``), so nothing more is drawn until the compute
    partition is done with it. A program then never holds an item queued behind a chunk that waits, and
    the chunks waited for are held by programs that are running, or will be drawn by them once they finish
    what they hold (fewer chunks a strip than programs, ``chunk_rows``)."""
    e = gl.arange(0, E_POW2, layout=group_layout(E_POW2, 1, False))
    col_tiles = gl.cdiv(C, COLUMNS)
    chunks, firsts, routed = _draw_table(offsets_ptr, E, M, CHUNK, col_tiles, E_POW2)
    work = routed
    if not BOUNDED:
        work += col_tiles
    n = 0
    waits = 0
    drawn = gl.atomic_add(counter_ptr, 1, sem="relaxed")
    while drawn < work:
        group = gl.where(drawn < routed,
                         gl.sum(gl.where((firsts <= drawn) & (drawn < firsts + chunks * col_tiles), e, 0), axis=0), E)
        split = gl.where(drawn < routed, pick(chunks, group), 1)
        local = gl.where(drawn < routed, drawn - pick(firsts, group), drawn - routed)
        post_item(strip_ids, strip_ready, strip_empty, n, (group * col_tiles + local // split) * CHUNK_SLOTS + local % split,
                  QUEUE)
        n += 1
        if split > 1:
            mbarrier.wait(chunk_done.index(0), waits & 1)
            waits += 1
        drawn = gl.atomic_add(counter_ptr, 1, sem="relaxed")
    post_item(strip_ids, strip_ready, strip_empty, n, -1, QUEUE)


@gluon.jit
def _chunk_rows(start, end, chunk, CHUNK):
    """The rows ``[first, last)`` of chunk ``chunk`` of a strip of the group's rows ``[start, end)``, and
    the rows of its chunks: ``_chunk_count`` chunks of equal rows to within 128 (a short last chunk would
    wait for its long siblings with nothing to do)."""
    rows = end - start
    size = gl.cdiv(gl.cdiv(rows, _chunk_count(rows, CHUNK)), ROWS) * ROWS
    first = start + chunk * size
    return first, gl.minimum(first + size, end), size


@gluon.jit
def _strip_loader(x_desc, x_ptr, rows_ptr, stride_x, x_bufs, ready, empty, strip_ids, strip_ready, strip_empty,
                  offsets_ptr, M, C, E, CHUNK, GATHER: gl.constexpr, BOUNDED: gl.constexpr, BY_WORK: gl.constexpr,
                  E_POW2: gl.constexpr, STAGES: gl.constexpr, LOADERS: gl.constexpr):
    """Rowwise: loads of the tiles of each of the program's items (``_item_of``), twice, for its amax and
    then for its values (the tail's strips load nothing)."""
    starts, ends, firsts = _group_table(offsets_ptr, E, M, E_POW2, LOADERS)
    col_tiles = gl.cdiv(C, COLUMNS)
    work = _strip_work(C, E, BOUNDED)
    step = 0
    n = 0
    item = _item_of(n, strip_ids, strip_ready, strip_empty, work, BY_WORK, LOADERS)
    while item >= 0:
        strip = item // CHUNK_SLOTS
        group = strip // col_tiles
        if group < E:
            col0 = (strip - group * col_tiles) * COLUMNS
            end = pick(ends, group)
            first = pick(starts, group)
            last = end
            if BY_WORK:
                first, last, _ = _chunk_rows(first, end, item % CHUNK_SLOTS, CHUNK)
            for _ in range(2):
                for row0 in range(first, last, ROWS):
                    _load(x_desc, x_ptr, rows_ptr, stride_x, C, x_bufs, ready, empty, step, row0, end, col0, GATHER,
                          STAGES, LOADERS)
                    step += 1
        n += 1
        item = _item_of(n, strip_ids, strip_ready, strip_empty, work, BY_WORK, LOADERS)


@gluon.jit
def _load(x_desc, x_ptr, rows_ptr, stride_x, C, x_bufs, ready, empty, step, row0, end, col0,
          GATHER: gl.constexpr, STAGES: gl.constexpr, LOADERS: gl.constexpr):
    """The operand's tile at ``[row0, col0]`` into the stage of ``step``, once that stage is free: one TMA
    load, or with GATHER each of its rows up to ``end`` read by index (row r of the operand is x's row
    ``rows[r]``), 16 bytes a thread a copy, each thread's copies counted by the stage's ready barrier.
    Gathered rows are copied up to C rounded up to 8 elements (16 bytes), within x's row stride, which
    TMA's alignment makes a multiple of 8: the columns past C are never stored."""
    stage = step % STAGES
    mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)
    if GATHER:
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [LOADERS, 1], [1, 0])
        r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        c = col0 + gl.arange(0, COLUMNS, layout=gl.SliceLayout(0, layout))
        ok = r < end - row0
        source = gl.load(rows_ptr + row0 + r, mask=ok, other=0).to(gl.int64)
        # In units of 8 elements, so that the compiler sees 16-byte runs.
        ptrs = x_ptr + source[:, None] * (stride_x // 8 * 8) + c[None, :]
        columns = gl.cdiv(C, 8) * 8
        async_copy.async_copy_global_to_shared(x_bufs.index(stage), ptrs, mask=ok[:, None] & (c < columns)[None, :])
        async_copy.mbarrier_arrive(ready.index(stage), increment_count=False)
    else:
        mbarrier.expect(ready.index(stage), x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [row0, col0], ready.index(stage), x_bufs.index(stage))


@gluon.jit
def stage_values(x_bufs, ready, step, layout: gl.constexpr, STAGES: gl.constexpr):
    """The tile of ``step`` from its stage, once loaded, in ``layout``."""
    stage = step % STAGES
    mbarrier.wait(ready.index(stage), (step // STAGES) & 1)
    return x_bufs.index(stage).load(layout)


@gluon.jit
def take_stage(x_bufs, ready, empty, step, layout: gl.constexpr, STAGES: gl.constexpr):
    """``stage_values`` as fp32, the stage given back to the loader."""
    v = stage_values(x_bufs, ready, step, layout, STAGES)
    release(empty, step, STAGES)
    return v.to(gl.float32)


@gluon.jit
def _take(x_bufs, ready, empty, step, row0, end, layout: gl.constexpr, STAGES: gl.constexpr):
    """``take_stage`` with the rows past the group's end made zeros."""
    v = take_stage(x_bufs, ready, empty, step, layout, STAGES)
    if row0 + ROWS > end:
        rows = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
        v = gl.where((rows < end - row0)[:, None], v, 0.0)
    return v


@gluon.jit
def column_amax(v, axis: gl.constexpr):
    """``max |v|`` along ``axis``, NaN counted as 0 (``fp8_math.magnitude``'s rule: maxnum skips NaN, and
    a column of NaN only gives NaN, which the last maximum with 0 turns into 0)."""
    return gl.maximum(gl.max(gl.abs(v), axis=axis), 0.0)


@gluon.jit
def _store_block_scales(scale_ptr, scale, group, local, start, end, C, col0, E, SCALE_ROWS,
                        BLOCK: gl.constexpr, MX: gl.constexpr):
    """Write a tile's block scales ``scale [ROWS // BLOCK, COLUMNS]``: the tile's blocks are the group's
    blocks ``local * ROWS // BLOCK`` onwards, whose scale rows start at ``start // BLOCK + group``; the
    group's rows end at ``end // BLOCK + group + 1``, the tail's at SCALE_ROWS. An E8M0 block with no
    rows holds 2**0, as the layout asks (an fp32 one gets 1 from its zero amax)."""
    layout: gl.constexpr = scale.type.layout
    b = gl.arange(0, ROWS // BLOCK, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, COLUMNS, layout=gl.SliceLayout(0, layout))
    row0 = start + local * ROWS
    first_row = start // BLOCK + group + local * (ROWS // BLOCK)
    rows_end = gl.where(group < E, end // BLOCK + group + 1, SCALE_ROWS)
    if MX:
        has_rows = (b * BLOCK < end - row0) & (group < E)
        scale = gl.where(has_rows[:, None], scale, fp8_math.E8M0_ONE)
    ptrs = scale_ptr + (first_row + b).to(gl.int64)[:, None] * C + (col0 + c)[None, :]
    gl.store(ptrs, scale.to(scale_ptr.dtype.element_ty), mask=(b < rows_end - first_row)[:, None] & (c < C - col0)[None, :])


@gluon.jit
def _compute(x_bufs, out_bufs, zero_buf, ready, empty, data_desc, scale_ptr, offsets_ptr, M, C, E, SLOTS, SCALE_ROWS,
             BLOCK: gl.constexpr, MX: gl.constexpr, POW2: gl.constexpr, RCEIL: gl.constexpr,
             BOUNDED: gl.constexpr, E_POW2: gl.constexpr, STAGES: gl.constexpr, THREAD_ROWS: gl.constexpr,
             num_warps: gl.constexpr):
    """The default partition: each tile's block amaxes and scales, its FP8 values written transposed, its
    store. A thread holds runs of ``THREAD_ROWS`` neighbouring rows of 4 columns: each run is one
    shared-memory store of the transposed tile."""
    layout: gl.constexpr = gl.BlockedLayout([THREAD_ROWS, 4], [8, 4], [1, num_warps], [1, 0])
    starts, ends, firsts = _group_table(offsets_ptr, E, M, E_POW2, num_warps)
    col_tiles = gl.cdiv(C, COLUMNS)
    slots = _slots_to_run(firsts, E, SLOTS, BOUNDED)
    _fill_zeros(zero_buf, layout)
    step = 0
    written = 0
    first, last = _tile_range(slots * col_tiles)
    looked_up = first // col_tiles
    group, local, start, end = _slot(looked_up, starts, ends, firsts)
    for tile in range(first, last):
        slot = tile // col_tiles
        col0 = (tile - slot * col_tiles) * COLUMNS
        if slot != looked_up:
            group, local, start, end = _slot(slot, starts, ends, firsts)
            looked_up = slot
        row0 = start + local * ROWS
        live = (row0 < end) & (group < E)
        if live:
            v = _take(x_bufs, ready, empty, step, row0, end, layout, STAGES)
            step += 1
            v3 = v.reshape([ROWS // BLOCK, BLOCK, COLUMNS])
            scale = fp8_math.gluon_block_scale(column_amax(v3, 1), MX, POW2, RCEIL)
            q = fp8_math.gluon_to_fp8(v3, scale[:, None, :], MX, False).reshape([ROWS, COLUMNS])
            _store_block_scales(scale_ptr, scale, group, local, start, end, C, col0, E, SCALE_ROWS, BLOCK, MX)
            _send(q, out_bufs, written, data_desc, col0, slot * ROWS)
            written += 1
        else:
            scale_layout: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, num_warps], [1, 0])
            zeros = gl.zeros([ROWS // BLOCK, COLUMNS], gl.float32, scale_layout)
            _store_block_scales(scale_ptr, fp8_math.gluon_block_scale(zeros, MX, POW2, RCEIL), group, local, start, end,
                                C, col0, E, SCALE_ROWS, BLOCK, MX)
            tma.async_copy_shared_to_global(data_desc, [col0, slot * ROWS], zero_buf)
    tma.store_wait(pendings=0)


@gluon.jit
def _fill_zeros(zero_buf, layout: gl.constexpr):
    """The buffer tiles with no rows leave from."""
    zero_buf.store(gl.zeros([ROWS, COLUMNS], gl.float32, layout).to(gl.float8e4nv).permute((1, 0)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _send(q, out_bufs, written, data_desc, col0, data_row):
    """An asynchronous TMA store of the FP8 tile ``q [ROWS, COLUMNS]``, transposed, to the data rows from
    ``data_row`` of the columns from ``col0``, through the output buffer of the ``written``-th tile."""
    out = out_bufs.index(written % 2)
    # The store that last read this buffer (two written tiles ago) is done.
    tma.store_wait(pendings=1)
    gl.thread_barrier()
    out.store(q.permute((1, 0)))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(data_desc, [col0, data_row], out)


@gluon.jit
def _chunks_amax(amax, amax_ptr, counter_ptr, chunks, ok):
    """A strip's column amaxes from the partial ones of its ``chunks`` chunks, each taken by its own
    program: this chunk's go into the strip's int32 amaxes (the bits of a non-negative float order as
    integers), then the strip's counter counts the chunk (release, after every thread's maxima); once it
    reaches ``chunks`` (acquire), the strip's amaxes are read back."""
    gl.atomic_max(amax_ptr, amax.to(gl.int32, bitcast=True), mask=ok, sem="relaxed")
    gl.thread_barrier()
    arrived = gl.atomic_add(counter_ptr, 1, sem="release") + 1
    while arrived < chunks:
        arrived = gl.atomic_add(counter_ptr, 0, sem="acquire")
    bits = gl.atomic_max(amax_ptr, gl.zeros_like(amax).to(gl.int32), mask=ok, sem="acquire")
    return gl.where(ok, bits.to(gl.float32, bitcast=True), 0.0)


@gluon.jit
def _strip_compute(x_bufs, out_bufs, zero_buf, ready, empty, strip_ids, strip_ready, strip_empty, chunk_done, data_desc,
                   scale_ptr, work_ptr, offsets_ptr, M, C, E, SLOTS, CHUNK, POW2: gl.constexpr, BOUNDED: gl.constexpr,
                   BY_WORK: gl.constexpr, E_POW2: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    """Rowwise, the default partition: for each of the program's items (``_item_of``), a chunk of a strip,
    its column amaxes over its tiles (with its sibling chunks' where the strip has several:
    ``_chunks_amax``, then the scheduler is told), the scales (one per group and column, from the first
    chunk), then its tiles again, quantized; the strip's last chunk also writes the zeros of its slots
    past the group's rows; the tail's strips write zeros (there are none with BOUNDED). ``work_ptr``:
    the draw counter, then a counter a strip, then the int32 amaxes ``[E, C]``."""
    layout: gl.constexpr = gl.BlockedLayout([2, 4], [8, 4], [1, num_warps], [1, 0])
    cols = gl.arange(0, COLUMNS, layout=gl.SliceLayout(0, layout))
    starts, ends, firsts = _group_table(offsets_ptr, E, M, E_POW2, num_warps)
    col_tiles = gl.cdiv(C, COLUMNS)
    _fill_zeros(zero_buf, layout)
    work = _strip_work(C, E, BOUNDED)
    step = 0
    written = 0
    n = 0
    item = _item_of(n, strip_ids, strip_ready, strip_empty, work, BY_WORK, num_warps)
    while item >= 0:
        strip = item // CHUNK_SLOTS
        chunk = item % CHUNK_SLOTS
        group = strip // col_tiles
        col0 = (strip - group * col_tiles) * COLUMNS
        start = pick(starts, group)
        routed = group < E
        # The tail's rows are not read: its data is zeros.
        end = gl.where(routed, pick(ends, group), start)
        # Rows read by index take whole strips (CHUNK past every group's rows).
        split = _chunk_count(end - start, CHUNK)
        first = start
        last = end
        size = CHUNK
        if BY_WORK:
            first, last, size = _chunk_rows(start, end, chunk, CHUNK)
        amax = gl.zeros([COLUMNS], gl.float32, gl.SliceLayout(0, layout))
        for row0 in range(first, last, ROWS):
            amax = gl.maximum(amax, column_amax(_take(x_bufs, ready, empty, step, row0, end, layout, STAGES), 0))
            step += 1
        ok = cols < C - col0
        if split > 1:
            amax = _chunks_amax(amax, work_ptr + 1 + E * col_tiles + group * C + col0 + cols, work_ptr + 1 + strip,
                                split, ok)
        scale = fp8_math.gluon_block_scale(amax, False, POW2, False)
        gl.store(scale_ptr + group * C + col0 + cols, scale, mask=ok & routed & (chunk == 0))
        slot0 = pick(firsts, group) + chunk * (size // ROWS)
        slots_end = gl.where(routed, pick(firsts, group + 1), SLOTS)
        for slot in range(slot0, gl.where(chunk == split - 1, slots_end, slot0 + size // ROWS)):
            row0 = first + (slot - slot0) * ROWS
            if row0 < end:
                v = _take(x_bufs, ready, empty, step, row0, end, layout, STAGES)
                step += 1
                _send(fp8_math.gluon_to_fp8(v, scale[None, :], False, False), out_bufs, written, data_desc, col0, slot * ROWS)
                written += 1
            else:
                tma.async_copy_shared_to_global(data_desc, [col0, slot * ROWS], zero_buf)
        if split > 1:
            release(chunk_done, 0, 1)
        n += 1
        item = _item_of(n, strip_ids, strip_ready, strip_empty, work, BY_WORK, num_warps)
    tma.store_wait(pendings=0)


@gluon.jit
def _quantize_groups_kernel(x_desc, x_ptr, rows_ptr, stride_x, data_desc, scale_ptr, work_ptr, offsets_ptr,
                            M, C, E, SLOTS, SCALE_ROWS, CHUNK,
                            BLOCK: gl.constexpr, MX: gl.constexpr, POW2: gl.constexpr, RCEIL: gl.constexpr,
                            GATHER: gl.constexpr, BOUNDED: gl.constexpr, BY_WORK: gl.constexpr, E_POW2: gl.constexpr,
                            STAGES: gl.constexpr, LOADERS: gl.constexpr, THREAD_ROWS: gl.constexpr,
                            num_warps: gl.constexpr):
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, ROWS, COLUMNS], x_desc.layout)
    out_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2, COLUMNS, ROWS], data_desc.layout)
    zero_buf = gl.allocate_shared_memory(gl.float8e4nv, [COLUMNS, ROWS], data_desc.layout)
    if GATHER:
        ready, empty = stage_barriers(STAGES, 1, 32 * LOADERS)
    else:
        ready, empty = stage_barriers(STAGES)
    if BLOCK == 0:
        # The queue of drawn items (BY_WORK): a slot is free again once the loader and the compute
        # partition have both read it; chunk_done: the compute partition is done with a chunk that waited.
        strip_ids = gl.allocate_shared_memory(gl.int32, [QUEUE, 1], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        strip_ready, strip_empty = stage_barriers(QUEUE, readers=2)
        chunk_done = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        mbarrier.init(chunk_done.index(0), count=1)
        # Two calls, the same but for the scheduler: warp_specialize takes its partitions as literals.
        if BY_WORK:
            gl.warp_specialize([
                (_strip_compute, (x_bufs, out_bufs, zero_buf, ready, empty, strip_ids, strip_ready, strip_empty,
                                  chunk_done, data_desc, scale_ptr, work_ptr, offsets_ptr, M, C, E, SLOTS, CHUNK, POW2,
                                  BOUNDED, True, E_POW2, STAGES, num_warps)),
                (_strip_loader, (x_desc, x_ptr, rows_ptr, stride_x, x_bufs, ready, empty, strip_ids, strip_ready,
                                 strip_empty, offsets_ptr, M, C, E, CHUNK, GATHER, BOUNDED, True, E_POW2, STAGES, LOADERS)),
                (_strip_scheduler, (strip_ids, strip_ready, strip_empty, chunk_done, work_ptr, offsets_ptr, M, C, E,
                                    CHUNK, BOUNDED, E_POW2)),
            ], [LOADERS, 1], [64, 96])
        else:
            gl.warp_specialize([
                (_strip_compute, (x_bufs, out_bufs, zero_buf, ready, empty, strip_ids, strip_ready, strip_empty,
                                  chunk_done, data_desc, scale_ptr, work_ptr, offsets_ptr, M, C, E, SLOTS, CHUNK, POW2,
                                  BOUNDED, False, E_POW2, STAGES, num_warps)),
                (_strip_loader, (x_desc, x_ptr, rows_ptr, stride_x, x_bufs, ready, empty, strip_ids, strip_ready,
                                 strip_empty, offsets_ptr, M, C, E, CHUNK, GATHER, BOUNDED, False, E_POW2, STAGES, LOADERS)),
            ], [LOADERS], [64])
    else:
        gl.warp_specialize([
            (_compute, (x_bufs, out_bufs, zero_buf, ready, empty, data_desc, scale_ptr, offsets_ptr, M, C, E,
                        SLOTS, SCALE_ROWS, BLOCK, MX, POW2, RCEIL, BOUNDED, E_POW2, STAGES, THREAD_ROWS, num_warps)),
            (_loader, (x_desc, x_ptr, rows_ptr, stride_x, x_bufs, ready, empty, offsets_ptr, M, C, E, SLOTS,
                       GATHER, BOUNDED, E_POW2, STAGES, LOADERS)),
        ], [LOADERS], [64])


_LAUNCH = DirectLaunch(_quantize_groups_kernel)


def quantize_groups_hopper_ok(x: torch.Tensor, data: torch.Tensor, recipe: Recipe, rows: torch.Tensor | None) -> bool:
    """Whether the Gluon kernel quantizes ``x [M, K]`` (or ``x[rows]``) per group along the tokens into
    ``data`` (a ``[Mp, K]`` view of ``[K, Mp]`` storage): a 16-bit x that TMA reads on an sm_90 GPU, a
    non-empty operand, a recipe other than block128x128, and few enough tiles that a program's share of
    them is found in 32-bit arithmetic (``tiles * programs < 2**31``: some 9 million rows at K = 7168), and
    for rowwise an item ``strip * CHUNK_SLOTS + chunk`` too (some 2 million rows at K = 7168)."""
    M = x.shape[0] if rows is None else rows.shape[0]
    if not (x.dim() == 2 and not recipe.tile and M > 0 and hopper_kernels_ok(x) and LaunchInfo.tma_ok(data.t())):
        return False
    tiles = data.shape[0] // GROUP_ALIGN * cdiv(x.shape[1], COLUMNS.value)
    programs = PROGRAMS_PER_SM * launch_info(x.device).num_programs
    return tiles * (max(programs, CHUNK_SLOTS.value) if recipe.block is None else programs) < 2**31


def chunk_rows(M: int, C: int, programs: int) -> int:
    """Rows a chunk of a rowwise strip drawn by work (a multiple of 128): half a program's share of the
    rows of all strips, so that no item is longer than that and a long strip no longer holds one program
    past the rest (a shorter cut only adds waits: Mixtral's 4,096-row strips cut in two lost 4-10%, v37);
    at least ``MIN_CHUNK_ROWS``; and long enough that a strip has fewer chunks than there are ``programs``
    (and than ``CHUNK_SLOTS``): the programs holding a strip's chunks can then never all be waiting for
    chunks not yet drawn."""
    share = cdiv(M * cdiv(C, COLUMNS.value), programs)
    fewest = GROUP_ALIGN * cdiv(cdiv(M, GROUP_ALIGN), min(programs, CHUNK_SLOTS.value) - 2)
    return max(MIN_CHUNK_ROWS, GROUP_ALIGN * cdiv(share, 2 * GROUP_ALIGN), fewest)


def quantize_groups_hopper(x: torch.Tensor, data: torch.Tensor, scale: torch.Tensor, recipe: Recipe,
                           offsets: torch.Tensor, bounded: bool, scale_rows: int,
                           rows: torch.Tensor | None = None) -> None:
    """Write ``x [M, K]`` (with ``rows [M']``: ``x[rows]``, each row read by index) quantized per group
    along the tokens (``quantize.quantize_along``'s dim 0 with offsets) into ``data [Mp, K]`` and
    ``scale`` (``[scale_rows, K]``; the raw bytes of E8M0 scales), for operands
    ``quantize_groups_hopper_ok`` accepts. int32 ``offsets [E]`` are read on the device. bounded: the
    tail past ``offsets[-1]`` writes nothing."""
    C = x.shape[1]
    M = x.shape[0] if rows is None else rows.shape[0]
    E = offsets.shape[0]
    slots = cdiv(M, GROUP_ALIGN) + E
    # Strips read by TMA are drawn from a counter, long ones in chunks, unless the groups are few; rows
    # read by index keep the static order, whole strips, whose two programs a multiprocessor a scheduler
    # warp would cost (a third warpgroup's registers).
    by_work = recipe.block is None and rows is None and E > STATIC_MAX_GROUPS
    limited = not by_work
    programs = (PROGRAMS_PER_SM if limited else 1) * launch_info(x.device).num_programs
    chunk = chunk_rows(M, C, programs) if by_work else GROUP_ALIGN * cdiv(M, GROUP_ALIGN)
    # Rowwise hands out strips (a group's rows, 64 columns; the tail's too), those drawn by work in chunks,
    # the blockwise recipes tiles. A grid of programs enough for them all, or one a multiprocessor's worth.
    work = (E + 1 + (cdiv(M, chunk) if by_work else 0) if recipe.block is None else slots) * cdiv(C, COLUMNS.value)
    if by_work:
        # The draw counter, then where strips cut into chunks meet: a counter a strip, the amaxes [E, C].
        shared = 1 + (E * cdiv(C, COLUMNS.value) + E * C if M > chunk else 0)
        work_buffer = torch.zeros(shared, dtype=torch.int32, device=x.device)
    else:
        work_buffer = offsets
    loaders = TMA_LOADER_WARPS if rows is None and recipe.block is not None else LOADER_WARPS
    _LAUNCH((max(1, min(work, programs)),), x_desc=descriptor(x, [GROUP_ALIGN, COLUMNS.value]), x_ptr=x,
            rows_ptr=x if rows is None else rows, stride_x=x.stride(0),
            data_desc=descriptor(data.t(), [COLUMNS.value, GROUP_ALIGN]), scale_ptr=scale, work_ptr=work_buffer,
            offsets_ptr=offsets, M=M, C=C, E=E, SLOTS=slots, SCALE_ROWS=scale_rows, CHUNK=chunk,
            BLOCK=recipe.block or 0, MX=recipe.name == "mxfp8", POW2=recipe.pow2, RCEIL=recipe.mx_rounding == "rceil",
            GATHER=rows is not None, BOUNDED=bounded, BY_WORK=by_work, E_POW2=next_power_of_2(E + 1),
            STAGES=STRIP_STAGES if by_work else STAGES, LOADERS=loaders, THREAD_ROWS=TILE_THREAD_ROWS, num_warps=4,
            maxnreg=MAX_REGISTERS if limited else None)
