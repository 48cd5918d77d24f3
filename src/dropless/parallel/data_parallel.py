"""Data parallelism for models with expert-parallel MoE layers: DDP (or FSDP2's ``fully_shard``) for what
every rank holds, the experts' gradients reduced over the ranks that hold the same experts.

A rank of an expert-parallel layer holds E/P experts of its EP group (P ranks) and a replica of
everything else (router, shared experts, the rest of the model). ``combine``'s backward already brings
every rank of the EP group its share of each token's gradient, so an expert's gradient sums the losses
of its EP group's ranks. DDP averages the replicated parameters' gradients over the world; the experts'
are summed over the ranks that hold the same experts (the same place in their EP groups: ranks
r, r + P, ... when the world is split into EP groups of P consecutive ranks, none when P is the world)
and divided by the world's size, which makes every gradient that of the mean of all ranks' losses.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def _expert_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from dropless.nn.moe import MoE

    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoE) and m.ep_group is not None]


def _replica_group(ep_group: dist.ProcessGroup) -> dist.ProcessGroup | None:
    """The ranks that hold the same experts as this one (the same place in their EP groups). Every rank
    creates every such group, in the same order, as ``new_group`` asks."""
    world = dist.get_world_size()
    # An object gather runs on any backend (NCCL takes no CPU tensors); once, when the model is wrapped.
    places: list[int] = [0] * world
    dist.all_gather_object(places, dist.get_rank(ep_group))
    mine = None
    for p in sorted(set(places)):
        ranks = [r for r, q in enumerate(places) if q == p]
        group = dist.new_group(ranks) if len(ranks) > 1 else None
        if p == places[dist.get_rank()]:
            mine = group
    return mine


def expert_data_parallel(model: nn.Module, **ddp_options: Any) -> DistributedDataParallel:
    """``model`` wrapped in DDP over the world, its expert-parallel experts left out of DDP's reduction
    and reduced as the module docstring says (a hook per expert parameter, on each backward's gradient,
    so accumulating micro-batches works as with DDP itself).

    Args:
        model: a module holding ``dropless.MoE`` layers built with an ``ep_group`` (or by
            ``MoE.expert_parallel``), on every rank of the world.
        ddp_options: passed to ``DistributedDataParallel`` (``device_ids`` on GPUs).
    Returns:
        The DDP-wrapped model. Call it as the model; step the optimizer as usual.
    """
    experts = _reduce_experts_apart(model)
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, list(experts))
    return DistributedDataParallel(model, **ddp_options)


def expert_fully_shard(model: nn.Module, **fsdp_options: Any) -> nn.Module:
    """``fully_shard(model)`` (FSDP2) over the world for every parameter but the expert-parallel experts,
    which are left whole on their ranks and reduced as the module docstring says. Shard submodules
    first (``fully_shard`` on each block, with ``ignored_params`` naming the experts) for finer-grained
    gathers; this call shards the rest.

    Args:
        model: as ``expert_data_parallel``'s.
        fsdp_options: passed to ``fully_shard`` (``mesh``, ``mp_policy``, ...), except ``ignored_params``.
    Returns:
        ``model``, sharded in place.
    """
    from torch.distributed.fsdp import fully_shard

    experts = _reduce_experts_apart(model)
    return fully_shard(model, ignored_params=set(experts.values()), **fsdp_options)


def _reduce_experts_apart(model: nn.Module) -> dict[str, nn.Parameter]:
    """Hook each expert-parallel expert parameter's gradient (summed over its replicas, divided by the
    world's size); returns them by their name in ``model``."""
    world = dist.get_world_size()
    experts: dict[str, nn.Parameter] = {}
    for name, layer in _expert_layers(model):
        if layer.experts_gate_up.fuse_wgrad_accumulation:
            raise ValueError(f"model.{name}: expert_data_parallel reduces the experts' .grad; build the layer "
                             "without fuse_wgrad_accumulation")
        replicas = _replica_group(layer.ep_group)
        for param_name, param in [*layer.experts_gate_up.named_parameters(prefix="experts_gate_up"),
                                  *layer.experts_down.named_parameters(prefix="experts_down")]:
            experts[f"{name}.{param_name}" if name else param_name] = param
            param.register_hook(_reduce_expert_grad(replicas, world))
    return experts


def _reduce_expert_grad(replicas: dist.ProcessGroup | None, world: int):
    """A hook on each backward's gradient before it accumulates into ``.grad`` (so micro-batches add up
    right): summed over the replicas, divided by the world's size."""
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        if replicas is not None:
            dist.all_reduce(grad, group=replicas)
        return grad.div_(world)
    return hook
