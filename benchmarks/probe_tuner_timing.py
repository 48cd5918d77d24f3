"""The autotuner's timing on a GPU that starts cool: short medians of the 3- and 4-stage Gluon ragged-M configs
in four interleaved rounds, then two long ones, at three balanced benchmark shapes.

    python benchmarks/probe_tuner_timing.py

Prints, per shape, the 3-stage / 4-stage time ratio of each round and the 3-stage times in ms.
"""
import numpy as np, torch
from triton.testing import do_bench
from dropless.bench.routing import group_sizes
from dropless.kernels.config import GemmConfig as G
from dropless.kernels.tuning import run_ragged_m
S3 = G(128, 256, 64, num_warps=8, num_stages=3, gluon=True); S4 = G(128, 256, 64, num_warps=8, num_stages=4, gluon=True)
for name, (E, M, K, N) in {"mixtral-down": (4, 16384, 14336, 4096), "mixtral-up": (4, 16384, 4096, 14336), "dsv3-up": (32, 32768, 7168, 4096)}.items():
    offs = torch.tensor(np.cumsum(group_sizes(E, M, "balanced")), dtype=torch.int32, device="cuda")
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16); w = (torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K ** .5).transpose(1, 2)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    for cfg in (S3, S4): run_ragged_m(a, w, offs, out, config=cfg)
    short = {0: [], 1: []}; long = {0: [], 1: []}
    for _ in range(4):
        for i, cfg in enumerate((S3, S4)):
            short[i].append(do_bench(lambda: run_ragged_m(a, w, offs, out, config=cfg), warmup=10, rep=25, return_mode="median"))
    for _ in range(2):
        for i, cfg in enumerate((S3, S4)):
            long[i].append(do_bench(lambda: run_ragged_m(a, w, offs, out, config=cfg), warmup=25, rep=200, return_mode="median"))
    print(name, "short s3/s4 per round", " ".join(f"{x / y:.3f}" for x, y in zip(short[0], short[1])),
          "| long", " ".join(f"{x / y:.3f}" for x, y in zip(long[0], long[1])), "| ms s3", [round(x, 3) for x in short[0] + long[0]], flush=True)
