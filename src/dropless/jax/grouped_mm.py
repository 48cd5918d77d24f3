"""Grouped GEMM in JAX: ``ragged_dot`` (``jax.lax.ragged_dot``'s drop-in) and ``grouped_mm`` (the
PyTorch op's options), differentiable through a ``jax.custom_vjp`` whose forward and input gradient run
the ragged-M kernel and whose weight gradient runs the ragged-K kernel (``kernel_calls``), or their
plain-JAX versions on the reference backend (``reference``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from dropless.jax import kernel_calls, reference
from dropless.jax.backend import use_kernels
from dropless.jax.vma import varying_axes, vary

KERNEL_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
REFERENCE_DTYPES = (*KERNEL_DTYPES, jnp.float64)


def _products(kernels: bool):
    """The module whose ``ragged_m`` and ``ragged_k`` run the products: the kernels' or the reference's."""
    return kernel_calls if kernels else reference


# ``kernels``, the backend chosen when the call was traced, is a static argument so that JAX's caches of
# traced functions (custom_vjp's rules, jax.checkpoint's bodies) never reuse a trace of the other one.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _mm(x: jax.Array, w: jax.Array, offsets: jax.Array, w_nk: bool, out_dtype: np.dtype, kernels: bool) -> jax.Array:
    return _products(kernels).ragged_m(x, w, offsets, w_nk, out_dtype)


def _mm_fwd(x, w, offsets, w_nk, out_dtype, kernels):
    return _mm(x, w, offsets, w_nk, out_dtype, kernels), (x, w, offsets)


def _mm_bwd(w_nk, out_dtype, kernels, saved, dy):
    x, w, offsets = saved
    products = _products(kernels)
    # The gradient is taken in the operands' dtype (an fp32 result of 16-bit operands comes back in it).
    dy = dy.astype(x.dtype)
    dx = products.ragged_m(dy, w, offsets, not w_nk, x.dtype)
    # w [G, K, N]: dw[g] = x_g^T dy_g; w [G, N, K]: dw[g] = dy_g^T x_g (the same product, transposed).
    dw = products.ragged_k(dy, x, offsets, w.dtype) if w_nk else products.ragged_k(x, dy, offsets, w.dtype)
    return dx, dw, np.zeros(offsets.shape, dtype=jax.dtypes.float0)


_mm.defvjp(_mm_fwd, _mm_bwd)


def _check(x: jax.Array, w: jax.Array, w_nk: bool, groups: jax.Array, groups_name: str) -> None:
    """Shapes and dtypes, every error naming the argument."""
    for name, t, ndim in (("x", x, 2), ("w", w, 3), (groups_name, groups, 1)):
        if not hasattr(t, "shape") or not hasattr(t, "dtype"):
            raise TypeError(f"{name} must be a jax array, got {type(t).__name__}")
        if t.ndim != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    dtypes = KERNEL_DTYPES if use_kernels() else REFERENCE_DTYPES
    for name, t in (("x", x), ("w", w)):
        if t.dtype not in dtypes:
            raise TypeError(f"{name} must have dtype in {[np.dtype(d).name for d in dtypes]}, got {t.dtype}")
    K = w.shape[2] if w_nk else w.shape[1]
    if K != x.shape[1]:
        layout = "[G, N, K]" if w_nk else "[G, K, N]"
        raise ValueError(f"w must have shape {layout} with K={x.shape[1]} to match x [M, K], got {tuple(w.shape)}")
    if w.shape[0] == 0:
        raise ValueError("w must hold at least one group (G >= 1)")
    if groups.shape[0] != w.shape[0]:
        raise ValueError(f"{groups_name} must have shape [G] = [{w.shape[0]}] (one entry per group), "
                         f"got {tuple(groups.shape)}")
    if not jnp.issubdtype(groups.dtype, jnp.integer):
        raise TypeError(f"{groups_name} must have an integer dtype, got {groups.dtype}")


def _grouped(x: jax.Array, w: jax.Array, offsets: jax.Array, w_nk: bool, out_dtype: np.dtype) -> jax.Array:
    """The product on checked operands of one dtype; offsets int ``[G]``."""
    M, K = x.shape
    N = w.shape[1] if w_nk else w.shape[2]
    if M == 0 or N == 0 or K == 0:
        return jnp.zeros((M, N), out_dtype)  # an empty result, or a product over nothing
    axes = varying_axes(x, w, offsets)
    return _mm(vary(x, axes), vary(w, axes), vary(offsets.astype(jnp.int32), axes), w_nk, out_dtype, use_kernels())


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, precision=None,
               preferred_element_type=None, group_offset: jax.Array | None = None, out_sharding=None) -> jax.Array:
    """``jax.lax.ragged_dot`` on the dropless kernels: ``out[s_g:t_g] = lhs[s_g:t_g] @ rhs[g]``.

    Args:
        lhs: ``[M, K]``, rows sorted by group; bf16, fp16 or fp32 (fp64 on the reference backend).
        rhs: ``[G, K, N]``.
        group_sizes: integer ``[G]`` rows per group, on the device (summing to at most M; rows past the
            last group come out zero and get zero gradient).
        precision: accepted for compatibility; fp32 operands always multiply in full fp32 and 16-bit
            ones on the tensor cores, accumulating in fp32.
        preferred_element_type: the result's dtype (default: the operands' promoted dtype); on the
            kernels it must be that dtype or float32.
        group_offset: not supported (raises NotImplementedError if given), as in the GPU lowering of
            ``jax.lax.ragged_dot``.
        out_sharding: not supported (raises NotImplementedError if given); under ``shard_map`` each
            device runs its own product.
    Returns:
        ``[M, N]``. Differentiable in lhs and rhs (``jax.grad``, ``jax.vjp``), usable under ``jax.jit``,
        ``jax.vmap`` (one kernel call per batch entry) and ``shard_map``.
    """
    del precision
    if group_offset is not None:
        raise NotImplementedError("group_offset is not supported by dropless.jax.ragged_dot")
    if out_sharding is not None:
        raise NotImplementedError("out_sharding is not supported by dropless.jax.ragged_dot; call it under shard_map")
    _check(lhs, rhs, False, group_sizes, "group_sizes")
    return _call(lhs, rhs, jnp.cumsum(group_sizes.astype(jnp.int32)), False, preferred_element_type)


def grouped_mm(x: jax.Array, w: jax.Array, offsets: jax.Array | None = None, *,
               group_sizes: jax.Array | None = None, offs: jax.Array | None = None, transposed: bool = False,
               out_dtype=None) -> jax.Array:
    """Grouped GEMM with the options of the PyTorch ``dropless.grouped_mm``: ``y[s_g:t_g] = x[s_g:t_g] @ w[g]``.

    Args:
        x: ``[M, K]`` rows sorted by group; bf16, fp16, fp32 (fp64 on the reference backend).
        w: ``[G, K, N]``, or ``[G, N, K]`` (the ``nn.Linear`` layout, ``y = x @ w[g]^T``) with
            ``transposed=True``; promoted with x to one dtype.
        offsets: integer ``[G]`` cumulative group ends on the device (``offs`` is an alias, as in
            ``torch._grouped_mm``); or give ``group_sizes [G]`` instead.
        out_dtype: the result's dtype (default: the operands'); on the kernels, theirs or float32.
    Returns:
        ``[M, N]``; rows past the last offset are zero. Differentiable in x and w.
    """
    if offs is not None:
        if offsets is not None:
            raise ValueError("pass offsets or its alias offs, not both")
        offsets = offs
    if (offsets is None) == (group_sizes is None):
        raise ValueError("pass exactly one of offsets (cumulative group ends) and group_sizes")
    name, groups = ("offsets", offsets) if offsets is not None else ("group_sizes", group_sizes)
    _check(x, w, transposed, groups, name)
    ends = groups.astype(jnp.int32) if offsets is not None else jnp.cumsum(groups.astype(jnp.int32))
    return _call(x, w, ends, transposed, out_dtype)


def _call(x: jax.Array, w: jax.Array, offsets: jax.Array, w_nk: bool, out_dtype) -> jax.Array:
    dtype = jnp.promote_types(x.dtype, w.dtype)
    out_dtype = np.dtype(out_dtype) if out_dtype is not None else np.dtype(dtype)
    if use_kernels() and out_dtype not in (np.dtype(dtype), np.dtype(jnp.float32)):
        raise TypeError(f"the result's dtype must be the operands' ({np.dtype(dtype).name}) or float32, "
                        f"got {out_dtype.name}")
    return _grouped(x.astype(dtype), w.astype(dtype), offsets, w_nk, out_dtype)
