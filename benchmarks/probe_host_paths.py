"""Host time of the eager path (``ops.direct``) against the custom op, interleaved, qwen3-down shape.

    DROPLESS_AUTOTUNE=0 python benchmarks/probe_host_paths.py

Each round runs one call of a variant (so the caching allocator holds its sizes), queues ~40 ms of
GPU work, then times 20 calls on the host (so none waits for the GPU); 12 rounds visit the variants in
turn, and each reports its median round in microseconds per call. Used for benchmarks/NOTES.md (v6).
"""
import statistics, time
import torch
import dropless
from host_problem import big, dy, offs, w, wd, x, xd


def step(mm):
    return torch.autograd.grad(mm(x, w, offs), (x, w), dy)


variants = {
    "fwd, no grad: eager": lambda: dropless.grouped_mm(xd, wd, offs),
    "fwd, no grad: custom op": lambda: torch.ops.dropless.grouped_mm(xd, wd, offs),
    "fwd, grad: eager": lambda: dropless.grouped_mm(x, w, offs),
    "fwd, grad: custom op": lambda: torch.ops.dropless.grouped_mm(x, w, offs),
    "fwd+bwd step: eager": lambda: step(dropless.grouped_mm),
    "fwd+bwd step: custom op": lambda: step(torch.ops.dropless.grouped_mm),
    "fwd+bwd step: torch._grouped_mm": lambda: step(lambda a, b, o: torch._grouped_mm(a, b, offs=o)),
}
for f in variants.values():
    f()
torch.cuda.synchronize()
times = {k: [] for k in variants}
for _ in range(12):
    for k, f in variants.items():
        f()  # the caching allocator settles on this variant's sizes before the timed calls
        torch.cuda.synchronize()
        for _ in range(24):
            big @ big
        t = time.perf_counter()
        for _ in range(20):
            f()
        times[k].append((time.perf_counter() - t) / 20 * 1e6)
        torch.cuda.synchronize()
for k, v in times.items():
    print(f"{k:34s} median {statistics.median(v):7.1f} us  (rounds {min(v):.0f}-{max(v):.0f})")
