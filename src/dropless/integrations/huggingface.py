"""Hugging Face transformers: dropless as an experts implementation.

transformers (>= 5) runs every MoE block's experts through a registry of functions with the signature
``fn(experts, hidden_states [T, d], top_k_index [T, k], top_k_weights [T, k]) -> [T, d]``.
``register_transformers()`` adds ``"dropless"`` to it, so that

    AutoModelForCausalLM.from_pretrained(..., experts_implementation="dropless")

runs the experts of Mixtral, Qwen3-MoE, DeepSeek-V3, gpt-oss and the rest on dropless: the sync-free
permute, grouped GEMMs for the (fused) up and down projections, the gated activation and unpermute.
Expert ids ``>= num_experts`` (the expert-parallel sentinel) contribute nothing.
"""

from __future__ import annotations

import torch

from dropless.ops.activation import swiglu
from dropless.ops.group_bias import add_group_bias
from dropless.ops.grouped_mm import grouped_mm
from dropless.ops.permute import permute, unpermute

IMPLEMENTATION = "dropless"


def register_transformers() -> None:
    """Register ``experts_implementation="dropless"`` with transformers (imports transformers)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(IMPLEMENTATION, experts_forward)


def experts_forward(experts: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """A transformers experts module's forward on dropless kernels.

    Args:
        experts: a module made by transformers' ``use_experts_implementation`` (attributes
            ``num_experts``, ``gate_up_proj`` or ``up_proj``, ``down_proj``, their ``_bias`` when
            ``has_bias``, ``is_transposed``, ``has_gate``, ``act_fn``, ``_apply_gate``).
        hidden_states: ``[T, d]``; top_k_index: int ``[T, k]``; top_k_weights: ``[T, k]``.
    Returns:
        ``[T, d]`` in hidden_states' dtype.
    """
    x_sorted, sorted_to_token_slot, _, offsets = permute(hidden_states, top_k_index, experts.num_experts)
    up_name = "gate_up_proj" if experts.has_gate else "up_proj"
    h = _project(experts, up_name, x_sorted, offsets)
    h = _gate(experts, h) if experts.has_gate else experts.act_fn(h)
    out = _project(experts, "down_proj", h, offsets)
    if getattr(experts, "has_post_expert_norm", False):  # absent in older transformers 5.x
        out = experts.post_expert_norm(out)
    return unpermute(out, sorted_to_token_slot, top_k_weights, offsets).to(hidden_states.dtype)


def _project(experts: torch.nn.Module, name: str, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """One grouped projection: weights ``[E, out, in]`` (or ``[E, in, out]`` when transposed)."""
    weight = getattr(experts, name)
    y = grouped_mm(x, weight if experts.is_transposed else weight.transpose(1, 2), offsets)
    if experts.has_bias:
        y = add_group_bias(y, getattr(experts, f"{name}_bias"), offsets)
    return y


def _gate(experts: torch.nn.Module, h: torch.Tensor) -> torch.Tensor:
    """The model's gating; the default one with SiLU (concatenated [gate | up]) runs the fused kernel."""
    from transformers.integrations.moe import _default_apply_gate

    default_gate = getattr(type(experts)._apply_gate, "__func__", type(experts)._apply_gate) is _default_apply_gate
    if default_gate and type(experts.act_fn).__name__ in ("SiLU", "SiLUActivation"):
        return swiglu(h, grad_in_place=True)  # h: the gate/up projection's own output, read by nothing else
    return experts._apply_gate(h)
