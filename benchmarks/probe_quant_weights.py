"""A weight's two orientations on one GPU: the Gluon kernel (``kernels/quantize_weight_hopper.py``)
against the Triton tile kernels it replaces, over E, both storage orders, mxfp8 and block128x128.

    PYTHONPATH=src python benchmarks/probe_quant_weights.py

GB/s of the bytes each call must move at the least (the bf16 weight read once, both FP8 copies
written: 4 bytes an element; the scales are left out), and that as a share of a device copy's (bytes
read + written). The bar: 0.8 of the copy, the same share for every E. Each call is timed twice: called
from Python (``do_bench``, the host's time per call included where it is longer than the GPU's) and
replayed from a CUDA graph of 10 calls (``bench.timing.graphed_median_ms``: the GPU's time alone). Each Gluon call's outputs are checked
against the Triton kernels' byte for byte first.
"""

from __future__ import annotations

import os

os.environ.setdefault("DROPLESS_AUTOTUNE", "0")

import torch
import dropless
from dropless.bench.fp8 import hbm_gbps
from dropless.bench.timing import graphed_median_ms, median_ms
from probe_quant_groups import triton_only  # the benchmarks folder is the script's

DEV = torch.device("cuda")
WEIGHTS = "quantize_weight_hopper_ok"  # the predicate that chooses the Gluon weight kernel
K, N = 2048, 1536  # a Qwen3-30B-A3B expert's up projection, [E, N, K] as nn.Linear stores it


def ms(fn) -> float:
    return median_ms(fn, DEV, 10, 30)


def graphed_ms(fn) -> float:
    return graphed_median_ms(fn, DEV, 10, 30)


def same_bytes(a, b) -> bool:
    return all(torch.equal(x.data.view(torch.uint8), y.data.view(torch.uint8))
               and torch.equal(x.scale.view(torch.uint8), y.scale.view(torch.uint8)) for x, y in zip(a, b))


def main() -> None:
    copy = hbm_gbps(DEV, 10, 30)
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s (bytes read + written); K={K} N={N}")
    print(f"{'':24s} {'Gluon':>7s} {'graphed':>7s} {'Triton':>7s} {'graphed':>7s}  (share of the copy)")
    for E in (8, 32, 128, 256):
        for layout in ("nk", "kn"):
            w = torch.randn(E, N, K, device=DEV, dtype=torch.bfloat16)
            w = w.transpose(1, 2) if layout == "nk" else w.view(E, K, N)
            for recipe in ("mxfp8", "block128x128"):
                call = lambda: dropless.quantize_weight(w, recipe)  # noqa: E731
                assert same_bytes(call(), triton_only(call, WEIGHTS)), (E, layout, recipe)
                times = (ms(call), graphed_ms(call), triton_only(lambda: ms(call), WEIGHTS),
                         triton_only(lambda: graphed_ms(call), WEIGHTS))
                shares = [4 * w.numel() / t / 1e6 / copy for t in times]
                print(f"E={E:<4d}{layout} {recipe:14s} " + " ".join(f"{x:7.2f}" for x in shares), flush=True)
            del w


if __name__ == "__main__":
    main()
