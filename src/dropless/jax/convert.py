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
                "num_shared_experts", "shared_d_ff", "bias", "activation")


def _to_jax(t: torch.Tensor, dtype: Any) -> jnp.ndarray:
    t = t.detach().cpu()
    # A copy: on the CPU jnp.asarray may alias the numpy buffer, which in-place updates of the PyTorch
    # tensor would then change under JAX.
    exact = t.dtype in (torch.float32, torch.float64, torch.int32, torch.int64)
    host = t.numpy().copy() if exact else t.float().numpy()
    return jnp.asarray(host, dtype)


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
        source = getattr(modules[path], tensor)
        initial = variable.get_value()
        variable.set_value(jax.device_put(_to_jax(source, initial.dtype), initial.sharding))
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
