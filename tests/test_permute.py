"""dropless.ops.permute: permute / unpermute (forward and gradients through autograd), on the reference
backend and on the Triton kernels (the interpreter on CPU), against an independent loop oracle in fp64
and dropless.reference; the kernel launchers on NaN-poisoned outputs; routing metadata exact."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE, assert_close, make_x, poisoned
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dropless
from dropless import reference
from dropless.kernels.permute import permute_rows, unpermute_rows
from dropless.ops.fp8_gradient import take_fp8_copy
from dropless.ops.permute import _invert, permute, quantize_permuted, unpermute
from dropless.ops.quantize import empty_quantized
from dropless.quantized import Recipe

META = torch.device("meta")  # stands in for a second device

# (T, k, E, d, routing). d includes 0, 1, 3, 17, 33, 100: not multiples of any block.
CASES = {
    "t1_k1": (1, 1, 3, 5, "random"),
    "t1_k8": (1, 8, 10, 3, "distinct"),
    "k8": (11, 8, 16, 100, "distinct"),
    "e1": (9, 1, 1, 3, "random"),
    "e1_k2_sentinel": (9, 2, 1, 1, "sentinel"),
    "e64": (20, 4, 64, 17, "distinct"),
    "one_expert": (15, 2, 5, 3, "one_expert"),
    "empty_experts": (17, 3, 8, 100, "subset"),
    "sentinel": (25, 4, 6, 1, "sentinel"),
    "sentinel_k8": (9, 8, 5, 33, "sentinel"),
    "negative_ids": (12, 2, 4, 3, "negative"),
    "all_sentinel": (6, 2, 3, 3, "all_sentinel"),
    "t0": (0, 2, 3, 4, "random"),
    "d0": (5, 2, 3, 0, "sentinel"),
}


def make_ids(T: int, k: int, E: int, routing: str, device, dtype=torch.int64) -> torch.Tensor:
    """Random expert ids ``[T, k]``: ``sentinel`` mixes in ids >= E, ``negative`` ids < 0 too,
    ``subset`` leaves most experts empty."""
    if routing == "random":
        ids = torch.randint(0, E, (T, k))
    elif routing == "distinct":
        ids = torch.stack([torch.randperm(E)[:k] for _ in range(T)]) if T else torch.empty(0, k, dtype=torch.long)
    elif routing == "sentinel":
        ids = torch.randint(0, E + 3, (T, k))
    elif routing == "negative":
        ids = torch.randint(-2, E + 2, (T, k))
    elif routing == "one_expert":
        ids = torch.full((T, k), E // 2)
    elif routing == "subset":
        ids = torch.tensor([1, E - 1])[torch.randint(0, 2, (T, k))]
    elif routing == "all_sentinel":
        ids = E + torch.randint(0, 3, (T, k))
    else:
        raise ValueError(routing)
    return ids.to(device=device, dtype=dtype)


def _case(name: str, device, ids_dtype=torch.int64):
    T, k, E, d, routing = CASES[name]
    return T, k, E, d, make_ids(T, k, E, routing, device, ids_dtype)


# ---------------------------------------------------------------------------------------------------
# Independent oracles in fp64 (loops over slots; no code shared with dropless)


def oracle_order(ids: torch.Tensor, E: int) -> tuple[list[int], list[int]]:
    """The sorted slots (expert by expert, token order within one; out-of-range ids last, in slot
    order) and the group sizes."""
    T, k = ids.shape
    flat = ids.reshape(-1).tolist()
    order = [s for e in range(E) for s in range(T * k) if flat[s] == e]
    order += [s for s in range(T * k) if not 0 <= flat[s] < E]
    return order, [flat.count(e) for e in range(E)]


def oracle_permute(x: torch.Tensor, order: list[int], n_valid: int, k: int) -> torch.Tensor:
    x64 = x.detach().double().cpu()
    out = torch.zeros(len(order), x.shape[1], dtype=torch.float64)
    for p in range(n_valid):
        out[p] = x64[order[p] // k]
    return out


def oracle_unpermute(y_sorted: torch.Tensor, order: list[int], n_valid: int, weights: torch.Tensor) -> torch.Tensor:
    T, k = weights.shape
    ys, w = y_sorted.detach().double().cpu(), weights.detach().double().cpu()
    y = torch.zeros(T, y_sorted.shape[1], dtype=torch.float64)
    for p in range(n_valid):
        t, j = divmod(order[p], k)
        y[t] += w[t, j] * ys[p]
    return y


def oracle_unpermute_grads(dy, y_sorted, order, n_valid, weights) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dy_sorted, dweights)`` of unpermute; zero for the rows past n_valid."""
    T, k = weights.shape
    dy64, ys, w = dy.detach().double().cpu(), y_sorted.detach().double().cpu(), weights.detach().double().cpu()
    dys = torch.zeros(len(order), dy.shape[1], dtype=torch.float64)
    dw = torch.zeros(T, k, dtype=torch.float64)
    for p in range(n_valid):
        t, j = divmod(order[p], k)
        dys[p] = w[t, j] * dy64[t]
        dw[t, j] = dy64[t] @ ys[p]
    return dys, dw


def _cumsum(sizes: list[int]) -> list[int]:
    out, total = [], 0
    for s in sizes:
        total += s
        out.append(total)
    return out


def _with_nan_tail(t: torch.Tensor, n_valid: int) -> torch.Tensor:
    """Rows past n_valid (sentinel copies) set to NaN: whatever they hold must not leak."""
    t[n_valid:] = float("nan")
    return t


# ---------------------------------------------------------------------------------------------------
# permute -> unpermute, forward and backward, every case


def _check(T, k, E, d, ids, dtype, device):
    order, sizes = oracle_order(ids.cpu(), E)
    n_valid, M = sum(sizes), T * k

    x = torch.randn(T, d, dtype=dtype, device=device, requires_grad=True)
    x_sorted, slot, group_sizes, offsets = permute(x, ids, E)
    assert x_sorted.dtype == dtype and x_sorted.shape == (M, d) and x_sorted.device == x.device
    assert slot.dtype == group_sizes.dtype == offsets.dtype == torch.int32
    assert slot.shape == (M,) and group_sizes.shape == offsets.shape == (E,)
    assert slot.tolist() == order, "sorted_to_token_slot"
    assert group_sizes.tolist() == sizes, "group_sizes"
    assert offsets.tolist() == _cumsum(sizes), "offsets"
    # A gather is exact, and the sentinel rows are exactly zero.
    assert torch.equal(x_sorted.detach().cpu(), oracle_permute(x, order, n_valid, k).to(dtype)), "x_sorted"

    dx_sorted = _with_nan_tail(torch.randn(M, d, dtype=dtype, device=device), n_valid)
    x_sorted.backward(dx_sorted)
    assert x.grad.dtype == dtype
    assert_close(x.grad, oracle_unpermute(dx_sorted, order, n_valid, torch.ones(T, k)), dtype, "dx")

    y_sorted = _with_nan_tail(torch.randn(M, d, dtype=dtype, device=device), n_valid).requires_grad_()
    w_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # router probabilities
    weights = (torch.rand(T, k, dtype=w_dtype, device=device) + 0.1).requires_grad_()
    y = unpermute(y_sorted, slot, weights, offsets)
    assert y.dtype == dtype and y.shape == (T, d) and y.device == x.device
    y_ref = oracle_unpermute(y_sorted, order, n_valid, weights)
    assert_close(y, y_ref, dtype, "y")

    dy = torch.randn(T, d, dtype=dtype, device=device)
    y.backward(dy)
    dys_ref, dw_ref = oracle_unpermute_grads(dy, y_sorted, order, n_valid, weights)
    assert y_sorted.grad.dtype == dtype and weights.grad.dtype == w_dtype
    assert_close(y_sorted.grad, dys_ref, dtype, "dy_sorted")
    assert bool((y_sorted.grad[n_valid:] == 0).all()), "dy_sorted: sentinel rows are not zero"
    assert_close(weights.grad, dw_ref, dtype, "dweights")
    assert bool((weights.grad.reshape(-1)[order[n_valid:]] == 0).all()), "dweights: sentinel copies are not zero"

    # dropless.reference in fp64 on the same inputs agrees too.
    ids_cpu, off_cpu, slot_cpu = ids.cpu(), offsets.cpu(), slot.cpu()
    ref_sorted, ref_slot, ref_sizes, ref_offsets = reference.permute(x.detach().double().cpu(), ids_cpu, E)
    assert torch.equal(ref_slot, slot_cpu) and torch.equal(ref_sizes, group_sizes.cpu())
    assert torch.equal(ref_offsets, off_cpu)
    assert torch.equal(ref_sorted.to(dtype), x_sorted.detach().cpu())
    w64 = weights.detach().double().cpu()
    assert_close(y, reference.unpermute(y_sorted.detach().double().cpu(), slot_cpu, w64, off_cpu), dtype, "y (ref)")
    dys64, dw64 = reference.unpermute_backward(dy.double().cpu(), y_sorted.detach().double().cpu(), slot_cpu, w64,
                                               off_cpu)
    assert_close(y_sorted.grad, dys64, dtype, "dy_sorted (ref)")
    assert_close(weights.grad, dw64, dtype, "dweights (ref)")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_reference(case, dtype, reference_backend):
    _check(*_case(case, reference_backend), dtype, reference_backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_triton(case, dtype, triton_backend):
    _check(*_case(case, triton_backend), dtype, triton_backend)


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_ids_dtypes(ids_dtype, backend):
    _, device = backend
    _check(*_case("sentinel", device, ids_dtype), torch.float32, device)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(T=st.integers(0, 12), k=st.integers(1, 5), E=st.integers(1, 8), d=st.integers(1, 40),
       sentinels=st.integers(0, 3))
def test_property_triton(T, k, E, d, sentinels):
    dropless.set_backend("triton")
    try:
        ids = torch.randint(0, E + sentinels, (T, k), device=KERNEL_DEVICE)
        _check(T, k, E, d, ids, torch.float32, KERNEL_DEVICE)
    finally:
        dropless.set_backend("auto")


def test_strided_operands(backend):
    """x a column window with odd offset, weights a transposed bf16 view, y_sorted column-major, dy
    with stride 0 (the gradient of ``.sum()``)."""
    _, device = backend
    T, k, E, d, ids = _case("sentinel_k8", device)
    order, sizes = oracle_order(ids.cpu(), E)
    n_valid = sum(sizes)
    x = make_x(T, d, torch.float32, device, "col_slice_odd").requires_grad_()
    x_sorted, slot, _, offsets = permute(x, ids, E)
    assert torch.equal(x_sorted.detach().cpu(), oracle_permute(x, order, n_valid, k).float())
    x_sorted.sum().backward()
    assert_close(x.grad, oracle_unpermute(torch.ones(T * k, d), order, n_valid, torch.ones(T, k)), torch.float32)

    y_sorted = make_x(T * k, d, torch.float32, device, "col_major").requires_grad_()
    weights = (torch.rand(k, T, device=device) + 0.1).to(torch.bfloat16).t().requires_grad_()
    y = unpermute(y_sorted, slot, weights, offsets)
    assert_close(y, oracle_unpermute(y_sorted, order, n_valid, weights), torch.float32, "y")
    y.sum().backward()
    dys_ref, dw_ref = oracle_unpermute_grads(torch.ones(T, d), y_sorted, order, n_valid, weights)
    assert_close(y_sorted.grad, dys_ref, torch.float32, "dy_sorted")
    assert weights.grad.dtype == torch.bfloat16
    assert_close(weights.grad, dw_ref, torch.bfloat16, "dweights")


@pytest.mark.parametrize("which", ["y_sorted", "weights"])
def test_gradient_of_one_input(which, backend):
    """Only one of y_sorted and weights requires grad: the other gets none, the dot products are skipped
    when weights need none."""
    _, device = backend
    T, k, E, d, ids = _case("sentinel", device)
    order, sizes = oracle_order(ids.cpu(), E)
    n_valid = sum(sizes)
    _, slot, _, offsets = permute(torch.randn(T, d, device=device), ids, E)
    y_sorted = torch.randn(T * k, d, device=device).requires_grad_(which == "y_sorted")
    weights = (torch.rand(T, k, device=device) + 0.1).requires_grad_(which == "weights")
    dy = torch.randn(T, d, device=device)
    unpermute(y_sorted, slot, weights, offsets).backward(dy)
    dys_ref, dw_ref = oracle_unpermute_grads(dy, y_sorted, order, n_valid, weights)
    if which == "y_sorted":
        assert weights.grad is None
        assert_close(y_sorted.grad, dys_ref, torch.float32, "dy_sorted")
    else:
        assert y_sorted.grad is None
        assert_close(weights.grad, dw_ref, torch.float32, "dweights")


# ---------------------------------------------------------------------------------------------------
# The launchers on NaN-poisoned outputs


def _launcher_routing(ids: torch.Tensor, E: int, device) -> tuple[list[int], int, torch.Tensor, torch.Tensor]:
    """The oracle's sorted slots, the valid rows, the inverse map (int32, slot -> sorted row) and the
    offsets (int32) of ``ids``, as the launchers take them."""
    order, sizes = oracle_order(ids.cpu(), E)
    M = ids.numel()
    inv = torch.empty(M, dtype=torch.int32)
    inv[torch.tensor(order, dtype=torch.long)] = torch.arange(M, dtype=torch.int32)
    return order, sum(sizes), inv.to(device), torch.tensor(_cumsum(sizes), dtype=torch.int32, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["k8", "sentinel", "empty_experts", "all_sentinel", "t1_k1"])
def test_launchers_write_every_element(case, dtype):
    device = KERNEL_DEVICE
    T, k, E, d, ids = _case(case, device)
    order, n_valid, inv, offsets = _launcher_routing(ids, E, device)
    M = T * k
    x = torch.randn(T, d, dtype=dtype, device=device)
    weights = torch.rand(T, k, device=device) + 0.1

    out = poisoned((M, d), dtype, device)
    permute_rows(x, inv, offsets, k, out)
    assert torch.equal(out.cpu(), oracle_permute(x, order, n_valid, k).to(dtype)), "plain gather"

    other = _with_nan_tail(torch.randn(M, d, dtype=dtype, device=device), n_valid)
    out, dw = poisoned((M, d), dtype, device), poisoned((M,), torch.float32, device)
    permute_rows(x, inv, offsets, k, out, weights, other=other, dweights=dw)
    dys_ref, dw_ref = oracle_unpermute_grads(x, other, order, n_valid, weights)
    assert_close(out, dys_ref, dtype, "weighted gather")
    assert_close(dw.view(T, k), dw_ref, dtype, "dot products")

    src = _with_nan_tail(torch.randn(M, d, dtype=dtype, device=device), n_valid)
    for w in (weights, None):
        y = poisoned((T, d), dtype, device)
        unpermute_rows(src, inv, offsets, k, y, w)
        ref = oracle_unpermute(src, order, n_valid, w if w is not None else torch.ones(T, k))
        assert_close(y, ref, dtype, "weighted sum" if w is not None else "sum")
    # Bounded: the first rows written as before, the rest left as they were.
    for rows in {0, T // 2, T}:
        y = poisoned((T, d), dtype, device)
        unpermute_rows(src, inv, offsets, k, y, weights, bound=torch.tensor([rows], dtype=torch.int32, device=device))
        assert_close(y[:rows], oracle_unpermute(src, order, n_valid, weights)[:rows], dtype, f"bound {rows}")
        assert y[rows:].isnan().all(), f"bound {rows}: rows past it written"


# Every option the kernel specializes on; D = 100 and 300 end mid-block for every recipe.
FP8_RECIPES = {
    "rowwise": Recipe("rowwise", None),
    "rowwise-pow2": Recipe("rowwise", None, pow2=True),
    "block128": Recipe("block128", 128),
    "mxfp8-rceil": Recipe("mxfp8", 32, mx_rounding="rceil"),
    "mxfp8-floor": Recipe("mxfp8", 32),
}


def _poisoned_fp8(shape, recipe: Recipe, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``empty_quantized``'s buffers filled with NaN bytes."""
    data, scale = empty_quantized(shape, recipe, 1, None, device)
    data.view(torch.uint8).fill_(0x7F)
    if scale.element_size() == 1:
        scale.view(torch.uint8).fill_(0xFF)
    else:
        scale.fill_(float("nan"))
    return data, scale


def assert_quantize_of(data: torch.Tensor, scale: torch.Tensor, rows: torch.Tensor, recipe: Recipe, what: str) -> None:
    """``(data, scale)`` hold ``reference.quantize(rows, recipe, 1)``'s bytes, every one written."""
    ref_data, ref_scale = reference.quantize(rows.cpu(), recipe, 1)
    for name, out, ref in (("data", data.cpu(), ref_data), ("scale", scale.cpu(), ref_scale)):
        out, ref = (out.view(torch.uint8), ref.view(torch.uint8)) if out.element_size() == 1 else (out, ref)
        bad = out != ref
        assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} {name} elements differ"


@pytest.mark.parametrize("recipe", list(FP8_RECIPES))
@pytest.mark.parametrize("case", ["k8", "sentinel", "all_sentinel", "t1_k1", "d0"])
def test_launcher_writes_fp8_copies(case, recipe):
    """The rows quantized along D, beside them (weighted, with the dot products) or alone (a plain gather):
    ``reference.quantize`` of the rows, bit for bit, into NaN-poisoned buffers; sentinel rows quantize
    as zeros. Token rows span many magnitudes, with a zero row and one outlier, and a weight is negative."""
    device, r = KERNEL_DEVICE, FP8_RECIPES[recipe]
    T, k, E, _, ids = _case(case, device)
    d = 0 if case == "d0" else 300
    order, n_valid, inv, offsets = _launcher_routing(ids, E, device)
    M = T * k
    x = (torch.randn(T, d) * torch.exp2(torch.randint(-20, 20, (T, 1)).float())).to(torch.bfloat16)
    if T > 1 and d:
        x[1] = 0.0
        x[0, d // 3] = 1e4
    x = x.to(device)
    weights = torch.rand(T, k, device=device) + 0.1
    weights[0, 0] = -0.7

    data, scale = _poisoned_fp8((M, d), r, device)
    permute_rows(x, inv, offsets, k, None, quantized=(data, scale, r))
    assert_quantize_of(data, scale, oracle_permute(x, order, n_valid, k).to(torch.bfloat16), r, "plain")

    out, dw = poisoned((M, d), torch.bfloat16, device), poisoned((M,), torch.float32, device)
    other = _with_nan_tail(torch.randn(M, d, dtype=torch.bfloat16, device=device), n_valid)
    data, scale = _poisoned_fp8((M, d), r, device)
    permute_rows(x, inv, offsets, k, out, weights, other=other, dweights=dw, quantized=(data, scale, r))
    dys_ref, dw_ref = oracle_unpermute_grads(x, other, order, n_valid, weights)
    assert_close(out, dys_ref, torch.bfloat16, "weighted gather")
    assert_close(dw.view(T, k), dw_ref, torch.bfloat16, "dot products")
    # The copy is of the rows as the kernel rounded them (the interpreter's rounding is not a GPU's).
    assert_quantize_of(data, scale, out, r, "weighted")


@pytest.mark.parametrize("recipe", ["rowwise", "block128", "mxfp8-rceil"])
@pytest.mark.parametrize("case", ["k8", "sentinel", "empty_experts"])
def test_quantize_permuted_is_quantize_of_permute(case, recipe, backend):
    """``quantize_permuted``: the bits of ``dropless.quantize(permute(x)[0])`` on either backend, sentinel
    rows zero, with no permuted rows made."""
    _, device = backend
    r = FP8_RECIPES[recipe]
    T, k, E, d, ids = _case(case, device)
    x = torch.randn(T, d, dtype=torch.bfloat16, device=device)
    x_sorted, slot, _, offsets = permute(x, ids, E)
    q = quantize_permuted(x, slot, offsets, k, r)
    assert q.recipe == r and q.dim == 1 and q.offsets is None and q.shape == x_sorted.shape
    assert_quantize_of(q.data, q.scale, x_sorted, r, case)


@pytest.mark.parametrize("recipe", ["rowwise", "block128", "mxfp8-floor"])
@pytest.mark.parametrize("case", ["k8", "sentinel"])
def test_unpermute_grad_recipe_attaches_the_gradients_copy(case, recipe, backend):
    """``unpermute(..., grad_recipe=r)``: y_sorted's gradient (the same values as without it) carries its
    quantization along d (``ops.fp8_gradient``), which the product that made y_sorted takes."""
    _, device = backend
    r = FP8_RECIPES[recipe]
    T, k, E, d, ids = _case(case, device)
    _, slot, _, offsets = permute(torch.randn(T, d, device=device), ids, E)
    y_sorted = torch.randn(T * k, d, dtype=torch.bfloat16, device=device, requires_grad=True)
    weights = (torch.rand(T, k, device=device) + 0.1).requires_grad_()
    dy = torch.randn(T, d, dtype=torch.bfloat16, device=device)
    taken = []
    y_in = y_sorted * 1  # a node between, whose hook sees the gradient unpermute's backward returned
    y_in.register_hook(lambda g: taken.append((g.clone(), take_fp8_copy(g, r), take_fp8_copy(g, r))))
    unpermute(y_in, slot, weights, offsets, grad_recipe=r).backward(dy)
    (grad, copy, again), = taken
    assert copy is not None and again is None, "the copy is taken once"
    assert_quantize_of(copy.data, copy.scale, grad, r, case)
    plain = y_sorted.detach().clone().requires_grad_()
    unpermute(plain, slot, weights.detach(), offsets).backward(dy)
    assert torch.equal(grad, plain.grad), "the gradient changed"


def test_launcher_without_interpreter_names_the_fix(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(2, 3)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        permute_rows(x, torch.arange(2, dtype=torch.int32), torch.tensor([2], dtype=torch.int32), 1,
                     torch.empty(2, 3))


# ---------------------------------------------------------------------------------------------------
# Properties: stability, determinism, round trip


def test_stable_and_deterministic(backend):
    _, device = backend
    T, k, E = 40, 4, 3  # many ties: ~50 copies per expert
    ids = torch.randint(0, E + 1, (T, k), device=device)
    x = torch.randn(T, 8, device=device)
    first = permute(x, ids, E)
    second = permute(x, ids, E)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    slot, offsets = first[1].tolist(), first[3].tolist()
    flat = ids.reshape(-1).tolist()
    start = 0
    for e, end in enumerate(offsets):
        group = slot[start:end]
        assert group == sorted(group), f"expert {e}: slots not in token order"
        assert all(flat[s] == e for s in group)
        start = end
    assert slot[start:] == sorted(slot[start:]) and all(flat[s] >= E for s in slot[start:])
    weights = torch.rand(T, k, device=device)
    y_sorted = torch.randn(T * k, 8, device=device)
    assert torch.equal(unpermute(y_sorted, first[1], weights, first[3]),
                       unpermute(y_sorted, first[1], weights, first[3]))


@pytest.mark.parametrize("routing", ["distinct", "sentinel"])
def test_round_trip(routing, backend):
    """Weights 1/(valid copies of t) on the valid copies: unpermute(permute(x)) is x (zero for a token
    with no local copy)."""
    _, device = backend
    T, k, E, d = 30, 3, 5, 17
    ids = make_ids(T, k, E, routing, device)
    valid = (ids >= 0) & (ids < E)
    count = valid.sum(1, keepdim=True)
    weights = torch.where(valid, 1.0 / count.clamp(min=1), 0.0)
    x = torch.randn(T, d, device=device)
    x_sorted, slot, _, offsets = permute(x, ids, E)
    y = unpermute(x_sorted, slot, weights, offsets)
    expected = torch.where(count > 0, x, 0.0)
    assert_close(y, expected.double(), torch.float32, "round trip")
    if routing == "distinct":
        assert bool(valid.all())


# ---------------------------------------------------------------------------------------------------
# gradcheck (fp64, reference backend)


def test_gradcheck_fp64(reference_backend):
    T, k, E, d, ids = _case("sentinel", reference_backend)
    T, d = 7, 3
    ids = ids[:T]
    x = torch.randn(T, d, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a: permute(a, ids, E)[0], (x,))
    _, slot, _, offsets = permute(x.detach(), ids, E)
    y_sorted = torch.randn(T * k, d, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(T, k, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, w: unpermute(a, slot, w, offsets), (y_sorted, weights))

    def layer(a, w):
        x_sorted, slot, _, offsets = permute(a, ids, E)
        return unpermute(x_sorted.sin(), slot, w, offsets)

    assert torch.autograd.gradcheck(layer, (x, weights))


# ---------------------------------------------------------------------------------------------------
# Argument checks


def _good(device="cpu"):
    T, k, E, d = 6, 2, 3, 4
    x = torch.randn(T, d, device=device)
    ids = torch.randint(0, E, (T, k), device=device)
    x_sorted, slot, _, offsets = permute(x, ids, E)
    return x, ids, E, x_sorted, slot, torch.rand(T, k, device=device), offsets


PERMUTE_BAD = [
    ("x list", TypeError, r"^x must be a torch\.Tensor", lambda x, i, e: permute(x.tolist(), i, e)),
    ("x rank", ValueError, r"^x must have 2 dimensions", lambda x, i, e: permute(x[0], i, e)),
    ("x int", TypeError, r"^x must have dtype", lambda x, i, e: permute(x.long(), i, e)),
    ("ids float", TypeError, r"^topk_ids must have dtype", lambda x, i, e: permute(x, i.float(), e)),
    ("ids rank", ValueError, r"^topk_ids must have 2 dimensions", lambda x, i, e: permute(x, i[:, 0], e)),
    ("ids rows", ValueError, r"^topk_ids must have shape \[T, k\] with T=6", lambda x, i, e: permute(x, i[:5], e)),
    ("ids device", ValueError, r"^topk_ids is on meta", lambda x, i, e: permute(x, i.to(META), e)),
    ("E zero", ValueError, r"^num_experts must be an int >= 1", lambda x, i, e: permute(x, i, 0)),
    ("E tensor", ValueError, r"^num_experts must be an int", lambda x, i, e: permute(x, i, torch.tensor(3))),
]

UNPERMUTE_BAD = [
    ("y_sorted rank", ValueError, r"^y_sorted must have 2 dimensions", lambda y, s, w, o: unpermute(y[0], s, w, o)),
    ("y_sorted rows", ValueError, r"^y_sorted must have T\*k = 12 rows", lambda y, s, w, o: unpermute(y[:11], s, w, o)),
    ("y_sorted int", TypeError, r"^y_sorted must have dtype", lambda y, s, w, o: unpermute(y.int(), s, w, o)),
    ("slot float", TypeError, r"^sorted_to_token_slot must have dtype",
     lambda y, s, w, o: unpermute(y, s.float(), w, o)),
    ("slot length", ValueError, r"^sorted_to_token_slot must have shape \[T\*k\] = \[12\]",
     lambda y, s, w, o: unpermute(y, s[:6], w, o)),
    ("slot list", TypeError, r"^sorted_to_token_slot must be a torch\.Tensor",
     lambda y, s, w, o: unpermute(y, s.tolist(), w, o)),
    ("weights rank", ValueError, r"^weights must have 2 dimensions", lambda y, s, w, o: unpermute(y, s, w[0], o)),
    ("weights int", TypeError, r"^weights must have dtype", lambda y, s, w, o: unpermute(y, s, w.long(), o)),
    ("weights device", ValueError, r"^weights is on meta", lambda y, s, w, o: unpermute(y, s, w.to(META), o)),
    ("offsets float", TypeError, r"^offsets must have dtype", lambda y, s, w, o: unpermute(y, s, w, o.float())),
    ("offsets empty", ValueError, r"^offsets must hold at least one expert",
     lambda y, s, w, o: unpermute(y, s, w, o[:0])),
    ("offsets device", ValueError, r"^offsets is on meta", lambda y, s, w, o: unpermute(y, s, w, o.to(META))),
]


@pytest.mark.parametrize("name, error, pattern, call", PERMUTE_BAD, ids=[c[0] for c in PERMUTE_BAD])
def test_permute_bad_arguments(name, error, pattern, call):
    x, ids, E, *_ = _good()
    with pytest.raises(error, match=pattern):
        call(x, ids, E)


@pytest.mark.parametrize("name, error, pattern, call", UNPERMUTE_BAD, ids=[c[0] for c in UNPERMUTE_BAD])
def test_unpermute_bad_arguments(name, error, pattern, call):
    _, _, _, x_sorted, slot, weights, offsets = _good()
    with pytest.raises(error, match=pattern):
        call(x_sorted, slot, weights, offsets)


def test_fp64_needs_the_reference_backend(triton_backend):
    with pytest.raises(TypeError, match=r"^x must have dtype"):
        permute(torch.randn(4, 3, dtype=torch.float64), torch.zeros(4, 1, dtype=torch.long), 2)


def test_validation_flags_bad_offsets(reference_backend):
    dropless.set_validation(True)
    _, _, _, x_sorted, slot, weights, offsets = _good()
    with pytest.raises(RuntimeError, match="offsets must be non-decreasing"):
        unpermute(x_sorted, slot, weights, offsets + 100)


# ---------------------------------------------------------------------------------------------------
# torch.compile (reference backend on the CPU: the custom ops' fake impls carry the tracing)


@pytest.mark.slow
def test_compile_permute_unpermute(reference_backend):
    torch._dynamo.reset()
    T, k, E, d = 10, 2, 3, 5

    def moe(x, ids, weights):
        x_sorted, slot, group_sizes, offsets = permute(x, ids, E)
        return unpermute(x_sorted.sin(), slot, weights, offsets).square().sum()

    compiled = torch.compile(moe, fullgraph=True)
    x = torch.randn(T, d, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(T, k, dtype=torch.float64, requires_grad=True)
    for routing in ("sentinel", "distinct"):  # new routing, same shapes: the ids are data, not constants
        ids = make_ids(T, k, E, routing, "cpu")
        x.grad = weights.grad = None
        loss = compiled(x, ids, weights)
        loss.backward()
        grads = x.grad.clone(), weights.grad.clone()
        x.grad = weights.grad = None
        eager = moe(x, ids, weights)
        eager.backward()
        assert_close(loss, eager.detach(), torch.float64, "loss")
        assert_close(grads[0], x.grad, torch.float64, "dx")
        assert_close(grads[1], weights.grad, torch.float64, "dweights")


# ---------------------------------------------------------------------------------------------------
# GPU only: no host sync, CUDA-graph replay with new routings


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_graph_no_sync(dtype):
    device = torch.device("cuda")
    T, k, E, d = 512, 8, 64, 384
    static_x = torch.randn(T, d, dtype=dtype, device=device, requires_grad=True)
    static_w = torch.rand(T, k, device=device, requires_grad=True)
    static_ids = torch.randint(0, E + 4, (T, k), device=device)
    static_dy = torch.randn(T, d, dtype=dtype, device=device)

    def step():
        x_sorted, slot, _, offsets = permute(static_x, static_ids, E)
        y = unpermute(x_sorted * 2, slot, static_w, offsets)
        y.backward(static_dy)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    static_x.grad = static_w.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = step()
    for _ in range(2):
        ids = torch.randint(0, E + 4, (T, k), device=device)
        static_ids.copy_(ids)
        graph.replay()
        torch.cuda.synchronize()
        order, sizes = oracle_order(ids.cpu(), E)
        n_valid = sum(sizes)
        x_sorted2 = oracle_permute(static_x, order, n_valid, k).to(dtype).double() * 2
        assert_close(static_y, oracle_unpermute(x_sorted2, order, n_valid, static_w), dtype, "y")
        dys_ref, dw_ref = oracle_unpermute_grads(static_dy, x_sorted2, order, n_valid, static_w)
        assert_close(static_w.grad, dw_ref, dtype, "dweights")
        assert_close(static_x.grad, oracle_unpermute(2 * dys_ref, order, n_valid, torch.ones(T, k)), dtype, "dx")


def test_the_inverse_map_is_computed_once_per_routing(backend):
    """permute's inverse map (slot -> sorted row) is kept on sorted_to_token_slot for the step's other
    gathers, and computed again once the tensor changes; results are those of a fresh tensor."""
    _, device = backend
    T, k, E, d, ids = _case("k8", device)
    x = torch.randn(T, d, device=device)
    _, slot, _, offsets = permute(x, ids, E)
    inverse = _invert(slot)
    assert _invert(slot) is inverse
    expected = torch.empty_like(slot)
    expected[slot.long()] = torch.arange(T * k, dtype=slot.dtype, device=device)
    assert torch.equal(inverse, expected)
    y_sorted, weights = torch.randn(T * k, d, device=device), torch.rand(T, k, device=device)
    y = unpermute(y_sorted, slot, weights, offsets)
    assert torch.equal(y, unpermute(y_sorted, slot.clone(), weights, offsets))
    slot.copy_(slot.flip(0))  # an in-place change: a new version
    assert _invert(slot) is not inverse
    assert torch.equal(_invert(slot), _invert(slot.clone()))
