"""Top-k routing of tokens to experts, in fp32, with no host sync.

Everything here is a device-side tensor computation: scores, the (optionally group-limited) top-k
selection, the renormalized weights, the auxiliary losses and the per-expert token counts. On the Triton
backend fp32 logits of at most ``MAX_E`` experts take two kernels forward and one backward
(``kernels/route.py``: the custom ops ``dropless::route`` and ``dropless::route_backward``); otherwise
(the reference backend, fp64, wider rows) the same math runs as PyTorch ops, the counts by a scatter-add
(the bincount op would sync with the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dropless.backend import use_triton
from dropless.kernels.route import MAX_E, route_backward, route_forward
from dropless.ops.direct import DirectOp
from dropless.ops.permute import keep_inverse, sort_by_expert

SCORE_FUNCS = ("softmax", "sigmoid")


@dataclass
class Routing:
    """The result of routing ``T`` tokens to ``k`` of ``E`` experts.

    weights: fp32 ``[T, k]`` the combine weight of each chosen expert.
    expert_ids: int64 ``[T, k]`` the chosen experts, best first.
    tokens_per_expert: int32 ``[E]`` token copies sent to each expert.
    aux_loss: fp32 scalar, the load-balancing loss (Switch/GShard form): ``E * sum_e f_e * P_e`` with
        ``f_e`` the fraction of the ``T*k`` token copies sent to e and ``P_e`` the mean normalized
        score of e; 1.0 at perfect balance. Unscaled by any coefficient.
    z_loss: fp32 scalar, ``mean_t logsumexp(logits_t)^2``. Unscaled.
    sorted_to_token_slot, offsets: with ``route(..., sort=True)``, the ``T*k`` copies sorted by expert
        (``permute``'s int32 ``sorted_to_token_slot``: the slot ``t*k + j`` of each sorted row, an expert's
        in token order) and the int32 ``[E]`` cumulative counts; else None.
    """

    weights: torch.Tensor
    expert_ids: torch.Tensor
    tokens_per_expert: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    sorted_to_token_slot: torch.Tensor | None = None
    offsets: torch.Tensor | None = None


def route(logits: torch.Tensor, top_k: int, *, score_func: str = "softmax", renormalize: bool = True,
          n_groups: int | None = None, topk_groups: int | None = None,
          expert_bias: torch.Tensor | None = None, scale: float = 1.0, sort: bool = False) -> Routing:
    """Choose ``top_k`` experts per token from router ``logits [T, E]``.

    Args:
        logits: ``[T, E]`` router outputs (any float dtype; the math runs in fp32, fp64 for fp64).
        top_k: experts per token, ``1 <= top_k <= E``.
        score_func: ``"softmax"`` (Mixtral, Qwen3-MoE) or ``"sigmoid"`` (DeepSeek-V3).
        renormalize: divide the k chosen scores by their sum.
        n_groups, topk_groups: group-limited routing (DeepSeek): experts form ``n_groups`` equal
            groups; each token picks among the experts of its best ``topk_groups`` groups, a group
            scored by its best expert (softmax) or the sum of its two best (sigmoid).
        expert_bias: fp32 ``[E]`` added to the scores for the choice only, not to the weights
            (the auxiliary-loss-free balancing of DeepSeek-V3).
        scale: multiplies the final weights (DeepSeek-V3's routed scaling factor).
        sort: also sort the copies by expert (``Routing.sorted_to_token_slot`` and ``offsets``, as
            ``permute`` sorts them): on the Triton backend a counting sort in the routing's kernels and one
            more launch, instead of a sort of the ids.
    """
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    if logits.dim() != 2:
        raise ValueError(f"logits must have shape [T, E], got {tuple(logits.shape)}")
    T, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, E={E}], got {top_k}")
    if n_groups is not None:
        _check_groups(E, n_groups, topk_groups, top_k)
    if expert_bias is not None and (tuple(expert_bias.shape) != (E,) or expert_bias.device != logits.device):
        raise ValueError(f"expert_bias must have shape [E={E}] on the logits' device {logits.device}, got shape "
                         f"{tuple(expert_bias.shape)} on {expert_bias.device}")
    logits = logits.double() if logits.dtype == torch.float64 else logits.float()
    if use_triton(logits.device) and logits.dtype == torch.float32 and E <= MAX_E and T > 0:
        bias = None if expert_bias is None else expert_bias.float().contiguous()
        weights, expert_ids, tokens_per_expert, losses, sorted_to_token_slot, slot_to_sorted, offsets = _ROUTE(
            logits, top_k, score_func == "softmax", renormalize, float(scale), bias, n_groups or 0, topk_groups or 0,
            sort)
        if not sort:
            return Routing(weights, expert_ids, tokens_per_expert, losses[0], losses[1])
        if not torch.compiler.is_compiling():
            keep_inverse(sorted_to_token_slot, slot_to_sorted)
        return Routing(weights, expert_ids, tokens_per_expert, losses[0], losses[1], sorted_to_token_slot, offsets)
    scores = torch.softmax(logits, dim=-1) if score_func == "softmax" else torch.sigmoid(logits)
    choice = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)
    if n_groups is not None:
        choice = _limit_to_groups(choice, n_groups, topk_groups, score_func)
    expert_ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, expert_ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    if scale != 1.0:
        weights = weights * scale

    tokens_per_expert = torch.zeros(E, dtype=torch.int32, device=logits.device)
    tokens_per_expert.scatter_add_(0, expert_ids.flatten(), torch.ones_like(expert_ids.flatten(), dtype=torch.int32))
    fraction = tokens_per_expert.float() / max(T * top_k, 1)
    probs = scores / scores.sum(dim=-1, keepdim=True) if score_func == "sigmoid" else scores
    aux_loss = E * (fraction * probs.mean(dim=0)).sum() if T > 0 else logits.new_zeros(())
    z_loss = torch.logsumexp(logits, dim=-1).square().mean() if T > 0 else logits.new_zeros(())
    if not sort:
        return Routing(weights, expert_ids, tokens_per_expert, aux_loss, z_loss)
    sorted_to_token_slot, _, offsets = sort_by_expert(expert_ids, E)
    return Routing(weights, expert_ids, tokens_per_expert, aux_loss, z_loss, sorted_to_token_slot, offsets)


def _route(logits: torch.Tensor, top_k: int, softmax: bool, renormalize: bool, scale: float,
           bias: torch.Tensor | None, n_groups: int, topk_groups: int, sort: bool
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(weights, expert_ids, tokens_per_expert, [aux_loss, z_loss], sorted_to_token_slot, slot_to_sorted,
    offsets)`` of fp32 ``logits [T, E]`` (T >= 1) on the Triton backend; ``n_groups=0``: no group limit. Without
    ``sort`` the last three are empty."""
    out = route_forward(logits, top_k, softmax, renormalize, scale, bias, n_groups, topk_groups, sort)
    if sort:
        return out
    return *out, *(logits.new_empty(0, dtype=torch.int32) for _ in range(3))  # a custom op's outputs never alias


def _route_fake(logits: torch.Tensor, top_k: int, softmax: bool, renormalize: bool, scale: float,
                bias: torch.Tensor | None, n_groups: int, topk_groups: int, sort: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor]:
    T, E = logits.shape
    copies, experts = (T * top_k, E) if sort else (0, 0)
    return (logits.new_empty(T, top_k), logits.new_empty(T, top_k, dtype=torch.int64),
            logits.new_empty(E, dtype=torch.int32), logits.new_empty(2), logits.new_empty(copies, dtype=torch.int32),
            logits.new_empty(copies, dtype=torch.int32), logits.new_empty(experts, dtype=torch.int32))


def _route_backward(logits: torch.Tensor, expert_ids: torch.Tensor, tokens_per_expert: torch.Tensor,
                    grad_weights: torch.Tensor | None, grad_losses: torch.Tensor | None, softmax: bool,
                    renormalize: bool, scale: float) -> torch.Tensor:
    """fp32 ``[T, E]``: the logits' gradient from the weights' and the losses' (None: no gradient)."""
    return route_backward(logits, expert_ids, tokens_per_expert, grad_weights,
                          None if grad_losses is None else grad_losses.contiguous(), softmax, renormalize, scale)


def _route_backward_fake(logits: torch.Tensor, expert_ids: torch.Tensor, tokens_per_expert: torch.Tensor,
                         grad_weights: torch.Tensor | None, grad_losses: torch.Tensor | None, softmax: bool,
                         renormalize: bool, scale: float) -> torch.Tensor:
    return logits.new_empty(logits.shape)


def _setup_route(ctx, inputs, output) -> None:
    logits, _, softmax, renormalize, scale, *_ = inputs
    _, expert_ids, tokens_per_expert, *_ = output
    ctx.save_for_backward(logits, expert_ids, tokens_per_expert)
    ctx.options = (softmax, renormalize, scale)


def _backward_route(ctx, grad_weights, grad_ids, grad_counts, grad_losses, *grad_sort):
    logits, expert_ids, tokens_per_expert = ctx.saved_tensors
    grad = _ROUTE_BACKWARD(logits, expert_ids, tokens_per_expert, grad_weights, grad_losses, *ctx.options)
    return grad, None, None, None, None, None, None, None, None


_ROUTE_BACKWARD = DirectOp.define("route_backward", _route_backward, _route_backward_fake)
_ROUTE = DirectOp.define("route", _route, _route_fake, backward=_backward_route, setup_context=_setup_route)


def _check_groups(E: int, n_groups: int, topk_groups: int | None, top_k: int) -> None:
    if E % n_groups != 0:
        raise ValueError(f"n_groups={n_groups} must divide the number of experts E={E}")
    if topk_groups is None or not 1 <= topk_groups <= n_groups:
        raise ValueError(f"topk_groups must be in [1, n_groups={n_groups}], got {topk_groups}")
    if topk_groups * (E // n_groups) < top_k:
        raise ValueError(f"topk_groups={topk_groups} groups of {E // n_groups} experts hold fewer than top_k={top_k}")


def _limit_to_groups(choice: torch.Tensor, n_groups: int, topk_groups: int, score_func: str) -> torch.Tensor:
    """``choice`` with the experts outside each token's best ``topk_groups`` groups set to -inf."""
    T, E = choice.shape
    per_group = E // n_groups
    grouped = choice.view(T, n_groups, per_group)
    if score_func == "sigmoid" and per_group >= 2:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.amax(dim=-1)
    best_groups = group_scores.topk(topk_groups, dim=-1).indices
    keep = torch.zeros(T, n_groups, dtype=torch.bool, device=choice.device)
    keep.scatter_(1, best_groups, True)
    return choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
