"""Weights between ``dropless.MoE`` (PyTorch) and ``dropless.jax.MoE`` (Flax NNX): the same options, the
same parameter layouts, values copied through host memory."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from flax import nnx

_TO_JAX = {torch.float32: jnp.float32, torch.bfloat16: jnp.bfloat16, torch.float16: jnp.float16,
           torch.float64: jnp.float64}
_TO_TORCH = {np.dtype(v): k for k, v in _TO_JAX.items()}

# JAX parameter name -> (PyTorch submodule path, tensor name)
_NAMES = {
    "router_weight": ("router", "weight"),
    "expert_bias": ("router", "expert_bias"),
    "load_since_update": ("router", "load_since_update"),
    "experts_gate_up": ("experts_gate_up", "weight"),
    "experts_gate_up_bias": ("experts_gate_up", "bias"),
    "experts_down": ("experts_down", "weight"),
    "experts_down_bias": ("experts_down", "bias"),
    "shared_gate_up": ("shared_experts.gate_up", "weight"),
    "shared_down": ("shared_experts.down", "weight"),
}
_JAX_OPTIONS = ("d_model", "d_ff", "num_experts", "top_k", "score_func", "renormalize", "n_groups", "topk_groups",
                "routed_scaling", "expert_bias", "bias_update_rate", "aux_loss_coef", "z_loss_coef",
                "num_shared_experts", "shared_d_ff", "bias", "activation", "recompute_activation")


def _to_jax(t: torch.Tensor, dtype: Any) -> jnp.ndarray:
    t = t.detach().cpu()  # sync-ok: weight conversion between frameworks, once, off the training step
    # A copy: on the CPU jnp.asarray may alias the numpy buffer, which in-place updates of the PyTorch
    # tensor would then change under JAX.
    exact = t.dtype in (torch.float32, torch.float64, torch.int32, torch.int64)
    host = t.numpy().copy() if exact else t.float().numpy()
    return jnp.asarray(host, dtype)


def _placed_as(value: jnp.ndarray, initial: jnp.ndarray) -> jnp.ndarray:
    """``value`` placed as ``initial`` is: with its sharding where that was given (an expert-parallel
    layer's), else left to the default device uncommitted. (A jitted step whose arguments mix committed
    and uncommitted arrays compiles again at its second call, when they all come back committed.)"""
    return jax.device_put(value, initial.sharding) if initial.committed else value


def _to_torch(a: jnp.ndarray, device: Any, dtype: torch.dtype | None) -> torch.Tensor:
    host = np.asarray(a.astype(jnp.float32) if a.dtype in (jnp.bfloat16, jnp.float16) else a)
    t = torch.from_numpy(host.copy()).to(device)
    return t.to(dtype) if dtype is not None else t.to(_TO_TORCH.get(np.dtype(a.dtype), t.dtype))


def moe_from_torch(cls: type, moe: Any, param_dtype: Any, ep_axis: str | None) -> Any:
    """``cls`` (``dropless.jax.MoE``) built from a ``dropless.MoE``'s options (and ``ep_axis``), its weights
    copied into the places of the new layer's own (sharded along E for an expert-parallel layer)."""
    options = moe.options
    if moe.ep_group is not None:
        raise ValueError("from_torch takes the whole layer, not an expert-parallel one (ep_group is set)")
    if options.get("recipe") is not None:
        raise ValueError(f"dropless.jax.MoE has no FP8 recipes; the layer's recipe is {options['recipe']!r}")
    weight = moe.router.weight
    dtype = param_dtype or _TO_JAX[weight.dtype]
    layer = cls(**{name: options[name] for name in _JAX_OPTIONS}, param_dtype=dtype, ep_axis=ep_axis,
                rngs=nnx.Rngs(0))
    modules = dict(moe.named_modules())
    for name, (path, tensor) in _NAMES.items():
        variable = getattr(layer, name)
        if variable is None:
            continue
        initial = variable.get_value()
        variable.set_value(_placed_as(_to_jax(getattr(modules[path], tensor), initial.dtype), initial))
    return layer


def moe_to_torch(layer: Any, device: Any, dtype: torch.dtype | None) -> Any:
    """A ``dropless.MoE`` with ``layer``'s options, its weights copied (the expert bias state too)."""
    from dropless.nn.moe import MoE

    dtype = dtype or _TO_TORCH[np.dtype(layer.router_weight.get_value().dtype)]
    moe = MoE(**layer.options, device=device, dtype=dtype)
    modules = dict(moe.named_modules())
    with torch.no_grad():
        for name, (path, tensor) in _NAMES.items():
            variable = getattr(layer, name)
            if variable is None:
                continue
            target = getattr(modules[path], tensor)
            target.copy_(_to_torch(variable.get_value(), device, None).to(target.dtype))
    return moe


def language_model_from_torch(cls: type, model: Any, dtype: Any, attention: str | None, param_dtype: Any) -> Any:
    """``cls`` (``dropless.jax.language_model.MoELanguageModel``) built from a PyTorch ``MoELanguageModel``'s
    config, computing in ``dtype``, every parameter copied (the MoE layers through ``moe_from_torch``).
    ValueError if the PyTorch model holds a parameter the JAX one has no place for."""
    from dropless.jax.moe import MoE

    params = dict(model.named_parameters())
    param_dtype = param_dtype or _TO_JAX[model.embedding.weight.dtype]
    lm = cls(model.config, dtype=dtype, attention=attention, param_dtype=param_dtype, rngs=nnx.Rngs(0))
    places = {"embedding.weight": lm.embedding, "norm.weight": lm.norm.weight, "lm_head.weight": lm.lm_head}
    for i, (block, source) in enumerate(zip(lm.blocks, model.blocks)):
        places |= {f"blocks.{i}.attention_norm.weight": block.attention_norm.weight,
                   f"blocks.{i}.attention.qkv.weight": block.attention.qkv,
                   f"blocks.{i}.attention.out.weight": block.attention.out,
                   f"blocks.{i}.moe_norm.weight": block.moe_norm.weight}
        block.moe = moe_from_torch(MoE, source.moe, param_dtype, None)
        places |= {f"blocks.{i}.moe.{name}": None for name, _ in source.moe.named_parameters()}
    unplaced = sorted(set(params) - set(places))
    if unplaced:
        raise ValueError(f"the JAX language model has no place for the PyTorch parameters {unplaced}")
    for name, variable in places.items():
        if variable is not None:
            initial = variable.get_value()
            variable.set_value(_placed_as(_to_jax(params[name], initial.dtype), initial))
    return lm
