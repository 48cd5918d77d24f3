"""The host's time of one grouped GEMM call, layer by layer (issue 20's decode rows, issue 17's qwen3 rows).

    python benchmarks/probe_host_layers.py [--json PATH]

At qwen3's decode down projection (E = 128, M = 1,536, K = 768, N = 2,048, all-to-one routing), each layer
of the forward's call path is timed on the host with the GPU kept busy (``host_us``: calls queued behind
~4 ms of matmuls, so none waits for the GPU; the least of 12 rounds, as the host's load varies), from the kernel launch with ready arguments up to the public
call, with and without autograd; then the weight gradient's path and whole fwd+bwd steps, BF16 and FP8
rowwise (weights cached), against torch._grouped_mm. (``probe_decode.py --profile`` gives a step's cProfile.)
"""
import argparse, json, time

import numpy as np
import torch

import dropless
from dropless.bench.routing import group_sizes
from dropless.kernels import tuning
from dropless.kernels.hopper import descriptor
from dropless.kernels.ragged_k import NO_ACCUMULATE
from dropless.ops.grouped_forms import RAGGED_K, RAGGED_M, _ragged_m

dev = torch.device("cuda")
big = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)


def host_us(fn, rounds=12, n=20):
    """The least time per call over ``rounds`` rounds of ``n`` calls: the host's own cost, which other
    work on the host only ever lengthens."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        for _ in range(4):
            big @ big
        t = time.perf_counter()
        for _ in range(n):
            fn()
        times.append((time.perf_counter() - t) / n * 1e6)
        torch.cuda.synchronize()
    return float(min(times))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    E, M, K, N = 128, 1536, 768, 2048
    offs = torch.tensor(np.cumsum(group_sizes(E, M, "all-to-one")), dtype=torch.int32, device=dev)
    x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
    w = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16) * K ** -0.5
    dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    c = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
    dw = torch.empty(E, K, N, device=dev, dtype=torch.bfloat16)
    tuning.run_ragged_m(x, w, offs, c)
    config = next(iter(tuning._RAGGED_M_HOPPER.cache.values()), tuning._RAGGED_M_HOPPER.default)
    from dropless.kernels import ragged_m_hopper as rmh
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    halves = rmh.output_in_halves(config, 2, 2)
    descs = dict(a_desc=descriptor(x, [bm, bk]), b_desc=descriptor(w, [1, bk, bn]),
                 c_desc=descriptor(c, [bm, bn // 2 if halves else bn]))
    launch_args = dict(**descs, c_ptr=c, stride_cm=c.stride(0), sa_ptr=c, sb_ptr=c, stride_sbe=0, offsets_ptr=offs,
                       M=M, N=N, K=K, E=E, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
                       STAGES=config.num_stages, E_POW2=256, B_NK=False, EPI_HALVES=halves, SCALED=False,
                       ZERO_TAIL=True, num_warps=config.num_warps)
    rmh._LAUNCH((132,), **launch_args)
    key, compiled = next(iter(rmh._LAUNCH.compiled.items()))
    values = [launch_args[p.name] for p in rmh._LAUNCH.params]
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()
    w_q = dropless.quantize_weight(w, "rowwise")

    def step(mm, **kw):
        return lambda: torch.autograd.grad(mm(xg, wg, **kw), (xg, wg), dy)

    stream = torch.cuda.current_stream().cuda_stream

    def raw_launch():
        compiled.run(132, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *values)

    class Floor(torch.autograd.Function):
        """The least a Python op can cost: an allocation and a launch of a compiled kernel with ready
        arguments forward, two of each backward."""

        @staticmethod
        def forward(ctx, a, b):
            out = torch.empty(M, N, device=dev, dtype=torch.bfloat16)
            raw_launch()
            return out

        @staticmethod
        def backward(ctx, grad):
            da, db = torch.empty(M, K, device=dev, dtype=torch.bfloat16), torch.empty_like(w)
            raw_launch()
            raw_launch()
            return da, db

    rows = {
        "compiled.run, ready arguments": host_us(raw_launch),
        "step floor (autograd.Function, 3 raw launches)": host_us(step(Floor.apply)),
        "python call of a no-op": host_us(lambda: None),
        "torch.empty [M, N]": host_us(lambda: torch.empty(M, N, device=dev, dtype=torch.bfloat16)),
        "compiled kernel, ready arguments": host_us(lambda: compiled[(132, 1, 1)](*values)),
        "DirectLaunch, ready descriptors": host_us(lambda: rmh._LAUNCH((132,), **launch_args)),
        "three descriptors": host_us(lambda: (descriptor(x, [bm, bk]), descriptor(w, [1, bk, bn]),
                                              descriptor(c, [bm, bn]))),
        "ragged_m_mm_hopper": host_us(lambda: rmh.ragged_m_mm_hopper(x, w, offs, c, config, 132)),
        "run_ragged_m": host_us(lambda: tuning.run_ragged_m(x, w, offs, c)),
        "_ragged_m (impl, allocates)": host_us(lambda: _ragged_m(x, w, offs)),
        "RAGGED_M op, no grad": host_us(lambda: RAGGED_M(x, w, offs, None, True)),
        "dropless.grouped_mm, no grad": host_us(lambda: dropless.grouped_mm(x, w, offs)),
        "dropless.grouped_mm, grad": host_us(lambda: dropless.grouped_mm(xg, wg, offs)),
        "torch._grouped_mm, no grad": host_us(lambda: torch._grouped_mm(x, w, offs=offs)),
        "torch._grouped_mm, grad": host_us(lambda: torch._grouped_mm(xg, wg, offs=offs)),
        "run_ragged_k (wgrad)": host_us(lambda: tuning.run_ragged_k(x, dy, offs, dw, NO_ACCUMULATE, None)),
        "RAGGED_K op (wgrad, allocates)": host_us(lambda: RAGGED_K(x.t(), dy, offs, None)),
        "dgrad RAGGED_M op": host_us(lambda: RAGGED_M(dy, w.transpose(1, 2), offs, None, True)),
        "step dropless bf16": host_us(step(lambda a, b: dropless.grouped_mm(a, b, offs))),
        "step torch bf16": host_us(step(lambda a, b: torch._grouped_mm(a, b, offs=offs))),
        "step dropless rowwise cached": host_us(step(lambda a, b: dropless.grouped_mm(
            a, b, offs, recipe="rowwise", w_quantized=w_q))),
        "autograd.grad of a matmul": host_us(lambda: torch.autograd.grad(xg @ wg[0], (xg, ), dy[:, :N])),
    }
    print(f"{'layer':48s} {'host us':>9s}")
    for name, us in rows.items():
        print(f"{name:48s} {us:9.1f}")
    if args.json:
        json.dump(rows, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
