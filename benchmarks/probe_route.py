"""The routing kernels of ``dropless.kernels.route`` against an earlier version of that module, at the three
layers' shapes (``bench moe``'s T, E, k, softmax top-k with the sort, as the one-GPU layer calls it): the
forward (routing, sums, sort's scatter) and the backward, each the median call of a CUDA graph of 10 calls
replayed, the current module at several launch shapes. Every output is compared with the earlier module's: ids, counts
and the sort equal, weights, losses and the logits' gradient within fp32 rounding.

    git show <commit>:src/dropless/kernels/route.py > /tmp/route_base.py
    PYTHONPATH=src python benchmarks/probe_route.py /tmp/route_base.py [ELEMENTS,MIN_PROGRAMS,WARPS ...]

The launches after the path set the current module's ``_BLOCK_ELEMENTS``, ``_MIN_PROGRAMS`` and ``_NUM_WARPS``
(default: the module's own, then 2048 and 1024 elements, then 1,024 programs at least).
"""
import contextlib
import importlib.util
import sys

import torch
import triton

from dropless.bench.timing import graphed_median_ms
from dropless.kernels import route as current

_spec = importlib.util.spec_from_file_location("route_base", sys.argv[1])
base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(base)
LAYERS = {"mixtral": (8192, 8, 2), "qwen3": (16384, 128, 8), "dsv2lite": (16384, 64, 6)}
NAMES = ("_BLOCK_ELEMENTS", "_MIN_PROGRAMS", "_NUM_WARPS")


def graphed_us(fn):
    return 1e3 * graphed_median_ms(fn, torch.device("cuda"), warmup=25, rep=100)


@contextlib.contextmanager
def launched(module, values):
    """``module``'s launch constants set to ``values`` (those it has) for the block."""
    saved = {n: getattr(module, n) for n in NAMES if hasattr(module, n)}
    for name, value in zip(NAMES, values):
        if hasattr(module, name):
            setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def run(module, logits, k, grad_w, grad_losses):
    out = module.route_forward(logits, k, True, True, 1.0, None, 0, 0, True)
    weights, ids, counts, losses, sorted_to_token_slot, slot_to_sorted, offsets = out
    grad = module.route_backward(logits, ids, counts, grad_w, grad_losses, True, True, 1.0)
    return ids, counts, sorted_to_token_slot, offsets, weights, losses, grad


default = tuple(getattr(current, n) for n in NAMES)
variants = [tuple(int(v) for v in a.split(",")) for a in sys.argv[2:]] or [
    default, (2048, *default[1:]), (1024, *default[1:]), (default[0], 1024, *default[2:])]
print(f"{torch.cuda.get_device_name()}; current defaults {dict(zip(NAMES, default))}")
print(f"{'layer':9} {'version':28} {'fwd us':>8} {'bwd us':>8} {'programs':>9}  check")
for layer, (T, E, k) in LAYERS.items():
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(T, E, device="cuda", generator=gen) * 2
    grad_w = torch.randn(T, k, device="cuda", generator=gen)
    grad_losses = torch.tensor([0.7, 0.3], device="cuda")
    expected = run(base, logits, k, grad_w, grad_losses)
    rows = [("base", base, None)] + [(",".join(map(str, v)), current, v) for v in variants]
    for label, module, values in rows:
        with launched(module, values or ()):
            got = run(module, logits, k, grad_w, grad_losses)
            same = all(torch.equal(a, b) for a, b in zip(got[:4], expected[:4]))
            close = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(got[4:], expected[4:]))
            fwd = graphed_us(lambda: module.route_forward(logits, k, True, True, 1.0, None, 0, 0, True))
            ids, counts = got[0], got[1]
            bwd = graphed_us(lambda: module.route_backward(logits, ids, counts, grad_w, grad_losses, True, True, 1.0))
            block_t, _ = module._block_rows(E, T)
        print(f"{layer:9} {label:28} {fwd:8.1f} {bwd:8.1f} {triton.cdiv(T, block_t):9d}  "
              f"{'equal' if same and close else 'DIFFERENT'}")
