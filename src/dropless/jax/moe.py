"""MoE: the dropless Mixture-of-Experts layer as a Flax NNX module, the same layer as ``dropless.MoE``.

router (fp32) -> permute -> gate/up grouped GEMM -> gated activation -> down grouped GEMM -> unpermute
[+ shared experts], every step on the device (no host sync), the grouped GEMMs on the dropless kernels
(``dropless.jax.grouped_mm``). Parameters use the PyTorch layer's names and layouts, so
``MoE.from_torch`` and ``to_torch`` move weights between the two without reshaping.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dropless.jax.experts import ACTIVATIONS, gated_experts, glu, permute, unpermute
from dropless.jax.routing import check_routing, route


class ExpertBias(nnx.Variable):
    """The router's expert bias and load counts (DeepSeek-V3's auxiliary-loss-free balancing): state
    moved by ``update_expert_bias``, not by gradients."""


class MoEStats(nnx.Variable):
    """What the last forward measured: losses and token counts (read them after the call)."""


def _uniform(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, dtype) -> nnx.Param:
    bound = 1.0 / math.sqrt(fan_in)
    return nnx.Param(jax.random.uniform(rngs.params(), shape, dtype, -bound, bound))


class MoE(nnx.Module):
    """A dropless MoE layer: every token goes to its ``top_k`` experts, no capacity, no dropping.

    Args: as ``dropless.MoE``'s (``d_model``, ``d_ff``, ``num_experts``, ``top_k``, ``score_func``,
    ``renormalize``, ``n_groups``, ``topk_groups``, ``routed_scaling``, ``expert_bias``,
    ``bias_update_rate``, ``aux_loss_coef``, ``z_loss_coef``, ``num_shared_experts``, ``shared_d_ff``,
    ``bias``, ``activation``), with ``param_dtype`` (the parameters' dtype; the experts compute in the
    input's dtype, the router in fp32) and ``rngs`` (``nnx.Rngs``, for the initial weights).

    Parameters (``nnx.Param``): ``router_weight [E, d]``, ``experts_gate_up [E, 2*d_ff, d]`` (gate rows,
    then up rows), ``experts_down [E, d, d_ff]``, with ``bias``: ``experts_gate_up_bias [E, 2*d_ff]``
    and ``experts_down_bias [E, d]``; with shared experts: ``shared_gate_up [S, d]`` and ``shared_down
    [d, S/2]`` (``S = 2 * num_shared_experts * shared_d_ff``). With ``expert_bias``: ``expert_bias
    [E]`` and ``load_since_update [E]`` (``ExpertBias`` state).

    After each call (``MoEStats`` state, read with ``.get_value()``): ``aux_loss`` (``aux_loss_coef * load-balancing
    loss + z_loss_coef * z loss``, to add to the training loss inside the differentiated function),
    ``load_balancing_loss``, ``z_loss`` and ``tokens_per_expert``.
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int, *, score_func: str = "softmax",
                 renormalize: bool = True, n_groups: int | None = None, topk_groups: int | None = None,
                 routed_scaling: float = 1.0, expert_bias: bool = False, bias_update_rate: float = 1e-3,
                 aux_loss_coef: float = 1e-2, z_loss_coef: float = 0.0, num_shared_experts: int = 0,
                 shared_d_ff: int | None = None, bias: bool = False, activation: str = "swiglu",
                 param_dtype: Any = jnp.float32, rngs: nnx.Rngs) -> None:
        check_routing(num_experts, top_k, score_func, n_groups, topk_groups)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
        self.options = dict(d_model=d_model, d_ff=d_ff, num_experts=num_experts, top_k=top_k,
                            score_func=score_func, renormalize=renormalize, n_groups=n_groups,
                            topk_groups=topk_groups, routed_scaling=routed_scaling, expert_bias=expert_bias,
                            bias_update_rate=bias_update_rate, aux_loss_coef=aux_loss_coef,
                            z_loss_coef=z_loss_coef, num_shared_experts=num_shared_experts,
                            shared_d_ff=shared_d_ff, bias=bias, activation=activation)
        self.d_model, self.num_experts, self.top_k, self.activation = d_model, num_experts, top_k, activation
        self.deterministic = False  # set by .eval(): no load counting for the expert bias
        E = num_experts
        self.router_weight = _uniform(rngs, (E, d_model), d_model, param_dtype)
        self.experts_gate_up = _uniform(rngs, (E, 2 * d_ff, d_model), d_model, param_dtype)
        self.experts_down = _uniform(rngs, (E, d_model, d_ff), d_ff, param_dtype)
        self.experts_gate_up_bias = _uniform(rngs, (E, 2 * d_ff), d_model, param_dtype) if bias else None
        self.experts_down_bias = _uniform(rngs, (E, d_model), d_ff, param_dtype) if bias else None
        shared = num_shared_experts * (shared_d_ff or d_ff)
        self.shared_gate_up = _uniform(rngs, (2 * shared, d_model), d_model, param_dtype) if shared else None
        self.shared_down = _uniform(rngs, (d_model, shared), shared, param_dtype) if shared else None
        self.expert_bias = ExpertBias(jnp.zeros(E, jnp.float32)) if expert_bias else None
        self.load_since_update = ExpertBias(jnp.zeros(E, jnp.int32)) if expert_bias else None
        self.aux_loss = MoEStats(jnp.zeros((), jnp.float32))
        self.load_balancing_loss = MoEStats(jnp.zeros((), jnp.float32))
        self.z_loss = MoEStats(jnp.zeros((), jnp.float32))
        self.tokens_per_expert = MoEStats(jnp.zeros(E, jnp.int32))

    def __call__(self, x: jax.Array) -> jax.Array:
        """``x [..., d_model] -> [..., d_model]`` in x's dtype."""
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape [..., d_model={self.d_model}], got {tuple(x.shape)}")
        tokens = x.reshape(-1, self.d_model)
        options = self.options
        router_weight = self.router_weight.get_value()
        compute = jnp.float64 if jnp.float64 in (tokens.dtype, router_weight.dtype) else jnp.float32
        logits = tokens.astype(compute) @ router_weight.astype(compute).T
        routing = route(logits, self.top_k, score_func=options["score_func"], renormalize=options["renormalize"],
                        n_groups=options["n_groups"], topk_groups=options["topk_groups"],
                        expert_bias=self.expert_bias.get_value() if self.expert_bias is not None else None,
                        scale=options["routed_scaling"])
        rows, order, group_sizes = permute(tokens, routing.expert_ids, self.num_experts)
        y = unpermute(self._experts(rows, group_sizes), order, routing.weights)
        if self.shared_gate_up is not None:
            h = tokens @ self.shared_gate_up.get_value().astype(tokens.dtype).T
            y = y + glu(h, self.activation) @ self.shared_down.get_value().astype(tokens.dtype).T
        if self.load_since_update is not None and not self.deterministic:
            self.load_since_update.set_value(self.load_since_update.get_value() + routing.tokens_per_expert)
        self.load_balancing_loss.set_value(routing.aux_loss.astype(jnp.float32))
        self.z_loss.set_value(routing.z_loss.astype(jnp.float32))
        self.aux_loss.set_value((options["aux_loss_coef"] * routing.aux_loss
                               + options["z_loss_coef"] * routing.z_loss).astype(jnp.float32))
        self.tokens_per_expert.set_value(routing.tokens_per_expert)
        return y.reshape(x.shape)

    def _experts(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """The gated experts on ``rows [R, d]`` sorted by expert, in rows' dtype."""
        def cast(p):
            return p.get_value().astype(rows.dtype) if p is not None else None
        return gated_experts(rows, group_sizes, cast(self.experts_gate_up), cast(self.experts_down),
                             self.activation, cast(self.experts_gate_up_bias), cast(self.experts_down_bias))

    def update_expert_bias(self) -> None:
        """Move the expert bias toward balance by ``bias_update_rate`` (the sign rule of DeepSeek-V3)
        from the loads counted since the last update, then reset the counts. Call once per step."""
        if self.expert_bias is None:
            raise RuntimeError("update_expert_bias needs a layer built with expert_bias=True")
        load = self.load_since_update.get_value().astype(jnp.float32)
        step = self.options["bias_update_rate"] * jnp.sign(load.mean() - load)
        self.expert_bias.set_value(self.expert_bias.get_value() + step)
        self.load_since_update.set_value(jnp.zeros_like(self.load_since_update.get_value()))

    @classmethod
    def from_torch(cls, moe: Any, *, param_dtype: Any = None) -> MoE:
        """The layer with a ``dropless.MoE``'s options and weights (copied to the default JAX device;
        ``param_dtype`` defaults to the PyTorch weights' dtype)."""
        from dropless.jax.convert import moe_from_torch

        return moe_from_torch(cls, moe, param_dtype)

    def to_torch(self, device: Any = "cpu", dtype: Any = None) -> Any:
        """A ``dropless.MoE`` with this layer's options and weights (on ``device``; ``dtype`` defaults to
        the parameters' dtype)."""
        from dropless.jax.convert import moe_to_torch

        return moe_to_torch(self, device, dtype)
