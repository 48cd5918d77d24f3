"""TopKRouter: the gate of an MoE layer, with the aux-loss-free expert bias of DeepSeek-V3."""

from __future__ import annotations

import torch
from torch import nn

from dropless.ops.router_logits import router_logits
from dropless.ops.routing import SCORE_FUNCS, Routing, route


class TopKRouter(nn.Module):
    """Scores each token against ``num_experts`` experts (a linear gate, computed in fp32) and picks
    ``top_k`` of them. See ``dropless.ops.routing.route`` for the options.

    With ``expert_bias=True`` a bias ``[E]`` (a buffer, not trained by gradients) is added to the
    scores for the choice only. ``update_expert_bias()`` moves it by ``bias_update_rate`` toward
    balance, from the token counts of the forwards since the last update, all on the device (call it
    once per optimizer step).

    Attributes after a forward: ``tokens_per_expert`` (int32 ``[E]`` device tensor, that forward's
    token copies per expert).
    """

    def __init__(self, d_model: int, num_experts: int, top_k: int, *, score_func: str = "softmax",
                 renormalize: bool = True, n_groups: int | None = None, topk_groups: int | None = None,
                 expert_bias: bool = False, bias_update_rate: float = 1e-3, scale: float = 1.0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if d_model < 1:
            raise ValueError(f"d_model must be at least 1, got {d_model}")
        if num_experts < 1:
            raise ValueError(f"num_experts must be at least 1, got {num_experts}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if score_func not in SCORE_FUNCS:
            raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.renormalize = renormalize
        self.n_groups = n_groups
        self.topk_groups = topk_groups
        self.bias_update_rate = bias_update_rate
        self.scale = scale
        self.weight = nn.Parameter(torch.empty(num_experts, d_model, device=device, dtype=dtype))
        nn.init.uniform_(self.weight, -1.0 / d_model**0.5, 1.0 / d_model**0.5)
        if expert_bias:
            self.register_buffer("expert_bias", torch.zeros(num_experts, device=device, dtype=torch.float32))
            self.register_buffer("load_since_update", torch.zeros(num_experts, device=device, dtype=torch.int64))
        else:
            self.expert_bias = None
        self.tokens_per_expert: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, sort: bool = False) -> Routing:
        """Route ``x [T, d_model]``; returns weights ``[T, k]`` (fp32), expert ids ``[T, k]``, the
        per-expert counts and the unscaled auxiliary and z losses; with ``sort``, also the copies sorted
        by expert (``route``'s ``sort``)."""
        logits = router_logits(x, self.weight)
        routing = route(logits, self.top_k, score_func=self.score_func, renormalize=self.renormalize,
                        n_groups=self.n_groups, topk_groups=self.topk_groups,
                        expert_bias=self.expert_bias, scale=self.scale, sort=sort)
        self.tokens_per_expert = routing.tokens_per_expert
        if self.expert_bias is not None and self.training:
            self.load_since_update += routing.tokens_per_expert
        return routing

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """Raise the bias of under-loaded experts and lower that of over-loaded ones by the update
        rate (the sign rule of DeepSeek-V3), then reset the load count. No host sync."""
        if self.expert_bias is None:
            raise RuntimeError("update_expert_bias needs a router built with expert_bias=True")
        load = self.load_since_update.float()
        self.expert_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.load_since_update.zero_()

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, top_k={self.top_k}, score_func={self.score_func}, "
                f"n_groups={self.n_groups}, topk_groups={self.topk_groups}, "
                f"expert_bias={self.expert_bias is not None}")
