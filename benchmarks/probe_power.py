"""The Mixtral-down dgrad GEMM (M=16384, K=4096, N=14336, nn.Linear-layout weights): the 3- and 4-stage
Gluon configs, the op, torch._grouped_mm and dense, on weights scaled as the benchmark scales them
(K^-0.5 of the forward), as the kernel probe does (N^-0.5) and unscaled, in three interleaved rounds.

    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv -lms 50 > smi.csv &
    DROPLESS_AUTOTUNE=0 python benchmarks/probe_power.py

Each timing line starts with its wall-clock time, so the nvidia-smi samples can be assigned to it.
Used for benchmarks/NOTES.md (v6): at these shapes the H100 runs at its 700 W limit, its clock moves
with the data and the temperature, and the same config moves by 5-17% between rounds."""
import time, datetime, numpy as np, torch
from triton.testing import do_bench
import dropless
from dropless.kernels.tuning import run_ragged_m
from dropless.kernels.config import GemmConfig as G
from dropless.bench.routing import group_sizes
E, M, Kf, Nf = 4, 16384, 14336, 4096  # forward shape; dgrad: dy [M, Nf] @ w^T
offs = torch.tensor(np.cumsum(group_sizes(E, M, "balanced")), dtype=torch.int32, device="cuda")
dy = torch.randn(M, Nf, device="cuda", dtype=torch.bfloat16)
data = {
  "bench_w": (torch.randn(E, Kf, Nf, device="cuda", dtype=torch.bfloat16) * Kf ** -0.5).transpose(1, 2),
  "probe_w": (torch.randn(E, Kf, Nf, device="cuda", dtype=torch.bfloat16) * Nf ** -0.5).transpose(1, 2),
  "unit_w": torch.randn(E, Kf, Nf, device="cuda", dtype=torch.bfloat16).transpose(1, 2),
}
out = torch.empty(M, Kf, device="cuda", dtype=torch.bfloat16)
s3 = G(128, 256, 64, num_warps=8, num_stages=3, gluon=True); s4 = G(128, 256, 64, num_warps=8, num_stages=4, gluon=True)
fns = {}
for name, wt in data.items():
    fns[f"{name} s3"] = lambda wt=wt: run_ragged_m(dy, wt, offs, out, config=s3)
    fns[f"{name} s4"] = lambda wt=wt: run_ragged_m(dy, wt, offs, out, config=s4)
    fns[f"{name} op"] = lambda wt=wt: dropless.grouped_mm(dy, wt, offs)
    fns[f"{name} torch"] = lambda wt=wt: torch._grouped_mm(dy, wt, offs=offs)
dense_b = torch.randn(Nf, Kf, device="cuda", dtype=torch.bfloat16) * Kf ** -0.5
fns["dense"] = lambda: torch.mm(dy, dense_b)
flops = 2 * M * Kf * Nf
res = {k: [] for k in fns}
for r in range(3):
    for k, f in fns.items():
        t0 = datetime.datetime.now().strftime("%H:%M:%S.%f")[:-3]
        res[k].append(do_bench(f, warmup=25, rep=100, return_mode="median"))
        print(f"{t0} round {r} {k:16s} {flops / res[k][-1] / 1e9:6.0f}", flush=True)
print("\nmedian over rounds, TFLOP/s")
for k, v in res.items():
    print(f"{k:16s} {flops / float(np.median(v)) / 1e9:6.0f}")
