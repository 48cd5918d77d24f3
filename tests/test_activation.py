"""dropless.ops.activation: swiglu and geglu on the fused gate+up layout ``h [M, 2F]``, forward and
backward, on the reference backend and on the Triton kernel (the interpreter on CPU), against the torch
expression ``act(gate) * up`` in fp64 and its autograd; the launchers on NaN-poisoned outputs. With a
recipe, the FP8 copy of ``a`` against ``dropless.quantize(a)`` bit for bit, ``a`` and the gradient
unchanged."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import INTERPRETING, KERNEL_DEVICE, REL_TOL, assert_close

import dropless
from dropless import reference
from dropless.kernels import swiglu as swiglu_kernels
from dropless.kernels.swiglu import glu_backward, glu_forward, glu_forward_quantized
from dropless.ops.activation import geglu, swiglu
from dropless.ops.fp8_gradient import attach_fp8_copy, take_fp8_copy
from dropless.ops.grouped_mm_fp8 import resolve_recipe
from dropless.ops.quantize import empty_quantized
from dropless.quantized import E8M0_DTYPE, FP8_DTYPE, QuantizedTensor, Recipe

# Saturated gates make the interpreter's exp overflow to inf, on purpose (sigmoid then rounds to 0).
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

OPS = {"silu": swiglu, "gelu_tanh": geglu}
TORCH_ACT = {"silu": F.silu, "gelu_tanh": lambda g: F.gelu(g, approximate="tanh")}
ROWS = [0, 1, 7, 300]
COLS = [1, 3, 64, 100]  # F, half of h's width; 300 below spans two column blocks of the kernel
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SATURATED = (20.0, 40.0, 100.0)


def make_h(M: int, Fh: int, dtype: torch.dtype, device, layout: str = "contiguous") -> torch.Tensor:
    """Random ``[M, 2F]``: gates ~ N(0, 3^2), about one in eight saturated at ±20 or ±100; up ~ N(0, 1).

    Layouts: contiguous; ``wide`` (columns 3.. of each row of a wider ``[M, 2F + 7]`` matrix: a row
    stride that is not 2F and a misaligned base); ``col_major`` (unit stride along M).
    """
    gate = 3 * torch.randn(M, Fh, dtype=torch.float64)
    big = torch.rand(M, Fh) < 0.125
    saturated = torch.tensor([20.0, -20.0, 100.0, -100.0], dtype=torch.float64)
    gate[big] = saturated[torch.randint(4, (int(big.sum()),))]
    # One gate in (-3, 3), so that even a 1 x 1 result is not a saturated ~0 (below fp16's normal range).
    gate[:1, :1] = 6 * torch.rand(min(M, 1), min(Fh, 1), dtype=torch.float64) - 3
    h = torch.cat([gate, torch.randn(M, Fh, dtype=torch.float64)], dim=1).to(dtype)
    if layout == "contiguous":
        return h.to(device)
    if layout == "wide":
        wide = torch.randn(M, 2 * Fh + 7, dtype=dtype)
        wide[:, 3:3 + 2 * Fh] = h
        return wide.to(device)[:, 3:3 + 2 * Fh]
    if layout == "col_major":
        return h.t().contiguous().to(device).t()
    raise ValueError(layout)


def oracle(h: torch.Tensor, activation: str, da: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 ``a = act(gate) * up`` through torch.nn.functional, and ``dh`` from its autograd."""
    h64 = h.detach().double().cpu().requires_grad_()
    Fh = h.shape[1] // 2
    a = TORCH_ACT[activation](h64[:, :Fh]) * h64[:, Fh:]
    a.backward(da.detach().double().cpu())
    return a.detach(), h64.grad


def _check(h: torch.Tensor, activation: str, dtype: torch.dtype) -> None:
    """The op's forward and backward (through autograd) against the oracle."""
    M, Fh = h.shape[0], h.shape[1] // 2
    h = h.detach().requires_grad_()
    a = OPS[activation](h)
    assert a.shape == (M, Fh) and a.dtype == dtype and a.device == h.device
    da = torch.randn(M, Fh, dtype=dtype, device=h.device)
    a.backward(da)
    a_ref, dh_ref = oracle(h, activation, da)
    assert h.grad.shape == h.shape and h.grad.dtype == dtype
    assert_close(a, a_ref, dtype, "a")
    assert_close(h.grad, dh_ref, dtype, "dh")


# ---------------------------------------------------------------------------------------------------
# The op, forward and backward


@pytest.mark.parametrize("Fh", COLS)
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("activation", list(OPS))
def test_forward_backward(activation, M, Fh, backend):
    _, device = backend
    _check(make_h(M, Fh, torch.float32, device), activation, torch.float32)


@pytest.mark.parametrize("Fh", [3, 100])
@pytest.mark.parametrize("activation", list(OPS))
def test_forward_backward_fp64(activation, Fh, reference_backend):
    _check(make_h(300, Fh, torch.float64, reference_backend), activation, torch.float64)


@pytest.mark.parametrize("layout", ["contiguous", "wide", "col_major"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", list(OPS))
def test_dtypes_and_layouts(activation, dtype, layout, backend):
    _, device = backend
    _check(make_h(300, 100, dtype, device, layout), activation, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", list(OPS))
def test_saturated_gates(activation, dtype, backend):
    """Every gate at ±20, ±40 or ±100: sigmoid saturates (exp overflows), nothing turns NaN, and each
    element matches the oracle to the dtype's tolerance (results below the dtype's smallest normal
    number may flush)."""
    _, device = backend
    M, Fh = 64, 24
    values = torch.tensor([s * sign for s in SATURATED for sign in (1, -1)], dtype=torch.float64)
    gate = values[torch.randint(len(values), (M, Fh))]
    h = torch.cat([gate, torch.randn(M, Fh, dtype=torch.float64)], dim=1).to(dtype).to(device).requires_grad_()
    a = OPS[activation](h)
    da = torch.randn(M, Fh, dtype=dtype, device=device)
    a.backward(da)
    a_ref, dh_ref = oracle(h, activation, da)
    tiny = torch.finfo(dtype).tiny
    for what, out, ref in (("a", a, a_ref), ("dh", h.grad, dh_ref)):
        out = out.detach().double().cpu()
        assert bool(torch.isfinite(out).all()), f"{what}: non-finite elements"
        bad = (out - ref).abs() > REL_TOL[dtype] * ref.abs() + tiny
        assert not bool(bad.any()), \
            f"{what}: {int(bad.sum())} elements off, e.g. {out[bad][:4]} vs {ref[bad][:4]}"


def test_backward_broadcast_da(backend):
    """``a.sum().backward()`` hands the backward a da with zero strides."""
    _, device = backend
    for activation, op in OPS.items():
        h = make_h(40, 33, torch.float32, device).requires_grad_()
        op(h).sum().backward()
        _, dh_ref = oracle(h, activation, torch.ones(40, 33))
        assert_close(h.grad, dh_ref, torch.float32, f"dh ({activation})")


def test_no_grad(backend):
    _, device = backend
    h = make_h(7, 3, torch.float32, device)
    with torch.no_grad():
        a = swiglu(h)
    assert not a.requires_grad
    assert_close(a, oracle(h, "silu", torch.ones(7, 3))[0], torch.float32)


@pytest.mark.parametrize("activation", list(OPS))
def test_gradcheck_fp64(activation, reference_backend):
    h = make_h(5, 3, torch.float64, reference_backend)
    h[:, :3] = torch.randn(5, 3, dtype=torch.float64)  # away from saturation, where finite differences see slope
    assert torch.autograd.gradcheck(OPS[activation], (h.requires_grad_(),))


@pytest.mark.parametrize("activation", list(OPS))
def test_reference_matches_functional(activation):
    """dropless.reference in fp64 against torch.nn.functional's activations and their autograd."""
    h = make_h(300, 64, torch.float64, "cpu")
    da = torch.randn(300, 64, dtype=torch.float64)
    a_ref, dh_ref = oracle(h, activation, da)
    assert_close(reference.glu(h, activation), a_ref, torch.float64, "a")
    assert_close(reference.glu_backward(h, da, activation), dh_ref, torch.float64, "dh")


# ---------------------------------------------------------------------------------------------------
# The launchers, on NaN-poisoned outputs inside larger NaN buffers


def _padded(rows: int, cols: int, dtype):
    """A NaN ``[rows, cols]`` window into a larger NaN buffer (so stray writes show) and its mask."""
    big = torch.full((rows + 3, cols + 5), float("nan"), dtype=dtype, device=KERNEL_DEVICE)
    window = torch.zeros(big.shape, dtype=torch.bool, device=KERNEL_DEVICE)
    window[1:1 + rows, 2:2 + cols] = True
    return big, big[1:1 + rows, 2:2 + cols], window


@pytest.mark.parametrize("layout", ["contiguous", "wide", "col_major"])
@pytest.mark.parametrize("M, Fh", [(1, 1), (7, 3), (300, 100), (70, 300)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", list(OPS))
def test_launchers_write_every_element(activation, dtype, M, Fh, layout):
    h = make_h(M, Fh, dtype, KERNEL_DEVICE, layout)
    da = torch.randn(M, Fh + 5, dtype=dtype, device=KERNEL_DEVICE)[:, 2:2 + Fh]  # a strided da
    a_ref, dh_ref = oracle(h, activation, da)

    big_a, a, window = _padded(M, Fh, dtype)
    glu_forward(h, a, activation)
    assert_close(a, a_ref, dtype, "a")
    assert bool(torch.isnan(big_a[~window]).all()), "the forward wrote outside a"

    big_dh, dh, window = _padded(M, 2 * Fh, dtype)
    glu_backward(h, da, dh, activation)
    assert_close(dh, dh_ref, dtype, "dh")
    assert bool(torch.isnan(big_dh[~window]).all()), "the backward wrote outside dh"


def test_launcher_rejects_unknown_activation():
    h = make_h(2, 2, torch.float32, KERNEL_DEVICE)
    with pytest.raises(ValueError, match=r"^activation must be one of"):
        glu_forward(h, torch.empty(2, 2, device=KERNEL_DEVICE), "relu")


# ---------------------------------------------------------------------------------------------------
# Errors name the argument


@pytest.mark.parametrize("bad, error, pattern", [
    (lambda h: h[0], ValueError, r"^h must have 2 dimensions"),
    (lambda h: h[None], ValueError, r"^h must have 2 dimensions"),
    (lambda h: h[:, :5], ValueError, r"^h must have an even last dimension 2F .*got shape \(4, 5\)"),
    (lambda h: h.long(), TypeError, r"^h must have dtype in"),
    (lambda h: h.to(torch.complex64), TypeError, r"^h must have dtype in"),
    (lambda h: h.tolist(), TypeError, r"^h must be a torch\.Tensor"),
], ids=["rank1", "rank3", "odd", "int", "complex", "list"])
@pytest.mark.parametrize("op", list(OPS.values()), ids=list(OPS))
def test_bad_arguments(op, bad, error, pattern, backend):
    _, device = backend
    with pytest.raises(error, match=pattern):
        op(bad(torch.randn(4, 6, device=device)))


def test_fp64_needs_the_reference_backend(triton_backend):
    with pytest.raises(TypeError, match=r"^h must have dtype in"):
        swiglu(torch.randn(4, 6, dtype=torch.float64, device=triton_backend))


@pytest.mark.parametrize("layout", ["contiguous", "wide", "col_major"])
@pytest.mark.parametrize("activation", list(OPS))
def test_grad_in_place_writes_the_same_gradient_over_h(activation, layout, backend):
    """``grad_in_place=True``: dh is, bit for bit, the out-of-place one and lives in h's memory (for a
    column slice, the columns around it untouched); a second backward through the graph raises instead
    of reading the overwritten h."""
    name, device = backend
    dtype = torch.float32 if name == "triton" else torch.float64
    h0 = make_h(70, 100, dtype, device, layout)
    da = torch.randn(70, 100, dtype=dtype, device=device)
    leaf = h0.detach().clone().requires_grad_()
    a_ref = OPS[activation](leaf)
    a_ref.backward(da)
    # h made inside the graph, as the gate/up product's output is in the layer (a slice, for "wide")
    x = (h0._base if layout == "wide" else h0).detach().clone().requires_grad_()
    around = x.detach().clone()
    h = x[:, 3:203] if layout == "wide" else x * 1.0
    a = OPS[activation](h, grad_in_place=True)
    assert torch.equal(a, a_ref)
    (dh,) = torch.autograd.grad(a, h, da, retain_graph=True)
    assert torch.equal(dh, leaf.grad)
    assert dh.data_ptr() == h.data_ptr() and torch.equal(h.detach(), dh)
    if layout == "wide":
        assert torch.equal(x.detach()[:, :3], around[:, :3]) and torch.equal(x.detach()[:, 203:], around[:, 203:])
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(a, x, da)


@pytest.mark.parametrize("recipe", [None, "rowwise", "block128"])
@pytest.mark.parametrize("n", [0, 29, 70])
@pytest.mark.parametrize("activation", list(OPS))
def test_rows_bound_the_rows_computed(activation, n, recipe, triton_backend):
    """``rows=[n]`` on h of 70 rows whose rows from n on are NaN: a, its FP8 copy and dh (written over h,
    as the MoE layer asks) hold, bit for bit, the op's results on the first n rows alone, and dh's rows
    from n on are h's, untouched. The launchers leave a's and the FP8 copy's rows from n on as they were."""
    device = triton_backend
    M, Fh = 70, 300
    h0 = make_h(M, Fh, torch.float32, device)
    h0[n:] = float("nan")
    da = torch.randn(M, Fh, device=device)
    rows = torch.tensor([n], device=device)
    leaf = h0[:n].clone().requires_grad_()
    alone = OPS[activation](leaf, recipe=recipe)
    (alone[0] if recipe else alone).backward(da[:n])
    x = h0.clone().requires_grad_()
    h = x * 1.0
    bounded = OPS[activation](h, recipe=recipe, grad_in_place=True, rows=rows)
    a = bounded[0] if recipe else bounded
    assert torch.equal(a[:n], alone[0] if recipe else alone)
    if recipe:
        assert torch.equal(raw(bounded[1].data[:n]), raw(alone[1].data))
        assert torch.equal(bounded[1].scale[:n], alone[1].scale)
    (dh,) = torch.autograd.grad(a, h, da)
    assert torch.equal(dh[:n], leaf.grad) and bool(dh[n:].isnan().all())
    poisoned = torch.full((M, Fh), float("nan"), device=device)
    if recipe is None:
        glu_forward(h0, poisoned, activation, rows)
    else:
        r = resolve_recipe(recipe)
        data, scale = empty_quantized((M, Fh), r, 1, None, device)
        raw(data).fill_(POISON[FP8_DTYPE])
        scale.fill_(float("nan"))
        glu_forward_quantized(h0, poisoned, data, scale, activation, r, rows)
        assert bool(torch.isnan(data[n:].float()).all()) and bool(torch.isnan(scale[n:]).all())
        assert not torch.isnan(data[:n].float()).any()
    assert torch.equal(poisoned[:n], alone[0] if recipe else alone) and bool(poisoned[n:].isnan().all())


def test_rows_is_checked(triton_backend):
    h = torch.randn(4, 6, device=triton_backend)
    with pytest.raises(ValueError, match="rows must be an int32/int64 tensor of shape"):
        swiglu(h, rows=torch.tensor([1.0], device=triton_backend))
    with pytest.raises(ValueError, match="rows must be"):
        swiglu(h, rows=torch.tensor([[1]], device=triton_backend))


# ---------------------------------------------------------------------------------------------------
# torch.compile (reference backend on the CPU: the custom ops' fake impls carry the tracing)


@pytest.mark.slow
def test_compile_forward_backward(reference_backend):
    torch._dynamo.reset()

    def f(h):
        return (swiglu(h) * geglu(h)).square().sum()

    compiled = torch.compile(f, fullgraph=True)
    h = make_h(37, 5, torch.float64, reference_backend).requires_grad_()
    loss = compiled(h)
    loss.backward()
    h64 = h.detach().clone().requires_grad_()
    g, u = h64[:, :5], h64[:, 5:]
    expected = (F.silu(g) * u * TORCH_ACT["gelu_tanh"](g) * u).square().sum()
    expected.backward()
    assert_close(loss, expected.detach(), torch.float64, "loss")
    assert_close(h.grad, h64.grad, torch.float64, "dh")


# ---------------------------------------------------------------------------------------------------
# The FP8 copy of a (recipe=): dropless.quantize(a, recipe, dim=-1) bit for bit, from the same kernel

# Every option the kernel specializes on: "mxfp8" by name resolves to rceil scales, as the GEMMs take it.
QUANT_RECIPES = {
    "rowwise": "rowwise",
    "rowwise-pow2": Recipe("rowwise", None, pow2=True),
    "block128": "block128",
    "block128-pow2": Recipe("block128", 128, pow2=True),
    "mxfp8": "mxfp8",
    "mxfp8-floor": Recipe("mxfp8", 32),
}
# F: not a multiple of 32 or 128, and wider than one 256-column tile; rows over many row blocks.
QUANT_SHAPES = [(300, 100), (70, 300), (1, 1), (5, 0), (0, 7)]
POISON = {FP8_DTYPE: 0x7F, E8M0_DTYPE: 0xFF}  # NaN bytes


def raw(t: torch.Tensor) -> torch.Tensor:
    """One-byte tensors (FP8 data, E8M0 scales) as their bytes, so that comparisons are bitwise."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor as integers of its width: equal bits, NaN included."""
    return t.detach().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def assert_same_fp8(q: QuantizedTensor, data: torch.Tensor, scale: torch.Tensor, what: str = "") -> None:
    """``q`` holds ``(data, scale)``: the same bytes (NaN for NaN: its sign bit may differ between the
    kernels and the reference), shapes and layout."""
    assert q.data.dtype == FP8_DTYPE and q.data.shape == data.shape and q.scale.shape == scale.shape, what
    assert q.data.is_contiguous() and q.scale.is_contiguous() and q.scale.dtype == scale.dtype, what
    nan = torch.isnan(data.float()).cpu()
    assert torch.equal(torch.isnan(q.data.float()).cpu(), nan), f"{what}: NaN elements differ"
    bad = raw(q.data).cpu()[~nan] != raw(data).cpu()[~nan]
    assert not bad.any(), f"{what}: {int(bad.sum())} data bytes differ"
    bad = raw(q.scale).cpu() != raw(scale).cpu()
    assert not bad.any(), f"{what}: {int(bad.sum())} scales differ, first at {bad.nonzero()[0].tolist()}"


def check_quantized_copy(op, h: torch.Tensor, recipe, what: str = "") -> tuple[torch.Tensor, QuantizedTensor]:
    """``op(h, recipe=recipe)`` against ``op(h)`` (a, the same bits) and ``dropless.quantize(a)`` on the
    backend in force and on the reference (the copy, the same bits)."""
    a, q = op(h, recipe=recipe)
    assert torch.equal(bits(a), bits(op(h))), f"{what}: a differs from the activation without a recipe"
    act = resolve_recipe(recipe)
    assert q.recipe == act and q.dim == 1 and q.offsets is None, what
    expected = dropless.quantize(a.detach(), act, dim=-1)
    assert_same_fp8(q, expected.data, expected.scale, what)
    assert_same_fp8(q, *reference.quantize(a.detach().cpu(), act, 1), f"{what} (reference)")
    return a, q


@pytest.mark.parametrize("M, Fh", QUANT_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("recipe", list(QUANT_RECIPES))
def test_quantized_copy_is_quantize_of_a(recipe, dtype, M, Fh, backend):
    _, device = backend
    for activation, op in OPS.items():
        check_quantized_copy(op, make_h(M, Fh, dtype, device), QUANT_RECIPES[recipe], activation)


def extreme_h(M: int, Fh: int, dtype: torch.dtype, subnormals: bool = True) -> torch.Tensor:
    """``h [M, 2F]`` whose rows of a span the dtype's range: a row per decade from huge down to the
    subnormals (or, without ``subnormals``, to just above the smallest normal number), with gates in
    (1, 4), where act is about the gate, and ``|up|`` in [0.5, 1.5) times the row's power of two; a zero
    row, rows with one outlier, a NaN or an infinity, and a row of saturated gates."""
    finfo = torch.finfo(dtype)
    # act(gate) < 2**2 and |up| < 2**1: the top row stays finite; |a| > 2**-2 |up's power of two|.
    top = math.log2(finfo.max) - 4
    bottom = math.log2(finfo.smallest_normal) + (-4 if subnormals else 3)
    gate = 1 + 3 * torch.rand(M, Fh)
    magnitude = (0.5 + torch.rand(M, Fh)) * torch.exp2(torch.linspace(top, bottom, M).round())[:, None]
    up = torch.where(torch.rand(M, Fh) < 0.5, -magnitude, magnitude)
    up[M // 2] = 0.0
    up[1, Fh // 3] = finfo.max / 8  # an outlier among the row's huge values
    up[M - 2, Fh // 2] = 1.0  # one among the tiniest
    up[3, 1] = float("nan")
    up[4, 2] = float("inf")
    gate[5, :] = -100.0  # act underflows: sigmoid(-100) is about 4e-44, times the row's huge up
    return torch.cat([gate, up], dim=1).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("recipe", list(QUANT_RECIPES))
def test_quantized_copy_of_huge_and_tiny_rows(recipe, dtype, backend):
    """Down to the subnormals, except for bf16 under the interpreter: triton 3.6's interpreter converts
    bf16 subnormals to and from fp32 wrongly (its ``_convert_float`` clamps their exponent), which a GPU
    does not; there the rows stop just above bf16's smallest normal number."""
    name, device = backend
    subnormals = not (INTERPRETING and name == "triton" and dtype == torch.bfloat16)
    h = extreme_h(40, 70, dtype, subnormals).to(device)
    a, q = check_quantized_copy(swiglu, h, QUANT_RECIPES[recipe])
    last = a.detach().float().abs()[-1]
    smallest_normal = torch.finfo(dtype).smallest_normal
    assert bool((last > 0).all()) and (last.max() < smallest_normal) == subnormals, \
        "the last row must reach the dtype's subnormals (or stop just above them)"


@pytest.mark.parametrize("recipe", ["rowwise", "rowwise-pow2"])
def test_rowwise_rows_wider_than_a_tile(recipe, triton_backend, monkeypatch):
    """Rows wider than one tile walk F twice (a, then its FP8 copy from a read back): at the real step,
    and at a step of 32 columns over many rows, ending mid-step."""
    h = make_h(3, 4100, torch.bfloat16, triton_backend)
    check_quantized_copy(swiglu, h, QUANT_RECIPES[recipe], "F=4100")
    monkeypatch.setattr(swiglu_kernels, "_MAX_ROW_BLOCK_F", 32)
    for layout in ("contiguous", "wide"):
        h = make_h(300, 100, torch.bfloat16, triton_backend, layout)
        check_quantized_copy(geglu, h, QUANT_RECIPES[recipe], f"step 32 {layout}")
    h = extreme_h(40, 70, torch.float32).to(triton_backend)
    check_quantized_copy(swiglu, h, QUANT_RECIPES[recipe], "step 32, extremes")


@pytest.mark.parametrize("recipe", list(QUANT_RECIPES))
def test_quantized_copy_keeps_the_backward(recipe, backend):
    """The gradient of h is that of the activation without a recipe, bit for bit; the copy has none."""
    _, device = backend
    for activation, op in OPS.items():
        h = make_h(70, 100, torch.bfloat16, device)
        da = torch.randn(70, 100, dtype=torch.bfloat16, device=device)
        h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
        a, q = op(h1, recipe=QUANT_RECIPES[recipe])
        assert a.requires_grad and not q.data.requires_grad and not q.scale.requires_grad
        a.backward(da)
        op(h2).backward(da)
        assert torch.equal(h1.grad, h2.grad), activation
        with torch.no_grad():
            a, q = op(h, recipe=QUANT_RECIPES[recipe])
        assert not a.requires_grad


@pytest.mark.parametrize("M, Fh", [(1, 1), (7, 3), (300, 100), (70, 300), (5, 0)])
@pytest.mark.parametrize("recipe", list(QUANT_RECIPES))
def test_quantized_launcher_writes_every_element(recipe, M, Fh):
    """a inside a larger NaN buffer, data and scale poisoned with NaN bytes: every element written, and
    nothing outside a."""
    r = resolve_recipe(QUANT_RECIPES[recipe])
    for activation in OPS:
        h = make_h(M, Fh, torch.bfloat16, KERNEL_DEVICE, "wide")
        big_a, a, window = _padded(M, Fh, torch.bfloat16)
        data, scale = empty_quantized((M, Fh), r, 1, None, KERNEL_DEVICE)
        raw(data).fill_(POISON[FP8_DTYPE])
        if scale.dtype == E8M0_DTYPE:
            raw(scale).fill_(POISON[E8M0_DTYPE])
        else:
            scale.fill_(float("nan"))
        glu_forward_quantized(h, a, data, scale, activation, r)
        expected = torch.empty_like(a)
        glu_forward(h, expected, activation)
        assert torch.equal(a, expected), activation
        assert bool(torch.isnan(big_a[~window]).all()), "the forward wrote outside a"
        assert_same_fp8(QuantizedTensor(data, scale, r, 1), *reference.quantize(a.cpu(), r, 1), activation)
        assert not torch.isnan(data.float()).any() and not torch.isnan(scale.float()).any(), activation


@pytest.mark.parametrize("recipe, error, pattern", [
    ("block128x128", ValueError, r"^recipe must be one of \['rowwise', 'block128', 'mxfp8'\]"),
    ("fp4", ValueError, r"^recipe must be one of"),
    (Recipe("mxfp8", 32, mx_rounding="nearest"), ValueError, r"^recipe\.mx_rounding must be one of"),
    (Recipe("mxfp8", 32, pow2=True), ValueError, r"^pow2 applies to the fp32-scaled recipes"),
    (Recipe("rowwise", 64), ValueError, r"^recipe must be one of .*with its own block shape"),
], ids=["block128x128", "fp4", "rounding", "mx-pow2", "rowwise-block"])
def test_bad_recipe(recipe, error, pattern, backend):
    _, device = backend
    with pytest.raises(error, match=pattern):
        swiglu(torch.randn(4, 6, device=device), recipe=recipe)


def test_quantized_copy_needs_an_fp8_input_dtype(reference_backend):
    with pytest.raises(TypeError, match=r"^h must have dtype in"):
        swiglu(torch.randn(4, 6, dtype=torch.float64), recipe="rowwise")


@pytest.mark.slow
def test_compile_quantized_copy(reference_backend):
    torch._dynamo.reset()

    def f(h):
        a, q = swiglu(h, recipe="mxfp8")
        return a.square().sum(), q.data, q.scale

    h = make_h(37, 40, torch.bfloat16, reference_backend)
    h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
    loss, data, scale = torch.compile(f, fullgraph=True)(h1)
    loss.backward()
    loss_eager, data_eager, scale_eager = f(h2)
    loss_eager.backward()
    assert torch.equal(loss, loss_eager) and torch.equal(h1.grad, h2.grad)
    assert torch.equal(raw(data), raw(data_eager)) and torch.equal(raw(scale), raw(scale_eager))


# ---------------------------------------------------------------------------------------------------
# The FP8 copy of dh (grad_recipe=): dropless.quantize(dh, rowwise, dim=-1) bit for bit, from the
# backward kernel, attached to dh for the product that made h

GRAD_RECIPES = {"rowwise": Recipe("rowwise", None), "rowwise-pow2": Recipe("rowwise", None, pow2=True)}


def gradient_and_copy(op, h: torch.Tensor, da: torch.Tensor, grad_recipe: Recipe | None,
                      **kwargs) -> tuple[torch.Tensor, QuantizedTensor | None]:
    """dh of ``op(h, grad_recipe=recipe, **kwargs)`` for the upstream gradient ``da``, and the FP8 copy
    attached to it, taken as the product that made h takes it (h is made in the graph, as that
    product's output is)."""
    x = h.detach().clone().requires_grad_()
    h_in = x * 1.0
    taken = []
    product_recipe = grad_recipe or GRAD_RECIPES["rowwise"]
    h_in.register_hook(lambda g: taken.append((g.detach().clone(), take_fp8_copy(g, product_recipe))))
    out = op(h_in, grad_recipe=grad_recipe, **kwargs)
    (out[0] if isinstance(out, tuple) else out).backward(da)
    ((dh, copy),) = taken
    return dh, copy


def check_gradient_copy(op, h: torch.Tensor, grad_recipe: Recipe, what: str, **kwargs) -> None:
    """dh is the gradient without a grad_recipe, bit for bit, and its copy ``dropless.quantize(dh)``'s
    bits on the backend in force and on the reference."""
    recipe = grad_recipe
    da = torch.randn(h.shape[0], h.shape[1] // 2, dtype=h.dtype, device=h.device)
    dh, copy = gradient_and_copy(op, h, da, recipe, **kwargs)
    plain, none = gradient_and_copy(op, h, da, None, **kwargs)
    assert none is None and torch.equal(bits(dh), bits(plain)), f"{what}: dh changed"
    assert copy is not None and copy.recipe == recipe and copy.dim == 1, what
    expected = dropless.quantize(dh, recipe, dim=-1)
    assert_same_fp8(copy, expected.data, expected.scale, what)
    assert_same_fp8(copy, *reference.quantize(dh.cpu(), recipe, 1), f"{what} (reference)")


@pytest.mark.parametrize("grad_in_place", [False, True])
@pytest.mark.parametrize("M, Fh", [(300, 100), (70, 300), (1, 1), (5, 0)])
@pytest.mark.parametrize("recipe", list(GRAD_RECIPES))
def test_gradient_copy_is_quantize_of_dh(recipe, M, Fh, grad_in_place, backend):
    _, device = backend
    for activation, op in OPS.items():
        for fp8 in (None, "block128"):  # with and without the forward's own copy
            h = make_h(M, Fh, torch.bfloat16, device)
            check_gradient_copy(op, h, GRAD_RECIPES[recipe], f"{activation} {fp8}", grad_in_place=grad_in_place,
                                recipe=fp8)


def test_gradient_copy_of_rows_wider_than_a_tile(triton_backend, monkeypatch):
    """Rows wider than one tile walk F twice (dh, then its copy from dh read back): at the real step, and
    at a step of 32 columns ending mid-step, extremes included (NaN, inf, zero rows, outliers)."""
    h = make_h(3, 4100, torch.bfloat16, triton_backend)
    check_gradient_copy(swiglu, h, GRAD_RECIPES["rowwise"], "F=4100", grad_in_place=True)
    monkeypatch.setattr(swiglu_kernels, "_MAX_ROW_BLOCK_F", 32)
    check_gradient_copy(geglu, make_h(300, 100, torch.bfloat16, triton_backend, "wide"), GRAD_RECIPES["rowwise-pow2"],
                        "step 32, wide")
    check_gradient_copy(swiglu, extreme_h(40, 70, torch.float32).to(triton_backend), GRAD_RECIPES["rowwise"],
                        "step 32, extremes")


@pytest.mark.parametrize("n", [0, 29, 70])
def test_gradient_copy_rows_bound_the_rows_computed(n, triton_backend):
    """With ``rows``, the copy's first rows[0] rows are the quantization of dh's, as dh's are."""
    h = make_h(70, 100, torch.bfloat16, triton_backend)
    da = torch.randn(70, 100, dtype=torch.bfloat16, device=triton_backend)
    rows = torch.tensor([n], device=triton_backend)
    dh, copy = gradient_and_copy(swiglu, h, da, GRAD_RECIPES["rowwise"], rows=rows, grad_in_place=True)
    expected = reference.quantize(dh[:n].cpu(), GRAD_RECIPES["rowwise"], 1)
    assert_same_fp8(QuantizedTensor(copy.data[:n], copy.scale[:n], copy.recipe, 1), *expected, f"rows {n}")


@pytest.mark.parametrize("M, Fh", [(1, 1), (7, 3), (300, 100), (70, 300), (5, 0)])
def test_gradient_copy_launcher_writes_every_element(M, Fh):
    """dh inside a larger NaN buffer, data and scale poisoned with NaN bytes: every element written, dh
    the same bits as without a copy, and nothing written outside dh."""
    r = GRAD_RECIPES["rowwise"]
    for activation in OPS:
        h = make_h(M, Fh, torch.bfloat16, KERNEL_DEVICE, "wide")
        da = torch.randn(M, Fh, dtype=torch.bfloat16, device=KERNEL_DEVICE)
        big, dh, window = _padded(M, 2 * Fh, torch.bfloat16)
        data, scale = empty_quantized((M, 2 * Fh), r, 1, None, KERNEL_DEVICE)
        raw(data).fill_(POISON[FP8_DTYPE])
        scale.fill_(float("nan"))
        glu_backward(h, da, dh, activation, quantized=(data, scale, r))
        expected = torch.empty_like(dh)
        glu_backward(h, da, expected, activation)
        assert torch.equal(bits(dh), bits(expected)), activation
        assert bool(torch.isnan(big[~window]).all()), "the backward wrote outside dh"
        assert_same_fp8(QuantizedTensor(data, scale, r, 1), *reference.quantize(dh.cpu(), r, 1), activation)


def test_grad_recipe_errors_name_the_argument(backend):
    _, device = backend
    h = torch.randn(4, 6, device=device)
    for bad in ("rowwise", Recipe("block128", 128), Recipe("mxfp8", 32)):
        with pytest.raises(ValueError, match=r"^grad_recipe must be a rowwise dropless\.Recipe"):
            swiglu(h, grad_recipe=bad)
    with pytest.raises(ValueError, match=r"rowwise only"):
        r = Recipe("block128", 128)
        copy = (*empty_quantized((4, 6), r, 1, None, device), r)
        glu_backward(h, h[:, :3], torch.empty_like(h), "silu", quantized=copy)


def test_a_gradient_copy_is_taken_only_while_it_holds_the_gradient():
    """``take_fp8_copy`` returns the copy once, and nothing (dropping it) for a gradient changed since it
    was attached, a product of another recipe or a copy of another shape."""
    r, pow2 = GRAD_RECIPES["rowwise"], GRAD_RECIPES["rowwise-pow2"]
    grad = torch.randn(6, 8)
    attach_fp8_copy(grad, dropless.quantize(grad, r, dim=-1))
    copy = take_fp8_copy(grad, r)
    assert copy is not None and torch.equal(copy.data.float(), dropless.quantize(grad, r, dim=-1).data.float())
    assert take_fp8_copy(grad, r) is None, "a copy is taken once"
    attach_fp8_copy(grad, dropless.quantize(grad, r, dim=-1))
    grad.add_(1.0)
    assert take_fp8_copy(grad, r) is None, "the gradient changed after the copy"
    attach_fp8_copy(grad, dropless.quantize(grad, r, dim=-1))
    assert take_fp8_copy(grad, pow2) is None and take_fp8_copy(grad, r) is None, "another recipe"
    attach_fp8_copy(grad, dropless.quantize(grad[:5], r, dim=-1))
    assert take_fp8_copy(grad, r) is None, "another shape"
