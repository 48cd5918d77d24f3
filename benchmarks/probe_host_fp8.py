"""Host time against wall time of a fwd+bwd step, BF16 and FP8 rowwise (weights cached), at qwen3-30b-a3b's
two shapes and dsv3-ep8-down, balanced routing.

    PYTHONPATH=src python benchmarks/probe_host_fp8.py          (PROFILE=1: cProfile of qwen3-down's FP8 step)

"host": the time to queue one step while the GPU is busy with queued matmuls (so nothing waits for it),
median of 5 rounds of 5 steps; "wall": 20 steps back to back, synchronized, per step. A step whose host
time reaches its wall time is bound by the host. Used for benchmarks/NOTES.md (v28).
"""
import cProfile
import os
import pstats
import statistics
import time

import torch

import dropless
from dropless.bench.routing import group_sizes

SHAPES = [("qwen3-down", (128, 65536, 768, 2048)), ("qwen3-up", (128, 65536, 2048, 1536)),
          ("dsv3-down", (32, 32768, 2048, 7168))]


def main() -> None:
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for name, (E, M, K, N) in SHAPES:
        offsets = torch.tensor(group_sizes(E, M, "balanced"), device="cuda").cumsum(0).to(torch.int32)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) * K ** -0.5).transpose(1, 2).requires_grad_()
        dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        pair = dropless.quantize_weight(w.detach(), "rowwise")
        steps = {
            "bf16": lambda: torch.autograd.grad(dropless.grouped_mm(x, w, offsets), (x, w), dy),
            "rowwise cached": lambda: torch.autograd.grad(
                dropless.grouped_mm(x, w, offsets, recipe="rowwise", w_quantized=pair), (x, w), dy),
        }
        for method, step in steps.items():
            step()
            step()
            torch.cuda.synchronize()
            host = []
            for _ in range(5):
                for _ in range(40):
                    big @ big
                start = time.perf_counter()
                for _ in range(5):
                    step()
                host.append((time.perf_counter() - start) / 5 * 1e3)
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(20):
                step()
            torch.cuda.synchronize()
            wall = (time.perf_counter() - start) / 20 * 1e3
            print(f"{name:11s} {method:15s} host {statistics.median(host):.3f} ms   wall {wall:.3f} ms", flush=True)
        if os.environ.get("PROFILE") and name == "qwen3-down":
            for _ in range(40):
                big @ big
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(5):
                steps["rowwise cached"]()
            profile.disable()
            stats = pstats.Stats(profile)
            stats.sort_stats("tottime").print_stats(45)
            stats.sort_stats("cumulative").print_stats(70)


if __name__ == "__main__":
    main()
