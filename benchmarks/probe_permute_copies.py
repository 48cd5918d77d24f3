"""The layer's gathers of ``dropless.kernels.permute`` against a candidate version of that module, each at
several launch shapes (elements a program, features a chunk, warps), at the three layers' shapes: permute
plain, permute weighted with the dot products (unpermute's backward), the same writing rowwise FP8 copies
beside (the FP8 layer's output gradient), the tokens' copies quantized block128 with no rows stored, and
unpermute weighted. Every output is poisoned before the call and compared with the current module's at its
default launch; kernel time replayed from a CUDA graph of 10 calls; share of a 1 GiB copy's rate by the
bytes the call must move.

    git show <commit>:src/dropless/kernels/permute.py > /tmp/permute_candidate.py
    PYTHONPATH=src python benchmarks/probe_permute_copies.py /tmp/permute_candidate.py [ELEMENTS,BLOCK_D,WARPS ...]

The candidate's launches are the arguments after its path (default 8192,256,4): they set the module's
``_BLOCK_ELEMENTS``, ``_MAX_BLOCK_D`` and ``_NUM_WARPS`` (a module whose block-recipe kernel takes its chunk
from another constant keeps that chunk).
"""
import importlib.util
import itertools
import sys

import torch
import triton

from dropless.kernels import permute as current
from dropless.ops.permute import _invert, sort_by_expert
from dropless.ops.quantize import empty_quantized
from dropless.quantized import get_recipe

_spec = importlib.util.spec_from_file_location("permute_candidate", sys.argv[1])
candidate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(candidate)
ROWWISE, BLOCK128 = get_recipe("rowwise"), get_recipe("block128")


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
    return triton.testing.do_bench(g.replay, warmup=25, rep=100) / n


def at_launch(module, block_elements, max_block_d, warps, fn):
    """``fn`` run with ``module``'s launch shape set to these values."""
    def run():
        saved = module._BLOCK_ELEMENTS, module._MAX_BLOCK_D, module._NUM_WARPS
        module._BLOCK_ELEMENTS, module._MAX_BLOCK_D, module._NUM_WARPS = block_elements, max_block_d, warps
        try:
            fn()
        finally:
            module._BLOCK_ELEMENTS, module._MAX_BLOCK_D, module._NUM_WARPS = saved
    return run


copy_src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
copy_dst = torch.empty_like(copy_src)
copy_gbps = 2 * copy_src.numel() / graphed_ms(lambda: copy_dst.copy_(copy_src)) / 1e6
del copy_src, copy_dst
print(f"copy 1 GiB: {copy_gbps:.0f} GB/s", flush=True)
LAYERS = (("mixtral", 8192, 4096, 2, 8), ("qwen3", 16384, 2048, 8, 128), ("dsv2lite", 16384, 2048, 6, 64))
KINDS = ("permute", "permute+dot", "permute+dot+rowwise", "tokens block128", "unpermute")
DEFAULT = (2048, 256, 4)
LAUNCHES = {"current": (DEFAULT,), "candidate": (tuple(tuple(int(v) for v in a.split(",")) for a in sys.argv[2:])
                                               or ((8192, 256, 4),))}
results = []
for name, T, d, k, E in LAYERS:
    torch.manual_seed(0)
    x = torch.randn(T, d, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda")[:k] for _ in range(T)])
    w = torch.rand(T, k, device="cuda")
    order, sizes, offsets = sort_by_expert(ids, E)
    inv = _invert(order)
    M = T * k
    y = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(M, d, device="cuda", dtype=torch.bfloat16)
    dw = torch.empty(M, device="cuda")
    un = torch.empty(T, d, device="cuda", dtype=torch.bfloat16)
    row_q = empty_quantized((M, d), ROWWISE, 1, None, x.device)
    blk_q = empty_quantized((M, d), BLOCK128, 1, None, x.device)
    outputs = {"permute": (out,), "permute+dot": (out, dw), "permute+dot+rowwise": (out, dw, *row_q),
               "tokens block128": blk_q, "unpermute": (un,)}
    calls = {
        "permute": lambda m: m.permute_rows(x, inv, offsets, k, out),
        "permute+dot": lambda m: m.permute_rows(x, inv, offsets, k, out, w, other=y, dweights=dw),
        "permute+dot+rowwise": lambda m: m.permute_rows(x, inv, offsets, k, out, w, other=y, dweights=dw,
                                                        quantized=(*row_q, ROWWISE)),
        "tokens block128": lambda m: m.permute_rows(x, inv, offsets, k, None, quantized=(*blk_q, BLOCK128)),
        "unpermute": lambda m: m.unpermute_rows(y, inv, offsets, k, un, w),
    }
    moved = {"permute": (T + M) * d * 2, "permute+dot": (T + 2 * M) * d * 2,
             "permute+dot+rowwise": (2 * T + 2 * M) * d * 2 + M * d, "tokens block128": T * d * 2 + M * d,
             "unpermute": (T + M) * d * 2}

    def poison():
        for t in (out, dw, un, *row_q, *blk_q):
            t.view(torch.uint8).fill_(0xFF)  # NaN in every float format used here

    def snapshot(kind):
        return [t.clone() for t in outputs[kind]]

    refs = {}
    for kind in KINDS:
        poison()
        calls[kind](current)
        refs[kind] = snapshot(kind)
    for (label, module), kind in itertools.product((("current", current), ("candidate", candidate)), KINDS):
        for launch in LAUNCHES[label]:
            fn = at_launch(module, *launch, lambda: calls[kind](module))
            poison()
            fn()
            got = snapshot(kind)
            # dot products and the unpermute's sum may be summed in another order: to fp32 rounding, then
            # rounded once to bf16.
            exact = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, refs[kind]))
            close = all(torch.allclose(a.float(), b.float(), rtol=1e-2, atol=1e-2, equal_nan=False)
                        for a, b in zip(got, refs[kind]))
            ms = graphed_ms(fn)
            share = moved[kind] / ms / 1e6 / copy_gbps
            results.append((name, kind, label, launch, ms * 1e3, share, exact, close))
            print(f"{name:9s} {kind:20s} {label:9s} {str(launch):18s} {ms * 1e3:7.1f} us  {share:.2f} of copy  "
                  f"{'bits' if exact else 'close' if close else 'DIFFER'}", flush=True)

print(f"\n| layer | kind | current {DEFAULT} | best candidate | ratio |")
print("|---|---|---|---|---|")
for name, kind in itertools.product([l[0] for l in LAYERS], KINDS):
    rows = [r for r in results if r[0] == name and r[1] == kind]
    base = next(r for r in rows if r[2] == "current" and r[3] == DEFAULT)
    best = min((r for r in rows if r[2] == "candidate" and r[7]), key=lambda r: r[4], default=None)
    if best is None:
        print(f"| {name} | {kind} | {base[4]:.0f} us ({base[5]:.2f}) | none close | |")
        continue
    print(f"| {name} | {kind} | {base[4]:.0f} us ({base[5]:.2f}) | {best[3]} {best[4]:.0f} us ({best[5]:.2f}, "
          f"{'bits' if best[6] else 'close'}) | {base[4] / best[4]:.2f}x |")
print("\ncandidate launches, total us over the layers and kinds:")
for launch in LAUNCHES["candidate"]:
    rows = [r for r in results if r[2] == "candidate" and r[3] == launch]
    print(f"  {launch}: {sum(r[4] for r in rows):.0f} us, all close: {all(r[7] for r in rows)}")
bad = [r[:4] for r in results if not r[7]]
print(f"{len(bad)} of {len(results)} differ" + "".join(f"\n  {r}" for r in bad[:10]))
