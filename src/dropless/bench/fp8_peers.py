"""The methods of the FP8 benchmark, on the same ``Problem`` (bf16 operands) as the GEMM benchmark.

Every FP8 method quantizes its bf16 activations inside the timed call; the weights too, except the
``_cached`` ones, which quantize the weight once at setup (as a training step does once per weight
version) and time the products with that copy. Results come back in bf16 and are checked against the
fp32 product of the bf16 operands, with an FP8 tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

import dropless
from dropless.bench.peers import Case, Dense, Dropless, Method, _gemm_case
from dropless.bench.problem import Problem
from dropless.ops.grouped_mm_fp8 import swap_weight
from dropless.quantized import FP8_DTYPE, FP8_MAX, GEMM_RECIPES, get_recipe, operand_recipes


class DroplessFp8(Method):
    """``dropless.grouped_mm(..., recipe=recipe)`` and ``grouped_mm_wgrad(..., recipe=recipe)``; with
    ``cached``, the weight's two FP8 orientations are made at setup and passed as ``w_quantized``."""

    def __init__(self, p: Problem, recipe: str, cached: bool) -> None:
        super().__init__(p)
        self.recipe = get_recipe(recipe)
        self.pair = dropless.quantize_weight(p.w, operand_recipes(self.recipe)[1]) if cached else None

    def case(self, pass_: str) -> Case:
        offsets, recipe, pair = self.p.offsets, self.recipe, self.pair

        def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            # dgrad multiplies by w^T (a view with unit stride along K): the weight's pair, each orientation
            # seen transposed.
            quantized = pair if pair is None or b.stride(2) == 1 else (swap_weight(pair[1]), swap_weight(pair[0]))
            return dropless.grouped_mm(a, b, offsets, recipe=recipe, w_quantized=quantized)

        return _gemm_case(pass_, mm, lambda a, b: dropless.grouped_mm_wgrad(a, b, offsets, recipe=recipe),
                          self.p.x, self.p.w, self.p.dy)


def _rowwise(t: torch.Tensor, dim: int, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch-side rowwise quantization along ``dim``: ``(t / s).to(fp8)`` and ``s = amax / 448`` (fp32,
    keepdim); the scale's power-of-two rounding as torchao does it if ``pow2``."""
    amax = t.abs().amax(dim=dim, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


class TorchScaledGroupedMM(Method):
    """``torch._scaled_grouped_mm`` (cuBLAS/CUTLASS FP8 grouped GEMM, rowwise scales) with PyTorch-side
    rowwise quantization of both operands in the timed call; its weight gradient is the 2D x 2D form
    over the tokens, with per-group scales of the transposed operands."""

    def __init__(self, p: Problem) -> None:
        super().__init__(p)
        if not hasattr(torch, "_scaled_grouped_mm"):
            raise RuntimeError("this torch has no _scaled_grouped_mm")

    def _mm(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a [M, K] @ b[e] [K, N]`` per group; b is quantized along K, stored ``[E, N, K]``."""
        aq, sa = _rowwise(a, 1)
        bq, sb = _rowwise(b.transpose(1, 2).contiguous(), 2)
        return torch._scaled_grouped_mm(aq, bq.transpose(1, 2), sa.view(-1), sb.view(b.shape[0], -1),
                                        offs=self.p.offsets, out_dtype=torch.bfloat16)

    def _wgrad(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a_e^T b_e`` per group, each operand quantized along the tokens with one scale per group and
        column (a segmented amax on the device; empty groups get scale 1)."""
        at, sa = self._per_group(a)
        bt, sb = self._per_group(b)
        return torch._scaled_grouped_mm(at, bt.t(), sa.reshape(-1), sb.reshape(-1), offs=self.p.offsets,
                                        out_dtype=torch.bfloat16)

    def _per_group(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``t [M, D]`` quantized per group along the tokens: ``t^T`` in FP8 ``[D, M]`` and scales ``[E, D]``."""
        offsets = self.p.offsets
        groups = torch.searchsorted(offsets, torch.arange(t.shape[0], device=t.device, dtype=offsets.dtype),
                                    right=True).clamp(max=offsets.shape[0] - 1)
        amax = torch.zeros(offsets.shape[0], t.shape[1], device=t.device).scatter_reduce_(
            0, groups[:, None].expand(-1, t.shape[1]), t.abs().float(), "amax")
        scale = torch.where(amax > 0, amax / FP8_MAX, 1.0)
        data = (t.float() / scale[groups]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
        return data.t().contiguous(), scale

    def case(self, pass_: str) -> Case:
        product = _differentiable(self._mm, self._wgrad) if pass_ == "fwd+bwd" else self._mm
        return _gemm_case(pass_, product, self._wgrad, self.p.x, self.p.w, self.p.dy)


def _differentiable(mm: Callable, wgrad: Callable) -> Callable:
    """An autograd function of ``mm`` whose backward runs ``mm(dy, w^T)`` and ``wgrad(x, dy)``."""

    class Product(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return mm(a, b)

        @staticmethod
        def backward(ctx, dy):
            a, b = ctx.saved_tensors
            return mm(dy, b.transpose(1, 2)), wgrad(a, dy)

    return Product.apply


class TorchaoRowwise(Method):
    """torchao's differentiable FP8 rowwise grouped GEMM (``_to_fp8_rowwise_then_scaled_grouped_mm``),
    which quantizes both operands (power-of-two scales) in every call; groups must be multiples of 16
    rows. Its passes: fwd and fwd+bwd (it has no separate dgrad or wgrad entry)."""

    def __init__(self, p: Problem) -> None:
        super().__init__(p)
        try:
            from torchao.prototype.moe_training import _to_fp8_rowwise_then_scaled_grouped_mm
        except ImportError as exc:
            raise RuntimeError("torchao is not installed") from exc
        self.product = partial(_to_fp8_rowwise_then_scaled_grouped_mm, offs=p.offsets, out_dtype=torch.bfloat16,
                               pad_token_groups_for_grouped_mm=False)
        # Its weight operand must be column-major per expert: the [E, K, N] view of [E, N, K] storage.
        self.w = p.w.transpose(1, 2).contiguous().transpose(1, 2)

    def case(self, pass_: str) -> Case:
        if pass_ not in ("fwd", "fwd+bwd"):
            raise RuntimeError(f"torchao's FP8 grouped GEMM has no separate {pass_} entry")
        return _gemm_case(pass_, lambda a, b: self.product(a, b), None, self.p.x, self.w, self.p.dy)


class DenseFp8(Method):
    """The ceiling: one ``torch._scaled_mm`` per pass with the same FLOPs (all M rows against one
    expert's weight), operands quantized rowwise at setup (not timed)."""

    oracle = "dense"

    def __init__(self, p: Problem) -> None:
        super().__init__(p)
        x, w, dy = p.x, p.w[0], p.dy
        self.fwd = (*_rowwise(x, 1), *_rowwise(w.t().contiguous(), 1))            # x along K, w^T [N, K]
        self.dgrad = (*_rowwise(dy, 1), *_rowwise(w.contiguous(), 1))             # dy along N, w [K, N]
        self.wgrad = (*_rowwise(x.t().contiguous(), 1), *_rowwise(dy.t().contiguous(), 1))  # along M

    @staticmethod
    def _mm(aq: torch.Tensor, sa: torch.Tensor, bq: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
        return torch._scaled_mm(aq, bq.t(), sa, sb.t(), out_dtype=torch.bfloat16)

    def case(self, pass_: str) -> Case:
        fwd = lambda: self._mm(*self.fwd)  # noqa: E731
        dgrad = lambda: self._mm(*self.dgrad)  # noqa: E731
        wgrad = lambda: self._mm(*self.wgrad)  # noqa: E731
        runs = {"fwd": (fwd,), "dgrad": (dgrad,), "wgrad": (wgrad,), "fwd+bwd": (fwd, dgrad, wgrad)}[pass_]
        return Case(lambda: tuple(run() for run in runs), lambda results: tuple(results))


FP8_METHODS: dict[str, Callable[[Problem], Method]] = {
    "dense": Dense,
    "dense_fp8": DenseFp8,
    "dropless": Dropless,
    **{f"dropless_{r}": partial(DroplessFp8, recipe=r, cached=False) for r in GEMM_RECIPES},
    **{f"dropless_{r}_cached": partial(DroplessFp8, recipe=r, cached=True) for r in GEMM_RECIPES},
    "torchao_rowwise": TorchaoRowwise,
    "torch_scaled_grouped_mm": TorchScaledGroupedMM,
}
