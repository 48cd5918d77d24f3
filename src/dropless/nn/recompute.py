"""Saving a tensor for the backward as the recipe that makes it again, instead of its memory."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator

import torch


class _Recipe:
    """A saved tensor's place holder: ``make()`` gives it back."""

    def __init__(self, make: Callable[[], torch.Tensor]) -> None:
        self.make = make


@contextlib.contextmanager
def recomputed(tensor: torch.Tensor, make: Callable[[], torch.Tensor]) -> Iterator[None]:
    """Within the block, autograd saves ``tensor`` (the very object) as ``make`` and calls ``make()``, under
    ``torch.no_grad()``, when the backward needs it; every other saved tensor is kept as usual.

    ``make`` must return a tensor equal to ``tensor`` from tensors the graph keeps anyway (the gated
    activation's output from its input, which the activation's own backward saves), so the saving is
    ``tensor``'s memory for one more pass of ``make`` in the backward.
    """
    # Autograd keeps the hooks as long as what they saved: a strong reference here would keep ``tensor``.
    target = weakref.ref(tensor)

    def pack(saved: torch.Tensor) -> torch.Tensor | _Recipe:
        return _Recipe(make) if saved is target() else saved

    def unpack(saved: torch.Tensor | _Recipe) -> torch.Tensor:
        if isinstance(saved, _Recipe):
            with torch.no_grad():
                return saved.make()
        return saved

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
