"""One launch of each quantization kernel case, for a profiler to read (the per-group tile kernel reaches
0.42-0.65 of a copy where its layout's other cases reach 0.8-0.9: NOTES v23).

    PYTHONPATH=src ncu --clock-control none --section SpeedOfLight --section MemoryWorkloadAnalysis \\
        --section Occupancy --section WarpStateStats --section LaunchStats -k regex:_tile --launch-skip 5 \\
        python benchmarks/probe_quant_profile.py

The cases run twice (compile and warm, then the launches to profile) in this order: block128 per group
along the tokens, block128 along K, block128 along the tokens with no groups (the same transposed store
without the group lookup), mxfp8 weights both orientations, block128x128 weights; qwen3's x (E = 128,
M = 65536, K = 2048, skewed routing).
"""

from __future__ import annotations

import os

os.environ.setdefault("DROPLESS_AUTOTUNE", "0")

import torch

import dropless
from dropless.bench.routing import group_sizes

DEV = torch.device("cuda")


def main() -> None:
    E, M, K = 128, 65536, 2048
    offsets = torch.tensor(group_sizes(E, M, "skewed", 0, 16), device=DEV).cumsum(0).to(torch.int32)
    x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(E, 1536, K, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
    cases = [
        lambda: dropless.quantize(x, "block128", dim=0, offsets=offsets),
        lambda: dropless.quantize(x, "block128", dim=1),
        lambda: dropless.quantize(x, "block128", dim=0),
        lambda: dropless.quantize_weight(w, "mxfp8"),
        lambda: dropless.quantize_weight(w, "block128x128"),
    ]
    for _ in range(2):
        for case in cases:
            case()
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
