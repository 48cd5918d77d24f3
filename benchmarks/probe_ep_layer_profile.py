"""Where the expert-parallel layer's time goes: the ``bench ep`` layer (DeepSeek-V3-like, fwd+bwd) profiled
per method and recipe on every rank, each rank's GPU kernels printed by total time.

    PYTHONPATH=src torchrun --nproc-per-node P benchmarks/probe_ep_layer_profile.py \\
        [--recipes bf16 rowwise] [--methods dropless_ep dropless_ep_symmetric_memory dropless_one_gpu] [--top 25]

Each layer runs 3 warm-up steps, then 3 profiled steps (``torch.profiler``, CUDA activity); the table is
the kernels' total over the 3 steps divided by 3, so ms per step. ``--isolated`` profiles 3 more steps,
each after a barrier and a sync (as ``bench ep`` times them); ``--host`` first runs a step under
``torch.cuda.set_sync_debug_mode("error")`` to show where its first host sync is asked for, then one
profiled on the host, and the host's time of unprofiled isolated steps. ``--main-stream`` runs the shared
experts on the main stream (queued after the dispatch) instead of beside the exchange on a second stream.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import torch
from torch.profiler import ProfilerActivity, profile

from dropless.bench import ep_layer
from dropless.bench.ep import _layer_step, process_group
from dropless.nn import moe


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipes", nargs="+", default=["rowwise"])
    parser.add_argument("--methods", nargs="+", default=list(ep_layer.METHODS))
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--host", action="store_true",
                        help="also the host's side: where the first host sync of a step is asked for, and the ops by "
                             "their own CPU time")
    parser.add_argument("--isolated", action="store_true",
                        help="also profile steps that each start from an idle GPU, after a barrier and a sync, as the "
                             "benchmark times them")
    parser.add_argument("--quick", action="store_true", help="the tiny config (a check that it runs, e.g. on CPUs)")
    parser.add_argument("--main-stream", action="store_true", help="the shared experts on the main stream")
    args = parser.parse_args()
    if args.main_stream:
        moe._side_stream = torch.cuda.current_stream
    with process_group() as ranks:
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
                    _report(_host_lines(step, method, recipe, args.top))
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
                    _report(_kernel_lines(prof, cuda, f"{method} {recipe}{', isolated steps' if isolated else ''}",
                                          wall / 3e-3, args.top))
                ep_layer.release_caches(layer)
                del layer, step
                if cuda:
                    torch.cuda.empty_cache()
                torch.distributed.barrier()


def _report(lines: list[str]) -> None:
    """Every rank's lines, printed by rank 0 under its rank's name."""
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, lines)
    if torch.distributed.get_rank() == 0:
        for rank, rank_lines in enumerate(gathered):
            print(f"\n[rank {rank}] " + "\n".join(rank_lines))


def _kernel_lines(prof, cuda: bool, label: str, wall_ms: float, top: int) -> list[str]:
    spent = (lambda e: e.device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    events = sorted((e for e in prof.key_averages() if spent(e) > 0), key=lambda e: -spent(e))
    total = sum(spent(e) for e in events) / 3e3
    return [f"== {label}: {wall_ms:.2f} ms per step (wall), {total:.2f} ms in {'kernels' if cuda else 'ops'}",
            *(f"{spent(e) / 3e3:8.3f} ms {e.count // 3:5d}x  {e.key[:110]}" for e in events[:top])]


def _host_lines(step, method: str, recipe: str, top: int) -> list[str]:
    """The first host sync of a step, where it was asked for (the step stops there: sync debug mode
    "error"), then a whole step profiled on the host: its ops by their own CPU time."""
    where = "no host sync"
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    except RuntimeError:
        frames = traceback.extract_tb(sys.exc_info()[2])
        where = "host sync at " + " <- ".join(f"{f.filename.rsplit('/', 2)[-1]}:{f.lineno} {f.name}"
                                               for f in reversed(frames[-8:]))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    torch.distributed.barrier()
    host, wall = [], []
    for _ in range(10):
        torch.cuda.synchronize()
        torch.distributed.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        host.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        wall.append((time.perf_counter() - start) * 1e3)
    unprofiled = (f"; unprofiled isolated steps: host {sorted(host)[5]:.2f} ms, wall {sorted(wall)[5]:.2f} ms "
                  "(medians of 10)")
    torch.cuda.synchronize()
    torch.distributed.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step()
        host_ms = (time.perf_counter() - start) * 1e3
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return [f"== {method} {recipe}: {where}; the step's host calls took {host_ms:.1f} ms{unprofiled}",
            *(f"{e.self_cpu_time_total / 1e3:8.3f} ms host {e.count:5d}x  {e.key[:100]}" for e in events[:top])]


if __name__ == "__main__":
    main()
