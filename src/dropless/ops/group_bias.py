"""Per-group bias: ``y[rows of group e] += bias[e]``, its gradient summed per group in fp32."""

from __future__ import annotations

import torch


class _GroupBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, bias, offsets):
        rows = torch.arange(y.shape[0], device=y.device, dtype=offsets.dtype)
        group = torch.searchsorted(offsets, rows, right=True)
        ctx.save_for_backward(group)
        ctx.num_groups = bias.shape[0]
        ctx.bias_dtype = bias.dtype
        padded = torch.cat([bias, bias.new_zeros(1, bias.shape[1])])
        return y + padded[group].to(y.dtype)

    @staticmethod
    def backward(ctx, dy):
        (group,) = ctx.saved_tensors
        sums = dy.new_zeros(ctx.num_groups + 1, dy.shape[1], dtype=torch.float32)
        sums.index_add_(0, group, dy.float())
        return dy, sums[:-1].to(ctx.bias_dtype), None


def add_group_bias(y: torch.Tensor, bias: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``y [M, N]`` plus ``bias[e] ([E, N])`` on the rows of group e; rows past ``offsets[-1]`` get none.

    offsets: int ``[E]`` cumulative group ends on y's device (each row's group is found there, no
    host sync). The bias gradient sums each group's rows in fp32 and is returned in bias's dtype.
    """
    return _GroupBias.apply(y, bias, offsets)
