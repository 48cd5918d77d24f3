"""The methods under test, each built on one ``Problem`` and giving one timed ``Case`` per pass.

Every case returns, after unpacking (not timed), its results in the layout of the reference:
fwd ``(y [M, N],)``, dgrad ``(dx [M, K],)``, wgrad ``(dw [E, K, N],)``, fwd+bwd ``(y, dx, dw)``;
``dense`` works on one expert's weight, so its ``dw`` is ``[K, N]``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

import dropless
from dropless.bench.problem import Problem

Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Case:
    """run: the timed work, returns raw results. unpack: raw results to the reference layout."""

    run: Callable[[], Any]
    unpack: Callable[[Any], tuple[torch.Tensor, ...]]


class Method(abc.ABC):
    """A way to compute the passes on a ``Problem``; ``oracle`` names the reference it is checked by."""

    oracle = "grouped"

    def __init__(self, p: Problem) -> None:
        self.p = p

    @abc.abstractmethod
    def case(self, pass_: str) -> Case:
        """The timed work of ``pass_`` (one of ``PASSES``)."""


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _gemm_case(pass_: str, mm: Product, wgrad: Product, x: torch.Tensor, w: torch.Tensor,
               dy: torch.Tensor, rows: Callable[[torch.Tensor], torch.Tensor] = _same) -> Case:
    """The four passes of ``y = mm(x, w)``: dgrad as ``mm(dy, w^T)``, wgrad as ``wgrad(x, dy)``.

    ``rows`` maps a result laid out like ``x`` or ``dy`` to ``[M, D]`` (for padded layouts).
    """
    if pass_ == "fwd":
        return Case(lambda: mm(x, w), lambda y: (rows(y),))
    if pass_ == "dgrad":
        wt = w.transpose(-2, -1)
        return Case(lambda: mm(dy, wt), lambda dx: (rows(dx),))
    if pass_ == "wgrad":
        return Case(lambda: wgrad(x, dy), lambda dw: (dw,))
    if pass_ == "fwd+bwd":
        x_leaf = x.detach().requires_grad_()
        w_leaf = w.detach().requires_grad_()

        def step() -> tuple[torch.Tensor, ...]:
            y = mm(x_leaf, w_leaf)
            # autograd.grad, not backward: nothing accumulates into .grad between repetitions.
            return (y, *torch.autograd.grad(y, (x_leaf, w_leaf), dy))

        return Case(step, lambda r: (rows(r[0]), rows(r[1]), r[2]))
    raise ValueError(f"unknown pass {pass_!r}")


class Dropless(Method):
    """``dropless.grouped_mm`` (ragged M) and ``dropless.grouped_mm_wgrad`` (ragged K), device offsets."""

    def case(self, pass_: str) -> Case:
        offsets = self.p.offsets
        return _gemm_case(pass_, lambda a, b: dropless.grouped_mm(a, b, offsets),
                          lambda a, b: dropless.grouped_mm_wgrad(a, b, offsets), self.p.x, self.p.w, self.p.dy)


class TorchGroupedMM(Method):
    """``torch._grouped_mm`` with device offsets; wgrad is its 2D x 2D (ragged K) form on ``x^T``."""

    def case(self, pass_: str) -> Case:
        offsets = self.p.offsets
        return _gemm_case(pass_, lambda a, b: torch._grouped_mm(a, b, offs=offsets),
                          lambda a, b: torch._grouped_mm(a.t(), b, offs=offsets), self.p.x, self.p.w, self.p.dy)


class Dense(Method):
    """One ``torch.mm`` of the same FLOPs on all M rows and the first expert's weight: the ceiling."""

    oracle = "dense"

    def case(self, pass_: str) -> Case:
        return _gemm_case(pass_, torch.mm, lambda a, b: torch.mm(a.t(), b), self.p.x, self.p.w[0], self.p.dy)


class PaddedBmm(Method):
    """Capacity-padded ``torch.bmm`` on ``[E, C, K]``, C = the largest group (no row dropped): under
    all-to-one routing C = M, so it multiplies E times the rows there are (its buffers too).

    The gather into the zero-padded buffers happens here, at setup, and is not timed; only the bmm is.
    """

    def __init__(self, p: Problem) -> None:
        super().__init__(p)
        E, C = p.shape.E, max(p.sizes)
        self.xp = p.x.new_zeros(E, C, p.shape.K)
        self.dyp = p.dy.new_zeros(E, C, p.shape.N)
        for e, (x_e, dy_e) in enumerate(zip(p.x.split(p.sizes), p.dy.split(p.sizes))):
            self.xp[e, :x_e.shape[0]] = x_e
            self.dyp[e, :dy_e.shape[0]] = dy_e

    def _rows(self, padded: torch.Tensor) -> torch.Tensor:
        """``[E, C, D]`` padded rows back to ``[M, D]`` in group order."""
        return torch.cat([padded[e, :n] for e, n in enumerate(self.p.sizes)])

    def case(self, pass_: str) -> Case:
        return _gemm_case(pass_, torch.bmm, lambda a, b: torch.bmm(a.transpose(1, 2), b),
                          self.xp, self.p.w, self.dyp, self._rows)


class Loop(Method):
    """A Python loop over experts with the group sizes on the host, as an ``nn.ModuleList`` of
    ``nn.Linear`` runs it: weights in ``[E, N, K]`` layout (the same values as ``w``), one ``F.linear``
    per expert, outputs joined with ``torch.cat``; backward through autograd with one leaf per expert.
    """

    def __init__(self, p: Problem) -> None:
        super().__init__(p)
        self.w_nk = p.w.transpose(1, 2).contiguous()

    def _forward(self, x: torch.Tensor, weights: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat([F.linear(x_e, w_e) for x_e, w_e in zip(x.split(self.p.sizes), weights)])

    def case(self, pass_: str) -> Case:
        p, w_nk = self.p, self.w_nk
        if pass_ == "fwd":
            return Case(lambda: self._forward(p.x, w_nk), lambda y: (y,))
        if pass_ == "dgrad":
            # What F.linear's backward runs for each expert: dx_e = dy_e @ W_e.
            return Case(lambda: torch.cat([torch.mm(dy_e, w_e) for dy_e, w_e in zip(p.dy.split(p.sizes), w_nk)]),
                        lambda dx: (dx,))
        if pass_ == "wgrad":
            dw = torch.empty_like(w_nk)

            def wgrad() -> torch.Tensor:
                # dW_e [N, K] = dy_e^T @ x_e, written in place; an empty group gives zeros.
                for e, (x_e, dy_e) in enumerate(zip(p.x.split(p.sizes), p.dy.split(p.sizes))):
                    torch.mm(dy_e.t(), x_e, out=dw[e])
                return dw

            return Case(wgrad, lambda dw: (dw.transpose(1, 2),))
        if pass_ == "fwd+bwd":
            x_leaf = p.x.detach().requires_grad_()
            leaves = [w_e.detach().requires_grad_() for w_e in w_nk]

            def step() -> tuple[torch.Tensor, ...]:
                y = self._forward(x_leaf, leaves)
                dx, *dws = torch.autograd.grad(y, (x_leaf, *leaves), p.dy)
                return y, dx, dws

            return Case(step, lambda r: (r[0], r[1], torch.stack(r[2]).transpose(1, 2)))
        raise ValueError(f"unknown pass {pass_!r}")


class Quack(Method):
    """quack's CuTe DSL varlen GEMMs (``quack-kernels``, where it is installed), default configuration:
    ragged M through ``cu_seqlens_m`` for fwd and dgrad, ragged K through ``cu_seqlens_k`` for wgrad; the
    fwd+bwd step is an autograd function whose backward runs those two.
    """

    def __init__(self, p: Problem) -> None:
        super().__init__(p)
        try:
            from quack.gemm_interface import gemm
        except ImportError as exc:
            raise RuntimeError("quack-kernels is not installed") from exc
        cu_seqlens = torch.cat([p.offsets.new_zeros(1), p.offsets])

        def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return gemm(a, b, cu_seqlens_m=cu_seqlens, tuned=False)

        def wgrad(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return gemm(a.t(), b, cu_seqlens_k=cu_seqlens, tuned=False)

        class Product(torch.autograd.Function):
            @staticmethod
            def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
                ctx.save_for_backward(a, b)
                return mm(a, b)

            @staticmethod
            def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                a, b = ctx.saved_tensors
                return mm(dy, b.transpose(1, 2)), wgrad(a, dy)

        self.mm, self.wgrad, self.product = mm, wgrad, Product.apply

    def case(self, pass_: str) -> Case:
        mm = self.product if pass_ == "fwd+bwd" else self.mm
        return _gemm_case(pass_, mm, self.wgrad, self.p.x, self.p.w, self.p.dy)


METHODS: dict[str, Callable[[Problem], Method]] = {
    "dense": Dense,
    "dropless": Dropless,
    "torch_grouped_mm": TorchGroupedMM,
    "loop": Loop,
    "padded_bmm": PaddedBmm,
    "quack": Quack,
}
