"""The FP8 rowwise weight gradient's kernels and the rowwise activation quantizers, variant by variant.

    PYTHONPATH=src python benchmarks/probe_fp8_wgrad_quant.py [wgrad] [quant]

wgrad: at the seven GEMM shapes (skewed routing, groups 16-aligned), the ragged-K product of operands
quantized per group along the tokens: the Triton kernel (fast accumulation) and every candidate of the
Hopper Gluon kernel, against the BF16 weight gradient, in TFLOP/s.
quant: the activation quantizers at the fwd+bwd's tensors (x and dy of dsv3-ep8-down and
qwen3-30b-a3b-up), in GB/s of bytes moved once (read + written) against a device copy's GB/s: along
K (rows), per group along the tokens (two passes) over tile shapes, and both from one launch.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DROPLESS_AUTOTUNE", "0")

import torch
from triton.testing import do_bench

import dropless
from dropless.bench.routing import group_sizes
from dropless.bench.shapes import SHAPES
from dropless.kernels import quantize as qk
from dropless.kernels import tuning
from dropless.kernels.ragged_k import NO_ACCUMULATE
from dropless.ops.quantize import quantize_pair
from dropless.quantized import get_recipe

DEV = torch.device("cuda")
ROWWISE = get_recipe("rowwise")


def ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=60, return_mode="median")


def offsets_for(E: int, M: int) -> torch.Tensor:
    return torch.tensor(group_sizes(E, M, "skewed", 0, 16), device=DEV).cumsum(0).to(torch.int32)


def wgrad() -> None:
    configs = [("triton-fast", tuning._RAGGED_K_FP8_FAST.default)]
    configs += [(f"gluon {c}", c) for c in tuning._RAGGED_K_FP8_HOPPER.candidates]
    print("| shape | bf16 wgrad | " + " | ".join(name for name, _ in configs) + " |")
    for s in SHAPES:
        offsets = offsets_for(s.E, s.M)
        x = torch.randn(s.M, s.K, device=DEV, dtype=torch.bfloat16)
        dy = torch.randn(s.M, s.N, device=DEV, dtype=torch.bfloat16)
        xt = dropless.quantize(x, ROWWISE, dim=0, offsets=offsets)
        dyt = dropless.quantize(dy, ROWWISE, dim=0, offsets=offsets)
        out = torch.empty(s.E, s.N, s.K, device=DEV, dtype=torch.bfloat16).transpose(1, 2)
        flops = 2 * s.M * s.K * s.N
        cells = [flops / ms(lambda: dropless.grouped_mm_wgrad(x, dy, offsets)) / 1e9]
        ref = dropless.grouped_mm_wgrad(x, dy, offsets).float()
        for _, config in configs:
            def run():
                tuning.run_ragged_k_fp8(xt.data, xt.scale, dyt.data, dyt.scale, None, offsets, out, NO_ACCUMULATE,
                                        None, fast_accum=True, config=config)
            run()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            cells.append(f"{flops / ms(run) / 1e9:.0f} (err {err:.3f})")
        print(f"| {s.name} | {cells[0]:.0f} | " + " | ".join(cells[1:]) + " |", flush=True)


def quant() -> None:
    tensors = [("dsv3 x", 32, 32768, 2048), ("dsv3 dy", 32, 32768, 7168), ("qwen3 x", 128, 65536, 2048),
               ("qwen3 dy", 128, 65536, 1536)]
    shapes = [(128, 64, 4), (128, 64, 8), (64, 128, 4), (64, 128, 8), (128, 128, 8), (256, 64, 8), (64, 64, 4),
              (32, 128, 4)]
    original = qk._tile_shape
    print("| tensor | copy GB/s | along K | tokens (default) | pair: 2 calls | pair: one launch (default) | "
          + " | ".join(f"tokens {a}x{b}/w{w}" for a, b, w in shapes) + " | "
          + " | ".join(f"one launch {a}x{b}/w{w}" for a, b, w in shapes) + " |")
    for name, E, M, C in tensors:
        offsets = offsets_for(E, M)
        x = torch.randn(M, C, device=DEV, dtype=torch.bfloat16)
        once = 3 * M * C  # bf16 read once, fp8 written once
        gbs = lambda t, n=once: f"{n / t / 1e6:.0f}"
        y = torch.empty_like(x)
        cells = [gbs(ms(lambda: y.copy_(x)), 4 * M * C)]
        cells.append(gbs(ms(lambda: dropless.quantize(x, ROWWISE, dim=1))))
        cells.append(gbs(ms(lambda: dropless.quantize(x, ROWWISE, dim=0, offsets=offsets))))
        cells.append(gbs(ms(lambda: quantize_pair(x, ROWWISE, offsets)), 4 * M * C))
        qk_ref, qm_ref = quantize_pair(x, ROWWISE, offsets)
        k_out, m_out = quantize_pair(x, ROWWISE, offsets)

        def both():
            qk.quantize_both(x, k_out.data, k_out.scale, m_out.data, m_out.scale, ROWWISE, offsets)

        both()
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in (
            (k_out.data, qk_ref.data), (m_out.data, qm_ref.data))) and torch.equal(
            k_out.scale, qk_ref.scale) and torch.equal(m_out.scale, qm_ref.scale)
        cells.append(gbs(ms(both), 4 * M * C) + ("" if same else " MISMATCH"))
        for fused in (False, True):
            for shape in shapes:
                qk._tile_shape = lambda *args, shape=shape: shape
                try:
                    fn = both if fused else (lambda: dropless.quantize(x, ROWWISE, dim=0, offsets=offsets))
                    cells.append(gbs(ms(fn), 4 * M * C if fused else once))
                except Exception as error:  # a tile shape the compiler refuses
                    cells.append(f"fail {type(error).__name__}")
                finally:
                    qk._tile_shape = original
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    parts = sys.argv[1:] or ["wgrad", "quant"]
    if "wgrad" in parts:
        wgrad()
    if "quant" in parts:
        quant()
