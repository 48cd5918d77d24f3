"""Ragged-M grouped GEMM (forward and input gradient).

    c[s_e:t_e, :] = a[s_e:t_e, :] @ b[e]          for every group e, with s_e = offsets[e-1], t_e = offsets[e]
    c[offsets[E-1]:M, :] = 0                       (rows that belong to no expert; left alone with tail=False)

a: [M, K] row-major; b: [E, K, N] with either N contiguous ("KN", the ``[E, K, N]`` layout) or K
contiguous ("NK", a transposed view of ``nn.Linear``-layout weights ``[E, N, K]``); c: [M, N].

A persistent grid of programs walks the tiles of all groups. The tiles of group e are numbered after
those of groups 0..e-1; each program derives that numbering from ``offsets`` on the device, so nothing
waits for the host. Operands come through TMA descriptors where the strides allow it and through
masked pointer loads otherwise.

Split K (``MAX_SPLIT > 1``): where the groups' tiles are fewer than the programs (one group of a few rows
against thousands of K: a decode step whose tokens all pick one expert), each tile's K steps are split
over ``split = min(MAX_SPLIT, programs // tiles, K steps)`` programs, chosen on the device from the tile
count, so routings with enough tiles run unsplit. Each part writes its fp32 partial tile into a
workspace ``[MAX_SPLIT, M, N]`` and counts itself on the tile's counter; the part that arrives last adds
the partials in split order (the sum does not depend on who arrived first), writes the tile and sets the
counter back to zero, so the counters (``zeroed_counters``) stay zeroed between launches without a memset.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dropless.kernels.config import GemmConfig
from dropless.kernels.groups import locate_tile, pick, tile_table, zero_tail
from dropless.kernels.launch import LaunchInfo, cdiv, next_power_of_2, weight_nk


@triton.jit
def _add_parts(acc, partials, counters, tile_id, part, split, rows, cols, mask, c_ptrs, M, N):
    """Split K: this part's fp32 tile into the workspace ``partials [split, M, N]``, then a count on the
    tile's counter (release, after every thread's stores); the part that makes the count ``split``
    (acquire) adds the parts in order, writes the tile to ``c_ptrs`` and zeroes the counter for the next
    launch."""
    rows = rows.to(tl.int64)[:, None]
    tl.store(partials + (rows + part * M) * N + cols[None, :], acc, mask=mask)
    tl.debug_barrier()
    if tl.atomic_add(counters + tile_id, 1, sem="acq_rel") == split - 1:
        total = tl.zeros_like(acc)
        for other in range(split):
            total += tl.load(partials + (rows + other * M) * N + cols[None, :], mask=mask, other=0.0,
                             cache_modifier=".cg")
        tl.store(c_ptrs, total.to(c_ptrs.dtype.element_ty), mask=mask)
        tl.store(counters + tile_id, 0)


@triton.jit
def _ragged_m_kernel(
    a, b, c, c_desc, offsets_ptr, partials, counters,
    M, N, K, E,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    NUM_PROGRAMS: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    B_NK: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, TMA_STORE: tl.constexpr, ZERO_TAIL: tl.constexpr,
    MAX_SPLIT: tl.constexpr,
):
    starts, ends, tiles, tiles_end = tile_table(offsets_ptr, E, M, N, BLOCK_M, BLOCK_N, E_POW2)
    # The groups' tiles; the unrouted tail (entry E) gets its zeros after them (zero_tail).
    routed_tiles = pick(tiles_end, E - 1, E_POW2)
    k_tiles = tl.cdiv(K, BLOCK_K)
    split = 1
    if MAX_SPLIT > 1:
        split = tl.maximum(tl.minimum(tl.minimum(NUM_PROGRAMS // tl.maximum(routed_tiles, 1), MAX_SPLIT), k_tiles), 1)
    k_part = tl.cdiv(k_tiles, split)

    for unit in tl.range(tl.program_id(0), routed_tiles * split, NUM_PROGRAMS,
                         flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        tile_id = unit // split
        part = unit % split
        group, row_end, row0, col0 = locate_tile(tile_id, starts, ends, tiles, tiles_end, N, BLOCK_M, BLOCK_N,
                                                 GROUP_M, E_POW2)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, BLOCK_N)

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # Unsplit, every tile runs the same number of steps, so the loop nest can be pipelined as one.
        for k_step in range(part * k_part, tl.minimum(part * k_part + k_part, k_tiles)):
            k0 = k_step * BLOCK_K
            if USE_TMA:
                a_tile = a.load([row0, k0])
                if B_NK:
                    b_tile = b.load([group, col0, k0]).reshape(BLOCK_N, BLOCK_K).T
                else:
                    b_tile = b.load([group, k0, col0]).reshape(BLOCK_K, BLOCK_N)
            else:
                ks = k0 + tl.arange(0, BLOCK_K)
                a_tile = tl.load(
                    a + rows.to(tl.int64)[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=(rows < row_end)[:, None] & (ks < K)[None, :], other=0.0)
                b_tile = tl.load(
                    b + group.to(tl.int64) * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=(ks < K)[:, None] & (cols < N)[None, :], other=0.0)
            if UPCAST:
                a_tile = a_tile.to(tl.float32)
                b_tile = b_tile.to(tl.float32)
            acc = tl.dot(a_tile, b_tile, acc, input_precision=PRECISION)

        mask = (rows < row_end)[:, None] & (cols < N)[None, :]
        c_ptrs = c + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
        if split > 1:
            _add_parts(acc, partials, counters, tile_id, part, split, rows, cols, mask, c_ptrs, M, N)
        elif TMA_STORE and row0 + BLOCK_M <= row_end:
            c_desc.store([row0, col0], acc.to(c_desc.dtype))
        else:
            # A tile that ends past its group's last row: mask the rows of the next group.
            tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=mask)
    if ZERO_TAIL:
        zero_tail(c, starts, ends, N, stride_cm, stride_cn, E, NUM_PROGRAMS, BLOCK_M, BLOCK_N, E_POW2)


_ZEROED_COUNTERS: dict[tuple, torch.Tensor] = {}


def zeroed_counters(device: torch.device, count: int) -> torch.Tensor:
    """int32 counters ``[count]`` on ``device`` for launches on its current stream, zeroed once: every
    kernel that takes them leaves them zeroed (a split-K launch's tile counters, ``count`` = programs, at
    most ``programs // 2`` tiles; the weight gradient's draw counter, ``count`` = 1). One set a stream and
    count, so launches on two streams never share one; kept for the life of the process, so a CUDA graph
    that captured a launch reads the same counters at every replay."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else 0
    key = (device, stream, count)
    counters = _ZEROED_COUNTERS.get(key)
    if counters is None:
        counters = _ZEROED_COUNTERS[key] = torch.zeros(count, dtype=torch.int32, device=device)
    return counters


def ragged_m_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, c: torch.Tensor,
                config: GemmConfig, info: LaunchInfo, tail: bool = True) -> None:
    """Launch the ragged-M kernel writing ``c [M, N]``; arguments are already checked by the caller.

    a: ``[M, K]``; b: ``[E, K, N]`` with ``b.stride(2) == 1`` or ``b.stride(1) == 1`` (any other
    layout takes the pointer path); offsets: int32 ``[E]`` on a's device; c: ``[M, N]``. tail: write
    zeros over the rows past ``offsets[-1]`` (False: leave them as they are). ``config.split_k > 1``: split
    K where the tiles are fewer than the programs, into a workspace of ``split_k * M * N`` floats (not
    with ``config.flatten``, whose one pipeline needs every tile's steps alike).
    """
    M, K = a.shape
    E, _, N = b.shape
    b_nk = weight_nk(b)
    use_tma = info.tma and info.tma_ok(a) and info.tma_ok(b.transpose(1, 2) if b_nk else b)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if use_tma:
        a_arg = info.descriptor(a, [bm, bk])
        b_arg = info.descriptor(b.transpose(1, 2), [1, bn, bk]) if b_nk else info.descriptor(b, [1, bk, bn])
    else:
        a_arg, b_arg = a, b
    tma_store = use_tma and config.tma_store and info.tma_ok(c)
    c_desc = info.descriptor(c, [bm, bn]) if tma_store else None
    e_pow2 = next_power_of_2(E + 1)
    max_tiles = (cdiv(M, bm) + E + 1) * cdiv(N, bn)
    programs = info.num_programs * config.programs_per_sm
    split = config.split_k if config.split_k > 1 and not config.flatten and M > 0 else 1
    num_programs = max(1, min(programs, max_tiles * split))
    if split > 1:
        partials = torch.empty(split, M, N, dtype=torch.float32, device=c.device)
        counters = zeroed_counters(c.device, programs)
    else:
        partials = counters = offsets
    _ragged_m_kernel[(num_programs,)](
        a_arg, b_arg, c, c_desc, offsets, partials, counters,
        M, N, K, E,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        NUM_PROGRAMS=num_programs, E_POW2=e_pow2,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
        B_NK=b_nk, USE_TMA=use_tma, UPCAST=info.upcast, PRECISION=info.precision(a.dtype),
        FLATTEN=config.flatten, WARP_SPECIALIZE=config.warp_specialize, TMA_STORE=tma_store, ZERO_TAIL=tail,
        MAX_SPLIT=split, num_warps=config.num_warps, num_stages=config.num_stages,
    )
