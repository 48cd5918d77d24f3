"""Helpers of the JAX tests: arrays from seeds, the float64 numpy oracle, comparisons with tolerances."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import dropless

# Relative Frobenius error allowed against the float64 oracle computed from the same (rounded) inputs.
REL_TOL = {jnp.float64: 1e-12, jnp.float32: 1e-5, jnp.float16: 5e-3, jnp.bfloat16: 1e-2}


def randn(rng: np.random.Generator, shape: Sequence[int], dtype) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape), dtype)


def f64(a: jax.Array) -> np.ndarray:
    return np.asarray(a.astype(jnp.float32) if a.dtype != jnp.float64 else a).astype(np.float64)


def bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    ends = np.cumsum(sizes)
    return [(int(e - s), int(e)) for s, e in zip(sizes, ends)]


def oracle_mm(x: jax.Array, w_kn: jax.Array, sizes: Sequence[int]) -> np.ndarray:
    """float64 ``y[i] = x[i] @ w[g(i)]`` group by group, zero past the last group."""
    x64, w64 = f64(x), f64(w_kn)
    y = np.zeros((x.shape[0], w_kn.shape[2]))
    for g, (s, t) in enumerate(bounds(sizes)):
        y[s:t] = x64[s:t] @ w64[g]
    return y


def oracle_wgrad(x: jax.Array, dy: jax.Array, sizes: Sequence[int]) -> np.ndarray:
    """float64 ``dw[g] = x_g^T dy_g``; zero for an empty group."""
    x64, dy64 = f64(x), f64(dy)
    dw = np.zeros((len(sizes), x.shape[1], dy.shape[1]))
    for g, (s, t) in enumerate(bounds(sizes)):
        dw[g] = x64[s:t].T @ dy64[s:t]
    return dw


def assert_close(out: jax.Array, ref: np.ndarray, dtype, what: str) -> None:
    """Same shape, every element finite, relative Frobenius error within REL_TOL[dtype]."""
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    got = f64(out)
    assert np.isfinite(got).all(), f"{what}: {int((~np.isfinite(got)).sum())} non-finite elements"
    den = np.linalg.norm(ref)
    err = np.linalg.norm(got - ref) / den if den else float(np.linalg.norm(got))
    assert err <= REL_TOL[dtype], f"{what}: relative error {err:.3g} > {REL_TOL[dtype]:g} ({np.dtype(dtype).name})"


def assert_matches_torch(got, expected, what: str, tol: float) -> None:
    """A JAX result against a PyTorch tensor: same shape, finite, relative Frobenius error within ``tol``."""
    got = np.asarray(got, np.float64)
    ref = expected.detach().double().cpu().numpy()
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert np.isfinite(got).all(), f"{what}: non-finite values"
    err = np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def assert_rows_close(y: jax.Array, ref: np.ndarray, sizes: Sequence[int], dtype, what: str = "y") -> None:
    """Group by group, and the rows past the last group exactly zero."""
    assert_close(y, ref, dtype, what)
    for g, (s, t) in enumerate(bounds(sizes)):
        if t > s:
            assert_close(y[s:t], ref[s:t], dtype, f"{what} rows of group {g}")
    assert (f64(y[sum(sizes):]) == 0).all(), f"{what}: rows past the last group are not all zero"


@contextlib.contextmanager
def torch_oracle() -> Iterator[None]:
    """The PyTorch side of a comparison (CPU tensors) on its reference backend, whichever backend the
    JAX side takes (the Triton one on a GPU cannot take CPU tensors)."""
    before = dropless.get_backend()
    dropless.set_backend("reference")
    try:
        yield
    finally:
        dropless.set_backend(before)
