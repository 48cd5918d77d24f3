"""FP8 rows back to 16/32-bit: ``out = data * scale`` for data quantized along its last dim.

    data: float8_e4m3fn ``[M, K]`` row-major; scale: ``[M, 1]`` (rowwise, fp32) or ``[M, cdiv(K, block)]``
    (fp32, or E8M0 bytes for mxfp8), contiguous; out: ``[M, K]`` row-major, bf16/fp16/fp32.

One pass, each element read once (1 byte) and written once: the product is taken in fp32 and rounded
to out's dtype once, as ``dropless.reference.dequantize(q).to(dtype)`` computes it, bit for bit. E8M0
scales are exact powers of two built from their bits (``2**(b - 127)``; byte 0 is ``2**-127``, 255 NaN).
Under ``TRITON_INTERPRET=1`` (``EMULATE``) the e4m3 bytes are decoded with integer operations, and a
bf16 result is rounded to nearest even by hand: the interpreter's own cast truncates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dropless.kernels.launch import cdiv, interpreting, launch_info


@triton.jit
def _e4m3_to_fp32(byte):
    """float8_e4m3fn bits (int32 in [0, 255]) to fp32: normal ``(1 + m/8) 2**(e - 7)``, subnormal
    ``m/8 2**-6``, ``S.1111.111`` NaN."""
    sign = tl.where((byte & 0x80) != 0, -1.0, 1.0)
    exponent = (byte >> 3) & 0xF
    mantissa = (byte & 0x7).to(tl.float32)
    normal = (1.0 + mantissa / 8.0) * tl.exp2((exponent - 7).to(tl.float32))
    value = tl.where(exponent == 0, mantissa / 8.0 * 0.015625, normal)
    return tl.where((byte & 0x7F) == 0x7F, float("nan"), sign * value)


@triton.jit
def _round_to_bf16(v):
    """fp32 ``v`` rounded to the nearest bf16 (ties to even), still as fp32; NaN stays NaN."""
    bits = v.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return tl.where(v == v, rounded.to(tl.float32, bitcast=True), v)


@triton.jit
def _dequantize_rows_kernel(
    data, scale, out, rows_ptr, M, K, SCALE_COLS,
    BLOCK: tl.constexpr, MX: tl.constexpr, EMULATE: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One ``BLOCK_M x BLOCK_K`` tile of ``out``. BLOCK: elements per scale along K (0: one per row).
    HAS_ROWS: only the first ``rows_ptr[0]`` rows (read on the device)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    if HAS_ROWS:
        row_ok = (rows < M) & (rows < tl.load(rows_ptr))
    else:
        row_ok = rows < M
    mask = row_ok[:, None] & (cols < K)[None, :]
    offsets = rows.to(tl.int64)[:, None] * K + cols[None, :]
    if EMULATE:
        q = _e4m3_to_fp32(tl.load(data.to(tl.pointer_type(tl.uint8)) + offsets, mask=mask, other=0).to(tl.int32))
    else:
        q = tl.load(data + offsets, mask=mask, other=0.0).to(tl.float32)
    if BLOCK == 0:
        s = tl.load(scale + rows, mask=row_ok, other=1.0)[:, None]
    else:
        s = tl.load(scale + rows.to(tl.int64)[:, None] * SCALE_COLS + (cols // BLOCK)[None, :], mask=mask, other=0)
    if MX:
        bits = s.to(tl.int32)
        bits = tl.where(bits == 0, 0x400000, tl.where(bits == 255, 0x7FC00000, bits << 23))
        s = bits.to(tl.float32, bitcast=True)
    y = q * s
    if EMULATE and out.dtype.element_ty == tl.bfloat16:
        y = _round_to_bf16(y)
    tl.store(out + offsets, y.to(out.dtype.element_ty), mask=mask)


def dequantize_rows(data: torch.Tensor, scale: torch.Tensor, block: int, mx: bool, out: torch.Tensor,
                    rows: torch.Tensor | None = None) -> None:
    """Write ``data * scale`` into ``out`` (arguments as the module docstring lays them out, already
    checked; ``block``: elements per scale along K, 0 for one scale per row; ``mx``: E8M0 scales,
    passed as their bytes; ``rows``: int ``[1]`` on the device, only that many first rows written)."""
    launch_info(data.device)
    M, K = data.shape
    if M == 0 or K == 0:
        return
    block_k = 128 if K >= 128 else max(triton.next_power_of_2(K), 16)
    block_m = max(4096 // block_k, 1)
    _dequantize_rows_kernel[(cdiv(M, block_m), cdiv(K, block_k))](
        data, scale, out, rows if rows is not None else out, M, K, scale.shape[1],
        BLOCK=block, MX=mx, EMULATE=interpreting(), HAS_ROWS=rows is not None, BLOCK_M=block_m, BLOCK_K=block_k,
        num_warps=4,
    )
