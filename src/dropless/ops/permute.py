"""Permute and unpermute: the gathers around the grouped GEMMs of a dropless MoE layer.

    x_sorted, sorted_to_token_slot, group_sizes, offsets = permute(x, topk_ids, E)
    y_sorted = grouped_mm(x_sorted, w, offsets)           # or any per-expert computation
    y = unpermute(y_sorted, sorted_to_token_slot, weights, offsets)

Token t's k copies are the slots ``s = t*k + j``; permute sorts them by expert, stably, so the result
is deterministic and each expert's rows keep token order. Expert ids outside ``[0, E)`` (the
expert-parallel sentinel ``>= E``: the copy goes to no local expert) sort after every expert, past
``offsets[-1]``; their rows are zeros and unpermute skips them.

permute is the sort (``sort_by_expert``, PyTorch ops) and the gather of the rows (``gather_copies``, which
takes a sort made elsewhere too: ``route(..., sort=True)``'s); the gather and unpermute are
``torch.library`` custom ops with fake implementations and autograd, so ``torch.compile(fullgraph=True)``
traces through them; eager calls on plain tensors skip the dispatcher (``ops.direct``). Output shapes
depend only on ``T``, ``k``, ``d`` and ``E``, and nothing reads the routing on the host: no host sync on the
Triton backend (the sort, the counts and the inverse map are device ops; the gathers are Triton kernels).
"""

from __future__ import annotations

import torch

from dropless import reference
from dropless.backend import use_triton
from dropless.kernels.permute import permute_rows, unpermute_rows
from dropless.ops.checks import (
    REFERENCE_DTYPES,
    TRITON_DTYPES,
    check_matrix,
    check_same_device,
    check_tensor,
    validate_offsets,
)
from dropless.ops.direct import DirectOp
from dropless.ops.fp8_gradient import attach_fp8_copy
from dropless.ops.quantize import recipe_of, empty_quantized
from dropless.quantized import QuantizedTensor, Recipe

INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_ROWS = 2**31 - 1  # sorted_to_token_slot and offsets are int32


def sort_by_expert(topk_ids: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sorted_to_token_slot`` int32 ``[T*k]``, ``group_sizes`` and ``offsets`` int32 ``[E]``, on the
    device. The offsets come from a binary search of the sorted ids (no bincount, which syncs, and
    no atomics). The ids are sorted as the narrowest integers that hold E: a radix sort takes one pass
    per byte of its keys."""
    ids = topk_ids.reshape(-1)
    ids = torch.where((ids >= 0) & (ids < E), ids, E).to(torch.int16 if E < 2**15 else torch.int32)
    sorted_ids, order = torch.sort(ids, stable=True)
    experts = torch.arange(E, dtype=ids.dtype, device=ids.device)
    offsets = torch.searchsorted(sorted_ids, experts, right=True, out_int32=True)
    group_sizes = torch.diff(offsets, prepend=offsets.new_zeros(1))
    return order.to(torch.int32), group_sizes, offsets


_INVERSE = "_dropless_slot_to_sorted"


def _invert(sorted_to_token_slot: torch.Tensor) -> torch.Tensor:
    """``slot_to_sorted [T*k]``: the sorted row of each slot (a scatter; no host sync). A layer's step
    needs it in every gather (permute, unpermute, their backwards), so it is kept on
    ``sorted_to_token_slot`` with that tensor's version and computed once while the tensor is unchanged
    (eager calls; a compiled graph computes it where it is used)."""
    compiling = torch.compiler.is_compiling()
    held = None if compiling else sorted_to_token_slot.__dict__.get(_INVERSE)
    if held is not None and held[0] == sorted_to_token_slot._version:
        return held[1]
    M = sorted_to_token_slot.shape[0]
    rows = torch.arange(M, dtype=sorted_to_token_slot.dtype, device=sorted_to_token_slot.device)
    inverse = torch.empty_like(sorted_to_token_slot).scatter_(0, sorted_to_token_slot.long(), rows)
    if not compiling:
        keep_inverse(sorted_to_token_slot, inverse)
    return inverse


def keep_inverse(sorted_to_token_slot: torch.Tensor, slot_to_sorted: torch.Tensor) -> None:
    """Keep ``slot_to_sorted`` (made by whoever sorted the copies) on ``sorted_to_token_slot`` for the gathers,
    which then do not invert the sort again while the tensor is unchanged."""
    setattr(sorted_to_token_slot, _INVERSE, (sorted_to_token_slot._version, slot_to_sorted))


def _top_k(weights: torch.Tensor | None, sorted_rows: int, num_tokens: int) -> int:
    """k, from the weights ``[T, k]`` when given (``T`` may be 0), else from ``T*k`` rows."""
    if weights is not None:
        return weights.shape[1]
    return sorted_rows // num_tokens if num_tokens else 0


def _reference_copies(x: torch.Tensor, sorted_to_token_slot: torch.Tensor, offsets: torch.Tensor,
                      top_k: int) -> torch.Tensor:
    """permute's rows of x, ``x[sorted_to_token_slot[p] // top_k]``, zero at or past ``offsets[-1]``, in PyTorch."""
    rows = x.index_select(0, sorted_to_token_slot.long() // top_k)
    valid = torch.arange(sorted_to_token_slot.shape[0], device=x.device) < offsets[-1:]
    return torch.where(valid[:, None], rows, torch.zeros((), dtype=x.dtype, device=x.device))


def _gather_copies(x: torch.Tensor, sorted_to_token_slot: torch.Tensor, offsets: torch.Tensor,
                   top_k: int) -> torch.Tensor:
    if not use_triton(x.device):
        return _reference_copies(x, sorted_to_token_slot, offsets, top_k)
    x_sorted = torch.empty(sorted_to_token_slot.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
    permute_rows(x, _invert(sorted_to_token_slot), offsets, top_k, x_sorted)
    return x_sorted


def _gather_copies_fake(x: torch.Tensor, sorted_to_token_slot: torch.Tensor, offsets: torch.Tensor,
                        top_k: int) -> torch.Tensor:
    return x.new_empty(sorted_to_token_slot.shape[0], x.shape[1])


def _recipe_args(recipe: Recipe | None) -> tuple[str | None, bool, str]:
    """A recipe as the custom ops take it: name (None for no recipe), pow2, mx_rounding."""
    return (recipe.name, recipe.pow2, recipe.mx_rounding) if recipe is not None else (None, False, "floor")


def _unpermute(y_sorted: torch.Tensor, sorted_to_token_slot: torch.Tensor, weights: torch.Tensor | None,
               offsets: torch.Tensor, num_tokens: int, grad_recipe: str | None, pow2: bool,
               mx_rounding: str) -> torch.Tensor:
    """``y [T, d]``; ``weights=None`` sums the copies unweighted (permute's backward). ``grad_recipe``
    (and its options) is read by the backward only."""
    k = _top_k(weights, y_sorted.shape[0], num_tokens)
    if not use_triton(y_sorted.device):
        w = weights if weights is not None else y_sorted.new_ones(num_tokens, k)
        return reference.unpermute(y_sorted, sorted_to_token_slot, w, offsets)
    y = torch.empty(num_tokens, y_sorted.shape[1], dtype=y_sorted.dtype, device=y_sorted.device)
    unpermute_rows(y_sorted, _invert(sorted_to_token_slot), offsets, k, y, weights)
    return y


def _unpermute_fake(y_sorted: torch.Tensor, sorted_to_token_slot: torch.Tensor, weights: torch.Tensor | None,
                    offsets: torch.Tensor, num_tokens: int, grad_recipe: str | None, pow2: bool,
                    mx_rounding: str) -> torch.Tensor:
    return y_sorted.new_empty(num_tokens, y_sorted.shape[1])


def _unpermute_backward(dy: torch.Tensor, y_sorted: torch.Tensor, sorted_to_token_slot: torch.Tensor,
                        weights: torch.Tensor | None, offsets: torch.Tensor, need_dweights: bool,
                        grad_recipe: str | None, pow2: bool, mx_rounding: str
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``dy_sorted [T*k, d]`` in dy's dtype, ``dweights [T, k]`` in weights' dtype (an empty ``[0]``
    tensor unless ``need_dweights`` and weights are given) and, with ``grad_recipe``, dy_sorted
    quantized along d (data, scale; empty ``[0]`` tensors without), from the same kernel."""
    T, M = dy.shape[0], sorted_to_token_slot.shape[0]
    k = _top_k(weights, M, T)
    with_dweights = need_dweights and weights is not None
    recipe = recipe_of(grad_recipe, pow2, mx_rounding) if grad_recipe is not None else None
    if not use_triton(dy.device):
        w = weights if weights is not None else dy.new_ones(T, k)
        dy_sorted, dweights = reference.unpermute_backward(dy, y_sorted, sorted_to_token_slot, w, offsets)
        data, scale = (reference.quantize(dy_sorted, recipe, 1) if recipe is not None
                       else (dy.new_empty(0), dy.new_empty(0)))
        return dy_sorted, dweights if with_dweights else dy.new_empty(0), data, scale
    dy_sorted = torch.empty(M, dy.shape[1], dtype=dy.dtype, device=dy.device)
    data, scale = (empty_quantized(dy_sorted.shape, recipe, 1, None, dy.device) if recipe is not None
                   else (dy.new_empty(0), dy.new_empty(0)))
    quantized = (data, scale, recipe) if recipe is not None else None
    slot_to_sorted = _invert(sorted_to_token_slot)
    if not with_dweights:
        permute_rows(dy, slot_to_sorted, offsets, k, dy_sorted, weights, quantized=quantized)
        return dy_sorted, dy.new_empty(0), data, scale
    dweights = torch.empty(M, dtype=torch.float32, device=dy.device)
    permute_rows(dy, slot_to_sorted, offsets, k, dy_sorted, weights, other=y_sorted, dweights=dweights,
                 quantized=quantized)
    return dy_sorted, dweights.view(T, k).to(weights.dtype), data, scale


def _unpermute_backward_fake(dy: torch.Tensor, y_sorted: torch.Tensor, sorted_to_token_slot: torch.Tensor,
                             weights: torch.Tensor | None, offsets: torch.Tensor, need_dweights: bool,
                             grad_recipe: str | None, pow2: bool, mx_rounding: str):
    dy_sorted = dy.new_empty(sorted_to_token_slot.shape[0], dy.shape[1])
    dweights = weights.new_empty(weights.shape) if need_dweights and weights is not None else dy.new_empty(0)
    if grad_recipe is None:
        return dy_sorted, dweights, dy.new_empty(0), dy.new_empty(0)
    return dy_sorted, dweights, *empty_quantized(dy_sorted.shape, recipe_of(grad_recipe, pow2, mx_rounding), 1,
                                                 None, dy.device)


def _quantize_permuted(x: torch.Tensor, sorted_to_token_slot: torch.Tensor, offsets: torch.Tensor, top_k: int,
                       recipe: str, pow2: bool, mx_rounding: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` of permute's rows of x quantized along d (zero rows at or past ``offsets[-1]``)."""
    r = recipe_of(recipe, pow2, mx_rounding)
    M = sorted_to_token_slot.shape[0]
    if not use_triton(x.device):
        return reference.quantize(_reference_copies(x, sorted_to_token_slot, offsets, top_k), r, 1)
    data, scale = empty_quantized((M, x.shape[1]), r, 1, None, x.device)
    permute_rows(x, _invert(sorted_to_token_slot), offsets, top_k, None, quantized=(data, scale, r))
    return data, scale


def _quantize_permuted_fake(x: torch.Tensor, sorted_to_token_slot: torch.Tensor, offsets: torch.Tensor,
                            top_k: int, recipe: str, pow2: bool, mx_rounding: str):
    return empty_quantized((sorted_to_token_slot.shape[0], x.shape[1]), recipe_of(recipe, pow2, mx_rounding), 1,
                           None, x.device)


def _gather_setup_context(ctx, inputs, output) -> None:
    x, sorted_to_token_slot, offsets, _ = inputs
    ctx.save_for_backward(sorted_to_token_slot, offsets)
    ctx.num_tokens = x.shape[0]


def _gather_bwd(ctx, dx_sorted):
    sorted_to_token_slot, offsets = ctx.saved_tensors
    return sum_copies(dx_sorted, sorted_to_token_slot, offsets, ctx.num_tokens), None, None, None


def _unpermute_setup_context(ctx, inputs, output) -> None:
    y_sorted, sorted_to_token_slot, weights, offsets, _, *grad_recipe = inputs
    ctx.save_for_backward(y_sorted, sorted_to_token_slot, weights, offsets)
    ctx.grad_recipe = grad_recipe


def _unpermute_bwd(ctx, dy):
    y_sorted, sorted_to_token_slot, weights, offsets = ctx.saved_tensors
    need_dweights = ctx.needs_input_grad[2]
    # A compiled graph plans its own buffers and hands nothing between its ops: no copy for it.
    name, pow2, mx_rounding = ctx.grad_recipe
    name = None if torch.compiler.is_compiling() or not ctx.needs_input_grad[0] else name
    dy_sorted, dweights, data, scale = _UNPERMUTE_BACKWARD(dy, y_sorted, sorted_to_token_slot, weights, offsets,
                                                           need_dweights, name, pow2, mx_rounding)
    if name is not None:
        attach_fp8_copy(dy_sorted, QuantizedTensor(data, scale, recipe_of(name, pow2, mx_rounding), 1))
    return (dy_sorted if ctx.needs_input_grad[0] else None, None,
            dweights if need_dweights else None, *([None] * (len(ctx.needs_input_grad) - 3)))


_GATHER = DirectOp.define("gather_copies", _gather_copies, _gather_copies_fake, backward=_gather_bwd,
                          setup_context=_gather_setup_context)
_UNPERMUTE = DirectOp.define("unpermute", _unpermute, _unpermute_fake, backward=_unpermute_bwd,
                             setup_context=_unpermute_setup_context)
_UNPERMUTE_BACKWARD = DirectOp.define("unpermute_backward", _unpermute_backward, _unpermute_backward_fake)
_QUANTIZE_PERMUTED = DirectOp.define("quantize_permuted", _quantize_permuted, _quantize_permuted_fake)


def _check(name: str, t: torch.Tensor, ndim: int, dtypes: tuple[torch.dtype, ...] | None = None) -> None:
    """``t`` a tensor of ``ndim`` dims with a dtype in ``dtypes`` (default: those the backend takes)."""
    check_tensor(name, t)
    check_matrix(name, t, ndim, dtypes or (TRITON_DTYPES if use_triton(t.device) else REFERENCE_DTYPES))


def permute(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather the token copies into expert order: ``x_sorted[p] = x[sorted_to_token_slot[p] // k]``.

    Args:
        x: ``[T, d]`` tokens; bf16, fp16 or fp32 (fp64 on the reference backend).
        topk_ids: int32/int64 ``[T, k]`` on x's device: the expert of copy j of token t (slot
            ``t*k + j``). Ids outside ``[0, num_experts)`` (``>= E``: an expert-parallel sentinel)
            send the copy to no local expert.
        num_experts: E >= 1, the number of local experts.
    Returns:
        ``x_sorted [T*k, d]`` (x's dtype): rows grouped by expert, ascending, token order kept within
        an expert (a stable sort: deterministic); the sentinel copies' rows come last, past
        ``offsets[-1]``, and are zero.
        ``sorted_to_token_slot`` int32 ``[T*k]``: the slot ``t*k + j`` of each sorted row.
        ``group_sizes`` int32 ``[E]``: rows per expert. ``offsets`` int32 ``[E]``: their cumulative
        ends, as ``grouped_mm`` takes them.

    Differentiable in x (``dx[t]`` sums the gradients of its valid copies, in slot order). Static
    output shapes and no host sync on the Triton backend: CUDA-graph capturable.
    """
    _check("x", x, 2)
    _check("topk_ids", topk_ids, 2, INDEX_DTYPES)
    T, k = topk_ids.shape
    if T != x.shape[0]:
        raise ValueError(f"topk_ids must have shape [T, k] with T={x.shape[0]} (x's rows), got {tuple(topk_ids.shape)}")
    check_same_device(x.device, topk_ids=topk_ids)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be an int >= 1, got {num_experts!r}")
    if T * k > _MAX_ROWS:
        raise ValueError(f"topk_ids has T*k = {T * k} copies; at most 2**31 - 1 are supported (int32 indices)")
    sorted_to_token_slot, group_sizes, offsets = sort_by_expert(topk_ids, num_experts)
    return _GATHER(x, sorted_to_token_slot, offsets, k), sorted_to_token_slot, group_sizes, offsets


def gather_copies(x: torch.Tensor, sorted_to_token_slot: torch.Tensor, offsets: torch.Tensor,
                  top_k: int) -> torch.Tensor:
    """``permute``'s rows of the tokens ``x [T, d]`` for copies already sorted (``route(..., sort=True)``):
    ``x_sorted[p] = x[sorted_to_token_slot[p] // top_k]``, ``[T*k, d]`` in x's dtype, zero at or past
    ``offsets[-1]``. Differentiable in x as permute is. ``sorted_to_token_slot`` and ``offsets`` as permute
    returns them; arguments are not checked (the callers hold the sort's own outputs)."""
    return _GATHER(x, sorted_to_token_slot, offsets, top_k)


def sum_copies(rows: torch.Tensor, sorted_to_token_slot: torch.Tensor, offsets: torch.Tensor,
               num_tokens: int) -> torch.Tensor:
    """Each token's copies summed, unweighted: ``x[t] = sum_j rows[p(t*k + j)]``, the gradient that
    ``permute`` (or any product reading permute's rows) gives its tokens. ``rows [T*k, d]`` in permute's
    order, ``sorted_to_token_slot`` and ``offsets`` as permute returns them (rows at or past
    ``offsets[-1]`` add nothing); ``[T, d]`` in rows' dtype, summed in fp32 in slot order. Arguments are
    not checked: the callers hold permute's own outputs."""
    return _UNPERMUTE(rows, sorted_to_token_slot, None, offsets, num_tokens, *_recipe_args(None))


def unpermute(y_sorted: torch.Tensor, sorted_to_token_slot: torch.Tensor, weights: torch.Tensor,
              offsets: torch.Tensor, *, grad_recipe: Recipe | None = None) -> torch.Tensor:
    """Weighted sum of each token's expert outputs: ``y[t] = sum_j weights[t, j] * y_sorted[p(t*k + j)]``.

    Args:
        y_sorted: ``[T*k, d]`` rows in the order ``permute`` returned; bf16, fp16 or fp32 (fp64 on
            the reference backend).
        sorted_to_token_slot: int32/int64 ``[T*k]`` from ``permute``.
        weights: ``[T, k]`` router weights of the copies, any float dtype and strides.
        offsets: int32/int64 ``[E]`` from ``permute``; the rows at or past ``offsets[-1]`` (sentinel
            copies) contribute nothing, whatever y_sorted holds there. Read on the device.
        grad_recipe: an FP8 activation recipe (``dropless.Recipe``): the backward also writes
            y_sorted's gradient quantized along d with it, from the same kernel, for the FP8 product
            that made y_sorted (``ops.fp8_gradient``): that product's backward then does not quantize it.
    Returns:
        ``y [T, d]`` in y_sorted's dtype, summed in fp32 in slot order (deterministic).

    Differentiable in y_sorted (``dy_sorted[p] = weights[t, j] * dy[t]``, zero for sentinel rows)
    and weights (``dweights[t, j] = <dy[t], y_sorted[p]>`` in fp32, zero for sentinel copies). No
    host sync on the Triton backend: the inverse map ``slot -> sorted row`` is a scatter on the device.
    """
    _check("y_sorted", y_sorted, 2)
    _check("weights", weights, 2, REFERENCE_DTYPES)
    _check("sorted_to_token_slot", sorted_to_token_slot, 1, INDEX_DTYPES)
    _check("offsets", offsets, 1, INDEX_DTYPES)
    T, k = weights.shape
    if y_sorted.shape[0] != T * k:
        raise ValueError(f"y_sorted must have T*k = {T * k} rows (weights is [T, k] = [{T}, {k}]), "
                         f"got shape {tuple(y_sorted.shape)}")
    if sorted_to_token_slot.shape[0] != T * k:
        raise ValueError(f"sorted_to_token_slot must have shape [T*k] = [{T * k}] (weights is [T, k] = "
                         f"[{T}, {k}]), got {tuple(sorted_to_token_slot.shape)}")
    if offsets.shape[0] == 0:
        raise ValueError("offsets must hold at least one expert (shape [E] with E >= 1), got shape (0,)")
    check_same_device(y_sorted.device, sorted_to_token_slot=sorted_to_token_slot, weights=weights, offsets=offsets)
    validate_offsets(offsets, T * k)
    return _UNPERMUTE(y_sorted, sorted_to_token_slot, weights, offsets, T, *_recipe_args(grad_recipe))


def quantize_permuted(x: torch.Tensor, sorted_to_token_slot: torch.Tensor, offsets: torch.Tensor, top_k: int,
                      recipe: Recipe) -> QuantizedTensor:
    """``permute``'s rows of the tokens ``x [T, d]`` quantized along d with the activation recipe
    ``recipe``, the rows themselves never made: ``dropless.quantize(x_sorted, recipe, dim=-1)``'s bits,
    the rows at or past ``offsets[-1]`` (sentinel copies) zero. One kernel reads each token once and
    writes its top_k FP8 copies. ``sorted_to_token_slot`` and ``offsets`` as permute returns them;
    arguments are not checked (the callers hold permute's own outputs)."""
    data, scale = _QUANTIZE_PERMUTED(x, sorted_to_token_slot, offsets, top_k, recipe.name, recipe.pow2,
                                     recipe.mx_rounding)
    return QuantizedTensor(data, scale, recipe, 1)
