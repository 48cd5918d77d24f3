"""The router's linear gate in fp32: ``logits [T, E] = x [T, d] @ weight [E, d]^T``.

With bf16 or fp16 ``x`` and ``weight`` on a GPU the product runs on tensor cores with fp32 output:
the product of two 16-bit floats is exact in fp32 and the sums are fp32, so the logits are those of
the fp32 GEMM of the upcast operands (up to summation order) at a fraction of its cost. The backward
splits the fp32 gradient into a high and a low 16-bit part (``g = hi + lo`` to about 2^-16 relative)
and runs both through tensor-core GEMMs (for x's gradient, one GEMM with K = 2E). Elsewhere the
operands are upcast and multiplied in fp32 (fp64 stays fp64). Autocast does not apply: the router
computes in fp32 under it too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_HALF = (torch.bfloat16, torch.float16)


def _fp32_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.mm(a, b, out_dtype=torch.float32)


class _HalfRouterLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return _fp32_mm(x, weight.t())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        E = grad.shape[1]
        # [hi | lo] in x's dtype, written in place: hi = grad rounded, lo = (grad - hi) rounded.
        split = torch.empty(grad.shape[0], 2 * E, dtype=x.dtype, device=grad.device)
        hi = split[:, :E].copy_(grad)
        if torch.compiler.is_compiling():
            split[:, E:] = grad - hi  # a traced graph takes no strided out= (its compiler fuses this anyway)
        else:
            torch.sub(grad, hi, out=split[:, E:])
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # One product over [hi | lo] and [weight; weight]: the two parts summed in the GEMM's fp32
            # accumulator and rounded once into x's dtype, with no fp32 [T, d] tensor written or added.
            dx = torch.mm(split, torch.cat((weight, weight), dim=0))
        if ctx.needs_input_grad[1]:
            parts = _fp32_mm(split.t(), x)
            dw = (parts[:E] + parts[E:]).to(weight.dtype)
        return dx, dw


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [T, d] @ weight [E, d]^T`` as fp32 ``[T, E]`` (fp64 if either is fp64); differentiable.

    Gradients come back in the operands' dtypes. No host sync.
    """
    with torch.autocast(x.device.type, enabled=False):
        if x.is_cuda and x.dtype in _HALF and weight.dtype == x.dtype:
            return _HalfRouterLogits.apply(x, weight)
        compute = torch.float64 if torch.float64 in (x.dtype, weight.dtype) else torch.float32
        return F.linear(x.to(compute), weight.to(compute))
