"""The pieces of the MoE layer between the router and the output, as JAX functions: permute, the gated
experts on the grouped GEMM, unpermute. Each follows the PyTorch op of the same name (``dropless.ops``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dropless.jax.backend import use_kernels
from dropless.jax.grouped_mm import grouped_mm

_SQRT_2_OVER_PI = 0.7978845608028654
_GELU_K = 0.044715
ACTIVATIONS = ("swiglu", "geglu")


def permute(tokens: jax.Array, expert_ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sort the ``T*k`` token copies by expert, stably (token order kept within an expert).

    tokens: ``[T, d]``; expert_ids: int ``[T, k]`` (copy ``s = t*k + j``). Returns the rows ``[T*k, d]``,
    ``order`` int32 ``[T*k]`` (the copy each sorted row is) and ``group_sizes`` int32 ``[E]``.
    """
    k = expert_ids.shape[1]
    ids = expert_ids.reshape(-1)
    order = jnp.argsort(ids, stable=True).astype(jnp.int32)
    group_sizes = jnp.zeros(num_experts, jnp.int32).at[ids].add(1)
    return tokens[order // k], order, group_sizes


def unpermute(rows: jax.Array, order: jax.Array, weights: jax.Array) -> jax.Array:
    """``y[t] = sum_j weights[t, j] * rows[p(t*k + j)]``, summed in fp32 (fp64 for fp64), in rows' dtype.

    rows: ``[T*k, d]`` sorted as ``permute`` left them; order: its ``order``; weights: ``[T, k]``.
    """
    T, k = weights.shape
    acc = jnp.float64 if jnp.float64 in (rows.dtype, weights.dtype) else jnp.float32
    by_copy = jnp.zeros(rows.shape, acc).at[order].set(rows.astype(acc))
    return (by_copy.reshape(T, k, rows.shape[1]) * weights.astype(acc)[..., None]).sum(axis=1).astype(rows.dtype)


def glu(h: jax.Array, activation: str) -> jax.Array:
    """``act(h[:, :F]) * h[:, F:]`` computed in fp32 (fp64 for fp64), in h's dtype: SiLU for swiglu, the
    tanh approximation of GELU for geglu."""
    compute = jnp.float64 if h.dtype == jnp.float64 else jnp.float32
    g, u = jnp.split(h.astype(compute), 2, axis=1)
    z = g if activation == "swiglu" else 2 * _SQRT_2_OVER_PI * (g + _GELU_K * g * g * g)
    return (g * jax.nn.sigmoid(z) * u).astype(h.dtype)


def add_group_bias(y: jax.Array, bias: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """``y [M, N]`` plus ``bias[g]`` (``[G, N]``) on the rows of group g; rows past the last group get none."""
    ends = jnp.cumsum(group_sizes)
    group = jnp.searchsorted(ends, jnp.arange(y.shape[0], dtype=ends.dtype), side="right")
    padded = jnp.concatenate([bias, jnp.zeros((1, bias.shape[1]), bias.dtype)])
    return y + padded[group].astype(y.dtype)


def gated_experts(rows: jax.Array, group_sizes: jax.Array, gate_up: jax.Array, down: jax.Array,
                  activation: str, gate_up_bias: jax.Array | None = None,
                  down_bias: jax.Array | None = None, recompute_activation: bool = False) -> jax.Array:
    """The experts on ``rows [R, d]`` sorted by expert: ``down(act(gate_up(rows)))`` on the grouped GEMM.

    gate_up: ``[E, 2*d_ff, d]`` (gate rows, then up rows) and down: ``[E, d, d_ff]`` in the ``nn.Linear``
    layout, of rows' dtype; biases ``[E, 2*d_ff]`` and ``[E, d]``. Returns ``[R, d]``. With
    ``recompute_activation`` the activation's output ``[R, d_ff]`` is not saved for the backward but
    computed again there from the gate/up output (``jax.checkpoint``; the down product's forward, whose
    result the backward does not need, is not run again).
    """
    h = grouped_mm(rows, gate_up, group_sizes=group_sizes, transposed=True)
    if gate_up_bias is not None:
        h = add_group_bias(h, gate_up_bias, group_sizes)
    project = _activated_down
    if recompute_activation:
        project = jax.checkpoint(project, static_argnums=(4, 5), policy=jax.checkpoint_policies.nothing_saveable)
    return project(h, down, down_bias, group_sizes, activation, use_kernels())


def _activated_down(h: jax.Array, down: jax.Array, down_bias: jax.Array | None, group_sizes: jax.Array,
                    activation: str, kernels: bool) -> jax.Array:
    """``down(act(h))`` (+ the per-expert bias) on the grouped GEMM: ``[R, 2*d_ff] -> [R, d]``. ``kernels``
    (the backend in force) keys jax.checkpoint's cache of this body's traces, one per backend."""
    del kernels
    y = grouped_mm(glu(h, activation), down, group_sizes=group_sizes, transposed=True)
    return add_group_bias(y, down_bias, group_sizes) if down_bias is not None else y
