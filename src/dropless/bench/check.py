"""The fp32 oracle each method's results are checked against before they are timed."""

from __future__ import annotations

import math

import torch

from dropless import reference
from dropless.bench.problem import Problem

# Largest accepted relative Frobenius error ||out - ref|| / ||ref||, by the dtype of the operands.
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref||_F / ||ref||_F`` computed in fp32; NaN or inf if ``out`` holds any."""
    if out.shape != ref.shape:
        raise ValueError(f"result has shape {tuple(out.shape)}, the reference {tuple(ref.shape)}")
    ref = ref.float()
    diff = torch.linalg.vector_norm(out.float() - ref).item()
    scale = torch.linalg.vector_norm(ref).item()
    return diff / scale if scale > 0 else diff


def max_rel_err(outs: tuple[torch.Tensor, ...], refs: tuple[torch.Tensor, ...]) -> float:
    """The largest ``rel_err`` over matching results (NaN wins, so a NaN result fails)."""
    if len(outs) != len(refs):
        raise ValueError(f"{len(outs)} results for {len(refs)} references")
    errs = [rel_err(o, r) for o, r in zip(outs, refs)]
    return math.nan if any(math.isnan(e) for e in errs) else max(errs)


class References:
    """fp32 results of every pass of one ``Problem``, computed on its device when first asked for.

    ``grouped``: per-group products of the upcast operands (``dropless.reference``, a host loop over
    groups: a sync, at setup only). ``dense``: the same products with all M rows against ``w[0]``.
    Layouts: fwd ``(y [M, N],)``, dgrad ``(dx [M, K],)``, wgrad ``(dw,)``, fwd+bwd ``(y, dx, dw)``;
    ``dw`` is ``[E, K, N]`` for ``grouped`` and ``[K, N]`` for ``dense``.
    """

    def __init__(self, p: Problem) -> None:
        self.p = p
        self._cache: dict[tuple[str, str], torch.Tensor] = {}

    def get(self, oracle: str, pass_: str) -> tuple[torch.Tensor, ...]:
        if pass_ == "fwd+bwd":
            return tuple(self._one(oracle, part) for part in ("fwd", "dgrad", "wgrad"))
        return (self._one(oracle, pass_),)

    def _one(self, oracle: str, pass_: str) -> torch.Tensor:
        key = (oracle, pass_)
        if key not in self._cache:
            self._cache[key] = self._compute(oracle, pass_)
        return self._cache[key]

    def _compute(self, oracle: str, pass_: str) -> torch.Tensor:
        x, dy, offsets = self.p.x.float(), self.p.dy.float(), self.p.offsets
        if oracle == "grouped":
            if pass_ == "fwd":
                return reference.grouped_mm(x, self.p.w.float(), offsets)
            if pass_ == "dgrad":
                return reference.grouped_mm(dy, self.p.w.float().transpose(1, 2), offsets)
            if pass_ == "wgrad":
                return reference.grouped_mm_wgrad(x, dy, offsets)
        elif oracle == "dense":
            w0 = self.p.w[0].float()
            if pass_ == "fwd":
                return x @ w0
            if pass_ == "dgrad":
                return dy @ w0.t()
            if pass_ == "wgrad":
                return x.t() @ dy
        raise ValueError(f"no reference for oracle {oracle!r}, pass {pass_!r}")
