"""Grouped GEMM ops: ``grouped_mm`` (ragged M, differentiable) and ``grouped_mm_wgrad`` (ragged K).

Both are ``torch.library`` custom ops with fake implementations, so ``torch.compile`` traces through
them; eager calls on plain tensors run the same implementations without the dispatcher
(``ops.direct``). Neither reads the group boundaries on the host when it runs on the Triton backend.
"""

from __future__ import annotations

import torch

from dropless import reference
from dropless.backend import use_triton
from dropless.kernels.launch import weight_nk
from dropless.kernels.ragged_k import ACCUMULATE_ALL, ACCUMULATE_FLAGGED, NO_ACCUMULATE
from dropless.kernels.tuning import run_ragged_k, run_ragged_m
from dropless.ops.autocast import autocast_operands
from dropless.ops.checks import (
    REFERENCE_DTYPES,
    TRITON_DTYPES,
    check_matrix,
    check_same_device,
    check_tensor,
    resolve_offsets,
    validate_offsets,
)
from dropless.ops.direct import DirectOp
from dropless.ops.grouped_mm_fp8 import fp8_grouped_mm, fp8_grouped_mm_wgrad, resolve_recipe
from dropless.quantized import QuantizedTensor, Recipe


def _forward(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    if not use_triton(x.device):
        return reference.grouped_mm(x, w, offsets)
    y = torch.empty(x.shape[0], w.shape[2], dtype=x.dtype, device=x.device)
    if x.shape[1] == 0:
        y.zero_()
    elif y.numel() > 0:
        run_ragged_m(x, w, offsets, y)
    return y


def _wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``dw [E, K, N]`` in x's dtype, or its transpose ``[E, N, K]`` (contiguous) if ``transposed``."""
    E, K, N = offsets.shape[0], x.shape[1], dy.shape[1]
    if not use_triton(x.device):
        dw = reference.grouped_mm_wgrad(x, dy, offsets).to(x.dtype)
        return dw.transpose(1, 2).contiguous() if transposed else dw
    dw = torch.empty((E, N, K) if transposed else (E, K, N), dtype=x.dtype, device=x.device)
    _launch_wgrad(x, dy, offsets, dw.transpose(1, 2) if transposed else dw, NO_ACCUMULATE, None)
    return dw


def _wgrad_into(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor,
                flags: torch.Tensor | None, accumulate: bool) -> None:
    if not use_triton(x.device):
        dw = reference.grouped_mm_wgrad(x, dy, offsets)
        reference.accumulate_into(out, dw, flags if flags is not None else accumulate)
        return
    mode = ACCUMULATE_FLAGGED if flags is not None else ACCUMULATE_ALL if accumulate else NO_ACCUMULATE
    _launch_wgrad(x, dy, offsets, out, mode, flags)


def _launch_wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor,
                  mode: int, flags: torch.Tensor | None) -> None:
    if out.numel() == 0:
        return
    if x.shape[0] == 0:
        # No rows at all: every group is empty.
        if mode == NO_ACCUMULATE:
            out.zero_()
        elif mode == ACCUMULATE_FLAGGED:
            out.masked_fill_(~flags.view(-1, 1, 1), 0)
        return
    run_ragged_k(x, dy, offsets, out, mode, flags)


def _forward_fake(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[2])


def _wgrad_fake(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, transposed: bool) -> torch.Tensor:
    E, K, N = offsets.shape[0], x.shape[1], dy.shape[1]
    return x.new_empty((E, N, K) if transposed else (E, K, N))


def _wgrad_into_fake(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor,
                     flags: torch.Tensor | None, accumulate: bool) -> None:
    return None


def _setup_context(ctx, inputs, output) -> None:
    x, w, offsets = inputs
    ctx.save_for_backward(x, w, offsets)


def _backward(ctx, dy: torch.Tensor):
    x, w, offsets = ctx.saved_tensors
    dx = dw = None
    if ctx.needs_input_grad[0]:
        dx = _GROUPED_MM(dy, w.transpose(1, 2), offsets)
    if ctx.needs_input_grad[1]:
        # Give dw the layout of w: nn.Linear-layout weights viewed as [E, K, N] get [E, N, K] storage.
        transposed = weight_nk(w)
        dw = _WGRAD(x, dy, offsets, transposed)
        dw = dw.transpose(1, 2) if transposed else dw
    return dx, dw, None


_GROUPED_MM = DirectOp.define("grouped_mm", _forward, _forward_fake, backward=_backward,
                             setup_context=_setup_context)
_WGRAD = DirectOp.define("grouped_mm_wgrad", _wgrad, _wgrad_fake)
_WGRAD_INTO = DirectOp.define("grouped_mm_wgrad_into", _wgrad_into, _wgrad_into_fake, mutates_args=("out",))


def _check_operands(x: torch.Tensor, name: str, other: torch.Tensor, other_ndim: int) -> None:
    """x is a matrix and ``other`` a tensor of ``other_ndim`` dims, of one dtype the backend takes,
    on one device."""
    check_tensor("x", x)
    dtypes = TRITON_DTYPES if use_triton(x.device) else REFERENCE_DTYPES
    check_matrix("x", x, 2, dtypes)
    check_matrix(name, other, other_ndim, dtypes)
    if other.dtype != x.dtype:
        raise TypeError(f"{name} must have x's dtype {x.dtype}, got {other.dtype}")
    check_same_device(x.device, **{name: other})


def grouped_mm(x: torch.Tensor | QuantizedTensor, w: torch.Tensor | QuantizedTensor,
               offsets: torch.Tensor | None = None, *, group_sizes: torch.Tensor | None = None,
               offs: torch.Tensor | None = None, recipe: str | Recipe | None = None,
               w_quantized: tuple[QuantizedTensor, QuantizedTensor] | None = None) -> torch.Tensor:
    """Grouped GEMM over row groups: ``y[s_e:t_e] = x[s_e:t_e] @ w[e]``.

    Args:
        x: ``[M, K]`` rows sorted by group; bf16, fp16 or fp32 (fp64 on the reference backend).
        w: ``[E, K, N]``, same dtype, any strides (``weight.transpose(1, 2)`` of nn.Linear-layout
            ``[E, N, K]`` weights works without a copy).
        offsets: int32/int64 ``[E]`` cumulative group ends on x's device (``offs`` is an alias, as
            in ``torch._grouped_mm``); or give ``group_sizes [E]`` instead.
        recipe: run in FP8 (``"rowwise"``, ``"block128"`` or ``"mxfp8"``, or a ``dropless.Recipe``):
            x, w, and in the backward dy, are quantized (``dropless.quantize``), multiplied on FP8
            tensor cores with fp32 accumulation, and y comes out in x's dtype. x and w may also be
            given as ``QuantizedTensor`` (x along K, w ``[E, K, N]`` along K): a forward product only,
            bf16 out, recipe taken from them if not given.
        w_quantized: with a recipe, ``dropless.quantize_weight(w, recipe)``'s pair, kept by the caller
            while w is unchanged, so the weight is not quantized again on every call.
    Returns:
        ``y [M, N]`` in x's dtype. Rows past ``offsets[-1]`` are zero. Differentiable in x and w.
        Under ``torch.autocast`` x and w are first cast to its dtype, as ``nn.Linear``'s operands are
        (in FP8, the quantization reads them as they are).

    No host sync on the Triton backend: the kernel derives its tiles from ``offsets`` on the device,
    so the call can be captured in a CUDA graph.
    """
    if offs is not None:
        if offsets is not None:
            raise ValueError("pass offsets or its alias offs, not both")
        offsets = offs
    if recipe is not None or isinstance(x, QuantizedTensor) or isinstance(w, QuantizedTensor):
        recipe = resolve_recipe(recipe, x, w)
        _check_fp8_operands(x, "w", w, 3)
        offsets = resolve_offsets(offsets, group_sizes, w.shape[0], x.device)
        validate_offsets(offsets, x.shape[0])
        return fp8_grouped_mm(x, w, offsets, recipe, w_quantized)
    if w_quantized is not None:
        raise ValueError("w_quantized needs recipe= (it is the FP8 copy of w)")
    x, w = autocast_operands(x, w)
    _check_operands(x, "w", w, 3)
    if w.shape[1] != x.shape[1]:
        raise ValueError(f"w must have shape [E, K={x.shape[1]}, N] to match x [M, K], got {tuple(w.shape)}")
    if w.shape[0] == 0:
        raise ValueError("w must hold at least one expert (E >= 1)")
    offsets = resolve_offsets(offsets, group_sizes, w.shape[0], x.device)
    validate_offsets(offsets, x.shape[0])
    return _GROUPED_MM(x, w, offsets)


def grouped_mm_wgrad(x: torch.Tensor | QuantizedTensor, dy: torch.Tensor | QuantizedTensor,
                     offsets: torch.Tensor | None = None, *, group_sizes: torch.Tensor | None = None,
                     out: torch.Tensor | None = None, accumulate: bool | torch.Tensor = False,
                     recipe: str | Recipe | None = None) -> torch.Tensor:
    """Weight gradient of ``grouped_mm``: ``dw[e] = x[s_e:t_e]^T @ dy[s_e:t_e]``, zero for an empty group.

    Args:
        x: ``[M, K]`` and dy: ``[M, N]``, same dtype (bf16, fp16, fp32), rows sorted by group.
        offsets: int ``[E]`` cumulative group ends (or ``group_sizes [E]``) on x's device.
        out: optional ``[E, K, N]`` tensor to write, any strides (an fp32 ``main_grad``, or a
            transposed view of an ``[E, N, K]`` one); x's dtype or fp32.
        accumulate: with ``out``: ``True`` adds into it in the kernel's epilogue (no extra pass over
            memory); a bool ``[E]`` tensor on the device adds for the experts marked True and
            overwrites the others; ``False`` overwrites.
        recipe: run in FP8: x and dy quantized along the tokens, blocks restarting at every group
            (``dropless.quantize(t, recipe, dim=0, offsets=offsets)``), or given so as QuantizedTensors.
    Returns:
        ``out``, or a new ``[E, K, N]`` tensor in x's dtype (bf16 for a quantized x). No host sync on
        the Triton backend.
    """
    fp8 = recipe is not None or isinstance(x, QuantizedTensor) or isinstance(dy, QuantizedTensor)
    if fp8:
        recipe = resolve_recipe(recipe, x, dy)
        _check_fp8_operands(x, "dy", dy, 2)
    else:
        _check_operands(x, "dy", dy, 2)
    M = _rows(x)
    if _rows(dy) != M:
        raise ValueError(f"dy must have x's number of rows M={M}, got {_rows(dy)} (shape {tuple(dy.shape)})")
    source = offsets if offsets is not None else group_sizes
    E = source.shape[0] if isinstance(source, torch.Tensor) and source.dim() == 1 else -1
    offsets = resolve_offsets(offsets, group_sizes, E, x.device)
    validate_offsets(offsets, M)
    K, N = x.shape[1], dy.shape[1]
    if out is None:
        if accumulate is not False:
            raise ValueError("accumulate needs out= (the tensor to accumulate into)")
        return fp8_grouped_mm_wgrad(x, dy, offsets, recipe, None, None, False) if fp8 else _WGRAD(x, dy, offsets, False)
    check_matrix("out", out, 3, (x.dtype if isinstance(x, torch.Tensor) else torch.bfloat16, torch.float32))
    if tuple(out.shape) != (E, K, N):
        raise ValueError(f"out must have shape [E, K, N] = [{E}, {K}, {N}], got {tuple(out.shape)}")
    check_same_device(x.device, out=out)
    flags = None
    if isinstance(accumulate, torch.Tensor):
        if accumulate.dtype != torch.bool or tuple(accumulate.shape) != (E,):
            raise ValueError(f"accumulate as a tensor must be bool [E] = [{E}], got {accumulate.dtype} "
                             f"{tuple(accumulate.shape)}")
        check_same_device(x.device, accumulate=accumulate)
        flags = accumulate
    elif not isinstance(accumulate, bool):
        raise TypeError(f"accumulate must be a bool or a bool tensor [E], got {type(accumulate).__name__}")
    if fp8:
        return fp8_grouped_mm_wgrad(x, dy, offsets, recipe, out, flags, bool(accumulate) if flags is None else True)
    _WGRAD_INTO(x, dy, offsets, out, flags, bool(accumulate) if flags is None else True)
    return out


def _check_fp8_operands(a: torch.Tensor | QuantizedTensor, name: str, b: torch.Tensor | QuantizedTensor,
                        b_ndim: int) -> None:
    """x is a matrix and ``b`` a tensor of ``b_ndim`` dims, each a tensor of a dtype the quantization
    takes (bf16, fp16, fp32) or a QuantizedTensor, on one device; a weight ``b`` with x's K (the wgrad
    checks its rows itself)."""
    for arg, t, ndim in (("x", a, 2), (name, b, b_ndim)):
        if isinstance(t, QuantizedTensor):
            if len(t.shape) != ndim:
                raise ValueError(f"{arg} must have {ndim} dimensions, got shape {tuple(t.shape)}")
            continue
        check_matrix(arg, t, ndim, TRITON_DTYPES)
    check_same_device(a.device, **{name: b.data if isinstance(b, QuantizedTensor) else b})
    if b_ndim == 3 and b.shape[1] != a.shape[1]:
        raise ValueError(f"{name} must have shape [E, K={a.shape[1]}, N] to match x [M, K], got {tuple(b.shape)}")


def _rows(t: torch.Tensor | QuantizedTensor) -> int:
    """M of a wgrad operand: its rows, or those of the tensor a per-group QuantizedTensor was quantized
    from (its data has ``128 * (cdiv(M, 128) + E)``)."""
    if isinstance(t, QuantizedTensor) and t.offsets is not None and isinstance(t.tokens, int):
        return t.tokens
    return t.shape[0]
