"""What is live at the peak of the MoE layer's step, BF16 against FP8: the ``bench moe`` layer (fwd+bwd) on one
GPU, its allocations recorded (``torch.cuda.memory._record_memory_history``) over one step after warm-up,
then the blocks live at the step's peak listed by size with the frames that allocated them.

    PYTHONPATH=src python benchmarks/probe_moe_memory.py [--configs mixtral] [--recipes bf16 rowwise] [--top 16]

The peak is counted as ``bench moe``'s ``peak_gib``: above what was allocated just before the step.
"""

from __future__ import annotations

import argparse

import torch

from dropless.bench.moe import _step
from dropless.bench.moe_layers import build_dropless, make_weights, select_configs


def _frames(block: dict) -> str:
    """The innermost frames of dropless (or the probe) that allocated a block."""
    names = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in block.get("frames", [])
             if "dropless" in f["filename"] or "probe_moe" in f["filename"]]
    return " <- ".join(names[:3]) or "?"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", default=["mixtral"])
    parser.add_argument("--recipes", nargs="+", default=["bf16", "rowwise"])
    parser.add_argument("--top", type=int, default=16)
    args = parser.parse_args()
    for cfg in select_configs(args.configs, quick=False):
        w = make_weights(cfg, torch.bfloat16, torch.device("cuda"))
        x = w.x.detach().requires_grad_()
        for recipe in args.recipes:
            built = build_dropless(cfg, w, None if recipe == "bf16" else recipe)
            step = _step(built, x, w.dy)
            for _ in range(2):
                step()
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            torch.cuda.memory._record_memory_history(max_entries=200_000)
            out = step()
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated()
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            del out
            live, at_peak = _live_at_peak(snapshot, peak)
            print(f"\n{cfg.name} {recipe}: peak {(peak - before) / 2**30:.3f} GiB above the step's start; "
                  f"{len(at_peak)} blocks allocated in the step live at its peak")
            for size, frames in sorted(at_peak, key=lambda b: -b[0])[:args.top]:
                print(f"  {size / 2**20:9.1f} MiB  {frames}")
            del built, step, live
            torch.cuda.empty_cache()


def _live_at_peak(snapshot: dict, peak: int) -> tuple[dict, list[tuple[int, str]]]:
    """Replays the recorded allocations and frees of the step; returns the blocks allocated in it that are
    live when the allocated total is highest."""
    events = [e for trace in snapshot["device_traces"] for e in trace if e["action"] in ("alloc", "free_completed")]
    live: dict[int, tuple[int, str]] = {}
    total = best = 0
    at_peak: list[tuple[int, str]] = []
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _frames(e))
            total += e["size"]
        elif e["addr"] in live:
            total -= live.pop(e["addr"])[0]
        if total > best:
            best, at_peak = total, list(live.values())
    return live, at_peak


if __name__ == "__main__":
    main()
