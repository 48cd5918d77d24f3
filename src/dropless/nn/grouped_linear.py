"""GroupedLinear: E linear layers applied to consecutive row groups of one input, in one grouped GEMM."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from dropless.ops.autocast import autocast_operands
from dropless.ops.checks import check_same_device
from dropless.ops.group_bias import add_group_bias
from dropless.ops.grouped_mm import grouped_mm, grouped_mm_wgrad
from dropless.ops.grouped_mm_fp8 import Fp8GroupedMM, resolve_recipe
from dropless.ops.quantize import check_quantized, quantize_weight
from dropless.quantized import QuantizedTensor, Recipe, operand_recipes


class _FusedWgradGroupedLinear(torch.autograd.Function):
    """``y = grouped x @ weight[e]^T`` whose weight gradient is added into ``main_grad`` in place."""

    @staticmethod
    def forward(ctx, x, weight, offsets, main_grad, accumulate, tail):
        ctx.save_for_backward(x, weight, offsets, accumulate)
        # Not saved for backward: it is written in place by every backward that shares it, which
        # would trip the saved-tensor version check of the others.
        ctx.main_grad = main_grad
        ctx.tail = tail
        return grouped_mm(x, weight.transpose(1, 2), offsets, tail=tail)

    @staticmethod
    def backward(ctx, dy):
        x, weight, offsets, accumulate = ctx.saved_tensors
        main_grad = ctx.main_grad
        # main_grad[e] [out, in] = dy_e^T @ x_e: the ragged-K product with dy as the left operand. Before
        # dx, and x dropped first: a recomputed x (the MoE layer's recompute_permute) and dx never coexist.
        grouped_mm_wgrad(dy, x, offsets, out=main_grad, accumulate=accumulate)
        del x
        dx = grouped_mm(dy, weight, offsets, tail=ctx.tail) if ctx.needs_input_grad[0] else None
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True
        return dx, None, None, None, None, None


class QuantizedWeightCache:
    """A weight's two FP8 orientations (``quantize_weight``), made again only when the weight changes.

    The key is the weight's version counter (bumped by every in-place update, an optimizer step
    included), its storage and the recipe: all host-side facts, so finding out costs no sync. The
    forward, the dgrad and every micro-batch of a step reuse one quantization. While a CUDA graph is
    captured or ``torch.compile`` traces, the weight is quantized inside the call instead, so the
    graph redoes it on every replay and never holds a stale copy.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._pair: tuple[QuantizedTensor, QuantizedTensor] | None = None

    def get(self, weight: torch.Tensor, recipe: Recipe) -> tuple[QuantizedTensor, QuantizedTensor]:
        """``quantize_weight`` of ``weight [E, out, in]`` seen as ``[E, in, out]`` with the weight recipe
        of ``recipe``."""
        w = weight.detach().transpose(1, 2)
        _, weights = operand_recipes(recipe)
        if torch.compiler.is_compiling() or (w.is_cuda and torch.cuda.is_current_stream_capturing()):
            return quantize_weight(w, weights)
        key = (weight._version, weight.data_ptr(), weight.dtype, weights)
        if key != self._key:
            self._pair = quantize_weight(w, weights)
            self._key = key
        return self._pair

    def clear(self) -> None:
        self._key = self._pair = None


class GroupedLinear(nn.Module):
    """``num_experts`` linear layers over consecutive row groups: ``y[rows of e] = x[rows of e] @ W[e]^T + b[e]``.

    Args:
        num_experts: E.
        in_features, out_features: per-expert layer sizes.
        bias: add a per-expert bias ``[E, out_features]``.
        fuse_wgrad_accumulation: add the weight gradient into ``weight.main_grad`` (fp32
            ``[E, out_features, in_features]``, created on first use if absent) inside the GEMM's
            epilogue instead of producing ``weight.grad``, as Megatron-style trainers expect. If the
            weight has a ``grad_added_to_main_grad`` attribute it is set to True in the backward.
        recipe: run the three GEMMs in FP8 (``"rowwise"``, ``"block128"``, ``"mxfp8"`` or a
            ``dropless.Recipe``; None: in the input's dtype). The weight's two FP8 copies are made
            once per weight version (``QuantizedWeightCache``); bias and output stay in x's dtype.

    ``weight`` is ``[E, out_features, in_features]`` (``nn.Linear`` layout per expert).
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, bias: bool = False,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 fuse_wgrad_accumulation: bool = False, recipe: str | Recipe | None = None) -> None:
        super().__init__()
        self.recipe = resolve_recipe(recipe) if recipe is not None else None
        self.weight_cache = QuantizedWeightCache()
        if num_experts < 1 or in_features < 1 or out_features < 1:
            raise ValueError(f"num_experts, in_features and out_features must be positive, got "
                             f"{num_experts}, {in_features}, {out_features}")
        self.num_experts = num_experts
        self.in_features = in_features
        self.out_features = out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(num_experts, out_features, **factory)) if bias else None
        self.reset_parameters()
        self._make_main_grad()

    def reset_parameters(self) -> None:
        """Each expert initialized as ``nn.Linear`` would be: U(-1/sqrt(in), 1/sqrt(in))."""
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def select_experts(self, first: int, count: int) -> GroupedLinear:
        """A GroupedLinear of experts ``first .. first + count - 1`` of this one, with copies of their
        weights (and biases) and the same options."""
        if not (0 <= first and count >= 1 and first + count <= self.num_experts):
            raise ValueError(f"experts {first}..{first + count - 1} are not all among this layer's "
                             f"{self.num_experts}")
        layer = GroupedLinear(count, self.in_features, self.out_features, bias=self.bias is not None,
                              device=self.weight.device, dtype=self.weight.dtype,
                              fuse_wgrad_accumulation=self.fuse_wgrad_accumulation, recipe=self.recipe)
        with torch.no_grad():
            layer.weight.copy_(self.weight[first:first + count])
            if self.bias is not None:
                layer.bias.copy_(self.bias[first:first + count])
        return layer

    def _make_main_grad(self) -> None:
        # Made outside forward, so that a compiled forward never allocates the tensor its backward
        # writes (which torch.compile cannot partition).
        if self.fuse_wgrad_accumulation:
            self.weight.main_grad = torch.zeros_like(self.weight, dtype=torch.float32)

    def _apply(self, fn, recurse=True):
        module = super()._apply(fn, recurse)
        self._make_main_grad()
        self.weight_cache.clear()
        return module

    def forward(self, x: torch.Tensor, group_sizes: Sequence[int] | torch.Tensor,
                wgrad_accumulation_mask: torch.Tensor | None = None,
                x_quantized: QuantizedTensor | None = None,
                gather: tuple[torch.Tensor, int] | None = None, tail: bool = True) -> torch.Tensor:
        """Apply expert e to its rows.

        Args:
            x: ``[M, in_features]``, rows sorted by expert.
            group_sizes: rows per expert, ``[E]``: a list of ints, a CPU tensor, or a tensor on x's
                device (no host sync). Rows past their sum give zero output. Sizes given on the host
                as a list (or any sequence) are checked, which costs no sync: E of them, none negative,
                summing to at most M (ValueError otherwise); tensors are not read.
            wgrad_accumulation_mask: with ``fuse_wgrad_accumulation``, an optional bool ``[E]``
                tensor on x's device: experts marked True add their gradient into ``main_grad``,
                the others overwrite it (the first micro-batch of a step). Default: all add.
            x_quantized: with a recipe, x already quantized along in_features with the layer's
                activation recipe (``dropless.quantize(x, recipe, dim=-1)``, or the FP8 copy that
                ``swiglu(h, recipe=...)`` writes with x): the forward product reads it instead of
                quantizing x. It must hold x's values as the layer reads them (after autocast); its
                layout is checked, its values are not. x itself is still needed: the weight
                gradient quantizes it along the tokens.
            gather: with a recipe, ``(sorted_to_token_slot, top_k)`` as ``dropless.permute`` returns
                them (int ``[M]``, M = T * top_k, and k): x is then the ``[T, in_features]`` tokens and
                row p of the product is token ``sorted_to_token_slot[p] // top_k``, the permuted row
                that is never made: x is quantized along in_features once and its FP8 rows gathered,
                the weight gradient reads the rows by index, and x's gradient sums each token's copies
                (in fp32, as permute's backward). ``group_sizes`` count the M rows.
            tail: False leaves the output's rows past the groups unwritten (they hold anything), and
                x's gradient's too (``dropless.grouped_mm``'s ``tail``): for rows no one reads, such as
                the unused rows of an expert-parallel receive buffer.
        Returns:
            ``[M, out_features]`` in x's dtype (the autocast dtype under ``torch.autocast``).
        """
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"x must be a tensor of shape [M, in_features={self.in_features}], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        rows = x.shape[0] if gather is None else self._check_gather(gather, x, x_quantized)
        offsets = self._offsets(group_sizes, x, rows)
        if wgrad_accumulation_mask is not None and not self.fuse_wgrad_accumulation:
            raise ValueError("wgrad_accumulation_mask needs fuse_wgrad_accumulation=True")
        fused = self.fuse_wgrad_accumulation and torch.is_grad_enabled() and self.weight.requires_grad
        accumulate = None
        if fused:
            accumulate = (wgrad_accumulation_mask if wgrad_accumulation_mask is not None
                          else torch.ones(self.num_experts, dtype=torch.bool, device=x.device))
        if x_quantized is not None:
            self._check_x_quantized(x_quantized, x)
        if self.recipe is not None:
            y = self._forward_fp8(x, offsets, accumulate if fused else None, x_quantized, gather, tail)
        else:
            x, weight = autocast_operands(x, self.weight)
            if fused:
                y = _FusedWgradGroupedLinear.apply(x, weight, offsets, self.weight.main_grad, accumulate, tail)
            else:
                y = grouped_mm(x, weight.transpose(1, 2), offsets, tail=tail)
        if self.bias is not None:
            y = add_group_bias(y, self.bias, offsets)
        return y

    def _check_x_quantized(self, q: object, x: torch.Tensor) -> None:
        """``q`` is x quantized along in_features as this layer's FP8 forward would quantize it."""
        if self.recipe is None:
            raise ValueError("x_quantized needs a layer with a recipe (an FP8 GroupedLinear); this one has none")
        check_quantized("x_quantized", q, ndim=2, dim=1)
        act, _ = operand_recipes(self.recipe)
        if q.recipe != act:
            raise ValueError(f"x_quantized was quantized with {q.recipe}, but this layer quantizes x with {act}")
        if q.shape != x.shape or q.device != x.device:
            raise ValueError(f"x_quantized must have x's shape {tuple(x.shape)} on {x.device}, got "
                             f"{tuple(q.shape)} on {q.device}")
        (cast,) = autocast_operands(x)
        if cast.dtype != x.dtype:
            raise ValueError(f"x_quantized: autocast casts x from {x.dtype} to {cast.dtype} before quantizing it, "
                             f"so a copy quantized from x as given would differ; pass x in {cast.dtype}")

    def _forward_fp8(self, x: torch.Tensor, offsets: torch.Tensor, accumulate: torch.Tensor | None,
                     x_quantized: QuantizedTensor | None, gather: tuple[torch.Tensor, int] | None,
                     tail: bool) -> torch.Tensor:
        """The FP8 product with the cached weight copies; x quantized from the autocast dtype, unless
        its copy ``x_quantized`` (already checked) is given; ``gather`` (checked): x's rows by slot."""
        (x,) = autocast_operands(x)
        wk, wn = self.weight_cache.get(self.weight, self.recipe)
        main_grad = self.weight.main_grad.transpose(1, 2) if accumulate is not None else None
        xq = (x_quantized.data, x_quantized.scale) if x_quantized is not None else (None, None)
        y = Fp8GroupedMM.apply(x, self.weight.transpose(1, 2), offsets, wk.data, wk.scale, wn.data, wn.scale,
                               self.recipe, main_grad, accumulate, *xq, *(gather or (None, None)), tail)
        if accumulate is not None and hasattr(self.weight, "grad_added_to_main_grad"):
            self.weight.grad_added_to_main_grad = True
        return y

    def _check_gather(self, gather: object, x: torch.Tensor, x_quantized: QuantizedTensor | None) -> int:
        """``gather`` is ``(sorted_to_token_slot [T*k], k)`` for the tokens x, on an FP8 layer; returns the
        product's rows, T*k."""
        if self.recipe is None:
            raise ValueError("gather needs a layer with a recipe (an FP8 GroupedLinear); a BF16 layer takes the "
                             "permuted rows (dropless.permute)")
        if x_quantized is not None:
            raise ValueError("gather and x_quantized cannot be given together: with gather the layer quantizes "
                             "the tokens once itself")
        if not (isinstance(gather, tuple) and len(gather) == 2 and isinstance(gather[0], torch.Tensor)
                and isinstance(gather[1], int) and not isinstance(gather[1], bool) and gather[1] >= 1):
            raise TypeError("gather must be (sorted_to_token_slot, top_k): an int tensor [T*top_k] and an int >= 1")
        slots, top_k = gather
        if slots.dim() != 1 or slots.dtype not in (torch.int32, torch.int64) or slots.shape[0] != x.shape[0] * top_k:
            raise ValueError(f"gather's sorted_to_token_slot must be an int32/int64 [T*top_k] = [{x.shape[0] * top_k}] "
                             f"tensor for x's {x.shape[0]} tokens, got {slots.dtype} of shape {tuple(slots.shape)}")
        check_same_device(x.device, sorted_to_token_slot=slots)
        return slots.shape[0]

    def _offsets(self, group_sizes: Sequence[int] | torch.Tensor, x: torch.Tensor, rows: int) -> torch.Tensor:
        """int32 ``[E]`` cumulative ends of ``group_sizes`` on x's device; sizes given on the host as a
        sequence are checked against the product's ``rows`` here (tensors are left to the device-side
        validation)."""
        if isinstance(group_sizes, torch.Tensor):
            if group_sizes.dtype.is_floating_point or group_sizes.dtype.is_complex or group_sizes.dtype == torch.bool:
                raise TypeError(f"group_sizes must be an integer tensor (or a sequence of ints), got "
                                f"{group_sizes.dtype}")
            sizes = group_sizes
        elif any(isinstance(size, bool) or int(size) != size for size in group_sizes):
            raise TypeError(f"group_sizes must be ints, got {list(group_sizes)}")
        else:
            sizes = torch.as_tensor(group_sizes, dtype=torch.int64)
        if sizes.shape != (self.num_experts,):
            raise ValueError(f"group_sizes must have shape [E] = [{self.num_experts}] (one size per expert), got "
                             f"{tuple(sizes.shape)}")
        if not isinstance(group_sizes, torch.Tensor):
            values = [int(size) for size in group_sizes]  # host values: no sync
            if min(values) < 0:
                raise ValueError(f"group_sizes must not be negative, got {values}")
            if sum(values) > rows:
                raise ValueError(f"group_sizes sum to {sum(values)}, more than the M={rows} rows of x "
                                 f"(got {values})")
        return torch.cumsum(sizes.to(x.device, non_blocking=True), 0, dtype=torch.int32)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.in_features}, "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"fuse_wgrad_accumulation={self.fuse_wgrad_accumulation}"
                + (f", recipe={self.recipe.name}" if self.recipe is not None else ""))
