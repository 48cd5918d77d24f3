"""Gated activations of the MoE experts on the fused gate+up layout: ``swiglu`` and ``geglu``.

``h [M, 2F]`` is the output of the fused gate+up grouped GEMM (the gate and up weights of each expert
stacked along the output dimension): ``gate = h[:, :F]``, ``up = h[:, F:]``. Both functions are one
``torch.library`` custom op, ``dropless::glu``, with the activation as an argument, a fake
implementation (``torch.compile`` traces through it) and a registered backward, itself the custom op
``dropless::glu_backward``; eager calls on plain tensors skip the dispatcher (``ops.direct``). The
backward recomputes the activation from h: h is saved, not ``a``.
"""

from __future__ import annotations

import torch

from dropless import reference
from dropless.backend import use_triton
from dropless.kernels.swiglu import glu_backward, glu_forward
from dropless.ops.checks import REFERENCE_DTYPES, TRITON_DTYPES, check_matrix, check_tensor
from dropless.ops.direct import DirectOp


def _glu(h: torch.Tensor, activation: str) -> torch.Tensor:
    if not use_triton(h.device):
        return reference.glu(h, activation)
    a = torch.empty(h.shape[0], h.shape[1] // 2, dtype=h.dtype, device=h.device)
    glu_forward(h, a, activation)
    return a


def _glu_fake(h: torch.Tensor, activation: str) -> torch.Tensor:
    return h.new_empty(h.shape[0], h.shape[1] // 2)


def _glu_backward(h: torch.Tensor, da: torch.Tensor, activation: str) -> torch.Tensor:
    """``dh [M, 2F] = [da * up * act'(gate) | da * act(gate)]`` in h's dtype."""
    if not use_triton(h.device):
        return reference.glu_backward(h, da, activation)
    dh = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    glu_backward(h, da, dh, activation)
    return dh


def _glu_backward_fake(h: torch.Tensor, da: torch.Tensor, activation: str) -> torch.Tensor:
    return h.new_empty(h.shape)


def _setup_context(ctx, inputs, output) -> None:
    h, activation = inputs
    ctx.save_for_backward(h)
    ctx.activation = activation


def _backward(ctx, da: torch.Tensor):
    (h,) = ctx.saved_tensors
    return _GLU_BACKWARD(h, da, ctx.activation), None


_GLU = DirectOp.define("glu", _glu, _glu_fake, backward=_backward, setup_context=_setup_context)
_GLU_BACKWARD = DirectOp.define("glu_backward", _glu_backward, _glu_backward_fake)


def _gated(h: torch.Tensor, activation: str) -> torch.Tensor:
    check_tensor("h", h)
    check_matrix("h", h, 2, TRITON_DTYPES if use_triton(h.device) else REFERENCE_DTYPES)
    if h.shape[1] % 2:
        raise ValueError(f"h must have an even last dimension 2F (the gate and up halves, [M, 2F]), "
                         f"got shape {tuple(h.shape)}")
    return _GLU(h, activation)


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """SwiGLU on the fused gate+up layout: ``a = silu(h[:, :F]) * h[:, F:]``.

    Args:
        h: ``[M, 2F]``, gate columns then up columns; bf16, fp16 or fp32 (fp64 on the reference
            backend); any strides (a column slice of a wider matrix is read in place, no copy).
    Returns:
        ``a [M, F]`` in h's dtype, computed in fp32. Differentiable in h: ``dh [M, 2F]`` in h's
        dtype, recomputed from h in the backward. No host sync.
    """
    return _gated(h, "silu")


def geglu(h: torch.Tensor) -> torch.Tensor:
    """GeGLU (tanh approximation) on the fused gate+up layout: ``a = gelu_tanh(h[:, :F]) * h[:, F:]``.

    ``gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))``, as
    ``torch.nn.functional.gelu(g, approximate="tanh")``. Shapes, dtypes, layouts and gradient as
    ``swiglu``.
    """
    return _gated(h, "gelu_tanh")
