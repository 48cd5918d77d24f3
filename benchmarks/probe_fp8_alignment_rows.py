"""Two questions about the FP8 rowwise path, on an H100.

    PYTHONPATH=src python benchmarks/probe_fp8_alignment_rows.py

1. Does the FP8 weight gradient lose to the 16-row (not 128-row) alignment of each group's tokens in
   operands quantized per group? Balanced groups of n and n - 16 tokens: with n - 16 = 112 mod 128 every
   group's first row is 128-aligned. The forward's FP8 product on the same shapes for reference.
2. The rowwise quantizer along K: elements per program and warps, in GB/s of bytes moved once.
"""
import os, sys
os.environ.setdefault("DROPLESS_AUTOTUNE", "0")
import torch
from triton.testing import do_bench
import dropless
from dropless.kernels import quantize as qk, tuning
from dropless.kernels.launch import next_power_of_2
from dropless.kernels.ragged_k import NO_ACCUMULATE
from dropless.ops.grouped_mm_fp8 import quantized_mm
from dropless.quantized import get_recipe
DEV = torch.device("cuda"); R = get_recipe("rowwise")
ms = lambda fn: do_bench(fn, warmup=25, rep=60, return_mode="median")
print("| shape | sizes | p_e aligned to | fp8 wgrad gluon | fp8 wgrad triton | fp8 fwd gluon |")
for name, E, size, K, N in [("mixtral-up", 4, 4096, 4096, 14336), ("dsv3-down", 32, 1024, 2048, 7168), ("qwen3-up", 128, 512, 2048, 1536)]:
    for n in (size, size - 16):
        M = E * n
        offsets = torch.full((E,), n, device=DEV).cumsum(0).to(torch.int32)
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16); dy = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
        xt = dropless.quantize(x, R, dim=0, offsets=offsets); dyt = dropless.quantize(dy, R, dim=0, offsets=offsets)
        out = torch.empty(E, N, K, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
        f = 2 * M * K * N
        g = ms(lambda: tuning.run_ragged_k_fp8(xt.data, xt.scale, dyt.data, dyt.scale, None, offsets, out, NO_ACCUMULATE, None, fast_accum=True, config=tuning._RAGGED_K_FP8_HOPPER.default))
        t = ms(lambda: tuning.run_ragged_k_fp8(xt.data, xt.scale, dyt.data, dyt.scale, None, offsets, out, NO_ACCUMULATE, None, fast_accum=True, config=tuning._RAGGED_K_FP8_FAST.default))
        w = torch.randn(E, N, K, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
        wk, _ = dropless.quantize_weight(w, R); xq = dropless.quantize(x, R, dim=1)
        fw = ms(lambda: quantized_mm(xq, wk, offsets, R, torch.bfloat16))
        al = 128 if n % 128 == 112 else 16
        print(f"| {name} | {E}x{n} | {al} | {f/g/1e9:.0f} | {f/t/1e9:.0f} | {f/fw/1e9:.0f} |", flush=True)
print("| tensor | BLOCK_M x warps -> GB/s (3 B/elt) |")
for name, M, C in [("qwen3 dy", 65536, 1536), ("dsv3 dy", 32768, 7168), ("qwen3 x", 65536, 2048), ("mixtral x-down", 16384, 14336)]:
    x = torch.randn(M, C, device=DEV, dtype=torch.bfloat16); cells = []
    original, block_k = qk._rowwise_shape, min(max(next_power_of_2(C), 16), 8192)
    for elements in (2048, 4096, 8192, 16384):
        for warps in (4, 8, 16):
            qk._rowwise_shape = lambda K, shape=(max(elements // block_k, 1), block_k, warps): shape
            t = ms(lambda: dropless.quantize(x, R, dim=1))
            cells.append(f"{elements}/{warps}: {3*M*C/t/1e6:.0f}")
    qk._rowwise_shape = original
    print(f"| {name} | " + ", ".join(cells) + " |", flush=True)
