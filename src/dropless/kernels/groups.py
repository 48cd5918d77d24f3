"""Device-side group table: every program derives the group boundaries from ``offsets`` itself.

The host never learns the group sizes. Each program loads the whole ``offsets`` vector (E <= a few
thousand, a few registers per thread) and answers "which group owns tile t" with one vector compare
and sum, so tiles can be numbered over all groups and handed out by a persistent grid.
"""

import triton
import triton.language as tl


@triton.jit
def group_bounds(offsets_ptr, E, M, E_POW2: tl.constexpr):
    """Row range ``[starts[e], ends[e])`` of each group as ``[E_POW2]`` int32 vectors.

    Entry ``E`` is the tail: rows ``[offsets[E-1], M)`` that belong to no expert. Entries past it
    are empty. Bounds are clamped to ``[0, M]`` and made non-decreasing (a running maximum), so
    malformed offsets can neither address memory outside the operands nor make groups overlap.
    """
    e = tl.arange(0, E_POW2)
    ends = tl.load(offsets_ptr + e, mask=e < E, other=M).to(tl.int32)
    ends = tl.associative_scan(tl.minimum(tl.maximum(ends, 0), M), 0, _maximum)
    starts = tl.load(offsets_ptr + e - 1, mask=(e > 0) & (e <= E), other=0).to(tl.int32)
    starts = tl.associative_scan(tl.minimum(tl.maximum(starts, 0), M), 0, _maximum)
    starts = tl.where(e > E, M, starts)
    return starts, tl.maximum(ends, starts)


@triton.jit
def _maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def pick(values, index, E_POW2: tl.constexpr):
    """``values[index]`` for a register vector ``values [E_POW2]`` and a scalar ``index``."""
    return tl.sum(tl.where(tl.arange(0, E_POW2) == index, values, 0), axis=0)


@triton.jit
def grouped_raster(local_tile, tiles_m, tiles_n, GROUP_M: tl.constexpr):
    """Map a tile number inside one group to ``(pid_m, pid_n)``, GROUP_M rows of tiles at a time.

    Neighbouring programs then share the same few A row-blocks and B column-blocks, which stay in L2.
    """
    width = GROUP_M * tiles_n
    first_m = (local_tile // width) * GROUP_M
    group_size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (local_tile % width) % group_size_m
    pid_n = (local_tile % width) // group_size_m
    return pid_m, pid_n


@triton.jit
def tile_table(offsets_ptr, E, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, E_POW2: tl.constexpr):
    """The ragged-M tile numbering: each group's row range (``group_bounds``, entry E the unrouted tail),
    its ``BLOCK_M x BLOCK_N`` tile count and the running total of those, as ``[E_POW2]`` vectors."""
    starts, ends = group_bounds(offsets_ptr, E, M, E_POW2)
    tiles = tl.cdiv(ends - starts, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    return starts, ends, tiles, tl.cumsum(tiles, axis=0)


@triton.jit
def zero_tail(c, starts, ends, N, stride_cm, stride_cn, E, NUM_PROGRAMS: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, E_POW2: tl.constexpr):
    """Zeros over the unrouted tail of ``c [M, N]`` (entry E of ``tile_table``: the rows past the last
    group), its ``BLOCK_M x BLOCK_N`` tiles shared out over the persistent programs after their
    products: those rows cost their bytes, not a K loop over zeros."""
    row_start = pick(starts, E, E_POW2)
    row_end = pick(ends, E, E_POW2)
    tiles_n = tl.cdiv(N, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=c.dtype.element_ty)
    for t in range(tl.program_id(0), tl.cdiv(row_end - row_start, BLOCK_M) * tiles_n, NUM_PROGRAMS):
        row0 = row_start + (t // tiles_n) * BLOCK_M
        col0 = (t % tiles_n) * BLOCK_N
        ptrs = c + (row0 + rows).to(tl.int64)[:, None] * stride_cm + (col0 + cols)[None, :] * stride_cn
        tl.store(ptrs, zeros, mask=(rows < row_end - row0)[:, None] & (cols < N - col0)[None, :])


@triton.jit
def locate_tile(tile_id, starts, ends, tiles, tiles_end, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                GROUP_M: tl.constexpr, E_POW2: tl.constexpr):
    """Ragged-M tile number -> ``(group, group's end row, tile's first row, tile's first column)``."""
    group = tl.sum((tiles_end <= tile_id).to(tl.int32), axis=0)
    row_start = pick(starts, group, E_POW2)
    row_end = pick(ends, group, E_POW2)
    local_tile = tile_id - pick(tiles_end - tiles, group, E_POW2)
    pid_m, pid_n = grouped_raster(local_tile, tl.cdiv(row_end - row_start, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    return group, row_end, row_start + pid_m * BLOCK_M, pid_n * BLOCK_N
