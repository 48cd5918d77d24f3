"""Where the MoE layer's step goes, BF16 against FP8: the ``bench moe`` layer (fwd+bwd) per recipe, one GPU.

    PYTHONPATH=src python benchmarks/probe_moe_fp8_profile.py [--configs qwen3] [--recipes bf16 rowwise] [--top 20]
        [--memory]

Time (default): after 5 warm-up steps, 5 timed steps (CUDA events around them) and 3 profiled ones
(``torch.profiler``, CUDA activity): the GPU kernels by time per step, with the step's wall time beside
the kernels' sum (a step whose wall time exceeds it waits on the host).

``--memory``: after 2 warm-up steps, one step with its allocations recorded
(``torch.cuda.memory._record_memory_history``), replayed to find the blocks allocated in the step that
are live at its peak, listed by size with the frames that allocated them. The peak is counted as
``bench moe``'s ``peak_gib``: above what was allocated just before the step.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

from dropless.bench.moe import _step
from dropless.bench.moe_layers import build_dropless, make_weights, select_configs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="+", default=["qwen3"])
    parser.add_argument("--recipes", nargs="+", default=["bf16", "rowwise"])
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--memory", action="store_true", help="what is live at the step's peak, not its time")
    args = parser.parse_args()
    for cfg in select_configs(args.configs, quick=False):
        w = make_weights(cfg, torch.bfloat16, torch.device("cuda"))
        x = w.x.detach().requires_grad_()
        for recipe in args.recipes:
            built = build_dropless(cfg, w, None if recipe == "bf16" else recipe)
            step = _step(built, x, w.dy)
            print(f"\n{cfg.name} {recipe}: " + (_memory(step, args.top) if args.memory else _time(step, args.top)))
            del built, step
            torch.cuda.empty_cache()


def _time(step: Callable[[], tuple], top: int) -> str:
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
    lines = [f"step {wall:.3f} ms wall, kernels {busy:.3f} ms ({len(kernels)} distinct, "
             f"{sum(n for _, n in kernels.values()) // 3} launches a step)"]
    lines += [f"  {ms:7.3f} ms {n // 3:4d}x  {name[:110]}"
              for name, (ms, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]]
    return "\n".join(lines)


def _memory(step: Callable[[], tuple], top: int) -> str:
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
    at_peak = _live_at_peak(snapshot)
    lines = [f"peak {(peak - before) / 2**30:.3f} GiB above the step's start; "
             f"{len(at_peak)} blocks allocated in the step live at its peak"]
    lines += [f"  {size / 2**20:9.1f} MiB  {frames}" for size, frames in sorted(at_peak, key=lambda b: -b[0])[:top]]
    return "\n".join(lines)


def _live_at_peak(snapshot: dict) -> list[tuple[int, str]]:
    """Replays the recorded allocations and frees: the blocks (size, frames) live when the total
    allocated in the step is highest."""
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
    return at_peak


def _frames(block: dict) -> str:
    """The innermost frames of dropless that allocated a block."""
    names = [f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}" for f in block.get("frames", [])
             if "dropless" in f["filename"]]
    return " <- ".join(names[:3]) or "?"


if __name__ == "__main__":
    main()
