"""block128 Gluon kernels (forward and weight gradient) at other stage counts and raster widths, operands
already quantized, each variant checked bit for bit against the default config. Used for NOTES v28.

    PYTHONPATH=src python benchmarks/probe_block128_stages.py
"""
import os

os.environ.setdefault("DROPLESS_AUTOTUNE", "0")
import torch
from triton.testing import do_bench
import dropless
from dropless.kernels.config import GemmConfig
from dropless.kernels.launch import launch_info
from dropless.kernels.ragged_m_block128_hopper import ragged_m_block128_hopper
from dropless.kernels.ragged_k_block128_hopper import ragged_k_block128_hopper
from dropless.quantized import get_recipe
DEV = torch.device("cuda")
P = launch_info(DEV).num_programs
ms = lambda f: do_bench(f, warmup=25, rep=100, return_mode="median")
r = get_recipe("block128")
CFG = [(4, 8), (5, 8), (4, 4), (4, 16), (5, 16)]
print("forward | " + " | ".join(f"s{s} g{g}" for s, g in CFG))
for E, rows, N, K in [(4, 8192, 4096, 7168), (4, 8192, 7168, 2048), (8, 4096, 4096, 7168), (8, 4096, 7168, 2048)]:
    M = E * rows
    offsets = torch.full((E,), rows, device=DEV).cumsum(0).to(torch.int32)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    w = (torch.randn(E, N, K, device=DEV, dtype=torch.bfloat16) * K ** -0.5).transpose(1, 2)
    y = torch.empty(M, N, device=DEV, dtype=torch.bfloat16)
    xq = dropless.quantize(x, r, dim=1); wq, _ = dropless.quantize_weight(w, r)
    ragged_m_block128_hopper(xq.data, xq.scale, wq.data, wq.scale, offsets, y, P); want = y.float().clone()
    cells = []
    for s, g in CFG:
        c = GemmConfig(128, 128, 128, num_warps=4, num_stages=s, group_m=g, gluon=True)
        f = lambda: ragged_m_block128_hopper(xq.data, xq.scale, wq.data, wq.scale, offsets, y, P, c)
        y.fill_(float("nan")); f(); assert torch.equal(y.float(), want), (s, g)
        cells.append(2 * M * N * K / ms(f) / 1e9)
    print(f"| {E}x{rows}, {N}, {K} | " + " | ".join(f"{c:.0f}" for c in cells), flush=True)
print("weight gradient | " + " | ".join(f"s{s} g{g}" for s, g in CFG))
for E, M, K, N in [(4, 16384, 4096, 14336), (32, 32768, 7168, 4096), (32, 32768, 2048, 7168), (128, 65536, 2048, 1536)]:
    offsets = torch.full((E,), M // E, device=DEV).cumsum(0).to(torch.int32)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16); dy = torch.randn(M, N, device=DEV, dtype=torch.bfloat16)
    xq = dropless.quantize(x, r, dim=0, offsets=offsets); dyq = dropless.quantize(dy, r, dim=0, offsets=offsets)
    out = torch.empty(E, K, N, device=DEV, dtype=torch.bfloat16)
    ragged_k_block128_hopper(xq.data, xq.scale, dyq.data, dyq.scale, offsets, out, 0, None, P); want = out.float().clone()
    cells = []
    for s, g in CFG:
        c = GemmConfig(128, 128, 128, num_warps=4, num_stages=s, group_m=g, gluon=True)
        f = lambda: ragged_k_block128_hopper(xq.data, xq.scale, dyq.data, dyq.scale, offsets, out, 0, None, P, c)
        out.fill_(float("nan")); f(); assert torch.equal(out.float(), want), (s, g)
        cells.append(2 * M * K * N / ms(f) / 1e9)
    print(f"| {E}, {M}, {K}, {N} | " + " | ".join(f"{c:.0f}" for c in cells), flush=True)
