"""Copies of the operands that TMA cannot read, padded so that it can, for the Hopper kernels.

A 16-bit operand whose rows are not a multiple of 16 bytes long (K or N odd, say 1001 or 2881) has a row
stride TMA cannot take, so its product would run on the pointer path at a quarter of the TMA kernels'
rate or less. A copy whose contiguous dimension is padded to 16 bytes (same logical shape, the pad never
read: TMA fills past the shape with zeros) costs one pass over the operand; an output TMA cannot write
then comes back from such a buffer in one more pass. An output alone is not padded: the Triton kernels'
TMA loads and pointer stores beat a padded output and its copy back (probe_odd_shapes: the input gradient
at K = 2881, 546 against 442 TFLOP/s).
"""

from __future__ import annotations

import torch

from dropless.kernels.launch import LaunchInfo

_ALIGN = 16  # bytes


def padded_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized tensor of t's shape and dtype, last dim contiguous, every other stride a multiple
    of 16 bytes (the last dim's storage padded); the Hopper kernels' TMA can read and write it."""
    per = _ALIGN // t.element_size()
    padded = -(-t.shape[-1] // per) * per
    return torch.empty(*t.shape[:-1], padded, dtype=t.dtype, device=t.device)[..., :t.shape[-1]]


def readable(t: torch.Tensor) -> torch.Tensor:
    """t itself where TMA can read it as laid out, else a padded copy (``padded_like``)."""
    return t if LaunchInfo.tma_ok(t) else padded_like(t).copy_(t)


def run_into_readable(c: torch.Tensor, keep: bool, product) -> None:
    """``product(c2)`` into c2 = c where TMA can write it, else into a padded buffer (holding c's values
    first where ``keep``: rows or experts the product leaves as they are) that is then copied into c."""
    if LaunchInfo.tma_ok(c):
        product(c)
        return
    c2 = padded_like(c)
    if keep:
        c2.copy_(c)
    product(c2)
    c.copy_(c2)
