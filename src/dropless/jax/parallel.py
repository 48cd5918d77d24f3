"""Expert parallelism in JAX: ``dispatch`` and ``combine``, called inside ``shard_map`` over a mesh axis.

E experts are spread over the P devices of the axis: device r owns experts ``r*E/P .. (r+1)*E/P - 1``
(its L = E/P local experts). Each device holds T tokens, each routed to k experts.

- ``dispatch`` sorts the ``T*k`` token copies by expert, exchanges the per-expert counts with one
  ``all_gather`` (an int32 ``[P, E]`` table, on the device) and sends the copies with one ragged
  all-to-all of E slices, one per (owner, local expert), each written where it belongs in the owner's
  expert-major order: a device receives its rows already sorted by local expert, each expert's rows in
  source-device then token order, into a buffer of static size.
- ``combine`` sends the expert outputs back along the same slices and sums each token's k outputs,
  weighted, in fp32, as ``dropless.jax.experts.unpermute`` does on one device.

Nothing is read on the host and every shape is static, so a whole layer jits. Both are differentiable
(``jax.grad``, ``jax.vjp``): the gradient of a ragged all-to-all is the reverse one along the same
slices, and the routing weights get theirs through combine's weighted sum.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from dropless.jax.collective import ragged_all_to_all
from dropless.jax.experts import permute, unpermute


class Slices(NamedTuple):
    """One ragged all-to-all from this device's point of view, int32 ``[P*L]`` each: where each slice
    starts in the operand, its rows, where it lands on its receiver, and the rows received per slice."""

    input_offsets: jax.Array
    send_sizes: jax.Array
    output_offsets: jax.Array
    recv_sizes: jax.Array


@functools.partial(jax.tree_util.register_dataclass, data_fields=["order", "sent", "returned", "rows_needed"],
                   meta_fields=["axis_name", "rows"])
@dataclasses.dataclass(frozen=True)
class DispatchHandle:
    """What ``combine`` needs to send a dispatch's rows back.

    order: int32 ``[T*k]``, the token copy (``t*k + j``) each of this device's sorted send rows is; sent /
    returned: the dispatch's and combine's exchanges; rows_needed: int32 scalar, the rows this device
    would receive with an unbounded buffer (more than ``rows`` means some were dropped); axis_name: the
    mesh axis; rows: R, the receive buffer's rows.
    """

    order: jax.Array
    sent: Slices
    returned: Slices
    rows_needed: jax.Array
    axis_name: str
    rows: int


def _move(rows: jax.Array, out_rows: int, slices: Slices, axis_name: str) -> jax.Array:
    """``rows`` along ``slices`` into ``out_rows`` rows of zeros on each receiver."""
    out = jnp.zeros((out_rows, *rows.shape[1:]), rows.dtype)
    if rows.shape[0] == 0 or out_rows == 0:
        return out  # the same static shapes on every device: all skip together
    # The received rows differ from device to device, so the buffer they land in is marked as varying.
    out = jax.lax.pcast(out, axis_name, to="varying")
    return ragged_all_to_all(rows, out, *slices, axis_name=axis_name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _exchange(axis_name: str, out_rows: int, in_rows: int, rows: jax.Array, there: Slices,
              back: Slices) -> jax.Array:
    """``rows [in_rows, ...]`` sent along ``there`` into ``out_rows`` rows; the gradient goes along
    ``back``, its reverse."""
    return _move(rows, out_rows, there, axis_name)


def _exchange_fwd(axis_name, out_rows, in_rows, rows, there, back):
    return _move(rows, out_rows, there, axis_name), back


def _exchange_bwd(axis_name, out_rows, in_rows, back, grad):
    return _move(grad, in_rows, back, axis_name), None, None


_exchange.defvjp(_exchange_fwd, _exchange_bwd)


def _axis_size(axis_name: str, caller: str) -> int:
    try:
        return jax.lax.axis_size(axis_name)
    except NameError as e:
        raise ValueError(f"{caller} must run inside shard_map over the mesh axis {axis_name!r}, "
                         f"which is not bound here") from e


def _plan(counts: jax.Array, axis_name: str, P: int, max_rows: int) -> tuple[Slices, Slices, jax.Array, jax.Array]:
    """The dispatch's and combine's slices from every device's counts, the local group sizes and the
    rows needed.

    counts: int32 ``[E]`` this device's copies per expert. Slice ``(dst, l)`` of device src lands on dst
    after all rows of dst's experts before l, then after expert l's rows from devices before src; rows
    past ``max_rows`` are cut off (their slices shrink, in this order).
    """
    me = jax.lax.axis_index(axis_name)
    table = jax.lax.all_gather(counts, axis_name)  # [src, E]
    per_slice = table.reshape(P, P, -1)  # [src, dst, l]
    home = (jnp.cumsum(table, axis=1) - table).reshape(per_slice.shape)  # where the slice starts at src
    totals = per_slice.sum(axis=0)  # [dst, l]
    start = (jnp.cumsum(totals, axis=1) - totals)[None] + jnp.cumsum(per_slice, axis=0) - per_slice
    size = jnp.clip(max_rows - start, 0, per_slice)
    start = jnp.minimum(start, max_rows)
    sent = Slices(home[me].ravel(), size[me].ravel(), start[me].ravel(), size[:, me].ravel())
    returned = Slices(start[:, me].ravel(), size[:, me].ravel(), home[:, me].ravel(), size[me].ravel())
    return sent, returned, size[:, me].sum(axis=0), totals[me].sum()


def dispatch(tokens: jax.Array, expert_ids: jax.Array, axis_name: str, num_experts: int, *,
             max_rows: int | None = None) -> tuple[jax.Array, jax.Array, DispatchHandle]:
    """Send each token's k copies to the devices owning their experts; call inside ``shard_map``.

    Args:
        tokens: ``[T, d]`` this device's tokens (any dtype; T may be 0).
        expert_ids: int ``[T, k]`` global expert ids. A copy whose id is outside ``[0, num_experts)`` is
            dropped: it reaches no expert and adds zero in ``combine``.
        axis_name: the mesh axis of the P devices that share the experts (bound by ``shard_map``).
        num_experts: E, all devices' experts together; P must divide it.
        max_rows: the receive buffer's rows R, static (default ``P*T*k``: every copy of every device
            could go to one device). With a smaller bound, rows past R on a device are not received:
            those copies (the last in expert-major order) reach no expert and add zero in ``combine``,
            so the layer is no longer dropless; ``handle.rows_needed`` says how many rows would have come.
    Returns:
        ``(rows, group_sizes, handle)``: rows ``[R, d]`` of tokens' dtype, sorted by local expert
        (experts ``r*E/P ..`` of device r), each expert's rows in source-device then token order, zeros
        past ``group_sizes.sum()`` (padding that ``dropless.jax.grouped_mm`` and ``ragged_dot`` skip,
        giving zeros there); group_sizes int32 ``[E/P]``; the handle for ``combine``.
    """
    if tokens.ndim != 2 or expert_ids.ndim != 2 or expert_ids.shape[0] != tokens.shape[0]:
        raise ValueError(f"tokens must be [T, d] and expert_ids [T, k], got shapes {tuple(tokens.shape)} "
                         f"and {tuple(expert_ids.shape)}")
    if not jnp.issubdtype(expert_ids.dtype, jnp.integer):
        raise TypeError(f"expert_ids must have an integer dtype, got {expert_ids.dtype}")
    P = _axis_size(axis_name, "dispatch")
    if num_experts < 1 or num_experts % P:
        raise ValueError(f"num_experts ({num_experts}) must be a positive multiple of the size of mesh axis "
                         f"{axis_name!r} ({P})")
    T, k = expert_ids.shape
    rows = P * T * k if max_rows is None else max_rows
    if not isinstance(rows, int) or rows < 0:
        raise ValueError(f"max_rows must be a non-negative int, got {max_rows!r}")
    ids = expert_ids.astype(jnp.int32)
    # Out-of-range ids sort last, into a group of their own that is never sent.
    ids = jnp.where((ids < 0) | (ids >= num_experts), num_experts, ids)
    sorted_rows, order, sizes = permute(tokens, ids, num_experts + 1)
    sent, returned, group_sizes, rows_needed = _plan(sizes[:num_experts], axis_name, P, rows)
    received = _exchange(axis_name, rows, T * k, sorted_rows, sent, returned)
    return received, group_sizes, DispatchHandle(order, sent, returned, rows_needed, axis_name, rows)


def combine(rows_out: jax.Array, handle: DispatchHandle, weights: jax.Array) -> jax.Array:
    """``y[t] = sum_j weights[t, j] * out(t, j)`` at each token's own device; call inside ``shard_map``.

    Args:
        rows_out: ``[R, d']`` the expert outputs of the rows ``dispatch`` returned, in their order.
        handle: that dispatch's handle.
        weights: ``[T, k]`` routing weights (differentiable).
    Returns:
        ``[T, d']`` in rows_out's dtype, summed in fp32 (fp64 for fp64); dropped copies add zero.
    """
    if rows_out.ndim != 2 or rows_out.shape[0] != handle.rows:
        raise ValueError(f"rows_out must be [R={handle.rows}, d'] like the rows dispatch returned, "
                         f"got shape {tuple(rows_out.shape)}")
    if weights.ndim != 2 or weights.size != handle.order.shape[0]:
        raise ValueError(f"weights must be [T, k] with T*k={handle.order.shape[0]} like dispatch's expert_ids, "
                         f"got shape {tuple(weights.shape)}")
    back = _exchange(handle.axis_name, handle.order.shape[0], handle.rows, rows_out, handle.returned, handle.sent)
    return unpermute(back, handle.order, weights)
