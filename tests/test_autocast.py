"""Under torch.autocast: grouped GEMM operands cast as nn.Linear's are, the router stays in fp32."""

from __future__ import annotations

import pytest
import torch
from conftest import REL_TOL, make_w, offsets_of, oracle_grouped_mm, random_group_sizes, rel_err

from dropless.nn.grouped_linear import GroupedLinear
from dropless.nn.moe import MoE
from dropless.ops.grouped_mm import grouped_mm
from dropless.ops.router_logits import router_logits


def _autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=torch.bfloat16)


def test_grouped_mm_casts_to_the_autocast_dtype(backend):
    _, device = backend
    sizes = random_group_sizes(4, 37)
    x = torch.randn(40, 24, device=device, requires_grad=True)
    w = make_w(4, 24, 20, torch.float32, device).requires_grad_()
    with _autocast(device):
        y = grouped_mm(x, w, offsets_of(sizes, device))
    assert y.dtype == torch.bfloat16
    ref = oracle_grouped_mm(x.bfloat16(), w.bfloat16(), sizes)
    assert rel_err(y, ref) <= REL_TOL[torch.bfloat16]
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    assert bool(torch.isfinite(w.grad).all())


def test_grouped_linear_fused_wgrad_under_autocast(backend):
    _, device = backend
    sizes = random_group_sizes(3, 29)
    layer = GroupedLinear(3, 16, 12, fuse_wgrad_accumulation=True, device=device)
    x = torch.randn(32, 16, device=device)
    with _autocast(device):
        y = layer(x, torch.tensor(sizes))
    assert y.dtype == torch.bfloat16
    dy = torch.randn_like(y)
    y.backward(dy)
    offsets = offsets_of(sizes)
    expected = torch.zeros(3, 12, 16, dtype=torch.float64)
    for e in range(3):
        s, t = (int(offsets[e - 1]) if e else 0), int(offsets[e])
        expected[e] = dy[s:t].double().cpu().t() @ x[s:t].bfloat16().double().cpu()
    assert layer.weight.main_grad.dtype == torch.float32
    assert rel_err(layer.weight.main_grad, expected) <= REL_TOL[torch.bfloat16]


def test_router_stays_fp32_under_autocast(backend):
    _, device = backend
    x = torch.randn(30, 16, device=device)
    w = torch.randn(8, 16, device=device, requires_grad=True)
    with _autocast(device):
        logits = router_logits(x, w)
    assert logits.dtype == torch.float32
    assert rel_err(logits, x.double().cpu() @ w.detach().double().cpu().t()) <= REL_TOL[torch.float32]


def test_moe_under_autocast_routes_as_in_fp32_and_trains_fp32_weights(backend):
    _, device = backend
    moe = MoE(16, 12, 6, 2, num_shared_experts=1, device=device)
    x = torch.randn(20, 16, device=device)
    moe(x)
    fp32_counts = moe.tokens_per_expert.clone()
    with _autocast(device):
        y = moe(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(moe.tokens_per_expert, fp32_counts)
    y.float().square().mean().backward()
    for name, p in moe.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert bool(torch.isfinite(p.grad).all()), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_router_logits_match_fp64(dtype):
    x = torch.randn(1000, 256, device="cuda", dtype=dtype, requires_grad=True)
    w = (torch.randn(64, 256, device="cuda", dtype=dtype) * 0.1).requires_grad_()
    logits = router_logits(x, w)
    assert logits.dtype == torch.float32
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = x64 @ w64.t()
    assert rel_err(logits, ref) <= 1e-6  # exact products, fp32 sums
    grad = torch.randn_like(logits)
    logits.backward(grad)
    ref.backward(grad.double())
    # The gradients are rounded once to the operands' dtype, not twice (the low part of grad counts).
    assert rel_err(x.grad, x64.grad) <= 2 * torch.finfo(dtype).eps
    assert rel_err(w.grad, w64.grad) <= 2 * torch.finfo(dtype).eps
