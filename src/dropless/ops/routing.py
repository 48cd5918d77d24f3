"""Top-k routing of tokens to experts, in fp32, with no host sync.

Everything here is a device-side tensor computation: scores, the (optionally group-limited) top-k
selection (one Triton kernel on the Triton backend, ``kernels/topk.py``), the renormalized weights,
the auxiliary losses and the per-expert token counts (counted by a scatter-add: the bincount op would
sync with the host).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dropless.backend import use_triton
from dropless.kernels.topk import MAX_E, topk_ids

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
    """

    weights: torch.Tensor
    expert_ids: torch.Tensor
    tokens_per_expert: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor


def route(logits: torch.Tensor, top_k: int, *, score_func: str = "softmax", renormalize: bool = True,
          n_groups: int | None = None, topk_groups: int | None = None,
          expert_bias: torch.Tensor | None = None, scale: float = 1.0) -> Routing:
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
    """
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    if logits.dim() != 2:
        raise ValueError(f"logits must have shape [T, E], got {tuple(logits.shape)}")
    T, E = logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k must be in [1, E={E}], got {top_k}")
    logits = logits.double() if logits.dtype == torch.float64 else logits.float()
    scores = torch.softmax(logits, dim=-1) if score_func == "softmax" else torch.sigmoid(logits)
    choice = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)
    if n_groups is not None:
        choice = _limit_to_groups(choice, n_groups, topk_groups, score_func, top_k)
    expert_ids = _top_k_ids(choice, top_k)
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
    return Routing(weights, expert_ids, tokens_per_expert, aux_loss, z_loss)


def _top_k_ids(choice: torch.Tensor, top_k: int) -> torch.Tensor:
    """int64 ``[T, top_k]``: each row's ``top_k`` largest, largest first. fp32 rows of at most ``MAX_E``
    on the Triton backend take one kernel (ties to the lower index); others ``torch.topk``."""
    if use_triton(choice.device) and choice.dtype == torch.float32 and choice.shape[1] <= MAX_E:
        return topk_ids(choice, top_k)
    return torch.topk(choice, top_k, dim=-1).indices


def _limit_to_groups(choice: torch.Tensor, n_groups: int, topk_groups: int | None, score_func: str,
                     top_k: int) -> torch.Tensor:
    """``choice`` with the experts outside each token's best ``topk_groups`` groups set to -inf."""
    T, E = choice.shape
    if E % n_groups != 0:
        raise ValueError(f"n_groups={n_groups} must divide the number of experts E={E}")
    if topk_groups is None or not 1 <= topk_groups <= n_groups:
        raise ValueError(f"topk_groups must be in [1, n_groups={n_groups}], got {topk_groups}")
    per_group = E // n_groups
    if topk_groups * per_group < top_k:
        raise ValueError(f"topk_groups={topk_groups} groups of {per_group} experts hold fewer than top_k={top_k}")
    grouped = choice.view(T, n_groups, per_group)
    if score_func == "sigmoid" and per_group >= 2:
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
    else:
        group_scores = grouped.amax(dim=-1)
    best_groups = group_scores.topk(topk_groups, dim=-1).indices
    keep = torch.zeros(T, n_groups, dtype=torch.bool, device=choice.device)
    keep.scatter_(1, best_groups, True)
    return choice.masked_fill(~keep.repeat_interleave(per_group, dim=1), float("-inf"))
