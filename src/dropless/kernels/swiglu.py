"""Gated activations of the MoE experts (SwiGLU, GeGLU), on the fused gate+up layout, with an optional
FP8 copy of the output for the down projection.

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

The quantized copy is ``a`` quantized along F (the down projection's K) as ``dropless.quantize(a,
recipe, dim=-1)`` does it, bit for bit: it is made from the values of ``a`` as stored (rounded to a's
dtype), not from the fp32 products, so that the down projection's forward (this copy) and its weight
gradient (``a`` quantized along the tokens) see one and the same ``a``, and an FP8 layer gives the
bits it gives without the fusion. The quantization itself is ``kernels/fp8_math.py``'s (``block_scale``,
``to_fp8``), so the two cannot drift apart. ``a`` is still written: the weight gradient and autograd
need it.
- block128 / mxfp8 (1 x B blocks along F): the tiles of the 2-D grid span whole blocks (BLOCK_F a
  multiple of B, masked past F), so each program quantizes its own tile from registers. h is read
  once, ``a``, the data and the scales are written once.
- rowwise (one scale per row over all F): a program owns BLOCK_M whole rows. When a row fits in one
  tile (F <= 4096) the scale is the tile's row maximum and everything stays in registers. Wider rows
  walk F twice: the first loop writes ``a`` and takes the row maximum, the second reads ``a`` back and
  quantizes it. Reading ``a`` back rather than recomputing it from h costs half the bytes (F elements
  a row against h's 2F), and they come from L2, where the row this program just wrote still is (a
  program owns one row then: 28 KiB at F = 14336 in bf16), so DRAM sees h read once and ``a`` written
  once. A barrier orders the two loops, as the second may read elements other threads wrote.

A 2-D grid of programs, one per ``BLOCK_M x BLOCK_F`` tile of ``a``: row blocks on grid axis 0
(up to 2^31 - 1 of them), column blocks on axis 1 (at most 65535; one column block for rowwise).
Row and column offsets are 64-bit, so ``M * 2F`` (or a large row stride) can exceed 2^31. Every
operand is addressed through its strides; unit column strides are specialized by Triton at compile
time and vectorize.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dropless.kernels.direct_launch import DirectLaunch
from dropless.kernels.launch import cdiv, interpreting, launch_info, next_power_of_2
from dropless.kernels.fp8_math import block_scale, magnitude, to_fp8
from dropless.kernels.quantize import scale_bits
from dropless.quantized import Recipe

ACTIVATIONS = ("silu", "gelu_tanh")

# Elements of ``a`` per program: 16 per thread with 8 warps, enough work to hide the latency of an
# elementwise kernel without starving the grid on small M.
_BLOCK_ELEMENTS = 4096
_MAX_BLOCK_F = 256
# Rowwise: the widest row one tile holds (the same 16 elements a thread); wider rows take two loops.
_MAX_ROW_BLOCK_F = _BLOCK_ELEMENTS
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
def _load_gate_up(h_rows, cols, mask, F, stride_hf):
    """The gate and up columns ``cols`` of the rows ``h_rows``, in fp32 (0 where masked)."""
    # The up half starts F columns on: cols + F stays 64-bit, so a large column stride cannot overflow.
    g = tl.load(h_rows + cols[None, :] * stride_hf, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_rows + (cols + F)[None, :] * stride_hf, mask=mask, other=0.0).to(tl.float32)
    return g, u


@triton.jit
def _forward_tile(h_rows, out_rows, cols, mask, F, stride_hf, stride_of, ACTIVATION: tl.constexpr):
    """Write the tile ``a = act(gate) * up`` and return it as written (rounded to out's dtype) in fp32,
    0 where masked."""
    g, u = _load_gate_up(h_rows, cols, mask, F, stride_hf)
    a = (g * _gate_sigmoid(g, ACTIVATION) * u).to(out_rows.dtype.element_ty)
    tl.store(out_rows + cols[None, :] * stride_of, a, mask=mask)
    return a.to(tl.float32)


@triton.jit
def _backward_tile(h_rows, da_rows, out_rows, cols, mask, F, stride_hf, stride_daf, stride_of,
                   ACTIVATION: tl.constexpr):
    """Write the tile's ``[dgate | dup]`` columns and return them as written (rounded to out's dtype) in
    fp32, 0 where masked."""
    g, u = _load_gate_up(h_rows, cols, mask, F, stride_hf)
    s = _gate_sigmoid(g, ACTIVATION)
    d = tl.load(da_rows + cols[None, :] * stride_daf, mask=mask, other=0.0).to(tl.float32)
    dgate = (d * u * _gate_derivative(g, s, ACTIVATION)).to(out_rows.dtype.element_ty)
    dup = (d * (g * s)).to(out_rows.dtype.element_ty)
    tl.store(out_rows + cols[None, :] * stride_of, dgate, mask=mask)
    tl.store(out_rows + (cols + F)[None, :] * stride_of, dup, mask=mask)
    return dgate.to(tl.float32), dup.to(tl.float32)


@triton.jit
def _glu_kernel(
    h, da, out, data, scale, rows_ptr,
    M, F, SCALE_COLS,
    stride_hm, stride_hf, stride_dam, stride_daf, stride_om, stride_of, stride_qm, stride_sm,
    ACTIVATION: tl.constexpr, BACKWARD: tl.constexpr, QUANTIZE: tl.constexpr, QBLOCK: tl.constexpr,
    MX: tl.constexpr, POW2: tl.constexpr, RCEIL: tl.constexpr, EMULATE_FP8: tl.constexpr,
    HAS_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_F: tl.constexpr,
):
    """Forward: ``out [M, F] = act(gate) * up``. Backward: ``out [M, 2F] = [dgate | dup]``.

    QUANTIZE: also write the output quantized along its row, ``data`` (``[M, F]`` forward, ``[M, 2F]``
    backward; unit column stride) and ``scale [M, SCALE_COLS]`` (fp32, or E8M0 bytes when MX). Forward,
    one scale per QBLOCK columns of a tile (BLOCK_F a multiple of it; QBLOCK = BLOCK_F >= F for a rowwise
    row in one tile); backward, rowwise only: one scale over both halves of a row in one tile (QBLOCK =
    BLOCK_F >= F). QBLOCK = 0: one scale per row wider than a tile, the program walking its rows twice.

    HAS_ROWS: only the first ``rows_ptr[0]`` rows (read on the device) are computed; the rest of the
    outputs is not touched.
    """
    pid_m = tl.program_id(0)
    pid_f = tl.program_id(1)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    if HAS_ROWS:
        computed = tl.load(rows_ptr)
        # A program past the computed rows stops before any work: masked off, its tile's arithmetic
        # (the sigmoid, the quantization's divisions) cost as much as a real one's (v26).
        if pid_m.to(tl.int64) * BLOCK_M >= computed:
            return
        row_ok = (rows < M) & (rows < computed)
    else:
        row_ok = rows < M
    h_rows = h + rows[:, None] * stride_hm
    da_rows = da + rows[:, None] * stride_dam
    out_rows = out + rows[:, None] * stride_om
    data_rows = data + rows[:, None] * stride_qm

    if QUANTIZE and QBLOCK == 0:
        amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for f0 in range(0, F, BLOCK_F):
            cols = f0 + tl.arange(0, BLOCK_F).to(tl.int64)
            mask = row_ok[:, None] & (cols < F)[None, :]
            if BACKWARD:
                dgate, dup = _backward_tile(h_rows, da_rows, out_rows, cols, mask, F, stride_hf, stride_daf,
                                            stride_of, ACTIVATION)
                amax = tl.maximum(amax, tl.maximum(tl.max(magnitude(dgate), axis=1), tl.max(magnitude(dup), axis=1)))
            else:
                a = _forward_tile(h_rows, out_rows, cols, mask, F, stride_hf, stride_of, ACTIVATION)
                amax = tl.maximum(amax, tl.max(magnitude(a), axis=1))
        s = block_scale(amax, False, POW2, False)
        # The second loop reads back what every thread of the program wrote in the first.
        tl.debug_barrier()
        for f0 in range(0, F, BLOCK_F):
            cols = f0 + tl.arange(0, BLOCK_F).to(tl.int64)
            mask = row_ok[:, None] & (cols < F)[None, :]
            a = tl.load(out_rows + cols[None, :] * stride_of, mask=mask, other=0.0).to(tl.float32)
            tl.store(data_rows + cols[None, :], to_fp8(a, s[:, None], False, EMULATE_FP8), mask=mask)
            if BACKWARD:
                dup = tl.load(out_rows + (cols + F)[None, :] * stride_of, mask=mask, other=0.0).to(tl.float32)
                tl.store(data_rows + (cols + F)[None, :], to_fp8(dup, s[:, None], False, EMULATE_FP8),
                         mask=mask)
        tl.store(scale + rows * stride_sm, s, mask=row_ok)
    else:
        cols = pid_f.to(tl.int64) * BLOCK_F + tl.arange(0, BLOCK_F)
        mask = row_ok[:, None] & (cols < F)[None, :]
        if BACKWARD:
            dgate, dup = _backward_tile(h_rows, da_rows, out_rows, cols, mask, F, stride_hf, stride_daf, stride_of,
                                        ACTIVATION)
            if QUANTIZE:
                # The whole row is in the tile (masked elements are 0): one scale over both halves.
                amax = tl.maximum(tl.max(magnitude(dgate), axis=1), tl.max(magnitude(dup), axis=1))
                s = block_scale(amax, False, POW2, False)
                tl.store(data_rows + cols[None, :], to_fp8(dgate, s[:, None], False, EMULATE_FP8), mask=mask)
                tl.store(data_rows + (cols + F)[None, :], to_fp8(dup, s[:, None], False, EMULATE_FP8),
                         mask=mask)
                tl.store(scale + rows * stride_sm, s, mask=row_ok)
        else:
            a = _forward_tile(h_rows, out_rows, cols, mask, F, stride_hf, stride_of, ACTIVATION)
            if QUANTIZE:
                # Masked elements are 0, so they never raise a block's amax.
                a3 = tl.reshape(a, (BLOCK_M, BLOCK_F // QBLOCK, QBLOCK))
                s = block_scale(tl.max(magnitude(a3), axis=2), MX, POW2, RCEIL)
                q = tl.reshape(to_fp8(a3, s[:, :, None], MX, EMULATE_FP8), (BLOCK_M, BLOCK_F))
                tl.store(data_rows + cols[None, :], q, mask=mask)
                blocks = pid_f * (BLOCK_F // QBLOCK) + tl.arange(0, BLOCK_F // QBLOCK)
                tl.store(scale + rows[:, None] * stride_sm + blocks[None, :], s.to(scale.dtype.element_ty),
                         mask=row_ok[:, None] & (blocks < SCALE_COLS)[None, :])


def _tile_f(F: int, recipe: Recipe | None) -> tuple[int, int]:
    """``(BLOCK_F, QBLOCK)``: the tile width along F and the columns per scale inside it (0: one scale a
    row over several tiles). Blockwise tiles span whole blocks; rowwise ones the whole row if it fits."""
    block_f = max(next_power_of_2(F), 16)
    if recipe is None:
        return min(block_f, _MAX_BLOCK_F), 0
    if recipe.block is not None:
        block_f = max(min(block_f, _MAX_BLOCK_F), recipe.block)
        return block_f, recipe.block
    if block_f <= _MAX_ROW_BLOCK_F:
        return block_f, block_f
    return _MAX_ROW_BLOCK_F, 0


_GLU = DirectLaunch(_glu_kernel)


def _launch(h: torch.Tensor, da: torch.Tensor | None, out: torch.Tensor, activation: str,
            data: torch.Tensor | None = None, scale: torch.Tensor | None = None, recipe: Recipe | None = None,
            rows: torch.Tensor | None = None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    launch_info(h.device)  # a clear error for a CPU tensor outside the interpreter
    M, F = h.shape[0], h.shape[1] // 2
    quantize = recipe is not None
    # Rows of no columns still get their rowwise scale (1), as dropless.quantize writes it.
    if M == 0 or (F == 0 and not quantize):
        return
    block_f, qblock = _tile_f(F, recipe)
    block_m = max(_BLOCK_ELEMENTS // block_f, 1)
    grid = (cdiv(M, block_m), 1 if quantize and recipe.block is None else max(cdiv(F, block_f), 1))
    backward = da is not None
    da_arg = da if backward else h  # unread in the forward; any tensor fills the slot
    data_arg = data if quantize else out  # likewise unread without a quantized copy
    scale_arg = scale_bits(scale) if quantize else out
    _GLU(
        grid, h=h, da=da_arg, out=out, data=data_arg, scale=scale_arg, rows_ptr=rows if rows is not None else out,
        M=M, F=F, SCALE_COLS=scale.shape[1] if quantize else 0,
        stride_hm=h.stride(0), stride_hf=h.stride(1), stride_dam=da_arg.stride(0), stride_daf=da_arg.stride(1),
        stride_om=out.stride(0), stride_of=out.stride(1), stride_qm=data_arg.stride(0), stride_sm=scale_arg.stride(0),
        ACTIVATION=activation, BACKWARD=backward, QUANTIZE=quantize, QBLOCK=qblock,
        MX=quantize and recipe.name == "mxfp8", POW2=quantize and recipe.pow2,
        RCEIL=quantize and recipe.mx_rounding == "rceil", EMULATE_FP8=interpreting(),
        HAS_ROWS=rows is not None, BLOCK_M=block_m, BLOCK_F=block_f,
        num_warps=_NUM_WARPS,
    )


def glu_forward(h: torch.Tensor, a: torch.Tensor, activation: str, rows: torch.Tensor | None = None) -> None:
    """Write ``a [M, F] = act(h[:, :F]) * h[:, F:]``; arguments are already checked by the caller.

    h: ``[M, 2F]``, a: ``[M, F]``, any strides, on one device (CUDA, or the CPU under the
    interpreter); bf16, fp16 or fp32. activation: ``"silu"`` or ``"gelu_tanh"``. rows: int ``[1]`` on
    the device: only the first ``rows[0]`` rows are written (every function here takes it).
    """
    _launch(h, None, a, activation, rows=rows)


def glu_forward_quantized(h: torch.Tensor, a: torch.Tensor, data: torch.Tensor, scale: torch.Tensor,
                          activation: str, recipe: Recipe, rows: torch.Tensor | None = None) -> None:
    """``glu_forward``, and ``a`` quantized along F with ``recipe`` into ``data`` and ``scale``, from the
    same read of h; arguments are already checked by the caller.

    recipe: an activation recipe, ``"rowwise"``, ``"block128"`` or ``"mxfp8"`` (any pow2 / mx_rounding).
    data: float8_e4m3fn ``[M, F]``, unit column stride; scale: contiguous, ``[M, 1]`` (rowwise) or
    ``[M, cdiv(F, block)]``, fp32 or float8_e8m0fnu (mxfp8). They hold ``dropless.quantize(a, recipe,
    dim=-1)``'s bits: the quantization reads a's values as written, in a's dtype. Every element of a,
    data and scale is written; nothing syncs with the host.
    """
    _launch(h, None, a, activation, data, scale, recipe, rows)


def glu_backward(h: torch.Tensor, da: torch.Tensor, dh: torch.Tensor, activation: str,
                 rows: torch.Tensor | None = None,
                 quantized: tuple[torch.Tensor, torch.Tensor, Recipe] | None = None) -> None:
    """Write ``dh [M, 2F] = [da * up * act'(gate) | da * act(gate)]``, recomputing act from h.

    h: ``[M, 2F]``, da: ``[M, F]`` (zero strides allowed: a broadcast gradient), dh: ``[M, 2F]``,
    any strides (dh may be h itself: each tile's h is read before its dh is written); arguments are
    already checked by the caller. ``quantized``: ``(data, scale, recipe)`` with a rowwise recipe: also
    write dh quantized along 2F, ``dropless.quantize(dh, recipe, dim=-1)``'s bits, data float8_e4m3fn
    ``[M, 2F]`` (unit column stride), scale fp32 ``[M, 1]``.
    """
    data, scale, recipe = quantized if quantized is not None else (None, None, None)
    if recipe is not None and recipe.block is not None:
        raise ValueError(f"glu_backward quantizes dh rowwise only, got recipe {recipe.name!r}")
    _launch(h, da, dh, activation, data, scale, recipe, rows)
