"""Ragged-K grouped GEMM (weight gradient).

    c[e] = a[s_e:t_e, :]^T @ b[s_e:t_e, :]     for every group e, with s_e = offsets[e-1], t_e = offsets[e]

a: [M, K] row-major (the layer input x); b: [M, N] row-major (the output gradient dy); c: [E, K, N]
(any strides), zero for an empty group. The reduction runs over the group's rows, so its length is
known only on the device: each tile steps over full BLOCK_M row blocks without masks and finishes with
one masked block. In the epilogue the tile can add into ``c`` (an fp32 ``main_grad``), for all experts
or for those whose flag is set.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dropless.kernels.config import GemmConfig
from dropless.kernels.groups import group_bounds, grouped_raster, pick
from dropless.kernels.launch import LaunchInfo, cdiv, next_power_of_2, weight_nk

NO_ACCUMULATE, ACCUMULATE_ALL, ACCUMULATE_FLAGGED = 0, 1, 2


@triton.jit
def _load_rows(a, b, row0, end, k0, n0, N, K, stride_am, stride_ak, stride_bm, stride_bn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               USE_TMA: tl.constexpr, UPCAST: tl.constexpr):
    """Rows ``[row0, row0 + BLOCK_M)`` of a (columns from k0) and b (columns from n0). Rows past
    ``end`` read as 0 on the pointer path and as whatever follows on the TMA path."""
    if USE_TMA:
        a_tile = a.load([row0, k0])
        b_tile = b.load([row0, n0])
    else:
        rows = row0 + tl.arange(0, BLOCK_M)
        ks = k0 + tl.arange(0, BLOCK_K)
        ns = n0 + tl.arange(0, BLOCK_N)
        a_tile = tl.load(a + rows.to(tl.int64)[:, None] * stride_am + ks[None, :] * stride_ak,
                         mask=(rows < end)[:, None] & (ks < K)[None, :], other=0.0)
        b_tile = tl.load(b + rows.to(tl.int64)[:, None] * stride_bm + ns[None, :] * stride_bn,
                         mask=(rows < end)[:, None] & (ns < N)[None, :], other=0.0)
    if UPCAST:
        a_tile = a_tile.to(tl.float32)
        b_tile = b_tile.to(tl.float32)
    return a_tile, b_tile


@triton.jit
def _ragged_k_tile(
    a, b, c, c_desc, flags_ptr, group, start, end, local_tile,
    M, N, K, stride_am, stride_ak, stride_bm, stride_bn, stride_ce, stride_ck, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACCUMULATE: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    TMA_STORE: tl.constexpr,
):
    """One output tile ``c[group, k-block, n-block]``, reduced over the group's rows."""
    pid_k, pid_n = grouped_raster(local_tile, tl.cdiv(K, BLOCK_K), tl.cdiv(N, BLOCK_N), GROUP_M)
    k0 = pid_k * BLOCK_K
    n0 = pid_n * BLOCK_N

    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    # Full row blocks without masks, then one masked block: the mask costs a register round trip
    # of the operand, so it is paid once per tile rather than at every step.
    full_steps = (end - start) // BLOCK_M
    for step in range(full_steps):
        a_tile, b_tile = _load_rows(a, b, start + step * BLOCK_M, end, k0, n0, N, K,
                                    stride_am, stride_ak, stride_bm, stride_bn,
                                    BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, UPCAST)
        acc = tl.dot(a_tile.T, b_tile, acc, input_precision=PRECISION)
    row0 = start + full_steps * BLOCK_M
    if row0 < end:
        # The last, partial block: rows past the group's end belong to the next group.
        a_tile, b_tile = _load_rows(a, b, row0, end, k0, n0, N, K,
                                    stride_am, stride_ak, stride_bm, stride_bn,
                                    BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, UPCAST)
        # Zero both operands there: rows past the end may hold anything, NaN included.
        in_group = (row0 + tl.arange(0, BLOCK_M) < end)[:, None]
        a_tile = tl.where(in_group, a_tile, 0.0)
        b_tile = tl.where(in_group, b_tile, 0.0)
        acc = tl.dot(a_tile.T, b_tile, acc, input_precision=PRECISION)

    store_tile(acc, c, c_desc, flags_ptr, group, k0, n0, N, K, stride_ce, stride_ck, stride_cn,
               BLOCK_N, BLOCK_K, ACCUMULATE, TMA_STORE)


@triton.jit
def store_tile(acc, c, c_desc, flags_ptr, group, k0, n0, N, K, stride_ce, stride_ck, stride_cn,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, ACCUMULATE: tl.constexpr, TMA_STORE: tl.constexpr):
    """Write the fp32 tile ``acc`` to ``c[group, k0:, n0:]``: overwriting (ACCUMULATE 0), adding to the
    values there (1), or adding where the group's flag is set and overwriting elsewhere (2)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    ns = n0 + tl.arange(0, BLOCK_N)
    c_ptrs = c + group.to(tl.int64) * stride_ce + ks.to(tl.int64)[:, None] * stride_ck + ns[None, :] * stride_cn
    c_mask = (ks < K)[:, None] & (ns < N)[None, :]
    if ACCUMULATE == 1:
        acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    elif ACCUMULATE == 2:
        if tl.load(flags_ptr + group) != 0:
            acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
    if TMA_STORE:
        c_desc.store([group, k0, n0], acc.to(c_desc.dtype).reshape(1, BLOCK_K, BLOCK_N))
    else:
        tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=c_mask)


@triton.jit
def _ragged_k_kernel(
    a, b, c, c_desc, offsets_ptr, flags_ptr, counter_ptr,
    M, N, K, E,
    stride_am, stride_ak, stride_bm, stride_bn, stride_ce, stride_ck, stride_cn,
    NUM_PROGRAMS: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACCUMULATE: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    BY_WORK: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, FLATTEN: tl.constexpr,
    TMA_STORE: tl.constexpr,
):
    tiles_per_group = tl.cdiv(K, BLOCK_K) * tl.cdiv(N, BLOCK_N)
    total_tiles = E * tiles_per_group
    starts, ends = group_bounds(offsets_ptr, E, M, E_POW2)
    if BY_WORK:
        # Largest groups first, handed out one tile at a time from a counter: a program that drew a
        # long tile draws no more until it is done, so long tiles do not pile up on a few programs.
        e = tl.arange(0, E_POW2)
        key = tl.where(e < E, (ends - starts).to(tl.int64) * E_POW2 + e, -1)
        order = (tl.sort(key, descending=True) % E_POW2).to(tl.int32)
        tile_id = tl.atomic_add(counter_ptr, 1)
        while tile_id < total_tiles:
            group = pick(order, tile_id // tiles_per_group, E_POW2)
            _ragged_k_tile(a, b, c, c_desc, flags_ptr, group, pick(starts, group, E_POW2),
                           pick(ends, group, E_POW2), tile_id % tiles_per_group,
                           M, N, K, stride_am, stride_ak, stride_bm, stride_bn, stride_ce, stride_ck, stride_cn,
                           BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, ACCUMULATE, USE_TMA, UPCAST, PRECISION,
                           TMA_STORE)
            tile_id = tl.atomic_add(counter_ptr, 1)
    else:
        for tile_id in tl.range(tl.program_id(0), total_tiles, NUM_PROGRAMS,
                                flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
            group = tile_id // tiles_per_group
            _ragged_k_tile(a, b, c, c_desc, flags_ptr, group, pick(starts, group, E_POW2),
                           pick(ends, group, E_POW2), tile_id % tiles_per_group,
                           M, N, K, stride_am, stride_ak, stride_bm, stride_bn, stride_ce, stride_ck, stride_cn,
                           BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, ACCUMULATE, USE_TMA, UPCAST, PRECISION,
                           TMA_STORE)


def oriented(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a, b, c)`` with ``c`` written along its contiguous dimension.

    If c is a transposed view (``[E, N, K]`` storage), the product is computed as ``c^T = b^T a``, so
    stores stay coalesced (and TMA-able).
    """
    if weight_nk(c):
        return b, a, c.transpose(1, 2)
    return a, b, c


def ragged_k_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, c: torch.Tensor,
                accumulate: int, flags: torch.Tensor | None, config: GemmConfig, info: LaunchInfo) -> None:
    """Launch the ragged-K kernel writing (or adding into) ``c [E, K, N]``; arguments are checked.

    a: ``[M, K]``; b: ``[M, N]``; offsets: int32 ``[E]``; accumulate: one of NO_ACCUMULATE,
    ACCUMULATE_ALL, ACCUMULATE_FLAGGED (then ``flags`` is a bool ``[E]`` tensor). Orient the
    operands with ``oriented`` first.
    """
    M, K = a.shape
    N = b.shape[1]
    E = c.shape[0]
    use_tma = info.tma and info.tma_ok(a) and info.tma_ok(b)
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    a_arg = info.descriptor(a, [bm, bk]) if use_tma else a
    b_arg = info.descriptor(b, [bm, bn]) if use_tma else b
    total_tiles = E * cdiv(K, bk) * cdiv(N, bn)
    num_programs = max(1, min(info.num_programs * config.programs_per_sm, total_tiles))
    tma_store = use_tma and config.tma_store and info.tma_ok(c)
    c_desc = info.descriptor(c, [1, bk, bn]) if tma_store else None
    counter = torch.zeros(1, dtype=torch.int32, device=a.device) if config.by_work else offsets
    _ragged_k_kernel[(num_programs,)](
        a_arg, b_arg, c, c_desc, offsets, flags if flags is not None else offsets, counter,
        M, N, K, E,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1), c.stride(2),
        NUM_PROGRAMS=num_programs, E_POW2=next_power_of_2(E + 1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
        ACCUMULATE=accumulate, USE_TMA=use_tma, UPCAST=info.upcast, PRECISION=info.precision(a.dtype),
        BY_WORK=config.by_work, WARP_SPECIALIZE=config.warp_specialize, FLATTEN=config.flatten,
        TMA_STORE=tma_store,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
