"""``jax.lax.ragged_dot`` pointed at ``dropless.jax.ragged_dot``, for code that calls XLA's op by name
(MaxText's sparse-matmul MoE) and is not to be edited."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

from dropless.jax.grouped_mm import ragged_dot


@contextlib.contextmanager
def replace_ragged_dot() -> Iterator[None]:
    """Within this block ``jax.lax.ragged_dot`` is ``dropless.jax.ragged_dot`` (the same signature):
    functions traced inside it (a first ``jax.jit`` call, ``jax.grad``) run the dropless kernels, and
    keep them once compiled. Code that imported the function itself (``from jax.lax import
    ragged_dot``) before the block is not affected."""
    original = jax.lax.ragged_dot
    jax.lax.ragged_dot = ragged_dot
    try:
        yield
    finally:
        jax.lax.ragged_dot = original
