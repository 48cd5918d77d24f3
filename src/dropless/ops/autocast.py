"""Autocast for the grouped GEMMs: under ``torch.autocast`` their operands are cast as ``nn.Linear``'s are."""

from __future__ import annotations

import torch

_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def autocast_operands(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors in the autocast dtype when autocast is on for the first one's device type (fp32,
    fp16 and bf16 ones; fp64 is left alone, as autocast leaves it, and so is anything not a tensor);
    otherwise unchanged. The casts are differentiable, so gradients reach the original (e.g. fp32)
    parameters."""
    if not isinstance(tensors[0], torch.Tensor) or not torch.is_autocast_enabled(tensors[0].device.type):
        return tensors  # not tensors: the caller's checks name the argument
    dtype = torch.get_autocast_dtype(tensors[0].device.type)
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in _CASTABLE else t for t in tensors)
