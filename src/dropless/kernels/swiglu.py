"""Gated activations of the MoE experts (SwiGLU, GeGLU), on the fused gate+up layout.

    h = [gate | up]   [M, 2F]: the output of the fused gate+up grouped GEMM
    a = act(gate) * up                                   [M, F]
    dgate = da * up * act'(gate),  dup = da * act(gate)  dh = [dgate | dup]  [M, 2F]

Both activations are ``g * sigmoid(u(g))``, which gives one formula for the value and the derivative:

    silu:       u = g                                    du/dg = 1
    gelu_tanh:  u = 2c (g + k g^3), c = sqrt(2/pi), k = 0.044715     du/dg = 2c (1 + 3k g^2)
                (0.5 g (1 + tanh(z)) = g sigmoid(2z), so no tanh, and no cancellation in 1 + tanh)
    act(g) = g s,   act'(g) = s + g s (1 - s) du/dg,     s = sigmoid(u)

``sigmoid(u) = 1 / (1 + exp(-u))`` saturates cleanly: exp overflows to inf for u << 0 and s becomes 0,
never NaN. The math runs in fp32 whatever the storage dtype. The backward recomputes act from h
rather than reading a saved ``a``: one read of h instead of a second [M, F] tensor kept alive.

A 2-D grid of programs, one per ``BLOCK_M x BLOCK_F`` tile of ``a``: row blocks on grid axis 0
(up to 2^31 - 1 of them), column blocks on axis 1 (at most 65535). Row and column offsets are
64-bit, so ``M * 2F`` (or a large row stride) can exceed 2^31. Every operand is addressed through its
strides; unit column strides are specialized by Triton at compile time and vectorize.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dropless.kernels.launch import cdiv, launch_info, next_power_of_2

ACTIVATIONS = ("silu", "gelu_tanh")

# Elements of ``a`` per program: 16 per thread with 8 warps, enough work to hide the latency of an
# elementwise kernel without starving the grid on small M.
_BLOCK_ELEMENTS = 4096
_MAX_BLOCK_F = 256
_NUM_WARPS = 8
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
GELU_K = tl.constexpr(0.044715)


@triton.jit
def _gate_sigmoid(g, ACTIVATION: tl.constexpr):
    """``s = sigmoid(u(g))`` in fp32, so that ``act(g) = g * s``."""
    if ACTIVATION == "silu":
        return tl.sigmoid(g)
    return tl.sigmoid(2.0 * SQRT_2_OVER_PI * (g + GELU_K * g * g * g))


@triton.jit
def _gate_derivative(g, s, ACTIVATION: tl.constexpr):
    """``act'(g) = s + g s (1 - s) du/dg`` in fp32."""
    if ACTIVATION == "silu":
        du = 1.0
    else:
        du = 2.0 * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_K * g * g)
    # s (1 - s) is exactly 0 where s saturates; there a huge du (|g| > 1e19) must not make 0 * inf = NaN.
    slope = s * (1.0 - s)
    return s + tl.where(slope == 0.0, 0.0, g * slope * du)


@triton.jit
def _glu_kernel(
    h, da, out,
    M, F,
    stride_hm, stride_hf, stride_dam, stride_daf, stride_om, stride_of,
    ACTIVATION: tl.constexpr, BACKWARD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """Forward: ``out [M, F] = act(gate) * up``. Backward: ``out [M, 2F] = [dgate | dup]``."""
    pid_m = tl.program_id(0)
    pid_f = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_f.to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < M)[:, None] & (cols < F)[None, :]

    # The up half starts F columns on: cols + F stays 64-bit, so a large column stride cannot overflow.
    h_rows = h + rows[:, None] * stride_hm
    g = tl.load(h_rows + cols[None, :] * stride_hf, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_rows + (cols + F)[None, :] * stride_hf, mask=mask, other=0.0).to(tl.float32)
    s = _gate_sigmoid(g, ACTIVATION)
    act = g * s

    out_rows = out + rows[:, None] * stride_om
    if BACKWARD:
        d = tl.load(da + rows[:, None] * stride_dam + cols[None, :] * stride_daf, mask=mask, other=0.0)
        d = d.to(tl.float32)
        dgate = d * u * _gate_derivative(g, s, ACTIVATION)
        tl.store(out_rows + cols[None, :] * stride_of, dgate.to(out.dtype.element_ty), mask=mask)
        tl.store(out_rows + (cols + F)[None, :] * stride_of, (d * act).to(out.dtype.element_ty), mask=mask)
    else:
        tl.store(out_rows + cols[None, :] * stride_of, (act * u).to(out.dtype.element_ty), mask=mask)


def _launch(h: torch.Tensor, da: torch.Tensor | None, out: torch.Tensor, activation: str) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    launch_info(h.device)  # a clear error for a CPU tensor outside the interpreter
    M, F = h.shape[0], h.shape[1] // 2
    if M == 0 or F == 0:
        return
    block_f = min(max(next_power_of_2(F), 16), _MAX_BLOCK_F)
    block_m = _BLOCK_ELEMENTS // block_f
    grid = (cdiv(M, block_m), cdiv(F, block_f))
    backward = da is not None
    da_arg = da if backward else h  # unread in the forward; any tensor fills the slot
    _glu_kernel[grid](
        h, da_arg, out,
        M, F,
        h.stride(0), h.stride(1), da_arg.stride(0), da_arg.stride(1), out.stride(0), out.stride(1),
        ACTIVATION=activation, BACKWARD=backward, BLOCK_M=block_m, BLOCK_F=block_f,
        num_warps=_NUM_WARPS,
    )


def glu_forward(h: torch.Tensor, a: torch.Tensor, activation: str) -> None:
    """Write ``a [M, F] = act(h[:, :F]) * h[:, F:]``; arguments are already checked by the caller.

    h: ``[M, 2F]``, a: ``[M, F]``, any strides, on one device (CUDA, or the CPU under the
    interpreter); bf16, fp16 or fp32. activation: ``"silu"`` or ``"gelu_tanh"``.
    """
    _launch(h, None, a, activation)


def glu_backward(h: torch.Tensor, da: torch.Tensor, dh: torch.Tensor, activation: str) -> None:
    """Write ``dh [M, 2F] = [da * up * act'(gate) | da * act(gate)]``, recomputing act from h.

    h: ``[M, 2F]``, da: ``[M, F]`` (zero strides allowed: a broadcast gradient), dh: ``[M, 2F]``,
    any strides; arguments are already checked by the caller.
    """
    _launch(h, da, dh, activation)
