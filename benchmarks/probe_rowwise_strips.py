"""Rowwise quantization per group along the tokens (the Gluon kernel's strips, ``kernels/quantize_hopper.py``)
on the benchmark's activations, balanced and skewed, one GPU: for timing two trees against each other in
one call (each run with its own ``PYTHONPATH``, alternated).

    PYTHONPATH=src python benchmarks/probe_rowwise_strips.py --label new --json out.jsonl [--stages 8] [--chunk 2048]

For each tensor and routing (and the permuted copies of a layer's tokens read by index): the output
compared byte for byte with the reference (``dropless.reference.quantize`` on the GPU), the kernel's time
(replayed from a CUDA graph of ten calls: the GPU's time alone, which a call from Python hides behind its
host time on a busy host) and the least bytes a call moves (x read once, 2 bytes an element, the FP8 copy
written, 1 byte) as a share of a device copy's GB/s measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("DROPLESS_AUTOTUNE", "0")

import torch

import dropless
from dropless import reference
from dropless.bench.fp8 import hbm_gbps
from dropless.bench.routing import group_sizes
from dropless.bench.timing import graphed_median_ms
from dropless.quantized import get_recipe

DEV = torch.device("cuda")
TENSORS = [("qwen3 x", 128, 65536, 2048), ("qwen3 dy", 128, 65536, 1536), ("qwen3-down x", 128, 65536, 768),
           ("dsv3 dy", 32, 32768, 7168), ("dsv3-down x", 32, 32768, 2048), ("mixtral dy", 4, 16384, 14336),
           ("mixtral x", 4, 16384, 4096)]
GATHERED = [("qwen3 x", 128, 8192, 8, 2048), ("dsv3 x", 32, 4096, 8, 7168), ("mixtral x", 4, 8192, 2, 4096)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", default="tree")
    parser.add_argument("--json", default=None)
    parser.add_argument("--stages", type=int, default=0,
                        help="the stage ring of the strips read by TMA (0: the tree's own)")
    parser.add_argument("--chunk", type=int, default=0,
                        help="the least rows of a chunk of a strip drawn by work (0: the tree's own)")
    args = parser.parse_args()
    from dropless.kernels import quantize_hopper

    if args.stages:
        quantize_hopper.STRIP_STAGES = args.stages
    if args.chunk:
        quantize_hopper.MIN_CHUNK_ROWS = args.chunk
    copy = hbm_gbps(DEV, 10, 30)
    out = open(args.json, "a") if args.json else None
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s; {args.label}", flush=True)
    cases = [(name, routing, E, M, K, None) for name, E, M, K in TENSORS for routing in ("balanced", "skewed")]
    cases += [(name, "gather", E, T * k, K, T) for name, E, T, k, K in GATHERED]
    recipe = get_recipe("rowwise")
    for name, routing, E, M, K, T in cases:
        x = torch.randn(T or M, K, device=DEV, dtype=torch.bfloat16)
        rows = None if T is None else torch.randint(0, T, (M,), device=DEV)
        sizes = group_sizes(E, M, "balanced" if T else routing, 0, 16)
        offsets = torch.tensor(sizes, device=DEV).cumsum(0).to(torch.int32)
        ref_data, ref_scale = reference.quantize(x if rows is None else x[rows], recipe, 0, offsets)
        call = lambda: dropless.quantize(x, "rowwise", dim=0, offsets=offsets, rows=rows)  # noqa: E731
        q = call()
        same = torch.equal(q.data.view(torch.uint8), ref_data.view(torch.uint8)) and torch.equal(q.scale, ref_scale)
        del q, ref_data, ref_scale
        t = graphed_median_ms(call, DEV, 25, 100)
        share = 3 * M * K / t / 1e6 / copy
        print(f"{name:13s} {routing:8s} {1e3 * t:8.1f} us {share:5.2f}{'' if same else '  BYTES DIFFER'}", flush=True)
        if out:
            out.write(json.dumps(dict(label=args.label, tensor=name, routing=routing, us=1e3 * t, share=share,
                                      same=same, max_group=max(sizes))) + "\n")
        del x


if __name__ == "__main__":
    main()
