"""The experts each token chooses: the indices of the ``k`` largest of each row of the router's scores.

    ids[t, j] = the index of the j-th largest of scores[t, :]     (j = 0 .. k-1, largest first)

One program owns ``BLOCK_T`` whole rows (E at most ``MAX_E``, padded to a power of two) and takes the
largest remaining element of each row k times. Ties go to the lower index; NaN counts as larger than any
number (as ``torch.topk`` orders it). An element, once taken, is never taken again, whatever its value
(-inf included: group-limited routing masks experts with it). The scores are read once; there is no
sort. No host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dropless.kernels.launch import cdiv, launch_info, next_power_of_2

MAX_E = 1024  # the widest row a program holds in registers
_BLOCK_ELEMENTS = 4096  # rows per program = _BLOCK_ELEMENTS // BLOCK_E
_NUM_WARPS = 4


@triton.jit
def _topk_kernel(scores, ids, T, E, top_k, stride_t, stride_e, stride_it, stride_ij,
                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    in_row = cols < E
    rows64 = rows.to(tl.int64)
    values = tl.load(scores + rows64[:, None] * stride_t + cols[None, :] * stride_e,
                     mask=row_ok[:, None] & in_row[None, :], other=0.0).to(tl.float32)
    values = tl.where(values != values, float("inf"), values)
    # Padding columns count as taken: they are never chosen.
    taken = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.int1) | ~in_row[None, :]
    for j in range(top_k):
        best = tl.max(tl.where(taken, float("-inf"), values), axis=1)
        candidate = ~taken & (values == best[:, None])
        choice = tl.min(tl.where(candidate, cols[None, :], BLOCK_E), axis=1)
        tl.store(ids + rows64 * stride_it + j * stride_ij, choice.to(ids.dtype.element_ty), mask=row_ok)
        taken = taken | (cols[None, :] == choice[:, None])


def topk_ids(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """int64 ``[T, top_k]``: the indices of the ``top_k`` largest scores of each row of ``scores [T, E]``
    (fp32 or fp64, any strides, ``1 <= top_k <= E <= MAX_E``; checked by the caller), largest first, ties
    to the lower index."""
    launch_info(scores.device)
    T, E = scores.shape
    ids = torch.empty(T, top_k, dtype=torch.int64, device=scores.device)
    if T == 0:
        return ids
    block_e = max(next_power_of_2(E), 2)
    block_t = max(min(_BLOCK_ELEMENTS // block_e, next_power_of_2(T)), 1)
    _topk_kernel[(cdiv(T, block_t),)](
        scores, ids, T, E, top_k, scores.stride(0), scores.stride(1), ids.stride(0), ids.stride(1),
        BLOCK_T=block_t, BLOCK_E=block_e, num_warps=_NUM_WARPS,
    )
    return ids
