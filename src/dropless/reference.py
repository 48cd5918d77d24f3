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


_SQRT_2_OVER_PI = 0.7978845608028654  # sqrt(2 / pi), the tanh approximation of GELU
_GELU_K = 0.044715


def _glu_gate(g: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor | float]:
    """``(s, du/dg)`` with ``act(g) = g * s`` and ``s = sigmoid(u(g))``: ``u = g`` for silu,
    ``u = 2c (g + k g^3)`` for gelu_tanh (``0.5 g (1 + tanh(z)) = g sigmoid(2z)``)."""
    if activation == "silu":
        return torch.sigmoid(g), 1.0
    if activation == "gelu_tanh":
        u = 2 * _SQRT_2_OVER_PI * (g + _GELU_K * g * g * g)
        return torch.sigmoid(u), 2 * _SQRT_2_OVER_PI * (1 + 3 * _GELU_K * g * g)
    raise ValueError(f"activation must be 'silu' or 'gelu_tanh', got {activation!r}")


def glu(h: torch.Tensor, activation: str) -> torch.Tensor:
    """Gated activation on the fused gate+up layout: ``a = act(h[:, :F]) * h[:, F:]``.

    h: ``[M, 2F]``, any strides; activation: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU, tanh
    approximation). Returns ``a [M, F]`` in h's dtype, computed in fp32 (fp64 for fp64 inputs).
    """
    compute = torch.float64 if h.dtype == torch.float64 else torch.float32
    g, u = h.to(compute).chunk(2, dim=1)
    s, _ = _glu_gate(g, activation)
    return (g * s * u).to(h.dtype)


def glu_backward(h: torch.Tensor, da: torch.Tensor, activation: str) -> torch.Tensor:
    """Gradient of ``glu`` recomputed from h: ``dh = [da * up * act'(gate) | da * act(gate)]``.

    h: ``[M, 2F]``, da: ``[M, F]``, any strides. ``act'(g) = s + g s (1 - s) du/dg``. Returns
    ``dh [M, 2F]`` in h's dtype, computed in fp32 (fp64 for fp64 inputs).
    """
    compute = torch.float64 if h.dtype == torch.float64 else torch.float32
    g, u = h.to(compute).chunk(2, dim=1)
    d = da.to(compute)
    s, du = _glu_gate(g, activation)
    # s (1 - s) is exactly 0 where s saturates; a huge du there must not make 0 * inf = NaN.
    slope = s * (1 - s)
    dact = s + torch.where(slope == 0, 0.0, g * slope * du)
    return torch.cat([d * u * dact, d * g * s], dim=1).to(h.dtype)


def _acc_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def permute(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort the ``T*k`` token copies by expert (stable: token order kept within an expert).

    x: ``[T, d]``; topk_ids: int ``[T, k]``, slot ``s = t*k + j``; ids outside ``[0, E)`` go to no
    local expert and sort last. Returns ``x_sorted [T*k, d]`` (x's dtype, zero rows past
    ``offsets[-1]``), ``sorted_to_token_slot`` int32 ``[T*k]``, ``group_sizes`` and ``offsets``
    int32 ``[E]``.
    """
    E = num_experts
    k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).long()
    ids = torch.where((ids >= 0) & (ids < E), ids, E)
    order = torch.argsort(ids, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
    group_sizes = counts[:E].to(torch.int32)
    offsets = torch.cumsum(counts[:E], 0).to(torch.int32)
    valid = ids[order] < E
    x_sorted = torch.where(valid[:, None], x[order // k], torch.zeros((), dtype=x.dtype, device=x.device))
    return x_sorted, order.to(torch.int32), group_sizes, offsets


def unpermute(y_sorted: torch.Tensor, sorted_to_token_slot: torch.Tensor, weights: torch.Tensor,
              offsets: torch.Tensor) -> torch.Tensor:
    """``y[t] = sum_j weights[t, j] * y_sorted[p(t*k + j)]`` over the copies sorted before ``offsets[-1]``.

    y_sorted: ``[T*k, d]``; sorted_to_token_slot: int ``[T*k]`` (the slot of each sorted row);
    weights: ``[T, k]``; offsets: int ``[E]``. Sums in fp32 (fp64 if an input is fp64), returns
    y_sorted's dtype.
    """
    T, k = weights.shape
    acc = _acc_dtype(y_sorted, weights)
    slot = sorted_to_token_slot.long()
    row_of_slot = torch.empty_like(slot).scatter_(0, slot, torch.arange(slot.shape[0], device=slot.device))
    valid = row_of_slot < offsets[-1]
    rows = torch.where(valid[:, None], y_sorted[row_of_slot].to(acc), 0.0)
    w = torch.where(valid, weights.reshape(-1).to(acc), 0.0)
    return (rows * w[:, None]).view(T, k, y_sorted.shape[1]).sum(1).to(y_sorted.dtype)


def unpermute_backward(dy: torch.Tensor, y_sorted: torch.Tensor, sorted_to_token_slot: torch.Tensor,
                       weights: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``unpermute`` given ``dy [T, d]``: ``dy_sorted[p] = weights[t, j] * dy[t]`` and
    ``dweights[t, j] = <dy[t], y_sorted[p]>``, both zero for the rows at or past ``offsets[-1]``.

    Returns ``dy_sorted [T*k, d]`` in dy's dtype and ``dweights [T, k]`` in weights' dtype (sums in
    fp32, or fp64).
    """
    T, k = weights.shape
    acc = _acc_dtype(dy, y_sorted, weights)
    slot = sorted_to_token_slot.long()
    valid = torch.arange(slot.shape[0], device=slot.device) < offsets[-1]
    dy_rows = torch.where(valid[:, None], dy[slot // k].to(acc), 0.0)
    w = torch.where(valid, weights.reshape(-1)[slot].to(acc), 0.0)
    dy_sorted = (dy_rows * w[:, None]).to(dy.dtype)
    dots = (dy_rows * torch.where(valid[:, None], y_sorted.to(acc), 0.0)).sum(1)
    dweights = torch.zeros(T * k, dtype=acc, device=dy.device).scatter_(0, slot, dots)
    return dy_sorted, dweights.view(T, k).to(weights.dtype)
