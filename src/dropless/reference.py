"""Pure-PyTorch implementations of every dropless op: the CPU backend and the test oracle.

These read group boundaries on the host (``offsets.tolist()``), which is free on the CPU and a
device-to-host sync on a GPU: they are the oracle, not the fast path.
"""

from __future__ import annotations

import torch

from dropless.quantized import (E8M0_BIAS, E8M0_DTYPE, FP8_DTYPE, FP8_MAX, GROUP_ALIGN, QuantizedTensor, Recipe,
                                grouped_rows, grouped_scale_rows)

FP32_TINY = 2.0**-126  # fp32's smallest normal number: the least fp32 scale


def group_bounds(offsets: torch.Tensor, M: int) -> list[tuple[int, int]]:
    """``(start, end)`` row range of each group, clamped to ``[0, M]`` as the kernels clamp them."""
    ends = [min(max(int(end), 0), M) for end in offsets.tolist()]  # sync-ok: oracle
    bounds = []
    start = 0
    for end in ends:
        bounds.append((start, max(start, end)))
        start = max(start, end)
    return bounds


def group_rows(offsets: torch.Tensor, M: int) -> list[tuple[int, int, int]]:
    """``(start, end, row)`` of each group of M tokens: x's rows ``[start, end)`` (as ``group_bounds``)
    and ``row = A * (start // A + e)`` (A = ``GROUP_ALIGN``), where the group starts in data quantized
    per group."""
    return [(start, end, GROUP_ALIGN * (start // GROUP_ALIGN + e))
            for e, (start, end) in enumerate(group_bounds(offsets, M))]


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Ragged-M grouped GEMM: ``y[s_e:t_e] = x[s_e:t_e] @ w[e]``.

    x: ``[M, K]``, w: ``[E, K, N]`` (any strides), offsets: int ``[E]`` cumulative group ends.
    Returns ``y [M, N]`` in ``out_dtype`` (default ``x.dtype``); rows past ``offsets[-1]`` are zero.
    Products accumulate in at least fp32.
    """
    M, N = x.shape[0], w.shape[2]
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = torch.zeros(M, N, dtype=acc_dtype, device=x.device)
    for e, (start, end) in enumerate(group_bounds(offsets, M)):
        if end > start:
            y[start:end] = x[start:end].to(acc_dtype) @ w[e].to(acc_dtype)
    return y.to(out_dtype or x.dtype)


def grouped_mm_ragged_n(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor,
                        out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Ragged-N grouped GEMM: ``y[:, s_g:t_g] = a[g] @ b[:, s_g:t_g]``, the transpose of a ragged-M one.

    a: ``[G, M, K]``, b: ``[K, N]`` (any strides), offsets: int ``[G]`` cumulative ends of column groups.
    Returns a contiguous ``y [M, N]`` in ``out_dtype`` (default ``a.dtype``); columns past ``offsets[-1]``
    are zero.
    """
    return grouped_mm(b.t(), a.transpose(1, 2), offsets, out_dtype).t().contiguous()


def grouped_mm_wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Ragged-K grouped GEMM: ``dw[e] = x[s_e:t_e]^T @ dy[s_e:t_e]``, zero for an empty group.

    x: ``[M, K]``, dy: ``[M, N]``, offsets: int ``[E]``. Returns ``dw [E, K, N]`` in fp32 (fp64 for
    fp64 inputs); callers cast or accumulate.
    """
    M, K, N = x.shape[0], x.shape[1], dy.shape[1]
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    bounds = group_bounds(offsets, M)
    dw = torch.zeros(len(bounds), K, N, dtype=acc_dtype, device=x.device)
    for e, (start, end) in enumerate(bounds):
        if end > start:
            dw[e] = x[start:end].to(acc_dtype).t() @ dy[start:end].to(acc_dtype)
    return dw


def accumulate_into(out: torch.Tensor, dw: torch.Tensor, accumulate: bool | torch.Tensor) -> None:
    """Write ``dw`` into ``out`` in place: experts whose flag is True add, the others overwrite."""
    if isinstance(accumulate, torch.Tensor):
        flags = accumulate.to(device=out.device, dtype=torch.bool).view(-1, 1, 1)
        out.copy_(torch.where(flags, out + dw.to(out.dtype), dw.to(out.dtype)))
    elif accumulate:
        out.add_(dw.to(out.dtype))
    else:
        out.copy_(dw)


_SQRT_2_OVER_PI = 0.7978845608028654  # sqrt(2 / pi), the tanh approximation of GELU
_GELU_K = 0.044715


def _glu_gate(g: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor | float]:
    """``(s, du/dg)`` with ``act(g) = g * s`` and ``s = sigmoid(u(g))``: ``u = g`` for silu,
    ``u = 2c (g + k g^3)`` for gelu_tanh (``0.5 g (1 + tanh(z)) = g sigmoid(2z)``)."""
    if activation == "silu":
        return torch.sigmoid(g), 1.0
    if activation == "gelu_tanh":
        u = 2 * _SQRT_2_OVER_PI * (g + _GELU_K * g * g * g)
        return torch.sigmoid(u), 2 * _SQRT_2_OVER_PI * (1 + 3 * _GELU_K * g * g)
    raise ValueError(f"activation must be 'silu' or 'gelu_tanh', got {activation!r}")


def glu(h: torch.Tensor, activation: str) -> torch.Tensor:
    """Gated activation on the fused gate+up layout: ``a = act(h[:, :F]) * h[:, F:]``.

    h: ``[M, 2F]``, any strides; activation: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU, tanh
    approximation). Returns ``a [M, F]`` in h's dtype, computed in fp32 (fp64 for fp64 inputs).
    """
    compute = torch.float64 if h.dtype == torch.float64 else torch.float32
    g, u = h.to(compute).chunk(2, dim=1)
    s, _ = _glu_gate(g, activation)
    return (g * s * u).to(h.dtype)


def glu_backward(h: torch.Tensor, da: torch.Tensor, activation: str) -> torch.Tensor:
    """Gradient of ``glu`` recomputed from h: ``dh = [da * up * act'(gate) | da * act(gate)]``.

    h: ``[M, 2F]``, da: ``[M, F]``, any strides. ``act'(g) = s + g s (1 - s) du/dg``. Returns
    ``dh [M, 2F]`` in h's dtype, computed in fp32 (fp64 for fp64 inputs).
    """
    compute = torch.float64 if h.dtype == torch.float64 else torch.float32
    g, u = h.to(compute).chunk(2, dim=1)
    d = da.to(compute)
    s, du = _glu_gate(g, activation)
    # s (1 - s) is exactly 0 where s saturates; a huge du there must not make 0 * inf = NaN.
    slope = s * (1 - s)
    dact = s + torch.where(slope == 0, 0.0, g * slope * du)
    return torch.cat([d * u * dact, d * g * s], dim=1).to(h.dtype)


def _acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def permute(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the ``T*k`` token copies by expert (stable: token order kept within an expert).

    x: ``[T, d]``; topk_ids: int ``[T, k]``, slot ``s = t*k + j``; ids outside ``[0, E)`` go to no
    local expert and sort last. Returns ``x_sorted [T*k, d]`` (x's dtype, zero rows past
    ``offsets[-1]``), ``sorted_to_token_slot`` int32 ``[T*k]``, ``group_sizes`` and ``offsets``
    int32 ``[E]``.
    """
    E = num_experts
    k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).long()
    ids = torch.where((ids >= 0) & (ids < E), ids, E)
    order = torch.argsort(ids, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    group_sizes = counts[:E].to(torch.int32)
    offsets = torch.cumsum(counts[:E], 0).to(torch.int32)
    valid = ids[order] < E
    x_sorted = torch.where(valid[:, None], x[order // k], torch.zeros((), dtype=x.dtype, device=x.device))
    return x_sorted, order.to(torch.int32), group_sizes, offsets


def unpermute(y_sorted: torch.Tensor, sorted_to_token_slot: torch.Tensor, weights: torch.Tensor,
              offsets: torch.Tensor) -> torch.Tensor:
    """``y[t] = sum_j weights[t, j] * y_sorted[p(t*k + j)]`` over the copies sorted before ``offsets[-1]``.

    y_sorted: ``[T*k, d]``; sorted_to_token_slot: int ``[T*k]`` (the slot of each sorted row);
    weights: ``[T, k]``; offsets: int ``[E]``. Sums in fp32 (fp64 if an input is fp64), returns
    y_sorted's dtype.
    """
    T, k = weights.shape
    acc = _acc_dtype(y_sorted, weights)
    slot = sorted_to_token_slot.long()
    row_of_slot = torch.empty_like(slot).scatter_(0, slot, torch.arange(slot.shape[0], device=slot.device))
    valid = row_of_slot < offsets[-1]
    rows = torch.where(valid[:, None], y_sorted[row_of_slot].to(acc), 0.0)
    w = torch.where(valid, weights.reshape(-1).to(acc), 0.0)
    return (rows * w[:, None]).view(T, k, y_sorted.shape[1]).sum(1).to(y_sorted.dtype)


def unpermute_backward(dy: torch.Tensor, y_sorted: torch.Tensor, sorted_to_token_slot: torch.Tensor,
                       weights: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``unpermute`` given ``dy [T, d]``: ``dy_sorted[p] = weights[t, j] * dy[t]`` and
    ``dweights[t, j] = <dy[t], y_sorted[p]>``, both zero for the rows at or past ``offsets[-1]``.

    Returns ``dy_sorted [T*k, d]`` in dy's dtype and ``dweights [T, k]`` in weights' dtype (sums in
    fp32, or fp64).
    """
    T, k = weights.shape
    acc = _acc_dtype(dy, y_sorted, weights)
    slot = sorted_to_token_slot.long()
    valid = torch.arange(slot.shape[0], device=slot.device) < offsets[-1]
    dy_rows = torch.where(valid[:, None], dy[slot // k].to(acc), 0.0)
    w = torch.where(valid, weights.reshape(-1)[slot].to(acc), 0.0)
    dy_sorted = (dy_rows * w[:, None]).to(dy.dtype)
    dots = (dy_rows * torch.where(valid[:, None], y_sorted.to(acc), 0.0)).sum(1)
    dweights = torch.zeros(T * k, dtype=acc, device=dy.device).scatter_(0, slot, dots)
    return dy_sorted, dweights.view(T, k).to(weights.dtype)


# ---------------------------------------------------------------------------------------------------
# FP8 quantization: the recipes and the layouts of data and scales are dropless.quantized's. The scales
# come from torch.frexp here and from the fp32 bits in the kernels, so the two are independent.


def _magnitude(x: torch.Tensor) -> torch.Tensor:
    """``|x|`` in fp32 with NaN as 0: a NaN element stays NaN in the data and leaves its block's scale alone."""
    a = x.float().abs()
    return torch.where(torch.isnan(a), 0.0, a)


def _frexp(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``v = mantissa * 2**exponent`` with mantissa in ``[0.5, 1)``, exactly (subnormals too); inf counts
    as ``2**128``, one past fp32's exponents, as its bits say."""
    mantissa, exponent = torch.frexp(v)
    inf = torch.isinf(v)
    return torch.where(inf, 0.5, mantissa), torch.where(inf, 129, exponent)


def _over_fp8_max(amax: torch.Tensor) -> torch.Tensor:
    """``amax / 448`` correctly rounded on every device: a CUDA tensor divided by a Python number is
    multiplied by the number's reciprocal instead, which is not the rounded quotient."""
    return amax / torch.full_like(amax, FP8_MAX)


def fp32_scale(amax: torch.Tensor, pow2: bool) -> torch.Tensor:
    """The fp32 scale of blocks whose largest magnitude is ``amax``: ``amax / 448`` (rounded to nearest
    in fp32) and at least ``2**-126`` (fp32's smallest normal number, so that its reciprocal is finite),
    with ``pow2`` rounded up to a power of two, exactly; 1 where amax is 0."""
    s = _over_fp8_max(amax).clamp_min(FP32_TINY)
    if pow2:
        mantissa, exponent = _frexp(s)
        s = torch.ldexp(torch.ones_like(s), torch.where(mantissa == 0.5, exponent - 1, exponent))
    return torch.where(amax > 0, s, 1.0)


def e8m0_exponent(amax: torch.Tensor, rounding: str) -> torch.Tensor:
    """The MXFP8 scale exponent (int32, in ``[-127, 127]``) of blocks whose largest magnitude is ``amax``.

    ``"floor"`` (OCP MX v1.0): ``floor(log2(amax)) - 8``, 8 being the exponent of e4m3's largest power of
    two. ``"rceil"``: ``ceil(log2(s))`` with ``s = amax / 448`` rounded to nearest in fp32. Both are
    exact (subnormals included) and clamped to E8M0's range; amax 0 gives -127.
    """
    if rounding == "floor":
        value = amax
        exponent = _frexp(amax)[1] - 1 - 8
    else:
        value = _over_fp8_max(amax)
        mantissa, exponent = _frexp(value)
        exponent = torch.where(mantissa == 0.5, exponent - 1, exponent)
    return torch.where(value > 0, exponent, -127).clamp(-127, 127).to(torch.int32)


def _times_reciprocal(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x * (1 / scale)`` in fp32, the reciprocal rounded to nearest (a tensor divided by a tensor, on
    every device), then the product rounded: how the recipes scale the data (the exact quotient for
    power-of-two scales)."""
    return x.float() * (torch.ones_like(scale) / scale)


def _cast_fp8(y: torch.Tensor) -> torch.Tensor:
    """fp32 to float8_e4m3fn, saturated to +-448, rounded to nearest even; NaN stays NaN."""
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _scales(amax: torch.Tensor, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale as stored, scale as fp32)`` of blocks with largest magnitude ``amax``."""
    if recipe.name != "mxfp8":
        scale = fp32_scale(amax, recipe.pow2)
        return scale, scale
    exponent = e8m0_exponent(amax, recipe.mx_rounding)
    stored = (exponent + E8M0_BIAS).to(torch.uint8).view(E8M0_DTYPE)
    return stored, torch.ldexp(torch.ones_like(amax), exponent)  # 2**-127 is an fp32 subnormal: exact


def _quantize_last(x: torch.Tensor, recipe: Recipe) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x [..., S]`` along its last dim in blocks of ``recipe.block`` (the whole slice for
    rowwise): contiguous data ``[..., S]`` and scale ``[..., cdiv(S, block)]`` (``[..., 1]`` rowwise)."""
    S = x.shape[-1]
    block = recipe.block or max(S, 1)
    blocks = -(-S // block) if recipe.block else 1
    padded = torch.nn.functional.pad(x.float(), (0, blocks * block - S)).view(*x.shape[:-1], blocks, block)
    stored, scale = _scales(_magnitude(padded).amax(-1), recipe)
    data = _cast_fp8(_times_reciprocal(padded, scale[..., None])).view(*x.shape[:-1], blocks * block)[..., :S]
    return data.contiguous(), stored


def _unit_stride(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` laid out with ``dim`` contiguous (a view of storage whose last dim is ``dim``)."""
    return t.movedim(dim, -1).contiguous().movedim(-1, dim)


def _tile_amax(x: torch.Tensor) -> torch.Tensor:
    """Largest magnitude of each 128x128 tile of the last two dims: ``[..., cdiv(R, 128), cdiv(C, 128)]``."""
    R, C = x.shape[-2:]
    tiles_r, tiles_c = -(-R // 128), -(-C // 128)
    padded = torch.nn.functional.pad(_magnitude(x), (0, tiles_c * 128 - C, 0, tiles_r * 128 - R))
    return padded.view(*x.shape[:-2], tiles_r, 128, tiles_c, 128).amax(dim=(-3, -1))


def _expand(scale: torch.Tensor, dim: int, block: int, size: int) -> torch.Tensor:
    """Each scale repeated over its ``block`` elements along ``dim``, cut to ``size``."""
    return scale.repeat_interleave(block, dim).narrow(dim, 0, size)


def quantize(x: torch.Tensor, recipe: Recipe, dim: int, offsets: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize ``x`` to FP8 along ``dim`` with ``recipe`` (a ``dropless.quantized.Recipe``).

    x: any float dtype and strides. offsets: int ``[E]`` cumulative group ends, for a 2D x ``[M, K]``
    quantized along dim 0 per group (no block crosses a group boundary; rows past ``offsets[-1]`` are
    not stored). Returns ``(data, scale)`` laid out as ``dropless.quantized`` says: data float8_e4m3fn of
    x's shape with unit stride along dim (per group: ``[Mp, K]``, group e from row ``p_e``, zeros
    elsewhere); scale contiguous, fp32 (float8_e8m0fnu for mxfp8).
    """
    dim = dim % x.dim()
    if offsets is not None:
        M, K = x.shape
        data = torch.zeros(K, grouped_rows(M, offsets.shape[0]), dtype=FP8_DTYPE, device=x.device).t()
        rows = grouped_scale_rows(M, offsets.shape[0], recipe.block)
        # Rows no block uses hold 1: 2**0 as an E8M0 byte for mxfp8 (filled through a uint8 view).
        if recipe.name == "mxfp8":
            scale = torch.full((rows, K), E8M0_BIAS, dtype=torch.uint8, device=x.device)
        else:
            scale = torch.ones(rows, K, device=x.device)
        for e, (start, end, row) in enumerate(group_rows(offsets, M)):
            if end == start:
                continue
            group_data, group_scale = quantize(x[start:end], recipe, 0)
            data[row:row + end - start] = group_data
            first = e if recipe.block is None else start // recipe.block + e
            scale[first:first + group_scale.shape[0]] = group_scale.view(scale.dtype)
        return data, scale.view(recipe.scale_dtype)
    if recipe.tile:
        stored, scale = _scales(_tile_amax(x), recipe)
        R, C = x.shape[-2:]
        expanded = _expand(_expand(scale, -2, 128, R), -1, 128, C)
        return _unit_stride(_cast_fp8(_times_reciprocal(x, expanded)), dim), stored
    data, scale = _quantize_last(x.movedim(dim, -1), recipe)
    return data.movedim(-1, dim), scale.movedim(-1, dim).contiguous()


def dequantize(q: QuantizedTensor) -> torch.Tensor:
    """``data * scale`` in fp32 (the scale broadcast over its block), a new contiguous tensor of q's shape;
    per group, of the original tensor's shape ``[q.tokens, K]``, zero past ``offsets[-1]``."""
    data = q.data.float()
    scale = q.scale.float()
    if q.offsets is not None:
        x = torch.zeros(q.tokens, data.shape[1], device=data.device)
        block = q.recipe.block
        for e, (start, end, row) in enumerate(group_rows(q.offsets, q.tokens)):
            size = end - start
            scale_rows = torch.full((size,), e) if block is None else start // block + e + torch.arange(size) // block
            x[start:end] = data[row:row + size] * scale[scale_rows.to(data.device)]
        return x
    if q.recipe.tile:
        R, C = data.shape[-2:]
        return data * _expand(_expand(scale, -2, 128, R), -1, 128, C)
    if q.recipe.block is None:
        return data * scale
    return data * _expand(scale, q.dim, q.recipe.block, data.shape[q.dim])


def to_blocked(scale: torch.Tensor) -> torch.Tensor:
    """The 128x4 swizzled layout of MX scales that Blackwell's block-scaled GEMMs read (cuBLAS's "1D block
    scaling factors layout"; CUTLASS and ``torch._scaled_mm`` read the same), flat.

    scale: ``[rows, cols]`` (rows: the rows of the operand, cols: its 32-element blocks along K). It is
    padded with zeros to ``rows`` a multiple of 128 and ``cols`` of 4 and cut into 128x4 tiles, stored
    tile after tile in row-major order of tiles; inside a tile, scale ``(r, c)`` sits at
    ``(r % 32) * 16 + (r // 32) * 4 + c``, so one 16-byte load gives a thread the 4 scales of 4 rows
    32 apart.
    """
    rows, cols = scale.shape
    padded_rows, padded_cols = -(-rows // 128) * 128, -(-cols // 4) * 4
    raw = scale.view(torch.uint8) if scale.element_size() == 1 else scale
    padded = raw.new_zeros(padded_rows, padded_cols)
    padded[:rows, :cols] = raw
    tiles = padded.view(padded_rows // 128, 128, padded_cols // 4, 4).permute(0, 2, 1, 3)
    swizzled = tiles.reshape(-1, 4, 32, 4).transpose(1, 2).reshape(-1)
    return swizzled.view(scale.dtype) if scale.element_size() == 1 else swizzled
