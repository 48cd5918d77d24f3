"""The MoE layer's fwd+bwd step (``bench moe``'s, Qwen3-30B-A3B) replayed from a CUDA graph, BF16 and FP8
rowwise: the replay's span against its kernels' sum, the largest gaps between kernels, the longest kernels.

    PYTHONPATH=src python benchmarks/probe_replay_gaps.py
"""
import torch
from torch.profiler import ProfilerActivity, profile
from layer_step import layer_steps

for recipe, step in layer_steps("qwen3", [None, "rowwise"], warmup=4).items():
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    ev = sorted([e for e in prof.events() if e.device_type.name == "CUDA"], key=lambda e: e.time_range.start)
    busy = sum(e.time_range.elapsed_us() for e in ev)
    span = ev[-1].time_range.end - ev[0].time_range.start
    gaps = sorted(((ev[i + 1].time_range.start - ev[i].time_range.end, ev[i].name[:50], ev[i + 1].name[:50])
                   for i in range(len(ev) - 1)), reverse=True)[:8]
    slow = sorted(((e.time_range.elapsed_us(), e.name[:60]) for e in ev), reverse=True)[:10]
    print(f"{recipe}: replay span {span / 1e3:.3f} ms, kernels {busy / 1e3:.3f} ms, {len(ev)} events")
    for g in gaps:
        print(f"   gap {g[0]:7.0f} us after {g[1]} before {g[2]}")
    for s in slow:
        print(f"   {s[0]:7.0f} us {s[1]}")
    del graph
    torch.cuda.empty_cache()
