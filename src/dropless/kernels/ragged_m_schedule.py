"""Which program of the Hopper ragged-M kernel computes which piece of which output tile.

Tiles are numbered group after group (group E, the unrouted tail, last); every program derives the
numbering from ``offsets`` on the device. The real tiles (groups 0..E-1) are dealt out round robin,
one whole tile at a time. With ``STREAM_K`` only the full waves are: the real tiles left over, fewer
than one per program, are cut along K so that every program gets one run of ``span`` consecutive
k-steps of them (at least ``k_steps / SPLIT_MAX``), and the pieces of a tile are summed afterwards
(``ragged_m_hopper._fixup_kernel``). Without it a last, partial wave of whole tiles leaves most
programs idle while a few finish: up to one tile's time in every launch. The tail's tiles (zeros,
no loads) come last.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from dropless.kernels.hopper import group_bounds, raster


@gluon.jit
def _scan_add(a, b):
    return a + b


@gluon.jit
def _pick(values, index, layout: gl.constexpr, E_POW2: gl.constexpr):
    """``values[index]`` of a register vector."""
    return gl.sum(gl.where(gl.arange(0, E_POW2, layout=layout) == index, values, 0), axis=0)


@gluon.jit
def group_table(offsets_ptr, E, M, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, E_POW2: gl.constexpr,
                WARPS: gl.constexpr):
    """Row ranges ``[starts, ends)`` of the groups (``hopper.group_bounds``; entry E: the unrouted
    tail) and the running total of their tiles, as ``[E_POW2]`` vectors; and the number of real
    tiles (those of groups 0..E-1)."""
    starts, ends = group_bounds(offsets_ptr, E, M, E_POW2, WARPS)
    tiles = gl.cdiv(ends - starts, BLOCK_M) * gl.cdiv(N, BLOCK_N)
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    real = gl.sum(gl.where(gl.arange(0, E_POW2, layout=layout) < E, tiles, 0), axis=0)
    return starts, ends, tiles, gl.associative_scan(tiles, 0, _scan_add), real


@gluon.jit
def locate(tile_id, starts, ends, tiles, tiles_end, N, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
           GROUP_M: gl.constexpr, E_POW2: gl.constexpr, WARPS: gl.constexpr):
    """Tile number -> (group, first row, group end, first column)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    group = gl.sum((tiles_end <= tile_id).to(gl.int32), axis=0)
    start = _pick(starts, group, layout, E_POW2)
    end = _pick(ends, group, layout, E_POW2)
    local = tile_id - _pick(tiles_end - tiles, group, layout, E_POW2)
    pid_m, pid_n = raster(local, gl.cdiv(end - start, BLOCK_M), gl.cdiv(N, BLOCK_N), GROUP_M)
    return group, start + pid_m * BLOCK_M, end, pid_n * BLOCK_N


@gluon.jit
def split_plan(real, programs, K, BLOCK_K: gl.constexpr, STREAM_K: gl.constexpr, SPLIT_MAX: gl.constexpr):
    """``(whole, span, k_steps)``: tiles ``[0, whole)`` run whole; with STREAM_K the real tiles
    ``[whole, real)`` (fewer than ``programs``) are cut into runs of ``span`` k-steps, one per program.
    ``span <= k_steps``, so a run touches at most two tiles."""
    k_steps = gl.cdiv(K, BLOCK_K)
    if STREAM_K:
        whole = real // programs * programs
        span = gl.maximum(gl.cdiv((real - whole) * k_steps, programs), gl.cdiv(k_steps, SPLIT_MAX))
    else:
        whole = real
        span = k_steps
    return whole, span, k_steps


@gluon.jit
def item_count(whole, real, total, programs):
    """How many items ``work_item`` numbers for this program (some of them may be empty)."""
    pid = gl.program_id(0)
    return gl.cdiv(gl.maximum(whole - pid, 0), programs) + 2 + gl.cdiv(gl.maximum(total - real - pid, 0), programs)


@gluon.jit
def work_item(v, whole, real, span, k_steps, programs):
    """This program's item ``v`` -> ``(tile, first k-step, end k-step)``; ``tile < 0``: nothing.

    Items: its whole tiles (``pid + i * programs`` below ``whole``), then the at most two pieces of
    its run ``[pid * span, (pid + 1) * span)`` over the split tiles' k-steps laid end to end, then
    its tiles of the unrouted tail (no k-steps)."""
    pid = gl.program_id(0)
    rounds = gl.cdiv(gl.maximum(whole - pid, 0), programs)
    piece = v - rounds
    start = pid * span
    stop = gl.minimum(start + span, (real - whole) * k_steps)
    split = start // k_steps + piece
    k_begin = gl.maximum(start - split * k_steps, 0)
    k_end = gl.minimum(stop - split * k_steps, k_steps)
    tile = gl.where(k_begin < k_end, whole + split, -1)
    tile = gl.where(v < rounds, pid + v * programs, tile)
    k_begin = gl.where(v < rounds, 0, k_begin)
    k_end = gl.where(v < rounds, k_steps, k_end)
    zero_tile = v >= rounds + 2
    tile = gl.where(zero_tile, real + pid + (v - rounds - 2) * programs, tile)
    k_end = gl.where(zero_tile, 0, k_end)
    return tile, gl.where(zero_tile, 0, k_begin), k_end


@gluon.jit
def contributors(split_tile, span, k_steps):
    """The programs ``[first, last]`` whose runs cover split tile ``split_tile`` (counted from
    ``whole``); program p's piece of it sits in workspace slot ``p + split_tile``."""
    return split_tile * k_steps // span, ((split_tile + 1) * k_steps - 1) // span
