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

Both walk token order: programs own blocks of tokens, so each token row is read once (permute_rows) or
written once (unpermute_rows) whatever the expert order, and walk the feature dimension in ``BLOCK_D``
chunks of unit-stride loads. (Walking the sorted rows instead reads each token row k times, from DRAM
once the tokens outgrow the L2.)
The number of valid rows is read from ``offsets`` on the device, so nothing waits for the host. Row
indices are 64-bit before they multiply a stride.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dropless.kernels.launch import cdiv, launch_info, next_power_of_2

_MAX_BLOCK_D = 256
_BLOCK_ELEMENTS = 2048  # rows per program = _BLOCK_ELEMENTS // BLOCK_D
_NUM_WARPS = 4


@triton.jit
def _permute_kernel(
    src, inv_ptr, offsets_ptr, out, w_ptr, other, dw_ptr,
    T, D, top_k, E,
    stride_src_t, stride_src_d, stride_out_m, stride_out_d, stride_other_m, stride_other_d,
    stride_w_t, stride_w_j,
    WEIGHTED: tl.constexpr, DOT: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    token_ok = tokens < T
    tokens64 = tokens.to(tl.int64)
    M = T * top_k
    num_valid = tl.load(offsets_ptr + E - 1)
    copies = tl.arange(0, K_PAD)
    dots = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        col_ok = cols < D
        # Each token's row is read once and stored to each of its k rows.
        row = tl.load(src + tokens64[:, None] * stride_src_t + cols[None, :] * stride_src_d,
                      mask=token_ok[:, None] & col_ok[None, :], other=0.0)
        for j in range(top_k):
            pos = tl.load(inv_ptr + tokens64 * top_k + j, mask=token_ok, other=-1).to(tl.int64)
            # A row outside [0, M) is written by no one; rows past the local experts are written as zeros.
            pos_ok = token_ok & (pos >= 0) & (pos < M)
            valid = pos_ok & (pos < num_valid)
            copy = tl.where(valid[:, None], row, 0.0)
            if DOT:
                y = tl.load(other + pos[:, None] * stride_other_m + cols[None, :] * stride_other_d,
                            mask=valid[:, None] & col_ok[None, :], other=0.0)
                dot = tl.sum(copy.to(tl.float32) * y.to(tl.float32), axis=1)
                dots += tl.where(copies[None, :] == j, dot[:, None], 0.0)
            if WEIGHTED:
                w = tl.load(w_ptr + tokens64 * stride_w_t + j * stride_w_j, mask=valid, other=0.0)
                copy = copy.to(tl.float32) * w.to(tl.float32)[:, None]
            tl.store(out + pos[:, None] * stride_out_m + cols[None, :] * stride_out_d,
                     copy.to(out.dtype.element_ty), mask=pos_ok[:, None] & col_ok[None, :])
    if DOT:
        tl.store(dw_ptr + tokens64[:, None] * top_k + copies[None, :], dots,
                 mask=token_ok[:, None] & (copies < top_k)[None, :])


@triton.jit
def _unpermute_kernel(
    src, inv_ptr, offsets_ptr, out, w_ptr, bound_ptr,
    T, D, top_k, E,
    stride_src_m, stride_src_d, stride_out_t, stride_out_d, stride_w_t, stride_w_j,
    WEIGHTED: tl.constexpr, BOUNDED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
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
    num_valid = tl.load(offsets_ptr + E - 1)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    # The k copies are summed in slot order whatever the routing: the result is deterministic.
    for j in range(top_k):
        pos = tl.load(inv_ptr + tokens64 * top_k + j, mask=token_ok, other=0).to(tl.int64)
        valid = token_ok & (pos >= 0) & (pos < num_valid) & (pos < T * top_k)
        row = tl.load(src + pos[:, None] * stride_src_m + cols[None, :] * stride_src_d,
                      mask=valid[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        if WEIGHTED:
            w = tl.load(w_ptr + tokens64 * stride_w_t + j * stride_w_j, mask=valid, other=0.0).to(tl.float32)
            row = row * w[:, None]
        acc += row
    tl.store(out + tokens64[:, None] * stride_out_t + cols[None, :] * stride_out_d,
             acc.to(out.dtype.element_ty), mask=token_ok[:, None] & col_ok[None, :])


def _blocks(rows: int, D: int) -> tuple[int, int]:
    """(rows per program, BLOCK_D): up to 256 contiguous features, about 2048 elements a program."""
    block_d = min(max(next_power_of_2(D), 16), _MAX_BLOCK_D)
    block_rows = min(_BLOCK_ELEMENTS // block_d, max(next_power_of_2(rows), 1))
    return block_rows, block_d


def permute_rows(src: torch.Tensor, slot_to_sorted: torch.Tensor, offsets: torch.Tensor, top_k: int,
                 out: torch.Tensor, weights: torch.Tensor | None = None, other: torch.Tensor | None = None,
                 dweights: torch.Tensor | None = None) -> None:
    """Write ``out [M, D]`` (sorted rows) from ``src [T, D]`` (token rows); arguments already checked.

    slot_to_sorted: int32/int64 ``[M]``, the sorted row of each slot ``t*top_k + j``, a permutation of
    ``0..M-1`` with ``M = T*top_k``; offsets: int ``[E]`` cumulative expert ends (only ``offsets[E-1]``
    is read, on the device); weights: optional ``[T, top_k]`` scale of each copy. With ``other [M, D]``
    and ``dweights`` (fp32 ``[M]``, contiguous, indexed by slot), also writes ``dweights[s] = <src[t],
    other[p]>``. Programs own blocks of tokens: each token row is read once and stored to its top_k
    rows. Computes in fp32 when scaling; a plain gather copies the values. No host sync.
    """
    launch_info(src.device)
    M, D = out.shape
    if M == 0:
        return
    T = M // top_k
    dot = other is not None
    block_t, block_d = _blocks(T, D)
    w_arg = weights if weights is not None else src
    other_arg = other if dot else src
    _permute_kernel[(cdiv(T, block_t),)](
        src, slot_to_sorted, offsets, out, w_arg, other_arg, dweights if dot else out,
        T, D, top_k, offsets.shape[0],
        src.stride(0), src.stride(1), out.stride(0), out.stride(1),
        other_arg.stride(0), other_arg.stride(1), w_arg.stride(0), w_arg.stride(1),
        WEIGHTED=weights is not None, DOT=dot, K_PAD=next_power_of_2(top_k), BLOCK_T=block_t, BLOCK_D=block_d,
        num_warps=_NUM_WARPS,
    )


def unpermute_rows(src: torch.Tensor, slot_to_sorted: torch.Tensor, offsets: torch.Tensor, top_k: int,
                   out: torch.Tensor, weights: torch.Tensor | None = None, bound: torch.Tensor | None = None) -> None:
    """Write ``out [T, D]`` (token rows) as the weighted sum of each token's ``top_k`` sorted rows of
    ``src [M, D]``; arguments already checked.

    slot_to_sorted: int32/int64 ``[M]``, the sorted row of each slot ``t*top_k + j``; rows at or past
    ``offsets[E-1]`` (read on the device) count as zero. weights: optional ``[T, top_k]`` (1 if
    absent). bound: optional int ``[1]`` on the device: only out's first ``bound[0]`` rows are written,
    the others left as they are. Accumulates in fp32 in slot order. No host sync.
    """
    launch_info(src.device)
    T, D = out.shape
    if T == 0 or D == 0:
        return
    block_t, block_d = _blocks(T, D)
    w_arg = weights if weights is not None else src
    _unpermute_kernel[(cdiv(T, block_t), cdiv(D, block_d))](
        src, slot_to_sorted, offsets, out, w_arg, offsets if bound is None else bound,
        T, D, top_k, offsets.shape[0],
        src.stride(0), src.stride(1), out.stride(0), out.stride(1), w_arg.stride(0), w_arg.stride(1),
        WEIGHTED=weights is not None, BOUNDED=bound is not None, BLOCK_T=block_t, BLOCK_D=block_d,
        num_warps=_NUM_WARPS,
    )
