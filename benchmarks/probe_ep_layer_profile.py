"""Where the expert-parallel layer's time goes: the ``bench ep`` layer (DeepSeek-V3-like, fwd+bwd) profiled
per method and recipe on every rank, rank 0's GPU kernels printed by total time.

    PYTHONPATH=src torchrun --nproc-per-node P benchmarks/probe_ep_layer_profile.py \\
        [--recipes bf16 rowwise] [--methods dropless_ep dropless_ep_symmetric_memory dropless_one_gpu] [--top 25]

Each layer runs 3 warm-up steps, then 3 profiled steps (``torch.profiler``, CUDA activity); the table is
the kernels' total over the 3 steps divided by 3, so ms per step.
"""

from __future__ import annotations

import argparse
import collections
import time
import warnings

import torch
from torch.profiler import ProfilerActivity, profile

from dropless.bench import ep_layer
from dropless.bench.ep import _layer_step, process_group


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipes", nargs="+", default=["rowwise"])
    parser.add_argument("--methods", nargs="+", default=list(ep_layer.METHODS))
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--host", action="store_true",
                        help="also the host's side: the ops by their own CPU time, and each host sync's place")
    parser.add_argument("--isolated", action="store_true",
                        help="also profile steps that each start from an idle GPU, after a barrier and a sync, as the "
                             "benchmark times them")
    parser.add_argument("--quick", action="store_true", help="the tiny config (a check that it runs, e.g. on CPUs)")
    args = parser.parse_args()
    with process_group() as ranks:
        rank = torch.distributed.get_rank()
        cfg = (ep_layer.QUICK_CONFIGS if args.quick else ep_layer.CONFIGS)[0]
        cuda = ranks.device.type == "cuda"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        weights = ep_layer.make_weights(cfg, ranks.group, ranks.device, torch.bfloat16 if cuda else torch.float32, 0)
        drawn = ep_layer.draw_routing(cfg, "balanced", ranks.group, ranks.device, 0)
        for recipe in args.recipes:
            for method in args.methods:
                layer = ep_layer.build_layer(cfg, method, recipe, weights, drawn, ranks.group)
                step = _layer_step(layer, weights.x, weights.dy)
                for _ in range(3):
                    step()
                sync()
                torch.distributed.barrier()
                if args.host and cuda:
                    _host_side(step, rank, method, recipe, args.top)
                for isolated in (False, True) if args.isolated else (False,):
                    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
                        wall, begin = 0.0, time.perf_counter()
                        for _ in range(3):
                            if isolated:
                                sync()
                                torch.distributed.barrier()
                                sync()
                                start = time.perf_counter()
                                step()
                                sync()
                                wall += time.perf_counter() - start
                            else:
                                step()
                        sync()
                        if not isolated:
                            wall = time.perf_counter() - begin
                    if rank == 0:
                        _print_kernels(prof, cuda, f"{method} {recipe}{', isolated steps' if isolated else ''}",
                                       wall / 3e-3, args.top)
                ep_layer.release_caches(layer)
                del layer, step
                if cuda:
                    torch.cuda.empty_cache()
                torch.distributed.barrier()


def _print_kernels(prof, cuda: bool, label: str, wall_ms: float, top: int) -> None:
    spent = (lambda e: e.device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    events = sorted((e for e in prof.key_averages() if spent(e) > 0), key=lambda e: -spent(e))
    total = sum(spent(e) for e in events) / 3e3
    print(f"\n== {label}: {wall_ms:.2f} ms per step (wall), {total:.2f} ms in {'kernels' if cuda else 'ops'}")
    for e in events[:top]:
        print(f"{spent(e) / 3e3:8.3f} ms {e.count // 3:5d}x  {e.key[:110]}")


def _host_side(step, rank: int, method: str, recipe: str, top: int) -> None:
    """One step with every host sync reported (where it was asked for), then one profiled on the host."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    if rank == 0:
        places = collections.Counter()
        for w in caught:
            places[f"{w.filename}:{w.lineno}"] += 1
        print(f"\n== {method} {recipe}: {len(caught)} host syncs " + ", ".join(f"{p} x{n}" for p, n in places.items()))
        events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        for e in events[:top]:
            print(f"{e.self_cpu_time_total / 1e3:8.3f} ms host {e.count:5d}x  {e.key[:100]}")


if __name__ == "__main__":
    main()
