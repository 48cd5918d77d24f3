"""The two paths of every op: eager calls on plain tensors run the implementation without the
dispatcher (``ops.direct``); traced, fake or subclassed calls go through the ``torch.library`` custom
op. Both must give the same values and gradients, and each must be taken where it should be."""

from __future__ import annotations

import importlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dropless
from dropless.ops.direct import is_plain_call
from dropless.ops.permute import sort_by_expert
from tests.conftest import offsets_of, random_group_sizes


def _grad_fn_name(t: torch.Tensor) -> str:
    return type(t.grad_fn).__name__


class _Tagged(torch.Tensor):
    """A tensor subclass that changes nothing, standing for any user subclass."""


def test_plain_call_conditions():
    x = torch.randn(3, 4)
    assert is_plain_call((x, torch.nn.Parameter(torch.randn(2)), 3, "silu", None))
    assert not is_plain_call((x.as_subclass(_Tagged),))
    with FakeTensorMode():
        assert not is_plain_call((torch.empty(3, 4),))
    seen = []

    @torch.compile(backend="eager", fullgraph=True)
    def traced(t):
        seen.append(is_plain_call((t,)))
        return t + 1

    torch._dynamo.reset()
    traced(x)
    assert seen == [False]


@pytest.mark.parametrize("wgrad_layout", ["nk", "kn"])
def test_grouped_mm_direct_matches_custom_op(backend, wgrad_layout):
    """Values and both gradients of the eager path equal those of the custom op, bit for bit (the
    same implementation runs on both); the eager graph node is the direct one."""
    name, device = backend
    dtype = torch.float32 if name == "triton" else torch.float64
    sizes = random_group_sizes(4, 37) + [0]
    M, K, N = sum(sizes) + 3, 12, 10  # three rows past the last offset
    offsets = offsets_of(sizes, device)
    x = torch.randn(M, K, dtype=dtype, device=device, requires_grad=True)
    stored = torch.randn(5, N, K, dtype=dtype, device=device) if wgrad_layout == "nk" else \
        torch.randn(5, K, N, dtype=dtype, device=device)
    stored.requires_grad_()
    w = stored.transpose(1, 2) if wgrad_layout == "nk" else stored
    dy = torch.randn(M, N, dtype=dtype, device=device)

    y_direct = dropless.grouped_mm(x, w, offsets)
    assert _grad_fn_name(y_direct).startswith("Direct_dropless_grouped_mm")
    dx_direct, dw_direct = torch.autograd.grad(y_direct, (x, stored), dy)
    y_op = torch.ops.dropless.grouped_mm(x, w, offsets)
    assert not _grad_fn_name(y_op).startswith("Direct_")
    dx_op, dw_op = torch.autograd.grad(y_op, (x, stored), dy)
    for name, a, b in (("y", y_direct, y_op), ("dx", dx_direct, dx_op), ("dw", dw_direct, dw_op)):
        assert torch.equal(a, b), name
    assert dw_direct.stride() == stored.stride()
    assert torch.count_nonzero(y_direct[-3:]) == 0 and torch.count_nonzero(dx_direct[-3:]) == 0


@pytest.mark.parametrize("op", ["grouped_mm_ragged_k", "grouped_mm_ragged_n"])
def test_ragged_forms_direct_match_custom_ops(backend, op):
    """The ragged-K and ragged-N forms of dropless.grouped_mm: values and gradients of the eager path
    equal those of their custom ops, bit for bit."""
    name, device = backend
    dtype = torch.float32 if name == "triton" else torch.float64
    sizes = random_group_sizes(3, 20)
    offsets = offsets_of(sizes, device)
    split = sum(sizes) + 2  # two past the last offset
    shapes = ((7, split), (split, 5)) if op == "grouped_mm_ragged_k" else ((3, 7, 5), (5, split))
    a, b = (torch.randn(shape, dtype=dtype, device=device, requires_grad=True) for shape in shapes)
    y_direct = dropless.grouped_mm(a, b, offsets)
    assert _grad_fn_name(y_direct).startswith(f"Direct_dropless_{op}")
    y_op = getattr(torch.ops.dropless, op)(a, b, offsets)
    assert not _grad_fn_name(y_op).startswith("Direct_")
    dy = torch.randn_like(y_direct)
    assert torch.equal(y_direct, y_op)
    for what, g_direct, g_op in zip(("da", "db"), torch.autograd.grad(y_direct, (a, b), dy),
                                    torch.autograd.grad(y_op, (a, b), dy)):
        assert torch.equal(g_direct, g_op), what


def test_grouped_mm_without_grad_runs_no_graph(reference_backend):
    x = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 4, 3, dtype=torch.float64)
    with torch.no_grad():
        y = dropless.grouped_mm(x, w, offsets_of([4, 5]))
    assert y.grad_fn is None and not y.requires_grad


def test_fake_tensors_take_the_custom_op():
    """Under FakeTensorMode nothing runs: the custom op's fake implementation gives the shape."""
    with FakeTensorMode():
        x = torch.empty(64, 16, dtype=torch.bfloat16, device="cuda")
        w = torch.empty(4, 16, 8, dtype=torch.bfloat16, device="cuda")
        offsets = torch.empty(4, dtype=torch.int32, device="cuda")
        y = dropless.grouped_mm(x, w, offsets)
        dw = dropless.grouped_mm_wgrad(x, torch.empty(64, 8, dtype=torch.bfloat16, device="cuda"), offsets)
    assert y.shape == (64, 8) and y.device.type == "cuda"
    assert dw.shape == (4, 16, 8)


def test_subclass_takes_the_custom_op(reference_backend):
    sizes = [3, 0, 6]
    x = torch.randn(9, 4, dtype=torch.float64).as_subclass(_Tagged).requires_grad_()
    w = torch.randn(3, 4, 5, dtype=torch.float64)
    y = dropless.grouped_mm(x, w, offsets_of(sizes))
    assert not _grad_fn_name(y).startswith("Direct_")
    ref = torch.cat([x.detach()[:3] @ w[0], x.detach()[3:9] @ w[2]])
    torch.testing.assert_close(torch.Tensor(y.detach()), torch.Tensor(ref))


@pytest.mark.parametrize("grad_in_place", [False, True])
def test_swiglu_and_permute_direct_match_custom_ops(backend, grad_in_place):
    name, device = backend
    dtype = torch.float32 if name == "triton" else torch.float64
    T, k, d, E = 11, 2, 6, 3
    x = torch.randn(T, d, dtype=dtype, device=device, requires_grad=True)
    topk_ids = torch.randint(0, E + 1, (T, k), device=device)  # E: a sentinel, sent to no expert
    weights = torch.rand(T, k, dtype=dtype, device=device, requires_grad=True)

    slots, _, offsets = sort_by_expert(topk_ids, E)

    def layer(gather, glu, unpermute):
        x_sorted = gather(x, slots, offsets, k)
        h = torch.cat([x_sorted, x_sorted.flip(1)], dim=1)
        # No FP8 copies of the gradients: (quantize_grad, grad_pow2) and (grad_recipe, pow2, mx_rounding).
        return unpermute(glu(h, "silu", grad_in_place, None, False, False), slots, weights, offsets, T, None, False,
                         "floor")

    permute_ops, activation_ops = (importlib.import_module(f"dropless.ops.{name}") for name in ("permute", "activation"))
    y_direct = layer(permute_ops._GATHER, activation_ops._GLU, permute_ops._UNPERMUTE)
    assert _grad_fn_name(y_direct).startswith("Direct_dropless_unpermute")
    y_op = layer(torch.ops.dropless.gather_copies, torch.ops.dropless.glu, torch.ops.dropless.unpermute)
    dy = torch.randn_like(y_direct)
    grads_direct = torch.autograd.grad(y_direct, (x, weights), dy)
    grads_op = torch.autograd.grad(y_op, (x, weights), dy)
    assert torch.equal(y_direct, y_op)
    for a, b in zip(grads_direct, grads_op):
        assert torch.equal(a, b)
