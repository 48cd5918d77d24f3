"""Top-k routing in JAX, the same computation as ``dropless.ops.routing.route``: scores in fp32 (fp64 for
fp64 logits), optional group-limited choice and expert bias, renormalized and scaled weights, the
load-balancing and z losses, and the token copies per expert, all on the device."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

SCORE_FUNCS = ("softmax", "sigmoid")


class Routing(NamedTuple):
    """weights: fp32 ``[T, k]``; expert_ids: int32 ``[T, k]`` (best first); tokens_per_expert: int32
    ``[E]``; aux_loss, z_loss: fp32 scalars, unscaled (see ``dropless.ops.routing.Routing``)."""

    weights: jax.Array
    expert_ids: jax.Array
    tokens_per_expert: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array


def check_routing(num_experts: int, top_k: int, score_func: str, n_groups: int | None,
                  topk_groups: int | None) -> None:
    """The routing options' errors, raised when a layer is built."""
    if score_func not in SCORE_FUNCS:
        raise ValueError(f"score_func must be one of {SCORE_FUNCS}, got {score_func!r}")
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
    if n_groups is None:
        return
    if num_experts % n_groups != 0:
        raise ValueError(f"n_groups={n_groups} must divide the number of experts E={num_experts}")
    if topk_groups is None or not 1 <= topk_groups <= n_groups:
        raise ValueError(f"topk_groups must be in [1, n_groups={n_groups}], got {topk_groups}")
    if topk_groups * (num_experts // n_groups) < top_k:
        raise ValueError(f"topk_groups={topk_groups} groups of {num_experts // n_groups} experts hold fewer "
                         f"than top_k={top_k}")


def route(logits: jax.Array, top_k: int, *, score_func: str = "softmax", renormalize: bool = True,
          n_groups: int | None = None, topk_groups: int | None = None, expert_bias: jax.Array | None = None,
          scale: float = 1.0) -> Routing:
    """Choose ``top_k`` experts per token from router ``logits [T, E]``; the options as in
    ``dropless.ops.routing.route``."""
    T, E = logits.shape
    check_routing(E, top_k, score_func, n_groups, topk_groups)
    logits = logits.astype(jnp.float64 if logits.dtype == jnp.float64 else jnp.float32)
    scores = jax.nn.softmax(logits, axis=-1) if score_func == "softmax" else jax.nn.sigmoid(logits)
    choice = scores if expert_bias is None else scores + expert_bias.astype(scores.dtype)
    if n_groups is not None:
        choice = _limit_to_groups(choice, n_groups, topk_groups, score_func)
    expert_ids = jax.lax.top_k(choice, top_k)[1]
    weights = jnp.take_along_axis(scores, expert_ids, axis=1)
    if renormalize:
        weights = weights / jnp.maximum(weights.sum(axis=-1, keepdims=True), 1e-20)
    if scale != 1.0:
        weights = weights * scale
    # A reduction, not a scatter-add: it also runs on tokens sharded over an explicit mesh axis.
    tokens_per_expert = (expert_ids[..., None] == jnp.arange(E)).sum(axis=(0, 1), dtype=jnp.int32)
    if T == 0:
        zero = jnp.zeros((), logits.dtype)
        return Routing(weights, expert_ids.astype(jnp.int32), tokens_per_expert, zero, zero)
    fraction = tokens_per_expert.astype(scores.dtype) / (T * top_k)
    probs = scores / scores.sum(axis=-1, keepdims=True) if score_func == "sigmoid" else scores
    aux_loss = E * (fraction * probs.mean(axis=0)).sum()
    z_loss = jnp.square(jax.nn.logsumexp(logits, axis=-1)).mean()
    return Routing(weights, expert_ids.astype(jnp.int32), tokens_per_expert, aux_loss, z_loss)


def _limit_to_groups(choice: jax.Array, n_groups: int, topk_groups: int, score_func: str) -> jax.Array:
    """``choice`` with the experts outside each token's best ``topk_groups`` groups set to -inf."""
    T, E = choice.shape
    per_group = E // n_groups
    grouped = choice.reshape(T, n_groups, per_group)
    if score_func == "sigmoid" and per_group >= 2:
        group_scores = jax.lax.top_k(grouped, 2)[0].sum(axis=-1)
    else:
        group_scores = grouped.max(axis=-1)
    best_groups = jax.lax.top_k(group_scores, topk_groups)[1]
    keep = (best_groups[..., None] == jnp.arange(n_groups)).any(axis=1)  # a comparison, as in route
    return jnp.where(jnp.repeat(keep, per_group, axis=1), choice, -jnp.inf)
