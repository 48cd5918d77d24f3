"""dropless.ops.activation: swiglu and geglu on the fused gate+up layout ``h [M, 2F]``, forward and
backward, on the reference backend and on the Triton kernel (the interpreter on CPU), against the torch
expression ``act(gate) * up`` in fp64 and its autograd; the launchers on NaN-poisoned outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import KERNEL_DEVICE, REL_TOL, assert_close

from dropless import reference
from dropless.kernels.swiglu import glu_backward, glu_forward
from dropless.ops.activation import geglu, swiglu

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
