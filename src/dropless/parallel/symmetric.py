"""Dispatch and combine through symmetric buffers, with nothing that waits for the host.

Every rank publishes what the others need in its own buffer (``Workspace``), a barrier on the stream
makes it visible, and kernels move the rows straight between the ranks' memories (``kernels.exchange``):

- dispatch: each rank publishes its tokens ``[T, d]``, its copies' slots in expert-sorted order
  (``sort_by_expert``) and its ``[E]`` counts per expert. Each rank reads the ``[P, E]`` table of counts,
  lays out the rows it receives (by local expert, each expert's rows in source-rank then sorted order:
  the layout of the "nccl" backend) and pulls each row from its source's tokens through the source's
  slot table. The received rows are ``[P * T_max * k, d]``, the most a rank can receive; the first
  ``sum(group_sizes)`` hold the copies, the rest is left as it was (nothing waits to learn the count).
- combine: each expert rank pushes its output rows into their sources' buffers, at the copies' sorted
  places; each source sums its tokens' copies with ``unpermute`` (fp32, slot order), as the "nccl"
  backend does.
- the backward passes are the same moves the other way: dispatch's backward pushes the rows' gradients
  and sums them at the sources; combine's backward publishes the output gradient and the routing
  weights, the expert ranks pull each row's ``w * grad`` and its dot product with the expert output
  (the weight's gradient), and push those back.

Each exchange starts with a barrier (no rank writes a peer's buffer before the peer is done reading it)
and ends with one (no rank reads before every rank has written). Only making the workspace, at the
first call of a size, waits for the host; after that a whole layer, forward and backward, can be
captured in a CUDA graph. Every rank must hold the same number of tokens, or pass the same
``max_tokens``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dropless.kernels.exchange import LOCAL_SLOT, REMOTE_SLOT, pull_rows, push_rows
from dropless.ops.checks import validation_enabled
from dropless.ops.permute import sort_by_expert, sum_copies, unpermute
from dropless.parallel.workspace import Workspace, align

ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FACTS = 3  # after the counts: the ids outside [0, E), the rows' dtype code, their width


@dataclass(frozen=True)
class _Layout:
    """Byte offsets of the regions of a workspace for ``tokens`` rows per rank of up to ``token_bytes``
    (published tokens), ``copies`` slots of up to ``copy_bytes`` (rows sent back), ``table`` int32s."""

    tokens: int
    copies: int
    table: int
    token_bytes: int
    copy_bytes: int

    def offsets(self) -> dict[str, int]:
        sizes = {"table": 4 * self.table, "slots": 4 * self.copies, "weights": 4 * self.copies,
                 "dots": 4 * self.copies, "tokens": self.tokens * self.token_bytes,
                 "rows": self.copies * self.copy_bytes}
        out, at = {}, 0
        for name, size in sizes.items():
            out[name] = at
            at += align(size)
        out["end"] = at
        return out

    def covers(self, other: _Layout) -> bool:
        return all(a >= b for a, b in zip(vars(self).values(), vars(other).values()))

    def union(self, other: _Layout) -> _Layout:
        return _Layout(*(max(a, b) for a, b in zip(vars(self).values(), vars(other).values())))


class _Space:
    """A group's workspace and the layout it was made for."""

    def __init__(self, group: dist.ProcessGroup | None, device: torch.device, layout: _Layout) -> None:
        self.layout = layout
        self.at = layout.offsets()
        self.workspace = Workspace(group, device, self.at["end"])


_SPACES: dict[tuple[int, str], _Space] = {}


def _space(group: dist.ProcessGroup | None, device: torch.device, need: _Layout) -> _Space:
    """The group's workspace on ``device``, made (or made larger) collectively when ``need`` outgrows it.
    The sizes are agreed on over the group, so every rank makes the same one."""
    group = group if group is not None else dist.group.WORLD
    key = (id(group), str(device))
    space = _SPACES.get(key)
    if space is not None and space.layout.covers(need):
        return space
    if space is not None:
        need = need.union(space.layout)
        space.workspace.barrier()  # the old buffers are read no more
    sizes = torch.tensor(list(vars(need).values()), dtype=torch.int64).to(device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    agreed = _Layout(*sizes.tolist())  # sync-ok: only when a workspace is made
    _SPACES[key] = _Space(group, device, agreed)
    return _SPACES[key]


@dataclass
class SymmetricHandle:
    """What combine and the backward passes need: the source side's sort (``slots``, ``offsets``, the
    routing ``weights [T, k]``, ``tokens`` T, ``top_k``) and, for each received row, its source rank
    (-1 past the received count), its place in the source's sorted copies and its slot there
    (``src_rank``, ``src_pos``, ``row_slot``: int32 ``[R]``), with the count ``received`` (``[1]``) and
    the group's size, all on the device."""

    group: dist.ProcessGroup | None
    slots: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor
    tokens: int
    top_k: int
    max_tokens: int
    src_rank: torch.Tensor
    src_pos: torch.Tensor
    row_slot: torch.Tensor
    received: torch.Tensor
    world: int

    @property
    def rows(self) -> int:
        return self.src_rank.shape[0]

    def space(self, token_bytes: int = 0, copy_bytes: int = 0) -> _Space:
        return _space(self.group, self.slots.device,
                      _Layout(self.max_tokens, self.max_tokens * self.top_k, 0, token_bytes, copy_bytes))


def as_words(rows: torch.Tensor) -> torch.Tensor:
    """A contiguous ``[R, ...]`` tensor's rows as the widest integers that tile them (int64 down to
    uint8): a row moves in fewer, wider accesses."""
    rows = rows.contiguous()
    flat = rows.reshape(rows.shape[0], math.prod(rows.shape[1:]))
    nbytes = flat.shape[1] * rows.element_size()
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if nbytes % size == 0 and rows.element_size() <= size:
            return flat.view(dtype)
    return flat.view(torch.uint8)


def _pull_table(space: _Space, width: int, device: torch.device) -> torch.Tensor:
    """After the ready barrier: every rank's published ``[E + 3]`` row, as ``[P, E + 3]`` int32."""
    ws = space.workspace
    table = torch.empty(ws.world, width, dtype=torch.int32, device=device)
    ranks = torch.arange(ws.world, dtype=torch.int32, device=device)
    pull_rows(ws.peers(space.at["table"]), ranks, torch.zeros_like(ranks), torch.full_like(ranks[:1], ws.world),
              table)
    return table


def _receive_layout(table: torch.Tensor, rank: int, world: int, num_experts: int, rows: int):
    """From the ``[P, E]`` counts: each received row's source rank (-1 past the count) and place in the
    source's sorted copies, the count ``[1]`` and the local group sizes (all on the device)."""
    local = num_experts // world
    counts = table[:, :num_experts].long()
    mine = counts[:, rank * local:(rank + 1) * local]  # [source, local expert]
    blocks = mine.t().reshape(-1)  # expert-major: each local expert's rows from rank 0, 1, ...
    ends = blocks.cumsum(0)
    starts = ends - blocks
    i = torch.arange(rows, device=table.device)
    block = torch.searchsorted(ends, i, right=True).clamp_(max=blocks.numel() - 1)
    expert, source = block // world, block % world
    first = counts.cumsum(1) - counts  # where each expert's copies start in each source's sorted order
    pos = first[source, rank * local + expert] + (i - starts[block])
    received = ends[-1:]
    src_rank = torch.where(i < received, source, -1).to(torch.int32)
    return src_rank, pos.to(torch.int32), received, mine.sum(0).to(torch.int32)


def _check_table(table: torch.Tensor, num_experts: int) -> None:
    """With validation on (``dropless.set_validate``): bad ids or rows of another dtype/width on any
    rank raise at the next sync point."""
    if validation_enabled():
        facts = table[:, num_experts:]
        torch._assert_async(facts[:, 0].eq(0).all(), f"topk_idx must hold expert ids in [0, {num_experts}) on every rank")
        torch._assert_async(facts[:, 1:].eq(facts[:1, 1:]).all(), "x must have one dtype and width on every rank")


def dispatch_rows(topk_idx: torch.Tensor, topk_weights: torch.Tensor, group: dist.ProcessGroup | None,
                  num_experts: int, max_tokens: int | None,
                  published: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor, SymmetricHandle]:
    """Publish ``published`` (tables of T rows: the tokens, or their FP8 data and scales; the first's
    dtype and width are checked across ranks), pull the copies' rows of each into ``[P * T_max * k,
    ...]`` tables; returns them, the local group sizes int32 ``[E/P]`` and the handle."""
    T, k = topk_idx.shape
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    max_tokens = max(max_tokens or 0, T)
    device = topk_idx.device
    slots, all_sizes, offsets = sort_by_expert(topk_idx, num_experts)
    words = [as_words(t) for t in published]
    row_bytes = [align(w.shape[1] * w.element_size()) for w in words]
    width = num_experts + _FACTS
    first = published[0]
    space = _space(group, device, _Layout(max_tokens, max_tokens * k, width, sum(row_bytes),
                                          first.shape[1] * first.element_size()))
    ws, at = space.workspace, space.at
    # The facts a rank checks of the others: ids outside [0, E), the rows' dtype and width.
    # (Filled by kernels: a Python number written into a device tensor would be a copy from the host.)
    facts = torch.full((_FACTS,), first.shape[1], dtype=torch.int32, device=device)
    facts[:1].copy_(T * k - offsets[-1:])
    facts[1:2].fill_(ROW_DTYPES.index(first.dtype) if first.dtype in ROW_DTYPES else len(ROW_DTYPES))
    ws.barrier()
    ws.view(at["table"], (width,), torch.int32).copy_(torch.cat([all_sizes, facts]))
    ws.view(at["slots"], (T * k,), torch.int32).copy_(slots)
    # Each published table has its own part of the tokens region, max_tokens rows of its row bytes.
    parts = [at["tokens"] + sum(row_bytes[:n]) * max_tokens for n in range(len(words))]
    for w, part in zip(words, parts):
        ws.view(part, tuple(w.shape), w.dtype).copy_(w)
    ws.barrier()
    table = _pull_table(space, width, device)
    _check_table(table, num_experts)
    R = world * max_tokens * k
    src_rank, src_pos, received, group_sizes = _receive_layout(table, rank, world, num_experts, R)
    row_slot = torch.empty(R, dtype=torch.int32, device=device)
    out = []
    for n, (t, w, part) in enumerate(zip(published, words, parts)):
        rows = torch.empty((R, w.shape[1]), dtype=w.dtype, device=device)
        if n == 0:
            pull_rows(ws.peers(part), src_rank, src_pos, received, rows, slots=REMOTE_SLOT, top_k=k,
                      slot_peers=ws.peers(at["slots"]), slot_out=row_slot)
        else:
            pull_rows(ws.peers(part), src_rank, row_slot, received, rows, slots=LOCAL_SLOT, top_k=k)
        out.append(rows.view(t.dtype).view(R, *t.shape[1:]))
    handle = SymmetricHandle(group, slots, offsets, topk_weights, T, k, max_tokens, src_rank, src_pos, row_slot,
                             received, world)
    return out, group_sizes, handle


def _rows_to_sources(rows: torch.Tensor, handle: SymmetricHandle) -> torch.Tensor:
    """Push the received rows (``[R, w]``) to their sources; returns this rank's ``[T*k, w]`` copies in
    sorted order (a view of the workspace: read it before the next exchange)."""
    words = as_words(rows)
    space = handle.space(copy_bytes=words.shape[1] * words.element_size())
    ws = space.workspace
    ws.barrier()
    push_rows(words, ws.peers(space.at["rows"]), handle.src_rank, handle.src_pos, handle.received)
    ws.barrier()
    copies = ws.view(space.at["rows"], (handle.tokens * handle.top_k, words.shape[1]), words.dtype)
    return copies.view(rows.dtype).view(-1, *rows.shape[1:])


def sum_at_sources(rows: torch.Tensor, handle: SymmetricHandle, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's copies (received rows ``[R, w]``, gradients or outputs) summed at its rank in fp32,
    weighted by ``weights [T, k]`` if given: ``[T, w]`` in rows' dtype."""
    copies = _rows_to_sources(rows, handle)
    with torch.no_grad():
        if weights is None:
            return sum_copies(copies, handle.slots, handle.offsets, handle.tokens)
        return unpermute(copies, handle.slots, weights, handle.offsets)


def combine_backward(grad: torch.Tensor, y: torch.Tensor, handle: SymmetricHandle,
                     weights_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``grad [T, w]`` of combine's output -> (the gradient of y ``[R, w]``: ``weight * grad[t]`` for each
    received row, and if ``weights_grad``, the routing weights' ``[T, k]``: ``<grad[t], y(t, j)>``)."""
    T, k = handle.tokens, handle.top_k
    grad = grad.contiguous()
    w_bytes = grad.shape[1] * grad.element_size()
    space = handle.space(token_bytes=align(w_bytes))
    ws, at = space.workspace, space.at
    ws.barrier()
    ws.view(at["tokens"], (T, grad.shape[1]), grad.dtype).copy_(grad)
    ws.view(at["weights"], (T * k,), torch.float32).copy_(handle.weights.detach().reshape(-1))
    ws.barrier()
    grad_y = torch.empty(handle.rows, grad.shape[1], dtype=grad.dtype, device=grad.device)
    dots = torch.empty(handle.rows, dtype=torch.float32, device=grad.device) if weights_grad else None
    pull_rows(ws.peers(at["tokens"]), handle.src_rank, handle.row_slot, handle.received, grad_y, slots=LOCAL_SLOT,
              top_k=k, weight_peers=ws.peers(at["weights"]), y=y.contiguous() if weights_grad else None, dots=dots)
    if not weights_grad:
        return grad_y, None
    push_rows(dots.view(-1, 1), ws.peers(at["dots"]), handle.src_rank, handle.src_pos, handle.received)
    ws.barrier()
    at_sources = ws.view(at["dots"], (T * k,), torch.float32)
    valid = torch.arange(T * k, device=grad.device) < handle.offsets[-1]
    by_slot = torch.zeros(T * k, dtype=torch.float32, device=grad.device).scatter_(
        0, handle.slots.long(), torch.where(valid, at_sources, 0.0))
    return grad_y, by_slot.view(T, k).to(handle.weights.dtype)


class SymmetricDispatch(torch.autograd.Function):
    """Forward: the rows dispatch pulled (``sent``); backward: their gradients pushed back and summed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, handle: SymmetricHandle, sent: torch.Tensor) -> torch.Tensor:
        ctx.handle = handle
        return sent

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return sum_at_sources(grad, ctx.handle), None, None


class SymmetricCombine(torch.autograd.Function):
    """Forward: ``out[t] = sum_j w[t, j] * y(t, j)`` at the sources; backward: ``combine_backward``."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, weights: torch.Tensor, handle: SymmetricHandle) -> torch.Tensor:
        ctx.handle = handle
        ctx.save_for_backward(y)
        return sum_at_sources(y, handle, weights)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (y,) = ctx.saved_tensors
        grad_y, grad_w = combine_backward(grad, y, ctx.handle, ctx.needs_input_grad[1])
        return grad_y, grad_w, None
