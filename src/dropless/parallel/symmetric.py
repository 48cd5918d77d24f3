"""Dispatch and combine through symmetric buffers, with nothing that waits for the host.

Every rank publishes what the others need in its own buffer (``Workspace``), a barrier on the stream
makes it visible, and kernels move the rows straight between the ranks' memories (``kernels.exchange``).
A token whose k copies go to several experts of one rank crosses to that rank once (as DeepEP's
dispatch does): with DeepSeek-V3's top-8 of 256 experts over 4 ranks, about 3.6 rows a token instead
of 8.

- dispatch: each rank publishes its tokens ``[T, d]``, its copies in expert-sorted order
  (``sort_by_expert``: their slots, and each copy's place among the tokens it sends to the copy's rank),
  for each rank the list of tokens it sends there, and its counts (``kernels.exchange_plan.send_plan``).
  Each rank reads the table of counts, works out what it receives (``receive_plan``), then pulls each
  token it gets from a source once and writes it to each of that token's copies' rows (by local expert,
  each expert's rows in source-rank then sorted order: the layout of the "nccl" backend). The copies
  are ``[P * T_max * k, d]``, the most a rank can receive; the first ``sum(group_sizes)`` hold them, the
  rest is left as it was (nothing waits to learn the count).
- combine: each expert rank sums the weighted outputs of each token's copies it holds (fp32, rounded
  to y's dtype once) and stores that one row in the token's rank's buffer (one kernel); the token's
  rank sums the rows from the ranks (fp32, in rank order). With bf16 rows this rounds each rank's
  partial sum once more than summing all k copies at the source would.
- the backward passes are the same moves the other way: dispatch's backward sums each token's copies'
  gradients per rank and pushes them back; combine's backward publishes the output gradient, each expert
  rank pulls each token's row once and gives each copy ``w * grad`` and the dot product with its output
  (the routing weight's gradient), which it pushes back.

Each exchange starts with a barrier (no rank writes a peer's buffer before the peer is done reading it)
and ends with one (no rank reads before every rank has written). Only making the workspace, at the
first call of a size, waits for the host; after that a whole layer, forward and backward, can be
captured in a CUDA graph. The workspace is sized by the first call (the most tokens any rank has,
or ``max_tokens``), and every rank's regions are laid out for that size; a later call with more tokens
on one rank alone would make that rank grow it alone and wait for the others.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dropless.kernels.exchange import pull_rows, pull_to_copies, push_rows, sum_and_push
from dropless.kernels.exchange_plan import receive_plan, send_plan
from dropless.kernels.permute import unpermute_rows
from dropless.ops.checks import validation_enabled
from dropless.ops.permute import sort_by_expert
from dropless.parallel.workspace import Workspace, align

ROW_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FACTS = 3  # after the counts: the ids outside [0, E), the rows' dtype code, their width


@dataclass(frozen=True)
class _Layout:
    """Byte offsets of the regions of a workspace for ``world`` ranks of up to ``tokens`` tokens of
    ``copies`` slots each: published rows of up to ``token_bytes`` a token, rows sent back (one per
    token and rank) of up to ``copy_bytes``, a ``table`` of int32s."""

    world: int
    tokens: int
    copies: int
    table: int
    token_bytes: int
    copy_bytes: int

    def offsets(self) -> dict[str, int]:
        pairs = self.world * self.tokens  # (token, rank) pairs: the most rows a rank gets back
        sizes = {"table": 4 * self.table, "slots": 4 * self.copies, "unique": 4 * self.copies,
                 "lists": 4 * pairs, "weights": 4 * self.copies, "dots": 4 * self.copies,
                 "tokens": self.tokens * self.token_bytes, "rows": pairs * self.copy_bytes}
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
        # The table pull's arguments, made once: each rank's row, at row 0 of its region, all P of them.
        world = self.workspace.world
        self.table_ranks = torch.arange(world, dtype=torch.int32, device=device)
        self.table_rows = torch.zeros(world, dtype=torch.int32, device=device)
        self.table_count = torch.full((1,), world, dtype=torch.int32, device=device)


_SPACES: dict[tuple[int, str], _Space] = {}
# GPU workspaces outgrown by a larger one stay allocated: a CUDA graph captured on one replays its
# addresses. (CPU processes capture no graphs; theirs go, once every rank is done with them.)
_OUTGROWN: list[_Space] = []


def _space(group: dist.ProcessGroup | None, device: torch.device, need: _Layout) -> _Space:
    """The group's workspace on ``device``, made (or made larger) collectively when ``need`` outgrows it.
    The sizes are agreed on over the group, so every rank makes the same one."""
    group = group if group is not None else dist.group.WORLD
    key = (id(group), str(device))
    space = _SPACES.get(key)
    if space is not None and space.workspace.group is not group:
        space = None  # made for a group since destroyed, whose id this one has taken
    if space is not None and space.layout.covers(need):
        return space
    if space is not None:
        need = need.union(space.layout)
        if device.type == "cuda":
            _OUTGROWN.append(space)
        else:
            space.workspace.barrier()
    sizes = torch.tensor(list(vars(need).values()), dtype=torch.int64).to(device)
    dist.all_reduce(sizes, op=dist.ReduceOp.MAX, group=group)
    agreed = _Layout(*sizes.tolist())  # sync-ok: only when a workspace is made
    _SPACES[key] = _Space(group, device, agreed)
    return _SPACES[key]


@dataclass
class SymmetricHandle:
    """What combine and the backward passes need, all on the device.

    Source side: the sort (``slots``, ``offsets``), the routing ``weights [T, k]``, ``tokens`` T, ``top_k``,
    and ``from_ranks`` int32 ``[T*P]``: at ``t*P + r``, where rank r's row for token t lands when rows
    come back (``t*P + r`` if t sent copies to r, else past the end).
    Expert side, per received copy (``[R]``): ``src_rank`` (-1 past the ``received`` count ``[1]``),
    ``src_pos`` (its place in the source's sorted copies) and ``row_weight`` (fp32). Per token pulled
    from a source (``[U]``, source-major; the ``staged`` count ``[1]``): ``stage_src`` (-1 past the
    count), ``stage_token`` (its token at the source), ``back_row`` (where its sum lands at the source:
    ``stage_token * P + rank``), and ``inverse`` ``[U, k]``: the copy of each (pulled token, slot j), R
    if none.
    """

    group: dist.ProcessGroup | None
    slots: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor
    tokens: int
    top_k: int
    max_tokens: int
    world: int
    rank: int
    from_ranks: torch.Tensor
    src_rank: torch.Tensor
    src_pos: torch.Tensor
    received: torch.Tensor
    row_weight: torch.Tensor
    inverse: torch.Tensor
    stage_src: torch.Tensor
    stage_token: torch.Tensor
    back_row: torch.Tensor
    staged: torch.Tensor

    @property
    def rows(self) -> int:
        return self.src_rank.shape[0]

    def space(self, token_bytes: int = 0, copy_bytes: int = 0) -> _Space:
        return _space(self.group, self.slots.device, _Layout(self.world, self.max_tokens, self.max_tokens * self.top_k,
                                                             0, token_bytes, copy_bytes))


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
    """After the ready barrier: every rank's published ``[width]`` row, as ``[P, width]`` int32."""
    table = torch.empty(space.workspace.world, width, dtype=torch.int32, device=device)
    pull_rows(space.workspace.peers(space.at["table"]), space.table_ranks, space.table_rows, space.table_count, table)
    return table


def _check_table(table: torch.Tensor, num_experts: int) -> None:
    """With validation on (``dropless.set_validation``): bad ids or rows of another dtype/width on any
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
    width = num_experts + _FACTS + world
    first = published[0]
    space = _space(group, device, _Layout(world, max_tokens, max_tokens * k, width, sum(row_bytes),
                                          first.shape[1] * first.element_size()))
    ws, at = space.workspace, space.at
    # The regions are laid out for the tokens the workspace was made for, a size every rank agreed on.
    max_tokens = space.layout.tokens
    pairs = world * max_tokens
    ws.barrier()
    # The table row holds the facts a rank checks of the others: ids outside [0, E), the rows' dtype and width.
    from_ranks = send_plan(topk_idx.contiguous(), slots, all_sizes, offsets, topk_weights.detach().contiguous(), world,
                           num_experts, max_tokens,
                           ROW_DTYPES.index(first.dtype) if first.dtype in ROW_DTYPES else len(ROW_DTYPES),
                           first.shape[1], ws.view(at["table"], (width,), torch.int32),
                           ws.view(at["slots"], (T * k,), torch.int32), ws.view(at["unique"], (T * k,), torch.int32),
                           ws.view(at["weights"], (T * k,), torch.float32), ws.view(at["lists"], (pairs,), torch.int32))
    parts = [sum(row_bytes[:n]) for n in range(len(words))]  # each table's part of a token's (or pair's) bytes
    for w, part in zip(words, parts):
        ws.view(at["tokens"] + part * max_tokens, tuple(w.shape), w.dtype).copy_(w)
    ws.barrier()
    table = _pull_table(space, width, device)
    _check_table(table, num_experts)
    R, U = world * max_tokens * k, pairs
    # Each (pulled token, slot j)'s copy, R where none: the plan writes the copies' places.
    inverse = torch.full((U * k,), R, dtype=torch.int32, device=device)
    plan = receive_plan(table, rank, world, num_experts, k, num_experts + _FACTS + rank, R, U, ws.peers(at["unique"]),
                        ws.peers(at["slots"]), ws.peers(at["weights"]), inverse)
    inverse = inverse.view(U, k)
    src_rank, src_pos, received, row_weight = plan["src_rank"], plan["src_pos"], plan["received"], plan["row_weight"]
    stage_src, stage_place, staged = plan["stage_src"], plan["stage_place"], plan["staged"]
    stage_token = torch.empty(U, dtype=torch.int32, device=device)
    out = []
    for n, (t, w, part) in enumerate(zip(published, words, parts)):
        rows = torch.empty((R, w.shape[1]), dtype=w.dtype, device=device)
        if n == 0:
            pull_to_copies(ws.peers(at["tokens"] + part * max_tokens), stage_src, stage_place, staged, inverse, rows,
                           lookup_peers=ws.peers(at["lists"] + 4 * rank * max_tokens), lookup_out=stage_token)
        else:
            pull_to_copies(ws.peers(at["tokens"] + part * max_tokens), stage_src, stage_token, staged, inverse, rows)
        out.append(rows.view(t.dtype).view(R, *t.shape[1:]))
    handle = SymmetricHandle(group, slots, offsets, topk_weights, T, k, max_tokens, world, rank, from_ranks,
                             src_rank, src_pos, received, row_weight, inverse, stage_src, stage_token,
                             stage_token * world + rank, staged)
    return out, plan["group_sizes"], handle


def sum_at_sources(rows: torch.Tensor, handle: SymmetricHandle, weighted: bool = False) -> torch.Tensor:
    """Each token's copies (received rows ``[R, w]``, gradients or outputs) summed at its rank in fp32,
    weighted by the routing weights if ``weighted``: ``[T, w]`` in rows' dtype. Each rank sums the
    copies it holds per token (rounded to rows' dtype), pushes one row a token back, and the token's
    rank sums those."""
    T, P = handle.tokens, handle.world
    rows = rows.contiguous()
    space = handle.space(copy_bytes=rows.shape[1] * rows.element_size())
    ws = space.workspace
    ws.barrier()
    sum_and_push(rows, handle.inverse, handle.staged, ws.peers(space.at["rows"]), handle.stage_src, handle.back_row,
                 scale=handle.row_weight if weighted else None)
    ws.barrier()
    back = ws.view(space.at["rows"], (T * P, rows.shape[1]), rows.dtype)
    out = torch.empty(T, rows.shape[1], dtype=rows.dtype, device=rows.device)
    unpermute_rows(back, handle.from_ranks, torch.full((1,), T * P, dtype=torch.int32, device=rows.device), P, out)
    return out


def combine_backward(grad: torch.Tensor, y: torch.Tensor, handle: SymmetricHandle,
                     weights_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``grad [T, w]`` of combine's output -> (the gradient of y ``[R, w]``: ``weight * grad[t]`` for each
    received row, and if ``weights_grad``, the routing weights' ``[T, k]``: ``<grad[t], y(t, j)>``)."""
    T, k = handle.tokens, handle.top_k
    grad = grad.contiguous()
    space = handle.space(token_bytes=align(grad.shape[1] * grad.element_size()))
    ws, at = space.workspace, space.at
    ws.barrier()
    ws.view(at["tokens"], (T, grad.shape[1]), grad.dtype).copy_(grad)
    ws.barrier()
    grad_y = torch.empty(handle.rows, grad.shape[1], dtype=grad.dtype, device=grad.device)
    dots = torch.empty(handle.rows, dtype=torch.float32, device=grad.device) if weights_grad else None
    pull_to_copies(ws.peers(at["tokens"]), handle.stage_src, handle.stage_token, handle.staged, handle.inverse, grad_y,
                   scale=handle.row_weight, y=y.contiguous() if weights_grad else None, dots=dots)
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
        return sum_at_sources(y, handle, weighted=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (y,) = ctx.saved_tensors
        grad_y, grad_w = combine_backward(grad, y, ctx.handle, ctx.needs_input_grad[1])
        return grad_y, grad_w, None
