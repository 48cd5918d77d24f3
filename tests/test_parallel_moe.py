"""The expert-parallel MoE layer on 2 and 4 CPU processes over gloo (and on 2 and 4 GPUs over NCCL, fp64 on
the reference backend there too): ``MoE.expert_parallel(group)`` gives,
on each rank's tokens, the full layer's outputs and input gradients; its experts' weight gradients
equal the full layer's for those experts (every rank's tokens contributing); the replicated router's
and shared experts' gradients, summed over the ranks, equal the full layer's on all the tokens."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from multiprocess import rank_device, run_ranks

import dropless


def _layer(seed: int, E: int, shared: bool) -> dropless.MoE:
    torch.manual_seed(seed)
    return dropless.MoE(16, 8, num_experts=E, top_k=2, num_shared_experts=1 if shared else 0,
                        aux_loss_coef=0.0, dtype=torch.float64)


def _worker(rank, world, tokens, E, shared, seed):
    device = rank_device()
    dropless.set_backend("reference")  # fp64 on GPUs too: the kernels take 16- and 32-bit floats
    full = _layer(seed, E, shared).to(device)
    ep = full.expert_parallel()
    assert ep.local_experts == E // world and ep.first_expert == rank * (E // world)
    gen = torch.Generator().manual_seed(seed + 1)
    x_all = torch.randn(sum(tokens), 16, generator=gen, dtype=torch.float64).to(device)
    g_all = torch.randn(sum(tokens), 16, generator=gen, dtype=torch.float64).to(device)
    lo = sum(tokens[:rank])
    mine = slice(lo, lo + tokens[rank])

    x_full = x_all.clone().requires_grad_()
    (full(x_full) * g_all).sum().backward()
    x = x_all[mine].clone().requires_grad_()
    y = ep(x)
    (y * g_all[mine]).sum().backward()

    torch.testing.assert_close(y, full(x_all)[mine].detach(), msg=f"rank {rank}: y")
    torch.testing.assert_close(x.grad, x_full.grad[mine], msg=f"rank {rank}: grad x")
    experts = slice(ep.first_expert, ep.first_expert + ep.local_experts)
    for name in ("experts_gate_up", "experts_down"):
        torch.testing.assert_close(getattr(ep, name).weight.grad, getattr(full, name).weight.grad[experts],
                                   msg=f"rank {rank}: {name}")
    replicated = [("router", ep.router.weight, full.router.weight)]
    if shared:
        replicated += [("shared gate_up", ep.shared_experts.gate_up.weight, full.shared_experts.gate_up.weight),
                       ("shared down", ep.shared_experts.down.weight, full.shared_experts.down.weight)]
    for name, mine_p, full_p in replicated:
        summed = mine_p.grad.clone()
        dist.all_reduce(summed)
        torch.testing.assert_close(summed, full_p.grad, msg=f"rank {rank}: {name} summed over ranks")


def _bad_group_worker(rank, world):
    with pytest.raises(ValueError, match="num_experts"):
        dropless.MoE(16, 8, num_experts=3, top_k=2, ep_group=dist.group.WORLD)
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


@pytest.mark.gpu
@pytest.mark.parametrize("world, tokens, E, shared", [
    (2, [9, 14], 4, True),
    (2, [0, 11], 4, False),
    (4, [6, 3, 0, 10], 8, True),
], ids=["2-gpus-shared", "2-gpus-empty-rank", "4-gpus"])
def test_expert_parallel_layer_matches_the_full_layer_over_nccl(world, tokens, E, shared):
    run_ranks(world, _worker, tokens, E, shared, 0, backend="nccl")


def test_expert_parallel_bad_group():
    run_ranks(2, _bad_group_worker)


def _fp8_worker(rank, world, recipe):
    """An FP8 layer's EP version: token rows travel in FP8; outputs as the full FP8 layer's (the same FP8
    values: a row's quantization along d does not depend on where it goes), expert gradients within FP8
    noise of its (the weight gradient re-quantizes the received values along the tokens)."""
    torch.manual_seed(0)
    full = dropless.MoE(16, 8, num_experts=4, top_k=2, aux_loss_coef=0.0, recipe=recipe)
    ep = full.expert_parallel()
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
