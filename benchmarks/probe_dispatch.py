"""Where an expert-parallel dispatch and combine spend their time, on one GPU (an NCCL group of one rank,
so the exchange is a local copy and the rest shows): DeepEP's setting (4096 tokens, hidden 7168,
top-8 of 256 experts) and Mixtral's (top-2 of 8, hidden 4096).

    PYTHONPATH=src python benchmarks/probe_dispatch.py

Per case: wall ms per call (host clock, a sync after each), the GPU time per call of each kernel from
torch.profiler, and the host time of the parts of dispatch. Used for benchmarks/NOTES.md (v16).
"""
import os
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from dropless.ops.permute import sort_by_expert
from dropless.parallel import combine, dispatch

os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", "29533")
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
torch.cuda.set_device(0)


def wall_ms(fn, n=20):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e3


for name, T, d, k, E in (("deepep", 4096, 7168, 8, 256), ("mixtral", 8192, 4096, 2, 8)):
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    idx = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
    w = torch.rand(T, k, device="cuda")
    rows_bytes = T * k * d * 2
    rows, sizes, handle = dispatch(x, idx, w, num_experts=E)
    parts = {
        "dispatch": lambda: dispatch(x, idx, w, num_experts=E),
        "combine": lambda: combine(rows, handle),
        "sort_by_expert": lambda: sort_by_expert(idx, E),
        "gather x rows (index_select)": lambda: x.index_select(0, handle.slots // k),
        "a2a of the rows": lambda: dist.all_to_all_single(torch.empty_like(rows), rows),
        "gather to expert order": lambda: rows.index_select(0, handle.expert_rows),
        "copy of the rows (floor)": lambda: rows.clone(),
    }
    print(f"{name}: T={T} d={d} k={k} E={E}, rows {rows_bytes / 1e6:.0f} MB")
    for part, fn in parts.items():
        ms = wall_ms(fn)
        print(f"  {part:32s} {ms:8.3f} ms wall   {2 * rows_bytes / ms / 1e6:7.0f} GB/s (rows read + written)")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            dispatch(x, idx, w, num_experts=E)
            combine(rows, handle)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=14, max_name_column_width=60))
dist.destroy_process_group()
