"""Pure-PyTorch implementations of every dropless op: the CPU backend and the test oracle.

These read group boundaries on the host (``offsets.tolist()``), which is free on the CPU and a
device-to-host sync on a GPU: they are the oracle, not the fast path.
"""

from __future__ import annotations

import torch


def group_bounds(offsets: torch.Tensor, M: int) -> list[tuple[int, int]]:
    """``(start, end)`` row range of each group, clamped to ``[0, M]`` as the kernels clamp them."""
    ends = [min(max(int(end), 0), M) for end in offsets.tolist()]  # sync-ok: oracle
    bounds = []
    start = 0
    for end in ends:
        bounds.append((start, max(start, end)))
        start = max(start, end)
    return bounds


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Ragged-M grouped GEMM: ``y[s_e:t_e] = x[s_e:t_e] @ w[e]``.

    x: ``[M, K]``, w: ``[E, K, N]`` (any strides), offsets: int ``[E]`` cumulative group ends.
    Returns ``y [M, N]`` in ``x.dtype``; rows past ``offsets[-1]`` are zero. Products accumulate
    in at least fp32.
    """
    M, N = x.shape[0], w.shape[2]
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = torch.zeros(M, N, dtype=acc_dtype, device=x.device)
    for e, (start, end) in enumerate(group_bounds(offsets, M)):
        if end > start:
            y[start:end] = x[start:end].to(acc_dtype) @ w[e].to(acc_dtype)
    return y.to(x.dtype)


def grouped_mm_wgrad(x: torch.Tensor, dy: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Ragged-K grouped GEMM: ``dw[e] = x[s_e:t_e]^T @ dy[s_e:t_e]``, zero for an empty group.

    x: ``[M, K]``, dy: ``[M, N]``, offsets: int ``[E]``. Returns ``dw [E, K, N]`` in fp32 (fp64 for
    fp64 inputs); callers cast or accumulate.
    """
    M, K, N = x.shape[0], x.shape[1], dy.shape[1]
    acc_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    bounds = group_bounds(offsets, M)
    dw = torch.zeros(len(bounds), K, N, dtype=acc_dtype, device=x.device)
    for e, (start, end) in enumerate(bounds):
        if end > start:
            dw[e] = x[start:end].to(acc_dtype).t() @ dy[start:end].to(acc_dtype)
    return dw


def accumulate_into(out: torch.Tensor, dw: torch.Tensor, accumulate: bool | torch.Tensor) -> None:
    """Write ``dw`` into ``out`` in place: experts whose flag is True add, the others overwrite."""
    if isinstance(accumulate, torch.Tensor):
        flags = accumulate.to(device=out.device, dtype=torch.bool).view(-1, 1, 1)
        out.copy_(torch.where(flags, out + dw.to(out.dtype), dw.to(out.dtype)))
    elif accumulate:
        out.add_(dw.to(out.dtype))
    else:
        out.copy_(dw)
