"""Split K on the decode shapes: the Triton ragged-M kernel with ``config.split_k`` (``kernels/ragged_m.py``)
against the tuned product (``tuning.run_ragged_m``) and ``torch._grouped_mm``, forward and input gradient,
one GPU, each replayed from a CUDA graph (the GPU's time alone).

    PYTHONPATH=src python benchmarks/probe_split_k.py [--splits 1 4 8] [--tiles 64x256w4 128x256w8 64x128w4s6g] [--json out.jsonl]

For each decode shape and routing: every output checked against torch._grouped_mm's (relative Frobenius
error), and the time of each method. Split K matters where the tiles are fewer than the multiprocessors
and K is long (Mixtral's all-to-one rows: one group of 64 rows, 16 tiles over K = 4,096 or 14,336).
"""

from __future__ import annotations

import argparse
import json
import os

os.environ.setdefault("DROPLESS_AUTOTUNE", "1")

import torch

from dropless.bench.routing import group_sizes
from dropless.bench.shapes import DECODE_SHAPES
from dropless.bench.timing import graphed_median_ms
from dropless.kernels.config import GemmConfig
from dropless.kernels.tuning import run_ragged_m

DEV = torch.device("cuda")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--splits", nargs="+", type=int, default=[1, 4, 8])
    parser.add_argument("--tiles", nargs="+", default=["64x256w4", "128x256w8"],
                        help="output tiles and warps, BMxBNwW, then sS for S stages and a g for the Gluon kernel (64x128w4s6g)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    out = open(args.json, "a") if args.json else None
    print(f"{torch.cuda.get_device_name()}; us, replayed from a CUDA graph", flush=True)
    for shape in DECODE_SHAPES:
        for routing in ("balanced", "all-to-one"):
            sizes = group_sizes(shape.E, shape.M, routing, 0)
            offsets = torch.tensor(sizes, device=DEV).cumsum(0).to(torch.int32)
            for name, (K, N) in (("fwd", (shape.K, shape.N)), ("dgrad", (shape.N, shape.K))):
                x = torch.randn(shape.M, K, device=DEV, dtype=torch.bfloat16)
                w = torch.randn(shape.E, N, K, device=DEV, dtype=torch.bfloat16).transpose(1, 2) / K**0.5
                ref = torch._grouped_mm(x, w, offsets)

                def tuned(x=x, w=w, offsets=offsets, ref=ref):
                    y = torch.empty_like(ref)
                    run_ragged_m(x, w, offsets, y)
                    return y

                def split_k(config, x=x, w=w, offsets=offsets, ref=ref):
                    y = torch.empty_like(ref)
                    run_ragged_m(x, w, offsets, y, config=config)
                    return y

                methods = {"torch": lambda x=x, w=w, offsets=offsets: torch._grouped_mm(x, w, offsets), "tuned": tuned}
                for split in args.splits:
                    for tile in args.tiles:
                        gluon = tile.endswith("g")
                        shape_warps, _, stages = tile.rstrip("g").partition("s")
                        bm, bn, warps = (int(v) for v in shape_warps.replace("w", "x").split("x"))
                        stages = int(stages) if stages else 3 if gluon and bm == 128 else 4
                        config = GemmConfig(bm, bn, 64, num_warps=warps, num_stages=stages, gluon=gluon, split_k=split)
                        methods[f"{tile}/k{split}"] = lambda config=config: split_k(config)
                row = {}
                for label, fn in methods.items():
                    y = fn()
                    err = float((y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))
                    row[label] = (1e3 * graphed_median_ms(fn, DEV, 25, 100), err)
                best = min(t for label, (t, _) in row.items() if label not in ("torch", "tuned"))
                print(f"{shape.name:28s} {routing:10s} {name:5s} torch {row['torch'][0]:7.1f} tuned {row['tuned'][0]:7.1f} "
                      + " ".join(f"{label} {t:7.1f}" for label, (t, _) in row.items() if label not in ("torch", "tuned"))
                      + f"  best/torch {row['torch'][0] / best:.2f}  max err {max(e for _, e in row.values()):.1e}",
                      flush=True)
                if out:
                    out.write(json.dumps(dict(shape=shape.name, routing=routing, pass_=name,
                                              us={k: v[0] for k, v in row.items()},
                                              err={k: v[1] for k, v in row.items()})) + "\n")


if __name__ == "__main__":
    main()
