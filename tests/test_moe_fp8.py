"""The FP8 MoE layer's fused activation: the gated activation writes its output in FP8 along d_ff and
the down projection's forward reads that copy (``GroupedLinear(x_quantized=...)``) instead of
quantizing again.

Both are checked for the same bits as the unfused path: GroupedLinear with and without the copy, and
MoE against the same layer run piece by piece with the activation unfused; on the reference backend
and on the Triton kernels (the interpreter on the CPU). Then the copy's checks, and torch.compile.
"""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE

import dropless
from dropless.nn.moe import ACTIVATIONS, MoE
from dropless.ops import grouped_mm_fp8
from dropless.ops.permute import permute, unpermute
from dropless.quantized import QuantizedTensor

RECIPES = ["rowwise", "block128", "mxfp8"]
# d_ff = 80: a multiple of neither 32 nor 128, so the copy's last block along d_ff is partial.
D_MODEL, D_FF, E, TOP_K = 64, 80, 4, 2
CONFIGS = {
    "swiglu": {},
    "geglu-bias-main-grad": {"activation": "geglu", "bias": True, "fuse_wgrad_accumulation": True},
}


@pytest.fixture(params=["reference", "triton"])
def device(request) -> torch.device:
    dropless.set_backend(request.param)
    return KERNEL_DEVICE if request.param == "triton" else torch.device("cpu")


def bits(t: torch.Tensor) -> torch.Tensor:
    """A float tensor as integers of its width: equal bits, NaN included."""
    return t.detach().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_same_bits(out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, what
    bad = bits(out) != bits(ref)
    assert not bad.any(), f"{what}: {int(bad.sum())} of {bad.numel()} elements differ"


# ---------------------------------------------------------------------------------------------------
# GroupedLinear with x_quantized


def _layer_pair(recipe: str, device: torch.device, **kwargs) -> tuple[dropless.GroupedLinear, dropless.GroupedLinear]:
    first = dropless.GroupedLinear(3, D_FF, 48, recipe=recipe, device=device, **kwargs)
    second = dropless.GroupedLinear(3, D_FF, 48, recipe=recipe, device=device, **kwargs)
    second.load_state_dict(first.state_dict())
    return first, second


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_linear_with_x_quantized_gives_the_same_bits(device, recipe, dtype):
    plain, given = _layer_pair(recipe, device, bias=True)
    sizes = torch.tensor([33, 0, 60], device=device)
    x = torch.randn(100, D_FF, device=device, dtype=dtype)  # 7 rows past the last group
    dy = torch.randn(100, 48, device=device, dtype=dtype)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y1 = plain.to(dtype)(x1, sizes)
    y2 = given.to(dtype)(x2, sizes, x_quantized=dropless.quantize(x, given.recipe, dim=-1))
    assert_same_bits(y2, y1, "y")
    y1.backward(dy)
    y2.backward(dy)
    assert_same_bits(x2.grad, x1.grad, "dx")
    assert_same_bits(given.weight.grad, plain.weight.grad, "dw")
    # The bias gradient sums each group's rows with index_add_, in whatever order a GPU's atomics take.
    torch.testing.assert_close(given.bias.grad, plain.bias.grad, rtol=1e-5, atol=1e-5)


def test_grouped_linear_skips_quantizing_x_along_k(device, monkeypatch):
    """With x_quantized the forward quantizes x only along the tokens (for the weight gradient); without,
    along K for its product and then along the tokens, neither past the last group (tail=False)."""
    calls = []
    original = grouped_mm_fp8.quantize

    def recording(x, recipe, dim=-1, offsets=None, **kwargs):
        calls.append((dim, offsets is not None and not kwargs.get("tail", True)))
        return original(x, recipe, dim, offsets, **kwargs)

    monkeypatch.setattr(grouped_mm_fp8, "quantize", recording)
    layer = dropless.GroupedLinear(2, D_FF, 32, recipe="block128", device=device)
    x = torch.randn(40, D_FF, device=device)
    layer(x, [10, 30], x_quantized=dropless.quantize(x, layer.recipe, dim=-1))
    assert calls == [(0, True)]
    calls.clear()
    layer(x, [10, 30])
    assert calls == [(1, True), (0, True)]


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_linear_gather_gives_the_permuted_rows_bits(device, recipe):
    """``gather=(sorted_to_token_slot, k)`` on the tokens: the bits of the layer on permute's rows, forward
    and backward (the tokens' gradient summing their copies as permute's backward does), with an expert
    that gets no rows, while the permuted rows in x's dtype are never made."""
    plain, gathered = _layer_pair(recipe, device, bias=True)
    T, k = 37, 2
    ids = torch.randint(0, 3, (T, k), device=device)
    ids[:, 0] = torch.where(ids[:, 0] == 1, 0, ids[:, 0])
    ids[:, 1] = torch.where(ids[:, 1] == 1, 2, ids[:, 1])  # expert 1 gets no rows
    x = torch.randn(T, D_FF, device=device, dtype=torch.bfloat16)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    x_sorted, slots, sizes, _ = permute(x1, ids, 3)
    y1 = plain.to(torch.bfloat16)(x_sorted, sizes)
    y2 = gathered.to(torch.bfloat16)(x2, sizes, gather=(slots, k))
    assert_same_bits(y2, y1, "y")
    dy = torch.randn_like(y1)
    y1.backward(dy)
    y2.backward(dy)
    assert_same_bits(x2.grad, x1.grad, "dx")
    assert_same_bits(gathered.weight.grad, plain.weight.grad, "dw")
    assert_same_bits(gathered.bias.grad, plain.bias.grad, "dbias")


def test_gather_errors_name_the_argument():
    dropless.set_backend("reference")
    layer = dropless.GroupedLinear(2, D_FF, 32, recipe="rowwise")
    x = torch.randn(10, D_FF)
    slots = torch.arange(20, dtype=torch.int32)
    layer(x, [12, 8], gather=(slots, 2))
    cases = [
        (dict(gather=(slots, 2), x_quantized=dropless.quantize(x, "rowwise", dim=-1)), ValueError,
         r"^gather and x_quantized"),
        (dict(gather=(slots[:19], 2)), ValueError, r"^gather's sorted_to_token_slot must be an int32/int64 \[T\*top_k\]"),
        (dict(gather=(slots.float(), 2)), ValueError, r"^gather's sorted_to_token_slot"),
        (dict(gather=(slots, 0)), TypeError, r"^gather must be \(sorted_to_token_slot, top_k\)"),
        (dict(gather=slots), TypeError, r"^gather must be"),
    ]
    for kwargs, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            layer(x, [12, 8], **kwargs)
    with pytest.raises(ValueError, match=r"^group_sizes sum to 21, more than the M=20 rows"):
        layer(x, [13, 8], gather=(slots, 2))
    with pytest.raises(ValueError, match=r"^gather needs a layer with a recipe"):
        dropless.GroupedLinear(2, D_FF, 32)(x, [12, 8], gather=(slots, 2))


def test_x_quantized_errors_name_the_argument():
    dropless.set_backend("reference")
    layer = dropless.GroupedLinear(2, D_FF, 32, recipe="mxfp8")  # resolved to rceil scales, as GEMMs take it
    sizes = [10, 30]
    x = torch.randn(40, D_FF)
    xq = dropless.quantize(x, layer.recipe, dim=-1)
    layer(x, sizes, x_quantized=xq)  # the matching copy is accepted
    cases = [
        (dropless.quantize(x, "mxfp8", dim=-1), ValueError, r"^x_quantized was quantized with .*'floor'.*'rceil'"),
        (dropless.quantize(x, "rowwise", dim=-1), ValueError, r"^x_quantized was quantized with .*'rowwise'"),
        (dropless.quantize(x[:39], layer.recipe, dim=-1), ValueError, r"^x_quantized must have x's shape \(40, 80\)"),
        (dropless.quantize(x, layer.recipe, dim=0), ValueError, r"^x_quantized must be quantized along dim 1"),
        (dropless.quantize(x, layer.recipe, dim=0, offsets=torch.tensor([10, 40], dtype=torch.int32)), ValueError,
         r"^x_quantized must be quantized along dim 1"),
        (dropless.quantize(x[None], layer.recipe, dim=-1), ValueError, r"^x_quantized must have 2 dimensions"),
        (QuantizedTensor(xq.data.float(), xq.scale, xq.recipe, 1), TypeError, r"^x_quantized\.data must be float8"),
        (QuantizedTensor(xq.data, xq.scale[:, :2], xq.recipe, 1), ValueError, r"^x_quantized\.scale must have shape"),
        (x, TypeError, r"^x_quantized must be a dropless\.QuantizedTensor"),
    ]
    for bad, error, pattern in cases:
        with pytest.raises(error, match=pattern):
            layer(x, sizes, x_quantized=bad)
    with pytest.raises(ValueError, match=r"^x_quantized needs a layer with a recipe"):
        dropless.GroupedLinear(2, D_FF, 32)(x, sizes, x_quantized=xq)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match=r"^x_quantized: autocast casts x from torch\.float32 to torch\.bfloat16"):
            layer(x, sizes, x_quantized=xq)
        layer(x.bfloat16(), sizes, x_quantized=dropless.quantize(x.bfloat16(), layer.recipe, dim=-1))


# ---------------------------------------------------------------------------------------------------
# MoE: the fused activation gives the unfused layer's bits


def _unfused_forward(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """``moe(x)`` piece by piece, the activation without a recipe and the down projection quantizing
    its input itself: the layer as it ran before the fusion."""
    tokens = x.reshape(-1, moe.d_model)
    routing = moe.router(tokens)
    x_sorted, sorted_to_token_slot, group_sizes, offsets = permute(tokens, routing.expert_ids, moe.num_experts)
    h = moe.experts_gate_up(x_sorted, group_sizes)
    out_sorted = moe.experts_down(ACTIVATIONS[moe.activation](h), group_sizes)
    y = unpermute(out_sorted, sorted_to_token_slot, routing.weights, offsets)
    return y.reshape(x.shape)


def _gradients(moe: MoE) -> dict[str, torch.Tensor]:
    grads = {name: p.grad for name, p in moe.named_parameters() if p.grad is not None}
    for name in ("experts_gate_up", "experts_down"):
        main_grad = getattr(getattr(moe, name).weight, "main_grad", None)
        if main_grad is not None:
            grads[f"{name}.weight.main_grad"] = main_grad
    return grads


# Each recipe once, each config at least once (every pair ran ~6 s under the interpreter).
@pytest.mark.parametrize("recipe, config", [("rowwise", "swiglu"), ("block128", "geglu-bias-main-grad"),
                                            ("mxfp8", "geglu-bias-main-grad")])
def test_moe_fused_activation_gives_the_unfused_bits(device, recipe, config, monkeypatch):
    torch.manual_seed(0)
    fused = MoE(D_MODEL, D_FF, E, TOP_K, recipe=recipe, device=device, dtype=torch.bfloat16, **CONFIGS[config])
    unfused = MoE(D_MODEL, D_FF, E, TOP_K, recipe=recipe, device=device, dtype=torch.bfloat16, **CONFIGS[config])
    unfused.load_state_dict(fused.state_dict())
    x = torch.randn(2, 23, D_MODEL, device=device, dtype=torch.bfloat16)
    dy = torch.randn_like(x)

    along_k = []
    original = grouped_mm_fp8.quantize

    def recording(t, recipe, dim=-1, offsets=None, **kwargs):
        if dim == 1:
            along_k.append(t.shape[1])
        return original(t, recipe, dim, offsets, **kwargs)

    monkeypatch.setattr(grouped_mm_fp8, "quantize", recording)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    # The fused layer's products quantize nothing along K: the tokens' copies come from the permute
    # kernel, the activation's from the activation kernel; backward, the down projection's output
    # gradient from unpermute's kernel and, rowwise, dh from the activation's backward kernel.
    y1 = fused(x1)
    assert along_k == [], "a product of the fused layer quantized its input again"
    y2 = _unfused_forward(unfused, x2)
    assert along_k == [D_MODEL, D_FF]
    assert_same_bits(y1, y2, "y")
    along_k.clear()
    (y1 * dy).sum().backward()
    assert along_k == ([] if recipe == "rowwise" else [2 * D_FF]), "a product quantized its fused gradient again"
    along_k.clear()
    (y2 * dy).sum().backward()
    assert sorted(along_k) == [D_MODEL, 2 * D_FF]
    # The routing weights' gradient (dot products of dy with the expert outputs) comes from the permute
    # kernel in both layers, but compiled with the FP8 copy in the fused one: a GPU may sum the dot
    # products in another order there. What follows from it (the router's gradients, and dx through
    # the router) is compared to that rounding; everything else bit for bit. The router's weight gradient
    # sums tokens' terms that cancel: its elements are compared to a thousandth of its largest.
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-2, atol=1e-6)
    grads, expected = _gradients(fused), _gradients(unfused)
    assert grads.keys() == expected.keys() and len(grads) >= 3
    for name, grad in grads.items():
        if name.startswith("router."):
            torch.testing.assert_close(grad, expected[name], rtol=1e-2, atol=1e-3 * float(expected[name].abs().max()))
        else:
            assert_same_bits(grad, expected[name], name)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["rowwise", "mxfp8"])
def test_moe_fp8_compiles_fullgraph(recipe, reference_backend):
    """torch.compile traces the FP8 layer's forward and backward, the fused activation included, and
    gives the eager result (to bf16 rounding: the compiled router may round differently)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    moe = MoE(32, 48, 4, 2, recipe=recipe, dtype=torch.bfloat16)
    x = torch.randn(19, 32, dtype=torch.bfloat16)
    dy = torch.randn_like(x)

    def step(x):
        return (moe(x) * dy).sum()

    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    loss = torch.compile(step, fullgraph=True)(x1)
    loss.backward()
    compiled_grads = {name: p.grad.clone() for name, p in moe.named_parameters()}
    moe.zero_grad(set_to_none=True)
    loss_eager = step(x2)
    loss_eager.backward()
    assert torch.allclose(loss, loss_eager, rtol=1e-2)
    assert torch.allclose(x1.grad.float(), x2.grad.float(), rtol=1e-2, atol=1e-2)
    for name, p in moe.named_parameters():
        assert torch.allclose(compiled_grads[name].float(), p.grad.float(), rtol=1e-2, atol=1e-2), name
