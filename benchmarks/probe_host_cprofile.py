"""Where the host's time goes in the MoE layer's step (``bench moe``'s fwd+bwd at Qwen3-30B-A3B):
``cProfile`` over steps queued behind a GPU sleep, so that no launch waits for the GPU.

    PYTHONPATH=src python benchmarks/probe_host_cprofile.py bf16|rowwise|block128

Prints the host's time a step (profiled, so inflated by the profiler's own cost on Python calls) and the
functions by their own time and by cumulative time.
"""
import cProfile
import pstats
import sys
import time

import torch

from dropless.bench.moe import _step
from dropless.bench.moe_layers import build_dropless, make_weights, select_configs

recipe = None if sys.argv[1] == "bf16" else sys.argv[1]
cfg = select_configs(["qwen3"], quick=False)[0]
w = make_weights(cfg, torch.bfloat16, torch.device("cuda"))
x = w.x.detach().requires_grad_()
built = build_dropless(cfg, w, recipe)
step = _step(built, x, w.dy)
for _ in range(5):
    step()
torch.cuda.synchronize()
prof = cProfile.Profile()
total = 0.0
for _ in range(5):
    torch.cuda._sleep(int(1e9))
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(3):
        step()
    prof.disable()
    total += time.perf_counter() - t0
    torch.cuda.synchronize()
print(f"{sys.argv[1]}: host {total / 15 * 1e3:.3f} ms a step (profiled)")
stats = pstats.Stats(prof)
stats.sort_stats("tottime").print_stats(28)
stats.sort_stats("cumtime").print_stats(40)
