"""The four operand forms of ``torch._grouped_mm`` as differentiable custom ops, on both backends.

    form   a          b          offsets split   out
    2d/3d  [M, K]     [G, K, N]  rows of a       [M, N]     out[s_g:t_g] = a[s_g:t_g] @ b[g]          ragged M
    2d/2d  [M, K]     [K, N]     K               [G, M, N]  out[g] = a[:, s_g:t_g] @ b[s_g:t_g]       ragged K
    3d/2d  [G, M, K]  [K, N]     columns of b    [M, N]     out[:, s_g:t_g] = a[g] @ b[:, s_g:t_g]    ragged N
    3d/3d  [G, M, K]  [G, K, N]  (no offsets)    [G, M, N]  out[g] = a[g] @ b[g]                      batched

with ``s_g = offsets[g-1]`` (0 for g = 0) and ``t_g = offsets[g]``. Rows (ragged M) and columns
(ragged N) past ``offsets[-1]`` come out zero, and the stretch of K past it (ragged K) enters no
product; they all get zero gradients. (``torch._grouped_mm`` leaves those rows and columns unwritten.)

The gradients of each form are forms again (dy: the output's gradient, cast to the operands' dtype):

    2d/3d  da = ragged_m(dy, b^T)      db = ragged_k(a^T, dy)  (in b's layout: ragged_k(dy^T, a)^T)
    2d/2d  da = ragged_n(dy, b^T)      db = ragged_m(a^T, dy)
    3d/2d  da = ragged_k(dy, b^T)      db = ragged_n(a^T, dy)
    3d/3d  da = batched(dy, b^T)       db = ragged_k over the G*M stacked rows

What runs on the Triton backend, on views of the operands (no copies):
- ragged M: the ragged-M kernel.
- ragged K: the ragged-K (weight-gradient) kernel on ``a^T [K, M]`` and ``b [K, N]``.
- ragged N: the ragged-M kernel on the transposed problem ``out^T = ragged_m(b^T, a^T)``, written through
  a transposed view of a row-major out.
- batched: ``batched_mm``, the ragged-M op over the ``G*M`` stacked rows of a (a view unless a's first
  two dims do not merge, e.g. a transposed across G, then a copy) with offsets ``M, 2M, ..., G*M`` made
  on the device; autograd takes its gradients through the ragged-M op's.
Nothing reads the offsets on the host.
"""

from __future__ import annotations

import torch

from dropless import reference
from dropless.backend import use_triton
from dropless.kernels.launch import weight_nk
from dropless.kernels.ragged_k import ACCUMULATE_FLAGGED, NO_ACCUMULATE
from dropless.kernels.tuning import run_ragged_k, run_ragged_m
from dropless.ops.direct import DirectOp


def _launch_ragged_m(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor,
                     tail: bool = True) -> None:
    """Write ``out [M, N]`` (any strides) with the ragged-M product of ``a [M, K]`` and ``b [G, K, N]``
    (``tail=False``: the rows past ``offsets[-1]`` may be left unwritten)."""
    if a.shape[1] == 0:
        out.zero_()
    elif out.numel() > 0:
        run_ragged_m(a, b, offsets, out, tail=tail)


def launch_ragged_k(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor,
                    mode: int, flags: torch.Tensor | None) -> None:
    """``out[g] (+)= a[s_g:t_g]^T @ b[s_g:t_g]`` for ``a [R, K]``, ``b [R, N]``, ``out [G, K, N]`` (any
    strides, a's dtype or fp32); ``mode`` and ``flags`` as ``kernels.ragged_k`` takes them."""
    if out.numel() == 0:
        return
    if a.shape[0] == 0:
        # No rows at all: every group is empty.
        if mode == NO_ACCUMULATE:
            out.zero_()
        elif mode == ACCUMULATE_FLAGGED:
            out.masked_fill_(~flags.view(-1, 1, 1), 0)
        return
    run_ragged_k(a, b, offsets, out, mode, flags)


def _ragged_m(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
              out_dtype: torch.dtype | None = None, tail: bool = True) -> torch.Tensor:
    """2d/3d: ``a [M, K]``, ``b [G, K, N]`` (any strides), offsets int32 ``[G]`` -> ``[M, N]`` in
    ``out_dtype`` (default a's); ``tail=False``: the rows past ``offsets[-1]`` hold anything (the
    reference backend still writes them as zeros)."""
    if not use_triton(a.device):
        return reference.grouped_mm(a, b, offsets, out_dtype)
    out = torch.empty(a.shape[0], b.shape[2], dtype=out_dtype or a.dtype, device=a.device)
    _launch_ragged_m(a, b, offsets, out, tail)
    return out


def _ragged_k(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """2d/2d: ``a [M, K]``, ``b [K, N]`` (any strides), offsets int32 ``[G]`` splitting K -> contiguous
    ``[G, M, N]`` in ``out_dtype`` (default a's)."""
    if not use_triton(a.device):
        return reference.grouped_mm_wgrad(a.t(), b, offsets).to(out_dtype or a.dtype)
    out = torch.empty(offsets.shape[0], a.shape[0], b.shape[1], dtype=out_dtype or a.dtype, device=a.device)
    launch_ragged_k(a.t(), b, offsets, out, NO_ACCUMULATE, None)
    return out


def _ragged_n(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """3d/2d: ``a [G, M, K]``, ``b [K, N]`` (any strides), offsets int32 ``[G]`` splitting N -> contiguous
    ``[M, N]`` in ``out_dtype`` (default a's)."""
    if not use_triton(a.device):
        return reference.grouped_mm_ragged_n(a, b, offsets, out_dtype)
    out = torch.empty(a.shape[1], b.shape[1], dtype=out_dtype or a.dtype, device=a.device)
    _launch_ragged_m(b.t(), a.transpose(1, 2), offsets, out.t())
    return out


def _ragged_m_fake(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                   out_dtype: torch.dtype | None = None, tail: bool = True) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[2], dtype=out_dtype or a.dtype)


def _ragged_k_fake(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return a.new_empty(offsets.shape[0], a.shape[0], b.shape[1], dtype=out_dtype or a.dtype)


def _ragged_n_fake(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    return a.new_empty(a.shape[1], b.shape[1], dtype=out_dtype or a.dtype)


def _setup_context(ctx, inputs, output) -> None:
    a, b, offsets = inputs[:3]
    ctx.save_for_backward(a, b, offsets)
    ctx.num_inputs = len(inputs)
    ctx.tail = inputs[4] if len(inputs) > 4 else True


def _ragged_m_backward(ctx, dy: torch.Tensor):
    a, b, offsets = ctx.saved_tensors
    dy = dy.to(a.dtype)
    db = None
    if ctx.needs_input_grad[1]:
        # Give db the layout of b: nn.Linear-layout weights viewed as [G, K, N] get [G, N, K] storage.
        if weight_nk(b):
            db = RAGGED_K(dy.t(), a, offsets, None).transpose(1, 2)
        else:
            db = RAGGED_K(a.t(), dy, offsets, None)
    # da after db, a dropped first: where a was saved as the recipe that makes it again (the MoE layer's
    # recompute_permute), a and da, of one size, are never alive together.
    del a
    # With tail=False the gradient's rows past offsets[-1] are left unwritten too: the caller reads none.
    da = RAGGED_M(dy, b.transpose(1, 2), offsets, None, ctx.tail) if ctx.needs_input_grad[0] else None
    return (da, db) + (None,) * (ctx.num_inputs - 2)


def _ragged_k_backward(ctx, dy: torch.Tensor):
    a, b, offsets = ctx.saved_tensors
    dy = dy.to(a.dtype)
    da = RAGGED_N(dy, b.t(), offsets, None) if ctx.needs_input_grad[0] else None
    db = RAGGED_M(a.t(), dy, offsets, None) if ctx.needs_input_grad[1] else None
    return da, db, None, None


def _ragged_n_backward(ctx, dy: torch.Tensor):
    a, b, offsets = ctx.saved_tensors
    dy = dy.to(a.dtype)
    da = RAGGED_K(dy, b.t(), offsets, None) if ctx.needs_input_grad[0] else None
    db = RAGGED_N(a.transpose(1, 2), dy, offsets, None) if ctx.needs_input_grad[1] else None
    return da, db, None, None


RAGGED_M = DirectOp.define("grouped_mm", _ragged_m, _ragged_m_fake, backward=_ragged_m_backward,
                           setup_context=_setup_context)
RAGGED_K = DirectOp.define("grouped_mm_ragged_k", _ragged_k, _ragged_k_fake, backward=_ragged_k_backward,
                           setup_context=_setup_context)
RAGGED_N = DirectOp.define("grouped_mm_ragged_n", _ragged_n, _ragged_n_fake, backward=_ragged_n_backward,
                           setup_context=_setup_context)


def batched_mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """3d/3d: ``a [G, M, K]``, ``b [G, K, N]`` -> contiguous ``[G, M, N]`` in ``out_dtype`` (default a's),
    ``out[g] = a[g] @ b[g]``: the ragged-M op over a's ``G*M`` stacked rows, groups of M rows."""
    G, M, K = a.shape
    offsets = torch.arange(1, G + 1, dtype=torch.int32, device=a.device) * M
    return RAGGED_M(a.reshape(G * M, K), b, offsets, out_dtype).view(G, M, b.shape[2])
