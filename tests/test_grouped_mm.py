"""dropless.ops.grouped_mm: grouped_mm (forward, dx, dw through autograd) and grouped_mm_wgrad, on the
reference backend and on the Triton kernels (the interpreter on CPU), against dropless.reference in fp64."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import (
    KERNEL_DEVICE,
    REL_TOL,
    assert_close,
    assert_experts_close,
    assert_rows_close,
    bounds_of,
    make_w,
    make_x,
    offsets_of,
    oracle_grouped_mm,
    oracle_wgrad,
    poisoned,
    random_group_sizes,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dropless
from dropless import reference

# (M, K, N, group sizes). Small enough for the interpreter; K and N include values that are not
# multiples of any tile (1, 3, 17, 100, 130) and multiples of 16 bytes (the TMA path).
CASES = {
    "aligned": (96, 64, 48, [20, 0, 45, 21]),  # 10 tail rows
    "zeros_tail": (77, 17, 100, [0, 30, 0, 0, 40, 0]),
    "giant_group": (130, 32, 3, [0, 0, 130, 0]),
    "e1": (70, 130, 17, [70]),
    "e1_tail": (70, 16, 16, [33]),
    "e256": (64, 3, 5, random_group_sizes(256, 60, zero_frac=0.6, rng=random.Random(1))),
    "m0": (0, 16, 8, [0, 0, 0]),
    "m1": (1, 3, 17, [0, 1]),
    "m1_tail": (1, 8, 8, [0, 0]),
    "k1": (40, 1, 100, [13, 0, 27]),
    "odd": (100, 100, 130, [33, 0, 61]),
    "all_empty": (20, 8, 8, [0, 0, 0, 0]),
    "e8_large": (300, 130, 130, random_group_sizes(8, 290, rng=random.Random(8))),
}
WGRAD_CASES = ["aligned", "zeros_tail", "giant_group", "e1_tail", "e256", "m0", "m1", "k1", "odd", "all_empty"]
# Every out layout and accumulate mode on each case but E=256 (slow on the interpreter): two of them there.
WGRAD_OUT = [(case, acc, out) for case in WGRAD_CASES if case != "e256"
             for acc in ("false", "true", "mask") for out in ("fp32", "fp32_transposed", "same")]
WGRAD_OUT += [("e256", "mask", "fp32_transposed"), ("e256", "false", "same")]


def _leaf_weights(E, K, N, dtype, device, layout):
    """Leaf parameter and the ``[E, K, N]`` view passed to grouped_mm (a transposed view for ``nk``)."""
    if layout == "nk":
        W = torch.randn(E, N, K, dtype=dtype, device=device, requires_grad=True)
        return W, W.transpose(1, 2)
    W = torch.randn(E, K, N, dtype=dtype, device=device, requires_grad=True)
    return W, W


def _check_forward_backward(M, K, N, sizes, dtype, device, x_layout="contiguous", w_layout="nk",
                            offsets_dtype=torch.int32):
    E = len(sizes)
    x = make_x(M, K, dtype, device, x_layout).requires_grad_()
    W, w = _leaf_weights(E, K, N, dtype, device, w_layout)
    offsets = offsets_of(sizes, device, offsets_dtype)
    y = dropless.grouped_mm(x, w, offsets)
    assert y.dtype == dtype and y.shape == (M, N) and y.device == x.device

    x64, w64, off_cpu = x.detach().double().cpu(), w.detach().double().cpu(), offsets.cpu()
    assert_rows_close(y, reference.grouped_mm(x64, w64, off_cpu), sizes, dtype, "y")

    dy = torch.randn(M, N, dtype=dtype, device=device)
    y.backward(dy)
    dy64 = dy.double().cpu()
    assert x.grad.shape == x.shape and W.grad.shape == W.shape
    assert_rows_close(x.grad, reference.grouped_mm(dy64, w64.transpose(1, 2), off_cpu), sizes, dtype, "dx")
    dw_ref = reference.grouped_mm_wgrad(x64, dy64, off_cpu)
    dW = W.grad.transpose(1, 2) if w_layout == "nk" else W.grad
    assert_experts_close(dW, dw_ref, dtype, "dw")


# ---------------------------------------------------------------------------------------------------
# grouped_mm, forward and backward


@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward(case, backend):
    _, device = backend
    M, K, N, sizes = CASES[case]
    _check_forward_backward(M, K, N, sizes, torch.float32, device)


@pytest.mark.parametrize("case", list(CASES))
def test_forward_backward_fp64(case, reference_backend):
    M, K, N, sizes = CASES[case]
    _check_forward_backward(M, K, N, sizes, torch.float64, reference_backend)


@pytest.mark.parametrize("shape", [(96, 64, 48, [20, 0, 45, 21]), (77, 17, 100, [0, 30, 0, 0, 40, 0])],
                         ids=["aligned", "odd"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dtypes(dtype, shape, backend):
    _, device = backend
    M, K, N, sizes = shape
    _check_forward_backward(M, K, N, sizes, dtype, device)


@pytest.mark.parametrize("w_layout", ["nk", "kn"])
@pytest.mark.parametrize("x_layout", ["contiguous", "col_slice", "col_slice_odd", "col_major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layouts(x_layout, w_layout, dtype, backend):
    _, device = backend
    _check_forward_backward(96, 64, 48, [20, 0, 45, 21], dtype, device, x_layout, w_layout)


@pytest.mark.parametrize("form", ["offsets_int32", "offsets_int64", "offs", "group_sizes_int32",
                                  "group_sizes_int64", "positional_int64"])
def test_offsets_and_group_sizes_forms(form, backend):
    _, device = backend
    sizes = [7, 0, 25, 0, 11]
    M, K, N = 50, 16, 24
    x = torch.randn(M, K, device=device)
    w = make_w(len(sizes), K, N, torch.float32, device)
    kind, _, bits = form.rpartition("_")
    itype = torch.int32 if bits == "int32" else torch.int64
    if kind == "offsets" or kind == "positional":
        y = dropless.grouped_mm(x, w, offsets_of(sizes, device, itype)) if kind == "positional" else \
            dropless.grouped_mm(x, w, offsets=offsets_of(sizes, device, itype))
    elif form == "offs":
        y = dropless.grouped_mm(x, w, offs=offsets_of(sizes, device))
    else:
        y = dropless.grouped_mm(x, w, group_sizes=torch.tensor(sizes, dtype=itype, device=device))
    assert_rows_close(y, oracle_grouped_mm(x, w, sizes), sizes, torch.float32)


@pytest.mark.parametrize("needs", ["x", "w"])
def test_backward_one_input(needs, backend):
    _, device = backend
    sizes = [9, 0, 30]
    M, K, N = 45, 16, 8
    x = torch.randn(M, K, device=device, requires_grad=needs == "x")
    W = torch.randn(3, N, K, device=device, requires_grad=needs == "w")
    y = dropless.grouped_mm(x, W.transpose(1, 2), offsets_of(sizes, device))
    dy = torch.randn(M, N, device=device)
    y.backward(dy)
    if needs == "x":
        assert W.grad is None
        assert_rows_close(x.grad, oracle_grouped_mm(dy, W.detach(), sizes), sizes, torch.float32, "dx")
    else:
        assert x.grad is None
        assert_experts_close(W.grad.transpose(1, 2), oracle_wgrad(x, dy, sizes), torch.float32, "dw")


def test_backward_broadcast_dy(backend):
    """``y.sum().backward()`` hands the op a dy with zero strides."""
    _, device = backend
    sizes = [0, 20, 17]
    M, K, N = 40, 32, 16
    x = torch.randn(M, K, device=device, requires_grad=True)
    W = torch.randn(3, N, K, device=device, requires_grad=True)
    dropless.grouped_mm(x, W.transpose(1, 2), offsets_of(sizes, device)).sum().backward()
    ones = torch.ones(M, N)
    assert_rows_close(x.grad, oracle_grouped_mm(ones, W.detach(), sizes), sizes, torch.float32, "dx")
    assert_experts_close(W.grad.transpose(1, 2), oracle_wgrad(x, ones, sizes), torch.float32, "dw")


def test_garbage_outside_the_groups_stays_out(backend):
    """A worst-case-sized buffer: its tail rows (and dy's) hold NaN, yet y and dx are zero there and dw
    is clean; Inf in one group's rows spoils only that expert's results."""
    _, device = backend
    sizes = [20, 0, 37, 15]
    M, K, N = 90, 32, 48
    x = torch.randn(M, K, device=device)
    W = torch.randn(4, N, K, device=device)
    dy = torch.randn(M, N, device=device)
    y_ref, dx_ref = oracle_grouped_mm(x, W.transpose(1, 2), sizes), oracle_grouped_mm(dy, W, sizes)
    dw_ref = oracle_wgrad(x, dy, sizes)
    for t in (x, dy):
        t[72:] = float("nan")
        t[57:60] = float("inf")  # rows of the last expert
    x.requires_grad_()
    W.requires_grad_()
    y = dropless.grouped_mm(x, W.transpose(1, 2), offsets_of(sizes, device))
    y.backward(dy)
    clean = [0, 1, 2]
    assert_rows_close(y[:57], y_ref[:57], sizes[:3], torch.float32, "y")
    assert_rows_close(x.grad[:57], dx_ref[:57], sizes[:3], torch.float32, "dx")
    assert bool((y[72:] == 0).all()) and bool((x.grad[72:] == 0).all()), "rows past offsets[-1]"
    assert_experts_close(W.grad.transpose(1, 2)[clean], dw_ref[clean], torch.float32, "dw")


def test_gradcheck_fp64(reference_backend):
    sizes = [3, 0, 5, 1]
    x = torch.randn(11, 3, dtype=torch.float64, requires_grad=True)  # 2 tail rows
    W = torch.randn(4, 2, 3, dtype=torch.float64, requires_grad=True)
    Wkn = torch.randn(4, 3, 2, dtype=torch.float64, requires_grad=True)
    offsets = offsets_of(sizes)
    assert torch.autograd.gradcheck(lambda a, b: dropless.grouped_mm(a, b.transpose(1, 2), offsets), (x, W))
    assert torch.autograd.gradcheck(lambda a, b: dropless.grouped_mm(a, b, group_sizes=torch.tensor(sizes)),
                                    (x, Wkn))


# ---------------------------------------------------------------------------------------------------
# grouped_mm_wgrad


def _accumulate_flags(sizes, device):
    """A mask with True and False among both the empty and the non-empty experts where possible."""
    empty = [e for e, s in enumerate(sizes) if s == 0]
    full = [e for e, s in enumerate(sizes) if s > 0]
    flags = [random.random() < 0.5 for _ in sizes]
    for group in (empty, full):
        if len(group) >= 2:
            flags[group[0]], flags[group[1]] = True, False
    return torch.tensor(flags, device=device)


@pytest.mark.parametrize("case, accumulate, out_kind", WGRAD_OUT)
def test_wgrad_out(case, accumulate, out_kind, backend):
    _, device = backend
    M, K, N, sizes = CASES[case]
    E = len(sizes)
    dtype = torch.float32
    out_dtype = dtype if out_kind == "same" else torch.float32
    x = torch.randn(M, K, dtype=dtype, device=device)
    dy = torch.randn(M, N, dtype=dtype, device=device)
    ref = reference.grouped_mm_wgrad(x.double().cpu(), dy.double().cpu(), offsets_of(sizes))

    transposed = out_kind == "fp32_transposed"
    if accumulate == "false":
        out = poisoned((E, K, N), out_dtype, device, transposed)
        acc = False
    else:
        out = poisoned((E, K, N), out_dtype, device, transposed)
        out.copy_(torch.randn(E, K, N))
        acc = True if accumulate == "true" else _accumulate_flags(sizes, device)
    init = out.detach().clone().cpu()

    result = dropless.grouped_mm_wgrad(x, dy, offsets_of(sizes, device), out=out, accumulate=acc)
    assert result is out
    flags = torch.zeros(E, dtype=torch.bool) if acc is False else \
        torch.ones(E, dtype=torch.bool) if acc is True else acc.cpu()
    expected = torch.where(flags.view(-1, 1, 1), init.double() + ref, ref)
    assert_experts_close(out, expected, dtype, "out")
    for e, (s, t) in enumerate(bounds_of(sizes)):
        if s == t:  # empty expert: untouched when accumulating, exactly zero when overwriting
            want = init[e] if flags[e] else torch.zeros_like(init[e])
            assert torch.equal(out[e].cpu(), want), f"empty expert {e} (accumulate={bool(flags[e])})"


@pytest.mark.parametrize("case", WGRAD_CASES)
def test_wgrad_returns_new_tensor(case, backend):
    _, device = backend
    M, K, N, sizes = CASES[case]
    x = make_x(M, K, torch.float32, device, "col_major")
    dy = torch.randn(M, N, device=device)
    dw = dropless.grouped_mm_wgrad(x, dy, group_sizes=torch.tensor(sizes, device=device))
    assert dw.shape == (len(sizes), K, N) and dw.dtype == torch.float32
    assert_experts_close(dw, oracle_wgrad(x, dy, sizes), torch.float32)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wgrad_low_precision_into_fp32_main_grad(dtype, transposed, backend):
    _, device = backend
    sizes = [0, 60, 3, 0, 33]
    M, K, N = 100, 24, 40
    x = torch.randn(M, K, dtype=dtype, device=device)
    dy = torch.randn(M, N, dtype=dtype, device=device)
    ref = oracle_wgrad(x, dy, sizes)
    main_grad = poisoned((len(sizes), K, N), torch.float32, device, transposed)
    dropless.grouped_mm_wgrad(x, dy, offsets_of(sizes, device), out=main_grad)
    assert_experts_close(main_grad, ref, dtype, "main_grad")
    init = main_grad.clone()
    dropless.grouped_mm_wgrad(x, dy, offsets_of(sizes, device), out=main_grad, accumulate=True)
    assert_experts_close(main_grad, init.double().cpu() + ref, dtype, "main_grad accumulated")
    dw = dropless.grouped_mm_wgrad(x, dy, offsets_of(sizes, device))
    assert dw.dtype == dtype
    assert_experts_close(dw, ref, dtype, "dw")


def test_wgrad_strided_operands(backend):
    _, device = backend
    sizes = [17, 0, 40, 1]
    M, K, N = 64, 32, 48
    x = make_x(M, K, torch.float32, device, "col_slice")
    dy = make_x(M, N, torch.float32, device, "col_major")
    out = poisoned((4, K, N), torch.float32, device, transposed=True)
    dropless.grouped_mm_wgrad(x, dy, offsets_of(sizes, device), out=out)
    assert_experts_close(out, oracle_wgrad(x, dy, sizes), torch.float32)


# ---------------------------------------------------------------------------------------------------
# Properties over random routings (hypothesis)


@st.composite
def routings(draw, max_e=12, max_rows=24, max_dim=20):
    """(sizes, tail rows, K, N) with zeros likely among the sizes."""
    E = draw(st.integers(1, max_e))
    sizes = draw(st.lists(st.one_of(st.just(0), st.integers(0, max_rows)), min_size=E, max_size=E))
    tail = draw(st.one_of(st.just(0), st.integers(0, 9)))
    K = draw(st.integers(1, max_dim))
    N = draw(st.integers(1, max_dim))
    return sizes, tail, K, N


def _check_routing(sizes, tail, K, N, dtype, device):
    M = sum(sizes) + tail
    x = torch.randn(M, K, dtype=dtype, device=device, requires_grad=True)
    W = torch.randn(len(sizes), N, K, dtype=dtype, device=device, requires_grad=True)
    offsets = offsets_of(sizes, device)
    y = dropless.grouped_mm(x, W.transpose(1, 2), offsets)
    assert_rows_close(y, oracle_grouped_mm(x, W.transpose(1, 2), sizes), sizes, dtype, "y")
    dy = torch.randn(M, N, dtype=dtype, device=device)
    y.backward(dy)
    assert_rows_close(x.grad, oracle_grouped_mm(dy, W.detach(), sizes), sizes, dtype, "dx")
    ref_dw = oracle_wgrad(x, dy, sizes)
    assert_experts_close(W.grad.transpose(1, 2), ref_dw, dtype, "dw")
    main_grad = torch.randn(len(sizes), K, N, device=device)
    init = main_grad.clone()
    flags = torch.tensor([random.random() < 0.5 for _ in sizes], device=device)
    dropless.grouped_mm_wgrad(x.detach(), dy, offsets, out=main_grad, accumulate=flags)
    added = flags.cpu().view(-1, 1, 1)
    expected = torch.where(added, init.double().cpu() + ref_dw, ref_dw)
    assert bool(torch.isfinite(main_grad).all()), "main_grad: non-finite elements"
    # An added expert is rounded to fp32 at the scale of its prior value and of the product, not of their
    # sum, which can cancel: each expert's error is measured against both.
    scale = torch.where(added, init.double().cpu().abs() + ref_dw.abs(), ref_dw.abs())
    for e in range(len(sizes)):
        err = torch.linalg.vector_norm(main_grad[e].double().cpu() - expected[e]).item()
        bound = REL_TOL[torch.float32] * torch.linalg.vector_norm(scale[e]).item()
        assert err <= bound, f"main_grad[{e}]: error {err:.3g} > {bound:.3g}"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(routings())
def test_property_reference(routing):
    dropless.set_backend("reference")
    try:
        _check_routing(*routing, dtype=torch.float64, device=torch.device("cpu"))
    finally:
        dropless.set_backend("auto")


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(routings(max_e=6, max_rows=40, max_dim=40))
def test_property_triton(routing):
    dropless.set_backend("triton")
    try:
        _check_routing(*routing, dtype=torch.float32, device=KERNEL_DEVICE)
    finally:
        dropless.set_backend("auto")


# ---------------------------------------------------------------------------------------------------
# torch.compile (reference backend on the CPU: the custom ops' fake impls carry the tracing)


@pytest.mark.slow
def test_compile_forward_backward(reference_backend):
    torch._dynamo.reset()
    sizes = [10, 0, 21]
    M, K, N = 35, 8, 6

    def f(x, W, offsets):
        return dropless.grouped_mm(x, W.transpose(1, 2), offsets).square().sum()

    compiled = torch.compile(f, fullgraph=True)
    x = torch.randn(M, K, dtype=torch.float64, requires_grad=True)
    W = torch.randn(3, N, K, dtype=torch.float64, requires_grad=True)
    offsets = offsets_of(sizes)
    loss = compiled(x, W, offsets)
    loss.backward()
    y_ref = oracle_grouped_mm(x, W.transpose(1, 2), sizes)
    assert_close(loss, y_ref.square().sum(), torch.float64, "loss")
    dy = 2 * y_ref
    assert_rows_close(x.grad, oracle_grouped_mm(dy, W.detach(), sizes), sizes, torch.float64, "dx")
    assert_experts_close(W.grad.transpose(1, 2), oracle_wgrad(x, dy, sizes), torch.float64, "dw")
    # New group sizes, same shapes: the compiled graph reads offsets as data, not as constants.
    sizes2 = [0, 30, 2]
    x.grad = W.grad = None
    compiled(x, W, offsets_of(sizes2)).backward()
    y_ref2 = oracle_grouped_mm(x, W.transpose(1, 2), sizes2)
    assert_rows_close(x.grad, oracle_grouped_mm(2 * y_ref2, W.detach(), sizes2), sizes2, torch.float64, "dx")


@pytest.mark.slow
def test_compile_wgrad_accumulate(reference_backend):
    torch._dynamo.reset()
    sizes = [4, 0, 9]
    x, dy = torch.randn(15, 5), torch.randn(15, 7)
    main_grad = torch.randn(3, 5, 7)
    init = main_grad.clone()
    flags = torch.tensor([True, False, False])

    @torch.compile(fullgraph=True)
    def step(x, dy, offsets, main_grad, flags):
        dropless.grouped_mm_wgrad(x, dy, offsets, out=main_grad, accumulate=flags)

    step(x, dy, offsets_of(sizes), main_grad, flags)
    ref = oracle_wgrad(x, dy, sizes)
    assert_experts_close(main_grad, torch.where(flags.view(-1, 1, 1), init.double() + ref, ref), torch.float32)
