"""FP8 grouped GEMMs through the public ops: forward, dgrad and wgrad against the fp64 product of the
dequantized operands (tight) and against BF16 (SQNR), main_grad accumulation, operands given already
quantized, the weight cache of GroupedLinear, the MoE layer, and bad input.

Runs on the reference backend and on the Triton kernels (the interpreter on the CPU, the real kernels
on a GPU), with the hard group sizes of the BF16 tests.
"""

from __future__ import annotations

import math

import pytest
import torch

import dropless
from dropless import reference
from dropless.ops import grouped_mm_fp8
from dropless.ops.grouped_mm_fp8 import resolve_recipe, swap_weight
from dropless.quantized import operand_recipes

from conftest import KERNEL_DEVICE

RECIPES = ["rowwise", "block128", "mxfp8"]
# group sizes over M rows: zeros, one giant group, sizes not divisible by any tile, rows past the end.
SIZES = {
    "zeros": ([0, 37, 0, 90, 5], 140),
    "giant": ([0, 201, 0], 201),
    "ragged": ([13, 1, 70, 33], 130),
}
TIGHT = 1e-5  # the FP8 products of exactly-represented operands, fp32 accumulation, fp32 output


def _tight(device: torch.device, recipe: str) -> float:
    """TIGHT on the CPU. Hopper's FP8 tensor cores accumulate a step's products in less than fp32 (2e-3 over
    a whole rowwise reduction in their fast mode, 5e-4 where every block is promoted into fp32), as the
    kernel tests allow (test_fp8_kernels)."""
    if device.type != "cuda":
        return TIGHT
    return 2e-3 if recipe == "rowwise" else 5e-4


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return (torch.linalg.vector_norm(out.double() - ref) / torch.linalg.vector_norm(ref).clamp(min=1e-300)).item()


@pytest.fixture(params=["reference", "triton"])
def device(request) -> torch.device:
    """The device of the backend under test: the reference on the CPU, the Triton kernels on the GPU
    (or under the interpreter on the CPU)."""
    dropless.set_backend(request.param)
    return KERNEL_DEVICE if request.param == "triton" else torch.device("cpu")


def _problem(sizes: list[int], M: int, K: int, N: int, device: torch.device, dtype=torch.float32):
    E = len(sizes)
    x = torch.randn(M, K, device=device, dtype=dtype)
    w = (torch.randn(E, K, N, device=device, dtype=dtype) * K ** -0.5)
    dy = torch.randn(M, N, device=device, dtype=dtype)
    offsets = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    # Rows past the last group: anything at all, even NaN, must not reach any result.
    if M > sum(sizes):
        x[sum(sizes):] = float("nan")
        dy[sum(sizes):] = float("nan")
    return x, w, dy, offsets


def _dq(q) -> torch.Tensor:
    return q.dequantize(torch.float64)


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("case", list(SIZES))
def test_forward_and_backward_match_the_dequantized_product(device, recipe, case):
    sizes, M = SIZES[case]
    K, N = 64 + 32, 48 + 16
    x, w, dy, offsets = _problem(sizes, M + 3, K, N, device)
    act, weights = operand_recipes(resolve_recipe(recipe))
    x_leaf = x.clone().requires_grad_()
    w_leaf = w.clone().requires_grad_()
    y = dropless.grouped_mm(x_leaf, w_leaf, offsets, recipe=recipe)
    dx, dw = torch.autograd.grad(y, (x_leaf, w_leaf), dy)

    wk, wn = dropless.quantize_weight(w, weights)
    y_ref = reference.grouped_mm(_dq(dropless.quantize(x, act, dim=1)), _dq(wk), offsets)
    dx_ref = reference.grouped_mm(_dq(dropless.quantize(dy, act, dim=1)), _dq(swap_weight(wn)), offsets)
    dw_ref = reference.grouped_mm_wgrad(_dq(dropless.quantize(x, act, dim=0, offsets=offsets)),
                                        _dq(dropless.quantize(dy, act, dim=0, offsets=offsets)), offsets)
    routed = sum(sizes)
    assert y.dtype == x.dtype and dx.dtype == x.dtype and dw.dtype == w.dtype
    assert torch.isfinite(y).all() and torch.isfinite(dx).all() and torch.isfinite(dw).all()
    tight = _tight(x.device, recipe)
    assert _rel(y[:routed], y_ref[:routed]) < tight
    assert _rel(dx[:routed], dx_ref[:routed]) < tight
    assert _rel(dw, dw_ref) < tight
    assert (y[routed:] == 0).all() and (dx[routed:] == 0).all()
    for e, size in enumerate(sizes):
        if size == 0:
            assert (dw[e] == 0).all()


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_is_close_to_bf16(device, recipe):
    """SQNR of each FP8 product against the fp32 product of the same operands: at least 28 dB on random
    data (e4m3's 3-bit mantissa gives about 31 dB with well-chosen scales)."""
    sizes, M = [40, 0, 150, 66], 256
    x, w, dy, offsets = _problem(sizes, M, 128, 96, device)
    x_leaf, w_leaf = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = dropless.grouped_mm(x_leaf, w_leaf, offsets, recipe=recipe)
    dx, dw = torch.autograd.grad(y, (x_leaf, w_leaf), dy)
    refs = (reference.grouped_mm(x.double(), w.double(), offsets),
            reference.grouped_mm(dy.double(), w.double().transpose(1, 2), offsets),
            reference.grouped_mm_wgrad(x.double(), dy.double(), offsets))
    for name, out, ref in zip(("y", "dx", "dw"), (y, dx, dw), refs):
        sqnr = -20 * math.log10(_rel(out, ref))
        assert sqnr >= 28, f"{name}: SQNR {sqnr:.1f} dB"


@pytest.mark.parametrize("recipe", RECIPES)
def test_operands_already_quantized(device, recipe):
    sizes, M = [30, 0, 61], 100
    x, w, _, offsets = _problem(sizes, M, 64, 32, device)
    act, weights = operand_recipes(resolve_recipe(recipe))
    xq = dropless.quantize(x, act, dim=1)
    wk, wn = dropless.quantize_weight(w, weights)
    y = dropless.grouped_mm(xq, wk, offsets)  # the recipe comes from the operands
    assert y.dtype == torch.bfloat16
    y_ref = reference.grouped_mm(_dq(xq), _dq(wk), offsets)
    assert _rel(y[:91].float(), y_ref[:91]) < 1e-2  # bf16 output
    # The same product from the plain operands with the weight pair passed in.
    y2 = dropless.grouped_mm(x, w, offsets, recipe=recipe, w_quantized=(wk, wn))
    assert _rel(y2[:91], y_ref[:91]) < _tight(x.device, recipe)


@pytest.mark.parametrize("recipe", RECIPES)
def test_wgrad_accumulates_into_main_grad_with_a_mask(device, recipe):
    sizes, M = [25, 0, 70, 9], 110
    x, _, dy, offsets = _problem(sizes, M, 64, 48, device)
    E = len(sizes)
    main_grad = torch.randn(E, 48, 64, device=device).transpose(1, 2)  # [E, K, N] view of [E, N, K]
    before = main_grad.clone()
    flags = torch.tensor([True, True, False, False], device=device)
    dropless.grouped_mm_wgrad(x, dy, offsets, out=main_grad, accumulate=flags, recipe=recipe)
    act, _ = operand_recipes(resolve_recipe(recipe))
    dw = reference.grouped_mm_wgrad(_dq(dropless.quantize(x, act, dim=0, offsets=offsets)),
                                    _dq(dropless.quantize(dy, act, dim=0, offsets=offsets)), offsets)
    expected = torch.where(flags.view(-1, 1, 1), before.double() + dw, dw)
    assert _rel(main_grad, expected) < _tight(x.device, recipe)


def test_column_chunks_bound_the_copy_of_dy():
    assert grouped_mm_fp8.column_chunks(2048, 1536) == [(0, 1536)]
    assert grouped_mm_fp8.column_chunks(768, 2048) == [(0, 2048)]
    assert grouped_mm_fp8.column_chunks(4096, 14336) == [(0, 14336)]
    assert grouped_mm_fp8.column_chunks(4096, 28672) == [(n, n + 4096) for n in range(0, 28672, 4096)]
    assert grouped_mm_fp8.column_chunks(2000, 9000) == [(n, min(n + 1920, 9000)) for n in range(0, 9000, 1920)]
    assert grouped_mm_fp8.column_chunks(32, 160) == [(0, 128), (128, 160)]
    assert grouped_mm_fp8.column_chunks(200, 0) == []


@pytest.mark.parametrize("recipe, into", [("rowwise", "w_nk"), ("block128", "main_grad"), ("mxfp8", "w_kn")])
def test_weight_gradient_by_column_runs(device, recipe, into):
    """N > 4 K: the backward quantizes dy a run of columns at a time (``column_chunks``); the weight gradient
    is still the product of x and dy each quantized whole, in every layout it is written to."""
    sizes, M = [0, 37, 0, 50, 5], 96
    K, N = 32, 160
    x, w, dy, offsets = _problem(sizes, M, K, N, device)
    E = len(sizes)
    act, _ = operand_recipes(resolve_recipe(recipe))
    dw_ref = reference.grouped_mm_wgrad(_dq(dropless.quantize(x, act, dim=0, offsets=offsets)),
                                        _dq(dropless.quantize(dy, act, dim=0, offsets=offsets)), offsets)
    flags = torch.tensor([True, False, True, True, False], device=device)
    if into == "main_grad":
        layer = dropless.GroupedLinear(E, K, N, recipe=recipe, device=device, fuse_wgrad_accumulation=True)
        before = torch.randn(E, N, K, device=device)
        layer.weight.main_grad.copy_(before)
        layer(x, torch.tensor(sizes, device=device), wgrad_accumulation_mask=flags).backward(dy)
        dw = layer.weight.main_grad.transpose(1, 2)
        expected = torch.where(flags.view(-1, 1, 1), before.transpose(1, 2).double() + dw_ref, dw_ref)
    else:
        w_leaf = (w.transpose(1, 2).contiguous().transpose(1, 2) if into == "w_nk" else w).requires_grad_()
        y = dropless.grouped_mm(x, w_leaf, offsets, recipe=recipe)
        (dw,) = torch.autograd.grad(y, (w_leaf,), dy)
        assert dw.stride() == w_leaf.stride()
        expected = dw_ref
    assert _rel(dw, expected) < _tight(x.device, recipe)


def test_grouped_linear_reuses_the_weight_quantization(device, monkeypatch):
    calls = []
    original = grouped_mm_fp8.quantize_weight

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr("dropless.nn.grouped_linear.quantize_weight", counting)
    layer = dropless.GroupedLinear(3, 64, 32, recipe="rowwise", device=device)
    sizes = torch.tensor([20, 0, 40], device=device)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    for _ in range(2):  # two micro-batches: one quantization
        x = torch.randn(60, 64, device=device, requires_grad=True)
        layer(x, sizes).square().sum().backward()
    assert len(calls) == 1
    optimizer.step()  # the weight changes: quantized again on the next forward, once
    layer(torch.randn(60, 64, device=device), sizes)
    layer(torch.randn(60, 64, device=device), sizes)
    assert len(calls) == 2
    assert layer.weight.grad is not None and torch.isfinite(layer.weight.grad).all()


@pytest.mark.parametrize("recipe", RECIPES)
def test_grouped_linear_main_grad_matches_weight_grad(device, recipe):
    sizes = torch.tensor([33, 0, 47], device=device)
    plain = dropless.GroupedLinear(3, 64, 32, recipe=recipe, device=device)
    fused = dropless.GroupedLinear(3, 64, 32, recipe=recipe, device=device, fuse_wgrad_accumulation=True)
    with torch.no_grad():
        fused.weight.copy_(plain.weight)
    x = torch.randn(80, 64, device=device)
    for _ in range(2):
        plain(x, sizes).square().sum().backward()
        fused(x, sizes).square().sum().backward()
    assert fused.weight.grad is None
    assert _rel(fused.weight.main_grad, plain.weight.grad) < _tight(x.device, recipe)


@pytest.mark.parametrize("recipe", RECIPES)
def test_moe_layer_trains_in_fp8(device, recipe):
    torch.manual_seed(0)
    moe = dropless.MoE(64, 32, num_experts=4, top_k=2, device=device)
    moe8 = dropless.MoE(64, 32, num_experts=4, top_k=2, recipe=recipe, device=device)
    moe8.load_state_dict(moe.state_dict())
    x = torch.randn(2, 24, 64, device=device)
    y, y8 = moe(x), moe8(x)
    # Two FP8 GEMMs in series (gate/up, then down on the activation): each adds its ~3.5% error.
    assert -20 * math.log10(_rel(y8, y)) >= 20
    y8.square().mean().backward()
    for p in moe8.parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all()


def test_bad_input_names_the_argument():
    x = torch.randn(16, 32)
    w = torch.randn(2, 32, 16)
    offsets = torch.tensor([8, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="recipe"):
        dropless.grouped_mm(x, w, offsets, recipe="fp4")
    with pytest.raises(ValueError, match="recipe"):
        dropless.grouped_mm(x, w, offsets, recipe="block128x128")  # a weight recipe, not a GEMM recipe
    with pytest.raises(TypeError, match="x"):
        dropless.grouped_mm(x.double(), w, offsets, recipe="rowwise")
    with pytest.raises(ValueError, match="w must have shape"):
        dropless.grouped_mm(x, torch.randn(2, 16, 16), offsets, recipe="rowwise")
    with pytest.raises(ValueError, match="w_quantized needs recipe"):
        dropless.grouped_mm(x, w, offsets, w_quantized=dropless.quantize_weight(w, "rowwise"))
    with pytest.raises(TypeError, match="w_quantized"):
        dropless.grouped_mm(x, w, offsets, recipe="rowwise", w_quantized=w)
    wk, wn = dropless.quantize_weight(w, "rowwise")
    with pytest.raises(ValueError, match=r"w_quantized\[0\]"):
        dropless.grouped_mm(x, w, offsets, recipe="rowwise", w_quantized=(wn, wk))
    with pytest.raises(ValueError, match="x was quantized with recipe 'mxfp8'"):
        dropless.grouped_mm(dropless.quantize(x, "mxfp8"), wk, offsets, recipe="rowwise")
    xq = dropless.quantize(x, "rowwise")
    not_fp8 = dropless.QuantizedTensor(xq.data.to(torch.bfloat16), xq.scale, xq.recipe, xq.dim)
    with pytest.raises((TypeError, ValueError), match="x"):
        dropless.grouped_mm(not_fp8, wk, offsets)
    wrong_scale = dropless.QuantizedTensor(xq.data, xq.scale[:8], xq.recipe, xq.dim)
    with pytest.raises(ValueError, match="x"):
        dropless.grouped_mm(wrong_scale, wk, offsets)
    with pytest.raises(ValueError, match="quantized along the tokens"):
        dropless.grouped_mm_wgrad(xq, torch.randn(16, 16), offsets)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_needs_fp8_tensor_cores(monkeypatch):
    monkeypatch.setattr("dropless.ops.grouped_mm_fp8._capability", lambda device: (8, 0))  # an sm_80 GPU
    x = torch.randn(16, 32, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2, 32, 16, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="FP8 tensor cores"):
        dropless.grouped_mm(x, w, torch.tensor([8, 16], device="cuda", dtype=torch.int32), recipe="rowwise")


@pytest.mark.slow
def test_compile_fullgraph():
    """torch.compile traces the FP8 forward and backward (quantization and products are custom ops with
    fake implementations) and gives the eager result."""
    torch._dynamo.reset()
    dropless.set_backend("reference")
    sizes, M = [20, 0, 37], 64
    x, w, dy, offsets = _problem(sizes, M, 64, 32, torch.device("cpu"))

    def step(x, w):
        y = dropless.grouped_mm(x, w, offsets, recipe="rowwise")
        return (y * dy).sum()

    compiled = torch.compile(step, fullgraph=True)
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    compiled(x1, w1).backward()
    step(x2, w2).backward()
    assert _rel(x1.grad[:57], x2.grad[:57]) < 1e-6
    assert _rel(w1.grad, w2.grad) < 1e-6


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@GPU
def test_column_runs_hold_one_copy_of_dy_at_a_time():
    """The weight gradient by column runs frees each run's FP8 copy of dy before quantizing the next: its
    peak above the call's start is one run's copy, not two."""
    E, M, K, N = 4, 4096, 256, 2048
    x, _, dy, offsets = _problem([1000, 0, 2500, 596], M, K, N, torch.device("cuda"), torch.bfloat16)
    recipe = resolve_recipe("rowwise")
    act, _ = operand_recipes(recipe)
    xt = dropless.quantize(x, act, dim=0, offsets=offsets, tail=False)
    out = torch.full((E, K, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    runs = grouped_mm_fp8.column_chunks(K, N)
    assert len(runs) == N // K
    run_bytes = dropless.quantize(dy[:, :K], act, dim=0, offsets=offsets, tail=False).data.numel()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    grouped_mm_fp8.wgrad_by_columns(xt, dy, offsets, recipe, out, None, False, runs)
    torch.cuda.synchronize()
    assert run_bytes <= torch.cuda.max_memory_allocated() - start < 1.5 * run_bytes
    assert torch.isfinite(out).all()  # every expert's gradient written, the empty one's too


@pytest.mark.gpu
@GPU
@pytest.mark.parametrize("recipe", RECIPES)
def test_no_host_sync_and_cuda_graph_replay(recipe):
    """A GroupedLinear step in FP8 (weight cache, quantization, the three products, main_grad) runs with
    host syncs forbidden, and a CUDA graph of it replays right with new group sizes and new weights."""
    E, K, N, M = 8, 512, 768, 2048
    layer = dropless.GroupedLinear(E, K, N, recipe=recipe, device="cuda", dtype=torch.bfloat16,
                                   fuse_wgrad_accumulation=True)
    sizes = torch.tensor([300, 0, 511, 17, 700, 1, 0, 400], device="cuda")
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    layer(x, sizes).backward(dy)  # warm-up: compilation
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer(x, sizes).backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode(0)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer(x, sizes).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    x.grad = None
    with torch.cuda.graph(graph):
        y = layer(x, sizes)
        y.backward(dy)
    for new_sizes in ([0, 1000, 0, 0, 48, 900, 100, 0], [256] * 8):
        sizes.copy_(torch.tensor(new_sizes))
        with torch.no_grad():
            layer.weight.add_(0.01 * torch.randn_like(layer.weight))  # the graph requantizes every replay
            x.copy_(torch.randn_like(x))
        layer.weight.main_grad.zero_()
        graph.replay()
        torch.cuda.synchronize()
        offsets = sizes.cumsum(0).to(torch.int32)
        ref = dropless.grouped_mm(x.detach(), layer.weight.detach().transpose(1, 2), offsets, recipe=recipe)
        assert _rel(y.float(), ref.float()) < 1e-2, new_sizes
        expected = dropless.grouped_mm_wgrad(x.detach(), dy, offsets, recipe=recipe).float()
        assert _rel(layer.weight.main_grad.transpose(1, 2), expected) < 1e-2, new_sizes
