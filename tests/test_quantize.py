"""FP8 quantization: ``dropless.quantize`` / ``quantize_weight`` and their kernels.

The Triton kernels (the interpreter on the CPU) match ``dropless.reference.quantize`` bit for bit, data
and scale bytes, for every recipe; the reference itself is checked against hand-computed cases, an
exponent oracle in Python floats and dequantization round trips. Then the per-group layout, outputs
poisoned before the kernels run, argument errors, and the swizzled MX scale layout.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from conftest import CUDA, KERNEL_DEVICE, bounds_of, data_rows_of, make_w, offsets_of

import dropless
from dropless import reference
from dropless.bench.routing import group_sizes
from dropless.kernels import quantize as quantize_kernels
from dropless.kernels.quantize import quantize_along, quantize_both, quantize_weight_3d
from dropless.ops.quantize import check_quantized, empty_quantized, quantize_pair

quantize_ops = importlib.import_module("dropless.ops.quantize")  # the module: ops exports the function too
from dropless.quantized import E8M0_DTYPE, FP8_DTYPE, QuantizedTensor, get_recipe

# (recipe, options): every recipe and option the kernels specialize on.
RECIPES = [
    ("rowwise", {}),
    ("rowwise", {"pow2": True}),
    ("block128", {}),
    ("block128", {"pow2": True}),
    ("block128x128", {}),
    ("mxfp8", {}),
    ("mxfp8", {"mx_rounding": "rceil"}),
]
GROUP_RECIPES = [r for r in RECIPES if r[0] != "block128x128"]
RECIPE_IDS = [name + "".join(f"-{v}" for v in opts.values()) for name, opts in RECIPES]
GROUP_RECIPE_IDS = [i for i in RECIPE_IDS if not i.startswith("block128x128")]
E4M3_STEP = 2.0**-4  # e4m3 keeps 3 mantissa bits: a rounding error of at most half of 2**-3, relative


def raw(t: torch.Tensor) -> torch.Tensor:
    """One-byte tensors (FP8 data, E8M0 scales) as their bytes, so that comparisons are bitwise."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def assert_same(q: QuantizedTensor, data: torch.Tensor, scale: torch.Tensor, what: str = "") -> None:
    """``q`` holds exactly ``(data, scale)``: same bytes, shapes and data strides."""
    assert q.data.dtype == FP8_DTYPE and q.scale.dtype == scale.dtype, what
    assert q.data.shape == data.shape, (what, q.data.shape, data.shape)
    assert q.data.stride() == data.stride() or not data.numel(), (what, q.data.stride(), data.stride())
    assert q.scale.shape == scale.shape and q.scale.is_contiguous(), (what, q.scale.shape, scale.shape)
    bad = raw(q.data).cpu() != raw(data).cpu()
    assert not bad.any(), f"{what}: {int(bad.sum())} data bytes differ, first at {bad.nonzero()[0].tolist()}"
    bad_scale = raw(q.scale).cpu() != raw(scale).cpu()
    assert not bad_scale.any(), \
        f"{what}: {int(bad_scale.sum())} scales differ, first at {bad_scale.nonzero()[0].tolist()}"


def planted(shape: tuple[int, ...], dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """Random values over several decades, with a zero row and column, a lone outlier, tiny and huge
    values in the slices of the last dim (fp32 only for those that bf16/fp16 cannot hold)."""
    x = torch.randn(shape) * torch.exp2(torch.randint(-6, 7, shape[:-1] + (1,)).float())
    flat = x.view(-1, shape[-1])
    rows = flat.shape[0]
    if rows > 3 and shape[-1] > 3:
        flat[1] = 0.0
        flat[:, 2] = 0.0
        flat[2, 1] = 3e4  # one outlier in a block of small values
        flat[3] *= 1e-3
    if dtype == torch.float32 and rows > 5:
        flat[4] *= 1e-40  # subnormal fp32 values: the scale exponents clamp at 2**-127
        flat[5] = flat[5].sign() * 3.0e38 * torch.rand(shape[-1])  # near fp32's largest
    return x.to(dtype).to(device)


def reference_q(x: torch.Tensor, name: str, opts: dict, dim: int, offsets=None) -> tuple[torch.Tensor, torch.Tensor]:
    return reference.quantize(x.cpu(), get_recipe(name, **opts), dim, None if offsets is None else offsets.cpu())


# ---------------------------------------------------------------------------------------------------
# The kernels and the public API against the reference, bit for bit


@pytest.mark.parametrize("name, opts", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("dim", [0, 1, -1])
@pytest.mark.parametrize("shape, dtype", [
    ((200, 136), torch.float32),
    ((45, 290), torch.bfloat16),
    ((128, 96), torch.float32),  # multiples of 16, which Triton specializes, in fp32 (v26)
])
def test_2d_matches_reference(backend, name, opts, dim, shape, dtype):
    _, device = backend
    x = planted(shape, dtype, device)
    q = dropless.quantize(x, name, dim, **opts)
    assert q.dim == dim % 2 and q.recipe == get_recipe(name, **opts) and q.offsets is None
    assert_same(q, *reference_q(x, name, opts, dim), f"{name} dim {dim}")
    check_quantized("q", q, ndim=2, dim=dim)


def test_rowwise_rows_longer_than_a_step(triton_backend, monkeypatch):
    """Rows longer than the rowwise kernel's step are walked in several chunks, twice: rows of 150 in
    steps of 64 (the default for a length that is not a power of two), then of 32 over 4 rows a program."""
    x = planted((40, 150), torch.float32, triton_backend)
    assert quantize_kernels._rowwise_shape(150)[1] == 64
    for shape in (None, (4, 32, 4)):
        if shape is not None:
            monkeypatch.setattr(quantize_kernels, "_rowwise_shape", lambda K: shape)
            monkeypatch.setattr(quantize_ops, "_PLANS", {})  # the plans kept hold the shape chosen before
        for opts in ({}, {"pow2": True}):
            assert_same(dropless.quantize(x, "rowwise", 1, **opts), *reference_q(x, "rowwise", opts, 1))


def test_2d_any_strides(triton_backend):
    x = torch.randn(300, 200, device=triton_backend)[::2, 3:139]  # row stride 400, offset start
    for dim in (0, 1):
        for name in ("rowwise", "mxfp8"):
            assert_same(dropless.quantize(x, name, dim), *reference_q(x, name, {}, dim), f"{name} {dim}")
    xt = torch.randn(136, 70, device=triton_backend).t()  # unit stride along the tokens
    assert_same(dropless.quantize(xt, "block128", 0), *reference_q(xt, "block128", {}, 0))


@pytest.mark.parametrize("name, opts", GROUP_RECIPES, ids=GROUP_RECIPE_IDS)
@pytest.mark.parametrize("sizes, M, K", [
    ([0, 70, 0, 80, 50], 200, 72),  # empty groups, sizes not divisible by 32 or 128
    ([190], 200, 72),  # one giant group, 10 rows past offsets[-1]
    ([0, 0, 0], 37, 72),  # no rows in any group: all data 0, every scale 1
    ([33, 1, 130, 31, 5], 200, 72),  # starts at every phase of the blocks
    ([0, 64, 32, 160], 256, 96),  # multiples of 16, which Triton specializes
])
def test_grouped_matches_reference(backend, name, opts, sizes, M, K):
    _, device = backend
    x = planted((M, K), torch.float32, device)
    offsets = offsets_of(sizes, device, torch.int64 if len(sizes) == 1 else torch.int32)
    q = dropless.quantize(x, name, 0, offsets, **opts)
    assert q.offsets.dtype == torch.int32 and q.offsets.tolist() == offsets.tolist()
    data, scale = reference_q(x, name, opts, 0, offsets)
    assert_same(q, data, scale, f"{name} {sizes}")
    assert q.tokens == M
    check_quantized("q", q, ndim=2, dim=0)


@pytest.mark.parametrize("name, opts", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("E, K, N", [(3, 100, 72), (1, 130, 64), (5, 96, 64)])  # the last: sizes Triton specializes
def test_weight_matches_reference(backend, name, opts, layout, E, K, N):
    _, device = backend
    w = make_w(E, K, N, torch.bfloat16, device, layout) * 4
    qk, qn = dropless.quantize_weight(w, name, **opts)
    expected = get_recipe("block128x128" if name == "block128" else name, **opts)
    assert (qk.dim, qn.dim) == (1, 2) and qk.recipe == qn.recipe == expected
    assert_same(qk, *reference.quantize(w.cpu(), expected, 1), f"{name} along K")
    assert_same(qn, *reference.quantize(w.cpu(), expected, 2), f"{name} along N")
    assert qk.data.transpose(1, 2).is_contiguous() and qn.data.is_contiguous()
    if expected.tile:
        assert qk.scale is qn.scale
    check_quantized("wk", qk, ndim=3, dim=1)
    check_quantized("wn", qn, ndim=3, dim=2)


@pytest.mark.parametrize("name, opts", RECIPES, ids=RECIPE_IDS)
def test_3d_quantize_matches_weight(backend, name, opts):
    """``quantize`` of a 3D tensor along one dim is that orientation of ``quantize_weight``."""
    _, device = backend
    w = make_w(2, 70, 40, torch.float16, device)
    for dim in (1, 2):
        assert_same(dropless.quantize(w, name, dim, **opts), *reference_q(w, name, opts, dim), f"dim {dim}")


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_mxfp8_extremes_bit_exact(backend, rounding):
    """Blocks of zeros, of subnormal and of huge values, with one outlier, and exact powers of two."""
    _, device = backend
    x = torch.randn(8, 96) * 1e-2
    x[0, :32] = 0.0
    x[1, :32] = torch.randn(32) * 1e-42  # subnormal amax: the scale clamps at 2**-127
    x[1, 32:64] = torch.randn(32) * 2.0**-118  # amax / 448 near 2**-127: rceil's subnormal quotients
    x[2, :32] = torch.randn(32).sign() * 3.4e38
    x[2, 40] = -3.4028234e38  # fp32's largest finite value
    x[3, 5] = 1e5
    x[4, :32] = 2.0 ** torch.arange(-16, 16).float()
    x[5, :32] = 448.0 * 2.0 ** torch.arange(-16, 16).float()
    x[6, :32] = torch.full((32,), 2.0**-127)
    x = x.to(device)
    for dim in (0, 1):
        q = dropless.quantize(x, "mxfp8", dim, mx_rounding=rounding)
        assert_same(q, *reference_q(x, "mxfp8", {"mx_rounding": rounding}, dim), f"dim {dim}")


def test_nan_stays_nan(backend):
    """A NaN element quantizes to NaN and leaves the scale of its block to the other elements."""
    _, device = backend
    x = torch.randn(64, 96)
    clean = x.clone()
    x[3, 7] = x[40, 90] = float("nan")
    clean[3, 7] = clean[40, 90] = 0.0
    for name, opts in RECIPES:
        for dim in (0, 1):
            q = dropless.quantize(x.to(device), name, dim, **opts)
            ref = dropless.quantize(clean.to(device), name, dim, **opts)
            nan = torch.isnan(q.data.float())
            assert nan[3, 7] and nan[40, 90] and int(nan.sum()) == 2, (name, dim)
            assert torch.equal(raw(q.scale), raw(ref.scale)), (name, dim)
            assert torch.equal(raw(q.data)[~nan], raw(ref.data)[~nan]), (name, dim)


def test_infinities_match_reference(backend):
    """An infinite element makes its block's scale infinite (fp32) or the largest (E8M0); the kernels and
    the reference agree, NaN for NaN (whose sign bit may differ)."""
    _, device = backend
    x = torch.randn(64, 96)
    x[3, 7], x[40, 90] = float("inf"), -float("inf")
    for name, opts in RECIPES:
        for dim in (0, 1):
            q = dropless.quantize(x.to(device), name, dim, **opts)
            data, scale = reference_q(x, name, opts, dim)
            nan = torch.isnan(data.float())
            assert torch.equal(torch.isnan(q.data.float()).cpu(), nan), (name, dim)
            assert torch.equal(raw(q.data).cpu()[~nan], raw(data)[~nan]), (name, dim)
            assert torch.equal(raw(q.scale).cpu(), raw(scale)), (name, dim)


# ---------------------------------------------------------------------------------------------------
# The reference on its own: hand-computed cases, an independent exponent oracle, round trips


def test_reference_hand_computed_scales():
    amax = torch.tensor([1.0, 448.0, 449.0, 0.0, 480.0, 2.0**-130])
    floor = reference.e8m0_exponent(amax, "floor").tolist()
    rceil = reference.e8m0_exponent(amax, "rceil").tolist()
    # floor(log2(1)) - 8 = -8; ceil(log2(1/448)) = ceil(-8.807) = -8; 448 -> 0 both ways; 449 -> rceil 1.
    assert floor == [-8, 0, 0, -127, 0, -127]
    assert rceil == [-8, 0, 1, -127, 1, -127]
    # A tiny amax gives the least scale, 2**-126 (its reciprocal is finite), and only amax 0 gives 1.
    tiny = 448.0 * 2.0**-140
    assert reference.fp32_scale(torch.tensor([448.0, 896.0, 0.0, tiny, 1e-45]), False).tolist() == \
        [1.0, 2.0, 1.0, 2.0**-126, 2.0**-126]
    # 500 / 448 = 1.116 -> 2; 448 / 448 = 1 stays; 448 * 2**-125 / 448 = 2**-125 is above the floor.
    pow2 = reference.fp32_scale(torch.tensor([500.0, 448.0, tiny, 448.0 * 2.0**-125]), True).tolist()
    assert pow2 == [2.0, 1.0, 2.0**-126, 2.0**-125]


def test_reference_mxfp8_bytes_by_hand():
    x = torch.zeros(1, 64)
    x[0, 0] = 1.0  # block 0: amax 1 -> exponent -8, byte 119; x / 2**-8 = 256
    x[0, 1] = 17.0 * 2.0**-8  # 17 is a tie between 16 and 18: rounds to the even mantissa, 16
    x[0, 2] = 19.0 * 2.0**-8  # 19 ties between 18 and 20: 20
    x[0, 32] = 480.0  # block 1: floor gives 2**0 and 480 saturates to 448; rceil gives 2**1 and 240
    q = reference.quantize(x, get_recipe("mxfp8"), 1)
    assert raw(q[1]).tolist() == [[119, 127]]
    assert q[0][0, :3].float().tolist() == [256.0, 16.0, 20.0]
    assert q[0][0, 32].float().item() == 448.0
    q = reference.quantize(x, get_recipe("mxfp8", mx_rounding="rceil"), 1)
    assert raw(q[1]).tolist() == [[119, 128]] and q[0][0, 32].float().item() == 240.0


def test_reference_fp32_saturation_and_exact_values():
    x = torch.tensor([[448.0, -448.0, 1.0, 0.5, 17.0, 0.0]])
    data, scale = reference.quantize(x, get_recipe("rowwise"), 1)
    assert scale.item() == 1.0
    assert data.float().tolist() == [[448.0, -448.0, 1.0, 0.5, 16.0, 0.0]]


def _fp32_quotient(a: float) -> float:
    """``a / 448`` rounded to fp32: the float64 quotient rounded again is correctly rounded (53 >= 2 * 24 + 2)."""
    return torch.tensor(a / 448.0, dtype=torch.float64).float().item()


def _oracle_exponent(a: float, rounding: str) -> int:
    """The MX exponent from Python floats, where frexp is exact."""
    value = a if rounding == "floor" else _fp32_quotient(a)
    if value == 0.0:
        return -127
    mantissa, exponent = math.frexp(value)
    e = exponent - 1 - 8 if rounding == "floor" else (exponent - 1 if mantissa == 0.5 else exponent)
    return min(max(e, -127), 127)


@pytest.mark.parametrize("rounding", ["floor", "rceil"])
def test_reference_exponents_against_frexp_oracle(rounding):
    amax = torch.cat([torch.rand(2000) * torch.exp2(torch.randint(-149, 128, (2000,)).float()),
                      torch.tensor([0.0, 1e-45, 2.0**-127, 2.0**-126, 448.0 * 2.0**-127, 448.0 * 2.0**-126, 3.4e38])])
    amax = amax[torch.isfinite(amax)]
    got = reference.e8m0_exponent(amax, rounding).tolist()
    assert got == [_oracle_exponent(a, rounding) for a in amax.tolist()]


def test_reference_pow2_scales_against_frexp_oracle():
    amax = torch.rand(2000) * torch.exp2(torch.randint(-149, 120, (2000,)).float())
    amax = torch.cat([amax, torch.tensor([0.0])])
    got = reference.fp32_scale(amax, True).tolist()
    for a, s in zip(amax.tolist(), got):
        if a == 0.0:
            assert s == 1.0
        else:
            mantissa, exponent = math.frexp(max(_fp32_quotient(a), 2.0**-126))
            assert s == 2.0 ** (exponent - 1 if mantissa == 0.5 else exponent)


def _e4m3_of(v: torch.Tensor, s: torch.Tensor, product: bool) -> torch.Tensor:
    """The e4m3 values of fp32 ``v`` scaled by fp32 ``s``, from float64: the product with the reciprocal
    rounded to fp32 (``product``), or the quotient. Float64 makes each step exact before its one rounding to
    fp32 (24 + 24 bits of a product; a quotient rounded twice is rounded once, 53 >= 2 * 24 + 2)."""
    if product:
        y = v.double() * (1.0 / s.double()).float().double()
    else:
        y = v.double() / s.double()
    return y.float().clamp(-448.0, 448.0).to(FP8_DTYPE).float()


@pytest.mark.parametrize("name", ["rowwise", "block128"])
def test_reference_fp32_data_is_the_product_with_the_reciprocal(name):
    """The fp32 recipes store ``e4m3(x * fl(1 / scale))``: against float64, on rows built to hold values
    next to midpoints of e4m3, where that product and the rounded quotient can land on either side (the
    test asserts some do), and a subnormal row, whose scale is the floor 2**-126."""
    rows = 64
    amax = (1 + torch.rand(rows, 1)) * torch.exp2(torch.randint(-30, 30, (rows, 1)).float())
    amax[0] = 1e-39
    s = reference.fp32_scale(amax, False)
    grid = torch.tensor([2.0**e * (1 + m / 8) for e in range(-2, 9) for m in range(8)])[:-1]  # to 448
    mids = ((grid[:-1] + grid[1:]) / 2)[:, None]
    near = (mids * s.T).float()  # [mids, rows], each next to a midpoint once scaled
    steps = torch.tensor([-2, -1, 1, 2], dtype=torch.int32)
    near = (near.view(torch.int32)[None] + steps[:, None, None]).view(torch.float32).reshape(-1, rows).T
    x = torch.cat([amax, near[:, torch.randperm(near.shape[1])[:127]]], 1)
    x[0, 1:] = torch.rand(127) * 1e-39
    data, scale = reference.quantize(x, get_recipe(name), 1)
    assert torch.equal(scale, s) and scale[0].item() == 2.0**-126
    assert torch.equal(data.float(), _e4m3_of(x, scale, product=True))
    assert bool((data.float() != _e4m3_of(x, scale, product=False)).any()), "no element tells the rules apart"


@pytest.mark.parametrize("name, opts", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("dim", [0, 1])
def test_dequantize_round_trip(name, opts, dim):
    """Each element comes back within e4m3's rounding: ``2**-4`` relative, or half a subnormal step
    (``2**-10`` of its scale) for the smallest; mxfp8's floor scales may saturate a block's largest."""
    x = torch.randn(160, 200) * torch.exp2(torch.randint(-8, 8, (160, 1)).float())
    q = dropless.quantize(x, name, dim, **opts)
    back = q.dequantize()
    assert back.dtype == torch.float32 and back.shape == x.shape
    unit = reference.dequantize(QuantizedTensor(torch.ones_like(q.data), q.scale, q.recipe, q.dim))  # each scale
    saturated = q.data.float().abs() == 448.0
    err = (back - x).abs()
    slack = 1 + 1e-6  # the fp32 reciprocal and products (scaling, dequantization) round too
    ok = (err <= E4M3_STEP * x.abs() * slack) | (err <= unit * 2.0**-10 * slack) | saturated
    assert bool(ok.all()), f"{int((~ok).sum())} elements off, worst {float(err[~ok].max())}"
    assert torch.equal(back[saturated].abs(), 448.0 * unit[saturated])


def test_dequantize_per_group_and_bf16():
    sizes = [0, 50, 31, 0, 60]
    x = torch.randn(150, 40)
    for name in ("rowwise", "block128", "mxfp8"):
        q = dropless.quantize(x, name, 0, offsets_of(sizes))
        back = q.dequantize(torch.bfloat16)
        assert back.dtype == torch.bfloat16 and back.shape == x.shape
        assert torch.allclose(back[:141].float(), x[:141], rtol=0.13, atol=1e-2)
        assert not back[141:].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("name, opts", GROUP_RECIPES, ids=GROUP_RECIPE_IDS)
@pytest.mark.parametrize("M, K", [(77, 300), (5, 20), (0, 40)])
def test_dequantize_kernel_matches_reference(name, opts, M, K, dtype):
    """The one-pass kernel for data quantized along the last dim: the reference's fp32 product rounded
    once, bit for bit (NaN where the data is NaN), every element of a poisoned output written; K not a
    multiple of 32 or 128, values over 8 orders of magnitude, an all-zero row (E8M0's 2**-127 scale).
    Results stay in fp32's normal range: the interpreter rounds subnormal ones to bf16 wrongly."""
    from dropless.kernels.dequantize import dequantize_rows

    x = torch.randn(M, K, device=KERNEL_DEVICE) * torch.logspace(-4, 4, K, device=KERNEL_DEVICE)
    if M * K:
        x[0, 0] = float("nan")
        x[-1, :] = 0.0
    q = dropless.quantize(x, name, 1, **opts)
    out = poison(torch.empty(M, K, dtype=dtype, device=KERNEL_DEVICE))
    mx = q.recipe.name == "mxfp8"
    dequantize_rows(q.data, q.scale.view(torch.uint8) if mx else q.scale, q.recipe.block or 0, mx, out)
    expected = reference.dequantize(q).to(dtype)
    assert torch.equal(out.isnan(), expected.isnan())
    assert torch.equal(torch.nan_to_num(out.float(), nan=0.0), torch.nan_to_num(expected.float(), nan=0.0))
    assert torch.equal(q.dequantize(dtype).isnan(), expected.isnan())


@pytest.mark.parametrize("name, opts", GROUP_RECIPES, ids=GROUP_RECIPE_IDS)
@pytest.mark.parametrize("n", [0, 31, 77])
def test_dequantize_kernel_writes_only_the_rows_asked(name, opts, n, triton_backend):
    """``rows=[n]``: the first n rows as without it, bit for bit, and the rest of the poisoned output
    untouched (the rows an expert-parallel buffer holds beyond those received)."""
    from dropless.kernels.dequantize import dequantize_rows

    x = torch.randn(77, 300, device=KERNEL_DEVICE)
    q = dropless.quantize(x, name, 1, **opts)
    mx = q.recipe.name == "mxfp8"
    out = poison(torch.empty(77, 300, dtype=torch.bfloat16, device=KERNEL_DEVICE))
    rows = torch.tensor([n], device=KERNEL_DEVICE)
    dequantize_rows(q.data, q.scale.view(torch.uint8) if mx else q.scale, q.recipe.block or 0, mx, out, rows)
    expected = reference.dequantize(q).to(torch.bfloat16)[:n]
    assert torch.equal(out[:n], expected) and bool(out[n:].isnan().all())
    assert torch.equal(q.dequantize(torch.bfloat16, rows=rows)[:n], expected)  # through the op


def test_dequantize_rows_errors_name_the_argument():
    q = dropless.quantize(torch.randn(8, 32), "rowwise", 1)
    for rows in (torch.tensor([1, 2]), torch.tensor([1.0]), 3):
        with pytest.raises((ValueError, TypeError), match="rows must be"):
            q.dequantize(torch.bfloat16, rows=rows)


# ---------------------------------------------------------------------------------------------------
# The per-group layout


@pytest.mark.parametrize("name", ["rowwise", "block128", "mxfp8"])
def test_no_block_crosses_a_group_boundary(backend, name):
    """Scaling one group's values changes that group's scales and no other group's data or scales."""
    _, device = backend
    sizes = [45, 0, 100, 37]
    x = torch.randn(200, 40)
    offsets = offsets_of(sizes, device)
    q = dropless.quantize(x.to(device), name, 0, offsets)
    x2 = x.clone()
    x2[45:145] *= 1000.0  # group 2
    q2 = dropless.quantize(x2.to(device), name, 0, offsets)
    B = {"rowwise": None, "block128": 128, "mxfp8": 32}[name]
    group2 = [2] if B is None else list(range(45 // B + 2, 45 // B + 2 + -(-100 // B)))
    other = [r for r in range(q.scale.shape[0]) if r not in group2]
    assert torch.equal(raw(q.scale)[other], raw(q2.scale)[other])
    assert not torch.equal(raw(q.scale)[group2], raw(q2.scale)[group2])
    first = data_rows_of(sizes, 200)[0][2]
    rows = [r for r in range(q.data.shape[0]) if not first <= r < first + 100]
    assert torch.equal(raw(q.data)[rows], raw(q2.data)[rows])


@pytest.mark.parametrize("name, opts", GROUP_RECIPES, ids=GROUP_RECIPE_IDS)
@pytest.mark.parametrize("sizes, M", [
    ([0, 70, 0, 80, 50], 213),  # empty groups, rows past offsets[-1]
    ([1, 15, 16, 17, 31, 33, 0, 47, 127, 129, 128], 700),  # starts at many phases of 16 and 128
    ([0, 0, 0], 37),
])
def test_group_data_starts_128_aligned(backend, name, opts, sizes, M):
    """Group e's rows are rows ``128 * (s_e // 128 + e)`` onwards of ``[Mp, K]`` data (``Mp = 128 *
    (cdiv(M, 128) + E)``), each starting 128 bytes into the storage's rows, holding the group quantized on its
    own; every other row is zero."""
    _, device = backend
    x = planted((M, 48), torch.float32, device)
    x[sum(sizes):] = float("nan")  # rows past offsets[-1] belong to no group
    q = dropless.quantize(x, name, 0, offsets_of(sizes, device), **opts)
    firsts, Mp = data_rows_of(sizes, M)
    assert q.shape == (Mp, 48) and q.data.stride() == (1, Mp) and q.tokens == M
    covered = torch.zeros(Mp, dtype=torch.bool)
    for first, (s, t) in zip(firsts, bounds_of(sizes)):
        assert first % 128 == 0 and (q.data[first].data_ptr() - q.data.data_ptr()) % 128 == 0
        alone, _ = reference_q(x[s:t], name, opts, 0)
        assert torch.equal(raw(q.data[first:first + t - s]).cpu(), raw(alone)), (s, t)
        assert not covered[first:first + t - s].any(), "groups overlap"
        covered[first:first + t - s] = True
    assert not raw(q.data).cpu()[~covered].any(), "gaps and rows past the last group must be 0"


@pytest.mark.parametrize("sizes, M", [([0, 130, 5], 140), ([300], 333), ([0, 0, 0], 37), ([128, 0, 1], 129)])
def test_slot_table(sizes, M):
    """The per-group slots written out by hand: group g owns slots ``s_g // 128 + g`` up to the next
    group's first (at least one), the tail (group E) the rest of ``cdiv(M, 128) + E``; each slot's rows
    start 128 apart from its group's start, its data rows from ``p_g``, up to ``p_{g+1}`` (Mp for the tail)."""
    from dropless.kernels.quantize import _SLOT_BLOCK, _slot_table_kernel

    E = len(sizes)
    starts = [s for s, _ in bounds_of(sizes)] + [sum(sizes)]  # the tail's rows start where the groups end
    ends = [e for _, e in bounds_of(sizes)] + [M]
    p, Mp = data_rows_of(sizes, M)
    p += [128 * (starts[E] // 128 + E), Mp]  # where the tail's data rows would start, and the end of all
    firsts = [starts[g] // 128 + g for g in range(E + 1)]
    expected = []
    for slot in range(-(-M // 128) + E):
        g = max(i for i in range(E + 1) if firsts[i] <= slot)
        local = slot - firsts[g]
        expected.append([g, starts[g], ends[g], local, p[g] + 128 * local, p[g + 1]])
    slots = len(expected)
    table = torch.full((slots, 8), -1, dtype=torch.int32, device=KERNEL_DEVICE)
    _slot_table_kernel[(-(-slots // _SLOT_BLOCK),)](offsets_of(sizes, KERNEL_DEVICE), table, M, E, slots, Mp,
                                                    BLOCK_R=128, E_POW2=8, SLOT_BLOCK=_SLOT_BLOCK)
    assert table[:, :6].cpu().tolist() == expected


def test_group_rows_never_overlap():
    """The layout's arithmetic: for any group sizes, each group's rows rounded up to 128 end before the
    next group's start, and the last group's before Mp."""
    rng = torch.Generator().manual_seed(0)
    for _ in range(2000):
        E = int(torch.randint(1, 9, (1,), generator=rng))
        sizes = torch.randint(0, 400, (E,), generator=rng) * (torch.rand(E, generator=rng) > 0.3)
        M = int(sizes.sum()) + int(torch.randint(0, 200, (1,), generator=rng))
        firsts, Mp = data_rows_of(sizes.tolist(), M)
        ends = [first + -(-int(size) // 128) * 128 for first, size in zip(firsts, sizes)]
        assert all(end <= nxt for end, nxt in zip(ends, firsts[1:] + [Mp])), (sizes.tolist(), M)
        assert all(first % 128 == 0 for first in firsts)


def test_group_scale_rows_by_hand(backend):
    """block128 groups of 100, 0, 200 rows in M = 320: group e's block j is scale row s_e // 128 + e + j;
    the rows no block uses hold 1. The data has 128 * (3 + 3) = 768 rows: group 0 at rows 0-99, group 2
    at 256-455 (128 * (100 // 128 + 2)); the rest, the 20 tokens past offsets[-1] included, is 0."""
    _, device = backend
    x = (torch.rand(320, 8) + 1.0).to(device)
    x[0:100] *= 448.0 * 2  # group 0: amax in [896, 1792)
    x[100:228] *= 448.0 * 4  # group 2, block 0
    x[228:300] *= 448.0 * 8  # group 2, block 1
    q = dropless.quantize(x, "block128", 0, torch.tensor([100, 100, 300], device=device))
    assert q.scale.shape == (3 + 3, 8)
    s = q.scale.cpu()
    # Rows: 0 = group 0's block; 1 = group 1 (empty, unused); 2, 3 = group 2's blocks; 4, 5 unused.
    assert bool(((s[0] > 2) & (s[0] <= 4)).all()) and bool(((s[2] > 4) & (s[2] <= 8)).all())
    assert bool(((s[3] > 8) & (s[3] <= 16)).all())
    assert torch.equal(s[[1, 4, 5]], torch.ones(3, 8))
    data = raw(q.data).cpu()
    assert data.shape == (768, 8)
    assert data[0:100].all() and data[256:456].all()  # x >= 1 quantizes to non-zero bytes
    assert not data[100:256].any() and not data[456:].any()


# ---------------------------------------------------------------------------------------------------
# Every element written: outputs poisoned before the kernels run

POISON = {FP8_DTYPE: 0x7F, E8M0_DTYPE: 0xFF}  # NaN bytes


def poison(t: torch.Tensor) -> torch.Tensor:
    if t.element_size() == 1:
        raw(t).fill_(POISON[t.dtype])
    else:
        t.fill_(float("nan"))
    return t


@pytest.mark.parametrize("name, opts", GROUP_RECIPES, ids=GROUP_RECIPE_IDS)
@pytest.mark.parametrize("sizes, M", [
    ([0, 70, 0, 80, 50], 200),  # empty groups, sizes not divisible by 32 or 128
    ([190], 200),  # one giant group, 10 rows past offsets[-1]
    ([0, 0, 0], 37),  # no rows in any group
    ([33, 1, 130, 31, 5], 200),  # starts at every phase of the blocks
])
def test_rows_by_index_give_the_gathered_operand_bits(backend, name, opts, sizes, M):
    """``quantize(x, ..., rows=idx)`` is ``quantize(x[idx], ...)`` bit for bit: the permuted copies of a
    layer's tokens (each token several times, some not at all), read by index."""
    _, device = backend
    x = planted((61, 72), torch.float32, device)
    rows = torch.randint(0, 61, (M,), device=device)
    offsets = offsets_of(sizes, device)
    q = dropless.quantize(x, name, 0, offsets, rows=rows, **opts)
    assert q.tokens == M
    assert_same(q, *reference_q(x[rows], name, opts, 0, offsets), f"{name} {sizes}")


def test_rows_given_as_a_strided_view(triton_backend):
    """Row indices in a view with a stride other than 1 (every other entry of a longer vector) are read
    as the indices they are, not as the memory behind them."""
    x = planted((40, 72), torch.float32, triton_backend)
    every_other = torch.randint(0, 40, (2 * 90,), device=triton_backend)
    rows = every_other[::2]
    offsets = offsets_of([30, 0, 55], triton_backend)
    for name in ("rowwise", "block128"):
        q = dropless.quantize(x, name, 0, offsets, rows=rows)
        assert_same(q, *reference_q(x[rows], name, {}, 0, offsets), name)


@pytest.mark.parametrize("name", ["rowwise", "mxfp8"])
def test_rows_kernel_writes_every_element(name):
    recipe = get_recipe(name)
    x = planted((23, 40), torch.float32, KERNEL_DEVICE)
    rows = torch.randint(0, 23, (77,), device=KERNEL_DEVICE)
    offsets = offsets_of([0, 30, 0, 25], KERNEL_DEVICE)
    data, scale = empty_quantized((77, 40), recipe, 0, 4, KERNEL_DEVICE)
    quantize_along(x, poison(data), poison(scale), recipe, 0, offsets, rows)
    assert_same(QuantizedTensor(data, scale, recipe, 0), *reference.quantize(x[rows].cpu(), recipe, 0, offsets.cpu()))


def test_rows_errors_name_the_argument():
    x = torch.randn(10, 16)
    offsets = torch.tensor([4, 12], dtype=torch.int32)
    rows = torch.arange(12) % 10
    cases = [
        (dict(rows=rows), ValueError, r"^rows needs offsets"),
        (dict(offsets=offsets, rows=rows.float()), ValueError, r"^rows must be a 1D int32/int64 tensor"),
        (dict(offsets=offsets, rows=rows[None]), ValueError, r"^rows must be a 1D int32/int64 tensor"),
        (dict(offsets=offsets, rows=[0, 1]), TypeError, r"rows"),
    ]
    for kwargs, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            dropless.quantize(x, "rowwise", 0, **kwargs)


@pytest.mark.parametrize("name, opts", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("dim, sizes, M", [
    (1, None, 77), (0, None, 77), (0, [0, 30, 0, 25], 77), (0, [0, 0], 0), (0, None, 0), (1, None, 0),
])
def test_kernels_write_every_element(name, opts, dim, sizes, M):
    if sizes is not None and name == "block128x128":
        pytest.skip("block128x128 has no per-group layout")
    recipe = get_recipe(name, **opts)
    x = planted((M, 40), torch.float32, KERNEL_DEVICE) if M else torch.empty(0, 40, device=KERNEL_DEVICE)
    offsets = None if sizes is None else offsets_of(sizes, KERNEL_DEVICE)
    data, scale = empty_quantized(x.shape, recipe, dim, None if sizes is None else len(sizes), KERNEL_DEVICE)
    quantize_along(x, poison(data), poison(scale), recipe, dim, offsets)
    assert_same(QuantizedTensor(data, scale, recipe, dim), *reference.quantize(x.cpu(), recipe, dim, offsets))


def untouched(t: torch.Tensor) -> bool:
    """Every element of ``t`` still holds the poison."""
    return bool((raw(t) == POISON[t.dtype]).all()) if t.element_size() == 1 else bool(t.isnan().all())


def assert_same_bits(data: torch.Tensor, ref_data: torch.Tensor, what: str = "") -> None:
    """FP8 ``data`` holds the reference's bytes, NaN for NaN (whose sign bit may differ)."""
    nan = torch.isnan(ref_data.float())
    assert torch.equal(torch.isnan(data.float()).cpu(), nan), what
    bad = raw(data).cpu()[~nan] != raw(ref_data)[~nan]
    assert not bad.any(), f"{what}: {int(bad.sum())} data bytes differ"


@pytest.mark.parametrize("name, opts", GROUP_RECIPES, ids=GROUP_RECIPE_IDS)
@pytest.mark.parametrize("dim", [0, 1])
@pytest.mark.parametrize("sizes, M", [([0, 70, 0, 81], 400), ([0, 0], 130), ([300], 300)])
def test_bound_writes_the_groups_rows_and_leaves_the_tail(name, opts, dim, sizes, M):
    """``bound=offsets[-1:]`` (``quantize(tail=False)``): the groups' rows (per group along the tokens, with
    the zeros up to the tail's first row) as the reference has them, and not one byte past them."""
    recipe = get_recipe(name, **opts)
    x = planted((M, 40), torch.float32, KERNEL_DEVICE)
    offsets = offsets_of(sizes, KERNEL_DEVICE)
    groups = offsets if dim == 0 else None
    data, scale = (poison(t) for t in empty_quantized(x.shape, recipe, dim, len(sizes) if dim == 0 else None,
                                                      KERNEL_DEVICE))
    quantize_along(x, data, scale, recipe, dim, groups, bound=offsets[-1:])
    ref_data, ref_scale = reference.quantize(x.cpu(), recipe, dim, None if groups is None else offsets.cpu())
    routed = sum(sizes)
    written, scale_rows = routed, routed
    if dim == 0:
        written = data_rows_of([*sizes, M - routed], M)[0][-1]  # the tail's first data row: p_E
        scale_rows = len(sizes) if recipe.block is None else routed // recipe.block + len(sizes)
    assert_same(QuantizedTensor(data[:written], scale[:scale_rows], recipe, dim),
                ref_data[:written], ref_scale[:scale_rows].contiguous())
    assert untouched(data[written:]) and untouched(scale[scale_rows:])


@pytest.mark.gpu
@pytest.mark.parametrize("name, opts", GROUP_RECIPES, ids=GROUP_RECIPE_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("sizes, M, K", [
    ([0, 70, 0, 80, 50], 200, 72),  # empty groups, sizes not divisible by 32 or 128, a partial column tile
    ([190], 200, 136),  # one giant group, 10 rows past offsets[-1]
    ([0, 0, 0], 37, 64),  # no rows in any group
    ([33, 1, 130, 31, 5], 200, 72),  # starts at every phase of the blocks
    (group_sizes(200, 8993, "skewed"), 9000, 200),  # more tiles than programs, a group table of 256, a tail
])
@pytest.mark.parametrize("tail, gather", [(True, False), (False, False), (True, True), (False, True)])
@pytest.mark.parametrize("launch", [None, (1, 3, 3, 4)], ids=["default", "1x3x3x4"])
def test_hopper_group_kernel_bit_exact(monkeypatch, name, opts, dtype, sizes, M, K, tail, gather, launch):
    """The Gluon kernel for 16-bit x per group along the tokens (``quantize_hopper``), bit for bit the
    reference, NaN and infinities included, every element of the poisoned outputs written; with
    ``tail=False``, not one byte past the groups' rows; with ``rows``, the rows of x read by index. Also
    with the blockwise tiles' other launch, ``launch`` = ``(TMA_LOADER_WARPS, PROGRAMS_PER_SM, STAGES,
    TILE_THREAD_ROWS)``: one loader warp, three programs a multiprocessor of three stages, four rows a
    thread."""
    from dropless.kernels import quantize_hopper
    from dropless.kernels.launch import hopper_gluon_device
    from dropless.kernels.quantize_hopper import quantize_groups_hopper_ok

    if not (CUDA and hopper_gluon_device(KERNEL_DEVICE)):
        pytest.skip("needs an sm_90 GPU")
    for attribute, value in zip(("TMA_LOADER_WARPS", "PROGRAMS_PER_SM", "STAGES", "TILE_THREAD_ROWS"), launch or ()):
        monkeypatch.setattr(quantize_hopper, attribute, value)
    recipe = get_recipe(name, **opts)
    source_rows = 61 if gather else M
    x = planted((source_rows, K), dtype, KERNEL_DEVICE)
    x[min(8, source_rows - 1), 5] = float("nan")
    x[min(20, source_rows - 1), 7] = float("inf")
    rows = torch.randint(0, source_rows, (M,), device=KERNEL_DEVICE) if gather else None
    operand = x if rows is None else x[rows]
    offsets = offsets_of(sizes, KERNEL_DEVICE)
    data, scale = (poison(t) for t in empty_quantized(operand.shape, recipe, 0, len(sizes), KERNEL_DEVICE))
    assert quantize_groups_hopper_ok(x, data, recipe, rows)
    quantize_along(x, data, scale, recipe, 0, offsets, rows, bound=None if tail else offsets[-1:])
    ref_data, ref_scale = reference.quantize(operand.cpu(), recipe, 0, offsets.cpu())
    written, scale_rows = data.shape[0], scale.shape[0]
    if not tail:
        routed = sum(sizes)
        written = data_rows_of([*sizes, M - routed], M)[0][-1]
        scale_rows = len(sizes) if recipe.block is None else routed // recipe.block + len(sizes)
    assert_same_bits(data[:written], ref_data[:written])
    assert torch.equal(raw(scale[:scale_rows]).cpu(), raw(ref_scale[:scale_rows]))
    assert untouched(data[written:]) and untouched(scale[scale_rows:])


def test_rowwise_chunks_leave_a_strip_fewer_chunks_than_programs():
    """``chunk_rows``: a multiple of 128 rows, at least ``MIN_CHUNK_ROWS`` and half a program's share of
    the strips' rows, and few enough chunks a strip (at most ``cdiv(M, chunk)``) that the programs holding
    them cannot all be waiting, and that a chunk's number fits its item's ``CHUNK_SLOTS``."""
    from dropless.kernels.quantize_hopper import CHUNK_SLOTS, MIN_CHUNK_ROWS, chunk_rows

    for programs in (3, 4, 66, 132, 2000):
        for M in (1, 127, 2048, 2049, 65536, 10**6, 9 * 10**6):
            for C in (8, 768, 7168):
                chunk = chunk_rows(M, C, programs)
                assert chunk % 128 == 0 and chunk >= MIN_CHUNK_ROWS
                assert 2 * chunk >= M * -(-C // 64) / programs
                assert -(-M // chunk) < min(programs, CHUNK_SLOTS.value), (M, C, programs, chunk)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [128, 384])
@pytest.mark.parametrize("sizes, M, K", [
    ([2000, 0, 130, 1, 0, 700], 3000, 200),  # one giant group in many chunks, empty groups, a tail
    ([128 * 9], 128 * 9, 64),  # a group of whole chunks, no tail
    ([0, 0, 2300], 2400, 136),  # the last group the only one, a partial column tile
    (group_sizes(64, 8000, "skewed"), 8100, 72),  # many strips and chunks, a group table of 128
])
@pytest.mark.parametrize("tail", [True, False])
def test_hopper_rowwise_chunks_bit_exact(monkeypatch, chunk, sizes, M, K, tail):
    """Rowwise per group on the Gluon kernel with long strips cut into chunks of ``chunk`` rows, drawn by
    work, the chunks of a strip meeting through its amaxes: bit for bit the reference, every element of
    the poisoned outputs written, and with ``tail=False`` not one byte past the groups' rows."""
    from dropless.kernels import quantize_hopper
    from dropless.kernels.launch import hopper_gluon_device

    if not (CUDA and hopper_gluon_device(KERNEL_DEVICE)):
        pytest.skip("needs an sm_90 GPU")
    monkeypatch.setattr(quantize_hopper, "MIN_CHUNK_ROWS", chunk)
    monkeypatch.setattr(quantize_hopper, "STATIC_MAX_GROUPS", 0)  # few groups too are drawn by work
    recipe = get_recipe("rowwise", pow2=chunk == 384)
    x = planted((M, K), torch.bfloat16, KERNEL_DEVICE)
    x[8, 5] = float("nan")
    x[20, 7] = float("inf")
    offsets = offsets_of(sizes, KERNEL_DEVICE)
    data, scale = (poison(t) for t in empty_quantized(x.shape, recipe, 0, len(sizes), KERNEL_DEVICE))
    quantize_along(x, data, scale, recipe, 0, offsets, bound=None if tail else offsets[-1:])
    ref_data, ref_scale = reference.quantize(x.cpu(), recipe, 0, offsets.cpu())
    written, scale_rows = data.shape[0], scale.shape[0]
    if not tail:
        written, scale_rows = data_rows_of([*sizes, M - sum(sizes)], M)[0][-1], len(sizes)
    assert_same_bits(data[:written], ref_data[:written])
    assert torch.equal(raw(scale[:scale_rows]).cpu(), raw(ref_scale[:scale_rows]))
    assert untouched(data[written:]) and untouched(scale[scale_rows:])


@pytest.mark.gpu
@pytest.mark.parametrize("by_work, chunk", [(False, None), (True, None), (True, 128)])
def test_hopper_rowwise_strips_drawn_in_a_cuda_graph(monkeypatch, by_work, chunk):
    """Rowwise per group on the Gluon kernel (four groups: strips in the static order; ``by_work``: drawn
    from a counter the call zeroes; with ``chunk``, long strips cut into chunks that wait for each other)
    runs with host syncs forbidden, and a CUDA graph of it replays right, bit for bit, with new group
    sizes: one group with every row, all empty, balanced."""
    from dropless.kernels import quantize_hopper
    from dropless.kernels.launch import hopper_gluon_device

    if not (CUDA and hopper_gluon_device(KERNEL_DEVICE)):
        pytest.skip("needs an sm_90 GPU")
    if by_work:
        monkeypatch.setattr(quantize_hopper, "STATIC_MAX_GROUPS", 0)
    if chunk:
        monkeypatch.setattr(quantize_hopper, "MIN_CHUNK_ROWS", chunk)
    x = torch.randn(4096, 320, device="cuda", dtype=torch.bfloat16)
    offsets = offsets_of([3000, 0, 1000, 50], "cuda")
    dropless.quantize(x, "rowwise", 0, offsets)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dropless.quantize(x, "rowwise", 0, offsets)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dropless.quantize(x, "rowwise", 0, offsets)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = dropless.quantize(x, "rowwise", 0, offsets)
    for sizes in ([4000, 0, 0, 96], [0, 0, 0, 0], [1024] * 4):
        offsets.copy_(offsets_of(sizes, "cuda"))
        x.copy_(torch.randn_like(x))
        graph.replay()
        ref_data, ref_scale = reference.quantize(x.cpu(), get_recipe("rowwise"), 0, offsets.cpu())
        assert_same_bits(q.data, ref_data)
        assert torch.equal(q.scale.cpu(), ref_scale), sizes


WEIGHT_HOPPER_RECIPES = [("mxfp8", {}), ("mxfp8", {"mx_rounding": "rceil"}), ("block128x128", {}),
                         ("block128x128", {"pow2": True})]
WEIGHT_HOPPER_IDS = ["mxfp8", "mxfp8-rceil", "block128x128", "block128x128-pow2"]


def planted_weight(E: int, K: int, N: int, dtype: torch.dtype, layout: str) -> torch.Tensor:
    """``planted`` values in ``w [E, K, N]`` on the kernels' device, stored as ``make_w``'s ``layout`` says,
    with a NaN, an infinity and, in bf16, a slice of magnitudes near 2**100."""
    storage = planted((E, N, K) if layout == "nk" else (E, K, N), dtype, KERNEL_DEVICE)
    w = storage.transpose(1, 2) if layout == "nk" else storage
    w[0, 5, 7] = float("nan")
    w[-1, 20, 9] = float("inf")
    if dtype == torch.bfloat16:
        w[-1, :, 3] *= 2.0**100
    return w


@pytest.mark.gpu
@pytest.mark.parametrize("name, opts", WEIGHT_HOPPER_RECIPES, ids=WEIGHT_HOPPER_IDS)
@pytest.mark.parametrize("layout", ["nk", "kn"])
@pytest.mark.parametrize("E, K, N, dtype", [
    (1, 256, 384, torch.bfloat16),
    (3, 208, 144, torch.float16),  # neither a multiple of 32: partial blocks and tiles along both dims
    (8, 1008, 80, torch.bfloat16),  # a last 128x128 tile of one 64-column half along N
    (3, 4096, 128, torch.float16),
])
def test_hopper_weight_kernel_bit_exact(name, opts, layout, E, K, N, dtype):
    """The Gluon kernel for a 16-bit weight's two orientations (``quantize_weight_hopper``), chosen by
    ``quantize_weight_3d`` for both storage orders, bit for bit the reference, NaN and infinities
    included, every element of the poisoned outputs written."""
    from dropless.kernels.launch import hopper_gluon_device
    from dropless.kernels.quantize_weight_hopper import quantize_weight_hopper_ok

    if not (CUDA and hopper_gluon_device(KERNEL_DEVICE)):
        pytest.skip("needs an sm_90 GPU")
    recipe = get_recipe(name, **opts)
    w = planted_weight(E, K, N, dtype, layout)
    data_k, scale_k = (poison(t) for t in empty_quantized(w.shape, recipe, 1, None, KERNEL_DEVICE))
    data_n, scale_n = (poison(t) for t in empty_quantized(w.shape, recipe, 2, None, KERNEL_DEVICE))
    scale_n = scale_k if recipe.tile else scale_n
    assert quantize_weight_hopper_ok(w, data_k, data_n, recipe)
    quantize_weight_3d(w, data_k, data_n, scale_k, scale_n, recipe)
    for data, scale, dim in ((data_k, scale_k, 1), (data_n, scale_n, 2)):
        ref_data, ref_scale = reference.quantize(w.cpu(), recipe, dim)
        assert_same_bits(data, ref_data, f"dim {dim}")
        assert torch.equal(raw(scale).cpu(), raw(ref_scale)), f"dim {dim} scales"


def test_hopper_weight_kernel_refuses():
    """Weights the Gluon kernel does not take stay on the Triton kernels: rowwise and block128, fp32, K
    not a multiple of 16 (the FP8 data's rows would not be 16-byte aligned for TMA), storage in neither
    order, no elements; and everything off an sm_90 GPU or under the interpreter."""
    from dropless.kernels.launch import hopper_gluon_device
    from dropless.kernels.quantize_weight_hopper import quantize_weight_hopper_ok

    def ok(w: torch.Tensor, name: str) -> bool:
        recipe = get_recipe(name)
        data_k, _ = empty_quantized(w.shape, recipe, 1, None, w.device)
        data_n, _ = empty_quantized(w.shape, recipe, 2, None, w.device)
        return quantize_weight_hopper_ok(w, data_k, data_n, recipe)

    w = make_w(3, 256, 128, torch.bfloat16, KERNEL_DEVICE)
    assert ok(w, "mxfp8") == (CUDA and hopper_gluon_device(KERNEL_DEVICE))
    assert not ok(w, "rowwise") and not ok(w, "block128")
    assert not ok(w.float(), "mxfp8")
    assert not ok(make_w(3, 200, 128, torch.bfloat16, KERNEL_DEVICE), "block128x128")
    assert not ok(torch.randn(256, 128, 3, dtype=torch.bfloat16, device=KERNEL_DEVICE).permute(2, 0, 1), "mxfp8")
    assert not ok(make_w(3, 0, 128, torch.bfloat16, KERNEL_DEVICE), "mxfp8")


def test_tail_errors_name_the_argument():
    x = torch.randn(10, 16)
    offsets = torch.tensor([4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^tail=False needs offsets"):
        dropless.quantize(x, "rowwise", 1, tail=False)
    with pytest.raises(ValueError, match=r"^offsets need a 2D x quantized along dim 0"):
        dropless.quantize(x, "rowwise", 1, offsets)
    q = dropless.quantize(x, "rowwise", 1, offsets, tail=False)
    assert q.offsets is None and q.dim == 1 and q.data.shape == x.shape


@pytest.mark.parametrize("name, opts", RECIPES, ids=RECIPE_IDS)
@pytest.mark.parametrize("E, K, N", [(2, 70, 33), (1, 0, 16), (2, 16, 0), (5, 96, 64)])
def test_weight_kernel_writes_every_element(name, opts, E, K, N):
    recipe = get_recipe("block128x128" if name == "block128" else name, **opts)
    w = make_w(E, K, N, torch.float32, KERNEL_DEVICE)
    data_k, scale_k = (poison(t) for t in empty_quantized(w.shape, recipe, 1, None, KERNEL_DEVICE))
    data_n, scale_n = (poison(t) for t in empty_quantized(w.shape, recipe, 2, None, KERNEL_DEVICE))
    quantize_weight_3d(w, data_k, data_n, scale_k, scale_k if recipe.tile else scale_n, recipe)
    assert_same(QuantizedTensor(data_k, scale_k, recipe, 1), *reference.quantize(w.cpu(), recipe, 1))
    assert_same(QuantizedTensor(data_n, scale_k if recipe.tile else scale_n, recipe, 2),
                *reference.quantize(w.cpu(), recipe, 2))


@pytest.mark.parametrize("chunk_r, warps", [(16, 4), (32, 8), (128, 4)])
def test_tile128_chunks(chunk_r, warps, monkeypatch):
    """The 128x128 kernel walks each tile in chunks of rows, twice: every chunk size gives the
    reference's bytes, for a weight over several tiles with partial ones at both edges and a 2D x along
    either dim."""
    recipe = get_recipe("block128x128")
    monkeypatch.setattr(quantize_kernels, "_tile128_shape", lambda: (chunk_r, warps))
    x = planted((213, 290), torch.float32, KERNEL_DEVICE)
    for dim in (0, 1):
        data, scale = empty_quantized(x.shape, recipe, dim, None, KERNEL_DEVICE)
        quantize_along(x, poison(data), poison(scale), recipe, dim)
        assert_same(QuantizedTensor(data, scale, recipe, dim), *reference.quantize(x.cpu(), recipe, dim), f"dim {dim}")
    w = make_w(2, 150, 290, torch.float32, KERNEL_DEVICE)
    data_k, scale_k = (poison(t) for t in empty_quantized(w.shape, recipe, 1, None, KERNEL_DEVICE))
    data_n, _ = (poison(t) for t in empty_quantized(w.shape, recipe, 2, None, KERNEL_DEVICE))
    quantize_weight_3d(w, data_k, data_n, scale_k, scale_k, recipe)
    assert_same(QuantizedTensor(data_k, scale_k, recipe, 1), *reference.quantize(w.cpu(), recipe, 1), "weight K")
    assert_same(QuantizedTensor(data_n, scale_k, recipe, 2), *reference.quantize(w.cpu(), recipe, 2), "weight N")


# ---------------------------------------------------------------------------------------------------
# Both orientations of an activation from one launch


@pytest.mark.parametrize("name, opts", GROUP_RECIPES, ids=GROUP_RECIPE_IDS)
@pytest.mark.parametrize("sizes, M, K, dtype", [
    ([0, 70, 0, 80, 50], 200, 72, torch.float32),  # empty groups, sizes not divisible by 16, 32 or 128
    ([300], 333, 40, torch.float32),  # one giant group over several tiles, 33 rows past offsets[-1]
    ([0, 0, 0], 37, 72, torch.float32),  # no rows in any group: every row is past offsets[-1]
    ([33, 1, 130, 31, 5], 213, 290, torch.bfloat16),  # starts at every phase of the blocks, K over two tiles
    ([0, 0], 0, 72, torch.float32),  # no rows at all
])
def test_pair_matches_two_calls(backend, name, opts, sizes, M, K, dtype):
    """``quantize_pair`` gives what the two separate calls give, bit for bit, NaN rows past offsets[-1]
    included (quantized along K, absent along the tokens)."""
    _, device = backend
    x = planted((M, K), torch.float32)
    x[sum(sizes):, 3] = float("nan")
    x = x.to(dtype).to(device)
    offsets = offsets_of(sizes, device)
    along_k, along_m = quantize_pair(x, name, offsets, **opts)
    expected_k = dropless.quantize(x, name, 1, **opts)
    expected_m = dropless.quantize(x, name, 0, offsets, **opts)
    assert_same(along_k, expected_k.data, expected_k.scale, f"{name} {sizes} along K")
    assert_same(along_m, expected_m.data, expected_m.scale, f"{name} {sizes} along the tokens")
    assert (along_k.dim, along_k.offsets, along_k.recipe) == (1, None, expected_k.recipe)
    assert along_m.dim == 0 and along_m.tokens == M and along_m.recipe == expected_m.recipe
    assert along_m.offsets.dtype == torch.int32 and along_m.offsets.tolist() == offsets.tolist()
    check_quantized("along_k", along_k, ndim=2, dim=1)
    check_quantized("along_m", along_m, ndim=2, dim=0)


@pytest.mark.parametrize("name, opts", GROUP_RECIPES, ids=GROUP_RECIPE_IDS)
@pytest.mark.parametrize("sizes, M", [([0, 30, 0, 25], 77), ([130], 130), ([0, 0], 0), ([0], 50)])
def test_pair_kernel_writes_every_element(name, opts, sizes, M, monkeypatch):
    """One launch of the tile kernel (rowwise: two, the amaxes first) fills all four outputs, poisoned
    beforehand."""
    recipe = get_recipe(name, **opts)
    x = planted((M, 40), torch.float32, KERNEL_DEVICE) if M else torch.empty(0, 40, device=KERNEL_DEVICE)
    offsets = offsets_of(sizes, KERNEL_DEVICE)
    data_k, scale_k = (poison(t) for t in empty_quantized(x.shape, recipe, 1, None, KERNEL_DEVICE))
    data_m, scale_m = (poison(t) for t in empty_quantized(x.shape, recipe, 0, len(sizes), KERNEL_DEVICE))
    launches = []
    kernel = quantize_kernels._tile_kernel
    monkeypatch.setattr(quantize_kernels, "_tile_kernel", _Counted(kernel, launches))
    quantize_both(x, data_k, scale_k, data_m, scale_m, recipe, offsets)
    assert len(launches) == (2 if recipe.block is None else 1)
    assert_same(QuantizedTensor(data_k, scale_k, recipe, 1), *reference.quantize(x.cpu(), recipe, 1), "along K")
    assert_same(QuantizedTensor(data_m, scale_m, recipe, 0), *reference.quantize(x.cpu(), recipe, 0, offsets.cpu()),
                "along the tokens")


class _Counted:
    """A Triton kernel whose launches (``kernel[grid](...)``) are appended to ``launches``."""

    def __init__(self, kernel, launches: list) -> None:
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


# ---------------------------------------------------------------------------------------------------
# Plans: what an eager call decided, kept per call signature


# (dim, per group, rows read by index, tail): the calls the FP8 products make, and plain ones.
PLAN_CALLS = [(1, False, False, True), (1, False, False, False), (0, True, False, False), (0, True, True, False),
              (0, True, False, True), (0, False, False, True)]


@pytest.mark.parametrize("name, opts", GROUP_RECIPES, ids=GROUP_RECIPE_IDS)
@pytest.mark.parametrize("dim, grouped, gathered, tail", PLAN_CALLS)
def test_plan_gives_the_checked_calls_bits(triton_backend, name, opts, dim, grouped, gathered, tail):
    """The second call of a signature runs the plan its first call kept and gives, on fresh inputs (other
    values, other group sizes, the same shapes), the reference's bytes: all of them, or with
    ``tail=False`` those of the groups' rows."""
    recipe = get_recipe(name, **opts)
    dtype = torch.bfloat16 if CUDA else torch.float32
    M, K, T = 200, 96, 150
    for call, sizes in enumerate(([0, 70, 0, 81], [150, 0, 30, 0])):
        source = planted((T if gathered else M, K), dtype, triton_backend)
        rows = torch.randint(0, T, (M,), device=triton_backend) if gathered else None
        offsets = offsets_of(sizes, triton_backend) if grouped or not tail else None
        q = dropless.quantize(source, name, dim, offsets if grouped or not tail else None, rows=rows, tail=tail,
                              **opts)
        assert len(quantize_ops._PLANS) == 1, f"call {call} keeps one plan for one signature"
        operand = source if rows is None else source[rows]
        ref_data, ref_scale = reference.quantize(operand.cpu(), recipe, dim, offsets.cpu() if grouped else None)
        written, scale_rows = ref_data.shape[0], ref_scale.shape[0]
        if not tail:
            routed = sum(sizes)
            written = data_rows_of([*sizes, M - routed], M)[0][-1] if grouped else routed
            scale_rows = routed if not grouped else len(sizes) if recipe.block is None else \
                routed // recipe.block + len(sizes)
        assert_same_bits(q.data[:written], ref_data[:written], f"call {call}")
        assert torch.equal(raw(q.scale[:scale_rows]).cpu(), raw(ref_scale[:scale_rows])), f"call {call}"
        assert (q.dim, q.recipe, q.tokens) == (dim, recipe, M if grouped else None)
        assert (q.offsets is None) != grouped and (not grouped or q.offsets.tolist() == offsets.tolist())
        check_quantized("q", q, ndim=2, dim=dim)


def test_plan_keeps_the_checks(triton_backend):
    """A signature with a plan still refuses what its checks refuse: a dim given as a bool, another dtype,
    offsets of the wrong dtype; and calls that validate offsets on the device keep no plan."""
    x = torch.randn(64, 32, device=triton_backend)
    offsets = offsets_of([30, 20], triton_backend)
    dropless.quantize(x, "rowwise", 1)
    dropless.quantize(x, "rowwise", 0, offsets)
    assert len(quantize_ops._PLANS) == 2
    with pytest.raises(ValueError, match=r"^dim must be an int"):
        dropless.quantize(x, "rowwise", True)
    with pytest.raises(TypeError, match=r"^offsets must be int32 or int64"):
        dropless.quantize(x, "rowwise", 0, offsets.float())
    with pytest.raises(TypeError, match=r"^x must be a floating tensor"):
        dropless.quantize(x.to(torch.int32), "rowwise", 1)
    dropless.set_validation(True)
    try:
        dropless.quantize(x, "rowwise", 0, offsets_of([10, 20], triton_backend))
    finally:
        dropless.set_validation(False)
    assert len(quantize_ops._PLANS) == 2


# ---------------------------------------------------------------------------------------------------
# Argument errors


def test_bad_arguments():
    x = torch.randn(16, 32)
    offsets = torch.tensor([8, 16], dtype=torch.int32)
    cases = [
        (ValueError, r"^recipe must be one of", lambda: dropless.quantize(x, "fp4")),
        (ValueError, r"^recipe must be one of", lambda: dropless.quantize(x, dropless.Recipe("rowwise", 64))),
        (TypeError, r"^x must be a torch.Tensor", lambda: dropless.quantize(x.tolist(), "rowwise")),
        (TypeError, r"^x must be a floating tensor", lambda: dropless.quantize(x.to(torch.int32), "rowwise")),
        (TypeError, r"^x must be a floating tensor", lambda: dropless.quantize(x.double(), "rowwise")),
        (ValueError, r"^x must have 2 or 3 dimensions", lambda: dropless.quantize(x[0], "rowwise")),
        (ValueError, r"^dim must be an int in \[-2, 2\)", lambda: dropless.quantize(x, "rowwise", 2)),
        (ValueError, r"^dim must be 1 or 2", lambda: dropless.quantize(x.view(2, 8, 32), "rowwise", 0)),
        (ValueError, r"^offsets need a 2D x quantized along dim 0",
         lambda: dropless.quantize(x, "rowwise", 1, offsets)),
        (ValueError, r"^offsets need a 2D x", lambda: dropless.quantize(x.view(2, 8, 32), "rowwise", 1, offsets)),
        (ValueError, r"^offsets must have shape \[E\]", lambda: dropless.quantize(x, "rowwise", 0, offsets.view(1, 2))),
        (TypeError, r"^offsets must be int32 or int64", lambda: dropless.quantize(x, "rowwise", 0, offsets.float())),
        (TypeError, r"^offsets must be a torch.Tensor", lambda: dropless.quantize(x, "rowwise", 0, [8, 16])),
        (ValueError, r"^recipe block128x128 cannot restart", lambda: dropless.quantize(x, "block128x128", 0, offsets)),
        (ValueError, r"^mx_rounding applies to the mxfp8 recipe only",
         lambda: dropless.quantize(x, "rowwise", mx_rounding="rceil")),
        (ValueError, r"^mx_rounding must be one of", lambda: dropless.quantize(x, "mxfp8", mx_rounding="up")),
        (ValueError, r"^pow2 applies to the fp32-scaled recipes", lambda: dropless.quantize(x, "mxfp8", pow2=True)),
        (ValueError, r"^w must have 3 dimensions", lambda: dropless.quantize_weight(x, "mxfp8")),
        (ValueError, r"^recipe block128x128 cannot restart", lambda: quantize_pair(x, "block128x128", offsets)),
        (ValueError, r"^x must have 2 dimensions", lambda: quantize_pair(x.view(2, 8, 32), "mxfp8", offsets)),
        (TypeError, r"^offsets must be a torch.Tensor", lambda: quantize_pair(x, "block128", [8, 16])),
        (TypeError, r"^w must be a floating tensor",
         lambda: dropless.quantize_weight(torch.zeros(2, 8, 32, dtype=torch.int32), "mxfp8")),
    ]
    for error, match, call in cases:
        with pytest.raises(error, match=match):
            call()


def test_offsets_on_another_device_is_an_error():
    if not CUDA:
        pytest.skip("needs a second device")
    with pytest.raises(ValueError, match=r"^offsets is on"):
        dropless.quantize(torch.randn(8, 8, device="cuda"), "rowwise", 0, torch.tensor([8]))


def test_check_quantized_errors():
    q = dropless.quantize(torch.randn(64, 96), "mxfp8", 0, offsets_of([30, 20]))
    check_quantized("x", q, ndim=2, dim=0)

    def with_(**changes):
        return QuantizedTensor(**{**vars(q), **changes})

    cases = [
        (TypeError, r"^x must be a dropless.QuantizedTensor", q.data),
        (TypeError, r"^x.data must be float8_e4m3fn", with_(data=q.data.float())),
        (TypeError, r"^x.scale must be torch.float8_e8m0fnu", with_(scale=q.scale.float())),
        (ValueError, r"^x.scale must have shape \[6, 96\]", with_(scale=q.scale[:3])),
        (ValueError, r"^x.data must have unit stride along its quantized dim 0", with_(data=q.data.contiguous())),
        (ValueError, r"^x.recipe must be one of", with_(recipe=dropless.Recipe("mxfp8", 16))),
        (ValueError, r"^x has offsets, which need 2D data quantized along dim 0",
         with_(dim=1, data=q.data.contiguous())),
        (ValueError, r"^x.offsets must be int32/int64", with_(offsets=q.offsets.float())),
        (ValueError, r"^x.tokens must be the int number of rows M", with_(tokens=None)),
        (ValueError, r"^x.data must have 128 \* \(cdiv\(M, 128\) \+ E\) = 384 rows for M=64",
         with_(data=torch.zeros(96, 64, dtype=FP8_DTYPE).t())),  # x's shape: not the per-group layout
        (ValueError, r"^x.data must have 128 \* \(cdiv\(M, 128\) \+ E\) = 512 rows for M=200", with_(tokens=200)),
    ]
    for error, match, bad in cases:
        with pytest.raises(error, match=match):
            check_quantized("x", bad)
    with pytest.raises(ValueError, match=r"^x must be quantized along dim 1"):
        check_quantized("x", q, dim=1)
    with pytest.raises(ValueError, match=r"^x must have 3 dimensions"):
        check_quantized("x", q, ndim=3)
    rowwise = dropless.quantize(torch.randn(8, 16), "rowwise")
    with pytest.raises(ValueError, match=r"^y.scale must have shape \[8, 1\]"):
        check_quantized("y", QuantizedTensor(rowwise.data, rowwise.scale.view(1, 8), rowwise.recipe, 1))


def test_triton_on_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    dropless.set_backend("triton")
    with pytest.raises(RuntimeError, match="Triton kernels need a CUDA tensor"):
        dropless.quantize(torch.randn(4, 4), "rowwise")


# ---------------------------------------------------------------------------------------------------
# The swizzled MX scale layout (cuBLAS's "1D block scaling factors layout")


def blocked_by_formula(scale: torch.Tensor) -> torch.Tensor:
    """Scale ``(r, c)`` at ``tile * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4`` of the flat layout,
    tiles of 128x4 in row-major order, zeros where padded."""
    rows, cols = scale.shape
    col_tiles = -(-cols // 4)
    flat = torch.zeros(-(-rows // 128) * 128 * col_tiles * 4, dtype=raw(scale).dtype)
    for r in range(rows):
        for c in range(cols):
            tile = (r // 128) * col_tiles + c // 4
            flat[tile * 512 + (r % 32) * 16 + (r % 128) // 32 * 4 + c % 4] = raw(scale)[r, c]
    return flat


@pytest.mark.parametrize("rows, cols", [(1, 1), (130, 5), (256, 8), (77, 12)])
def test_to_blocked_against_index_formula(rows, cols):
    e8m0 = torch.randint(1, 255, (rows, cols), dtype=torch.uint8).view(E8M0_DTYPE)
    blocked = reference.to_blocked(e8m0)
    assert blocked.dtype == E8M0_DTYPE and torch.equal(raw(blocked), blocked_by_formula(e8m0))
    fp32 = torch.rand(rows, cols) + 1.0
    assert torch.equal(reference.to_blocked(fp32), blocked_by_formula(fp32))


def test_blocked_scale():
    q = dropless.quantize(torch.randn(200, 96), "mxfp8", 1)
    assert torch.equal(raw(q.blocked_scale()), raw(reference.to_blocked(q.scale)))
    with pytest.raises(ValueError, match="blocked_scale needs a 2D mxfp8 QuantizedTensor"):
        dropless.quantize(torch.randn(200, 96), "mxfp8", 0).blocked_scale()
    with pytest.raises(ValueError, match="blocked_scale needs a 2D mxfp8 QuantizedTensor"):
        dropless.quantize(torch.randn(200, 96), "block128", 1).blocked_scale()


# ---------------------------------------------------------------------------------------------------
# torch.compile and host syncs


@pytest.mark.slow
def test_compile_fullgraph(reference_backend):
    torch._dynamo.reset()

    def f(x, offsets, w):
        q = dropless.quantize(x, "mxfp8", 0, offsets)
        wk, wn = dropless.quantize_weight(w, "block128")
        pk, pm = quantize_pair(x, "block128", offsets)
        return (q.data.float().sum() + q.scale.float().sum() + wk.data.float().sum() + wn.scale.sum()
                + pk.data.float().sum() + pm.scale.sum())

    x, offsets, w = torch.randn(100, 64), offsets_of([40, 0, 50]), make_w(2, 64, 48, torch.float32, "cpu")
    assert torch.equal(torch.compile(f, fullgraph=True)(x, offsets, w), f(x, offsets, w))


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_no_host_sync_on_gpu():
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(8, 768, 512, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    offsets = offsets_of([1000, 0, 2500, 500], "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for name in ("rowwise", "block128", "mxfp8"):
            dropless.quantize(x, name, 1)
            dropless.quantize(x, name, 0, offsets)
            dropless.quantize_weight(w, name)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
