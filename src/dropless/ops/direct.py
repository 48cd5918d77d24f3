"""Eager calls of the custom ops that skip the dispatcher.

Every op of dropless is a ``torch.library`` custom op, which is what ``torch.compile``, fake tensors
and tensor subclasses need. Called eagerly, though, the dispatcher and the custom op's autograd
wrapper cost host time on every call (9-26 us of a grouped_mm forward on an H100's host,
benchmarks/NOTES.md v6), which adds up over the many calls of an MoE layer. A ``DirectOp`` runs the
op's implementation itself when the call is eager on plain tensors (through an ``autograd.Function``
holding the op's backward when an input needs a gradient), and the custom op otherwise: while
``torch.compile`` traces, under a dispatch mode (fake tensors, ``make_fx``), under functorch
transforms, or for a tensor subclass.
Both paths run the same implementation and the same backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)  # what a call may hold to skip the dispatcher


def is_plain_call(args: tuple[Any, ...]) -> bool:
    """Whether a call with ``args`` may skip the dispatcher: not traced, no dispatch mode or functorch
    transform active, and every tensor argument a plain ``torch.Tensor`` or ``nn.Parameter``."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._are_functorch_transforms_active()):
        return False
    return all(type(a) in PLAIN_TYPES for a in args if isinstance(a, torch.Tensor))


class DirectOp:
    """A custom op ``op`` whose implementation is ``impl``, callable with the op's positional arguments.

    With ``backward`` and ``setup_context`` (the functions ``register_autograd`` takes, registered on
    ``op`` here), the op is differentiable on both paths.
    """

    @classmethod
    def define(cls, name: str, impl: Callable[..., Any], fake: Callable[..., Any], *,
               mutates_args: tuple[str, ...] = (), backward: Callable[..., Any] | None = None,
               setup_context: Callable[..., None] | None = None) -> DirectOp:
        """Register ``impl`` as the custom op ``dropless::name`` with the fake implementation ``fake``
        (and the backward, if given)."""
        op = torch.library.custom_op(f"dropless::{name}", impl, mutates_args=mutates_args)
        op.register_fake(fake)
        return cls(op, impl, backward, setup_context)

    def __init__(self, op: torch.library.CustomOpDef, impl: Callable[..., Any],
                 backward: Callable[..., Any] | None = None,
                 setup_context: Callable[..., None] | None = None) -> None:
        self.op = op
        self.impl = impl
        self.function: type[torch.autograd.Function] | None = None
        if backward is not None:
            op.register_autograd(backward, setup_context=setup_context)
            self.function = _autograd_function(op._qualname, impl, backward, setup_context)

    def __call__(self, *args: Any) -> Any:
        if not is_plain_call(args):
            return self.op(*args)
        if self.function is not None and torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return self.function.apply(*args)
        return self.impl(*args)


def _autograd_function(name: str, impl: Callable[..., Any], backward: Callable[..., Any],
                       setup_context: Callable[..., None] | None) -> type[torch.autograd.Function]:
    """An ``autograd.Function`` running ``impl`` forward and ``backward`` back, as the custom op's
    registered autograd does."""

    def forward(ctx: Any, *args: Any) -> Any:
        output = impl(*args)
        if setup_context is not None:
            setup_context(ctx, args, output)
        return output

    return type(f"Direct_{name.replace('::', '_')}", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})
