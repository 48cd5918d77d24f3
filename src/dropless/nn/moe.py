"""MoE: a dropless Mixture-of-Experts layer with gated (SwiGLU) experts and no host sync."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from dropless.nn.grouped_linear import GroupedLinear
from dropless.nn.recompute import recomputed
from dropless.nn.router import TopKRouter
from dropless.ops.activation import geglu, swiglu
from dropless.ops.permute import gather_copies, unpermute
from dropless.parallel import combine, dispatch
from dropless.parallel.dispatch import BACKENDS as EP_BACKENDS
from dropless.quantized import QuantizedTensor, Recipe, operand_recipes

ACTIVATIONS = {"swiglu": swiglu, "geglu": geglu}
# transformers' softmax top-k routers: Mixtral's always renormalizes, Qwen3-MoE's per norm_topk_prob.
_HF_SOFTMAX_ROUTERS = ("MixtralTopKRouter", "Qwen3MoeTopKRouter")
# transformers' activation modules by class name, to the gated activation they make with [gate | up].
_HF_ACTIVATIONS = {"SiLU": "swiglu", "SiLUActivation": "swiglu", "GELUTanh": "geglu",
                   "PytorchGELUTanh": "geglu", "NewGELUActivation": "geglu", "GELUPytorchTanh": "geglu"}


class SharedExperts(nn.Module):
    """Experts every token goes to (DeepSeek): one dense gated MLP of width ``d_ff``."""

    def __init__(self, d_model: int, d_ff: int, activation: str = "swiglu", bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.activation = activation
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=bias, device=device, dtype=dtype)
        self.down = nn.Linear(d_ff, d_model, bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, d_model] -> [T, d_model]``."""
        # The gate/up output is read by nothing else in the backward: its memory takes the gradient.
        return self.down(ACTIVATIONS[self.activation](self.gate_up(x), grad_in_place=True))


_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """A second stream on ``device``, one per process, for work that overlaps the expert exchange."""
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return _SIDE_STREAMS[device]


class MoE(nn.Module):
    """A dropless MoE layer: every token goes to its ``top_k`` experts, no capacity, no dropping.

    router (fp32) -> permute (token copies sorted by expert, on the device) -> one grouped GEMM for
    the fused gate and up projections (``N = 2 * d_ff``) -> gated activation -> grouped down GEMM ->
    unpermute (each token's weighted sum of its experts' outputs) [+ shared experts]. No step reads
    the routing on the host, so the layer, forward and backward, can be captured in a CUDA graph.
    With a recipe, the gated activation writes its output in FP8 too, the down GEMM's forward operand.

    Args:
        d_model, d_ff: model width and each expert's hidden width.
        num_experts, top_k: E experts, k per token (``1 <= k <= E``; ValueError at construction otherwise).
        score_func, renormalize, n_groups, topk_groups, routed_scaling: routing options, see
            ``dropless.ops.routing.route`` (``routed_scaling`` is its ``scale``).
        expert_bias, bias_update_rate: DeepSeek-V3's auxiliary-loss-free balancing; call
            ``update_expert_bias()`` once per optimizer step.
        aux_loss_coef, z_loss_coef: weights of the load-balancing and z losses in ``aux_loss``.
        num_shared_experts, shared_d_ff: experts every token uses (width ``num_shared_experts *
            shared_d_ff``, ``shared_d_ff`` defaulting to ``d_ff``).
        bias: biases in the expert projections.
        activation: ``"swiglu"`` or ``"geglu"``.
        fuse_wgrad_accumulation: expert weight gradients go into ``main_grad`` (see GroupedLinear).
        recompute_activation: keep the gated activation's output ``[T*k, d_ff]`` out of the memory
            saved for the backward, and compute it again from the gate/up output there (as Megatron's
            option of that name); the gradients are the same. BF16/FP16 experts (with a recipe the
            down product saves its own FP8 copies).
        recompute_permute: keep the permuted token copies ``x_sorted [T*k, d_model]`` out of the memory
            saved for the backward: the gate/up product's weight gradient gathers them again from the
            tokens, and its input gradient (a buffer of the same size) is made after that, so the two
            never coexist; one more gather of ``T*k*d_model`` elements a step, the same gradients.
            BF16/FP16 experts on one process (with a recipe the permuted rows are never made: the
            gate/up product gathers FP8 rows; with an ``ep_group`` the rows come from other ranks).
        recipe: run the expert GEMMs in FP8 (``"rowwise"``, ``"block128"``, ``"mxfp8"``; see
            GroupedLinear); the router and the shared experts stay in the input's dtype (router: fp32).
            The tokens are quantized once and their copies move as FP8 rows and scales
            (``GroupedLinear``'s ``gather``).
        ep_group: expert parallelism over this process group of P ranks: rank r keeps experts
            ``r*E/P .. (r+1)*E/P - 1`` (P must divide E); router and shared experts are replicated, and
            token copies travel to their experts' ranks and back (``dropless.parallel.dispatch`` and
            ``combine``). ``expert_parallel(group)`` makes one from a full layer. On GPUs the shared
            experts run on a second stream, beside the exchange (forward and backward).
        ep_backend: how the copies travel: ``"nccl"`` (``all_to_all_single``, one host sync a layer) or
            ``"symmetric_memory"`` (no host sync: the layer can be captured in a CUDA graph; its expert
            products run on buffers sized for the most rows a rank can receive, ``P * T * top_k``).
        ep_max_tokens: with ``"symmetric_memory"``, the most tokens a rank passes in one forward, so that a
            later forward with more tokens does not outgrow the buffers (default: the first forward's,
            the most over the ranks).

    Experts' weights: ``experts_gate_up.weight [E, 2*d_ff, d_model]`` (gate rows, then up rows) and
    ``experts_down.weight [E, d_model, d_ff]`` (``E/P`` experts with an ``ep_group``).

    After each forward: ``aux_loss`` (fp32 scalar, ``aux_loss_coef * load-balancing loss +
    z_loss_coef * z loss``, to add to the training loss), ``load_balancing_loss`` and ``z_loss``
    (unscaled) and ``tokens_per_expert`` (int32 ``[E]`` on the device).
    """

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int, *,
                 score_func: str = "softmax", renormalize: bool = True, n_groups: int | None = None,
                 topk_groups: int | None = None, routed_scaling: float = 1.0, expert_bias: bool = False,
                 bias_update_rate: float = 1e-3, aux_loss_coef: float = 1e-2, z_loss_coef: float = 0.0,
                 num_shared_experts: int = 0, shared_d_ff: int | None = None, bias: bool = False,
                 activation: str = "swiglu", fuse_wgrad_accumulation: bool = False,
                 recompute_activation: bool = False, recompute_permute: bool = False,
                 recipe: str | Recipe | None = None,
                 ep_group: dist.ProcessGroup | None = None, ep_backend: str = "nccl",
                 ep_max_tokens: int | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        # The layer's options, from which expert_parallel() builds the same layer over a group.
        options = {name: value for name, value in locals().items()
                   if name not in ("self", "__class__", "ep_group", "device", "dtype")}
        super().__init__()
        self.options = options
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {list(ACTIVATIONS)}, got {activation!r}")
        if d_model < 1 or d_ff < 1:
            raise ValueError(f"d_model and d_ff must be at least 1, got {d_model} and {d_ff}")
        if num_shared_experts < 0 or shared_d_ff is not None and shared_d_ff < 1:
            raise ValueError(f"num_shared_experts must be at least 0 and shared_d_ff at least 1 (or None), got "
                             f"{num_shared_experts} and {shared_d_ff}")
        if ep_backend not in EP_BACKENDS:
            raise ValueError(f"ep_backend must be one of {EP_BACKENDS}, got {ep_backend!r}")
        self.ep_group = ep_group
        self.ep_backend = ep_backend
        self.ep_max_tokens = ep_max_tokens
        ranks = dist.get_world_size(ep_group) if ep_group is not None else 1
        if num_experts % ranks:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by the ep_group's size ({ranks})")
        self.local_experts = num_experts // ranks
        self.first_expert = dist.get_rank(ep_group) * self.local_experts if ep_group is not None else 0
        self.d_model = d_model
        self.num_experts = num_experts
        self.top_k = top_k
        self.activation = activation
        self.recompute_activation = recompute_activation
        self.recompute_permute = recompute_permute
        self.aux_loss_coef = aux_loss_coef
        self.z_loss_coef = z_loss_coef
        factory = {"device": device, "dtype": dtype}
        self.router = TopKRouter(d_model, num_experts, top_k, score_func=score_func, renormalize=renormalize,
                                 n_groups=n_groups, topk_groups=topk_groups, expert_bias=expert_bias,
                                 bias_update_rate=bias_update_rate, scale=routed_scaling, **factory)
        self.experts_gate_up = GroupedLinear(self.local_experts, d_model, 2 * d_ff, bias=bias,
                                             fuse_wgrad_accumulation=fuse_wgrad_accumulation, recipe=recipe,
                                             **factory)
        self.experts_down = GroupedLinear(self.local_experts, d_ff, d_model, bias=bias,
                                          fuse_wgrad_accumulation=fuse_wgrad_accumulation, recipe=recipe, **factory)
        self.shared_experts = (SharedExperts(d_model, num_shared_experts * (shared_d_ff or d_ff), activation,
                                             **factory) if num_shared_experts > 0 else None)
        self.aux_loss: torch.Tensor | None = None
        self.load_balancing_loss: torch.Tensor | None = None
        self.z_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., d_model] -> y [..., d_model]`` in x's dtype."""
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x must have shape [..., d_model={self.d_model}], got {tuple(x.shape)}")
        tokens = x.reshape(-1, self.d_model)
        # On one process the router also sorts the token copies by expert (its kernels' counting sort).
        routing = self.router(tokens, sort=self.ep_group is None)
        sorted_to_token_slot, offsets = routing.sorted_to_token_slot, routing.offsets
        shared, side = None, None
        if self.ep_group is None and self.experts_gate_up.recipe is not None:
            # FP8: the permute writes FP8 rows and their scales (the gate/up product quantizes each token
            # once and writes its copies); the permuted rows are never made in x's dtype. Backward,
            # unpermute writes the down projection's output gradient in FP8 too, which its product reads.
            y_sorted = self._experts(tokens, routing.tokens_per_expert, gather=(sorted_to_token_slot, self.top_k))
            y = unpermute(y_sorted, sorted_to_token_slot, routing.weights, offsets,
                          grad_recipe=operand_recipes(self.experts_down.recipe)[0])
        elif self.ep_group is None:
            x_sorted = gather_copies(tokens, sorted_to_token_slot, offsets, self.top_k)
            if self.recompute_permute:
                # Every id is a valid expert here, so x_sorted[p] is the token row of its slot.
                copies = sorted_to_token_slot // self.top_k
                with recomputed(x_sorted, lambda: tokens.index_select(0, copies)):
                    y_sorted = self._experts(x_sorted, routing.tokens_per_expert)
            else:
                y_sorted = self._experts(x_sorted, routing.tokens_per_expert)
            y = unpermute(y_sorted, sorted_to_token_slot, routing.weights, offsets)
        else:
            # With a recipe, token rows travel in FP8 (quantized once, at their rank) and the gate/up
            # product reads them as they come.
            recipe = self.experts_gate_up.recipe
            beside = self.shared_experts is not None and tokens.is_cuda
            if beside:
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(tokens.device))
            rows, group_sizes, handle = dispatch(tokens, routing.expert_ids, routing.weights, self.ep_group,
                                                 num_experts=self.num_experts, recipe=recipe,
                                                 backend=self.ep_backend, max_tokens=self.ep_max_tokens)
            if beside:
                shared, side = self._shared_beside(tokens, ready)
            rows, rows_fp8 = rows if recipe is not None else (rows, None)
            # The symmetric-memory backend's rows are sized for the most a rank can receive: the
            # activation computes only the ones received.
            y = combine(self._experts(rows, group_sizes, rows_fp8, received=handle.received), handle)
        if side is not None:
            main = torch.cuda.current_stream(tokens.device)
            main.wait_stream(side)
            shared.record_stream(main)
            y = y + shared
        elif self.shared_experts is not None:
            y = y + self.shared_experts(tokens)
        self.load_balancing_loss = routing.aux_loss
        self.z_loss = routing.z_loss
        self.aux_loss = self.aux_loss_coef * routing.aux_loss + self.z_loss_coef * routing.z_loss
        self.tokens_per_expert = routing.tokens_per_expert
        return y.reshape(x.shape)

    def _shared_beside(self, tokens: torch.Tensor,
                       ready: torch.cuda.Event) -> tuple[torch.Tensor, torch.cuda.Stream]:
        """The shared experts on ``tokens [T, d_model]``, queued on a second stream from ``ready`` on: they
        need no routing, so they run while the token copies travel, and their backward (on the same
        stream) while the gradients travel back. Queued after the dispatch, so that the exchange, which
        every rank waits on, is not held up on the host by their launches."""
        side = _side_stream(tokens.device)
        side.wait_event(ready)
        with torch.cuda.stream(side):
            shared = self.shared_experts(tokens)
        tokens.record_stream(side)
        return shared, side

    def _experts(self, rows: torch.Tensor, group_sizes: torch.Tensor, rows_fp8: QuantizedTensor | None = None,
                 gather: tuple[torch.Tensor, int] | None = None, received: torch.Tensor | None = None
                 ) -> torch.Tensor:
        """The gated experts on ``rows`` sorted by (local) expert: ``[R, d_model] -> [R, d_model]``;
        ``rows_fp8``: the rows already quantized for the gate/up product's forward; ``gather``: rows are
        the tokens and the product's rows their copies by slot (``GroupedLinear``'s gather);
        ``received``: int ``[1]``, the rows that hold copies (the others are not computed: the products
        leave their rows past the groups unwritten, as nothing reads them)."""
        tail = received is None
        h = self.experts_gate_up(rows, group_sizes, x_quantized=rows_fp8, gather=gather, tail=tail)
        activation = ACTIVATIONS[self.activation]
        # h is read by nothing else in the backward (the recomputation of a, where asked for, comes first,
        # in the down projection's backward): the activation's backward writes dh over it, one [R, 2 d_ff]
        # buffer less at the backward's peak.
        if self.experts_down.recipe is None:
            a = activation(h, grad_in_place=True, rows=received)
            if not self.recompute_activation:
                return self.experts_down(a, group_sizes, tail=tail)
            with recomputed(a, lambda: activation(h, rows=received)):
                return self.experts_down(a, group_sizes, tail=tail)
        # The activation kernel also writes its output in FP8 along d_ff, which the down projection's
        # forward reads instead of quantizing the activation again; with rowwise scales, its backward
        # writes dh in FP8 too, which the gate/up product's backward reads.
        up_recipe = operand_recipes(self.experts_gate_up.recipe)[0]
        a, a_fp8 = activation(h, recipe=self.experts_down.recipe, grad_in_place=True, rows=received,
                              grad_recipe=up_recipe if up_recipe.name == "rowwise" else None)
        return self.experts_down(a, group_sizes, x_quantized=a_fp8, tail=tail)

    def expert_parallel(self, group: dist.ProcessGroup | None = None, *, backend: str | None = None,
                        max_tokens: int | None = None) -> MoE:
        """The same layer over ``group`` (default: the whole world), its copies moved by ``backend`` (default:
        the layer's ``ep_backend``; see ``ep_max_tokens`` for ``max_tokens``): this rank's experts (copies of
        their weights), the router and the shared experts replicated. Its outputs on a rank's tokens, and the
        gradients of its experts, equal this layer's; the router's and shared experts' gradients summed
        over the ranks equal this layer's on all the ranks' tokens."""
        if self.ep_group is not None:
            raise ValueError("this layer is already expert-parallel")
        if group is None and not dist.is_initialized():
            raise RuntimeError("expert_parallel needs torch.distributed: call torch.distributed.init_process_group "
                               "first (under torchrun), or pass the process group of the expert-parallel ranks")
        weight = self.experts_gate_up.weight
        options = dict(self.options)
        if backend is not None:
            options["ep_backend"] = backend
        if max_tokens is not None:
            options["ep_max_tokens"] = max_tokens
        layer = MoE(**options, ep_group=group if group is not None else dist.group.WORLD,
                    device=weight.device, dtype=weight.dtype)
        layer.router.load_state_dict(self.router.state_dict())
        if self.shared_experts is not None:
            layer.shared_experts.load_state_dict(self.shared_experts.state_dict())
        layer.experts_gate_up = self.experts_gate_up.select_experts(layer.first_expert, layer.local_experts)
        layer.experts_down = self.experts_down.select_experts(layer.first_expert, layer.local_experts)
        return layer

    @classmethod
    def from_hf(cls, block: nn.Module) -> MoE:
        """A ``MoE`` with the weights and routing of a Hugging Face transformers sparse-MoE block.

        Takes the blocks of Mixtral and Qwen3-MoE (softmax top-k router) and DeepSeek-V3 (sigmoid
        router with group-limited choice, score-correction bias, routed scaling and shared experts):
        a module with ``gate`` (router weight ``[E, d]``, ``top_k``) and ``experts`` (gated, fused
        ``gate_up_proj [E, 2*d_ff, d]`` and ``down_proj [E, d, d_ff]``, SiLU or tanh-GELU, no bias).
        The weights are copied; ``aux_loss_coef`` is 0 (transformers adds its own auxiliary loss).
        Raises ValueError, naming what differs, for any other block.
        """
        name = type(block).__name__
        gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
        if gate is None or experts is None or not hasattr(experts, "gate_up_proj"):
            raise ValueError(f"{name}: expected a sparse-MoE block with a `gate` router and fused `experts`")
        custom_gate = getattr(type(experts)._apply_gate, "__name__", "") != "_default_apply_gate"
        if (not experts.has_gate or experts.has_bias or experts.is_transposed or not experts.is_concatenated
                or getattr(experts, "has_post_expert_norm", False) or custom_gate):
            raise ValueError(f"{name}: only gated experts with concatenated [gate | up] weights in nn.Linear "
                             "layout, no bias, no custom gate and no post-expert norm can become a MoE")
        activation = _HF_ACTIVATIONS.get(type(experts.act_fn).__name__)
        if activation is None:
            raise ValueError(f"{name}: the experts' activation {type(experts.act_fn).__name__} has no dropless kernel")
        if getattr(gate, "bias", None) is not None or hasattr(block, "shared_expert_gate"):
            raise ValueError(f"{name}: router biases and gated shared experts are not supported")
        E, d_model = gate.weight.shape
        d_ff = experts.gate_up_proj.shape[1] // 2
        router = type(gate).__name__
        deepseek = router == "DeepseekV3TopkRouter"
        if deepseek:
            routing = dict(score_func="sigmoid", n_groups=gate.num_group, topk_groups=gate.topk_group,
                           renormalize=gate.norm_topk_prob, routed_scaling=gate.routed_scaling_factor,
                           expert_bias=True)
        elif router in _HF_SOFTMAX_ROUTERS:
            routing = dict(score_func="softmax", renormalize=getattr(gate, "norm_topk_prob", True))
        else:
            raise ValueError(f"{name}: its router {router} is not one MoE.from_hf knows how to reproduce")
        shared = getattr(block, "shared_experts", None)
        moe = cls(d_model, d_ff, E, gate.top_k, aux_loss_coef=0.0, activation=activation,
                  num_shared_experts=1 if shared is not None else 0,
                  shared_d_ff=shared.gate_proj.out_features if shared is not None else None,
                  device=gate.weight.device, dtype=experts.gate_up_proj.dtype, **routing)
        with torch.no_grad():
            moe.router.weight.copy_(gate.weight)
            moe.experts_gate_up.weight.copy_(experts.gate_up_proj)
            moe.experts_down.weight.copy_(experts.down_proj)
            if deepseek:
                moe.router.expert_bias.copy_(gate.e_score_correction_bias)
            if shared is not None:
                moe.shared_experts.gate_up.weight.copy_(torch.cat([shared.gate_proj.weight, shared.up_proj.weight]))
                moe.shared_experts.down.weight.copy_(shared.down_proj.weight)
        return moe

    def update_expert_bias(self) -> None:
        """Move the router's expert bias toward balance (needs ``expert_bias=True``); no host sync."""
        self.router.update_expert_bias()
