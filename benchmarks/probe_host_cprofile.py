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

from layer_step import layer_steps

recipe = None if sys.argv[1] == "bf16" else sys.argv[1]
step = layer_steps("qwen3", [recipe])[recipe]
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
