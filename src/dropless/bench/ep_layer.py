"""The expert-parallel layer benchmark's configs and layers: ``dropless.MoE`` over an EP group of P ranks,
and the same per-GPU work on one GPU with no communication (the weak-scaling reference).

On every rank, for each recipe (BF16, FP8 rowwise), two layers share one set of weights:

- ``dropless_ep``: ``MoE(d, d_ff, E, k, ep_group=<all ranks>)``: this rank's E/P experts, the router and
  the shared expert replicated; T tokens per rank, each routed to k of all E experts, copies dispatched
  to their experts' ranks and combined back (``dropless.parallel``, backend "nccl");
  ``dropless_ep_symmetric_memory``: the same with ``ep_backend="symmetric_memory"`` (no host sync).
- ``dropless_one_gpu``: ``MoE(d, d_ff, E/P, k)`` with no group, holding the same E/P experts (the same
  tensors), router and shared expert: the same T tokens, each routed to k of its E/P experts, all
  local. Each GPU then runs ``T * k`` token copies through E/P experts, as a rank of the EP layer does on
  average, with the same router and shared-expert work: the EP layer's per-GPU work without the exchange.
- ``dropless_ep_symmetric_memory_graph`` and ``dropless_one_gpu_graph`` (GPUs): the same steps captured in
  a CUDA graph each and replayed, as a training step captured whole runs them; the host's Python and
  launches (the eager exchange's dozens of small operations) drop out of both. An FP8 layer captured in a
  graph quantizes its weights inside it (``QuantizedWeightCache``: replays must see the optimizer's
  updates), so its graph rows pay the weights' quantization every step, as a step of one micro-batch does;
  its eager rows reuse the cached copies.

Routing: the routers' choice of experts is replaced by a draw (``DrawnRouter``) so that it is random and
seeded per rank, and the same rule in both layers: each token's k distinct experts drawn uniformly from
the layer's experts (E for the EP layer, E/P for the reference) for ``balanced``, or from the skewed
popularity of ``routing.draw_topk`` for ``skewed``. The routing weights are still the router's (its fp32
logits, scored, gathered at the drawn experts, renormalized and scaled), so the router runs and gets
its gradient as in training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dropless.bench.options import select_by_name
from dropless.bench.routing import draw_topk
from dropless.nn.grouped_linear import GroupedLinear
from dropless.nn.moe import MoE
from dropless.ops.permute import sort_by_expert
from dropless.ops.router_logits import router_logits
from dropless.ops.routing import Routing

RECIPES = ("bf16", "rowwise")  # "bf16": the experts in the input's dtype; else an FP8 recipe
# The EP layers, by the dispatch backend each uses; then the one-GPU reference. A "_graph" method is its
# step (forward and backward) captured in a CUDA graph and timed as its replay: GPUs only, and only for a
# layer with no host sync (the NCCL backend's count exchange is one).
EP_METHODS = {"dropless_ep": "nccl", "dropless_ep_symmetric_memory": "symmetric_memory",
              "dropless_ep_symmetric_memory_graph": "symmetric_memory"}
METHODS = (*EP_METHODS, "dropless_one_gpu", "dropless_one_gpu_graph")
GRAPHED = "_graph"


def layer_methods(graphs: bool) -> tuple[str, ...]:
    """The layer methods a run times: with ``graphs`` (on GPUs) the graph-replayed ones too."""
    return tuple(m for m in METHODS if graphs or not m.endswith(GRAPHED))


def reference(method: str) -> str:
    """The one-GPU method an EP method's weak scaling is measured against: replayed from a graph where the
    EP method is, so that both steps have their host's share removed alike."""
    return "dropless_one_gpu" + (GRAPHED if method.endswith(GRAPHED) else "")


@dataclass(frozen=True)
class EpLayerConfig:
    """A DeepSeek-style MoE layer: T tokens per rank of width d, k of E routed experts of width d_ff, a
    shared expert of width ``shared_d_ff``, sigmoid scores renormalized over the k and scaled."""

    name: str
    label: str
    T: int
    d: int
    d_ff: int
    E: int
    k: int
    shared_d_ff: int
    routed_scaling: float = 2.5

    @property
    def useful_flops(self) -> int:
        """Expert GEMM FLOPs of one GPU's forward+backward on average: ``3 * T * 6 * d * (k * d_ff +
        shared_d_ff)`` (the router GEMM not counted), the same at every P."""
        return 3 * self.T * 6 * self.d * (self.k * self.d_ff + self.shared_d_ff)


CONFIGS = (
    # DeepSeek-V3's MoE layer at full width fits 80 GB at 4096 tokens per rank, so it is not scaled down.
    # Per GPU at P ranks: 256/P experts of 3 * 7168 * 2048 bf16 weights (21/P GiB), as much again for
    # their gradients and, with FP8, for the cached FP8 weight copies (two orientations of one byte);
    # the 32768 token copies' activations and buffers take a few GiB. The FP8 step's peak is about
    # 35 GiB at P = 2 and 65 GiB at P = 1 (the whole layer on one GPU).
    EpLayerConfig("dsv3", "DeepSeek-V3 MoE layer", T=4096, d=7168, d_ff=2048, E=256, k=8, shared_d_ff=2048),
)
QUICK_CONFIGS = (
    EpLayerConfig("dsv3", "DeepSeek-V3 MoE layer (tiny)", T=64, d=64, d_ff=32, E=32, k=4, shared_d_ff=32),
)


def select_configs(names: Sequence[str] | None, quick: bool) -> list[EpLayerConfig]:
    return select_by_name(names, CONFIGS, QUICK_CONFIGS, quick, "layer config")


class DrawnRouter(nn.Module):
    """Stands in for a ``MoE``'s router: the router's fp32 logits ``x @ weight^T`` and scores, its choice
    of experts replaced by ``expert_ids`` drawn beforehand; weights = the scores at those experts,
    renormalized and scaled. The auxiliary losses are zeros (``aux_loss_coef`` is 0 in the benchmark). With
    ``sort`` (the layer on one process asks for it) the copies are sorted by ``sort_by_expert``.

    weight: ``[E_router, d]`` (may score more experts than the layer has: the reference scores all E);
    expert_ids: int64 ``[T, k]`` in ``[0, num_experts)``, for inputs of exactly T tokens.
    """

    def __init__(self, weight: nn.Parameter, expert_ids: torch.Tensor, num_experts: int, scale: float) -> None:
        super().__init__()
        self.weight = weight
        self.expert_ids = expert_ids
        self.num_experts = num_experts
        self.scale = scale

    def forward(self, x: torch.Tensor, sort: bool = False) -> Routing:
        scores = torch.sigmoid(router_logits(x, self.weight))
        weights = scores.gather(1, self.expert_ids)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.scale
        zero = scores.new_zeros(())
        if sort:
            sorted_to_token_slot, tokens, offsets = sort_by_expert(self.expert_ids, self.num_experts)
            return Routing(weights, self.expert_ids, tokens, zero, zero, sorted_to_token_slot, offsets)
        flat = self.expert_ids.flatten()
        tokens = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        tokens.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        return Routing(weights, self.expert_ids, tokens, zero, zero)


@dataclass
class LayerWeights:
    """One rank's tokens ``x [T, d]``, upstream gradient ``dy [T, d]``, and the weights every layer built on
    them shares: ``owner``, the EP layer holding this rank's experts and the router and shared expert (the
    same on every rank)."""

    x: torch.Tensor
    dy: torch.Tensor
    owner: MoE


@dataclass
class LayerRouting:
    """The drawn experts of this rank's tokens in each layer (int64 ``[T, k]`` on the device) and the token
    copies this rank's experts take: ``rows_ep`` (from every rank's draw) and ``rows_one_gpu`` (T * k)."""

    ids_ep: torch.Tensor
    ids_one_gpu: torch.Tensor
    rows_ep: int
    rows_one_gpu: int


def make_weights(cfg: EpLayerConfig, group: dist.ProcessGroup, device: torch.device, dtype: torch.dtype,
                 seed: int) -> LayerWeights:
    """This rank's experts (``MoE``'s own initialization, seeded by ``seed`` and the rank), rank 0's router
    and shared expert, random tokens and upstream gradient. Collective: every rank of ``group`` (the
    whole world) calls it."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if cfg.E % world or cfg.k > cfg.E // world:
        raise ValueError(f"layer {cfg.name}: {world} ranks must divide its {cfg.E} experts and leave each at least "
                         f"k = {cfg.k} (the one-GPU reference routes every token to k of them)")
    torch.manual_seed(seed * 1000 + rank)
    owner = _moe(cfg, cfg.E, group, None, device, dtype)
    with torch.no_grad():  # the replicated weights: rank 0's
        for p in (owner.router.weight, *owner.shared_experts.parameters()):
            dist.broadcast(p, 0, group=group)
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(cfg.T, cfg.d, generator=gen).to(device, dtype)
    dy = torch.randn(cfg.T, cfg.d, generator=gen).to(device, dtype)
    return LayerWeights(x, dy, owner)


def draw_routing(cfg: EpLayerConfig, routing: str, group: dist.ProcessGroup, device: torch.device,
                 seed: int) -> LayerRouting:
    """Both layers' draws for this rank's tokens (``routing.draw_topk``, seeded by ``seed`` and the rank).
    Collective: every rank of ``group`` calls it."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    local = cfg.E // world
    ids_ep = draw_topk(cfg.T, cfg.E, cfg.k, routing, seed, seed * 1000 + rank)
    ids_one_gpu = draw_topk(cfg.T, local, cfg.k, routing, seed, seed * 1000 + 500 + rank)
    counts = torch.bincount(ids_ep.flatten(), minlength=cfg.E).to(device)
    dist.all_reduce(counts, group=group)
    rows_ep = int(counts.view(world, local)[rank].sum())
    return LayerRouting(ids_ep.to(device), ids_one_gpu.to(device), rows_ep, cfg.T * cfg.k)


def _moe(cfg: EpLayerConfig, num_experts: int, group: dist.ProcessGroup | None, recipe: str | None,
         device: torch.device | str, dtype: torch.dtype, ep_backend: str = "nccl") -> MoE:
    return MoE(cfg.d, cfg.d_ff, num_experts, cfg.k, score_func="sigmoid", routed_scaling=cfg.routed_scaling,
               aux_loss_coef=0.0, num_shared_experts=1, shared_d_ff=cfg.shared_d_ff, recipe=recipe,
               ep_group=group, ep_backend=ep_backend, device=device, dtype=dtype)


def build_layer(cfg: EpLayerConfig, method: str, recipe: str, weights: LayerWeights, routing: LayerRouting,
                group: dist.ProcessGroup) -> MoE:
    """``method``'s layer with ``recipe``, its parameters those of ``weights.owner`` (the same tensors: built
    on the meta device, then given them), its router a ``DrawnRouter`` with the method's drawn experts."""
    if method not in METHODS:
        raise ValueError(f"unknown layer method {method!r}")
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose from {list(RECIPES)}")
    ep = method in EP_METHODS
    owner = weights.owner
    experts = cfg.E if ep else owner.local_experts
    layer = _moe(cfg, experts, group if ep else None, None if recipe == "bf16" else recipe, "meta", weights.x.dtype,
                 EP_METHODS.get(method, "nccl"))
    for name in ("experts_gate_up.weight", "experts_down.weight", "shared_experts.gate_up.weight",
                 "shared_experts.down.weight"):
        path, _, attr = name.rpartition(".")
        setattr(layer.get_submodule(path), attr, owner.get_parameter(name))
    layer.router = DrawnRouter(owner.router.weight, routing.ids_ep if ep else routing.ids_one_gpu, experts,
                               cfg.routed_scaling)
    left = [n for n, t in [*layer.named_parameters(), *layer.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"the benchmark left {left} of the layer on the meta device")
    return layer


def release_caches(layer: nn.Module) -> None:
    """Drop the FP8 weight copies the layer's grouped linears cached (made again on the next forward)."""
    for module in layer.modules():
        if isinstance(module, GroupedLinear):
            module.weight_cache.clear()
