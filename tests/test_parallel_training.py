"""Expert parallelism with data parallelism (``dropless.parallel.expert_data_parallel``, DDP, and
``expert_fully_shard``, FSDP2) on 2 and 4 CPU processes over gloo: after a backward of each rank's loss on its own tokens, every parameter's gradient
is that of the mean of all ranks' losses in one process (the whole model there), for EP over the whole
world and for EP groups of 2 ranks in a world of 4 (experts also reduced over the ranks that hold them)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from multiprocess import run_ranks
from torch import nn

import dropless
from dropless.parallel import expert_data_parallel, expert_fully_shard


def _model(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 16, dtype=torch.float64),
                         dropless.MoE(16, 8, num_experts=4, top_k=2, num_shared_experts=1, aux_loss_coef=0.0,
                                      dtype=torch.float64))


def _worker(rank, world, ep_size, tokens, micro_batches, wrapper):
    groups = [dist.new_group(list(range(start, start + ep_size))) for start in range(0, world, ep_size)]
    ep_group = groups[rank // ep_size]
    full = _model(0)
    local = _model(0)
    local[1] = full[1].expert_parallel(ep_group)
    ddp = expert_data_parallel(local) if wrapper == "ddp" else expert_fully_shard(local)
    gen = torch.Generator().manual_seed(1)
    data = [[(torch.randn(t, 16, generator=gen, dtype=torch.float64), torch.randn(t, 16, generator=gen,
              dtype=torch.float64)) for t in tokens] for _ in range(micro_batches)]
    for batch in data:
        x, g = batch[rank]
        (ddp(x) * g).sum().backward()
        sum((full(x_r) * g_r).sum() for x_r, g_r in batch).div(world).backward()

    moe, full_moe = local[1], full[1]
    experts = slice(moe.first_expert, moe.first_expert + moe.local_experts)
    pairs = [("linear", local[0].weight, full[0].weight.grad),
             ("router", moe.router.weight, full_moe.router.weight.grad),
             ("shared", moe.shared_experts.gate_up.weight, full_moe.shared_experts.gate_up.weight.grad)]
    pairs += [(name, getattr(moe, name).weight, getattr(full_moe, name).weight.grad[experts])
              for name in ("experts_gate_up", "experts_down")]
    for name, mine, expected in pairs:
        grad = mine.grad.full_tensor() if hasattr(mine.grad, "full_tensor") else mine.grad  # FSDP2: sharded
        torch.testing.assert_close(grad, expected, msg=f"rank {rank}: {name}")


@pytest.mark.parametrize("world, ep_size, tokens, micro_batches", [
    (2, 2, [9, 14], 1),
    (2, 2, [0, 11], 2),  # a rank with no tokens; two micro-batches accumulated
    (4, 2, [6, 3, 5, 10], 2),  # EP groups {0, 1} and {2, 3}: experts also reduced over {0, 2} and {1, 3}
], ids=["ep2", "ep2-accumulate", "ep2-of-4"])
@pytest.mark.parametrize("wrapper", ["ddp", "fsdp2"])
def test_gradients_are_those_of_the_mean_loss(world, ep_size, tokens, micro_batches, wrapper):
    run_ranks(world, _worker, ep_size, tokens, micro_batches, wrapper)
