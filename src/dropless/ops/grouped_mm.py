"""Grouped GEMM API: ``grouped_mm`` (the four forms of ``torch._grouped_mm``, differentiable) and
``grouped_mm_wgrad`` (ragged K, into a new tensor or written or accumulated into ``out``).

The products are ``torch.library`` custom ops with fake implementations (``ops.grouped_forms`` and
``grouped_mm_wgrad_into`` here), so ``torch.compile`` traces through them; eager calls on plain tensors
run the same implementations without the dispatcher (``ops.direct``). None reads the group boundaries
on the host when it runs on the Triton backend. This module checks the arguments and picks the op.
"""

from __future__ import annotations

import torch

from dropless import reference
from dropless.backend import use_triton
from dropless.kernels.ragged_k import ACCUMULATE_ALL, ACCUMULATE_FLAGGED, NO_ACCUMULATE
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
from dropless.ops.grouped_forms import RAGGED_K, RAGGED_M, RAGGED_N, batched_mm, launch_ragged_k
from dropless.ops.grouped_mm_fp8 import fp8_grouped_mm, fp8_grouped_mm_wgrad, resolve_recipe
from dropless.quantized import QuantizedTensor, Recipe


def _wgrad_into(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor,
                flags: torch.Tensor | None, accumulate: bool) -> None:
    if not use_triton(x.device):
        dw = reference.grouped_mm_wgrad(x, dy, offsets)
        reference.accumulate_into(out, dw, flags if flags is not None else accumulate)
        return
    mode = ACCUMULATE_FLAGGED if flags is not None else ACCUMULATE_ALL if accumulate else NO_ACCUMULATE
    launch_ragged_k(x, dy, offsets, out, mode, flags)


def _wgrad_into_fake(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor, out: torch.Tensor,
                     flags: torch.Tensor | None, accumulate: bool) -> None:
    return None


_WGRAD_INTO = DirectOp.define("grouped_mm_wgrad_into", _wgrad_into, _wgrad_into_fake, mutates_args=("out",))


def _check_operands(x: torch.Tensor, x_ndim: int | tuple[int, ...], name: str, other: torch.Tensor,
                    other_ndim: int | tuple[int, ...]) -> tuple[torch.dtype, ...]:
    """x and ``other`` are tensors of the given numbers of dims, of one dtype the backend takes, on one
    device; returns the dtypes the backend takes."""
    check_tensor("x", x)
    dtypes = TRITON_DTYPES if use_triton(x.device) else REFERENCE_DTYPES
    check_matrix("x", x, x_ndim, dtypes)
    check_matrix(name, other, other_ndim, dtypes)
    if other.dtype != x.dtype:
        raise TypeError(f"{name} must have x's dtype {x.dtype}, got {other.dtype}")
    check_same_device(x.device, **{name: other})
    return dtypes


def _groups(offsets: object, group_sizes: object) -> int:
    """The number of groups that ``offsets`` or ``group_sizes`` give, -1 if neither is a 1D tensor
    (``resolve_offsets`` then names what is wrong)."""
    source = offsets if offsets is not None else group_sizes
    return source.shape[0] if isinstance(source, torch.Tensor) and source.dim() == 1 else -1


def _check_form(x: torch.Tensor, w: torch.Tensor) -> tuple[int, int, str]:
    """Check that w fits x in their form; returns ``(G, S, dim)``: the number of groups (-1: as many as
    offsets hold), and the size S and name of the dim the offsets split."""
    if x.dim() == 2 and w.dim() == 3:
        if w.shape[1] != x.shape[1]:
            raise ValueError(f"w must have shape [E, K={x.shape[1]}, N] to match x [M, K], got {tuple(w.shape)}")
        if w.shape[0] == 0:
            raise ValueError("w must hold at least one expert (E >= 1)")
        return w.shape[0], x.shape[0], "M"
    if w.shape[0] != x.shape[-1]:
        x_shape = "[M, K]" if x.dim() == 2 else "[G, M, K]"
        raise ValueError(f"w must have shape [K={x.shape[-1]}, N] to match x {x_shape}, got {tuple(w.shape)}")
    if x.dim() == 2:
        return -1, x.shape[1], "K"
    if x.shape[0] == 0:
        raise ValueError("x must hold at least one group (G >= 1)")
    return x.shape[0], w.shape[1], "N"


def _check_batched(x: torch.Tensor, w: torch.Tensor, **offsets: object) -> None:
    """The 3d/3d form: w ``[G, K, N]`` fits x ``[G, M, K]``, and no offsets are given."""
    G, _, K = x.shape
    if w.shape[0] != G or w.shape[1] != K:
        raise ValueError(f"w must have shape [G={G}, K={K}, N] to match x [G, M, K], got {tuple(w.shape)}")
    for name, value in offsets.items():
        if value is not None:
            raise ValueError(f"{name} must not be given with a 3d x and a 3d w (the batched form, "
                             "out[g] = x[g] @ w[g], has no groups to split)")


def grouped_mm(x: torch.Tensor | QuantizedTensor, w: torch.Tensor | QuantizedTensor,
               offsets: torch.Tensor | None = None, *, group_sizes: torch.Tensor | None = None,
               offs: torch.Tensor | None = None, recipe: str | Recipe | None = None,
               w_quantized: tuple[QuantizedTensor, QuantizedTensor] | None = None,
               out_dtype: torch.dtype | None = None, tail: bool = True) -> torch.Tensor:
    """Grouped GEMM in the four forms of ``torch._grouped_mm``, a drop-in for it.

    With ``s_g = offsets[g-1]`` (0 for g = 0) and ``t_g = offsets[g]``:

    - x ``[M, K]``, w ``[E, K, N]`` (ragged M, the MoE forward): ``y[s_e:t_e] = x[s_e:t_e] @ w[e]``,
      ``y [M, N]``; rows past ``offsets[-1]`` are zero.
    - x ``[M, K]``, w ``[K, N]`` (ragged K, the weight-gradient form): offsets split K,
      ``y[g] = x[:, s_g:t_g] @ w[s_g:t_g]``, ``y [G, M, N]``; K past ``offsets[-1]`` is left out.
    - x ``[G, M, K]``, w ``[K, N]`` (ragged N): offsets split N, ``y[:, s_g:t_g] = x[g] @ w[:, s_g:t_g]``,
      ``y [M, N]``; columns past ``offsets[-1]`` are zero.
    - x ``[G, M, K]``, w ``[G, K, N]`` (batched, no offsets): ``y[g] = x[g] @ w[g]``, ``y [G, M, N]``.

    ``dropless.ops.grouped_forms`` says which kernel runs each form (all on views of the operands) and
    how the gradients of each form are other forms.

    Args:
        x, w: bf16, fp16 or fp32 (fp64 on the reference backend), one dtype, any strides
            (``weight.transpose(1, 2)`` of nn.Linear-layout ``[E, N, K]`` weights works without a copy).
        offsets: int32/int64 ``[G]`` cumulative group ends on x's device (``offs`` is an alias, as in
            ``torch._grouped_mm``); or give ``group_sizes [G]`` instead. Not for the batched form.
        out_dtype: y's dtype (default x's), any the backend takes: e.g. bf16 operands with an fp32 y
            straight from the fp32 accumulator. The gradients come in the operands' dtypes (dy is cast
            to it first).
        recipe: run in FP8 (ragged M only; ``"rowwise"``, ``"block128"`` or ``"mxfp8"``, or a
            ``dropless.Recipe``): x, w, and in the backward dy, are quantized (``dropless.quantize``),
            multiplied on FP8 tensor cores with fp32 accumulation, and y comes out in x's dtype. x and w
            may also be given as ``QuantizedTensor`` (x along K, w ``[E, K, N]`` along K): a forward
            product only, bf16 out, recipe taken from them if not given.
        w_quantized: with a recipe, ``dropless.quantize_weight(w, recipe)``'s pair, kept by the caller
            while w is unchanged, so the weight is not quantized again on every call.
        tail: ragged M only. False leaves y's rows past ``offsets[-1]`` unwritten (they hold anything),
            and x's gradient's too: for a caller that reads none of them, such as the experts of a
            worst-case-sized receive buffer, which would otherwise spend a write of zeros over them.
    Returns:
        y, a new contiguous tensor, differentiable in x and w (the rows, columns or stretch of K past
        ``offsets[-1]`` get zero gradients). Under ``torch.autocast`` x and w are first cast to its
        dtype, as ``nn.Linear``'s operands are (in FP8, the quantization reads them as they are).

    No host sync on the Triton backend: the kernels derive their tiles from ``offsets`` on the device,
    so the call can be captured in a CUDA graph.
    """
    offsets_name = "offs" if offs is not None else "offsets"
    if offs is not None:
        if offsets is not None:
            raise ValueError("pass offsets or its alias offs, not both")
        offsets = offs
    if recipe is not None or isinstance(x, QuantizedTensor) or isinstance(w, QuantizedTensor):
        if out_dtype is not None:
            raise ValueError("out_dtype cannot be given with recipe= (FP8 products come out in x's dtype)")
        operands = (torch.Tensor, QuantizedTensor)
        if isinstance(x, operands) and isinstance(w, operands) and (len(x.shape), len(w.shape)) != (2, 3):
            raise ValueError(f"recipe= (FP8) runs the ragged-M form only, x [M, K] and w [E, K, N]; got x of "
                             f"shape {tuple(x.shape)} and w of shape {tuple(w.shape)}")
        recipe = resolve_recipe(recipe, x, w)
        _check_fp8_operands(x, "w", w, 3)
        offsets = resolve_offsets(offsets, group_sizes, w.shape[0], x.device)
        validate_offsets(offsets, x.shape[0])
        return fp8_grouped_mm(x, w, offsets, recipe, w_quantized, tail=_check_tail(tail, True))
    if w_quantized is not None:
        raise ValueError("w_quantized needs recipe= (it is the FP8 copy of w)")
    x, w = autocast_operands(x, w)
    dtypes = _check_operands(x, (2, 3), "w", w, (2, 3))
    if out_dtype is not None and out_dtype not in dtypes:
        raise TypeError(f"out_dtype must be one of {[str(d) for d in dtypes]} (or None: x's dtype), got {out_dtype!r}")
    _check_tail(tail, x.dim() == 2 and w.dim() == 3)
    if x.dim() == 3 and w.dim() == 3:
        _check_batched(x, w, **{offsets_name: offsets, "group_sizes": group_sizes})
        return batched_mm(x, w, out_dtype)
    G, size, dim = _check_form(x, w)
    if G < 0:
        G = _groups(offsets, group_sizes)
    offsets = resolve_offsets(offsets, group_sizes, G, x.device)
    validate_offsets(offsets, size, dim)
    if w.dim() == 3:
        return RAGGED_M(x, w, offsets, out_dtype, tail)
    return (RAGGED_K if x.dim() == 2 else RAGGED_N)(x, w, offsets, out_dtype)


def _check_tail(tail: object, ragged_m: bool) -> bool:
    """``tail`` is a bool, and False only for the ragged-M form."""
    if not isinstance(tail, bool):
        raise TypeError(f"tail must be a bool, got {type(tail).__name__}")
    if not tail and not ragged_m:
        raise ValueError("tail=False is for the ragged-M form only (x [M, K], w [E, K, N]): the other forms have "
                         "no rows past the groups")
    return tail


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
        _check_operands(x, 2, "dy", dy, 2)
    M = _rows(x)
    if _rows(dy) != M:
        raise ValueError(f"dy must have x's number of rows M={M}, got {_rows(dy)} (shape {tuple(dy.shape)})")
    E = _groups(offsets, group_sizes)
    offsets = resolve_offsets(offsets, group_sizes, E, x.device)
    validate_offsets(offsets, M)
    K, N = x.shape[1], dy.shape[1]
    if out is None:
        if accumulate is not False:
            raise ValueError("accumulate needs out= (the tensor to accumulate into)")
        if fp8:
            return fp8_grouped_mm_wgrad(x, dy, offsets, recipe, None, None, False)
        return RAGGED_K(x.t(), dy, offsets, None)
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
