"""The operands every method of one benchmark case shares, and the useful FLOPs of each pass."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from dropless.bench.shapes import Shape

PASSES = ("fwd", "dgrad", "wgrad", "fwd+bwd")


def useful_flops(shape: Shape, pass_: str) -> int:
    """``2*M*K*N`` for one GEMM pass, ``6*M*K*N`` for forward+backward; padding never counts."""
    if pass_ not in PASSES:
        raise ValueError(f"pass must be one of {PASSES}, got {pass_!r}")
    return (6 if pass_ == "fwd+bwd" else 2) * shape.M * shape.K * shape.N


@dataclass
class Problem:
    """Random operands of one (shape, routing) case, on the device that runs it.

    x: ``[M, K]`` rows sorted by expert. w: ``[E, K, N]`` stacked expert weights (contiguous).
    dy: ``[M, N]`` the gradient of the output. All three in ``dtype``, random normal (never zeros).
    offsets: int32 ``[E]`` cumulative group ends on the device. sizes: the same groups as host ints.
    """

    shape: Shape
    x: torch.Tensor
    w: torch.Tensor
    dy: torch.Tensor
    offsets: torch.Tensor
    sizes: list[int]


def make_problem(shape: Shape, sizes: list[int], dtype: torch.dtype, device: torch.device,
                 seed: int = 0) -> Problem:
    """Fresh operands for ``shape`` with the given group sizes (which must sum to M)."""
    if len(sizes) != shape.E or sum(sizes) != shape.M:
        raise ValueError(f"sizes must be E={shape.E} ints summing to M={shape.M}")
    gen = torch.Generator(device=device).manual_seed(seed)
    M, K, N, E = shape.M, shape.K, shape.N, shape.E
    x = torch.randn(M, K, generator=gen, device=device, dtype=dtype)
    # Scaled as an initialized layer would be, so outputs stay near unit size.
    w = torch.randn(E, K, N, generator=gen, device=device, dtype=dtype).mul_(K ** -0.5)
    dy = torch.randn(M, N, generator=gen, device=device, dtype=dtype)
    offsets = torch.tensor(np.cumsum(sizes), dtype=torch.int32, device=device)
    return Problem(shape, x, w, dy, offsets, list(sizes))
