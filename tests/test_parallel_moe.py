"""The expert-parallel MoE layer on 2 and 4 CPU processes over gloo (and on 2 and 4 GPUs over NCCL, fp64 on
the reference backend there too): ``MoE.expert_parallel(group)`` gives,
on each rank's tokens, the full layer's outputs and input gradients; its experts' weight gradients
equal the full layer's for those experts (every rank's tokens contributing); the replicated router's
and shared experts' gradients, summed over the ranks, equal the full layer's on all the tokens."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from conftest import CPU_KERNELS
from multiprocess import rank_device, run_ranks

import dropless


def _layer(seed: int, E: int, shared: bool, dtype: torch.dtype = torch.float64) -> dropless.MoE:
    torch.manual_seed(seed)
    return dropless.MoE(16, 8, num_experts=E, top_k=2, num_shared_experts=1 if shared else 0,
                        aux_loss_coef=0.0, dtype=dtype)


def _worker(rank, world, tokens, E, shared, seed, ep_backend="nccl"):
    """fp64 with "nccl"; fp32 with "symmetric_memory" (its rows' widest dtype), at fp32's tolerance."""
    device = rank_device()
    dropless.set_backend("reference")  # fp64 on GPUs too: the kernels take 16- and 32-bit floats
    dtype = torch.float64 if ep_backend == "nccl" else torch.float32
    tol = {} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    full = _layer(seed, E, shared, dtype).to(device)
    ep = full.expert_parallel(backend=ep_backend, max_tokens=max(tokens))
    assert ep.local_experts == E // world and ep.first_expert == rank * (E // world)
    gen = torch.Generator().manual_seed(seed + 1)
    x_all = torch.randn(sum(tokens), 16, generator=gen, dtype=torch.float64).to(device, dtype)
    g_all = torch.randn(sum(tokens), 16, generator=gen, dtype=torch.float64).to(device, dtype)
    lo = sum(tokens[:rank])
    mine = slice(lo, lo + tokens[rank])

    x_full = x_all.clone().requires_grad_()
    (full(x_full) * g_all).sum().backward()
    x = x_all[mine].clone().requires_grad_()
    y = ep(x)
    (y * g_all[mine]).sum().backward()

    torch.testing.assert_close(y, full(x_all)[mine].detach(), msg=f"rank {rank}: y", **tol)
    torch.testing.assert_close(x.grad, x_full.grad[mine], msg=f"rank {rank}: grad x", **tol)
    experts = slice(ep.first_expert, ep.first_expert + ep.local_experts)
    for name in ("experts_gate_up", "experts_down"):
        torch.testing.assert_close(getattr(ep, name).weight.grad, getattr(full, name).weight.grad[experts],
                                   msg=f"rank {rank}: {name}", **tol)
    replicated = [("router", ep.router.weight, full.router.weight)]
    if shared:
        replicated += [("shared gate_up", ep.shared_experts.gate_up.weight, full.shared_experts.gate_up.weight),
                       ("shared down", ep.shared_experts.down.weight, full.shared_experts.down.weight)]
    for name, mine_p, full_p in replicated:
        summed = mine_p.grad.clone()
        dist.all_reduce(summed)
        torch.testing.assert_close(summed, full_p.grad, msg=f"rank {rank}: {name} summed over ranks", **tol)


def _bad_group_worker(rank, world):
    with pytest.raises(ValueError, match="num_experts"):
        dropless.MoE(16, 8, num_experts=3, top_k=2, ep_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="ep_backend"):
        dropless.MoE(16, 8, num_experts=4, top_k=2, ep_group=dist.group.WORLD, ep_backend="nvshmem")
    ep = _layer(0, 4, False).expert_parallel()
    with pytest.raises(ValueError, match="already expert-parallel"):
        ep.expert_parallel()


@pytest.mark.parametrize("world, tokens, E, shared", [
    (2, [9, 14], 4, True),
    (2, [0, 11], 4, False),  # a rank with no tokens
    (4, [6, 3, 0, 10], 8, True),
], ids=["2-ranks-shared", "2-ranks-empty-rank", "4-ranks"])
def test_expert_parallel_layer_matches_the_full_layer(world, tokens, E, shared):
    run_ranks(world, _worker, tokens, E, shared, 0)


@pytest.mark.parametrize("world, tokens, E, shared", [
    (2, [9, 14], 4, True),
    (4, [6, 3, 0, 10], 8, False),
], ids=["2-ranks-shared", "4-ranks"])
@CPU_KERNELS
def test_symmetric_memory_layer_matches_the_full_layer(world, tokens, E, shared):
    run_ranks(world, _worker, tokens, E, shared, 0, "symmetric_memory")


@pytest.mark.gpu
@pytest.mark.parametrize("world, tokens, E, shared", [
    (2, [9, 14], 4, True),
    (2, [0, 11], 4, False),
    (4, [6, 3, 0, 10], 8, True),
], ids=["2-gpus-shared", "2-gpus-empty-rank", "4-gpus"])
def test_expert_parallel_layer_matches_the_full_layer_over_nccl(world, tokens, E, shared):
    run_ranks(world, _worker, tokens, E, shared, 0, backend="nccl")


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_symmetric_memory_layer_matches_the_full_layer_on_gpus(world):
    run_ranks(world, _worker, [6, 3, 0, 10][:world], 8, True, 0, "symmetric_memory", backend="nccl")


def test_expert_parallel_bad_group():
    run_ranks(2, _bad_group_worker)


def _fp8_worker(rank, world, recipe, backend="nccl"):
    """An FP8 layer's EP version: token rows travel in FP8; outputs as the full FP8 layer's (the same FP8
    values: a row's quantization along d does not depend on where it goes), expert gradients within FP8
    noise of its (the weight gradient re-quantizes the received values along the tokens)."""
    torch.manual_seed(0)
    full = dropless.MoE(16, 8, num_experts=4, top_k=2, aux_loss_coef=0.0, recipe=recipe)
    ep = full.expert_parallel(backend=backend, max_tokens=12)
    gen = torch.Generator().manual_seed(1)
    tokens = [12, 7]
    x_all = torch.randn(sum(tokens), 16, generator=gen)
    g_all = torch.randn(sum(tokens), 16, generator=gen)
    mine = slice(sum(tokens[:rank]), sum(tokens[:rank + 1]))
    (full(x_all) * g_all).sum().backward()
    x = x_all[mine].clone().requires_grad_()
    y = ep(x)
    (y * g_all[mine]).sum().backward()
    torch.testing.assert_close(y, full(x_all)[mine].detach(), msg=f"rank {rank}: y")
    experts = slice(ep.first_expert, ep.first_expert + ep.local_experts)
    for name in ("experts_gate_up", "experts_down"):
        got, want = getattr(ep, name).weight.grad, getattr(full, name).weight.grad[experts]
        assert (got - want).norm() <= 0.1 * want.norm(), f"rank {rank}: {name}"


@pytest.mark.parametrize("recipe", ["rowwise", "block128", "mxfp8"])
def test_fp8_rows_travel_quantized(recipe):
    run_ranks(2, _fp8_worker, recipe)


@CPU_KERNELS
def test_fp8_rows_travel_quantized_through_symmetric_memory():
    run_ranks(2, _fp8_worker, "rowwise", "symmetric_memory")


def _graph_worker(rank, world):
    """The symmetric-memory EP layer's forward and backward: no host sync in an eager step (after the first,
    which makes the buffers), then captured in one CUDA graph and replayed with new tokens (new routing)
    on every rank, each replay's outputs and gradients those of an eager step on the same tokens."""
    device = rank_device()
    torch.manual_seed(0)
    layer = dropless.MoE(64, 32, num_experts=8, top_k=2, num_shared_experts=1, aux_loss_coef=0.0,
                         device=device, dtype=torch.bfloat16).expert_parallel(backend="symmetric_memory")
    params = list(layer.parameters())
    gen = torch.Generator(device=device).manual_seed(rank)

    def draw():
        return torch.randn(40, 64, device=device, dtype=torch.bfloat16, generator=gen)

    x, g = draw().requires_grad_(), draw()

    def step(inp):
        y = layer(inp)
        y.backward(g)
        return y

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(x)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.set_sync_debug_mode("error")
    step(x)
    torch.cuda.set_sync_debug_mode(0)
    for p in params:
        p.grad = None
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = step(x)
    grads_static = [p.grad for p in params] + [x.grad]
    for _ in range(2):
        with torch.no_grad():
            x.copy_(draw())
            g.copy_(draw())
        graph.replay()
        got = [y_static.clone()] + [t.clone() for t in grads_static]
        for p in params:
            p.grad = None
        x_eager = x.detach().clone().requires_grad_()
        want = [step(x_eager).detach()] + [p.grad for p in params] + [x_eager.grad]
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, msg=f"rank {rank}: replay against eager")
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_symmetric_memory_layer_captured_in_a_cuda_graph(world):
    run_ranks(world, _graph_worker, backend="nccl")
