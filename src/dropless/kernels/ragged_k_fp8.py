"""Ragged-K grouped GEMM on FP8 operands (weight gradient).

    c[e] = (a * sa)[p_e:p_e+n_e, :]^T @ (b * sb)[p_e:p_e+n_e, :]     for every group e

a: float8_e4m3fn [Mp, K] and b: float8_e4m3fn [Mp, N], both quantized per group along the tokens as
``dropless.quantized`` lays them out: views of ``[K, Mp]`` and ``[N, Mp]`` storage (the tokens
contiguous: the K-major layout of Hopper's FP8 tensor cores), ``Mp = A * (cdiv(M, A) + E)``, group e's
``n_e = t_e - s_e`` tokens (``s_e = offsets[e-1]``, ``t_e = offsets[e]``) in rows ``[p_e, p_e + n_e)``,
``p_e = A * (s_e // A + e)`` (A = ``GROUP_ALIGN`` = 128), which each program computes from offsets. c: [E, K, N], bf16 or fp32,
any strides; zero for an empty group, or added into (an fp32 ``main_grad``) for all experts or for those
whose flag is set, as in ragged_k.py.

Scales (fp32, or E8M0 bytes, see scales.py) restart at every group, so that no block spans two:
- rowwise (one scale per group and column): ``a_scale [E, K]``, ``b_scale [E, N]``; the accumulator is
  scaled once in the epilogue, ``c[e] = acc * sa[e, :, None] * sb[e, None, :]``;
- blocks of B tokens: ``a_scale [cdiv(Mp - A E, B) + E, K]``, ``b_scale`` likewise with N; block j of group
  e (rows ``p_e + j*B`` onwards) uses row ``s_e // B + e + j``. Each BLOCK_M-row step (BLOCK_M divides
  B) adds its partial product to the accumulator scaled by that row's ``sa[:, None] * sb[None, :]``.

Each tile steps over its group's rows in windows of BLOCK_M (which divides A) from p_e, so every
window starts aligned along the tokens, where a TMA read must start (16 bytes), and lies inside one
token block of the scales. Full windows go without masks; the last, partial one zeroes its rows past the
group in both operands: they are the next group's rows or zero gaps, and a NaN of the next group must
not reach this one. Operands come through TMA descriptors of the transposed storage for every recipe,
and through masked pointer loads only where TMA is unavailable (no TMA on the device, or operands whose
base or strides are not 16-byte aligned).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dropless.kernels.config import GemmConfig
from dropless.kernels.groups import group_bounds, grouped_raster, pick
from dropless.kernels.launch import LaunchInfo, cdiv, next_power_of_2
from dropless.kernels.ragged_k import store_tile
from dropless.kernels.ragged_m_fp8 import kernel_scale
from dropless.kernels.scales import FP8_MIN_STEP, SCALE_EPILOGUE, SCALE_PER_STEP, load_scale
from dropless.quantized import GROUP_ALIGN

_GROUP_ALIGN = tl.constexpr(GROUP_ALIGN)  # rows: every group of the operands starts at a multiple of it


@triton.jit
def _load_rows(a, b, row0, end, k0, n0, N, K, stride_am, stride_ak, stride_bm, stride_bn,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               USE_TMA: tl.constexpr, UPCAST: tl.constexpr):
    """``a^T [BLOCK_K, BLOCK_M]`` (columns k0.. of a) and ``b [BLOCK_M, BLOCK_N]`` (columns n0.. of b)
    over rows ``[row0, row0 + BLOCK_M)``, both with the rows contiguous in shared memory. Rows past
    ``end`` read as 0 on the pointer path and as whatever follows on the TMA path (0 past the storage)."""
    if USE_TMA:
        a_t = a.load([k0, row0])
        b_tile = b.load([n0, row0]).T
    else:
        rows = (row0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        ks = (k0 + tl.arange(0, BLOCK_K)).to(tl.int64)
        ns = (n0 + tl.arange(0, BLOCK_N)).to(tl.int64)
        a_t = tl.load(a + ks[:, None] * stride_ak + rows[None, :] * stride_am,
                      mask=(ks < K)[:, None] & (rows < end)[None, :], other=0.0)
        b_tile = tl.load(b + rows[:, None] * stride_bm + ns[None, :] * stride_bn,
                         mask=(rows < end)[:, None] & (ns < N)[None, :], other=0.0)
    if UPCAST:
        a_t = a_t.to(tl.float32)
        b_tile = b_tile.to(tl.float32)
    return a_t, b_tile


@triton.jit
def _step_product(a_t, b_tile, acc, a_scale, b_scale, scale_row, ks, ns, K, N,
                  stride_sa, stride_sak, stride_sb, stride_sbn,
                  A_E8M0: tl.constexpr, B_E8M0: tl.constexpr, SCALE_MODE: tl.constexpr,
                  MAX_IMPRECISE_ACC: tl.constexpr):
    """``acc`` plus one row step's product, promoted and scaled by the step's scale row when the
    scales change along the tokens."""
    if SCALE_MODE == SCALE_PER_STEP:
        sa = load_scale(a_scale + scale_row.to(tl.int64) * stride_sa + ks * stride_sak, ks < K, A_E8M0)
        sb = load_scale(b_scale + scale_row.to(tl.int64) * stride_sb + ns * stride_sbn, ns < N, B_E8M0)
        # A fresh product per step, promoted into the fp32 accumulator (the tensor cores' FP8
        # accumulation is short of fp32), scaled as it goes in.
        return acc + tl.dot(a_t, b_tile) * (sa[:, None] * sb[None, :])
    return tl.dot(a_t, b_tile, acc, max_num_imprecise_acc=MAX_IMPRECISE_ACC)


@triton.jit
def _ragged_k_fp8_tile(
    a, b, c, c_desc, a_scale, b_scale, flags_ptr, group, start, end, row_start, local_tile,
    N, K, stride_am, stride_ak, stride_bm, stride_bn, stride_ce, stride_ck, stride_cn,
    stride_sa, stride_sak, stride_sb, stride_sbn,
    TOKEN_BLOCK: tl.constexpr, A_E8M0: tl.constexpr, B_E8M0: tl.constexpr, SCALE_MODE: tl.constexpr,
    MAX_IMPRECISE_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACCUMULATE: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr, TMA_STORE: tl.constexpr,
):
    """One output tile ``c[group, k-block, n-block]``, reduced over the group's tokens ``[start, end)``,
    which sit in rows ``[row_start, row_start + end - start)`` of a and b."""
    pid_k, pid_n = grouped_raster(local_tile, tl.cdiv(K, BLOCK_K), tl.cdiv(N, BLOCK_N), GROUP_M)
    k0 = pid_k * BLOCK_K
    n0 = pid_n * BLOCK_N
    ks = k0 + tl.arange(0, BLOCK_K)
    ns = n0 + tl.arange(0, BLOCK_N)
    # Scale row of the group's first block; blocks of TOKEN_BLOCK rows restart at the group's start.
    first_scale_row = start // TOKEN_BLOCK + group
    row_end = row_start + (end - start)

    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    # Full windows without masks: a mask costs a register round trip of the operands.
    full_steps = (end - start) // BLOCK_M
    for step in range(full_steps):
        a_t, b_tile = _load_rows(a, b, row_start + step * BLOCK_M, row_end, k0, n0, N, K,
                                 stride_am, stride_ak, stride_bm, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, UPCAST)
        acc = _step_product(a_t, b_tile, acc, a_scale, b_scale, first_scale_row + step * BLOCK_M // TOKEN_BLOCK,
                            ks, ns, K, N, stride_sa, stride_sak, stride_sb, stride_sbn,
                            A_E8M0, B_E8M0, SCALE_MODE, MAX_IMPRECISE_ACC)
    row0 = row_start + full_steps * BLOCK_M
    if row0 < row_end:
        a_t, b_tile = _load_rows(a, b, row0, row_end, k0, n0, N, K, stride_am, stride_ak, stride_bm, stride_bn,
                                 BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, UPCAST)
        in_group = row0 + tl.arange(0, BLOCK_M) < row_end
        a_t = tl.where(in_group[None, :], a_t, 0.0)
        b_tile = tl.where(in_group[:, None], b_tile, 0.0)
        acc = _step_product(a_t, b_tile, acc, a_scale, b_scale, first_scale_row + full_steps * BLOCK_M // TOKEN_BLOCK,
                            ks, ns, K, N, stride_sa, stride_sak, stride_sb, stride_sbn,
                            A_E8M0, B_E8M0, SCALE_MODE, MAX_IMPRECISE_ACC)

    if SCALE_MODE == SCALE_EPILOGUE:
        # An empty group's scales may be anything: it keeps its zeros.
        has_rows = end > start
        sa = load_scale(a_scale + group.to(tl.int64) * stride_sa + ks * stride_sak, (ks < K) & has_rows, A_E8M0)
        sb = load_scale(b_scale + group.to(tl.int64) * stride_sb + ns * stride_sbn, (ns < N) & has_rows, B_E8M0)
        acc *= sa[:, None] * sb[None, :]
    store_tile(acc, c, c_desc, flags_ptr, group, k0, n0, N, K, stride_ce, stride_ck, stride_cn,
               BLOCK_N, BLOCK_K, ACCUMULATE, TMA_STORE)


@triton.jit
def _ragged_k_fp8_kernel(
    a, b, c, c_desc, a_scale, b_scale, offsets_ptr, flags_ptr, counter_ptr,
    M, N, K, E,
    stride_am, stride_ak, stride_bm, stride_bn, stride_ce, stride_ck, stride_cn,
    stride_sa, stride_sak, stride_sb, stride_sbn,
    TOKEN_BLOCK: tl.constexpr, A_E8M0: tl.constexpr, B_E8M0: tl.constexpr, SCALE_MODE: tl.constexpr,
    MAX_IMPRECISE_ACC: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACCUMULATE: tl.constexpr, USE_TMA: tl.constexpr, UPCAST: tl.constexpr,
    BY_WORK: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, FLATTEN: tl.constexpr, TMA_STORE: tl.constexpr,
):
    """M: the operands' rows Mp. Group bounds are clamped to the ``Mp - A E`` tokens (a multiple of A,
    at least the real M) the data holds, so even malformed offsets keep every group inside the Mp rows
    and its blocks inside the scales (``dropless.quantized``)."""
    tiles_per_group = tl.cdiv(K, BLOCK_K) * tl.cdiv(N, BLOCK_N)
    total_tiles = E * tiles_per_group
    starts, ends = group_bounds(offsets_ptr, E, M - _GROUP_ALIGN * E, E_POW2)
    row_starts = (starts // _GROUP_ALIGN + tl.arange(0, E_POW2)) * _GROUP_ALIGN
    if BY_WORK:
        # Largest groups first, tiles drawn one at a time from a counter (as in ragged_k.py).
        e = tl.arange(0, E_POW2)
        key = tl.where(e < E, (ends - starts).to(tl.int64) * E_POW2 + e, -1)
        order = (tl.sort(key, descending=True) % E_POW2).to(tl.int32)
        tile_id = tl.atomic_add(counter_ptr, 1)
        while tile_id < total_tiles:
            group = pick(order, tile_id // tiles_per_group, E_POW2)
            _ragged_k_fp8_tile(a, b, c, c_desc, a_scale, b_scale, flags_ptr, group, pick(starts, group, E_POW2),
                               pick(ends, group, E_POW2), pick(row_starts, group, E_POW2), tile_id % tiles_per_group,
                               N, K, stride_am, stride_ak, stride_bm, stride_bn, stride_ce, stride_ck, stride_cn,
                               stride_sa, stride_sak, stride_sb, stride_sbn,
                               TOKEN_BLOCK, A_E8M0, B_E8M0, SCALE_MODE, MAX_IMPRECISE_ACC,
                               BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, ACCUMULATE, USE_TMA, UPCAST, TMA_STORE)
            tile_id = tl.atomic_add(counter_ptr, 1)
    else:
        for tile_id in tl.range(tl.program_id(0), total_tiles, NUM_PROGRAMS,
                                flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
            group = tile_id // tiles_per_group
            _ragged_k_fp8_tile(a, b, c, c_desc, a_scale, b_scale, flags_ptr, group, pick(starts, group, E_POW2),
                               pick(ends, group, E_POW2), pick(row_starts, group, E_POW2), tile_id % tiles_per_group,
                               N, K, stride_am, stride_ak, stride_bm, stride_bn, stride_ce, stride_ck, stride_cn,
                               stride_sa, stride_sak, stride_sb, stride_sbn,
                               TOKEN_BLOCK, A_E8M0, B_E8M0, SCALE_MODE, MAX_IMPRECISE_ACC,
                               BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, ACCUMULATE, USE_TMA, UPCAST, TMA_STORE)


def ragged_k_fp8_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                    block: int | None, offsets: torch.Tensor, c: torch.Tensor, accumulate: int,
                    flags: torch.Tensor | None, config: GemmConfig, info: LaunchInfo,
                    fast_accum: bool = False) -> None:
    """Launch the FP8 ragged-K kernel writing (or adding into) ``c [E, K, N]``; nothing syncs.

    a: float8_e4m3fn ``[Mp, K]``; b: float8_e4m3fn ``[Mp, N]``, quantized per group along the tokens
    (``Mp = 128 * (cdiv(M, 128) + E)`` rows, group e from row ``128 * (s_e // 128 + e)``, the module
    docstring's layout; TMA needs ``a.stride(0) == 1`` and ``b.stride(0) == 1`` with 16-byte aligned
    other strides and base pointers, which storage of that layout has; other layouts take the pointer
    path). block: tokens per scale block (a power of two of at least 32), None for one scale per group;
    a_scale ``[E, K]`` or ``[cdiv(Mp - 128 E, block) + E, K]``, b_scale likewise with N, any strides, fp32 or
    E8M0 (``float8_e8m0fnu`` or its uint8 view). offsets: int32 ``[E]``; E is c's first dim. c:
    ``[E, K, N]`` written along its last dim (swap the operands, their scales and c's last two dims for
    a transposed view); accumulate: NO_ACCUMULATE, ACCUMULATE_ALL or ACCUMULATE_FLAGGED (then ``flags``
    is a bool ``[E]``). With blocks, BLOCK_M is cut to the block. fast_accum: for one scale per group,
    let Hopper's tensor cores accumulate the whole group in their reduced-precision FP8 accumulation
    rather than promoting every BLOCK_M rows into fp32. ValueError for a token block or a row count Mp
    that the layout does not allow.
    """
    M, K = a.shape
    N = b.shape[1]
    E = c.shape[0]
    if block is not None and (block < FP8_MIN_STEP or block & (block - 1)):
        raise ValueError(f"the token block of the scales must be a power of two of at least {FP8_MIN_STEP}, "
                         f"got {block}")
    if M % GROUP_ALIGN or M < GROUP_ALIGN * E or b.shape[0] != M:
        raise ValueError(f"a and b must have the rows Mp = 128 * (cdiv(M, 128) + E) of operands quantized per group "
                         f"(E={E}), got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    bm = config.block_m if block is None else min(config.block_m, block)
    bn, bk = config.block_n, config.block_k
    a_t, b_t = a.t(), b.t()
    use_tma = info.tma and info.tma_ok(a_t) and info.tma_ok(b_t)
    a_arg = info.descriptor(a_t, [bk, bm]) if use_tma else a
    b_arg = info.descriptor(b_t, [bn, bm]) if use_tma else b
    total_tiles = E * cdiv(K, bk) * cdiv(N, bn)
    num_programs = max(1, min(info.num_programs * config.programs_per_sm, total_tiles))
    tma_store = use_tma and config.tma_store and info.tma_ok(c)
    c_desc = info.descriptor(c, [1, bk, bn]) if tma_store else None
    counter = torch.zeros(1, dtype=torch.int32, device=a.device) if config.by_work else offsets
    (a_scale_arg, a_e8m0), (b_scale_arg, b_e8m0) = kernel_scale(a_scale), kernel_scale(b_scale)
    _ragged_k_fp8_kernel[(num_programs,)](
        a_arg, b_arg, c, c_desc,
        a_scale_arg, b_scale_arg,
        offsets, flags if flags is not None else offsets, counter,
        M, N, K, E,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1), c.stride(2),
        a_scale.stride(0), a_scale.stride(1), b_scale.stride(0), b_scale.stride(1),
        TOKEN_BLOCK=block or 1, A_E8M0=a_e8m0, B_E8M0=b_e8m0,
        SCALE_MODE=SCALE_EPILOGUE if block is None else SCALE_PER_STEP,
        MAX_IMPRECISE_ACC=None if fast_accum or block is not None else bm,
        NUM_PROGRAMS=num_programs, E_POW2=next_power_of_2(E + 1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
        ACCUMULATE=accumulate, USE_TMA=use_tma, UPCAST=info.upcast,
        BY_WORK=config.by_work, WARP_SPECIALIZE=config.warp_specialize, FLATTEN=config.flatten,
        TMA_STORE=tma_store,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
