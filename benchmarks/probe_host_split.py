"""Host and GPU time of the decode products whose tiles are few (issue 20): Mixtral's all-to-one rows, one
group of 64 rows over K = 4,096 or 14,336, each config forced, against the tuned call and
torch._grouped_mm, one GPU.

    PYTHONPATH=src python benchmarks/probe_host_split.py [--json PATH]

``host``: the least time a call of 12 rounds of 20 calls queued behind matmuls (``probe_host_layers.host_us``:
the host's own cost); ``gpu``: replayed from a CUDA graph. A benchmark that times calls back to back reads
the larger of the two.
"""
import argparse
import json

import torch
from probe_host_layers import host_us

import dropless
from dropless.bench.timing import graphed_median_ms
from dropless.kernels import tuning

DEV = torch.device("cuda")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    args = parser.parse_args()
    E, M = 4, 64
    offsets = torch.full((E,), M, dtype=torch.int32, device=DEV)
    configs = {"split 64x128": tuning.SPLIT_K, **{str(c): c for c in tuning.hopper_candidates()["ragged_m"][1:]}}
    rows = []
    for K, N in ((14336, 4096), (4096, 14336)):
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
        w = torch.randn(E, N, K, device=DEV, dtype=torch.bfloat16).transpose(1, 2) / K**0.5
        c = torch.empty(M, N, device=DEV, dtype=torch.bfloat16)
        calls = {"torch._grouped_mm": lambda: torch._grouped_mm(x, w, offs=offsets),
                 "dropless.grouped_mm": lambda: dropless.grouped_mm(x, w, offsets)}
        for name, config in configs.items():
            calls[name] = lambda config=config: tuning.run_ragged_m(x, w, offsets, c, config=config)
        for name, fn in calls.items():
            row = dict(K=K, N=N, call=name, host_us=host_us(fn), gpu_us=1e3 * graphed_median_ms(fn, DEV, 25, 100))
            rows.append(row)
            print(f"K {K:5d} N {N:5d} {name:40s} host {row['host_us']:6.1f} us  gpu {row['gpu_us']:6.1f} us", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
