"""Expert parallelism in ``dropless train --ep N``: the EP groups, the model's experts sharded over them,
the checkpoint's full tensors gathered from (and sliced back to) the shards, and the gradient norm over
all of a model's experts.

The world is split into groups of N consecutive ranks; rank r keeps experts ``(r mod N) * E/N`` onwards
of every MoE layer. Checkpoints hold the full model and optimizer state whatever N is, so a run saved
at one EP size resumes at another.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dropless.nn.moe import MoE
from dropless.train.errors import TrainError

_EXPERTS = ("experts_gate_up", "experts_down")


def ep_group(ep: int, world_size: int, num_experts: int) -> dist.ProcessGroup:
    """This rank's group of ``ep`` consecutive ranks (every rank creates every group, as ``new_group``
    asks); TrainError if ``ep`` does not divide the world or the experts."""
    if world_size % ep or num_experts % ep:
        raise TrainError(f"--ep {ep} must divide the number of processes ({world_size}) and of experts "
                         f"({num_experts})")
    groups = [dist.new_group(list(range(start, start + ep))) for start in range(0, world_size, ep)]
    return groups[dist.get_rank() // ep]


def shard_experts(model: nn.Module, group: dist.ProcessGroup, backend: str = "nccl") -> None:
    """Replace every MoE layer of ``model`` by its expert-parallel version over ``group`` (its copies moved
    by ``backend``), in place."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, MoE) and child.ep_group is None:
                setattr(module, child_name, child.expert_parallel(group, backend=backend))


def expert_parameters(model: nn.Module) -> dict[str, tuple[nn.Parameter, MoE]]:
    """The expert-parallel layers' expert parameters by name, each with its layer."""
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, MoE) and module.ep_group is not None:
            for part in _EXPERTS:
                for param_name, param in getattr(module, part).named_parameters(prefix=f"{name}.{part}"):
                    found[param_name] = (param, module)
    return found


def _gather(shard: torch.Tensor, layer: MoE) -> torch.Tensor:
    pieces = [torch.empty_like(shard) for _ in range(dist.get_world_size(layer.ep_group))]
    dist.all_gather(pieces, shard.contiguous(), group=layer.ep_group)
    return torch.cat(pieces)


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """``(model state dict, optimizer state dict)`` with every expert tensor gathered whole from its EP
    group (a collective: every rank calls it)."""
    experts = expert_parameters(model)
    model_state = model.state_dict()
    for name, (param, layer) in experts.items():
        model_state[name] = _gather(param.detach(), layer)
    optimizer_state = optimizer.state_dict()
    index_of = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    for param, layer in experts.values():
        state = optimizer_state["state"].get(index_of[id(param)], {})
        for key, value in state.items():
            if value.dim() > 0:
                state[key] = _gather(value, layer)
    return model_state, optimizer_state


def slice_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> dict:
    """A full optimizer state (``optimizer.state_dict()`` form) cut to this rank's experts."""
    index_of = {id(p): i for i, p in enumerate(p for g in optimizer.param_groups for p in g["params"])}
    for param, layer in expert_parameters(model).values():
        first, count = layer.first_expert, layer.local_experts
        for key, value in state["state"].get(index_of[id(param)], {}).items():
            if value.dim() > 0:
                state["state"][index_of[id(param)]][key] = value[first:first + count]
    return state


def clip_grad_norm(model: nn.Module, max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` over the whole model, the experts of every EP rank included: each EP group
    sums its ranks' expert gradient norms, so every replica scales by the same factor."""
    experts = expert_parameters(model)
    expert_ids = {id(p) for p, _ in experts.values()}
    grads = [p.grad for p in model.parameters() if p.grad is not None and id(p) not in expert_ids]
    expert_grads = [p.grad for p, _ in experts.values() if p.grad is not None]
    device = next(model.parameters()).device
    replicated = sum((g.float().square().sum() for g in grads), torch.zeros((), device=device))
    sharded = sum((g.float().square().sum() for g in expert_grads), torch.zeros((), device=device))
    if experts:
        dist.all_reduce(sharded, group=next(iter(experts.values()))[1].ep_group)
    total = (replicated + sharded).sqrt()
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads + expert_grads:
        g.mul_(scale.to(g.dtype))
    return total
