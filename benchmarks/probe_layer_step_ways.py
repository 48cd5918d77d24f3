"""The MoE layer's fwd+bwd step (``bench moe``'s) at one config and recipe, four ways: eager (10 steps back to
back), replayed from a CUDA graph, the host's time to queue a step behind a GPU sleep, and its kernels by
``torch.profiler``. Run once per tree to compare two commits in one call.

    PYTHONPATH=src python benchmarks/probe_layer_step_ways.py TAG CONFIG bf16|rowwise|block128
"""
import sys
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile
from dropless.bench.timing import back_to_back_ms
from layer_step import layer_steps

tag, config, recipe = sys.argv[1], sys.argv[2], sys.argv[3]
recipe = None if recipe == "bf16" else recipe
step = layer_steps(config, [recipe])[recipe]

eager = min(back_to_back_ms(step, 10) for _ in range(3))
torch.cuda._sleep(int(2e9))  # ~1 s of GPU time: the host queues the steps alone
t0 = time.perf_counter()
for _ in range(4):
    step()
host = (time.perf_counter() - t0) / 4 * 1e3
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    out = step()
replay = min(back_to_back_ms(graph.replay, 10) for _ in range(3))
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(3):
        step()
    torch.cuda.synchronize()
kernels = defaultdict(float)
for e in prof.events():
    if e.device_type.name == "CUDA":
        kernels[e.name[:60]] += e.device_time / 1e3 / 3
print(f"{tag} {config} {recipe}: eager {eager:.3f} ms, replay {replay:.3f} ms, host {host:.3f} ms/step, "
      f"kernels {sum(kernels.values()):.3f} ms")
for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:9]:
    print(f"   {ms:6.3f} {name}")
