"""Quantization per group along the tokens: the Gluon kernel (``kernels/quantize_hopper.py``) against the
Triton tile kernel it replaces for 16-bit x, on the benchmark's activations, one GPU.

    PYTHONPATH=src python benchmarks/probe_quant_groups.py [--recipes block128 mxfp8 rowwise] [--variants]

For each tensor, routing and recipe: both kernels' outputs compared byte for byte with the reference
(``dropless.reference.quantize``, run on the GPU), then the GB/s of the
least bytes a call must move (x read once, 2 bytes an element, the FP8 copy written, 1 byte) as a share
of a device copy's GB/s (bytes read + written) measured in the same run, and the Gluon kernel's
speed-up. The host's own time is not in it: each call is timed on the GPU (``do_bench``, median). Last, the
permuted copies of a layer's tokens, quantized from the tokens by index (``rows=``), counting the
bytes of the copies (a row read per copy).

``--variants``: instead, the Gluon kernel's blockwise tiles read by TMA in each ``(loader warps, programs a
multiprocessor, stages, rows a thread)`` of ``VARIANTS``, each variant's bytes checked against the reference and its
share of the copy printed (replayed from a CUDA graph: the GPU's time alone), per tensor (balanced routing) and recipe.
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("DROPLESS_AUTOTUNE", "0")

import torch
from triton.testing import do_bench

import dropless
from dropless import reference
from dropless.bench.fp8 import hbm_gbps
from dropless.bench.routing import group_sizes
from dropless.bench.timing import graphed_median_ms
from dropless.kernels import quantize as qk
from dropless.kernels import quantize_hopper as qh
from dropless.quantized import get_recipe

DEV = torch.device("cuda")
TENSORS = [("qwen3 x", 128, 65536, 2048), ("qwen3-down x", 128, 65536, 768), ("dsv3 dy", 32, 32768, 7168),
           ("dsv3-down x", 32, 32768, 2048), ("mixtral dy", 4, 16384, 14336)]


# (TMA_LOADER_WARPS, PROGRAMS_PER_SM, STAGES, TILE_THREAD_ROWS) of kernels/quantize_hopper.py; shared
# memory allows a program (stages of 16 KB, 24 KB of output buffers) at most 9 stages alone, 5 at two, 3
# at three; registers (128 a thread) allow three programs of 5 warps, two of 8.
VARIANTS = [(4, 2, 4, 2), (1, 2, 4, 2), (1, 2, 5, 2), (1, 3, 3, 2), (1, 2, 4, 4), (1, 3, 3, 4)]
VARIANT_TENSORS = TENSORS[:3]
NAMES = ("TMA_LOADER_WARPS", "PROGRAMS_PER_SM", "STAGES", "TILE_THREAD_ROWS")


def ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def triton_only(fn, gluon_ok: str = "quantize_groups_hopper_ok"):
    """``fn`` with the Gluon kernel that ``kernels.quantize``'s predicate ``gluon_ok`` chooses turned down,
    so the Triton kernels run."""
    original = getattr(qk, gluon_ok)
    setattr(qk, gluon_ok, lambda *args: False)
    try:
        return fn()
    finally:
        setattr(qk, gluon_ok, original)


def compare(label: str, x: torch.Tensor, recipe: str, offsets: torch.Tensor, copy: float,
            rows: torch.Tensor | None = None) -> None:
    """One row of the table: ``x`` (or ``x[rows]``) quantized per group along the tokens by both kernels,
    each output checked against the reference, each kernel timed."""
    call = lambda: dropless.quantize(x, recipe, dim=0, offsets=offsets, rows=rows)  # noqa: E731
    fast, slow = call(), triton_only(call)
    ref_data, ref_scale = reference.quantize(x if rows is None else x[rows], get_recipe(recipe), 0, offsets)
    same = all(torch.equal(q.data.view(torch.uint8), ref_data.view(torch.uint8))
               and torch.equal(q.scale.view(torch.uint8), ref_scale.view(torch.uint8)) for q in (fast, slow))
    del ref_data, ref_scale, fast, slow
    t_triton, t_gluon = triton_only(lambda: ms(call)), ms(call)
    least = 3 * (x.shape[0] if rows is None else rows.shape[0]) * x.shape[1]
    print(f"{label} {recipe:9s} {1e3 * t_triton:9.1f} {1e3 * t_gluon:9.1f} {least / t_triton / 1e6 / copy:7.2f} "
          f"{least / t_gluon / 1e6 / copy:7.2f} {t_triton / t_gluon:7.2f}{'' if same else '  BYTES DIFFER'}", flush=True)


def variants(recipes: list[str], copy: float) -> None:
    """The ``--variants`` table: each blockwise recipe's share of the copy in every variant."""
    print(f"{'tensor':14s} {'recipe':9s} " + " ".join(f"{''.join(map(str, v)):>11s}" for v in VARIANTS) + "  (share of the copy)")
    saved = [getattr(qh, n) for n in NAMES]
    for name, E, M, K in VARIANT_TENSORS:
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
        offsets = torch.tensor(group_sizes(E, M, "balanced", 0, 16), device=DEV).cumsum(0).to(torch.int32)
        for recipe in (r for r in recipes if r != "rowwise"):
            ref_data, ref_scale = reference.quantize(x, get_recipe(recipe), 0, offsets)
            cells = []
            for variant in VARIANTS:
                for n, value in zip(NAMES, variant):
                    setattr(qh, n, value)
                call = lambda: dropless.quantize(x, recipe, dim=0, offsets=offsets)  # noqa: E731
                try:
                    q = call()
                    same = torch.equal(q.data.view(torch.uint8), ref_data.view(torch.uint8)) and torch.equal(
                        q.scale.view(torch.uint8), ref_scale.view(torch.uint8))
                    del q
                    seconds = graphed_median_ms(call, DEV, 10, 30) / 1e3
                    cells.append(f"{3 * M * K / seconds / 1e9 / copy:10.3f}" + (" " if same else "!"))
                except Exception as error:  # a variant the device cannot run (shared memory, registers)
                    cells.append(f"{type(error).__name__[:10]:>11s}")
                finally:
                    for n, value in zip(NAMES, saved):
                        setattr(qh, n, value)
            del ref_data, ref_scale
            print(f"{name:14s} {recipe:9s} " + " ".join(cells), flush=True)
        del x
    print("! marks bytes that differ from the reference")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipes", nargs="+", default=["block128", "mxfp8", "rowwise"])
    parser.add_argument("--variants", action="store_true")
    args = parser.parse_args()
    recipes = args.recipes
    copy = hbm_gbps(DEV, 10, 30)
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s (bytes read + written)")
    if args.variants:
        variants(recipes, copy)
        return
    print(f"{'tensor':14s} {'routing':8s} {'recipe':9s} {'triton us':>9s} {'gluon us':>9s} "
          f"{'triton':>7s} {'gluon':>7s} {'speedup':>7s}  (share of the copy)")
    for name, E, M, K in TENSORS:
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
        for routing in ("balanced", "skewed"):
            offsets = torch.tensor(group_sizes(E, M, routing, 0, 16), device=DEV).cumsum(0).to(torch.int32)
            for recipe in recipes:
                compare(f"{name:14s} {routing:8s}", x, recipe, offsets, copy)
        del x
    print("\nthe permuted copies of a layer's tokens, read by index (rows=): T tokens, top-k, M = T k rows")
    for name, E, T, k, K in [("qwen3 x", 128, 8192, 8, 2048), ("dsv3 x", 32, 4096, 8, 7168), ("mixtral x", 4, 8192, 2, 4096)]:
        tokens = torch.randn(T, K, device=DEV, dtype=torch.bfloat16)
        rows = torch.randint(0, T, (T * k,), device=DEV)
        offsets = torch.tensor(group_sizes(E, T * k, "balanced", 0, 16), device=DEV).cumsum(0).to(torch.int32)
        for recipe in recipes:
            compare(f"{name:14s} {'gather':8s}", tokens, recipe, offsets, copy, rows)
        del tokens


if __name__ == "__main__":
    main()
