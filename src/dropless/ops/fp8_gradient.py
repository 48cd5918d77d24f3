"""A gradient's FP8 copy, made by the kernel that writes the gradient and read by the FP8 product whose
backward receives it, so that the product does not quantize the gradient again.

In an FP8 MoE layer two gradients come out of kernels that can quantize them on the way: unpermute's
backward writes the down projection's output gradient, and the gated activation's backward writes the
gate/up projection's. Autograd hands a backward only the gradient tensors, so the copy travels attached
to its gradient. The product takes it (and drops it from the gradient, so that the copy is freed with
the product's operands) only if the gradient has not changed since (its version counter) and the copy is
quantized as the product needs it: its recipe, along dim 1, the gradient's shape. Anything else (a
gradient summed over two uses, a compiled graph, a different recipe) finds no copy, and the product
quantizes the gradient itself, as it would without the producer's help.
"""

from __future__ import annotations

import torch

from dropless.quantized import QuantizedTensor, Recipe

_ATTRIBUTE = "_dropless_fp8_copy"


def attach_fp8_copy(grad: torch.Tensor, copy: QuantizedTensor) -> None:
    """Attach ``copy`` (``grad`` quantized along dim 1, as it is now) to ``grad``."""
    setattr(grad, _ATTRIBUTE, (grad._version, copy))


def take_fp8_copy(grad: torch.Tensor, recipe: Recipe) -> QuantizedTensor | None:
    """The copy attached to ``grad`` if it still holds ``grad``'s values quantized along dim 1 with
    ``recipe``, else None; either way ``grad`` holds no copy after the call. None in a compiled graph,
    whose producers attach nothing."""
    if torch.compiler.is_compiling():
        return None
    held = grad.__dict__.pop(_ATTRIBUTE, None)
    if held is None:
        return None
    version, copy = held
    if (version != grad._version or copy.recipe != recipe or copy.dim != 1 or copy.offsets is not None
            or copy.shape != grad.shape or copy.device != grad.device):
        return None
    return copy
