"""The ragged all-to-all under ``shard_map``: XLA's own collective (``jax.lax.ragged_all_to_all``, NCCL on
GPUs) wherever XLA implements it, and on the CPU, where XLA does not (jax-ml/jax#34755), an emulation with
the same meaning built on ``all_gather``, so that expert parallelism runs and is tested on CPU devices.

The emulation gathers every device's operand (P times its rows) and is meant for tests and small
problems; the platform is read when the function is traced.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dropless.jax.backend import platform


def ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
                      output_offsets: jax.Array, recv_sizes: jax.Array, *, axis_name: str) -> jax.Array:
    """``jax.lax.ragged_all_to_all``'s contract: slice ``i`` of the K (a multiple of the axis size P)
    goes to device ``i // (K/P)``, rows ``operand[input_offsets[i]:][:send_sizes[i]]`` written at
    ``output_offsets[i]`` of that device's ``output``; every other row of ``output`` is kept.

    operand: ``[N, ...]``; output: ``[M, ...]`` of operand's dtype; the four int32 ``[K]`` arrays as
    ``jax.lax.ragged_all_to_all`` takes them. Returns ``[M, ...]``. Not differentiable on the CPU.
    """
    if platform() != "cpu":
        return jax.lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                         recv_sizes, axis_name=axis_name)
    return _emulated(operand, output, input_offsets, send_sizes, output_offsets, axis_name)


def _emulated(operand: jax.Array, output: jax.Array, input_offsets: jax.Array, send_sizes: jax.Array,
              output_offsets: jax.Array, axis_name: str) -> jax.Array:
    """Each device gathers every operand and the slices addressed to it, then reads each of its output
    rows from the one slice that writes it (the receive sizes equal the senders' send sizes)."""
    P = jax.lax.axis_size(axis_name)
    per_device = input_offsets.shape[0] // P
    every_operand = jax.lax.all_gather(operand, axis_name)
    plans = jax.lax.all_gather(jnp.stack([input_offsets, send_sizes, output_offsets]).astype(jnp.int32), axis_name)
    mine = jax.lax.dynamic_slice_in_dim(plans, jax.lax.axis_index(axis_name) * per_device, per_device, axis=2)
    start, size, at = (mine[:, i].reshape(-1) for i in range(3))  # [P * per_device], source-major
    m = jnp.arange(output.shape[0], dtype=jnp.int32)
    writes = (at[:, None] <= m) & (m < (at + size)[:, None])
    piece = jnp.argmax(writes, axis=0)
    row = jnp.clip(start[piece] + m - at[piece], 0, max(operand.shape[0] - 1, 0))
    received = every_operand[piece // per_device, row]
    written = writes.any(axis=0).reshape(-1, *([1] * (output.ndim - 1)))
    return jnp.where(written, received, output)
