"""``QuantizedTensor.dequantize`` on the Triton backend: FP8 data quantized along the last dim of a 2D
tensor (what a grouped GEMM's forward reads, and what expert-parallel dispatch moves) back to
bf16/fp16/fp32 in one kernel pass; every other layout through the reference's torch ops."""

from __future__ import annotations

import torch

from dropless import reference
from dropless.backend import use_triton
from dropless.kernels.dequantize import dequantize_rows
from dropless.ops.checks import TRITON_DTYPES, check_row_count
from dropless.ops.direct import DirectOp
from dropless.quantized import QuantizedTensor


def _dequantize_rows(data: torch.Tensor, scale: torch.Tensor, block: int, mx: bool, dtype: torch.dtype,
                     rows: torch.Tensor | None) -> torch.Tensor:
    out = torch.empty(data.shape, dtype=dtype, device=data.device)
    dequantize_rows(data, scale.view(torch.uint8) if mx else scale, block, mx, out, rows)
    return out


def _dequantize_rows_fake(data: torch.Tensor, scale: torch.Tensor, block: int, mx: bool,
                          dtype: torch.dtype, rows: torch.Tensor | None) -> torch.Tensor:
    return data.new_empty(data.shape, dtype=dtype)


_DEQUANTIZE_ROWS = DirectOp.define("dequantize_rows", _dequantize_rows, _dequantize_rows_fake)


def dequantize(q: QuantizedTensor, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``q.data * q.scale`` as a new contiguous tensor of ``dtype``, computed in fp32 and rounded once:
    bit for bit ``dropless.reference.dequantize(q).to(dtype)``. ``rows`` (int ``[1]`` on the device): the
    one-pass kernel writes only that many first rows, the rest left unwritten (elsewhere all are)."""
    if rows is not None:
        check_row_count(rows, q.data.device, "q.data")
    one_pass = (q.data.dim() == 2 and q.dim == 1 and q.offsets is None and not q.recipe.tile
                and q.data.is_contiguous() and q.scale.is_contiguous() and dtype in TRITON_DTYPES)
    if one_pass and use_triton(q.data.device):
        return _DEQUANTIZE_ROWS(q.data, q.scale, q.recipe.block or 0, q.recipe.name == "mxfp8", dtype, rows)
    return reference.dequantize(q).to(dtype)
