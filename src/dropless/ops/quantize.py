"""FP8 quantization: ``quantize`` (an activation or any 2D/3D tensor, optionally per group along the
tokens), ``quantize_pair`` (an activation along K and per group along the tokens, from one pass) and
``quantize_weight`` (3D expert weights in both orientations, from one pass).

The recipes and the layouts of data and scales are ``dropless.quantized``'s; the functions return
``QuantizedTensor``s. They are ``torch.library`` custom ops (``dropless::quantize``,
``dropless::quantize_pair``, ``dropless::quantize_weight``) with fake implementations, taking the recipe
as its name and options, so ``torch.compile(fullgraph=True)`` traces through them; eager calls on plain tensors skip the
dispatcher (``ops.direct``). Output shapes depend only on the input's shape, the recipe and E: nothing
reads the group sizes on the host, and the Triton backend does not sync. Quantization is not
differentiable (the FP8 GEMMs carry the gradients).

An MoE layer quantizes operands of the same few signatures every step, so an eager ``quantize`` on the
Triton backend keeps what its checks and its choice of kernel decided for a signature (a
``QuantizePlan``: the recipe, the outputs' layout and the launch) and later calls of that signature
pay for the outputs and the launch alone.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from dropless import reference
from dropless.backend import get_backend, use_triton
from dropless.kernels.launch import cdiv, interpreting
from dropless.kernels.quantize import (QuantizeLaunch, quantize_along, quantize_both, quantize_launcher,
                                      quantize_weight_3d)
from dropless.ops.checks import TRITON_DTYPES, check_same_device, check_tensor, validate_offsets, validation_enabled
from dropless.ops.direct import PLAIN_TYPES, DirectOp, is_plain_call
from dropless.quantized import (FP8_DTYPE, MX_ROUNDINGS, RECIPES, QuantizedTensor, Recipe, get_recipe, grouped_rows,
                               grouped_scale_rows)

INDEX_DTYPES = (torch.int32, torch.int64)


def scale_shape(shape: tuple[int, ...], recipe: Recipe, dim: int, num_groups: int | None = None) -> tuple[int, ...]:
    """The shape of the scales of a tensor of ``shape`` (x's, ``[M, K]`` per group, not the data's) quantized
    along ``dim`` (non-negative) with ``recipe``, per group of ``num_groups`` along dim 0 when given
    (``dropless.quantized``'s layouts)."""
    if num_groups is not None:
        return (grouped_scale_rows(shape[0], num_groups, recipe.block), shape[1])
    if recipe.tile:
        return (*shape[:-2], cdiv(shape[-2], 128), cdiv(shape[-1], 128))
    size = 1 if recipe.block is None else cdiv(shape[dim], recipe.block)
    return (*shape[:dim], size, *shape[dim + 1:])


def empty_quantized(shape: tuple[int, ...], recipe: Recipe, dim: int, num_groups: int | None,
                    device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized ``(data, scale)`` of a tensor of ``shape`` laid out for ``recipe`` along ``dim``: data
    float8_e4m3fn of ``shape`` (per group of ``num_groups``: ``[Mp, K]``, ``Mp = grouped_rows(M, E)``) with
    dim contiguous (a view of storage whose last dim is dim), scale contiguous."""
    rows = shape[dim] if num_groups is None else grouped_rows(shape[0], num_groups)
    storage = [*shape[:dim], *shape[dim + 1:], rows]
    data = torch.empty(storage, dtype=FP8_DTYPE, device=device).movedim(-1, dim)
    scale = torch.empty(scale_shape(tuple(shape), recipe, dim, num_groups), dtype=recipe.scale_dtype, device=device)
    return data, scale


@functools.cache
def recipe_of(name: str, pow2: bool, mx_rounding: str) -> Recipe:
    """The recipe a custom op's arguments name (already checked), one object per combination."""
    return replace(RECIPES[name], pow2=pow2, mx_rounding=mx_rounding)


def _operand_shape(x: torch.Tensor, rows: torch.Tensor | None) -> tuple[int, ...]:
    """The quantized operand's shape: x's, or that of ``x[rows]``."""
    return tuple(x.shape) if rows is None else (rows.shape[0], *x.shape[1:])


def _quantize(x: torch.Tensor, recipe: str, dim: int, offsets: torch.Tensor | None, pow2: bool,
              mx_rounding: str, rows: torch.Tensor | None = None, tail: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale)`` of x (or ``x[rows]``) quantized along dim (non-negative) with the recipe named
    ``recipe``; per group along dim 0 with offsets, else offsets only bound the rows (``tail=False``)."""
    r = recipe_of(recipe, pow2, mx_rounding)
    groups = offsets if dim == 0 else None
    if not use_triton(x.device):
        return reference.quantize(x if rows is None else x.index_select(0, rows), r, dim, groups)
    data, scale = _quantize_fake(x, recipe, dim, offsets, pow2, mx_rounding, rows, tail)
    quantize_along(x, data, scale, r, dim, groups, rows, None if tail else offsets[-1:])
    return data, scale


def _quantize_fake(x: torch.Tensor, recipe: str, dim: int, offsets: torch.Tensor | None, pow2: bool,
                   mx_rounding: str, rows: torch.Tensor | None = None, tail: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    r = recipe_of(recipe, pow2, mx_rounding)
    groups = None if offsets is None or dim != 0 else offsets.shape[0]
    return empty_quantized(_operand_shape(x, rows), r, dim, groups, x.device)


def _quantize_pair(x: torch.Tensor, recipe: str, offsets: torch.Tensor, pow2: bool, mx_rounding: str
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(data_k, scale_k, data_m, scale_m)`` of a 2D x quantized along dim 1 and along dim 0 per group
    with the recipe named ``recipe``: one launch of the tile kernel on the Triton backend (two for rowwise)."""
    r = recipe_of(recipe, pow2, mx_rounding)
    if not use_triton(x.device):
        return *reference.quantize(x, r, 1), *reference.quantize(x, r, 0, offsets)
    data_k, scale_k, data_m, scale_m = _quantize_pair_fake(x, recipe, offsets, pow2, mx_rounding)
    quantize_both(x, data_k, scale_k, data_m, scale_m, r, offsets)
    return data_k, scale_k, data_m, scale_m


def _quantize_pair_fake(x: torch.Tensor, recipe: str, offsets: torch.Tensor, pow2: bool, mx_rounding: str
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    r = recipe_of(recipe, pow2, mx_rounding)
    return (*empty_quantized(x.shape, r, 1, None, x.device),
            *empty_quantized(x.shape, r, 0, offsets.shape[0], x.device))


def _quantize_weight(w: torch.Tensor, recipe: str, pow2: bool, mx_rounding: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(data_k, scale_k, data_n, scale_n)``; block128x128's one scale is scale_k (scale_n is empty)."""
    r = recipe_of(recipe, pow2, mx_rounding)
    if not use_triton(w.device):
        data_k, scale_k = reference.quantize(w, r, 1)
        data_n, scale_n = reference.quantize(w, r, 2)
        return data_k, scale_k, data_n, scale_n.new_empty(0) if r.tile else scale_n
    data_k, data_n, scale_k, scale_n = _empty_weight(w, r)
    quantize_weight_3d(w, data_k, data_n, scale_k, scale_k if r.tile else scale_n, r)
    return data_k, scale_k, data_n, scale_n


def _empty_weight(w: torch.Tensor, r: Recipe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    data_k, scale_k = empty_quantized(w.shape, r, 1, None, w.device)
    data_n, scale_n = empty_quantized(w.shape, r, 2, None, w.device)
    return data_k, data_n, scale_k, scale_n.new_empty(0) if r.tile else scale_n


def _quantize_weight_fake(w: torch.Tensor, recipe: str, pow2: bool, mx_rounding: str):
    data_k, data_n, scale_k, scale_n = _empty_weight(w, recipe_of(recipe, pow2, mx_rounding))
    return data_k, scale_k, data_n, scale_n


_QUANTIZE = DirectOp.define("quantize", _quantize, _quantize_fake)
_QUANTIZE_PAIR = DirectOp.define("quantize_pair", _quantize_pair, _quantize_pair_fake)
_QUANTIZE_WEIGHT = DirectOp.define("quantize_weight", _quantize_weight, _quantize_weight_fake)


def _resolve_recipe(recipe: str | Recipe, pow2: bool | None, mx_rounding: str | None) -> Recipe:
    """The recipe with its options, checked: a known name with its own block shape, and each option
    given only to the recipes it applies to."""
    r = get_recipe(recipe, pow2=pow2, mx_rounding=mx_rounding)
    base = RECIPES.get(r.name)
    if base is None or (r.block, r.tile) != (base.block, base.tile):
        raise ValueError(f"recipe must be one of {list(RECIPES)} (with its own block shape), got {r!r}")
    if r.mx_rounding not in MX_ROUNDINGS:
        raise ValueError(f"recipe.mx_rounding must be one of {MX_ROUNDINGS}, got {r.mx_rounding!r}")
    if r.name == "mxfp8" and r.pow2:
        raise ValueError("pow2 applies to the fp32-scaled recipes; mxfp8's E8M0 scales are powers of two already")
    if r.name != "mxfp8" and (mx_rounding is not None or r.mx_rounding != base.mx_rounding):
        raise ValueError(f"mx_rounding applies to the mxfp8 recipe only, got it with recipe {r.name!r}")
    return r


def _check_input(name: str, t: torch.Tensor, ndims: tuple[int, ...]) -> None:
    check_tensor(name, t)
    if t.dim() not in ndims:
        raise ValueError(f"{name} must have {' or '.join(map(str, ndims))} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in TRITON_DTYPES:
        raise TypeError(f"{name} must be a floating tensor with dtype in {[str(d) for d in TRITON_DTYPES]}, "
                        f"got {t.dtype}")


def _check_offsets(offsets: object, device: torch.device) -> None:
    check_tensor("offsets", offsets)
    if offsets.dim() != 1 or offsets.shape[0] == 0:
        raise ValueError(f"offsets must have shape [E] with E >= 1 (cumulative group ends), got {tuple(offsets.shape)}")
    if offsets.dtype not in INDEX_DTYPES:
        raise TypeError(f"offsets must be int32 or int64, got {offsets.dtype}")
    check_same_device(device, offsets=offsets)


def _group_offsets(offsets: torch.Tensor, M: int, r: Recipe) -> torch.Tensor:
    """``offsets`` (already checked as a tensor) as int32, checked against the ``M`` rows of an operand
    quantized per group along its tokens with ``r``."""
    if r.tile:
        raise ValueError("recipe block128x128 cannot restart its 128x128 tiles at group boundaries: "
                         "offsets are not supported with it (use block128 along the tokens)")
    validate_offsets(offsets, M)
    return offsets.to(torch.int32)


@dataclass(frozen=True)
class QuantizePlan:
    """What ``quantize`` decided for one call signature: the checked recipe and dim, the outputs' layout
    (data of ``shape`` and ``strides``, scale of ``scale_shape``) and the kernels' launch."""

    recipe: Recipe
    dim: int
    grouped: bool
    bounded: bool
    tokens: int | None
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    scale_shape: tuple[int, ...]
    launch: QuantizeLaunch

    def __call__(self, x: torch.Tensor, offsets: torch.Tensor | None, rows: torch.Tensor | None) -> QuantizedTensor:
        if offsets is not None and offsets.dtype != torch.int32:
            offsets = offsets.to(torch.int32)
        if rows is not None:
            rows = rows.contiguous()
        data = torch.empty_strided(self.shape, self.strides, dtype=FP8_DTYPE, device=x.device)
        scale = torch.empty(self.scale_shape, dtype=self.recipe.scale_dtype, device=x.device)
        groups = offsets if self.grouped else None
        self.launch(x, data, scale, groups, rows, offsets[-1:] if self.bounded else None)
        return QuantizedTensor(data, scale, self.recipe, self.dim, groups, self.tokens)


# Plans kept at most (M is in a signature, so a caller whose sizes keep changing would add them without
# end); past it the table starts again.
_MAX_PLANS = 1024
_PLANS: dict[tuple, QuantizePlan] = {}


def _tensor_signature(t: torch.Tensor | None) -> tuple | None:
    """What a plan depends on of an operand: its layout, dtype, device and 16-byte alignment."""
    if t is None:
        return None
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16


def _plan_key(x: object, recipe: object, dim: object, offsets: object, pow2: object, mx_rounding: object,
              rows: object, tail: object) -> tuple | None:
    """The call signature of an eager ``quantize`` on the Triton backend with plain tensors, or None for
    any other call (which takes the checked path: a traced one, or one whose checks may fail)."""
    operands = (x, offsets, rows)
    if type(x) not in PLAIN_TYPES or any(t is not None and type(t) not in PLAIN_TYPES for t in operands[1:]):
        return None
    backend = get_backend()
    if validation_enabled() or not is_plain_call(operands) or not use_triton(x.device, backend):
        return None
    # Off the GPU the kernels run only under the interpreter (elsewhere the checked path raises).
    interpreted = x.device.type != "cuda" and interpreting()
    key = (type(recipe), recipe, type(dim), dim, pow2, mx_rounding, tail, backend, interpreted,
           *map(_tensor_signature, operands))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _make_plan(x: torch.Tensor, q: QuantizedTensor, offsets: torch.Tensor | None, rows: torch.Tensor | None,
               tail: bool) -> QuantizePlan:
    """The plan of a call that quantized ``x`` (``x[rows]``) into ``q`` with these offsets (already int32)."""
    groups = offsets if q.dim == 0 else None
    launch = quantize_launcher(x, q.data, q.recipe, q.dim, groups, rows)
    return QuantizePlan(q.recipe, q.dim, groups is not None, not tail, q.tokens, tuple(q.data.shape),
                        q.data.stride(), tuple(q.scale.shape), launch)


def quantize(x: torch.Tensor, recipe: str | Recipe, dim: int = -1, offsets: torch.Tensor | None = None, *,
             pow2: bool | None = None, mx_rounding: str | None = None, rows: torch.Tensor | None = None,
             tail: bool = True) -> QuantizedTensor:
    """Quantize ``x`` to FP8 along ``dim``: ``x ~= data * scale``, one scale per block of the recipe.

    Args:
        x: ``[M, K]`` or ``[E, K, N]``; bf16, fp16 or fp32; any strides.
        recipe: ``"rowwise"``, ``"block128"`` (1x128), ``"block128x128"`` (128x128 tiles of the last
            two dims), ``"mxfp8"`` (1x32, E8M0 scales), or a ``dropless.Recipe``.
        dim: the quantized (contraction) dim: 0 or 1 (-2, -1) for a 2D x, 1 or 2 (-2, -1) for a 3D x.
        offsets: int32/int64 ``[E]`` cumulative group ends on x's device, for a 2D x along dim 0
            (the tokens, as a weight gradient reads them): blocks restart at every group start, every
            group starts at a 128-aligned row of the data and rows past ``offsets[-1]`` are not stored.
            Not with block128x128. Read on the device.
        pow2: round fp32 scales up to powers of two (rowwise, block128, block128x128).
        mx_rounding: mxfp8's scale exponent, ``"floor"`` (OCP MX, the default) or ``"rceil"``.
        rows: with ``offsets``, int32/int64 ``[M']`` on x's device, each in ``[0, M)`` (not checked: that
            would sync): quantize ``x[rows]`` (``[M', K]``) without making it, each row read by index, as
            the weight gradient of a layer reads its permuted token copies from the tokens.
        tail: ``False`` leaves the rows past ``offsets[-1]`` unwritten (their data and scales hold
            whatever the memory held), for a product that reads no row outside its groups, as the grouped
            GEMMs do: the rows of a buffer sized for the most a rank can receive cost nothing. Needs
            offsets, which along dim 1 of a 2D x then bound the rows only (the layout stays unchanged).
    Returns:
        A ``QuantizedTensor``: data float8_e4m3fn of x's shape (``x[rows]``'s) with unit stride along
        dim (dim 0 of a 2D x: a transposed view of ``[K, M]`` storage; with offsets ``[Mp, K]``, a view
        of ``[K, Mp]`` storage with ``Mp = 128 * (cdiv(M, 128) + E)``, each group starting 128-aligned,
        zeros between), scale contiguous, fp32 or float8_e8m0fnu, as ``dropless.quantized`` lays them
        out; offsets kept as int32, and M as ``tokens``. No host sync on the Triton backend.
    """
    key = _plan_key(x, recipe, dim, offsets, pow2, mx_rounding, rows, tail)
    plan = _PLANS.get(key) if key is not None else None
    if plan is not None:
        return plan(x, offsets, rows)
    r = _resolve_recipe(recipe, pow2, mx_rounding)
    _check_input("x", x, (2, 3))
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim must be an int in [-{x.dim()}, {x.dim()}) for x of shape {tuple(x.shape)}, got {dim!r}")
    dim %= x.dim()
    if x.dim() == 3 and dim == 0:
        raise ValueError("dim must be 1 or 2 (K or N) for a 3D x [E, K, N]: experts are never quantized across, got 0")
    if rows is not None:
        if offsets is None:
            raise ValueError("rows needs offsets: only an operand quantized per group along its tokens is "
                             "read by index")
        check_tensor("rows", rows)
        if rows.dim() != 1 or rows.dtype not in INDEX_DTYPES:
            raise ValueError(f"rows must be a 1D int32/int64 tensor of row indices, got {rows.dtype} of shape "
                             f"{tuple(rows.shape)}")
        check_same_device(x.device, rows=rows)
        rows = rows.contiguous()  # the kernels read the indices as a contiguous vector
    M = x.shape[0] if rows is None else rows.shape[0]
    if not tail and offsets is None:
        raise ValueError("tail=False needs offsets: the rows past offsets[-1] are the ones left unwritten")
    if offsets is not None:
        _check_offsets(offsets, x.device)
        if x.dim() != 2 or dim != 0 and (tail or rows is not None):
            raise ValueError(f"offsets need a 2D x quantized along dim 0 (the tokens), or along dim 1 with "
                             f"tail=False, got x of shape {tuple(x.shape)} and dim {dim}")
        offsets = _group_offsets(offsets, M, r)
    data, scale = _QUANTIZE(x, r.name, dim, offsets, r.pow2, r.mx_rounding, rows, tail)
    groups = offsets if dim == 0 else None
    q = QuantizedTensor(data, scale, r, dim, groups, None if groups is None else M)
    if key is not None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = _make_plan(x, q, offsets, rows, tail)
    return q


def quantize_pair(x: torch.Tensor, recipe: str | Recipe, offsets: torch.Tensor, *, pow2: bool | None = None,
                  mx_rounding: str | None = None) -> tuple[QuantizedTensor, QuantizedTensor]:
    """Quantize an activation ``x [M, K]`` along K and along the tokens per group: what a grouped GEMM's
    forward (or input gradient) and its weight gradient read.

    Returns exactly ``(quantize(x, recipe, 1), quantize(x, recipe, 0, offsets))``, bit for bit. The
    blockwise recipes (block128, mxfp8) write both from one read of x, in one launch on the Triton backend;
    rowwise (whose scales span whole rows and groups) reads x twice, in two launches: the amaxes of both
    orientations, then the values of both (the two calls read it three times).

    Args:
        x: ``[M, K]``, bf16, fp16 or fp32, any strides.
        recipe, pow2, mx_rounding: as ``quantize`` (not block128x128, which has no per-group layout).
        offsets: int32/int64 ``[E]`` cumulative group ends on x's device, read on the device.
    Returns:
        ``(along K, along the tokens)``: data ``[M, K]`` row-major with scales ``[M, cdiv(K, block)]``
        (rowwise ``[M, 1]``), and data ``[Mp, K]`` (a view of ``[K, Mp]`` storage, ``Mp = 128 * (cdiv(M, 128)
        + E)``) with scales ``[cdiv(Mp - 128 E, block) + E, K]`` (rowwise ``[E, K]``). No host sync on the Triton
        backend.
    """
    r = _resolve_recipe(recipe, pow2, mx_rounding)
    _check_input("x", x, (2,))
    _check_offsets(offsets, x.device)
    offsets = _group_offsets(offsets, x.shape[0], r)
    data_k, scale_k, data_m, scale_m = _QUANTIZE_PAIR(x, r.name, offsets, r.pow2, r.mx_rounding)
    return QuantizedTensor(data_k, scale_k, r, 1), QuantizedTensor(data_m, scale_m, r, 0, offsets, x.shape[0])


def quantize_weight(w: torch.Tensor, recipe: str | Recipe, *, pow2: bool | None = None,
                    mx_rounding: str | None = None) -> tuple[QuantizedTensor, QuantizedTensor]:
    """Quantize expert weights ``w [E, K, N]`` along K and along N, reading w once (twice for rowwise).

    The two orientations are what the forward (``y = x w``: w along K) and the input gradient
    (``dx = dy w^T``: w along N) of a grouped GEMM read. The ``"block128"`` recipe quantizes weights
    in 128x128 tiles (``"block128x128"``, as DeepSeek-V3 pairs 1x128 activation blocks with 128x128
    weight tiles); ``"block128x128"`` may be named directly too.

    Args:
        w: ``[E, K, N]``, bf16, fp16 or fp32, any strides (commonly ``nn.Linear`` weights
            ``[E, N, K]`` seen as ``.transpose(1, 2)``).
        recipe, pow2, mx_rounding: as ``quantize``.
    Returns:
        ``(along K, along N)``: QuantizedTensors of shape ``[E, K, N]`` with dim 1 (data a view of
        ``[E, N, K]`` storage) and dim 2 (contiguous data). With 128x128 tiles both share one scale
        tensor ``[E, cdiv(K, 128), cdiv(N, 128)]``. One launch covers all experts; no host sync.
    """
    r = _resolve_recipe(recipe, pow2, mx_rounding)
    if r.name == "block128":
        r = replace(RECIPES["block128x128"], pow2=r.pow2)
    _check_input("w", w, (3,))
    data_k, scale_k, data_n, scale_n = _QUANTIZE_WEIGHT(w, r.name, r.pow2, r.mx_rounding)
    return QuantizedTensor(data_k, scale_k, r, 1), QuantizedTensor(data_n, scale_k if r.tile else scale_n, r, 2)


def check_quantized(name: str, q: object, *, ndim: int | None = None, dim: int | None = None) -> None:
    """Raise a TypeError or ValueError naming ``name`` unless ``q`` is a ``QuantizedTensor`` laid out as
    ``dropless.quantized`` says: float8_e4m3fn data with unit stride along ``q.dim``, a scale of its
    recipe's dtype and shape (any strides: a transposed view of a weight's scales is one) (per group with offsets: ``q.tokens`` rows M and data of
    ``128 * (cdiv(M, 128) + E)`` rows), all on one device; with ``ndim`` /
    ``dim``, also of that rank and quantized along that dim."""
    if not isinstance(q, QuantizedTensor):
        raise TypeError(f"{name} must be a dropless.QuantizedTensor, got {type(q).__name__}")
    if not isinstance(q.recipe, Recipe):
        raise TypeError(f"{name}.recipe must be a dropless.Recipe, got {type(q.recipe).__name__}")
    base = RECIPES.get(q.recipe.name)
    if base is None or (q.recipe.block, q.recipe.tile) != (base.block, base.tile):
        raise ValueError(f"{name}.recipe must be one of {list(RECIPES)} (with its own block shape), got {q.recipe!r}")
    check_tensor(f"{name}.data", q.data)
    check_tensor(f"{name}.scale", q.scale)
    data, scale = q.data, q.scale
    if data.dtype != FP8_DTYPE:
        raise TypeError(f"{name}.data must be float8_e4m3fn (an FP8 QuantizedTensor), got {data.dtype}")
    if ndim is not None and data.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(data.shape)}")
    if isinstance(q.dim, bool) or not isinstance(q.dim, int) or not 0 <= q.dim < data.dim():
        raise ValueError(f"{name}.dim must be a non-negative dim of its data of shape {tuple(data.shape)}, "
                         f"got {q.dim!r}")
    if dim is not None and q.dim != dim % data.dim():
        raise ValueError(f"{name} must be quantized along dim {dim % data.dim()}, got dim {q.dim}")
    if data.shape[q.dim] > 1 and data.stride(q.dim) != 1:
        raise ValueError(f"{name}.data must have unit stride along its quantized dim {q.dim}, got strides "
                         f"{data.stride()}")
    if scale.dtype != q.recipe.scale_dtype:
        raise TypeError(f"{name}.scale must be {q.recipe.scale_dtype} for recipe {q.recipe.name!r}, got {scale.dtype}")
    check_same_device(data.device, **{f"{name}.scale": scale})
    groups = None
    shape = tuple(data.shape)
    if q.offsets is not None:
        check_tensor(f"{name}.offsets", q.offsets)
        if q.offsets.dim() != 1 or q.offsets.dtype not in INDEX_DTYPES or q.offsets.shape[0] == 0:
            raise ValueError(f"{name}.offsets must be int32/int64 of shape [E] with E >= 1, got "
                             f"{q.offsets.dtype} of shape {tuple(q.offsets.shape)}")
        check_same_device(data.device, **{f"{name}.offsets": q.offsets})
        if data.dim() != 2 or q.dim != 0 or q.recipe.tile:
            raise ValueError(f"{name} has offsets, which need 2D data quantized along dim 0 with a recipe other "
                             f"than block128x128; got shape {tuple(data.shape)}, dim {q.dim}, recipe {q.recipe.name!r}")
        groups = q.offsets.shape[0]
        if isinstance(q.tokens, bool) or not isinstance(q.tokens, int) or q.tokens < 0:
            raise ValueError(f"{name}.tokens must be the int number of rows M of the quantized tensor, "
                             f"got {q.tokens!r}")
        if data.shape[0] != grouped_rows(q.tokens, groups):
            raise ValueError(f"{name}.data must have 128 * (cdiv(M, 128) + E) = {grouped_rows(q.tokens, groups)} rows "
                             f"for M={q.tokens} tokens in E={groups} groups, got shape {shape}")
        shape = (q.tokens, data.shape[1])
    expected = scale_shape(shape, q.recipe, q.dim, groups)
    if tuple(scale.shape) != expected:
        raise ValueError(f"{name}.scale must have shape {list(expected)} for recipe {q.recipe.name!r} along dim "
                         f"{q.dim}{' per group' if groups else ''} of data {tuple(data.shape)}, "
                         f"got {tuple(scale.shape)}")

