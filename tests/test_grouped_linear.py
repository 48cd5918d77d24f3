"""dropless.nn.GroupedLinear against a loop of nn.functional.linear, one call per expert."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close, bounds_of, oracle_wgrad, poisoned

from dropless import GroupedLinear


def linear_loop(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, sizes) -> torch.Tensor:
    """The module's definition: ``F.linear`` per expert on its rows, zero rows past the last group."""
    y = x.new_zeros(x.shape[0], weight.shape[1])
    parts = [F.linear(x[s:t], weight[e], None if bias is None else bias[e]) for e, (s, t) in enumerate(bounds_of(sizes))]
    return torch.cat([*parts, y[sum(sizes):]]) if parts else y


def _module(E, K, N, dtype, device, **kwargs):
    layer = GroupedLinear(E, K, N, device=device, dtype=dtype, **kwargs)
    assert layer.weight.shape == (E, N, K)
    return layer


def _compare(layer, x, group_sizes, sizes, dtype):
    """Forward and backward of ``layer(x, group_sizes)`` against the loop on copies of the parameters."""
    x1 = x.detach().clone().requires_grad_()
    y = layer(x1, group_sizes)
    weight = layer.weight.detach().double().cpu().requires_grad_()
    bias = None if layer.bias is None else layer.bias.detach().double().cpu().requires_grad_()
    x2 = x.detach().double().cpu().requires_grad_()
    ref = linear_loop(x2, weight, bias, sizes)
    assert y.shape == ref.shape and y.dtype == x.dtype
    assert_close(y, ref, dtype, "y")
    assert bool((y[sum(sizes):] == 0).all()), "rows past the last group must be zero (bias too)"

    dy = torch.randn_like(y)
    y.backward(dy)
    ref.backward(dy.double().cpu())
    assert_close(x1.grad, x2.grad, dtype, "dx")
    assert bool((x1.grad[sum(sizes):] == 0).all())
    assert_close(layer.weight.grad, weight.grad, dtype, "dweight")
    if bias is not None:
        assert_close(layer.bias.grad, bias.grad, dtype, "dbias")


CASES = {
    "zeros_tail": (6, 17, 30, [0, 12, 0, 9, 0, 1], 25),
    "giant": (4, 32, 16, [0, 40, 0, 0], 40),
    "e1": (1, 3, 100, [20], 23),
    "m1": (3, 8, 8, [1, 0, 0], 1),
    "m0": (2, 8, 8, [0, 0], 0),
}


@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_linear_loop(case, bias, backend):
    _, device = backend
    E, K, N, sizes, M = CASES[case]
    layer = _module(E, K, N, torch.float32, device, bias=bias)
    _compare(layer, torch.randn(M, K, device=device), sizes, sizes, torch.float32)


@pytest.mark.parametrize("form", ["list", "cpu_int64", "cpu_int32", "device_tensor"])
def test_group_sizes_forms(form, backend):
    _, device = backend
    sizes = [5, 0, 14, 2]
    group_sizes = {
        "list": sizes,
        "cpu_int64": torch.tensor(sizes),
        "cpu_int32": torch.tensor(sizes, dtype=torch.int32),
        "device_tensor": torch.tensor(sizes, device=device),
    }[form]
    layer = _module(4, 16, 24, torch.float32, device, bias=True)
    _compare(layer, torch.randn(25, 16, device=device), group_sizes, sizes, torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision(dtype, backend):
    _, device = backend
    sizes = [30, 0, 41, 9]
    layer = _module(4, 64, 48, dtype, device, bias=True)
    _compare(layer, torch.randn(90, 64, device=device, dtype=dtype), sizes, sizes, dtype)


def test_gradcheck_fp64(reference_backend):
    sizes = [2, 0, 4]
    layer = _module(3, 3, 2, torch.float64, "cpu", bias=True)
    x = torch.randn(8, 3, dtype=torch.float64, requires_grad=True)

    def f(x, weight, bias):
        return torch.func.functional_call(layer, {"weight": weight, "bias": bias}, (x, sizes))

    assert torch.autograd.gradcheck(f, (x, layer.weight.detach().requires_grad_(),
                                        layer.bias.detach().requires_grad_()))


# ---------------------------------------------------------------------------------------------------
# fuse_wgrad_accumulation: weight gradients land in weight.main_grad (fp32), inside the GEMM


def _fused_step(layer, x, sizes, mask=None):
    dy = torch.randn(x.shape[0], layer.out_features, dtype=x.dtype, device=x.device)
    y = layer(x, sizes, mask) if mask is not None else layer(x, sizes)
    y.backward(dy)
    return dy, oracle_wgrad(dy, x, sizes)  # main_grad[e] [out, in] = dy_e^T x_e


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_wgrad_accumulates_across_backward_calls(dtype, backend):
    _, device = backend
    sizes1, sizes2 = [7, 0, 20, 3], [0, 15, 15, 0]
    layer = _module(4, 24, 16, dtype, device, fuse_wgrad_accumulation=True, bias=True)
    layer.weight.grad_added_to_main_grad = False
    x1 = torch.randn(30, 24, device=device, dtype=dtype, requires_grad=True)
    _, g1 = _fused_step(layer, x1, sizes1)
    main_grad = layer.weight.main_grad
    assert main_grad.dtype == torch.float32 and main_grad.shape == layer.weight.shape
    assert layer.weight.grad is None, "fused accumulation must not produce weight.grad"
    assert layer.weight.grad_added_to_main_grad is True
    assert_close(main_grad, g1, dtype, "main_grad after step 1")
    assert x1.grad is not None and layer.bias.grad is not None

    x2 = torch.randn(32, 24, device=device, dtype=dtype)  # 2 tail rows
    _, g2 = _fused_step(layer, x2, sizes2)
    assert layer.weight.main_grad is main_grad, "main_grad must be updated in place"
    assert_close(main_grad, g1 + g2, dtype, "main_grad after step 2")


def test_fused_wgrad_mask_overwrites_and_accumulates(backend):
    _, device = backend
    E, K, N = 5, 16, 12
    sizes = [9, 0, 0, 11, 4]
    layer = _module(E, K, N, torch.float32, device, fuse_wgrad_accumulation=True)
    # First micro-batch: every expert overwrites, so a NaN-poisoned main_grad is fully replaced.
    layer.weight.main_grad = poisoned((E, N, K), torch.float32, device)
    x = torch.randn(26, K, device=device)
    _, g1 = _fused_step(layer, x, sizes, torch.zeros(E, dtype=torch.bool, device=device))
    assert_close(layer.weight.main_grad, g1, torch.float32, "overwritten main_grad")
    assert bool((layer.weight.main_grad[1:3] == 0).all()), "empty experts overwrite with zeros"

    # Second: experts 0, 1 and 3 add, 2 and 4 overwrite (expert 1 empty: untouched; 2 empty: zeroed).
    before = layer.weight.main_grad.clone()
    before[2] = 1.0
    layer.weight.main_grad.copy_(before)
    mask = torch.tensor([True, True, False, True, False], device=device)
    _, g2 = _fused_step(layer, x, [3, 0, 0, 20, 3], mask)
    expected = torch.where(mask.cpu().view(-1, 1, 1), before.double().cpu() + g2, g2)
    assert_close(layer.weight.main_grad, expected, torch.float32, "masked main_grad")
    assert torch.equal(layer.weight.main_grad[1], before[1])
    assert bool((layer.weight.main_grad[2] == 0).all())


def test_fused_no_grad_forward_leaves_main_grad_alone(backend):
    _, device = backend
    layer = _module(3, 8, 8, torch.float32, device, fuse_wgrad_accumulation=True, bias=True)
    before = torch.randn_like(layer.weight.main_grad)
    layer.weight.main_grad.copy_(before)
    x = torch.randn(10, 8, device=device)
    with torch.no_grad():
        y = layer(x, [4, 0, 5])
    assert torch.equal(layer.weight.main_grad, before)
    ref = linear_loop(x.double().cpu(), layer.weight.detach().double().cpu(), layer.bias.detach().double().cpu(),
                      [4, 0, 5])
    assert_close(y, ref, torch.float32)


def test_main_grad_follows_the_module():
    """main_grad exists from construction, and a cast or move of the module gives a fresh fp32 one."""
    layer = GroupedLinear(3, 8, 6, fuse_wgrad_accumulation=True)
    assert layer.weight.main_grad.dtype == torch.float32
    assert layer.weight.main_grad.shape == layer.weight.shape
    layer.weight.main_grad.add_(1.0)
    layer.to(torch.float64)
    assert layer.weight.dtype == torch.float64
    assert layer.weight.main_grad.dtype == torch.float32
    assert torch.count_nonzero(layer.weight.main_grad) == 0
    assert not hasattr(GroupedLinear(3, 8, 6).weight, "main_grad")


def test_fused_two_forwards_one_backward(backend):
    """Two forwards sharing one main_grad, then one backward (each backward writes main_grad in place)."""
    _, device = backend
    layer = _module(3, 8, 6, torch.float32, device, fuse_wgrad_accumulation=True)
    x1, x2 = torch.randn(10, 8, device=device), torch.randn(12, 8, device=device)
    dy1, dy2 = torch.randn(10, 6, device=device), torch.randn(12, 6, device=device)
    loss = (layer(x1, [4, 0, 6]) * dy1).sum() + (layer(x2, [0, 12, 0]) * dy2).sum()
    loss.backward()
    assert_close(layer.weight.main_grad, oracle_wgrad(dy1, x1, [4, 0, 6]) + oracle_wgrad(dy2, x2, [0, 12, 0]),
                 torch.float32)


# ---------------------------------------------------------------------------------------------------
# Arguments


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_experts"):
        GroupedLinear(0, 4, 4)
    with pytest.raises(ValueError, match="in_features"):
        GroupedLinear(2, 0, 4)
    layer = GroupedLinear(3, 4, 5)
    x = torch.randn(6, 4)
    with pytest.raises(ValueError, match="group_sizes"):
        layer(x, [1, 2])
    with pytest.raises(ValueError, match="group_sizes"):
        layer(x, torch.ones(3, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="wgrad_accumulation_mask"):
        layer(x, [1, 2, 3], torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"^x must be a tensor of shape \[M, in_features=4\], got \(6, 7\)"):
        layer(torch.randn(6, 7), [1, 2, 3])


HOST_SIZES_BAD = [
    ("too many rows", [1, 4, 2], r"^group_sizes sum to 7, more than the M=6 rows of x \(got \[1, 4, 2\]\)"),
    ("too many rows, a tuple", (0, 0, 9), r"^group_sizes sum to 9, more than the M=6 rows of x"),
    ("too few sizes", [1, 2], r"^group_sizes must have shape \[E\] = \[3\] \(one size per expert\), got \(2,\)"),
    ("too many sizes", [1, 2, 0, 0], r"^group_sizes must have shape \[E\] = \[3\] .*got \(4,\)"),
    ("negative", [4, -2, 3], r"^group_sizes must not be negative, got \[4, -2, 3\]"),
]


@pytest.mark.parametrize("name, sizes, pattern", HOST_SIZES_BAD, ids=[c[0] for c in HOST_SIZES_BAD])
def test_host_group_sizes_are_checked(name, sizes, pattern, backend):
    """Sizes given as a host list cost no sync to check: more rows than x holds, a wrong count or a negative
    size is a ValueError before anything runs (fused wgrad accumulation included: main_grad is untouched)."""
    _, device = backend
    layer = GroupedLinear(3, 4, 5, fuse_wgrad_accumulation=True, device=device)
    layer.weight.main_grad.fill_(2.0)
    with pytest.raises(ValueError, match=pattern):
        layer(torch.randn(6, 4, device=device), sizes).sum().backward()
    assert bool((layer.weight.main_grad == 2.0).all())


@pytest.mark.parametrize("sizes, pattern", [
    (torch.tensor([1.0, 2.0, 3.0]), r"^group_sizes must be an integer tensor .*got torch.float32$"),
    (torch.tensor([True, False, True]), r"^group_sizes must be an integer tensor .*got torch.bool$"),
    ([1, 2.5, 2], r"^group_sizes must be ints, got \[1, 2.5, 2\]$"),
    ([1, True, 2], r"^group_sizes must be ints"),
])
def test_group_sizes_must_be_integers(sizes, pattern, backend):
    """Sizes that are not integers (a float or bool tensor, a fractional host value) are refused, not
    truncated into other groups."""
    _, device = backend
    layer = GroupedLinear(3, 4, 5, device=device)
    with pytest.raises(TypeError, match=pattern):
        layer(torch.randn(6, 4, device=device), sizes)


def test_host_group_sizes_may_leave_rows(backend):
    """Fewer sizes than rows is allowed: the rows past their sum give zeros."""
    _, device = backend
    layer = GroupedLinear(3, 4, 5, device=device)
    y = layer(torch.randn(6, 4, device=device), [1, 0, 3])
    assert y.shape == (6, 5) and bool((y[4:] == 0).all()) and bool(torch.isfinite(y).all())


def test_x_must_be_a_matrix():
    layer = GroupedLinear(3, 4, 5)
    with pytest.raises(ValueError, match=r"^x must be a tensor of shape \[M, in_features=4\], got \(2, 3, 4\)"):
        layer(torch.randn(2, 3, 4), [1, 1, 1])
    with pytest.raises(ValueError, match=r"^x must be a tensor of shape \[M, in_features=4\], got list"):
        layer([[0.0] * 4], [1, 0, 0])


def test_reset_parameters_is_nn_linear_init():
    layer = GroupedLinear(64, 50, 40, bias=True)
    bound = 50 ** -0.5
    for p in (layer.weight.detach(), layer.bias.detach()):
        assert float(p.abs().max()) <= bound
        assert float(p.abs().max()) > 0.9 * bound  # spread over the whole range, not a constant
    assert "num_experts=64" in repr(layer)


# ---------------------------------------------------------------------------------------------------
# torch.compile on the CPU (reference backend, custom ops' fake impls)


@pytest.mark.slow
def test_compile(reference_backend):
    torch._dynamo.reset()
    layer = _module(3, 8, 6, torch.float32, "cpu", bias=True)
    compiled = torch.compile(layer, fullgraph=True)
    sizes = torch.tensor([4, 0, 9])
    x = torch.randn(15, 8, requires_grad=True)
    y = compiled(x, sizes)
    dy = torch.randn_like(y)
    y.backward(dy)
    weight = layer.weight.detach().double().requires_grad_()
    bias = layer.bias.detach().double().requires_grad_()
    x2 = x.detach().double().requires_grad_()
    ref = linear_loop(x2, weight, bias, [4, 0, 9])
    ref.backward(dy.double())
    assert_close(y, ref, torch.float32, "y")
    assert_close(x.grad, x2.grad, torch.float32, "dx")
    assert_close(layer.weight.grad, weight.grad, torch.float32, "dweight")
    assert_close(layer.bias.grad, bias.grad, torch.float32, "dbias")


@pytest.mark.slow
def test_compile_fused_wgrad(reference_backend):
    torch._dynamo.reset()
    layer = _module(3, 8, 6, torch.float32, "cpu", fuse_wgrad_accumulation=True)
    layer.weight.main_grad = torch.randn(3, 6, 8)
    init = layer.weight.main_grad.clone()
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(15, 8)
    mask = torch.tensor([True, False, True])
    y = compiled(x, torch.tensor([4, 0, 9]), mask)
    dy = torch.randn_like(y)
    y.backward(dy)
    g = oracle_wgrad(dy, x, [4, 0, 9])
    assert_close(layer.weight.main_grad, torch.where(mask.view(-1, 1, 1), init.double() + g, g), torch.float32)


@pytest.mark.slow
def test_compile_fused_wgrad_fresh_module(reference_backend):
    """A freshly built module compiles with fullgraph: main_grad exists before the traced forward."""
    torch._dynamo.reset()
    layer = _module(3, 8, 6, torch.float32, "cpu", fuse_wgrad_accumulation=True)
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(15, 8)
    y = compiled(x, torch.tensor([4, 0, 9]))
    dy = torch.randn_like(y)
    y.backward(dy)
    assert_close(layer.weight.main_grad, oracle_wgrad(dy, x, [4, 0, 9]), torch.float32)
