"""Dispatch and combine over a process group with ``all_to_all_single`` after a count exchange.

E experts are spread over the P ranks of ``group``: rank r owns experts ``r * E/P .. (r+1) * E/P - 1``
(its local experts). Each rank holds T tokens, each routed to k experts (``topk_idx [T, k]``) with
weights (``topk_weights [T, k]``).

- ``dispatch`` sends every (token, slot) copy to the rank owning its expert. A rank receives its rows
  grouped by local expert (the layout the grouped GEMMs read), with the local group sizes.
- ``combine`` sends the expert outputs back and returns, for every token of the source rank,
  ``sum_j topk_weights[t, j] * y(t, j)``.

Both are differentiable: dispatch's backward is an unweighted combine, combine's backward a dispatch of
the weighted output gradient (and the routing weights' gradient, ``<grad_out[t], y(t, j)>``).

The split sizes of ``all_to_all_single`` live on the host, so the count exchange (a ``[P, E/P]`` table
per rank) is read back once per dispatch: one host sync, which the backward reuses. On the CPU, gloo
runs the same algorithm.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dropless.ops.grouped_mm_fp8 import resolve_recipe
from dropless.ops.quantize import quantize
from dropless.quantized import QuantizedTensor, operand_recipes


@dataclass
class DispatchHandle:
    """What ``combine`` and the backward passes need to retrace a dispatch.

    order: ``[T*k]``, the (token, slot) copies sorted by expert (stable), as indices into the flattened
    ``[T, k]`` routing; send_splits / recv_splits: rows sent to and received from each rank; recv_order:
    ``[R]``, for each row in local-expert order, its place in the received (rank-major) buffer; weights:
    the flattened routing weights; tokens: T; top_k: k.
    """

    group: dist.ProcessGroup | None
    order: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    recv_order: torch.Tensor
    weights: torch.Tensor
    tokens: int
    top_k: int


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """``all_to_all_single`` of ``rows`` (``sum(send)`` rows) into ``sum(recv)`` rows."""
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
    return out


# Row dtypes by code, for the check that every rank sends rows of one dtype and width.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _route(topk_idx: torch.Tensor, num_experts: int, group: dist.ProcessGroup | None, x: torch.Tensor):
    """Sort the copies by expert, count them per (rank, local expert) and exchange the counts.

    Each rank also sends how many of its ids fall outside ``[0, num_experts)`` and its rows' dtype and
    width, so that every rank raises together on bad input (a rank that raised alone would leave the
    others waiting in the next collective)."""
    world = dist.get_world_size(group)
    if num_experts % world:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the group's size ({world})")
    local = num_experts // world
    ids = topk_idx.reshape(-1).long()
    bad = (ids < 0) | (ids >= num_experts)
    ids = ids.clamp(0, num_experts - 1)
    order = torch.sort(ids, stable=True).indices
    # scatter_add, not bincount: bincount reads the largest id on the host.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(
        0, ids, torch.ones_like(ids)).view(world, local)
    dtype_code = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else len(_DTYPES)
    facts = torch.stack([bad.sum(), torch.tensor(dtype_code, device=ids.device),
                         torch.tensor(x.shape[1], device=ids.device)])
    table = torch.cat([counts, facts.expand(world, 3)], dim=1)
    received = torch.empty_like(table)
    dist.all_to_all_single(received, table, group=group)
    # The one host sync: all_to_all_single takes its splits on the host.
    received, table = torch.stack([received, table]).cpu()  # sync-ok: the backend's one sync, for the splits
    if received[:, local].any():
        ranks = received[:, local].nonzero().flatten().tolist()  # sync-ok: host tensor, bad input only
        raise ValueError(f"topk_idx must hold expert ids in [0, {num_experts}); rank(s) {ranks} sent others")
    if (received[:, local + 1:] != received[0, local + 1:]).any():
        facts = received[:, local + 1:].tolist()  # sync-ok: host tensor, bad input only
        kinds = [(str(_DTYPES[c]) if c < len(_DTYPES) else "other", int(d)) for c, d in facts]
        raise ValueError(f"x must have one dtype and width on every rank of the group, got (dtype, d) {kinds}")
    recv_table = received[:, :local]
    send_splits = table[:, :local].sum(1).tolist()  # sync-ok: host tensors (read back above)
    recv_splits = recv_table.sum(1).tolist()  # sync-ok: host tensors
    # Received rows come rank-major, each rank's sorted by local expert: a stable sort by expert makes
    # them expert-major, each expert's rows in rank order.
    expert_of_row = torch.repeat_interleave(torch.arange(local).repeat(world), recv_table.flatten())
    recv_order = torch.sort(expert_of_row, stable=True).indices
    group_sizes = recv_table.sum(0).to(torch.int32)
    return order, send_splits, recv_splits, recv_order.to(topk_idx.device), group_sizes.to(topk_idx.device)


def _send_rows(t: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """``t``'s rows (one per token) to the ranks of the dispatch's copies, in local-expert order."""
    received = _exchange(t[handle.order // handle.top_k], handle.send_splits, handle.recv_splits, handle.group)
    return received[handle.recv_order]


class _Dispatch(torch.autograd.Function):
    """Forward: the copies of x's rows, or (``sent`` given) rows already sent, e.g. the dequantized values
    of FP8 rows; backward: each token's copies' gradients summed back at its rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, handle: DispatchHandle, sent: torch.Tensor | None = None) -> torch.Tensor:
        ctx.handle = handle
        return _send_rows(x, handle) if sent is None else sent

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h = ctx.handle
        back = grad.new_empty(grad.shape)
        back[h.recv_order] = grad
        rows = _exchange(back, h.recv_splits, h.send_splits, h.group)
        grad_x = grad.new_zeros((h.tokens, *grad.shape[1:]))
        grad_x.index_add_(0, h.order // h.top_k, rows)
        return grad_x, None, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, weights: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        back = y.new_empty(y.shape)
        back[handle.recv_order] = y
        rows = _exchange(back, handle.recv_splits, handle.send_splits, handle.group)  # in handle.order
        ctx.handle = handle
        ctx.save_for_backward(rows, weights)
        # Weighted and summed in fp32 (or wider), as the one-process unpermute does.
        wide = torch.promote_types(rows.dtype, torch.float32)
        w = weights.reshape(-1)[handle.order].to(wide)
        out = rows.new_zeros((handle.tokens, *rows.shape[1:]), dtype=wide)
        out.index_add_(0, handle.order // handle.top_k, rows.to(wide) * w.view(-1, *([1] * (rows.dim() - 1))))
        return out.to(rows.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        h = ctx.handle
        rows, weights = ctx.saved_tensors
        token = h.order // h.top_k
        wide = torch.promote_types(rows.dtype, torch.float32)
        g = grad[token].to(wide)
        grad_w = None
        if ctx.needs_input_grad[1]:
            grad_w_flat = weights.new_zeros(weights.numel())
            grad_w_flat[h.order] = (g * rows.to(wide)).flatten(1).sum(1).to(weights.dtype)
            grad_w = grad_w_flat.view_as(weights)
        w = weights.reshape(-1)[h.order].to(wide)
        weighted = (g * w.view(-1, *([1] * (g.dim() - 1)))).to(rows.dtype)
        sent = _exchange(weighted, h.send_splits, h.recv_splits, h.group)
        return sent[h.recv_order], grad_w, None


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
             group: dist.ProcessGroup | None = None, *, num_experts: int, backend: str = "nccl",
             recipe: str | None = None) -> tuple[torch.Tensor | tuple[torch.Tensor, QuantizedTensor], torch.Tensor,
                                                 DispatchHandle]:
    """Send each token's k copies to the ranks that own their experts.

    Args:
        x: ``[T, d]`` tokens of this rank (any float dtype; T may be 0).
        topk_idx: int ``[T, k]`` global expert ids in ``[0, num_experts)``.
        topk_weights: ``[T, k]`` routing weights, applied by ``combine``.
        group: the expert-parallel process group (default: the whole world); its size must divide
            ``num_experts``.
        num_experts: E, all ranks' experts together.
        backend: ``"nccl"``: ``all_to_all_single`` after a count exchange (NCCL on GPUs, gloo on the
            CPU), one host sync per dispatch.
        recipe: an FP8 recipe whose activations quantize along d (``"rowwise"``, ``"block128"``,
            ``"mxfp8"``): each token is quantized once at its rank and its copies travel as FP8 bytes and
            scales (about half the bytes of bf16), for a grouped GEMM to read without quantizing again.
    Returns:
        ``(rows, group_sizes, handle)``: rows ``[R, d]`` received, sorted by local expert (rank r's
        experts ``r*E/P ..``), each expert's rows in source-rank then token order; group_sizes int32
        ``[E/P]`` on x's device; the handle for ``combine``. With a recipe, rows is ``(values, fp8)``:
        the FP8 rows as a ``QuantizedTensor`` (along d) and their dequantized values in x's dtype,
        differentiable (the gradient goes back to x as without a recipe; a weight gradient quantizes
        these values along the tokens).
    """
    if backend != "nccl":
        raise ValueError(f"backend must be 'nccl', got {backend!r}")
    if x.dim() != 2 or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [T, d] and topk_idx [T, k], got shapes {tuple(x.shape)} and {tuple(topk_idx.shape)}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(f"topk_weights must have topk_idx's shape {tuple(topk_idx.shape)}, got {tuple(topk_weights.shape)}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_idx must be int32/int64, got {topk_idx.dtype}")
    order, send, recv, recv_order, group_sizes = _route(topk_idx, num_experts, group, x)
    handle = DispatchHandle(group, order, send, recv, recv_order, topk_weights, x.shape[0], topk_idx.shape[1])
    if recipe is None:
        return _Dispatch.apply(x, handle), group_sizes, handle
    act, _ = operand_recipes(resolve_recipe(recipe))
    q = quantize(x.detach(), act, dim=1)
    # FP8 data and E8M0 scales travel as their bytes.
    data = _send_rows(q.data.view(torch.uint8), handle).view(q.data.dtype)
    scale = q.scale.view(torch.uint8) if q.scale.element_size() == 1 else q.scale
    rows_fp8 = QuantizedTensor(data, _send_rows(scale, handle).view(q.scale.dtype), q.recipe, 1)
    values = _Dispatch.apply(x, handle, rows_fp8.dequantize(x.dtype))
    return (values, rows_fp8), group_sizes, handle


def combine(y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * y(t, j)`` at each token's own rank.

    Args:
        y: ``[R, d']``: the expert outputs of the rows ``dispatch`` returned, in their order.
        handle: that dispatch's handle (its routing weights get a gradient if they require one).
    Returns:
        ``[T, d']`` in y's dtype.
    """
    if y.shape[0] != len(handle.recv_order):
        raise ValueError(f"y must have the {len(handle.recv_order)} rows dispatch returned, got {y.shape[0]}")
    return _Combine.apply(y, handle.weights, handle)
