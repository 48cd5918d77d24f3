"""MoE: the dropless Mixture-of-Experts layer as a Flax NNX module, the same layer as ``dropless.MoE``.

router (fp32) -> permute -> gate/up grouped GEMM -> gated activation -> down grouped GEMM -> unpermute
[+ shared experts], every step on the device (no host sync), the grouped GEMMs on the dropless kernels
(``dropless.jax.grouped_mm``). With ``ep_axis`` the experts are spread over a mesh axis and permute /
unpermute become ``dropless.jax.parallel.dispatch`` / ``combine`` under ``shard_map``. Parameters use the
PyTorch layer's names and layouts, so ``MoE.from_torch`` and ``to_torch`` move weights between the two
without reshaping.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, PartitionSpec

from dropless.jax.experts import ACTIVATIONS, gated_experts, glu, permute, unpermute
from dropless.jax.parallel import combine, dispatch
from dropless.jax.reference import matmul
from dropless.jax.routing import Routing, check_routing, route


class ExpertBias(nnx.Variable):
    """The router's expert bias and load counts (DeepSeek-V3's auxiliary-loss-free balancing): state
    moved by ``update_expert_bias``, not by gradients."""


class MoEStats(nnx.Variable):
    """What the last forward measured: losses and token counts (read them after the call)."""


def _uniform(rngs: nnx.Rngs, shape: tuple[int, ...], fan_in: int, dtype, ep_axis: str | None = None) -> nnx.Param:
    """Uniform in ``+-1/sqrt(fan_in)``; with ``ep_axis``, annotated as sharded over it along dim 0."""
    bound = 1.0 / math.sqrt(fan_in)
    value = jax.random.uniform(rngs.params(), shape, dtype, -bound, bound)
    if ep_axis is None:
        return nnx.Param(value)
    return nnx.Param(value, out_sharding=(ep_axis, *([None] * (len(shape) - 1))))


def _ep_mesh(ep_axis: str, num_experts: int) -> tuple[int, bool]:
    """``(size, explicit)`` of mesh axis ``ep_axis`` in the current mesh, checked: present, outside
    ``shard_map`` over it, dividing the experts, and the mesh's other axes not explicit."""
    mesh = jax.sharding.get_abstract_mesh()
    if ep_axis not in mesh.axis_names:
        raise ValueError(f"MoE(ep_axis={ep_axis!r}) is built and called under a mesh with that axis "
                         f"(`with jax.set_mesh(mesh):`); the current mesh has axes {mesh.axis_names}")
    types = dict(zip(mesh.axis_names, mesh.axis_types))
    if types[ep_axis] == AxisType.Manual:
        raise ValueError(f"MoE(ep_axis={ep_axis!r}) maps over mesh axis {ep_axis!r} itself: call it outside "
                         f"shard_map over that axis")
    others = [name for name, kind in types.items() if name != ep_axis and kind == AxisType.Explicit]
    if others:
        raise ValueError(f"MoE(ep_axis={ep_axis!r}) leaves the mesh's other axes to XLA's automatic "
                         f"partitioning; make {others} Auto (jax.make_mesh(..., axis_types=...))")
    size = mesh.shape[ep_axis]
    if num_experts % size:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the size of mesh axis "
                         f"{ep_axis!r} ({size})")
    return size, types[ep_axis] == AxisType.Explicit


class MoE(nnx.Module):
    """A dropless MoE layer: every token goes to its ``top_k`` experts, no capacity, no dropping.

    Args: as ``dropless.MoE``'s (``d_model``, ``d_ff``, ``num_experts``, ``top_k``, ``score_func``,
    ``renormalize``, ``n_groups``, ``topk_groups``, ``routed_scaling``, ``expert_bias``,
    ``bias_update_rate``, ``aux_loss_coef``, ``z_loss_coef``, ``num_shared_experts``, ``shared_d_ff``,
    ``bias``, ``activation``, ``recompute_activation``), with ``param_dtype`` (the parameters' dtype;
    the experts compute in the input's dtype, the router in fp32) and ``rngs`` (``nnx.Rngs``, for the
    initial weights).

    Expert parallelism: ``ep_axis`` names a mesh axis of P devices (P must divide E) over which the
    experts are spread, device r running experts ``r*E/P .. (r+1)*E/P - 1``. Build and call the layer
    under the mesh::

        mesh = jax.make_mesh((P,), ("expert",))
        with jax.set_mesh(mesh):
            layer = MoE(d, d_ff, E, k, ep_axis="expert", rngs=nnx.Rngs(0))
            y = nnx.jit(lambda layer, x: layer(x))(layer, x)

    The parameters stay full-size (``[E, ...]``, the names and layouts below, so ``from_torch`` /
    ``to_torch`` and checkpoints are those of the single-device layer); the expert ones carry the
    annotation ``out_sharding=(ep_axis, None, ...)``, so Flax creates them sharded along E (each device
    holds its E/P experts) and ``nnx.get_partition_spec`` gives their layout. The router, the losses and
    the shared experts run outside ``shard_map`` on all the tokens (their weights replicated, the losses
    those of the single-device layer); the routed experts run under ``shard_map`` over ``ep_axis``: the
    tokens (T of them, a multiple of P) and their routing are split over the axis, and each device's
    token copies go to their experts' devices with ``dropless.jax.parallel.dispatch`` and come back with
    ``combine`` (each device receives into a buffer of ``P * T/P * k`` rows, room for every copy: the
    layer stays dropless). Outputs, losses and gradients equal the single-device layer's. ``ep_axis``
    may be an Explicit or an Auto axis; other axes of the mesh must be Auto (XLA partitions them).

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
                 recompute_activation: bool = False, param_dtype: Any = jnp.float32, ep_axis: str | None = None,
                 rngs: nnx.Rngs) -> None:
        check_routing(num_experts, top_k, score_func, n_groups, topk_groups)
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
        if ep_axis is not None:
            _ep_mesh(ep_axis, num_experts)
        self.options = dict(d_model=d_model, d_ff=d_ff, num_experts=num_experts, top_k=top_k,
                            score_func=score_func, renormalize=renormalize, n_groups=n_groups,
                            topk_groups=topk_groups, routed_scaling=routed_scaling, expert_bias=expert_bias,
                            bias_update_rate=bias_update_rate, aux_loss_coef=aux_loss_coef,
                            z_loss_coef=z_loss_coef, num_shared_experts=num_shared_experts,
                            shared_d_ff=shared_d_ff, bias=bias, activation=activation,
                            recompute_activation=recompute_activation)
        self.d_model, self.num_experts, self.top_k, self.activation = d_model, num_experts, top_k, activation
        self.ep_axis = ep_axis
        self.deterministic = False  # set by .eval(): no load counting for the expert bias
        E = num_experts
        self.router_weight = _uniform(rngs, (E, d_model), d_model, param_dtype)
        self.experts_gate_up = _uniform(rngs, (E, 2 * d_ff, d_model), d_model, param_dtype, ep_axis)
        self.experts_down = _uniform(rngs, (E, d_model, d_ff), d_ff, param_dtype, ep_axis)
        self.experts_gate_up_bias = _uniform(rngs, (E, 2 * d_ff), d_model, param_dtype, ep_axis) if bias else None
        self.experts_down_bias = _uniform(rngs, (E, d_model), d_ff, param_dtype, ep_axis) if bias else None
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
        logits = matmul(tokens.astype(compute), router_weight.astype(compute).T)
        routing = route(logits, self.top_k, score_func=options["score_func"], renormalize=options["renormalize"],
                        n_groups=options["n_groups"], topk_groups=options["topk_groups"],
                        expert_bias=self.expert_bias.get_value() if self.expert_bias is not None else None,
                        scale=options["routed_scaling"])
        if self.ep_axis is None:
            rows, order, group_sizes = permute(tokens, routing.expert_ids, self.num_experts)
            y = unpermute(self._experts(rows, group_sizes), order, routing.weights)
        else:
            y = self._expert_parallel(tokens, routing)
        if self.shared_gate_up is not None:
            h = matmul(tokens, self.shared_gate_up.get_value().astype(tokens.dtype).T)
            y = y + matmul(glu(h, self.activation), self.shared_down.get_value().astype(tokens.dtype).T)
        if self.load_since_update is not None and not self.deterministic:
            self.load_since_update.set_value(self.load_since_update.get_value() + routing.tokens_per_expert)
        self.load_balancing_loss.set_value(routing.aux_loss.astype(jnp.float32))
        self.z_loss.set_value(routing.z_loss.astype(jnp.float32))
        self.aux_loss.set_value((options["aux_loss_coef"] * routing.aux_loss
                               + options["z_loss_coef"] * routing.z_loss).astype(jnp.float32))
        self.tokens_per_expert.set_value(routing.tokens_per_expert)
        return y.reshape(x.shape)

    def _expert_weights(self, dtype) -> dict[str, jax.Array | None]:
        """The experts' weights (and biases, None without ``bias``) in ``dtype``."""
        names = ("experts_gate_up", "experts_down", "experts_gate_up_bias", "experts_down_bias")
        return {name: getattr(self, name).get_value().astype(dtype) if getattr(self, name) is not None else None
                for name in names}

    def _experts(self, rows: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """The gated experts on ``rows [R, d]`` sorted by expert, in rows' dtype."""
        return _gated(rows, group_sizes, self._expert_weights(rows.dtype), self.activation,
                      self.options["recompute_activation"])

    def _expert_parallel(self, tokens: jax.Array, routing: Routing) -> jax.Array:
        """The routed experts under ``shard_map`` over ``ep_axis``: ``tokens [T, d]`` and their routing
        split over the axis, the experts' weights along E; returns ``[T, d]`` in tokens' dtype."""
        axis = self.ep_axis
        size, explicit = _ep_mesh(axis, self.num_experts)
        if tokens.shape[0] % size:
            raise ValueError(f"the {tokens.shape[0]} tokens must split evenly over the {size} devices of mesh "
                             f"axis {axis!r}")

        def routed(tokens, expert_ids, weights, experts):
            rows, group_sizes, handle = dispatch(tokens, expert_ids, axis, self.num_experts)
            return combine(_gated(rows, group_sizes, experts, self.activation, self.options["recompute_activation"]),
                           handle, weights)

        split = PartitionSpec(axis)
        # Every input and the output are split over the axis (nothing replicated, so no gradient is
        # summed over it).
        mapped = jax.shard_map(routed, in_specs=split, out_specs=split, axis_names={axis})
        args = (tokens, routing.expert_ids, routing.weights, self._expert_weights(tokens.dtype))
        if not explicit:
            return mapped(*args)
        # Explicit axes carry shardings in the types: shard_map takes its inputs as specified, and the
        # result goes back to the tokens' sharding.
        y = mapped(*jax.tree.map(lambda a: jax.reshard(a, split), args))
        return jax.reshard(y, jax.typeof(tokens).sharding.spec)

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
    def from_torch(cls, moe: Any, *, param_dtype: Any = None, ep_axis: str | None = None) -> MoE:
        """The layer with a ``dropless.MoE``'s options and weights (placed as the new layer's own;
        ``param_dtype`` defaults to the PyTorch weights' dtype; ``ep_axis``: the expert-parallel layer,
        built under a mesh with that axis)."""
        from dropless.jax.convert import moe_from_torch

        return moe_from_torch(cls, moe, param_dtype, ep_axis)

    def to_torch(self, device: Any = "cpu", dtype: Any = None) -> Any:
        """A ``dropless.MoE`` with this layer's options and weights (on ``device``; ``dtype`` defaults to
        the parameters' dtype)."""
        from dropless.jax.convert import moe_to_torch

        return moe_to_torch(self, device, dtype)


def _gated(rows: jax.Array, group_sizes: jax.Array, experts: dict[str, jax.Array | None], activation: str,
           recompute_activation: bool) -> jax.Array:
    """``gated_experts`` with the weights of ``MoE._expert_weights``."""
    return gated_experts(rows, group_sizes, experts["experts_gate_up"], experts["experts_down"], activation,
                         experts["experts_gate_up_bias"], experts["experts_down_bias"], recompute_activation)
