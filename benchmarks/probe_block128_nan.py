"""The open block128 failure on GPUs (benchmarks/NOTES.md, v25): where the non-finite outputs are and
which operand carries NaN bytes, for the problem of
``tests/test_fp8_ops.py::test_forward_and_backward_match_the_dequantized_product[triton-zeros-block128]``
(E = 5, K = 96, N = 64, NaN rows past the groups), in fp32 and bf16.

    PYTHONPATH=src python benchmarks/probe_block128_nan.py [TRIALS]
"""

from __future__ import annotations

import sys

import torch

import dropless
from dropless.ops.grouped_mm_fp8 import resolve_recipe
from dropless.quantized import operand_recipes


def nan_bytes(data: torch.Tensor) -> int:
    """The NaN encodings (0x7F, 0xFF) among float8_e4m3fn ``data``'s bytes."""
    return int(((data.view(torch.uint8) & 0x7F) == 0x7F).sum())


def main() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    sizes, M, K, N = [0, 37, 0, 90, 5], 143, 96, 64
    routed = sum(sizes)
    act, weights = operand_recipes(resolve_recipe("block128"))
    offsets = torch.tensor(sizes, device=device).cumsum(0).to(torch.int32)
    for trial in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(M, K, device=device, dtype=dtype)
            w = torch.randn(len(sizes), K, N, device=device, dtype=dtype) * K ** -0.5
            x[routed:] = float("nan")
            y = dropless.grouped_mm(x, w, offsets, recipe="block128")
            bad = (~torch.isfinite(y)).nonzero()
            xq = dropless.quantize(x[:routed], act, dim=1)
            wk, wn = dropless.quantize_weight(w, weights)
            print(f"trial {trial} {dtype}: y non-finite {bad.shape[0]} (rows {sorted(set(bad[:, 0].tolist()))[:4]}, "
                  f"cols {sorted(set(bad[:, 1].tolist()))[:6]}); NaN bytes: x {nan_bytes(xq.data)}, w along K "
                  f"{nan_bytes(wk.data)} (per expert {[nan_bytes(d) for d in wk.data]}), "
                  f"w along N {nan_bytes(wn.data)}; non-finite scales: x {int((~xq.scale.isfinite()).sum())}, "
                  f"w {int((~wk.scale.isfinite()).sum())}")


if __name__ == "__main__":
    main()
