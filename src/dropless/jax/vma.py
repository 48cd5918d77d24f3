"""Which manual axes of a ``shard_map`` a value varies over (its ``vma``), and casts between them.

A custom VJP must hand each input back a gradient of that input's own type. Its inputs are first made
to vary over the same axes (``vary``): an input that did not, say weights replicated over the axis of
sharded tokens, then gets the gradient summed over that axis by the cast's own transpose (``psum``), as
every replicated weight does under ``shard_map``. Outside ``shard_map`` nothing varies and these are
no-ops.
"""

from __future__ import annotations

import jax


def _varying(value: jax.Array) -> frozenset[str]:
    aval = jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)  # jax >= 0.10; before, the set itself as ``vma``
    return frozenset(manual.varying if manual is not None else getattr(aval, "vma", ()))


def varying_axes(*values: jax.Array) -> frozenset[str]:
    """The manual axes any of ``values`` varies over."""
    return frozenset().union(*(_varying(value) for value in values))


def vary(value: jax.Array, axes: frozenset[str]) -> jax.Array:
    """``value`` made to vary over ``axes`` too (a no-op where it already does)."""
    missing = tuple(sorted(axes - _varying(value)))
    return jax.lax.pcast(value, missing, to="varying") if missing else value
