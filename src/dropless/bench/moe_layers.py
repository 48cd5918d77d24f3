"""The whole MoE layer benchmark's configs, shared weights, and the layers under test.

Every layer is built from one ``Weights`` (the same router, expert and shared-expert weights, the
same ``x`` and upstream gradient ``dy``), one layer at a time, and handed to the runner as a
``Built``: its forward on ``x [T, d]``, its parameters, and how to lay their gradients out in the
canonical layout the fp32 reference uses:

    router [E, d], gate_up [E, 2*d_ff, d] (gate rows, then up rows), down [E, d, d_ff],
    shared_gate_up [2*shared_d_ff, d], shared_down [d, shared_d_ff].

Routing is computed in fp32 from the same bf16 router weights and inputs in every layer, so that all
of them pick the same experts (bf16 router logits would flip near-ties between methods).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dropless.bench.options import select_by_name


@dataclass(frozen=True)
class LayerConfig:
    """One MoE layer: T tokens, E experts, k per token, width d, expert width d_ff, gated SiLU experts,
    softmax router (top-k weights renormalized or not) and optional shared experts of total width
    ``shared_d_ff`` (0: none)."""

    name: str
    label: str
    family: str  # transformers model family: "mixtral", "qwen3_moe" or "deepseek_v2"
    T: int
    E: int
    k: int
    d: int
    d_ff: int
    shared_d_ff: int = 0
    renormalize: bool = True

    @property
    def useful_flops(self) -> int:
        """Expert GEMM FLOPs of forward+backward: ``3 * T * k * 6 * d * d_ff`` (gate+up and down,
        forward, dgrad and wgrad) plus the shared experts' ``3 * T * 6 * d * shared_d_ff``."""
        return 3 * self.T * 6 * self.d * (self.k * self.d_ff + self.shared_d_ff)

    @property
    def dense_shape(self) -> tuple[int, int, int]:
        """``(M, K, N)`` of the dense ceiling: ``[M, d] @ [d, 3*d_ff]`` with ``M = T*k + T*shared_d_ff/d_ff``
        rows, so that ``6*M*K*N`` equals ``useful_flops`` (up to rounding of M)."""
        M = self.T * self.k + round(self.T * self.shared_d_ff / self.d_ff)
        return M, self.d, 3 * self.d_ff


CONFIGS = (
    LayerConfig("mixtral", "Mixtral-8x7B", "mixtral", T=8192, E=8, k=2, d=4096, d_ff=14336),
    LayerConfig("qwen3", "Qwen3-30B-A3B", "qwen3_moe", T=16384, E=128, k=8, d=2048, d_ff=768),
    LayerConfig("dsv2lite", "DeepSeek-V2-Lite", "deepseek_v2", T=16384, E=64, k=6, d=2048, d_ff=1408,
                shared_d_ff=2 * 1408, renormalize=False),
)

# The same three layers, tiny: the reference backend runs all methods on a CPU in seconds.
QUICK_CONFIGS = (
    LayerConfig("mixtral", "Mixtral-8x7B (tiny)", "mixtral", T=256, E=8, k=2, d=64, d_ff=96),
    LayerConfig("qwen3", "Qwen3-30B-A3B (tiny)", "qwen3_moe", T=512, E=16, k=4, d=64, d_ff=32),
    LayerConfig("dsv2lite", "DeepSeek-V2-Lite (tiny)", "deepseek_v2", T=256, E=16, k=3, d=64, d_ff=48,
                shared_d_ff=2 * 48, renormalize=False),
)


def select_configs(names: Sequence[str] | None, quick: bool) -> list[LayerConfig]:
    """The configs named (all when ``names`` is None), from the quick set if ``quick``."""
    return select_by_name(names, CONFIGS, QUICK_CONFIGS, quick, "config")


@dataclass
class Weights:
    """One copy of the layer's weights in the canonical layouts, and its input and upstream gradient."""

    router: torch.Tensor  # [E, d]
    gate_up: torch.Tensor  # [E, 2*d_ff, d]
    down: torch.Tensor  # [E, d, d_ff]
    shared_gate_up: torch.Tensor | None  # [2*shared_d_ff, d]
    shared_down: torch.Tensor | None  # [d, shared_d_ff]
    x: torch.Tensor  # [T, d]
    dy: torch.Tensor  # [T, d]

    def canonical(self) -> dict[str, torch.Tensor]:
        """The parameters by canonical name (shared experts only when there are some)."""
        out = {"router": self.router, "gate_up": self.gate_up, "down": self.down}
        if self.shared_gate_up is not None:
            out |= {"shared_gate_up": self.shared_gate_up, "shared_down": self.shared_down}
        return out


def make_weights(cfg: LayerConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> Weights:
    """Random normal weights (scaled as an initialized layer's, so activations stay near unit size),
    a random input and a random upstream gradient; never zeros."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype).mul_(scale)

    E, d, f, s = cfg.E, cfg.d, cfg.d_ff, cfg.shared_d_ff
    return Weights(
        router=randn(E, d, scale=d ** -0.5),
        gate_up=randn(E, 2 * f, d, scale=d ** -0.5),
        down=randn(E, d, f, scale=f ** -0.5),
        shared_gate_up=randn(2 * s, d, scale=d ** -0.5) if s else None,
        shared_down=randn(d, s, scale=s ** -0.5) if s else None,
        x=randn(cfg.T, d),
        dy=randn(cfg.T, d),
    )


@dataclass
class Built:
    """A layer ready to run: ``forward(x [T, d]) -> y [T, d]``, its parameters (``leaves``, in a fixed
    order), and ``canonical(grads)`` giving the leaves' gradients by canonical name and layout."""

    forward: Callable[[torch.Tensor], torch.Tensor]
    leaves: list[torch.Tensor]
    canonical: Callable[[Sequence[torch.Tensor]], dict[str, torch.Tensor]]
    module: nn.Module


def _fp32_route(x: torch.Tensor, router: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax top-k routing in fp32: ``(weights [T, k] fp32, expert ids [T, k])``."""
    scores = torch.softmax(F.linear(x.float(), router.float()), dim=-1)
    weights, ids = torch.topk(scores, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


# ---------------------------------------------------------------------------------------------------
# dropless


def build_dropless(cfg: LayerConfig, w: Weights, recipe: str | None = None, recompute_activation: bool = False,
                   recompute_permute: bool = False) -> Built:
    """``dropless.MoE`` with the shared weights (router included; ``aux_loss_coef=0``), its expert GEMMs in
    FP8 with ``recipe`` when given, and the layer's recompute options."""
    from dropless.nn.moe import MoE

    moe = MoE(cfg.d, cfg.d_ff, cfg.E, cfg.k, score_func="softmax", renormalize=cfg.renormalize,
              aux_loss_coef=0.0, num_shared_experts=1 if cfg.shared_d_ff else 0,
              shared_d_ff=cfg.shared_d_ff or None, recipe=recipe, recompute_activation=recompute_activation,
              recompute_permute=recompute_permute,
              device=w.x.device, dtype=w.x.dtype)
    params = {"router": moe.router.weight, "gate_up": moe.experts_gate_up.weight, "down": moe.experts_down.weight}
    if moe.shared_experts is not None:
        params |= {"shared_gate_up": moe.shared_experts.gate_up.weight, "shared_down": moe.shared_experts.down.weight}
    _copy(params, w.canonical())
    names = list(params)
    return Built(moe, list(params.values()), lambda grads: dict(zip(names, grads)), moe)


def _copy(params: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(values[name])


# ---------------------------------------------------------------------------------------------------
# torch._grouped_mm, written the way torchtitan writes its MoE


class TorchGroupedMoE(nn.Module):
    """A pure-torch MoE layer in torchtitan's style, a benchmark peer (not library code).

    Router: linear and softmax in fp32, top-k, renormalized if asked. Permute: a stable ``argsort`` of
    the flattened expert ids and an index gather of the token rows; tokens per expert by a
    ``scatter_add_`` (no host sync), int32 offsets by ``cumsum``. Experts: ``torch._grouped_mm`` with
    the fused gate+up weight ``w13 [E, d, 2*d_ff]``, SiLU(gate) * up in torch, ``torch._grouped_mm``
    with ``w2 [E, d_ff, d]``. Unpermute: scatter the rows back to (token, slot) order and take each
    token's weighted sum over its k slots. Shared experts: a dense SwiGLU MLP added on top.
    """

    def __init__(self, cfg: LayerConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        E, d, f, s = cfg.E, cfg.d, cfg.d_ff, cfg.shared_d_ff
        self.num_experts, self.top_k, self.renormalize = E, cfg.k, cfg.renormalize
        factory = {"device": device, "dtype": dtype}
        self.router = nn.Parameter(torch.empty(E, d, **factory))
        self.w13 = nn.Parameter(torch.empty(E, d, 2 * f, **factory))
        self.w2 = nn.Parameter(torch.empty(E, f, d, **factory))
        self.shared_w13 = nn.Linear(d, 2 * s, bias=False, **factory) if s else None
        self.shared_w2 = nn.Linear(s, d, bias=False, **factory) if s else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T, d = x.shape
        k = self.top_k
        weights, ids = _fp32_route(x, self.router, k, self.renormalize)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # token slots sorted by expert
        counts = torch.zeros(self.num_experts, dtype=torch.int32, device=x.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        x_sorted = x[order // k]
        gate, up = torch._grouped_mm(x_sorted, self.w13, offs=offsets).chunk(2, dim=-1)
        out_sorted = torch._grouped_mm(F.silu(gate) * up, self.w2, offs=offsets)
        out = torch.empty_like(out_sorted)
        out[order] = out_sorted  # back to (token, slot) order
        y = (out.view(T, k, d) * weights.to(x.dtype).unsqueeze(-1)).sum(dim=1)
        if self.shared_w13 is not None:
            g, u = self.shared_w13(x).chunk(2, dim=-1)
            y = y + self.shared_w2(F.silu(g) * u)
        return y


def build_torch_grouped_mm(cfg: LayerConfig, w: Weights) -> Built:
    layer = TorchGroupedMoE(cfg, w.x.device, w.x.dtype)
    with torch.no_grad():
        layer.router.copy_(w.router)
        layer.w13.copy_(w.gate_up.transpose(1, 2))
        layer.w2.copy_(w.down.transpose(1, 2))
        if layer.shared_w13 is not None:
            layer.shared_w13.weight.copy_(w.shared_gate_up)
            layer.shared_w2.weight.copy_(w.shared_down)
    leaves = [layer.router, layer.w13, layer.w2]
    if layer.shared_w13 is not None:
        leaves += [layer.shared_w13.weight, layer.shared_w2.weight]

    def canonical(grads: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {"router": grads[0], "gate_up": grads[1].transpose(1, 2), "down": grads[2].transpose(1, 2)}
        if len(grads) > 3:
            out |= {"shared_gate_up": grads[3], "shared_down": grads[4]}
        return out

    return Built(layer, leaves, canonical, layer)


# ---------------------------------------------------------------------------------------------------
# transformers' own sparse-MoE blocks


HF_BLOCKS = {  # family -> (module, block class name)
    "mixtral": ("transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock"),
    "qwen3_moe": ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock"),
    "deepseek_v2": ("transformers.models.deepseek_v2.modeling_deepseek_v2", "DeepseekV2Moe"),
}
# transformers' routers return their top-k weights in these dtypes: Mixtral's in fp32 (softmax in
# fp32, no cast back), Qwen3-MoE's cast back to the router logits' dtype (the model's).
_HF_ROUTING_WEIGHTS_IN_MODEL_DTYPE = {"mixtral": False, "qwen3_moe": True}


class Fp32Router(nn.Module):
    """Runs a transformers router (Mixtral, Qwen3-MoE) on fp32 inputs with an fp32 weight, so that its
    choice of experts is that of every other method (transformers computes these logits in the model
    dtype); gives its outputs back in the dtypes transformers would."""

    def __init__(self, gate: nn.Module, weights_in_model_dtype: bool) -> None:
        super().__init__()
        self.gate = gate
        self.weights_in_model_dtype = weights_in_model_dtype

    def forward(self, hidden_states: torch.Tensor):
        logits, weights, ids = self.gate(hidden_states.float())
        if self.weights_in_model_dtype:
            weights = weights.to(hidden_states.dtype)
        return logits.to(hidden_states.dtype), weights, ids


def hf_block_class(cfg: LayerConfig) -> type[nn.Module]:
    """transformers' sparse-MoE block class for ``cfg``'s family; raises if this transformers lacks it."""
    import importlib

    module, name = HF_BLOCKS[cfg.family]
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        import transformers

        raise RuntimeError(f"{name} is not available in transformers {transformers.__version__}") from exc


def hf_config(cfg: LayerConfig):
    """A transformers config whose MoE block has ``cfg``'s shape and routing."""
    import transformers

    if cfg.family == "mixtral":
        return transformers.MixtralConfig(hidden_size=cfg.d, intermediate_size=cfg.d_ff, num_local_experts=cfg.E,
                                          num_experts_per_tok=cfg.k, router_jitter_noise=0.0, hidden_act="silu")
    if cfg.family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(hidden_size=cfg.d, moe_intermediate_size=cfg.d_ff, num_experts=cfg.E,
                                           num_experts_per_tok=cfg.k, norm_topk_prob=cfg.renormalize,
                                           hidden_act="silu")
    if cfg.family == "deepseek_v2":
        if cfg.renormalize:
            raise ValueError("transformers' DeepseekV2Moe never renormalizes its top-k weights")
        if cfg.shared_d_ff % cfg.d_ff:
            raise ValueError("DeepseekV2Moe's shared width is a multiple of moe_intermediate_size")
        # DeepSeek-V2-Lite: greedy softmax top-k, no group limit, routed scaling 1, no renormalization.
        return transformers.DeepseekV2Config(hidden_size=cfg.d, moe_intermediate_size=cfg.d_ff,
                                             n_routed_experts=cfg.E, num_experts_per_tok=cfg.k,
                                             n_shared_experts=cfg.shared_d_ff // cfg.d_ff, topk_method="greedy",
                                             routed_scaling_factor=1.0, norm_topk_prob=False, hidden_act="silu")
    raise ValueError(f"no transformers block for family {cfg.family!r}")


def build_hf(cfg: LayerConfig, w: Weights, implementation: str) -> Built:
    """transformers' sparse-MoE block for ``cfg`` with the shared weights, its experts run by
    ``implementation`` (``"grouped_mm"``, ``"eager"``, ``"dropless"``, ...).

    The block is built on the meta device and materialized in the weights' dtype on their device, so
    no extra copy is ever made. Its experts implementation is set on the block's config (the experts
    read ``config._experts_implementation`` at each forward). Mixtral's and Qwen3-MoE's routers are
    wrapped in ``Fp32Router``; DeepSeek-V2's already route in fp32.
    """
    if implementation == "dropless":
        from dropless.integrations import register_transformers

        register_transformers()
    block_class = hf_block_class(cfg)
    config = hf_config(cfg)
    with torch.device("meta"):
        block = block_class(config)
    block = block.to(w.x.dtype).to_empty(device=w.x.device)
    config._experts_implementation = implementation
    experts = block.experts
    gate = block.gate
    with torch.no_grad():
        experts.gate_up_proj.copy_(w.gate_up)
        experts.down_proj.copy_(w.down)
        if cfg.family in _HF_ROUTING_WEIGHTS_IN_MODEL_DTYPE:
            gate.weight = nn.Parameter(w.router.float())
            block.gate = Fp32Router(gate, _HF_ROUTING_WEIGHTS_IN_MODEL_DTYPE[cfg.family])
        else:
            gate.weight.copy_(w.router)
    leaves = [gate.weight, experts.gate_up_proj, experts.down_proj]
    shared = getattr(block, "shared_experts", None)
    if cfg.shared_d_ff:
        if shared is None:
            raise RuntimeError(f"{type(block).__name__} has no shared experts")
        s = cfg.shared_d_ff
        with torch.no_grad():
            shared.gate_proj.weight.copy_(w.shared_gate_up[:s])
            shared.up_proj.weight.copy_(w.shared_gate_up[s:])
            shared.down_proj.weight.copy_(w.shared_down)
        leaves += [shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight]

    def canonical(grads: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        out = {"router": grads[0], "gate_up": grads[1], "down": grads[2]}
        if len(grads) > 3:
            out |= {"shared_gate_up": torch.cat([grads[3], grads[4]]), "shared_down": grads[5]}
        return out

    T, d = cfg.T, cfg.d
    return Built(lambda x: block(x.view(1, T, d)).view(T, d), leaves, canonical, block)


# ---------------------------------------------------------------------------------------------------
# the fp32 reference


def reference(cfg: LayerConfig, w: Weights) -> dict[str, torch.Tensor]:
    """fp32 results of forward+backward, by name: ``y``, ``dx`` and the canonical weight gradients.

    The layer as written in the papers, independent of every method: fp32 routing from the same
    weights and input, then a host loop over experts (each one's tokens by ``nonzero``: a sync, at
    setup only), SwiGLU experts, weighted ``index_add`` of their outputs, plus the shared experts.
    """
    leaves = {name: t.detach().float().requires_grad_() for name, t in w.canonical().items()}
    x = w.x.detach().float().requires_grad_()
    weights, ids = _fp32_route(x, leaves["router"], cfg.k, cfg.renormalize)
    y = torch.zeros_like(x)
    for e in range(cfg.E):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate, up = F.linear(x[token], leaves["gate_up"][e]).chunk(2, dim=-1)
        out = F.linear(F.silu(gate) * up, leaves["down"][e])
        y.index_add_(0, token, out * weights[token, slot].unsqueeze(-1))
    if "shared_gate_up" in leaves:
        gate, up = F.linear(x, leaves["shared_gate_up"]).chunk(2, dim=-1)
        y = y + F.linear(F.silu(gate) * up, leaves["shared_down"])
    grads = torch.autograd.grad(y, [x, *leaves.values()], w.dy.float())
    return {"y": y.detach(), "dx": grads[0], **dict(zip(leaves, grads[1:]))}
