"""Gated activations of the MoE experts on the fused gate+up layout: ``swiglu`` and ``geglu``.

``h [M, 2F]`` is the output of the fused gate+up grouped GEMM (the gate and up weights of each expert
stacked along the output dimension): ``gate = h[:, :F]``, ``up = h[:, F:]``. Both functions are one
``torch.library`` custom op, ``dropless::glu``, with the activation as an argument, a fake
implementation (``torch.compile`` traces through it) and a registered backward, itself the custom op
``dropless::glu_backward``; eager calls on plain tensors skip the dispatcher (``ops.direct``). The
backward recomputes the activation from h: h is saved, not ``a``. With ``grad_in_place=True`` it writes
``dh`` into h's memory (``dropless::glu_backward_into_h``), which the MoE layer uses: its gate/up output
is read by nothing else in the backward, and the backward's peak holds one ``[M, 2F]`` buffer less.

With ``recipe=`` they also return ``a`` quantized to FP8 along F, the operand the down projection's FP8
forward reads, written by the activation kernel from the same read of h (``dropless::glu_quantized``,
the same backward: the FP8 copy has no gradient). With ``grad_recipe=`` (rowwise) the backward kernel
also writes ``dh`` quantized along 2F, attached to ``dh`` for the FP8 product that made h
(``ops.fp8_gradient``), which then does not quantize it again.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dropless import reference
from dropless.backend import use_triton
from dropless.kernels.swiglu import glu_backward, glu_forward, glu_forward_quantized
from dropless.ops.checks import REFERENCE_DTYPES, TRITON_DTYPES, check_matrix, check_row_count, check_tensor
from dropless.ops.direct import DirectOp
from dropless.ops.fp8_gradient import attach_fp8_copy
from dropless.ops.grouped_mm_fp8 import resolve_recipe
from dropless.ops.quantize import _resolve_recipe, empty_quantized
from dropless.quantized import QuantizedTensor, Recipe, get_recipe, operand_recipes


def _glu(h: torch.Tensor, activation: str, grad_in_place: bool, rows: torch.Tensor | None, quantize_grad: bool,
         grad_pow2: bool) -> torch.Tensor:
    if not use_triton(h.device):
        return reference.glu(h, activation)
    a = torch.empty(h.shape[0], h.shape[1] // 2, dtype=h.dtype, device=h.device)
    glu_forward(h, a, activation, rows)
    return a


def _glu_fake(h: torch.Tensor, activation: str, grad_in_place: bool, rows: torch.Tensor | None, quantize_grad: bool,
              grad_pow2: bool) -> torch.Tensor:
    return h.new_empty(h.shape[0], h.shape[1] // 2)


def _glu_quantized(h: torch.Tensor, activation: str, grad_in_place: bool, rows: torch.Tensor | None,
                   quantize_grad: bool, grad_pow2: bool, recipe: str, pow2: bool,
                   mx_rounding: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(a, data, scale)``: a as ``_glu``, and a quantized along F with the recipe named ``recipe``."""
    r = get_recipe(recipe, pow2=pow2, mx_rounding=mx_rounding)
    if not use_triton(h.device):
        a = reference.glu(h, activation)
        return a, *reference.quantize(a, r, 1)
    a = torch.empty(h.shape[0], h.shape[1] // 2, dtype=h.dtype, device=h.device)
    data, scale = empty_quantized(a.shape, r, 1, None, h.device)
    glu_forward_quantized(h, a, data, scale, activation, r, rows)
    return a, data, scale


def _glu_quantized_fake(h: torch.Tensor, activation: str, grad_in_place: bool, rows: torch.Tensor | None,
                        quantize_grad: bool, grad_pow2: bool, recipe: str, pow2: bool,
                        mx_rounding: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    a = h.new_empty(h.shape[0], h.shape[1] // 2)
    return a, *empty_quantized(a.shape, get_recipe(recipe, pow2=pow2, mx_rounding=mx_rounding), 1, None, h.device)


def _glu_backward(h: torch.Tensor, da: torch.Tensor, activation: str, rows: torch.Tensor | None,
                  quantize: bool, pow2: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dh [M, 2F] = [da * up * act'(gate) | da * act(gate)]`` in h's dtype, and with ``quantize`` dh
    quantized rowwise along 2F (data, scale; empty ``[0]`` tensors without)."""
    if not use_triton(h.device):
        dh = reference.glu_backward(h, da, activation)
        return dh, *_reference_copy(dh, quantize, pow2)
    dh = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    data, scale = _copy_of(dh, quantize, pow2, lambda copy: glu_backward(h, da, dh, activation, rows, copy))
    return dh, data, scale


def _glu_backward_fake(h: torch.Tensor, da: torch.Tensor, activation: str, rows: torch.Tensor | None,
                       quantize: bool, pow2: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return h.new_empty(h.shape), *_copy_of(h, quantize, pow2, lambda copy: None)


def _glu_backward_into_h(h: torch.Tensor, da: torch.Tensor, activation: str, rows: torch.Tensor | None,
                         quantize: bool, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``_glu_backward`` written over h (each element pair of h is read before its gradient replaces it:
    the kernel reads a tile's gate and up columns before it writes theirs); returns the FP8 copy."""
    if not use_triton(h.device):
        h.copy_(reference.glu_backward(h, da, activation))
        return _reference_copy(h, quantize, pow2)
    copy = _copy_of(h, quantize, pow2, lambda copy: glu_backward(h, da, h, activation, rows, copy))
    torch.autograd.graph.increment_version(h)  # what saved h sees it changed, as after h.copy_
    return copy


def _glu_backward_into_h_fake(h: torch.Tensor, da: torch.Tensor, activation: str, rows: torch.Tensor | None,
                              quantize: bool, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _copy_of(h, quantize, pow2, lambda copy: None)


KernelCopy = tuple[torch.Tensor, torch.Tensor, Recipe]  # (data, scale, recipe), as glu_backward takes it


def _copy_of(dh: torch.Tensor, quantize: bool, pow2: bool,
             write: Callable[[KernelCopy | None], None]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` of dh's rowwise copy, made by ``write((data, scale, recipe))`` (the kernel that
    writes dh); without ``quantize``, ``write(None)`` and two empty ``[0]`` tensors."""
    if not quantize:
        write(None)
        return dh.new_empty(0), dh.new_empty(0)
    recipe = get_recipe("rowwise", pow2=pow2)
    data, scale = empty_quantized(tuple(dh.shape), recipe, 1, None, dh.device)
    write((data, scale, recipe))
    return data, scale


def _reference_copy(dh: torch.Tensor, quantize: bool, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference backend's ``(data, scale)`` of dh quantized rowwise, or two empty ``[0]`` tensors."""
    if not quantize:
        return dh.new_empty(0), dh.new_empty(0)
    return reference.quantize(dh, get_recipe("rowwise", pow2=pow2), 1)


def _setup_context(ctx, inputs, output) -> None:
    h, activation, grad_in_place, rows, quantize_grad, grad_pow2 = inputs[:6]
    ctx.save_for_backward(h, rows)
    ctx.activation = activation
    ctx.grad_in_place = grad_in_place
    ctx.grad_recipe = get_recipe("rowwise", pow2=grad_pow2) if quantize_grad else None
    if isinstance(output, tuple):  # glu_quantized: its FP8 copy (data, scale) has no gradient
        ctx.mark_non_differentiable(*output[1:])


def _backward(ctx, da: torch.Tensor, *fp8_grads):
    """``dh`` from ``da`` alone; no input after h (the activation, the row count, a recipe) has a
    gradient. Compiled graphs plan their own buffers and hand nothing between ops: they take the
    out-of-place op, with no FP8 copy of dh."""
    h, rows = ctx.saved_tensors
    compiling = torch.compiler.is_compiling()
    recipe = ctx.grad_recipe if not compiling else None
    quantize, pow2 = recipe is not None, recipe is not None and recipe.pow2
    if ctx.grad_in_place and not compiling:
        data, scale = _GLU_BACKWARD_INTO_H(h, da, ctx.activation, rows, quantize, pow2)
        dh = h
    else:
        dh, data, scale = _GLU_BACKWARD(h, da, ctx.activation, rows, quantize, pow2)
    if quantize:
        attach_fp8_copy(dh, QuantizedTensor(data, scale, recipe, 1))
    return dh, *([None] * (len(ctx.needs_input_grad) - 1))


_GLU = DirectOp.define("glu", _glu, _glu_fake, backward=_backward, setup_context=_setup_context)
_GLU_QUANTIZED = DirectOp.define("glu_quantized", _glu_quantized, _glu_quantized_fake, backward=_backward,
                                 setup_context=_setup_context)
_GLU_BACKWARD = DirectOp.define("glu_backward", _glu_backward, _glu_backward_fake)
_GLU_BACKWARD_INTO_H = DirectOp.define("glu_backward_into_h", _glu_backward_into_h, _glu_backward_into_h_fake,
                                       mutates_args=("h",))


def _gated(h: torch.Tensor, activation: str, recipe: str | Recipe | None, grad_in_place: bool,
           rows: torch.Tensor | None,
           grad_recipe: Recipe | None) -> torch.Tensor | tuple[torch.Tensor, QuantizedTensor]:
    check_tensor("h", h)
    quantized = recipe is not None
    check_matrix("h", h, 2, TRITON_DTYPES if use_triton(h.device) or quantized else REFERENCE_DTYPES)
    if h.shape[1] % 2:
        raise ValueError(f"h must have an even last dimension 2F (the gate and up halves, [M, 2F]), "
                         f"got shape {tuple(h.shape)}")
    if rows is not None:
        check_row_count(rows, h.device, "h")
    if grad_recipe is not None and (not isinstance(grad_recipe, Recipe) or grad_recipe.name != "rowwise"):
        raise ValueError(f"grad_recipe must be a rowwise dropless.Recipe (dh is quantized rowwise along 2F), "
                         f"got {grad_recipe!r}")
    grad = (grad_recipe is not None, grad_recipe is not None and grad_recipe.pow2)
    if not quantized:
        return _GLU(h, activation, grad_in_place, rows, *grad)
    act, _ = operand_recipes(resolve_recipe(recipe))
    act = _resolve_recipe(act, None, None)  # its options checked as dropless.quantize checks them
    a, data, scale = _GLU_QUANTIZED(h, activation, grad_in_place, rows, *grad, act.name, act.pow2, act.mx_rounding)
    return a, QuantizedTensor(data, scale, act, 1)


def swiglu(h: torch.Tensor, *, recipe: str | Recipe | None = None, grad_in_place: bool = False,
           rows: torch.Tensor | None = None,
           grad_recipe: Recipe | None = None) -> torch.Tensor | tuple[torch.Tensor, QuantizedTensor]:
    """SwiGLU on the fused gate+up layout: ``a = silu(h[:, :F]) * h[:, F:]``.

    Args:
        h: ``[M, 2F]``, gate columns then up columns; bf16, fp16 or fp32 (fp64 on the reference
            backend without a recipe); any strides (a column slice of a wider matrix is read in place,
            no copy).
        recipe: also return ``a`` quantized to FP8 along F for an FP8 grouped GEMM of this recipe
            (``"rowwise"``, ``"block128"``, ``"mxfp8"`` or a ``dropless.Recipe``, resolved as the GEMMs
            resolve it: ``"mxfp8"`` by name rounds its scales ``"rceil"``), made by the same kernel from
            the same read of h.
        grad_in_place: the backward writes ``dh`` into h's memory instead of a new ``[M, 2F]`` tensor
            (one buffer less at the backward's peak). Only where nothing else reads h in the backward
            (nothing else saved it, as in the MoE layer, where h is the gate/up product's output); a
            second backward through the same graph (``retain_graph``) then raises, h having changed.
        rows: int32/int64 ``[1]`` on h's device: the rows that hold data (the first ``rows[0]``, read on
            the device), as in an expert-parallel buffer sized for the most a rank can receive. Only
            those are computed, forward and backward; the other rows of ``a`` (and of its FP8 copy, and
            of ``dh``) are left unwritten (the reference backend computes them all).
        grad_recipe: a rowwise ``dropless.Recipe``: the backward kernel also writes ``dh`` quantized
            along 2F with it (``dropless.quantize(dh, grad_recipe, dim=-1)``'s bits), attached to dh for
            the FP8 grouped GEMM that made h, whose backward then reads it instead of quantizing dh
            (``ops.fp8_gradient``). Eager only: a compiled backward quantizes dh in the product.
    Returns:
        ``a [M, F]`` in h's dtype, computed in fp32. Differentiable in h: ``dh [M, 2F]`` in h's
        dtype, recomputed from h in the backward. With a recipe, ``(a, a_fp8)``: ``a_fp8`` is the
        ``QuantizedTensor`` of ``dropless.quantize(a, recipe, dim=-1)``, bit for bit (quantized from
        a's values as rounded to its dtype): data float8_e4m3fn ``[M, F]`` row-major, scale ``[M, 1]``
        (rowwise) or ``[M, cdiv(F, block)]``, fp32 or float8_e8m0fnu (mxfp8); it carries no gradient.
        No host sync.
    """
    return _gated(h, "silu", recipe, grad_in_place, rows, grad_recipe)


def geglu(h: torch.Tensor, *, recipe: str | Recipe | None = None, grad_in_place: bool = False,
          rows: torch.Tensor | None = None,
          grad_recipe: Recipe | None = None) -> torch.Tensor | tuple[torch.Tensor, QuantizedTensor]:
    """GeGLU (tanh approximation) on the fused gate+up layout: ``a = gelu_tanh(h[:, :F]) * h[:, F:]``.

    ``gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)))``, as
    ``torch.nn.functional.gelu(g, approximate="tanh")``. Shapes, dtypes, layouts, the FP8 copy with a
    ``recipe``, ``grad_in_place``, ``rows``, ``grad_recipe`` and the gradient as ``swiglu``.
    """
    return _gated(h, "gelu_tanh", recipe, grad_in_place, rows, grad_recipe)
