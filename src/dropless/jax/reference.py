"""The grouped GEMM products in plain JAX, with the signatures of ``kernel_calls``: what runs where the
kernels do not (no GPU, or the reference backend chosen).

Each group's product is taken over all the rows with the other groups' rows masked out, one group at a
time (``jax.lax.scan`` / ``jax.lax.map``): G dense products, the work XLA's own lowering of
``jax.lax.ragged_dot`` does, with one ``[M, N]`` product in memory at a time. No ragged op is involved,
so the products compose with ``jax.vmap`` over any operand (XLA's op batches only when all its operands
are batched). Sums in fp32 (fp64 for fp64 operands); fp32 operands multiply in full fp32 (XLA's default
on GPUs would round them to TF32), as the kernels do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dropless.jax.vma import varying_axes, vary


def matmul(a: jax.Array, b: jax.Array, preferred_element_type=None) -> jax.Array:
    """``a @ b`` with fp32 operands multiplied in full fp32, as PyTorch and the kernels do (XLA's default
    precision on GPUs rounds them to TF32); 16-bit and fp64 operands as XLA's default."""
    precision = jax.lax.Precision.HIGHEST if jnp.float32 in (a.dtype, b.dtype) else None
    return jnp.matmul(a, b, precision=precision, preferred_element_type=preferred_element_type)


def _group_rows(M: int, offsets: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Row numbers ``[M]`` and each group's first and last-plus-one rows ``[G]``."""
    rows = jnp.arange(M, dtype=offsets.dtype)
    starts = jnp.concatenate([jnp.zeros(1, offsets.dtype), offsets[:-1]])
    return rows, starts, offsets


def ragged_m(lhs: jax.Array, rhs: jax.Array, offsets: jax.Array, rhs_nk: bool, out_dtype: np.dtype) -> jax.Array:
    """``out[s_g:t_g] = lhs[s_g:t_g] @ rhs[g]`` (``rhs[g]^T`` with ``rhs_nk``), zero past ``offsets[-1]``."""
    rows, starts, ends = _group_rows(lhs.shape[0], offsets)
    accumulate = jnp.promote_types(lhs.dtype, jnp.float32)
    rhs_kn = jnp.swapaxes(rhs, 1, 2) if rhs_nk else rhs

    def group(out: jax.Array, part: tuple[jax.Array, jax.Array, jax.Array]) -> tuple[jax.Array, None]:
        weight, start, end = part
        mine = ((rows >= start) & (rows < end))[:, None]
        return out + jnp.where(mine, matmul(lhs, weight, accumulate), 0), None

    # Under shard_map the carry must vary over the manual axes as the operands do.
    out = vary(jnp.zeros((lhs.shape[0], rhs_kn.shape[2]), accumulate), varying_axes(lhs, rhs, offsets))
    return jax.lax.scan(group, out, (rhs_kn, starts, ends))[0].astype(out_dtype)


def ragged_k(lhs: jax.Array, rhs: jax.Array, offsets: jax.Array, out_dtype: np.dtype) -> jax.Array:
    """``out[g] = lhs[s_g:t_g]^T @ rhs[s_g:t_g]`` (``[G, K, N]``), zero for an empty group."""
    rows, starts, ends = _group_rows(lhs.shape[0], offsets)
    accumulate = jnp.promote_types(lhs.dtype, jnp.float32)

    def group(bounds: tuple[jax.Array, jax.Array]) -> jax.Array:
        start, end = bounds
        mine = ((rows >= start) & (rows < end))[:, None]
        return matmul(jnp.where(mine, lhs, 0).T, jnp.where(mine, rhs, 0), accumulate)

    return jax.lax.map(group, (starts, ends)).astype(out_dtype)
