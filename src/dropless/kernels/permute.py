"""Row gathers between token order and expert-sorted order (permute and unpermute of an MoE layer).

The T tokens each send k copies to experts; copy j of token t is the slot ``s = t*k + j``. Sorting the
M = T*k slots by expert gives the sorted order: sorted row p holds slot ``sorted_to_token_slot[p]``,
and slot s sits at row ``slot_to_sorted[s]``. Rows ``p >= offsets[E-1]`` belong to no local expert
(expert-parallel sentinels): they are written as zeros and never read back.

    permute_rows:    out[slot_to_sorted[s]] = w[s] * src[s // k]     (0 at rows p >= offsets[E-1])
                     dw[s]  = <src[s // k], other[p]>               (optional, fp32, 0 past offsets[E-1])
    unpermute_rows:  out[t] = sum_j w[t, j] * src[slot_to_sorted[t*k + j]]   (valid rows only)

with s = sorted_to_token_slot[p] (so p = slot_to_sorted[s]) and w = 1 when no weights are given.
permute_rows is permute's forward (plain) and unpermute's backward (weighted, with the dot products
that make the weights' gradient); unpermute_rows is unpermute's forward (weighted) and permute's
backward (plain). Each output element is written by exactly one program, with no atomics: the results
are deterministic.

permute_rows can also write its rows quantized to FP8 along D (``dropless.quantize(out, recipe,
dim=-1)``'s bits, from the values as rounded to out's dtype), beside them or instead of them: the FP8
layer's permuted tokens (no rows in x's dtype made) and the gradient its down projection reads. Blockwise
scales come from the chunk in registers (BLOCK_D a multiple of the block). A rowwise scale needs the
whole row first: a first loop takes each token's amax, and a copy's is ``|w|`` times it rounded to out's
dtype, which is exactly the largest of its rounded elements (rounding is monotone, so it commutes with
the maximum).

Both walk token order: programs own blocks of tokens, so each token row is read once (permute_rows) or
written once (unpermute_rows) whatever the expert order, and walk the feature dimension in ``BLOCK_D``
chunks of unit-stride loads. (Walking the sorted rows instead reads each token row k times, from DRAM
once the tokens outgrow the L2.)
A token's k copies are one dimension of a program's tiles: their sorted rows are looked up once, and a
chunk of all k copies is one gather or one store, so every copy's loads are in flight together. Copies
quantized with a block recipe go one copy at a time (``_permute_blocks_kernel``).
The number of valid rows is read from ``offsets`` on the device, so nothing waits for the host. Row
indices are 64-bit before they multiply a stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dropless.kernels.direct_launch import DirectLaunch
from dropless.kernels.fp8_math import block_scale, magnitude, to_fp8
from dropless.kernels.launch import cdiv, interpreting, launch_info, next_power_of_2
from dropless.kernels.quantize import scale_bits
from dropless.quantized import Recipe

_MAX_BLOCK_D = 256
# Elements of the copies a program holds at once (token rows x padded top_k x BLOCK_D). With 4 warps and
# 256 features a chunk, 8192 puts at least 4 token rows in a program when top_k <= 8, so that the warps
# split the tokens and a token's copies sit in one thread's registers (fewer token rows put the copies
# across warps: unpermute's sum then runs ~8x slower).
_BLOCK_ELEMENTS = 8192
_BLOCK_ELEMENTS_PER_COPY = 2048  # the block-recipe kernel's chunk of one copy
_NUM_WARPS = 4


@triton.jit
def _copy_slots(inv_ptr, w_ptr, tokens64, copies, slot_ok, num_valid, T, stride_w_t, stride_w_j,
                TOP_K: tl.constexpr, WEIGHTED: tl.constexpr):
    """Copies ``copies`` of tokens ``tokens64`` (broadcast together; ``slot_ok`` where both exist): their
    sorted rows, whether each row is written (in ``[0, M)``), whether it holds the copy (before
    ``num_valid``, the local experts' rows; past it, zeros) and the copy's weight (0 where not valid;
    unweighted, 1 where valid)."""
    pos = tl.load(inv_ptr + tokens64 * TOP_K + copies, mask=slot_ok, other=-1).to(tl.int64)
    pos_ok = slot_ok & (pos >= 0) & (pos < T * TOP_K)
    valid = pos_ok & (pos < num_valid)
    w = valid.to(tl.float32)
    if WEIGHTED:
        w = tl.load(w_ptr + tokens64 * stride_w_t + copies * stride_w_j, mask=valid, other=0.0).to(tl.float32)
    return pos, pos_ok, valid, w


@triton.jit
def _copy_scales(amax, w, valid, out_dtype: tl.constexpr, WEIGHTED: tl.constexpr, POW2: tl.constexpr):
    """The rowwise scales ``[BLOCK_T, K_PAD]`` of the copies of tokens whose rows' largest magnitudes are
    ``amax [BLOCK_T]``: each copy's own largest element as rounded to ``out_dtype`` (``|w| amax``
    rounded; 0 for copies not written)."""
    copy_amax = tl.broadcast_to(amax[:, None], w.shape)
    if WEIGHTED:
        copy_amax = copy_amax * tl.abs(w)
    copy_amax = magnitude(tl.where(valid, copy_amax, 0.0).to(out_dtype).to(tl.float32))
    return block_scale(copy_amax, False, POW2, False)


@triton.jit
def _permute_kernel(
    src, inv_ptr, offsets_ptr, out, w_ptr, other, dw_ptr, data, scale,
    T, D, E,
    stride_src_t, stride_src_d, stride_out_m, stride_out_d, stride_other_m, stride_other_d,
    stride_w_t, stride_w_j, stride_qm, stride_sm,
    TOP_K: tl.constexpr, WEIGHTED: tl.constexpr, DOT: tl.constexpr, STORE_ROWS: tl.constexpr,
    ROWWISE: tl.constexpr, POW2: tl.constexpr, EMULATE_FP8: tl.constexpr, K_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """STORE_ROWS: write the rows into ``out``; ROWWISE: write them quantized along D into ``data`` and
    ``scale`` (one scale a row), from the values as rounded to out's dtype (out is only read for its dtype
    when not STORE_ROWS). A token's copies are one tensor dimension: their rows and weights are loaded
    once, and a chunk of every copy is one gather and one store, so a program has all its copies' loads
    in flight at once."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < T
    tokens64 = tokens.to(tl.int64)
    copies = tl.arange(0, K_PAD)
    slot_ok = token_ok[:, None] & (copies < TOP_K)[None, :]
    pos, pos_ok, valid, w = _copy_slots(inv_ptr, w_ptr, tokens64[:, None], copies[None, :], slot_ok,
                                        tl.load(offsets_ptr + E - 1), T, stride_w_t, stride_w_j, TOP_K, WEIGHTED)
    dots = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    if ROWWISE:
        amax = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + tl.arange(0, BLOCK_D)
            row = tl.load(src + tokens64[:, None] * stride_src_t + cols[None, :] * stride_src_d,
                          mask=token_ok[:, None] & (cols < D)[None, :], other=0.0)
            amax = tl.maximum(amax, tl.max(magnitude(row.to(tl.float32)), axis=1))
        # Every copy's scale is known now: stored (also where D is 0: rows of no columns get 1, as
        # dropless.quantize writes it).
        row_scale = _copy_scales(amax, w, valid, out.dtype.element_ty, WEIGHTED, POW2)
        tl.store(scale + pos * stride_sm, row_scale, mask=pos_ok)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        col_ok = cols < D
        # Each token's row is read once and stored to each of its k rows. A row outside [0, M) is written
        # by no one; rows past the local experts are written as zeros.
        row = tl.load(src + tokens64[:, None] * stride_src_t + cols[None, :] * stride_src_d,
                      mask=token_ok[:, None] & col_ok[None, :], other=0.0)
        copy = tl.where(valid[:, :, None], row[:, None, :], 0.0)
        if DOT:
            y = tl.load(other + pos[:, :, None] * stride_other_m + cols[None, None, :] * stride_other_d,
                        mask=valid[:, :, None] & col_ok[None, None, :], other=0.0)
            dots += tl.sum(copy.to(tl.float32) * y.to(tl.float32), axis=2)
        if WEIGHTED:
            copy = copy.to(tl.float32) * w[:, :, None]
        value = copy.to(out.dtype.element_ty)
        mask = pos_ok[:, :, None] & col_ok[None, None, :]
        if STORE_ROWS:
            tl.store(out + pos[:, :, None] * stride_out_m + cols[None, None, :] * stride_out_d, value, mask=mask)
        if ROWWISE:
            q = to_fp8(value.to(tl.float32), row_scale[:, :, None], False, EMULATE_FP8)
            tl.store(data + pos[:, :, None] * stride_qm + cols[None, None, :], q, mask=mask)
    if DOT:
        tl.store(dw_ptr + tokens64[:, None] * TOP_K + copies[None, :], dots, mask=slot_ok)


@triton.jit
def _permute_blocks_kernel(
    src, inv_ptr, offsets_ptr, out, w_ptr, other, dw_ptr, data, scale,
    T, D, E, SCALE_COLS,
    stride_src_t, stride_src_d, stride_out_m, stride_out_d, stride_other_m, stride_other_d,
    stride_w_t, stride_w_j, stride_qm, stride_sm,
    TOP_K: tl.constexpr, WEIGHTED: tl.constexpr, DOT: tl.constexpr, STORE_ROWS: tl.constexpr,
    QBLOCK: tl.constexpr, MX: tl.constexpr, POW2: tl.constexpr, RCEIL: tl.constexpr,
    EMULATE_FP8: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``_permute_kernel`` writing the copies quantized with a block recipe (one scale per QBLOCK columns),
    one copy at a time: a copy's blocks then split only the chunk's feature dimension. (With the copies as
    a tensor dimension the blocks' maxima ran 2.2-4x slower on Hopper.)"""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < T
    tokens64 = tokens.to(tl.int64)
    copies = tl.arange(0, K_PAD)
    num_valid = tl.load(offsets_ptr + E - 1)
    dots = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        col_ok = cols < D
        row = tl.load(src + tokens64[:, None] * stride_src_t + cols[None, :] * stride_src_d,
                      mask=token_ok[:, None] & col_ok[None, :], other=0.0)
        for j in range(TOP_K):
            pos, pos_ok, valid, w = _copy_slots(inv_ptr, w_ptr, tokens64, j, token_ok, num_valid, T, stride_w_t,
                                                stride_w_j, TOP_K, WEIGHTED)
            copy = tl.where(valid[:, None], row, 0.0)
            if DOT:
                y = tl.load(other + pos[:, None] * stride_other_m + cols[None, :] * stride_other_d,
                            mask=valid[:, None] & col_ok[None, :], other=0.0)
                dot = tl.sum(copy.to(tl.float32) * y.to(tl.float32), axis=1)
                dots += tl.where(copies[None, :] == j, dot[:, None], 0.0)
            if WEIGHTED:
                copy = copy.to(tl.float32) * w[:, None]
            value = copy.to(out.dtype.element_ty)
            mask = pos_ok[:, None] & col_ok[None, :]
            if STORE_ROWS:
                tl.store(out + pos[:, None] * stride_out_m + cols[None, :] * stride_out_d, value, mask=mask)
            # Masked elements are 0, so they never raise a block's amax.
            v3 = tl.reshape(value.to(tl.float32), (BLOCK_T, BLOCK_D // QBLOCK, QBLOCK))
            s = block_scale(tl.max(magnitude(v3), axis=2), MX, POW2, RCEIL)
            q = tl.reshape(to_fp8(v3, s[:, :, None], MX, EMULATE_FP8), (BLOCK_T, BLOCK_D))
            blocks = d0 // QBLOCK + tl.arange(0, BLOCK_D // QBLOCK)
            tl.store(scale + pos[:, None] * stride_sm + blocks[None, :], s.to(scale.dtype.element_ty),
                     mask=pos_ok[:, None] & (blocks < SCALE_COLS)[None, :])
            tl.store(data + pos[:, None] * stride_qm + cols[None, :], q, mask=mask)
    if DOT:
        tl.store(dw_ptr + tokens64[:, None] * TOP_K + copies[None, :], dots,
                 mask=token_ok[:, None] & (copies < TOP_K)[None, :])


@triton.jit
def _unpermute_kernel(
    src, inv_ptr, offsets_ptr, out, w_ptr, bound_ptr,
    T, D, E,
    stride_src_m, stride_src_d, stride_out_t, stride_out_d, stride_w_t, stride_w_j,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, WEIGHTED: tl.constexpr, BOUNDED: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    written = T
    if BOUNDED:
        # Token rows from bound_ptr[0] on are not written: their programs stop before any work.
        written = tl.minimum(T, tl.load(bound_ptr).to(tl.int32))
        if tl.program_id(0) * BLOCK_T >= written:
            return
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    token_ok = tokens < written
    col_ok = cols < D
    tokens64 = tokens.to(tl.int64)
    copies = tl.arange(0, K_PAD)
    pos, pos_ok, valid, w = _copy_slots(inv_ptr, w_ptr, tokens64[:, None], copies[None, :],
                                        token_ok[:, None] & (copies < TOP_K)[None, :],
                                        tl.load(offsets_ptr + E - 1), T, stride_w_t, stride_w_j, TOP_K, WEIGHTED)
    # Every copy's chunk in one gather; the k copies summed in fp32 in the same order whatever the
    # routing: the result is deterministic.
    rows = tl.load(src + pos[:, :, None] * stride_src_m + cols[None, None, :] * stride_src_d,
                   mask=valid[:, :, None] & col_ok[None, None, :], other=0.0).to(tl.float32)
    if WEIGHTED:
        rows = rows * w[:, :, None]
    acc = tl.sum(rows, axis=1)
    tl.store(out + tokens64[:, None] * stride_out_t + cols[None, :] * stride_out_d,
             acc.to(out.dtype.element_ty), mask=token_ok[:, None] & col_ok[None, :])


_PERMUTE = DirectLaunch(_permute_kernel)
_PERMUTE_BLOCKS = DirectLaunch(_permute_blocks_kernel)
_UNPERMUTE = DirectLaunch(_unpermute_kernel)


def _blocks(rows: int, D: int, copies: int, elements: int, qblock: int = 0) -> tuple[int, int]:
    """(token rows per program, BLOCK_D): up to 256 contiguous features (a multiple of ``qblock``; fewer
    where ``copies`` is large), about ``elements`` elements a program (token rows x ``copies`` x BLOCK_D)."""
    block_d = max(min(next_power_of_2(D), _MAX_BLOCK_D, elements // copies), 16, qblock)
    block_rows = max(min(elements // (block_d * copies), max(next_power_of_2(rows), 1)), 1)
    return block_rows, block_d


def permute_rows(src: torch.Tensor, slot_to_sorted: torch.Tensor, offsets: torch.Tensor, top_k: int,
                 out: torch.Tensor | None, weights: torch.Tensor | None = None, other: torch.Tensor | None = None,
                 dweights: torch.Tensor | None = None,
                 quantized: tuple[torch.Tensor, torch.Tensor, Recipe] | None = None) -> None:
    """Write ``out [M, D]`` (sorted rows) from ``src [T, D]`` (token rows); arguments already checked.

    slot_to_sorted: int32/int64 ``[M]``, the sorted row of each slot ``t*top_k + j``, a permutation of
    ``0..M-1`` with ``M = T*top_k``; offsets: int ``[E]`` cumulative expert ends (only ``offsets[E-1]``
    is read, on the device); weights: optional ``[T, top_k]`` scale of each copy. With ``other [M, D]``
    and ``dweights`` (fp32 ``[M]``, contiguous, indexed by slot), also writes ``dweights[s] = <src[t],
    other[p]>``. ``quantized``: ``(data, scale, recipe)``, the rows quantized along D with an activation
    recipe (``"rowwise"``, ``"block128"``, ``"mxfp8"``), ``dropless.quantize(out, recipe, dim=-1)``'s
    bits: data float8_e4m3fn ``[M, D]`` with unit column stride, scale ``[M, 1]`` or ``[M, cdiv(D,
    block)]`` (fp32, or E8M0 for mxfp8) with unit column stride; ``out`` may then be None (the rows are
    quantized as rounded to src's dtype and not stored). Programs own blocks of tokens: each token row is
    read once (twice for rowwise scales) and stored to its top_k rows. Computes in fp32 when scaling; a
    plain gather copies the values. No host sync.
    """
    launch_info(src.device)
    M, D = slot_to_sorted.shape[0], src.shape[1]
    if M == 0:
        return
    T = M // top_k
    dot = other is not None
    data, scale, recipe = quantized if quantized is not None else (None, None, None)
    qblock = (recipe.block or 0) if recipe is not None else 0
    k_pad = next_power_of_2(top_k)
    rows = out if out is not None else src  # out's dtype rounds the values; src stands in when not stored
    w_arg = weights if weights is not None else src
    other_arg = other if dot else src
    data_arg = data if data is not None else rows
    scale_arg = scale_bits(scale) if scale is not None else rows
    args = dict(
        src=src, inv_ptr=slot_to_sorted, offsets_ptr=offsets, out=rows, w_ptr=w_arg, other=other_arg,
        dw_ptr=dweights if dot else rows, data=data_arg, scale=scale_arg, T=T, D=D, E=offsets.shape[0],
        stride_src_t=src.stride(0), stride_src_d=src.stride(1), stride_out_m=rows.stride(0),
        stride_out_d=rows.stride(1), stride_other_m=other_arg.stride(0), stride_other_d=other_arg.stride(1),
        stride_w_t=w_arg.stride(0), stride_w_j=w_arg.stride(1), stride_qm=data_arg.stride(0),
        stride_sm=scale_arg.stride(0), TOP_K=top_k, WEIGHTED=weights is not None, DOT=dot,
        STORE_ROWS=out is not None, POW2=recipe is not None and recipe.pow2, EMULATE_FP8=interpreting(),
        K_PAD=k_pad, num_warps=_NUM_WARPS,
    )
    if qblock:
        block_t, block_d = _blocks(T, D, 1, _BLOCK_ELEMENTS_PER_COPY, qblock)
        _PERMUTE_BLOCKS((cdiv(T, block_t),), SCALE_COLS=scale.shape[1], QBLOCK=qblock, MX=recipe.name == "mxfp8",
                        RCEIL=recipe.mx_rounding == "rceil", BLOCK_T=block_t, BLOCK_D=block_d, **args)
    else:
        block_t, block_d = _blocks(T, D, k_pad, _BLOCK_ELEMENTS)
        _PERMUTE((cdiv(T, block_t),), ROWWISE=recipe is not None, BLOCK_T=block_t, BLOCK_D=block_d, **args)


def unpermute_rows(src: torch.Tensor, slot_to_sorted: torch.Tensor, offsets: torch.Tensor, top_k: int,
                   out: torch.Tensor, weights: torch.Tensor | None = None, bound: torch.Tensor | None = None) -> None:
    """Write ``out [T, D]`` (token rows) as the weighted sum of each token's ``top_k`` sorted rows of
    ``src [M, D]``; arguments already checked.

    slot_to_sorted: int32/int64 ``[M]``, the sorted row of each slot ``t*top_k + j``; rows at or past
    ``offsets[E-1]`` (read on the device) count as zero. weights: optional ``[T, top_k]`` (1 if
    absent). bound: optional int ``[1]`` on the device: only out's first ``bound[0]`` rows are written,
    the others left as they are. Accumulates in fp32, in the same order every call. No host sync.
    """
    launch_info(src.device)
    T, D = out.shape
    if T == 0 or D == 0:
        return
    block_t, block_d = _blocks(T, D, next_power_of_2(top_k), _BLOCK_ELEMENTS)
    w_arg = weights if weights is not None else src
    _UNPERMUTE(
        (cdiv(T, block_t), cdiv(D, block_d)), src=src, inv_ptr=slot_to_sorted, offsets_ptr=offsets, out=out,
        w_ptr=w_arg, bound_ptr=offsets if bound is None else bound, T=T, D=D, E=offsets.shape[0],
        stride_src_m=src.stride(0), stride_src_d=src.stride(1), stride_out_t=out.stride(0),
        stride_out_d=out.stride(1), stride_w_t=w_arg.stride(0), stride_w_j=w_arg.stride(1),
        TOP_K=top_k, K_PAD=next_power_of_2(top_k), WEIGHTED=weights is not None, BOUNDED=bound is not None,
        BLOCK_T=block_t, BLOCK_D=block_d,
        num_warps=_NUM_WARPS,
    )
