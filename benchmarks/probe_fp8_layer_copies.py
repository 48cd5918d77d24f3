"""The FP8 layer's gradient and token copies written by the kernels that make the rows, against the
separate passes they replace: kernel times in us, each replayed from a CUDA graph (``do_bench_cudagraph``).

    PYTHONPATH=src python benchmarks/probe_fp8_layer_copies.py TAG

Per layer shape (Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V2-Lite; rowwise recipe):
- ``perm_q``: the permute kernel writing the tokens' FP8 copies, against ``gather_sep`` (the tokens
  quantized, then their FP8 rows and scales gathered by index), and ``perm_plain`` (the bf16 permute);
- ``perm_bwd_q``: unpermute's backward (weighted rows, dot products) writing dy's FP8 copy too, against
  ``perm_bwd`` + ``rowwise_dy`` (the same kernel without it, then the rowwise quantization of its rows);
- ``glu_bwd_q``: the activation's backward writing dh's FP8 copy too, against ``glu_bwd`` + ``rowwise_dh``;
  ``glu_bwd_q_256``: the same with rows walked in 256-column steps (twice) instead of one tile.
The last two figures: the separate passes summed, and the fused kernels summed.
"""
import sys

import torch
import triton

from dropless.kernels import swiglu as sk
from dropless.kernels.permute import permute_rows
from dropless.kernels.swiglu import glu_backward
from dropless.ops.permute import _invert, sort_by_expert
from dropless.ops.quantize import empty_quantized, quantize
from dropless.quantized import get_recipe

tag = sys.argv[1]
dev = torch.device("cuda")
r = get_recipe("rowwise")
bf = torch.bfloat16
for name, T, k, d, F, E in (("qwen3", 16384, 8, 2048, 768, 128), ("mixtral", 8192, 2, 4096, 14336, 8),
                            ("dsv2lite", 16384, 6, 2048, 1408, 64)):
    M = T * k
    ids = torch.rand(T, E, device=dev).topk(k, dim=1).indices  # k distinct experts a token, balanced
    slots, sizes, offsets = sort_by_expert(ids, E)
    inv = _invert(slots)
    x = torch.randn(T, d, device=dev, dtype=bf)
    dy = torch.randn(T, d, device=dev, dtype=bf)
    w = torch.rand(T, k, device=dev)
    ys = torch.randn(M, d, device=dev, dtype=bf)
    out = torch.empty(M, d, device=dev, dtype=bf)
    dw = torch.empty(M, device=dev)
    data, scale = empty_quantized((M, d), r, 1, None, dev)
    h = torch.randn(M, 2 * F, device=dev, dtype=bf)
    dh = torch.empty_like(h)
    da = torch.randn(M, F, device=dev, dtype=bf)
    hd, hs = empty_quantized((M, 2 * F), r, 1, None, dev)
    def gather_sep():
        q = quantize(x, r, dim=1)
        q.data.view(torch.uint8).index_select(0, slots.long() // k)
        q.scale.index_select(0, slots.long() // k)
    cases = {
        "perm_plain": lambda: permute_rows(x, inv, offsets, k, out),
        "perm_q": lambda: permute_rows(x, inv, offsets, k, None, quantized=(data, scale, r)),
        "gather_sep": gather_sep,
        "perm_bwd": lambda: permute_rows(dy, inv, offsets, k, out, w, other=ys, dweights=dw),
        "perm_bwd_q": lambda: permute_rows(dy, inv, offsets, k, out, w, other=ys, dweights=dw, quantized=(data, scale, r)),
        "rowwise_dy": lambda: quantize(out, r, dim=1, offsets=offsets, tail=False),
        "glu_bwd": lambda: glu_backward(h, da, dh, "silu"),
        "glu_bwd_q": lambda: glu_backward(h, da, dh, "silu", quantized=(hd, hs, r)),
        "rowwise_dh": lambda: quantize(dh, r, dim=1, offsets=offsets, tail=False),
    }
    t = {}
    for c, fn in cases.items():
        fn()
        t[c] = triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3
    saved = sk._MAX_ROW_BLOCK_F
    sk._MAX_ROW_BLOCK_F = 256
    fn = cases["glu_bwd_q"]
    fn()
    t["glu_bwd_q_256"] = triton.testing.do_bench_cudagraph(fn, rep=30, return_mode="median") * 1e3
    sk._MAX_ROW_BLOCK_F = saved
    old = t["gather_sep"] + t["perm_bwd"] + t["rowwise_dy"] + t["glu_bwd"] + t["rowwise_dh"]
    new = t["perm_q"] + t["perm_bwd_q"] + t["glu_bwd_q"]
    print(f"{tag} {name}: " + " ".join(f"{c} {v:.0f}" for c, v in t.items()) + f" | old passes {old:.0f} fused {new:.0f}")
