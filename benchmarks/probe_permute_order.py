"""The permute gather walking sorted rows (before d0bbca5) against walking tokens (now), plain and with
the weighted gather and dot products (unpermute's backward), at the three layers' shapes, with the
outputs compared. Kernel time replayed from a CUDA graph of 10 calls, median of do_bench over the replays.

    git show 6a956a9:src/dropless/kernels/permute.py > /tmp/permute_old.py
    PYTHONPATH=src python benchmarks/probe_permute_order.py /tmp/permute_old.py
"""
import importlib.util
import sys

import torch
import triton

from dropless.kernels import permute as new
from dropless.ops.permute import _invert, sort_by_expert

_spec = importlib.util.spec_from_file_location("permute_old", sys.argv[1])
permute_old = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(permute_old)

def graphed_ms(fn, n=10):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        for _ in range(n):
            fn()
    return triton.testing.do_bench(g.replay, warmup=50, rep=300) / n

copy_src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
copy_dst = torch.empty_like(copy_src)
copy_ms = graphed_ms(lambda: copy_dst.copy_(copy_src))
copy_gbps = 2 * copy_src.numel() / copy_ms / 1e6
print(f"copy 1 GiB: {copy_gbps:.0f} GB/s")
LAYERS = (("mixtral", 8192, 4096, 2, 8), ("qwen3", 16384, 2048, 8, 128), ("dsv2lite", 16384, 2048, 6, 64))
for name, T, d, k, E in LAYERS:
    torch.manual_seed(0)
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
    w = torch.rand(T, k, device="cuda")
    order, sizes, offsets = sort_by_expert(ids, E)
    inv = _invert(order)
    M = T * k
    y = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    outs = [torch.empty(M, d, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    dws = [torch.empty(M, device="cuda") for _ in range(2)]
    permute_old.permute_rows(x, order, offsets, k, outs[0], w, other=y, dweights=dws[0])
    new.permute_rows(x, inv, offsets, k, outs[1], w, other=y, dweights=dws[1])
    same = torch.equal(outs[0], outs[1]) and torch.allclose(dws[0], dws[1], rtol=1e-5, atol=1e-3)
    permute_old.permute_rows(x, order, offsets, k, outs[0])
    new.permute_rows(x, inv, offsets, k, outs[1])
    same = same and torch.equal(outs[0], outs[1])
    plain_bytes = (T + M) * d * 2
    dot_bytes = (T + 2 * M) * d * 2
    row = [name, "same" if same else "DIFFER"]
    for label, fn, nbytes in (
        ("old plain", lambda: permute_old.permute_rows(x, order, offsets, k, outs[0]), plain_bytes),
        ("new plain", lambda: new.permute_rows(x, inv, offsets, k, outs[1]), plain_bytes),
        ("new plain+invert", lambda: new.permute_rows(x, _invert(order), offsets, k, outs[1]), plain_bytes),
        ("old dot", lambda: permute_old.permute_rows(x, order, offsets, k, outs[0], w, other=y, dweights=dws[0]),
         dot_bytes),
        ("new dot", lambda: new.permute_rows(x, inv, offsets, k, outs[1], w, other=y, dweights=dws[1]), dot_bytes)):
        ms = graphed_ms(fn)
        row.append(f"{label} {ms * 1e3:.0f} us ({nbytes / ms / 1e6 / copy_gbps:.2f} of copy)")
    print("; ".join(row), flush=True)
