"""Where the MoE layer's step goes, BF16 against FP8: the ``bench moe`` layer (fwd+bwd) profiled per recipe,
its GPU kernels printed by time per step, with the step's wall time beside the GPU's busy time (a step
whose wall time exceeds its kernels' sum waits on the host).

    PYTHONPATH=src python benchmarks/probe_moe_fp8_profile.py [--configs qwen3] [--recipes bf16 rowwise] [--top 20]

Each layer runs 5 warm-up steps, then 5 timed steps (CUDA events around each) and 3 profiled ones
(``torch.profiler``, CUDA activity; the table is the kernels' total over them divided by 3).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from dropless.bench.moe import _step
from dropless.bench.moe_layers import build_dropless, make_weights, select_configs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", default=["qwen3"])
    parser.add_argument("--recipes", nargs="+", default=["bf16", "rowwise"])
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args()
    for cfg in select_configs(args.configs, quick=False):
        w = make_weights(cfg, torch.bfloat16, torch.device("cuda"))
        x = w.x.detach().requires_grad_()
        for recipe in args.recipes:
            built = build_dropless(cfg, w, None if recipe == "bf16" else recipe)
            step = _step(built, x, w.dy)
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(5):
                step()
            end.record()
            torch.cuda.synchronize()
            wall = start.elapsed_time(end) / 5
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    step()
                torch.cuda.synchronize()
            kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
            for event in prof.events():
                if event.device_type.name == "CUDA":
                    kernels[event.name][0] += event.device_time / 1e3 / 3
                    kernels[event.name][1] += 1
            busy = sum(ms for ms, _ in kernels.values())
            print(f"\n{cfg.name} {recipe}: step {wall:.3f} ms wall, kernels {busy:.3f} ms "
                  f"({len(kernels)} distinct, {sum(n for _, n in kernels.values()) // 3} launches a step)")
            for name, (ms, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:args.top]:
                print(f"  {ms:7.3f} ms {n // 3:4d}x  {name[:110]}")
            del built, step
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
