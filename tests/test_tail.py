"""``tail=False``: the ragged-M products, BF16 and FP8, forward and x's gradient, leave the rows past the last
group as they are, and write the groups' rows exactly as with the tail's zeros (``tail=True``). On the
Triton kernels (the interpreter on CPU); on a Hopper GPU, bf16 and rowwise FP8 at these aligned shapes
also run the Gluon kernels."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE, assert_rows_close, make_w, make_x, offsets_of, oracle_grouped_mm, poisoned

import dropless
from dropless.kernels.tuning import run_ragged_m
from dropless.ops.fp8_launch import launch_ragged_m_fp8
from dropless.quantized import get_recipe, operand_recipes

# (M, K, N, group sizes): tail rows past a group of every phase, and no routed row at all.
CASES = {
    "aligned": (96, 64, 48, [20, 0, 45, 21]),  # 10 tail rows
    "zeros": (77, 32, 16, [0, 30, 0, 0, 40, 0]),  # 7 tail rows
    "all_tail": (40, 16, 16, [0, 0]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_leaves_the_tail(case, dtype, triton_backend):
    M, K, N, sizes = CASES[case]
    end = sum(sizes)
    x, w = make_x(M, K, dtype, KERNEL_DEVICE), make_w(len(sizes), K, N, dtype, KERNEL_DEVICE)
    offsets = offsets_of(sizes, KERNEL_DEVICE)
    for tail in (True, False):
        c = poisoned((M, N), dtype, KERNEL_DEVICE)
        run_ragged_m(x, w, offsets, c, tail=tail)
        assert_rows_close(c[:end], oracle_grouped_mm(x, w, sizes)[:end], sizes, dtype, f"tail={tail}")
        assert (c[end:] == 0).all() if tail else c[end:].isnan().all(), f"tail={tail}: rows past the groups"


@pytest.mark.parametrize("recipe", ["rowwise", "block128"])
@pytest.mark.parametrize("case", ["aligned", "all_tail"])
def test_fp8_kernel_leaves_the_tail(case, recipe, triton_backend):
    M, K, N, sizes = CASES[case]
    end = sum(sizes)
    x, w = make_x(M, K, torch.bfloat16, KERNEL_DEVICE), make_w(len(sizes), K, N, torch.bfloat16, KERNEL_DEVICE)
    offsets = offsets_of(sizes, KERNEL_DEVICE)
    act, weights = operand_recipes(get_recipe(recipe))
    xq, wq = dropless.quantize(x, act, 1), dropless.quantize_weight(w, weights)[0]
    outputs = {}
    for tail in (True, False):
        outputs[tail] = poisoned((M, N), torch.bfloat16, KERNEL_DEVICE)
        launch_ragged_m_fp8(xq, wq, offsets, outputs[tail], tail=tail)
    assert torch.isfinite(outputs[True]).all() and (outputs[True][end:] == 0).all()
    assert outputs[False][end:].isnan().all()
    assert torch.equal(outputs[False][:end], outputs[True][:end])


def _product_and_grads(x, w, offsets, tail, **kw):
    x, w = x.detach().requires_grad_(), w.detach().requires_grad_()
    y = dropless.grouped_mm(x, w, offsets, tail=tail, **kw)
    dy = torch.randn_like(y)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    return y, dx, dw, dy


@pytest.mark.parametrize("recipe", [None, "rowwise"])
def test_op_gradients_match_on_the_groups(recipe, backend):
    """Through autograd: y's and x's gradient's routed rows and w's gradient are those of tail=True (the
    same dy); the reference backend writes the zeros either way."""
    name, device = backend
    M, K, N, sizes = CASES["aligned"]
    end = sum(sizes)
    dtype = torch.bfloat16 if recipe else torch.float32
    x, w = make_x(M, K, dtype, device), make_w(len(sizes), K, N, dtype, device)
    offsets = offsets_of(sizes, device)
    kw = {"recipe": recipe} if recipe else {}
    y, dx, dw, dy = _product_and_grads(x, w, offsets, True, **kw)
    x2, w2 = x.detach().requires_grad_(), w.detach().requires_grad_()
    y2 = dropless.grouped_mm(x2, w2, offsets, tail=False, **kw)
    dx2, dw2 = torch.autograd.grad(y2, (x2, w2), dy)
    assert torch.equal(y2[:end], y[:end]) and torch.equal(dx2[:end], dx[:end]) and torch.equal(dw2, dw)
    assert (y[end:] == 0).all() and (dx[end:] == 0).all()


@pytest.mark.parametrize("recipe, fused", [(None, False), (None, True), ("rowwise", True)])
def test_grouped_linear_tail(recipe, fused, triton_backend):
    M, K, N, sizes = CASES["zeros"]
    end = sum(sizes)
    layer = dropless.GroupedLinear(len(sizes), K, N, recipe=recipe, fuse_wgrad_accumulation=fused).to(KERNEL_DEVICE)
    x = make_x(M, K, torch.float32, KERNEL_DEVICE)
    group_sizes = torch.tensor(sizes, device=KERNEL_DEVICE)
    results = []
    for tail in (True, False):
        xi = x.detach().requires_grad_()
        y = layer(xi, group_sizes, tail=tail)
        if fused:
            layer.weight.main_grad.zero_()
        y.backward(torch.ones_like(y) * torch.arange(M, device=KERNEL_DEVICE)[:, None])
        grad_w = (layer.weight.main_grad if fused else layer.weight.grad).clone()
        layer.weight.grad = None
        results.append((y.detach(), xi.grad, grad_w))
    (y, dx, dw), (y2, dx2, dw2) = results
    assert torch.equal(y2[:end], y[:end]) and torch.equal(dx2[:end], dx[:end]) and torch.equal(dw2, dw)


def test_tail_errors_name_the_argument(triton_backend):
    x, w = make_x(8, 4, torch.float32, KERNEL_DEVICE), make_w(2, 4, 3, torch.float32, KERNEL_DEVICE)
    offsets = offsets_of([3, 5], KERNEL_DEVICE)
    with pytest.raises(TypeError, match=r"^tail must be a bool, got int"):
        dropless.grouped_mm(x, w, offsets, tail=0)
    with pytest.raises(ValueError, match=r"^tail=False is for the ragged-M form only"):
        dropless.grouped_mm(x.t(), x, offsets_of([4, 4], KERNEL_DEVICE), tail=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="the Gluon kernels need a Hopper GPU")
@pytest.mark.parametrize("case", ["aligned", "all_tail"])
def test_gluon_kernels_leave_the_tail(case):
    """The warp-specialized Hopper kernels: bf16 and rowwise FP8 asked for by their configs, block128 FP8
    by default."""
    from dropless.kernels.config import GemmConfig
    from dropless.ops.fp8_launch import GLUON_FP8, gluon_ok

    M, K, N, sizes = CASES[case]
    end = sum(sizes)
    device = torch.device("cuda")
    x, w = make_x(M, K, torch.bfloat16, device), make_w(len(sizes), K, N, torch.bfloat16, device)
    offsets = offsets_of(sizes, device)
    quantized = {}
    for name in ("rowwise", "block128"):
        act, weights = operand_recipes(get_recipe(name))
        quantized[name] = dropless.quantize(x, act, 1), dropless.quantize_weight(w, weights)[0]
    gluon = GemmConfig(128, 256, 64, num_warps=8, num_stages=3, gluon=True)
    for tail in (True, False):
        c = poisoned((M, N), torch.bfloat16, device)
        run_ragged_m(x, w, offsets, c, config=gluon, tail=tail)
        assert_rows_close(c[:end], oracle_grouped_mm(x, w, sizes)[:end], sizes, torch.bfloat16, f"bf16 tail={tail}")
        assert (c[end:] == 0).all() if tail else c[end:].isnan().all(), f"bf16 tail={tail}: rows past the groups"
        for name, config in (("rowwise", GLUON_FP8), ("block128", None)):
            xq, wq = quantized[name]
            c8 = poisoned((M, N), torch.bfloat16, device)
            assert gluon_ok(xq, wq, c8, name)
            launch_ragged_m_fp8(xq, wq, offsets, c8, config=config, tail=tail)
            assert (c8[end:] == 0).all() if tail else c8[end:].isnan().all(), f"{name} tail={tail}: rows past the groups"
            assert torch.isfinite(c8[:end]).all()
