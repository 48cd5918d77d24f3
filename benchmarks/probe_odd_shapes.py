"""Shapes whose K or N is not a multiple of 16 (issue 20: the backward at the forward's rate).

    python benchmarks/probe_odd_shapes.py [--json PATH] [--shapes K,N ...]

bf16 operands whose rows are not 16-byte aligned (K or N not a multiple of 8: 1001, 2881) cannot be
read by TMA, so their products take the pointer path; multiples of 8 that are not of 16 (1000, 2888)
can. For E = 8 experts, M = 16,384 rows (balanced), each (K, N) below and a near multiple of 128 for
reference: the forward, the input gradient and the weight gradient of ``dropless.grouped_mm``,
timed as the GEMM benchmark times them (L2 flushed), in TFLOP/s; ``--json`` also keeps the configs the
tuners chose.
"""
import argparse, json

import numpy as np
import torch

import dropless
from dropless.bench.routing import group_sizes
from dropless.bench.timing import median_ms
from dropless.kernels import tuning

dev = torch.device("cuda")
E, M = 8, 16384
SHAPES = [(1024, 1024), (1000, 1024), (1024, 1000), (1000, 1000), (2880, 2880), (2888, 2880), (2880, 2888),
          (4096, 1000), (1000, 4096), (1001, 1024), (1024, 1001), (1001, 1001), (2881, 2880), (2880, 2881)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--shapes", nargs="*", help="K,N pairs (default: the list above)")
    args = ap.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    offs = torch.tensor(np.cumsum(group_sizes(E, M, "balanced")), dtype=torch.int32, device=dev)
    rows = []
    for K, N in shapes:
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16) * K ** -0.5
        dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
        flops = 2 * M * K * N
        passes = {"fwd": lambda: dropless.grouped_mm(x, w, offs),
                  "dgrad": lambda: dropless.grouped_mm(dy, w.transpose(1, 2), offs),
                  "wgrad": lambda: dropless.grouped_mm_wgrad(x, dy, offs)}
        row = {"K": K, "N": N}
        for name, fn in passes.items():
            fn()
            row[name] = flops / median_ms(fn, dev, 50, 200) / 1e9
        rows.append(row)
        print(f"K={K:5d} N={N:5d}  " + "  ".join(f"{p} {row[p]:6.0f}" for p in passes) + "  TFLOP/s", flush=True)
    if args.json:
        json.dump({"rows": rows, "configs": tuning.tuned_configs()}, open(args.json, "w"), indent=1)


if __name__ == "__main__":
    main()
