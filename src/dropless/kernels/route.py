"""Top-k routing in two kernels forward and one backward, from the router's fp32 logits ``[T, E]``.

Forward, ``_route_kernel``: one program owns ``BLOCK_T`` whole rows (E at most ``MAX_E``, padded to a power
of two) and computes each row's scores (softmax or sigmoid), the choice (scores plus the expert bias,
limited to the best groups where asked), the ``k`` largest choices (largest first, ties to the lower index,
NaN above every number, as ``torch.topk`` orders it), their weights (renormalized, scaled), and per program
the counts of copies per expert, the column sums of the normalized scores and the sum of the squared
log-sum-exps. ``_route_sums_kernel`` (one program) adds the programs' partial sums in a fixed order: the
tokens per expert and the two losses, the same bits on every run. Backward, ``_route_backward_kernel``
recomputes the scores from the logits and writes the logits' gradient from those of the weights and the
two losses. No host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dropless.kernels.direct_launch import DirectLaunch
from dropless.kernels.launch import cdiv, launch_info, next_power_of_2

MAX_E = 1024  # the widest row a program holds in registers
_BLOCK_ELEMENTS = 4096  # rows per program at most _BLOCK_ELEMENTS // BLOCK_E
_MIN_PROGRAMS = 256  # rows per program at most T / _MIN_PROGRAMS (a power of two), so that few experts fill the GPU
_NUM_WARPS = 4
_SCATTER_BLOCK = 1024  # copies per program of the sort's scatter


@triton.jit
def _load_rows(logits, rows, cols, T, E, stride_t, stride_e):
    """The ``[BLOCK_T, BLOCK_E]`` logits of ``rows``, -inf past E (0 in rows past T)."""
    in_row = cols < E
    rows64 = rows.to(tl.int64)
    values = tl.load(logits + rows64[:, None] * stride_t + cols[None, :] * stride_e,
                     mask=(rows < T)[:, None] & in_row[None, :], other=0.0)
    return tl.where(in_row[None, :], values, float("-inf"))


@triton.jit
def _scores(values, cols, E, SOFTMAX: tl.constexpr):
    """``(scores, softmax, lse)``: the routing scores (softmax or sigmoid; 0 past E), the softmax and each
    row's log-sum-exp."""
    peak = tl.max(values, axis=1)
    exps = tl.exp(values - peak[:, None])
    total = tl.sum(exps, axis=1)
    soft = exps / total[:, None]
    if SOFTMAX:
        scores = soft
    else:
        scores = tl.where((cols < E)[None, :], tl.sigmoid(values), 0.0)
    return scores, soft, peak + tl.log(total)


@triton.jit
def _best_groups(choice, cols, in_row, n_groups, topk_groups, group_size, SOFTMAX: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, G_POW2: tl.constexpr):
    """``[BLOCK_T, BLOCK_E]``: the experts of each row's ``topk_groups`` best groups, a group scored by its
    best choice (softmax) or the sum of its two best (sigmoid, groups of two or more)."""
    group_of = cols // group_size
    gcols = tl.arange(0, G_POW2)
    gscore = tl.full((BLOCK_T, G_POW2), float("-inf"), tl.float32)
    for g in range(n_groups):
        member = ((group_of == g) & in_row)[None, :]
        values = tl.where(member, choice, float("-inf"))
        first = tl.max(values, axis=1)
        score = first
        if not SOFTMAX:
            at = tl.min(tl.where(member & (values == first[:, None]), cols[None, :], BLOCK_E), axis=1)
            second = tl.max(tl.where(cols[None, :] == at[:, None], float("-inf"), values), axis=1)
            score = tl.where(group_size >= 2, first + second, first)
        gscore = tl.where(gcols[None, :] == g, score[:, None], gscore)
    gtaken = tl.broadcast_to(gcols[None, :] >= n_groups, (BLOCK_T, G_POW2))
    allowed = tl.zeros((BLOCK_T, BLOCK_E), tl.int1)
    for _ in range(topk_groups):
        best = tl.max(tl.where(gtaken, float("-inf"), gscore), axis=1)
        pick = tl.min(tl.where(~gtaken & (gscore == best[:, None]), gcols[None, :], G_POW2), axis=1)
        gtaken = gtaken | (gcols[None, :] == pick[:, None])
        allowed = allowed | (group_of[None, :] == pick[:, None])
    return allowed


@triton.jit
def _route_kernel(logits, bias, ids, weights, ranks, part_counts, part_probs, part_z,
                  T, E, top_k, n_groups, topk_groups, group_size, scale, stride_t, stride_e,
                  SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
                  GROUPED: tl.constexpr, SORT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                  G_POW2: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    in_row = cols < E
    values = _load_rows(logits, rows, cols, T, E, stride_t, stride_e)
    scores, soft, lse = _scores(values, cols, E, SOFTMAX)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias + cols, mask=in_row, other=0.0)[None, :]
    choice = tl.where(choice != choice, float("inf"), choice)
    # Padding columns (and experts outside the best groups) count as taken: they are never chosen.
    taken = tl.broadcast_to(~in_row[None, :], (BLOCK_T, BLOCK_E))
    if GROUPED:
        taken = taken | ~_best_groups(choice, cols, in_row, n_groups, topk_groups, group_size, SOFTMAX, BLOCK_T,
                                      BLOCK_E, G_POW2)
    rank = tl.full((BLOCK_T, BLOCK_E), -1, tl.int32)
    for j in range(top_k):
        best = tl.max(tl.where(taken, float("-inf"), choice), axis=1)
        pick = tl.min(tl.where(~taken & (choice == best[:, None]), cols[None, :], BLOCK_E), axis=1)
        hit = cols[None, :] == pick[:, None]
        rank = tl.where(hit, j, rank)
        taken = taken | hit
    chosen = rank >= 0
    valid = row_ok[:, None] & in_row[None, :]
    total = tl.sum(tl.where(chosen, scores, 0.0), axis=1)
    # A copy's rank among this program's copies of its expert (a token takes an expert at most once).
    earlier = tl.cumsum((chosen & valid).to(tl.int32), axis=0) - (chosen & valid).to(tl.int32)
    rows64 = rows.to(tl.int64)
    for j in range(top_k):
        at = rank == j
        weight = tl.sum(tl.where(at, scores, 0.0), axis=1)
        if RENORMALIZE:
            weight = weight / tl.maximum(total, 1e-20)
        tl.store(ids + rows64 * top_k + j, tl.min(tl.where(at, cols[None, :], BLOCK_E), axis=1).to(tl.int64),
                 mask=row_ok)
        tl.store(weights + rows64 * top_k + j, weight * scale, mask=row_ok)
        if SORT:
            tl.store(ranks + rows64 * top_k + j, tl.sum(tl.where(at, earlier, 0), axis=1), mask=row_ok)
    if SOFTMAX:
        probs = scores
    else:
        probs = scores / tl.sum(scores, axis=1)[:, None]
    tl.store(part_counts + pid * BLOCK_E + cols, tl.sum((chosen & valid).to(tl.int32), axis=0))
    tl.store(part_probs + pid * BLOCK_E + cols, tl.sum(tl.where(valid, probs, 0.0), axis=0))
    tl.store(part_z + pid, tl.sum(tl.where(row_ok, lse * lse, 0.0), axis=0))


@triton.jit
def _route_sums_kernel(part_counts, part_probs, part_z, counts, losses, offsets, programs, E, aux_scale, z_scale,
                       SORT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    cols = tl.arange(0, BLOCK_E)
    prows = tl.arange(0, BLOCK_P)
    count = tl.zeros((BLOCK_P, BLOCK_E), tl.int32)
    probs = tl.zeros((BLOCK_P, BLOCK_E), tl.float32)
    z = tl.zeros((BLOCK_P,), tl.float32)
    for p0 in range(0, programs, BLOCK_P):
        p = p0 + prows
        ok = p < programs
        at = p[:, None] * BLOCK_E + cols[None, :]
        count += tl.load(part_counts + at, mask=ok[:, None], other=0)
        probs += tl.load(part_probs + at, mask=ok[:, None], other=0.0)
        z += tl.load(part_z + p, mask=ok, other=0.0)
    per_expert = tl.sum(count, axis=0)
    tl.store(counts + cols, per_expert, mask=cols < E)
    tl.store(losses, aux_scale * tl.sum(per_expert.to(tl.float32) * tl.sum(probs, axis=0), axis=0))
    tl.store(losses + 1, z_scale * tl.sum(z, axis=0))
    if SORT:
        ends = tl.cumsum(per_expert, axis=0)
        tl.store(offsets + cols, ends, mask=cols < E)
        # Each program's first row of each expert, written over its counts: the expert's start, then the
        # copies of the programs before it.
        carry = ends - per_expert
        for p0 in range(0, programs, BLOCK_P):
            p = p0 + prows
            at = p[:, None] * BLOCK_E + cols[None, :]
            chunk = tl.load(part_counts + at, mask=(p < programs)[:, None], other=0)
            tl.store(part_counts + at, carry[None, :] + tl.cumsum(chunk, axis=0) - chunk, mask=(p < programs)[:, None])
            carry += tl.sum(chunk, axis=0)


@triton.jit
def _slot_scatter_kernel(ids, ranks, starts, sorted_to_token_slot, slot_to_sorted, slots, top_k, rows_per_program,
                         BLOCK_E: tl.constexpr, BLOCK: tl.constexpr):
    slot = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = slot < slots
    expert = tl.load(ids + slot, mask=ok, other=0).to(tl.int32)
    program = slot // top_k // rows_per_program
    row = tl.load(starts + program * BLOCK_E + expert, mask=ok, other=0) + tl.load(ranks + slot, mask=ok, other=0)
    tl.store(sorted_to_token_slot + row, slot, mask=ok)
    tl.store(slot_to_sorted + slot, row, mask=ok)


@triton.jit
def _route_backward_kernel(logits, ids, grad_weights, grad_losses, counts, grad_logits,
                           T, E, top_k, scale, aux_scale, z_scale, stride_t, stride_e, stride_gt, stride_gj,
                           SOFTMAX: tl.constexpr, RENORMALIZE: tl.constexpr, HAS_GRAD_WEIGHTS: tl.constexpr,
                           HAS_GRAD_LOSSES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    row_ok = rows < T
    in_row = cols < E
    rows64 = rows.to(tl.int64)
    scores, soft, lse = _scores(_load_rows(logits, rows, cols, T, E, stride_t, stride_e), cols, E, SOFTMAX)
    grad = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    if HAS_GRAD_WEIGHTS:
        # w_j = scale u_j / max(U, floor), u_j the chosen scores, U their sum:
        # dL/du_j = scale g_j / max(U, floor) - [U >= floor] scale sum_l g_l u_l / U^2.
        chosen_sum = tl.zeros((BLOCK_T,), tl.float32)
        dot = tl.zeros((BLOCK_T,), tl.float32)
        for j in range(top_k):
            pick = tl.load(ids + rows64 * top_k + j, mask=row_ok, other=0)
            g = tl.load(grad_weights + rows64 * stride_gt + j * stride_gj, mask=row_ok, other=0.0)
            u = tl.sum(tl.where(cols[None, :] == pick[:, None], scores, 0.0), axis=1)
            chosen_sum += u
            dot += g * u
        if RENORMALIZE:
            divisor = tl.maximum(chosen_sum, 1e-20)
            per_g = scale / divisor
            shift = tl.where(chosen_sum >= 1e-20, scale * dot / (divisor * divisor), 0.0)
        else:
            per_g = tl.full((BLOCK_T,), 1.0, tl.float32) * scale
            shift = tl.zeros((BLOCK_T,), tl.float32)
        for j in range(top_k):
            pick = tl.load(ids + rows64 * top_k + j, mask=row_ok, other=0)
            g = tl.load(grad_weights + rows64 * stride_gt + j * stride_gj, mask=row_ok, other=0.0)
            grad += tl.where(cols[None, :] == pick[:, None], (per_g * g - shift)[:, None], 0.0)
    if HAS_GRAD_LOSSES:
        # aux = aux_scale sum_e counts_e sum_t p_te, with p the scores normalized per row.
        per_expert = tl.load(grad_losses) * aux_scale * tl.load(counts + cols, mask=in_row, other=0).to(tl.float32)
        if SOFTMAX:
            grad += per_expert[None, :]
        else:
            row_sum = tl.sum(scores, axis=1)
            probs = scores / row_sum[:, None]
            grad += (per_expert[None, :] - tl.sum(per_expert[None, :] * probs, axis=1)[:, None]) / row_sum[:, None]
    if SOFTMAX:
        out = scores * (grad - tl.sum(grad * scores, axis=1)[:, None])
    else:
        out = grad * scores * (1.0 - scores)
    if HAS_GRAD_LOSSES:
        # z = z_scale sum_t lse_t^2: dz / dl = 2 z_scale lse_t softmax_t.
        out += (2.0 * z_scale * tl.load(grad_losses + 1)) * lse[:, None] * soft
    tl.store(grad_logits + rows64[:, None] * E + cols[None, :], out, mask=row_ok[:, None] & in_row[None, :])


_ROUTE = DirectLaunch(_route_kernel)
_ROUTE_SUMS = DirectLaunch(_route_sums_kernel)
_SLOT_SCATTER = DirectLaunch(_slot_scatter_kernel)
_ROUTE_BACKWARD = DirectLaunch(_route_backward_kernel)


def _block_rows(E: int, T: int) -> tuple[int, int]:
    """``(rows a program routes, E padded)``: a tile of at most ``_BLOCK_ELEMENTS`` logits, and at least
    ``_MIN_PROGRAMS`` programs where T allows (E = 8 would otherwise give 512 rows a program: 16 programs
    for 8,192 tokens)."""
    block_e = max(next_power_of_2(E), 2)
    return max(min(_BLOCK_ELEMENTS // block_e, next_power_of_2(cdiv(T, _MIN_PROGRAMS))), 1), block_e


def _loss_scales(T: int, E: int, top_k: int) -> tuple[float, float]:
    """aux = aux_scale sum_e counts_e sum_t p_te (``E * sum_e f_e mean_t p_te`` with ``f_e = counts_e / (T k)``),
    z = z_scale sum_t lse_t^2 (the mean over the tokens)."""
    return E / (max(T * top_k, 1) * T), 1.0 / T


def route_forward(logits: torch.Tensor, top_k: int, softmax: bool, renormalize: bool, scale: float,
                  bias: torch.Tensor | None, n_groups: int, topk_groups: int, sort: bool = False
                  ) -> tuple[torch.Tensor, ...]:
    """``(weights fp32 [T, k], ids int64 [T, k], counts int32 [E], losses fp32 [2])`` of fp32 ``logits [T, E]``
    (any strides; ``T >= 1``, ``1 <= k <= E <= MAX_E``, checked by the caller), and with ``sort`` the copies
    sorted by expert: ``sorted_to_token_slot``, ``slot_to_sorted`` (its inverse) int32 ``[T k]`` and the
    offsets int32 ``[E]`` (cumulative counts), the slots ``t k + j`` of an expert in token order, as a stable
    sort of the ids gives them. bias: fp32 ``[E]`` contiguous or None. n_groups: 0 for no group limit, else E's
    equal groups, of which each row keeps ``topk_groups``. losses: the auxiliary loss and the z loss,
    unscaled."""
    launch_info(logits.device)
    T, E = logits.shape
    device = logits.device
    block_t, block_e = _block_rows(E, T)
    programs = cdiv(T, block_t)
    ids = torch.empty(T, top_k, dtype=torch.int64, device=device)
    weights = torch.empty(T, top_k, dtype=torch.float32, device=device)
    ranks = torch.empty(T, top_k, dtype=torch.int32, device=device) if sort else ids
    part_counts = torch.empty(programs, block_e, dtype=torch.int32, device=device)
    part_probs = torch.empty(programs, block_e, dtype=torch.float32, device=device)
    part_z = torch.empty(programs, dtype=torch.float32, device=device)
    _ROUTE(
        (programs,), logits=logits, bias=logits if bias is None else bias, ids=ids, weights=weights, ranks=ranks,
        part_counts=part_counts, part_probs=part_probs, part_z=part_z, T=T, E=E, top_k=top_k,
        n_groups=max(n_groups, 1), topk_groups=topk_groups, group_size=E // max(n_groups, 1), scale=scale,
        stride_t=logits.stride(0), stride_e=logits.stride(1),
        SOFTMAX=softmax, RENORMALIZE=renormalize, HAS_BIAS=bias is not None, GROUPED=n_groups > 0, SORT=sort,
        BLOCK_T=block_t, BLOCK_E=block_e, G_POW2=max(next_power_of_2(n_groups), 2), num_warps=_NUM_WARPS,
    )
    counts = torch.empty(E, dtype=torch.int32, device=device)
    losses = torch.empty(2, dtype=torch.float32, device=device)
    offsets = torch.empty(E, dtype=torch.int32, device=device) if sort else counts
    aux_scale, z_scale = _loss_scales(T, E, top_k)
    _ROUTE_SUMS((1,), part_counts=part_counts, part_probs=part_probs, part_z=part_z, counts=counts, losses=losses,
                offsets=offsets, programs=programs, E=E, aux_scale=aux_scale, z_scale=z_scale, SORT=sort,
                BLOCK_P=max(_BLOCK_ELEMENTS // block_e, 1), BLOCK_E=block_e, num_warps=_NUM_WARPS)
    if not sort:
        return weights, ids, counts, losses
    sorted_to_token_slot = torch.empty(T * top_k, dtype=torch.int32, device=device)
    slot_to_sorted = torch.empty(T * top_k, dtype=torch.int32, device=device)
    _SLOT_SCATTER(
        (cdiv(T * top_k, _SCATTER_BLOCK),), ids=ids, ranks=ranks, starts=part_counts,
        sorted_to_token_slot=sorted_to_token_slot, slot_to_sorted=slot_to_sorted, slots=T * top_k, top_k=top_k,
        rows_per_program=block_t, BLOCK_E=block_e, BLOCK=_SCATTER_BLOCK, num_warps=_NUM_WARPS,
    )
    return weights, ids, counts, losses, sorted_to_token_slot, slot_to_sorted, offsets


def route_backward(logits: torch.Tensor, ids: torch.Tensor, counts: torch.Tensor, grad_weights: torch.Tensor | None,
                   grad_losses: torch.Tensor | None, softmax: bool, renormalize: bool, scale: float) -> torch.Tensor:
    """fp32 ``[T, E]``: the gradient of the logits from that of the weights ``[T, k]`` (any strides) and of
    the losses ``[2]`` (contiguous), either None for none; the other arguments as ``route_forward``'s and
    its outputs."""
    launch_info(logits.device)
    T, E = logits.shape
    top_k = ids.shape[1]
    grad_logits = torch.empty(T, E, dtype=torch.float32, device=logits.device)
    block_t, block_e = _block_rows(E, T)
    aux_scale, z_scale = _loss_scales(T, E, top_k)
    gw = grad_weights if grad_weights is not None else logits
    _ROUTE_BACKWARD(
        (cdiv(T, block_t),), logits=logits, ids=ids, grad_weights=gw,
        grad_losses=logits if grad_losses is None else grad_losses, counts=counts, grad_logits=grad_logits,
        T=T, E=E, top_k=top_k, scale=scale, aux_scale=aux_scale, z_scale=z_scale, stride_t=logits.stride(0),
        stride_e=logits.stride(1), stride_gt=gw.stride(0), stride_gj=gw.stride(1),
        SOFTMAX=softmax, RENORMALIZE=renormalize, HAS_GRAD_WEIGHTS=grad_weights is not None,
        HAS_GRAD_LOSSES=grad_losses is not None, BLOCK_T=block_t, BLOCK_E=block_e, num_warps=_NUM_WARPS,
    )
    return grad_logits
