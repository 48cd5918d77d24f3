"""Probe: where the symmetric-memory dispatch and combine spend their time, under torchrun.

DeepEP's setting and Mixtral's (as ``bench ep``), balanced routing, bf16: dispatch + combine timed eagerly
(host launches included) and replayed from a CUDA graph (the GPU's time alone), and rank 0's profile of
the eager calls (kernels by GPU time, the host's time). ``--blocks BYTES:WARPS:STEP ...`` also replays
dispatch + combine with the exchange kernels' blocks set to each (bytes of a row a program moves per step,
warps, bytes a program moves per step).

    torchrun --nproc-per-node 4 benchmarks/probe_symm_dispatch.py [--blocks 1024:4:8192 2048:4:8192]
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

from dropless.bench import ep_exchange
from dropless.bench.routing import draw_topk
from dropless.bench.timing import back_to_back_ms
from dropless.kernels import exchange
from dropless.parallel import combine, dispatch


def _time(fn, n: int = 20) -> float:
    """Per-call ms of ``fn`` back to back, after one warm call and a barrier of all ranks."""
    fn()
    torch.cuda.synchronize()
    dist.barrier()
    return back_to_back_ms(fn, n)


def _with_blocks(spec: str, fn) -> float:
    """Graph-replayed ms of ``fn`` with the exchange kernels' blocks set by ``spec`` (BYTES:WARPS:STEP)."""
    saved = exchange._BLOCK_BYTES, exchange._NUM_WARPS, exchange._STEP_BYTES
    exchange._BLOCK_BYTES, exchange._NUM_WARPS, exchange._STEP_BYTES = (int(v) for v in spec.split(":"))
    try:
        return _time(ep_exchange.graphed(fn))
    finally:
        exchange._BLOCK_BYTES, exchange._NUM_WARPS, exchange._STEP_BYTES = saved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", nargs="*", default=[])
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    dev = torch.device("cuda", rank)
    for name, T, d, k, E in (("deepep", 4096, 7168, 8, 256), ("mixtral", 8192, 4096, 2, 8)):
        x = torch.randn(T, d, device=dev, dtype=torch.bfloat16)
        ids = draw_topk(T, E, k, "balanced", 0, rank).to(dev)
        w = torch.rand(T, k, device=dev)

        def dispatch_only():
            return dispatch(x, ids, w, num_experts=E, backend="symmetric_memory")

        rows, sizes, handle = dispatch_only()

        def both():
            r, _, h = dispatch_only()
            return combine(r, h)

        with torch.no_grad():
            eager_d = _time(dispatch_only)
            eager_c = _time(lambda: combine(rows, handle))
            eager = _time(both)
            graphed = _time(ep_exchange.graphed(both))
            graphed_d = _time(ep_exchange.graphed(dispatch_only))
            graphed_c = _time(ep_exchange.graphed(lambda: combine(rows, handle)))
            variants = {spec: _with_blocks(spec, both) for spec in args.blocks}
        copies = int(sizes.sum())
        mb = copies * d * 2 / 1e6
        line = (f"{name} rank {rank}: {copies} rows received ({mb:.0f} MB); eager dispatch {eager_d:.3f} ms, "
                f"combine {eager_c:.3f} ms, both {eager:.3f} ms; graph both {graphed:.3f} ms, "
                f"dispatch {graphed_d:.3f} ms, combine {graphed_c:.3f} ms")
        if variants:
            line += "; blocks " + ", ".join(f"{spec} {ms:.3f} ms" for spec, ms in variants.items())
        outs = [None] * world
        dist.all_gather_object(outs, line)
        if rank == 0:
            print("\n".join(outs), flush=True)
        with torch.no_grad(), torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                both()
            torch.cuda.synchronize()
        if rank == 0:
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18), flush=True)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
