"""dropless.nn.MoE against a plain PyTorch MoE: a loop over tokens and their experts, in fp64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import REL_TOL, rel_err

from dropless.nn.moe import MoE
from dropless.ops.routing import route


def _oracle(moe: MoE, x: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
    """The layer written as a loop over tokens and their k experts, on fp64 copies of its weights."""
    r = moe.router
    logits = x @ params["router"].t()
    routing = route(logits, r.top_k, score_func=r.score_func, renormalize=r.renormalize, n_groups=r.n_groups,
                    topk_groups=r.topk_groups, expert_bias=r.expert_bias, scale=r.scale)
    d_ff = params["down"].shape[2]
    rows = []
    for t in range(x.shape[0]):
        out = torch.zeros(x.shape[1], dtype=x.dtype)
        for j in range(r.top_k):
            e = int(routing.expert_ids[t, j])
            h = params["gate_up"][e] @ x[t]
            if "gate_up_bias" in params:
                h = h + params["gate_up_bias"][e]
            a = F.silu(h[:d_ff]) * h[d_ff:]
            o = params["down"][e] @ a
            if "down_bias" in params:
                o = o + params["down_bias"][e]
            out = out + routing.weights[t, j] * o
        rows.append(out)
    y = torch.stack(rows)
    if moe.shared_experts is not None:
        h = x @ params["shared_gate_up"].t()
        y = y + (F.silu(h[:, : h.shape[1] // 2]) * h[:, h.shape[1] // 2:]) @ params["shared_down"].t()
    return y


def _fp64_params(moe: MoE) -> dict[str, torch.Tensor]:
    named = {"router": moe.router.weight, "gate_up": moe.experts_gate_up.weight, "down": moe.experts_down.weight}
    if moe.experts_gate_up.bias is not None:
        named |= {"gate_up_bias": moe.experts_gate_up.bias, "down_bias": moe.experts_down.bias}
    if moe.shared_experts is not None:
        named |= {"shared_gate_up": moe.shared_experts.gate_up.weight, "shared_down": moe.shared_experts.down.weight}
    return {k: v.detach().cpu().double().requires_grad_() for k, v in named.items()}


CASES = {
    "mixtral_like": dict(T=12, d=16, d_ff=24, E=4, k=2),
    "t1": dict(T=1, d=16, d_ff=8, E=4, k=2),
    "k1": dict(T=9, d=8, d_ff=12, E=3, k=1, renormalize=False),
    "k8": dict(T=6, d=8, d_ff=8, E=8, k=8),
    "e1": dict(T=5, d=8, d_ff=8, E=1, k=1),
    "bias_shared": dict(T=10, d=16, d_ff=8, E=4, k=2, bias=True, num_shared_experts=2),
    "sigmoid_groups": dict(T=10, d=16, d_ff=8, E=8, k=2, score_func="sigmoid", n_groups=4, topk_groups=2,
                           routed_scaling=2.5),
}


def _build(case: dict, dtype: torch.dtype, device) -> MoE:
    c = dict(case)
    T, d, d_ff, E, k = (c.pop(n) for n in ("T", "d", "d_ff", "E", "k"))
    return MoE(d, d_ff, E, k, device=device, dtype=dtype, **c)


@pytest.mark.parametrize("name", list(CASES))
def test_moe_matches_loop(backend, name):
    kind, device = backend
    dtype = torch.float64 if kind == "reference" else torch.float32
    case = CASES[name]
    moe = _build(case, dtype, device)
    x = torch.randn(case["T"], case["d"], dtype=dtype, device=device, requires_grad=True)
    y = moe(x)
    params = _fp64_params(moe)
    x64 = x.detach().cpu().double().requires_grad_()
    ref = _oracle(moe, x64, params)
    assert rel_err(y, ref) <= REL_TOL[dtype]
    dy = torch.randn_like(y)
    y.backward(dy)
    ref.backward(dy.detach().cpu().double())
    assert rel_err(x.grad, x64.grad) <= REL_TOL[dtype]
    assert rel_err(moe.experts_gate_up.weight.grad, params["gate_up"].grad) <= REL_TOL[dtype]
    assert rel_err(moe.experts_down.weight.grad, params["down"].grad) <= REL_TOL[dtype]
    assert rel_err(moe.router.weight.grad, params["router"].grad) <= REL_TOL[dtype]
    if moe.shared_experts is not None:
        assert rel_err(moe.shared_experts.gate_up.weight.grad, params["shared_gate_up"].grad) <= REL_TOL[dtype]
        assert rel_err(moe.shared_experts.down.weight.grad, params["shared_down"].grad) <= REL_TOL[dtype]


RECOMPUTE = {"activation": {"recompute_activation": True}, "permute": {"recompute_permute": True},
             "both": {"recompute_activation": True, "recompute_permute": True}}


@pytest.mark.parametrize("recompute", list(RECOMPUTE))
@pytest.mark.parametrize("name", ["mixtral_like", "bias_shared", "k8"])
def test_recompute_keeps_gradients_and_drops_what_it_recomputes(backend, name, recompute, monkeypatch):
    """With recompute_activation / recompute_permute the outputs and gradients are bit for bit those
    without (the per-expert bias sums on the GPU to their rounding), and the activation's output / the
    permuted token copies are no longer alive after the forward (nothing saved them)."""
    import weakref

    from dropless.nn import moe as moe_module

    kind, device = backend
    dtype = torch.float64 if kind == "reference" else torch.float32
    case = CASES[name]
    x = torch.randn(case["T"], case["d"], dtype=dtype, device=device)
    dy = torch.randn(case["T"], case["d"], dtype=dtype, device=device)
    outputs, made = {}, {"activation": [], "permute": []}
    swiglu, gather_copies = moe_module.ACTIVATIONS["swiglu"], moe_module.gather_copies
    monkeypatch.setitem(moe_module.ACTIVATIONS, "swiglu",
                        lambda h, **kw: made["activation"].append(a := swiglu(h, **kw)) or a)
    monkeypatch.setattr(moe_module, "gather_copies",
                        lambda *args: made["permute"].append(r := gather_copies(*args)) or r)
    for options in ({}, RECOMPUTE[recompute]):
        torch.manual_seed(0)
        moe = _build(case | options, dtype, device)
        for made_list in made.values():
            made_list.clear()
        x_in = x.clone().requires_grad_()
        y = moe(x_in)
        alive = {"activation": weakref.ref(made["activation"].pop(0)),
                 "permute": weakref.ref(made["permute"].pop(0))}
        for what, ref in alive.items():
            dropped = options.get(f"recompute_{what}", False)
            assert (ref() is None) == dropped, f"{options}: the {what} output alive after the forward: {not dropped}"
        y.backward(dy)
        outputs[bool(options)] = {"y": y.detach(), "x.grad": x_in.grad} | {
            f"{name}.grad": p.grad for name, p in moe.named_parameters()}
    for name, plain in outputs[False].items():
        recomputed = outputs[True][name]
        if name.endswith("bias.grad") and plain.is_cuda:
            # Summed per expert with atomic adds on the GPU (index_add_), in no fixed order.
            torch.testing.assert_close(recomputed, plain, rtol=1e-6, atol=1e-6, msg=name)
        else:
            assert torch.equal(plain, recomputed), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_recompute_permute_lowers_the_backward_peak_by_the_permuted_copies():
    """On the GPU the step's peak memory falls by most of one [T*k, d] buffer: the recomputed copies and the
    gate/up product's input gradient are never alive together. The peak then sits at another point of the
    backward, a little above the one it left (0.86 of a buffer lower on an H200), hence 0.75."""
    T, d, d_ff, E, k = 4096, 1024, 256, 16, 8
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    peaks = {}
    for recompute in (False, True):
        torch.manual_seed(0)
        moe = MoE(d, d_ff, E, k, recompute_permute=recompute, device="cuda", dtype=torch.bfloat16)
        x_in = x.clone().requires_grad_()
        moe(x_in).sum().backward()  # warm-up: tuning, caches
        moe.zero_grad(set_to_none=True)
        x_in.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        moe(x_in).sum().backward()
        torch.cuda.synchronize()
        peaks[recompute] = torch.cuda.max_memory_allocated() - base
    copies = T * k * d * 2
    assert peaks[False] - peaks[True] >= 0.75 * copies, (peaks, copies)


def test_moe_keeps_shape_and_reports_losses(reference_backend):
    moe = MoE(16, 8, 4, 2, aux_loss_coef=0.1, z_loss_coef=0.01)
    x = torch.randn(2, 3, 16)
    y = moe(x)
    assert y.shape == x.shape
    assert int(moe.tokens_per_expert.sum()) == 2 * 3 * 2
    torch.testing.assert_close(moe.aux_loss, 0.1 * moe.load_balancing_loss + 0.01 * moe.z_loss)


def test_moe_zero_token_experts_and_one_expert_for_all(reference_backend):
    moe = MoE(8, 8, 6, 1, dtype=torch.float64)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[2] = 1.0
    x = torch.rand(7, 8, dtype=torch.float64) + 0.1  # positive: every token scores expert 2 highest
    y = moe(x)
    assert moe.tokens_per_expert.tolist() == [0, 0, 7, 0, 0, 0]
    assert rel_err(y, _oracle(moe, x, _fp64_params(moe))) <= REL_TOL[torch.float64]


def test_moe_expert_bias_update(reference_backend):
    moe = MoE(8, 8, 4, 1, score_func="sigmoid", expert_bias=True, bias_update_rate=0.5)
    moe(torch.randn(16, 8))
    before = moe.router.expert_bias.clone()
    moe.update_expert_bias()
    assert not torch.equal(before, moe.router.expert_bias)


def test_moe_rejects_bad_input(reference_backend):
    with pytest.raises(ValueError, match="activation"):
        MoE(8, 8, 4, 1, activation="relu")
    with pytest.raises(ValueError, match="d_model=8"):
        MoE(8, 8, 4, 1)(torch.randn(3, 7))


@pytest.mark.parametrize("args, kwargs, pattern", [
    ((0, 8, 4, 1), {}, r"^d_model and d_ff must be at least 1, got 0 and 8$"),
    ((8, -2, 4, 1), {}, r"^d_model and d_ff must be at least 1, got 8 and -2$"),
    ((8, 8, 4, 1), {"num_shared_experts": -1}, r"^num_shared_experts must be at least 0 and shared_d_ff"),
    ((8, 8, 4, 1), {"num_shared_experts": 1, "shared_d_ff": 0},
     r"^num_shared_experts must be at least 0 and shared_d_ff"),
])
def test_moe_rejects_bad_sizes_at_construction(args, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        MoE(*args, **kwargs)


@pytest.mark.parametrize("top_k", [0, -1, 5])
def test_moe_rejects_bad_top_k_at_construction(top_k):
    with pytest.raises(ValueError, match=rf"^top_k must be in \[1, num_experts=4\], got {top_k}$"):
        MoE(8, 8, 4, top_k)


def test_expert_parallel_without_a_process_group():
    """``expert_parallel()`` where torch.distributed was never set up names what is missing instead of
    returning the whole layer."""
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="^expert_parallel needs torch.distributed: call "
                                           "torch.distributed.init_process_group first"):
        MoE(16, 8, num_experts=4, top_k=2).expert_parallel()


@pytest.mark.slow
def test_moe_compiles_fullgraph(reference_backend):
    torch._dynamo.reset()
    moe = MoE(16, 8, 4, 2, dtype=torch.float64)
    x = torch.randn(10, 16, dtype=torch.float64)
    compiled = torch.compile(moe, fullgraph=True)
    torch.testing.assert_close(compiled(x), moe(x))


def _gpu_moe(recipe: str | None = None) -> MoE:
    return MoE(256, 128, 16, 4, num_shared_experts=1, recipe=recipe, device="cuda", dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", [None, "rowwise", "block128"])
def test_moe_forward_backward_without_host_sync(recipe):
    moe = _gpu_moe(recipe)
    x = torch.randn(1024, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    moe(x).float().square().mean().backward()  # warm-up: autotuning syncs on its first call
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = moe(x)
        (y.float().square().mean() + moe.aux_loss).backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert bool(torch.isfinite(x.grad).all())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe", [None, "rowwise", "block128"])
def test_moe_cuda_graph_replays_new_routing(recipe):
    """The step captured whole (the FP8 layer's gradient copies handed between its kernels at capture)
    gives eager's results on new routing."""
    moe = _gpu_moe(recipe)
    static_x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up and autotuning outside the capture
            moe(static_x).float().square().mean().backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    moe.zero_grad(set_to_none=False)
    static_x.grad = None
    with torch.cuda.graph(graph):
        static_y = moe(static_x)
        static_y.float().square().mean().backward()
    static_counts = moe.tokens_per_expert  # the graph's output; an eager forward rebinds the attribute
    for seed in (1, 2):
        torch.manual_seed(seed)
        fresh = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16) * (1 + seed)
        with torch.no_grad():
            static_x.copy_(fresh)
        moe.zero_grad(set_to_none=False)
        static_x.grad.zero_()
        graph.replay()
        counts = static_counts.clone()
        x = fresh.clone().requires_grad_()
        moe.zero_grad(set_to_none=False)
        y = moe(x)
        assert torch.equal(counts, moe.tokens_per_expert)
        assert rel_err(static_y, y) <= REL_TOL[torch.bfloat16]
        y.float().square().mean().backward()
        assert rel_err(static_x.grad, x.grad) <= REL_TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moe_compiles_fullgraph_on_gpu():
    torch._dynamo.reset()
    moe = _gpu_moe()
    x = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    eager = moe(x)
    compiled = torch.compile(moe, fullgraph=True)(x)
    assert rel_err(compiled, eager) <= REL_TOL[torch.bfloat16]
