"""Dispatch and combine over a process group: ``all_to_all_single`` after a count exchange ("nccl"), or
through symmetric buffers with no host sync ("symmetric_memory", ``parallel.symmetric``).

E experts are spread over the P ranks of ``group``: rank r owns experts ``r * E/P .. (r+1) * E/P - 1``
(its local experts). Each rank holds T tokens, each routed to k experts (``topk_idx [T, k]``) with
weights (``topk_weights [T, k]``).

- ``dispatch`` sends every (token, slot) copy to the rank owning its expert. A rank receives its rows
  grouped by local expert (the layout the grouped GEMMs read), with the local group sizes.
- ``combine`` sends the expert outputs back and returns, for every token of the source rank,
  ``sum_j topk_weights[t, j] * y(t, j)``.

Both are differentiable: dispatch's backward is an unweighted combine, combine's backward a dispatch of
the weighted output gradient (and the routing weights' gradient, ``<grad_out[t], y(t, j)>``).

The copies are sorted by expert on the device (``dropless.permute``'s sort), gathered, exchanged, and
reordered from rank-major to local-expert order by one gather; the weighted sum of combine (and the
sum of dispatch's backward) is ``dropless.unpermute``: in fp32, in slot order, with no atomics. The
split sizes of ``all_to_all_single`` live on the host, so the count exchange (a ``[P, E/P]`` table per
rank) is read back once per dispatch: one host sync, which the backward reuses. On the CPU, gloo runs
the same algorithm. The "symmetric_memory" backend returns the rows in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dropless import reference
from dropless.backend import use_triton
from dropless.ops.grouped_mm_fp8 import resolve_recipe
from dropless.ops.permute import sort_by_expert, sum_copies, unpermute
from dropless.ops.quantize import quantize
from dropless.parallel.symmetric import ROW_DTYPES, SymmetricCombine, SymmetricDispatch, SymmetricHandle, dispatch_rows
from dropless.quantized import QuantizedTensor, operand_recipes

BACKENDS = ("nccl", "symmetric_memory")


@dataclass
class DispatchHandle:
    """What ``combine`` and the backward passes need to retrace a dispatch.

    slots: int32 ``[T*k]``, the (token, slot) copies ``t*k + j`` sorted by expert (stable), the order
    they are sent in; offsets: int32 ``[E]``, the cumulative ends of each (global) expert's copies in
    that order; send_splits / recv_splits: rows sent to and received from each rank; expert_rows:
    ``[R]``, for each row in local-expert order its place among the received (rank-major) rows;
    rank_rows: ``[R]``, the inverse; weights: the ``[T, k]`` routing weights; tokens: T; top_k: k.
    """

    group: dist.ProcessGroup | None
    slots: torch.Tensor
    offsets: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    expert_rows: torch.Tensor
    rank_rows: torch.Tensor
    weights: torch.Tensor
    tokens: int
    top_k: int

    @property
    def received(self) -> None:
        """Every row dispatch returned holds a copy (the symmetric-memory handle's count, where not)."""
        return None


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    """``all_to_all_single`` of ``rows`` (``sum(send)`` rows) into ``sum(recv)`` rows."""
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
    return out


# Row dtypes by code, for the check that every rank sends rows of one dtype and width.
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _block_gather(counts: torch.Tensor, shifts: torch.Tensor, total: int) -> torch.Tensor:
    """For the rows of blocks laid out one after another (block b: ``counts[b]`` rows), the place of each in
    another layout of the same blocks, ``shifts[b]`` rows away: ``[total]`` int64 on the tables' device;
    nothing syncs (the size is known)."""
    return torch.repeat_interleave(shifts, counts, output_size=total) + torch.arange(total, device=counts.device)


def _route(topk_idx: torch.Tensor, num_experts: int, group: dist.ProcessGroup | None, x: torch.Tensor):
    """Sort the copies by expert (on the device), exchange the ``[P, E/P]`` tables of counts, and lay out
    where each received row goes.

    Each rank also sends how many of its ids fall outside ``[0, num_experts)`` and its rows' dtype and
    width, so that every rank raises together on bad input (a rank that raised alone would leave the
    others waiting in the next collective)."""
    world = dist.get_world_size(group)
    local = num_experts // world
    slots, group_sizes, offsets = sort_by_expert(topk_idx, num_experts)
    dtype_code = _DTYPES.index(x.dtype) if x.dtype in _DTYPES else len(_DTYPES)
    # Filled on the device: a host tensor copied in would wait for the stream (a pageable copy syncs).
    facts = torch.full((3,), x.shape[1], dtype=torch.int64, device=offsets.device)
    facts[0] = topk_idx.numel() - offsets[-1].long()
    facts[1] = dtype_code
    table = torch.cat([group_sizes.long().view(world, local), facts.expand(world, 3)], dim=1)
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
    recv_table = received[:, :local]  # [source rank, local expert]
    send_splits = table[:, :local].sum(1).tolist()  # sync-ok: host tensors (read back above)
    recv_splits = recv_table.sum(1).tolist()  # sync-ok: host tensors
    # Received rows come rank-major, each rank's sorted by local expert; the experts read them
    # expert-major, each expert's rows in rank order. Each (rank, expert) block's start in both layouts:
    rank_major = recv_table.flatten()
    rank_starts = rank_major.cumsum(0) - rank_major
    expert_major = recv_table.t().flatten()
    expert_starts = (expert_major.cumsum(0) - expert_major).view(local, world).t().flatten()
    # One copy of the small tables to the device: the local group sizes, then per block (rank-major) its
    # rows and how far it moves, then the same expert-major. From pageable memory a copy that does not
    # block returns once the host buffer is staged, so the stream does not wait for it.
    def em(t: torch.Tensor) -> torch.Tensor:  # a rank-major [P * E/P] table in expert-major order
        return t.view(world, local).t().flatten()

    tables = torch.cat([recv_table.sum(0), rank_major, expert_starts - rank_starts, expert_major,
                        em(rank_starts) - em(expert_starts)]).to(topk_idx.device, non_blocking=True)
    sizes, rank_counts, rank_shifts, expert_counts, expert_shifts = tables.split([local] + [world * local] * 4)
    total = int(rank_major.sum())
    expert_rows = _block_gather(expert_counts, expert_shifts, total)
    rank_rows = _block_gather(rank_counts, rank_shifts, total)
    return slots, offsets, send_splits, recv_splits, expert_rows, rank_rows, sizes.to(torch.int32)


def _sum_at_sources(rows: torch.Tensor, handle: DispatchHandle, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's copies (``rows`` in the sending order) summed in fp32, weighted by ``weights [T, k]``
    if given: ``dropless.unpermute`` (``sum_copies`` unweighted); for rows its kernel does not take (fp64
    on a GPU), the reference's torch ops (differentiable by autograd)."""
    if rows.dtype == torch.float64 and use_triton(rows.device):
        w = weights if weights is not None else rows.new_ones(handle.tokens, handle.top_k)
        return reference.unpermute(rows, handle.slots, w, handle.offsets)
    if weights is None:
        return sum_copies(rows, handle.slots, handle.offsets, handle.tokens)
    return unpermute(rows, handle.slots, weights, handle.offsets)


def _to_experts(rows: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Rows in the sending order (``handle.slots``) to their experts' ranks, in local-expert order there."""
    received = _exchange(rows, handle.send_splits, handle.recv_splits, handle.group)
    return received.index_select(0, handle.expert_rows)


def _to_sources(rows: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """Rows in local-expert order back to the ranks that sent them, in their sending order."""
    return _exchange(rows.index_select(0, handle.rank_rows), handle.recv_splits, handle.send_splits, handle.group)


def _send_rows(t: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
    """``t``'s rows (one per token) to the ranks of the dispatch's copies, in local-expert order."""
    return _to_experts(t.index_select(0, handle.slots // handle.top_k), handle)


class _Dispatch(torch.autograd.Function):
    """Forward: the copies of x's rows, or (``sent`` given) rows already sent, e.g. the dequantized values
    of FP8 rows; backward: each token's copies' gradients sent back and summed in fp32 at its rank."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, handle: DispatchHandle, sent: torch.Tensor | None = None) -> torch.Tensor:
        ctx.handle = handle
        return _send_rows(x, handle) if sent is None else sent

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _sum_at_sources(_to_sources(grad, ctx.handle), ctx.handle), None, None


class _Return(torch.autograd.Function):
    """Forward: expert outputs back to their sources, in the sending order; backward: their gradients
    to the experts again."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        ctx.handle = handle
        return _to_sources(y, handle)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _to_experts(grad, ctx.handle), None


def dispatch(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
             group: dist.ProcessGroup | None = None, *, num_experts: int, backend: str = "nccl",
             recipe: str | None = None, max_tokens: int | None = None
             ) -> tuple[torch.Tensor | tuple[torch.Tensor, QuantizedTensor], torch.Tensor,
                        DispatchHandle | SymmetricHandle]:
    """Send each token's k copies to the ranks that own their experts.

    Args:
        x: ``[T, d]`` tokens of this rank (any float dtype; T may be 0).
        topk_idx: int ``[T, k]`` global expert ids in ``[0, num_experts)``.
        topk_weights: ``[T, k]`` routing weights, applied by ``combine``.
        group: the expert-parallel process group (default: the whole world); its size must divide
            ``num_experts``.
        num_experts: E, all ranks' experts together.
        backend: ``"nccl"``: ``all_to_all_single`` after a count exchange (NCCL on GPUs, gloo on the
            CPU), one host sync per dispatch. ``"symmetric_memory"``: the rows move between the ranks'
            symmetric buffers (torch symmetric memory on GPUs, shared memory between CPU processes) with
            no host sync after the first call of a size (which makes the buffers, collectively), so a
            layer can be captured in a CUDA graph; x in fp32/bf16/fp16. The buffers are made by the
            first call, collectively, for the most tokens any rank has then (or ``max_tokens``), and grown
            the same way when every rank needs more: a rank that alone outgrows them waits for its
            peers. It returns ``P * T_max * k`` rows for those ``T_max`` tokens, the most a rank can
            receive: the first ``sum(group_sizes)`` are the copies, in the order above, and the rest are
            left unwritten (the grouped GEMMs read only the groups' rows). Bad ids and mismatched rows
            across ranks are checked on the device with ``dropless.set_validation(True)``.
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
        max_tokens: with "symmetric_memory", the most tokens a rank will dispatch in any call, so that later
            calls with more tokens do not outgrow the buffers (default: the first call's, over all ranks).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if x.dim() != 2 or topk_idx.dim() != 2 or topk_idx.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [T, d] and topk_idx [T, k], got shapes {tuple(x.shape)} and {tuple(topk_idx.shape)}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(f"topk_weights must have topk_idx's shape {tuple(topk_idx.shape)}, got {tuple(topk_weights.shape)}")
    if topk_idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_idx must be int32/int64, got {topk_idx.dtype}")
    world = dist.get_world_size(group)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int of at least 1, got {num_experts!r}")
    if num_experts % world:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the group's size ({world})")
    if backend == "symmetric_memory":
        return _dispatch_symmetric(x, topk_idx, topk_weights, group, num_experts, recipe, max_tokens)
    slots, offsets, send, recv, expert_rows, rank_rows, group_sizes = _route(topk_idx, num_experts, group, x)
    handle = DispatchHandle(group, slots, offsets, send, recv, expert_rows, rank_rows, topk_weights, x.shape[0],
                            topk_idx.shape[1])
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


def _dispatch_symmetric(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                        group: dist.ProcessGroup | None, num_experts: int, recipe: str | None, max_tokens: int | None):
    """``dispatch`` with the "symmetric_memory" backend (the same returns)."""
    if x.dtype not in ROW_DTYPES:
        raise ValueError(f"x must be one of {ROW_DTYPES} with the symmetric_memory backend, got {x.dtype}")
    if max_tokens is not None and max_tokens < x.shape[0]:
        raise ValueError(f"max_tokens ({max_tokens}) must be at least x's {x.shape[0]} tokens")
    if recipe is None:
        (rows,), group_sizes, handle = dispatch_rows(topk_idx, topk_weights, group, num_experts, max_tokens,
                                                     [x.detach()])
        return SymmetricDispatch.apply(x, handle, rows), group_sizes, handle
    act, _ = operand_recipes(resolve_recipe(recipe))
    q = quantize(x.detach(), act, dim=1)
    (data, scale), group_sizes, handle = dispatch_rows(topk_idx, topk_weights, group, num_experts, max_tokens,
                                                       [q.data, q.scale])
    rows_fp8 = QuantizedTensor(data, scale, q.recipe, 1)
    values = rows_fp8.dequantize(x.dtype, rows=handle.received)
    return (SymmetricDispatch.apply(x, handle, values), rows_fp8), group_sizes, handle


def combine(y: torch.Tensor, handle: DispatchHandle | SymmetricHandle) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t, j] * y(t, j)`` at each token's own rank.

    Args:
        y: ``[R, d']``: the expert outputs of the rows ``dispatch`` returned, in their order.
        handle: that dispatch's handle (its routing weights get a gradient if they require one).
    Returns:
        ``[T, d']`` in y's dtype.
    """
    if isinstance(handle, SymmetricHandle):
        if y.shape[0] != handle.rows:
            raise ValueError(f"y must have the {handle.rows} rows dispatch returned, got {y.shape[0]}")
        return SymmetricCombine.apply(y, handle.weights, handle)
    if y.shape[0] != len(handle.expert_rows):
        raise ValueError(f"y must have the {len(handle.expert_rows)} rows dispatch returned, got {y.shape[0]}")
    return _sum_at_sources(_Return.apply(y, handle), handle, handle.weights)
