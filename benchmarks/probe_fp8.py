"""FP8 probe: the Hopper Gluon kernel (rowwise, epilogue scales) against the Triton FP8 kernels and BF16,
forward at three shapes, and the rowwise fwd+bwd with the weight cached; correctness first.

    PYTHONPATH=src python benchmarks/probe_fp8.py
"""

from __future__ import annotations

import os

os.environ.setdefault("DROPLESS_AUTOTUNE", "0")

import torch
from triton.testing import do_bench

import dropless
from dropless import reference
from dropless.bench.routing import group_sizes
from dropless.kernels.config import GemmConfig
from dropless.ops.fp8_launch import launch_ragged_m_fp8

SHAPES = [("mixtral-up", 4, 16384, 4096, 14336), ("dsv3-down", 32, 32768, 2048, 7168),
          ("qwen3-up", 128, 65536, 2048, 1536)]


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    dev = torch.device("cuda")
    rows = []
    for name, E, M, K, N in SHAPES:
        sizes = group_sizes(E, M, "skewed", 0, 16)
        offsets = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        w = torch.randn(E, K, N, device=dev, dtype=torch.bfloat16) * K ** -0.5
        wT = w.transpose(1, 2).contiguous().transpose(1, 2)  # nn.Linear storage
        xq = dropless.quantize(x, "rowwise", dim=1)
        wk, wn = dropless.quantize_weight(wT, "rowwise")
        ref = reference.grouped_mm(xq.dequantize(), wk.dequantize(), offsets)
        y_bf16 = dropless.grouped_mm(x, wT, offsets)
        outs = {}
        for label, config in (("gluon", GemmConfig(128, 256, 128, num_warps=8, num_stages=3, gluon=True)),
                              ("gluon4", GemmConfig(128, 256, 128, num_warps=8, num_stages=4, gluon=True)),
                              ("triton", GemmConfig(128, 256, 64, num_warps=8, num_stages=4, flatten=True))):
            y = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
            try:
                launch_ragged_m_fp8(xq, wk, offsets, y, config)
                err = rel(y, ref)
                ms = do_bench(lambda: launch_ragged_m_fp8(xq, wk, offsets, y, config), warmup=100, rep=200,
                              return_mode="median")
                outs[label] = (err, 2 * M * K * N / ms / 1e9)
            except Exception as exc:  # noqa: BLE001
                outs[label] = (str(exc).splitlines()[0][:80], None)
        ms_bf16 = do_bench(lambda: dropless.grouped_mm(x, wT, offsets), warmup=100, rep=200, return_mode="median")
        ms_q = do_bench(lambda: dropless.quantize(x, "rowwise", dim=1), warmup=50, rep=100, return_mode="median")
        ms_qw = do_bench(lambda: dropless.quantize_weight(wT, "rowwise"), warmup=50, rep=100, return_mode="median")
        # fwd+bwd, weights cached, end to end through grouped_mm
        xl = x.detach().requires_grad_()
        wl = wT.detach().requires_grad_()
        dy = torch.randn(M, N, device=dev, dtype=torch.bfloat16)

        def step8():
            y = dropless.grouped_mm(xl, wl, offsets, recipe="rowwise", w_quantized=(wk, wn))
            return torch.autograd.grad(y, (xl, wl), dy)

        def step16():
            y = dropless.grouped_mm(xl, wl, offsets)
            return torch.autograd.grad(y, (xl, wl), dy)
        g8, g16 = step8(), step16()
        fb_err = max(rel(a, b) for a, b in zip(g8, g16))
        ms8 = do_bench(step8, warmup=100, rep=300, return_mode="median")
        ms16 = do_bench(step16, warmup=100, rep=300, return_mode="median")
        rows.append((name, outs, 2 * M * K * N / ms_bf16 / 1e9, ms_q, ms_qw, 6 * M * K * N / ms8 / 1e9,
                     6 * M * K * N / ms16 / 1e9, fb_err, rel(y_bf16, ref)))
    print("| shape | fwd gluon3 (err) | gluon4 | triton fast | bf16 fwd | quant x ms | quant w ms | fwd+bwd fp8 cached"
          " | fwd+bwd bf16 | ratio | fb err vs bf16 |")
    for name, outs, bf, mq, mqw, f8, f16, fbe, e16 in rows:
        cells = [f"{v[1]:.0f} ({v[0]:.1e})" if v[1] else f"ERR {v[0]}" for v in outs.values()]
        print(f"| {name} | " + " | ".join(cells) + f" | {bf:.0f} | {mq:.3f} | {mqw:.3f} | {f8:.0f} | {f16:.0f} | "
              f"{f8 / f16:.2f} | {fbe:.3f} |")


if __name__ == "__main__":
    main()
