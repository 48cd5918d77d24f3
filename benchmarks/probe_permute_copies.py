"""The layer's gathers with a token's k copies as one tensor dimension, against the kernels of
``dropless.kernels.permute`` (a loop over the copies, each copy's sorted row loaded inside it), at the three
layers' shapes: permute plain, permute weighted with the dot products (unpermute's backward), unpermute
weighted. The copies' rows and weights are loaded once a program, before the walk over the features, and
every copy's row of a chunk is one load, so a program has k gathers in flight instead of one. Also the
current kernels at other launch shapes (rows a program, features a chunk, warps). Outputs compared with the
current kernels'; kernel time replayed from a CUDA graph of 10 calls.

    PYTHONPATH=src python benchmarks/probe_permute_copies.py
"""
import itertools

import torch
import triton
import triton.language as tl

from dropless.kernels import permute as current
from dropless.ops.permute import _invert, sort_by_expert


@triton.jit
def _permute_copies(src, inv_ptr, offsets_ptr, out, w_ptr, other, dw_ptr, T, D, E,
                    TOP_K: tl.constexpr, K_PAD: tl.constexpr, WEIGHTED: tl.constexpr, DOT: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    token_ok = tokens < T
    copies = tl.arange(0, K_PAD)
    M = T * TOP_K
    num_valid = tl.load(offsets_ptr + E - 1)
    slot_ok = token_ok[:, None] & (copies < TOP_K)[None, :]
    pos = tl.load(inv_ptr + tokens[:, None] * TOP_K + copies[None, :], mask=slot_ok, other=-1).to(tl.int64)
    pos_ok = slot_ok & (pos >= 0) & (pos < M)
    valid = pos_ok & (pos < num_valid)
    w = valid.to(tl.float32)
    if WEIGHTED:
        w = tl.load(w_ptr + tokens[:, None] * TOP_K + copies[None, :], mask=valid, other=0.0).to(tl.float32)
    dots = tl.zeros((BLOCK_T, K_PAD), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        col_ok = cols < D
        row = tl.load(src + tokens[:, None] * D + cols[None, :], mask=token_ok[:, None] & col_ok[None, :],
                      other=0.0)
        copy = tl.where(valid[:, :, None], row[:, None, :], 0.0)
        mask3 = pos_ok[:, :, None] & col_ok[None, None, :]
        if DOT:
            y = tl.load(other + pos[:, :, None] * D + cols[None, None, :],
                        mask=valid[:, :, None] & col_ok[None, None, :], other=0.0)
            dots += tl.sum(copy.to(tl.float32) * y.to(tl.float32), axis=2)
        if WEIGHTED:
            copy = copy.to(tl.float32) * w[:, :, None]
        tl.store(out + pos[:, :, None] * D + cols[None, None, :], copy.to(out.dtype.element_ty), mask=mask3)
    if DOT:
        tl.store(dw_ptr + tokens[:, None] * TOP_K + copies[None, :], dots, mask=slot_ok)


@triton.jit
def _unpermute_copies(src, inv_ptr, offsets_ptr, out, w_ptr, T, D, E,
                      TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    tokens = (tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    token_ok = tokens < T
    col_ok = cols < D
    copies = tl.arange(0, K_PAD)
    num_valid = tl.load(offsets_ptr + E - 1)
    slot_ok = token_ok[:, None] & (copies < TOP_K)[None, :]
    pos = tl.load(inv_ptr + tokens[:, None] * TOP_K + copies[None, :], mask=slot_ok, other=0).to(tl.int64)
    valid = slot_ok & (pos >= 0) & (pos < num_valid) & (pos < T * TOP_K)
    w = tl.load(w_ptr + tokens[:, None] * TOP_K + copies[None, :], mask=valid, other=0.0).to(tl.float32)
    rows = tl.load(src + pos[:, :, None] * D + cols[None, None, :], mask=valid[:, :, None] & col_ok[None, None, :],
                   other=0.0).to(tl.float32)
    acc = tl.sum(rows * w[:, :, None], axis=1)
    tl.store(out + tokens[:, None] * D + cols[None, :], acc.to(out.dtype.element_ty),
             mask=token_ok[:, None] & col_ok[None, :])


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


def current_at(block_elements, max_block_d, warps):
    """Run ``fn`` with the current kernels' launch shape set to these values."""
    def run(fn):
        saved = current._BLOCK_ELEMENTS, current._MAX_BLOCK_D, current._NUM_WARPS
        current._BLOCK_ELEMENTS, current._MAX_BLOCK_D, current._NUM_WARPS = block_elements, max_block_d, warps
        try:
            fn()
        finally:
            current._BLOCK_ELEMENTS, current._MAX_BLOCK_D, current._NUM_WARPS = saved
    return run


copy_src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
copy_dst = torch.empty_like(copy_src)
copy_gbps = 2 * copy_src.numel() / graphed_ms(lambda: copy_dst.copy_(copy_src)) / 1e6
del copy_src, copy_dst
print(f"copy 1 GiB: {copy_gbps:.0f} GB/s")
LAYERS = (("mixtral", 8192, 4096, 2, 8), ("qwen3", 16384, 2048, 8, 128), ("dsv2lite", 16384, 2048, 6, 64))
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
    ref_plain = torch.empty(M, d, device="cuda", dtype=torch.bfloat16)
    ref_w = torch.empty_like(ref_plain)
    ref_dw = torch.empty(M, device="cuda")
    ref_un = torch.empty(T, d, device="cuda", dtype=torch.bfloat16)
    current.permute_rows(x, inv, offsets, k, ref_plain)
    current.permute_rows(x, inv, offsets, k, ref_w, w, other=y, dweights=ref_dw)
    current.unpermute_rows(y, inv, offsets, k, ref_un, w)
    out = torch.empty_like(ref_plain)
    dw = torch.empty_like(ref_dw)
    un = torch.empty_like(ref_un)
    nbytes = {"permute": (T + M) * d * 2, "permute+dot": (T + 2 * M) * d * 2, "unpermute": (T + M) * d * 2}

    def check(kind):
        if kind == "permute":
            return torch.equal(out, ref_plain)
        if kind == "permute+dot":
            return torch.equal(out, ref_w) and torch.allclose(dw, ref_dw, rtol=1e-4, atol=1e-2)
        return torch.allclose(un.float(), ref_un.float(), rtol=1e-2, atol=1e-2)  # the k copies summed in another order

    def time(kind, label, fn):
        out.fill_(float("nan")); dw.fill_(float("nan")); un.fill_(float("nan"))
        fn()
        ok = check(kind)
        ms = graphed_ms(fn)
        share = nbytes[kind] / ms / 1e6 / copy_gbps
        results.append((name, kind, label, ms * 1e3, share, ok))
        print(f"{name:9s} {kind:12s} {label:34s} {ms * 1e3:7.1f} us  {share:.2f} of copy  {'same' if ok else 'DIFFER'}",
              flush=True)

    for be, bd, nw in itertools.product((2048, 8192), (256, 512), (4, 8)):
        run = current_at(be, bd, nw)
        label = f"current {be} el, D {bd}, {nw} warps"
        time("permute", label, lambda: run(lambda: current.permute_rows(x, inv, offsets, k, out)))
        time("permute+dot", label, lambda: run(lambda: current.permute_rows(x, inv, offsets, k, out, w, other=y,
                                                                            dweights=dw)))
        time("unpermute", label, lambda: run(lambda: current.unpermute_rows(y, inv, offsets, k, un, w)))
    kp = triton.next_power_of_2(k)
    for bt, bd, nw in itertools.product((1, 2, 4), (128, 256, 512), (4, 8)):
        if bt * kp * bd > 16384 or bt * kp * bd < 512:
            continue
        label = f"copies {bt} tok, D {bd}, {nw} warps"
        grid = (triton.cdiv(T, bt),)
        time("permute", label, lambda: _permute_copies[grid](
            x, inv, offsets, out, w, x, dw, T, d, E, TOP_K=k, K_PAD=kp, WEIGHTED=False, DOT=False,
            BLOCK_T=bt, BLOCK_D=bd, num_warps=nw))
        time("permute+dot", label, lambda: _permute_copies[grid](
            x, inv, offsets, out, w, y, dw, T, d, E, TOP_K=k, K_PAD=kp, WEIGHTED=True, DOT=True,
            BLOCK_T=bt, BLOCK_D=bd, num_warps=nw))
        time("unpermute", label, lambda: _unpermute_copies[(triton.cdiv(T, bt), triton.cdiv(d, bd))](
            y, inv, offsets, un, w, T, d, E, TOP_K=k, K_PAD=kp, BLOCK_T=bt, BLOCK_D=bd, num_warps=nw))

print("\nbest a layer and kind (current default: 2048 el, D 256, 4 warps)")
for name, kind in itertools.product([l[0] for l in LAYERS], ("permute", "permute+dot", "unpermute")):
    rows = [r for r in results if r[0] == name and r[1] == kind and r[5]]
    default = next(r for r in rows if r[2] == "current 2048 el, D 256, 4 warps")
    best_cur = min((r for r in rows if r[2].startswith("current")), key=lambda r: r[3])
    best_new = min((r for r in rows if r[2].startswith("copies")), key=lambda r: r[3])
    print(f"| {name} | {kind} | default {default[3]:.0f} us ({default[4]:.2f}) | best current {best_cur[2]} "
          f"{best_cur[3]:.0f} us ({best_cur[4]:.2f}) | best copies {best_new[2]} {best_new[3]:.0f} us ({best_new[4]:.2f}) |")
bad = [r for r in results if not r[5]]
print(f"{len(bad)} of {len(results)} differ" + "".join(f"\n  {r[:3]}" for r in bad[:10]))
