"""FP8 recipes and the ``QuantizedTensor`` that passes FP8 operands between ops.

A recipe says how a tensor is scaled before its elements are cast to ``float8_e4m3fn`` (largest
finite value 448): one scale per slice along ``dim`` (``"rowwise"``), per 128 consecutive elements
along ``dim`` (``"block128"``, DeepSeek-V3's activations), per 128x128 tile of the last two dims
(``"block128x128"``, DeepSeek-V3's weights), or per 32 elements along ``dim`` with a power-of-two
E8M0 scale (``"mxfp8"``, OCP MX v1.0). ``x ~= data * scale``, the scale broadcast over its block: the
data is ``x * (1 / scale)`` rounded to fp32 (the reciprocal rounded once a scale, as DeepSeek-V3, torchao
and Transformer Engine compute it; exactly ``x / scale`` for power-of-two scales), saturated at +-448 and
rounded to nearest even; fp32 scales are ``amax / 448``, at least ``2**-126`` so that every reciprocal is
finite, and 1 for a block of zeros.

Layouts (``d`` = the quantized dim, counted from 0):
- ``data`` has x's shape (per group, see below) and unit stride along ``d``: the quantized dim is
  contiguous, which is the K-major layout Hopper's FP8 tensor cores read. Quantizing a ``[M, K]``
  activation along the token dim (d = 0) gives a transposed view of ``[K, M]`` storage; a weight
  ``[E, K, N]`` along K (d = 1) a view of ``[E, N, K]`` storage.
- ``scale`` (fp32, or ``float8_e8m0fnu`` for mxfp8) is contiguous:
  - rowwise: x's shape with size 1 along ``d``;
  - block128 / mxfp8: x's shape with ``cdiv(size_d, block)`` along ``d``;
  - block128x128: ``[..., cdiv(size_{-2}, 128), cdiv(size_{-1}, 128)]`` whatever ``d`` is.
- With ``offsets`` (``[E]`` cumulative group ends, ``x [M, K]``, d = 0; group e is x's rows
  ``[s_e, t_e)``, ``s_e = offsets[e-1]``), no block crosses a group boundary and every group starts
  at a multiple of A = ``GROUP_ALIGN`` = 128 rows in the data, so that a GEMM reads any group in
  windows of up to 128 tokens that start 128-byte aligned (whole cache lines, through TMA) and never
  reach into the next group, and the quantization writes them with aligned 16-byte stores:
  - ``data`` is ``[Mp, K]``, a transposed view of ``[K, Mp]`` storage, ``Mp = A * (cdiv(M, A) + E)``
    (``grouped_rows``). Group e's rows occupy rows ``[p_e, p_e + t_e - s_e)`` with
    ``p_e = A * (s_e // A + e)``; every other row (the gaps between groups and everything past the
    last group) is zero. These ranges never overlap and fit in Mp: with ``A * (t_e // A) >= t_e - A + 1``
    and ``A * (s_e // A) <= s_e``, ``p_{e+1} - p_e = A * (t_e // A - s_e // A) + A >= t_e - s_e + 1``,
    a multiple of A larger than the group, so even its rows rounded up to A end before ``p_{e+1}``
    (a window of the group's last rows reads zeros past them); and ``p_E = A * (t_{E-1} // A + E) <= Mp``
    bounds the last. Rows of x past ``offsets[-1]`` belong to no group and are not stored.
  - rowwise gives ``scale [E, K]`` (row e: group e's rows); a blockwise recipe of block B (which divides
    A) gives ``scale [cdiv(Mp - A E, B) + E, K]`` (``grouped_scale_rows``) where block j of group e (x's
    rows ``s_e + j*B`` onwards, data rows ``p_e + j*B`` onwards) is row ``s_e // B + e + j``; rows no
    block uses hold 1. The scale rows, like Mp, follow from M rounded up to A, which is what the data
    tells.
  Each kernel finds a group's data rows and scales from ``s_e`` alone, with no table of group sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
E8M0_DTYPE = torch.float8_e8m0fnu
E8M0_BIAS = 127
MX_ROUNDINGS = ("floor", "rceil")
GROUP_ALIGN = 128  # rows: where each group starts in per-group data, 128 bytes of FP8 along the tokens


def grouped_rows(M: int, E: int) -> int:
    """``Mp``: the rows of the data of ``M`` tokens in ``E`` groups quantized per group along the tokens."""
    return GROUP_ALIGN * (-(-M // GROUP_ALIGN) + E)


def grouped_scale_rows(M: int, E: int, block: int | None) -> int:
    """The scale rows of ``M`` tokens in ``E`` groups quantized per group along the tokens: ``E`` (one scale
    row per group) or, for blocks of ``block`` tokens, ``cdiv(Mp - A E, block) + E``."""
    if block is None:
        return E
    return -(-GROUP_ALIGN * -(-M // GROUP_ALIGN) // block) + E


@dataclass(frozen=True)
class Recipe:
    """How one operand is scaled.

    name: ``"rowwise"``, ``"block128"``, ``"block128x128"`` or ``"mxfp8"``.
    block: elements per scale along the quantized dim (None: the whole slice).
    tile: the block is ``block x block`` over the last two dims (else ``1 x block``).
    pow2: fp32 scales rounded up to a power of two (rowwise and block recipes).
    mx_rounding: mxfp8's scale: ``"floor"`` (OCP: ``2**(floor(log2(amax)) - 8)``) or ``"rceil"``
        (``2**ceil(log2(amax / 448))``, as NVIDIA's libraries compute it).
    """

    name: str
    block: int | None
    tile: bool = False
    pow2: bool = False
    mx_rounding: str = "floor"

    @property
    def scale_dtype(self) -> torch.dtype:
        return E8M0_DTYPE if self.name == "mxfp8" else torch.float32

    @property
    def blockwise(self) -> bool:
        """Scales change along the contraction dim, so a GEMM applies them per K step."""
        return self.block is not None


RECIPES = {
    "rowwise": Recipe("rowwise", None),
    "block128": Recipe("block128", 128),
    "block128x128": Recipe("block128x128", 128, tile=True),
    "mxfp8": Recipe("mxfp8", 32),
}


# The recipes a grouped GEMM runs in, by name: how its activations and its weights are quantized.
GEMM_RECIPES = ("rowwise", "block128", "mxfp8")


def operand_recipes(recipe: Recipe) -> tuple[Recipe, Recipe]:
    """``(activations, weights)`` recipes of a GEMM recipe: block128 pairs 1x128 activation blocks with
    128x128 weight tiles (DeepSeek-V3), the others use the same recipe for both."""
    if recipe.name not in GEMM_RECIPES:
        raise ValueError(f"recipe must be one of {list(GEMM_RECIPES)} for a grouped GEMM, got {recipe.name!r}")
    if recipe.name == "block128":
        return recipe, replace(recipe, name="block128x128", tile=True)
    return recipe, recipe


def get_recipe(recipe: str | Recipe, *, pow2: bool | None = None, mx_rounding: str | None = None) -> Recipe:
    """The ``Recipe`` named ``recipe`` (or ``recipe`` itself), with the given options replaced.

    Raises ValueError naming the argument for an unknown recipe or option.
    """
    if isinstance(recipe, Recipe):
        base = recipe
    elif isinstance(recipe, str) and recipe in RECIPES:
        base = RECIPES[recipe]
    else:
        raise ValueError(f"recipe must be one of {list(RECIPES)} or a dropless.Recipe, got {recipe!r}")
    if mx_rounding is not None:
        if mx_rounding not in MX_ROUNDINGS:
            raise ValueError(f"mx_rounding must be one of {MX_ROUNDINGS}, got {mx_rounding!r}")
        base = replace(base, mx_rounding=mx_rounding)
    if pow2 is not None:
        base = replace(base, pow2=bool(pow2))
    return base


@dataclass
class QuantizedTensor:
    """An FP8 tensor with its scales: ``x ~= data * scale`` (the scale broadcast over its block).

    data: ``float8_e4m3fn``, the original tensor's shape, unit stride along ``dim``.
    scale: fp32 or ``float8_e8m0fnu`` (mxfp8), laid out as the module docstring says.
    recipe: the ``Recipe`` it was quantized with; dim: the quantized dim (non-negative).
    offsets: int32 ``[E]`` group ends when quantized per group along the token dim, else None.
    """

    data: torch.Tensor
    scale: torch.Tensor
    recipe: Recipe
    dim: int
    offsets: torch.Tensor | None = None
    tokens: int | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``data * scale`` as a new contiguous tensor of ``dtype`` (computed in fp32), of the original
        tensor's shape (``[tokens, K]`` per group, zero past ``offsets[-1]``). One kernel pass on the
        Triton backend for data quantized along the last dim of a 2D tensor, which writes only the first
        ``rows[0]`` rows if ``rows`` (int ``[1]`` on the device) is given (the rest left unwritten)."""
        from dropless.ops.dequantize import dequantize

        return dequantize(self, dtype, rows)

    def blocked_scale(self) -> torch.Tensor:
        """The scales in the 128x4 swizzled layout that cuBLAS, CUTLASS and ``torch._scaled_mm`` read for
        MX formats on Blackwell (flat, rows padded to 128 and columns to 4), for a 2D ``mxfp8`` tensor
        quantized along its last dim."""
        from dropless import reference

        if self.recipe.name != "mxfp8" or self.data.dim() != 2 or self.dim != 1 or self.offsets is not None:
            raise ValueError("blocked_scale needs a 2D mxfp8 QuantizedTensor quantized along its last dim, got "
                             f"recipe {self.recipe.name}, shape {tuple(self.data.shape)}, dim {self.dim}")
        return reference.to_blocked(self.scale)
