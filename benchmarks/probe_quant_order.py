"""The tile quantization kernel's program order (column tiles fastest, or row slots fastest), on an H100.

    PYTHONPATH=src python benchmarks/probe_quant_order.py

For each order: rowwise per group along the tokens (whole call, and its amax pass alone) in 128x64 and
128x128 tiles, rowwise's two orientations of an activation from one launch pair (``quantize_both``)
against the two calls, and 3D weights per recipe at E = 8 and 128. GB/s of the bytes each call must
move at the least (bf16 read once, each FP8 copy written once).
"""

from __future__ import annotations

import os

os.environ.setdefault("DROPLESS_AUTOTUNE", "0")

import torch
from probe_quant_tiles import amax_pass, ms, with_shape

import dropless
from dropless.bench.routing import group_sizes
from dropless.kernels import quantize as qk
from dropless.ops.quantize import quantize_pair
from dropless.quantized import get_recipe

DEV = torch.device("cuda")
ROWWISE = get_recipe("rowwise")


def main() -> None:
    shapes = [(128, 64, 4), (128, 128, 4)]
    for cols_first in (False, True):
        qk._COLS_FIRST = cols_first
        print(f"column tiles fastest: {cols_first}")
        print("| tensor | " + " | ".join(f"tokens {a}x{b}/w{w} call, amax" for a, b, w in shapes)
              + " | pair: two calls | pair: one launch 128x64/w4 |")
        for name, E, M, C in [("dsv3 x", 32, 32768, 2048), ("dsv3 dy", 32, 32768, 7168),
                              ("qwen3 x", 128, 65536, 2048), ("qwen3 dy", 128, 65536, 1536),
                              ("mixtral dy", 4, 16384, 14336)]:
            offsets = torch.tensor(group_sizes(E, M, "skewed", 0, 16), device=DEV).cumsum(0).to(torch.int32)
            x = torch.randn(M, C, device=DEV, dtype=torch.bfloat16)
            once, read, pair = 3 * M * C, 2 * M * C, 4 * M * C
            cells = []
            for shape in shapes:
                call = with_shape(shape, lambda: dropless.quantize(x, ROWWISE, dim=0, offsets=offsets))
                cells.append(f"{once / call / 1e6:.0f}, {read / ms(lambda: amax_pass(x, offsets, shape)) / 1e6:.0f}")
            cells.append(f"{pair / ms(lambda: quantize_pair(x, ROWWISE, offsets)) / 1e6:.0f}")
            k_out, m_out = quantize_pair(x, ROWWISE, offsets)
            both = with_shape((128, 64, 4), lambda: qk.quantize_both(x, k_out.data, k_out.scale, m_out.data,
                                                                      m_out.scale, ROWWISE, offsets))
            cells.append(f"{pair / both / 1e6:.0f}")
            print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
        for recipe in ("rowwise", "block128x128", "mxfp8"):
            cells = []
            for E in (8, 128):
                w = torch.randn(E, 1536, 2048, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
                cells.append(f"E={E}: {4 * w.numel() / ms(lambda: dropless.quantize_weight(w, recipe)) / 1e6:.0f}")
            print(f"weights {recipe}: " + ", ".join(cells), flush=True)


if __name__ == "__main__":
    main()
