"""Probe: where the symmetric-memory dispatch and combine spend their time, under torchrun.

DeepEP's setting and Mixtral's (as ``bench ep``), balanced routing, bf16: dispatch + combine timed eagerly
(host launches included) and replayed from a CUDA graph (the GPU's time alone), and rank 0's profile of
the eager calls (kernels by GPU time, the host's time). ``--blocks BYTES:WARPS:STEP ...`` also replays
dispatch + combine with the exchange kernels' blocks set to each (bytes of a row a program moves per step,
warps, bytes a program moves per step). ``--ceiling MB`` first times the link alone, replayed: each rank
pulls MB of contiguous rows from the other ranks (spread evenly) into its memory, then pushes them back,
with the exchange's own kernels (the bandwidth a dispatch or combine of that many remote bytes can reach),
and pulls them with the copy engines (one copy per peer, each on its own stream) for the link's reference.
Each case's line also gives its wire bytes: a token crosses once to each other rank that holds any of its
experts, and its combined row crosses back once.

    torchrun --nproc-per-node 4 benchmarks/probe_symm_dispatch.py [--blocks 1024:4:8192 2048:4:8192] [--ceiling 100]
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
from dropless.parallel.workspace import Workspace


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


def link_ceiling(megabytes: float, rank: int, world: int, dev: torch.device, specs: list[str],
                 d: int = 4096) -> str:
    """GB/s of a replayed pull, and of a replayed push, of ``megabytes`` of bf16 rows of width ``d`` between
    this rank and the others (row i to or from rank ``rank + 1 + i % (P - 1)``), each between barriers;
    the pull with each block spec of ``specs``; and a pull of the same bytes by the copy engines."""
    rows = int(megabytes * 1e6) // (2 * d)
    ws = Workspace(None, dev, rows * d * 2)
    local = torch.randn(rows, d, device=dev, dtype=torch.bfloat16).view(torch.int64)
    ws.view(0, tuple(local.shape), torch.int64).copy_(local)
    i = torch.arange(rows, device=dev)
    ranks = ((rank + 1 + i % max(world - 1, 1)) % world).to(torch.int32)
    at, count = i.to(torch.int32), torch.full((1,), rows, dtype=torch.int32, device=dev)

    def pull():
        ws.barrier()
        exchange.pull_rows(ws.peers(0), ranks, at, count, local)

    def push():
        ws.barrier()
        exchange.push_rows(local, ws.peers(0), ranks, at, count)

    others = [(rank + 1 + j) % world for j in range(world - 1)]
    share = rows // len(others)
    remote = [ws._handle.get_buffer(p, (share, d), torch.bfloat16) for p in others]
    landing = torch.empty(len(others), share, d, device=dev, dtype=torch.bfloat16)
    streams = [torch.cuda.Stream(dev) for _ in others]

    def copy_engines():
        ws.barrier()
        main = torch.cuda.current_stream()
        for s, src, dst in zip(streams, remote, landing):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                dst.copy_(src)
        for s in streams:
            main.wait_stream(s)

    with torch.no_grad():
        pull_ms, push_ms = _time(ep_exchange.graphed(pull)), _time(ep_exchange.graphed(push))
        blocks = {spec: _with_blocks(spec, pull) for spec in specs}
        ce_ms = _time(copy_engines)
    nbytes = rows * d * 2
    line = (f"link rank {rank}: {nbytes / 1e6:.0f} MB to or from {world - 1} ranks: pull {pull_ms:.3f} ms "
            f"({nbytes / pull_ms / 1e6:.0f} GB/s), push {push_ms:.3f} ms ({nbytes / push_ms / 1e6:.0f} GB/s), "
            f"copy engines {ce_ms:.3f} ms ({landing.numel() * 2 / ce_ms / 1e6:.0f} GB/s), "
            "a barrier included in each")
    if blocks:
        line += "; pull blocks " + ", ".join(f"{k} {nbytes / v / 1e6:.0f} GB/s" for k, v in blocks.items())
    return line


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", nargs="*", default=[])
    parser.add_argument("--ceiling", type=float, default=0.0)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    dev = torch.device("cuda", rank)
    if args.ceiling:
        lines = [None] * world
        dist.all_gather_object(lines, link_ceiling(args.ceiling, rank, world, dev, args.blocks))
        if rank == 0:
            print("\n".join(lines), flush=True)
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
        holder = (ids.long() * world) // E
        remote = torch.zeros(T, world, dtype=torch.bool, device=dev).scatter_(1, holder, True)
        remote[:, rank] = False
        crossing = torch.tensor([int(remote.sum()), int((holder != rank).sum())], device=dev)
        dist.all_reduce(crossing)
        wire = 2 * int(crossing[0]) * d * 2 / world
        line = (f"{name} rank {rank}: {copies} rows received ({mb:.0f} MB); wire both ways {wire / 1e6:.0f} MB a "
                f"rank on average ({int(crossing[0])} of {int(crossing[1])} remote copies cross, "
                f"{wire / graphed / 1e6:.0f} GB/s replayed); eager dispatch {eager_d:.3f} ms, "
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
