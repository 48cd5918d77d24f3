"""dropless.ops.checks: bad arguments raise a clear error naming the argument; opt-in offsets validation."""

from __future__ import annotations

import pytest
import torch
from conftest import offsets_of

import dropless

M, K, N, E = 12, 8, 6, 3


def _operands(device="cpu", dtype=torch.float32):
    x = torch.randn(M, K, device=device, dtype=dtype)
    w = torch.randn(E, K, N, device=device, dtype=dtype)
    dy = torch.randn(M, N, device=device, dtype=dtype)
    return x, w, dy, offsets_of([4, 0, 6], device)


META = torch.device("meta")  # stands in for a second device


# (name, error type, message pattern, callable building the bad call from good operands)
GROUPED_MM_BAD = [
    ("x rank 1", ValueError, r"^x must have 2 or 3 dimensions", lambda x, w, o: dropless.grouped_mm(x[0], w, o)),
    ("x rank 4", ValueError, r"^x must have 2 or 3 dimensions",
     lambda x, w, o: dropless.grouped_mm(x[None, None], w, o)),
    ("x int dtype", TypeError, r"^x must have dtype", lambda x, w, o: dropless.grouped_mm(x.long(), w.long(), o)),
    ("w rank 1", ValueError, r"^w must have 2 or 3 dimensions", lambda x, w, o: dropless.grouped_mm(x, w[0, 0], o)),
    ("w rank 4", ValueError, r"^w must have 2 or 3 dimensions", lambda x, w, o: dropless.grouped_mm(x, w[None], o)),
    ("w dtype", TypeError, r"^w must have (x's )?dtype", lambda x, w, o: dropless.grouped_mm(x, w.double(), o)),
    ("w K", ValueError, r"^w must have shape \[E, K=8, N\]", lambda x, w, o: dropless.grouped_mm(x, w[:, :5], o)),
    ("w no experts", ValueError, r"^w must hold at least one expert",
     lambda x, w, o: dropless.grouped_mm(x, w[:0], o[:0])),
    ("w device", ValueError, r"^w is on meta", lambda x, w, o: dropless.grouped_mm(x, w.to(META), o)),
    ("offsets dtype float", TypeError, r"^offsets must be int32 or int64",
     lambda x, w, o: dropless.grouped_mm(x, w, o.float())),
    ("offsets dtype int16", TypeError, r"^offsets must be int32 or int64",
     lambda x, w, o: dropless.grouped_mm(x, w, o.short())),
    ("offsets length", ValueError, r"^offsets must have shape \[E\] = \[3\]",
     lambda x, w, o: dropless.grouped_mm(x, w, o[:2])),
    ("offsets rank", ValueError, r"^offsets must have shape \[E\]",
     lambda x, w, o: dropless.grouped_mm(x, w, o[None])),
    ("offsets list", TypeError, r"^offsets must be a torch\.Tensor",
     lambda x, w, o: dropless.grouped_mm(x, w, o.tolist())),
    ("offsets device", ValueError, r"^offsets is on meta", lambda x, w, o: dropless.grouped_mm(x, w, o.to(META))),
    ("offs alias device", ValueError, r"^offsets is on meta",
     lambda x, w, o: dropless.grouped_mm(x, w, offs=o.to(META))),
    ("group_sizes dtype", TypeError, r"^group_sizes must be int32 or int64",
     lambda x, w, o: dropless.grouped_mm(x, w, group_sizes=o.float())),
    ("group_sizes length", ValueError, r"^group_sizes must have shape \[E\] = \[3\]",
     lambda x, w, o: dropless.grouped_mm(x, w, group_sizes=o[:1])),
    ("group_sizes device", ValueError, r"^group_sizes is on meta",
     lambda x, w, o: dropless.grouped_mm(x, w, group_sizes=o.to(META))),
    ("group_sizes list", TypeError, r"^group_sizes must be a torch\.Tensor",
     lambda x, w, o: dropless.grouped_mm(x, w, group_sizes=[4, 0, 6])),
    ("both", ValueError, r"exactly one of offsets .* and group_sizes",
     lambda x, w, o: dropless.grouped_mm(x, w, o, group_sizes=o)),
    ("neither", ValueError, r"exactly one of offsets .* and group_sizes", lambda x, w, o: dropless.grouped_mm(x, w)),
    ("offsets and offs", ValueError, r"offsets or its alias offs, not both",
     lambda x, w, o: dropless.grouped_mm(x, w, o, offs=o)),
    ("out_dtype int", TypeError, r"^out_dtype must be one of .*got torch\.int32",
     lambda x, w, o: dropless.grouped_mm(x, w, o, out_dtype=torch.int32)),
    ("out_dtype str", TypeError, r"^out_dtype must be one of .*got 'bf16'",
     lambda x, w, o: dropless.grouped_mm(x, w, o, out_dtype="bf16")),
    # ragged K: x [M, K] and w [K, N], offsets split K
    ("ragged K w rows", ValueError, r"^w must have shape \[K=8, N\] to match x \[M, K\], got \(5, 6\)",
     lambda x, w, o: dropless.grouped_mm(x, w[0, :5], o)),
    ("ragged K no offsets", ValueError, r"exactly one of offsets .* and group_sizes",
     lambda x, w, o: dropless.grouped_mm(x, w[0])),
    ("ragged K offsets rank", ValueError, r"^offsets must have shape \[E\] \(one entry per expert\), got \(1, 3\)",
     lambda x, w, o: dropless.grouped_mm(x, w[0], o[None])),
    ("ragged K offsets dtype", TypeError, r"^offsets must be int32 or int64",
     lambda x, w, o: dropless.grouped_mm(x, w[0], o.float())),
    ("ragged K w dtype", TypeError, r"^w must have x's dtype", lambda x, w, o: dropless.grouped_mm(x, w[0].half(), o)),
    # ragged N: x [G, M, K] and w [K, N], offsets split N
    ("ragged N w rows", ValueError, r"^w must have shape \[K=8, N\] to match x \[G, M, K\], got \(5, 6\)",
     lambda x, w, o: dropless.grouped_mm(x.view(E, 4, K), w[0, :5], o)),
    ("ragged N offsets length", ValueError, r"^offsets must have shape \[E\] = \[3\]",
     lambda x, w, o: dropless.grouped_mm(x.view(E, 4, K), w[0], o[:2])),
    ("ragged N no groups", ValueError, r"^x must hold at least one group",
     lambda x, w, o: dropless.grouped_mm(x.view(E, 4, K)[:0], w[0], o[:0])),
    ("ragged N no offsets", ValueError, r"exactly one of offsets .* and group_sizes",
     lambda x, w, o: dropless.grouped_mm(x.view(E, 4, K), w[0])),
    ("ragged N w device", ValueError, r"^w is on meta",
     lambda x, w, o: dropless.grouped_mm(x.view(E, 4, K), w[0].to(META), o)),
    # batched: x [G, M, K] and w [G, K, N], no offsets
    ("batched w groups", ValueError, r"^w must have shape \[G=1, K=8, N\] to match x \[G, M, K\], got \(3, 8, 6\)",
     lambda x, w, o: dropless.grouped_mm(x[None], w)),
    ("batched w K", ValueError, r"^w must have shape \[G=3, K=8, N\]",
     lambda x, w, o: dropless.grouped_mm(x.view(E, 4, K), w[:, :5])),
    ("batched offsets", ValueError, r"^offsets must not be given with a 3d x and a 3d w",
     lambda x, w, o: dropless.grouped_mm(x.view(E, 4, K), w, o)),
    ("batched offs", ValueError, r"^offs must not be given with a 3d x and a 3d w",
     lambda x, w, o: dropless.grouped_mm(x.view(E, 4, K), w, offs=o)),
    ("batched group_sizes", ValueError, r"^group_sizes must not be given with a 3d x and a 3d w",
     lambda x, w, o: dropless.grouped_mm(x.view(E, 4, K), w, group_sizes=o)),
    ("batched w dtype", TypeError, r"^w must have x's dtype",
     lambda x, w, o: dropless.grouped_mm(x.view(E, 4, K), w.half())),
    # FP8 runs the ragged-M form only
    ("recipe ragged K", ValueError, r"^recipe= \(FP8\) runs the ragged-M form only.*w of shape \(8, 6\)",
     lambda x, w, o: dropless.grouped_mm(x, w[0], o, recipe="rowwise")),
    ("recipe batched", ValueError, r"^recipe= \(FP8\) runs the ragged-M form only.*x of shape \(3, 4, 8\)",
     lambda x, w, o: dropless.grouped_mm(x.view(E, 4, K), w, recipe="rowwise")),
    ("recipe out_dtype", ValueError, r"^out_dtype cannot be given with recipe=",
     lambda x, w, o: dropless.grouped_mm(x, w, o, recipe="rowwise", out_dtype=torch.float32)),
]


@pytest.mark.parametrize("name, error, pattern, call", GROUPED_MM_BAD, ids=[c[0] for c in GROUPED_MM_BAD])
def test_grouped_mm_bad_arguments(name, error, pattern, call, backend):
    _, device = backend
    x, w, _, offsets = _operands(device)
    with pytest.raises(error, match=pattern):
        call(x, w, offsets)


@pytest.mark.parametrize("op", ["grouped_mm", "grouped_mm_wgrad"])
def test_x_not_a_tensor(op):
    x, w, dy, offsets = _operands()
    with pytest.raises(TypeError, match=r"^x must be a torch\.Tensor"):
        if op == "grouped_mm":
            dropless.grouped_mm(x.tolist(), w, offsets)
        else:
            dropless.grouped_mm_wgrad(x.tolist(), dy, offsets)


def test_grouped_mm_fp64_only_on_reference(backend):
    name, device = backend
    x, w, _, offsets = _operands(device, torch.float64)
    if name == "reference":
        assert dropless.grouped_mm(x, w, offsets).dtype == torch.float64
        assert dropless.grouped_mm(x.float(), w.float(), offsets, out_dtype=torch.float64).dtype == torch.float64
    else:
        with pytest.raises(TypeError, match=r"^x must have dtype in .*float32.*got torch\.float64"):
            dropless.grouped_mm(x, w, offsets)
        with pytest.raises(TypeError, match=r"^out_dtype must be one of .*float32.*got torch\.float64"):
            dropless.grouped_mm(x.float(), w.float(), offsets, out_dtype=torch.float64)


WGRAD_BAD = [
    ("x rank", ValueError, r"^x must have 2 dimensions",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(x[None], dy, o)),
    ("x dtype", TypeError, r"^x must have dtype", lambda x, dy, o, out: dropless.grouped_mm_wgrad(x.int(), dy, o)),
    ("dy rank", ValueError, r"^dy must have 2 dimensions",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy[0], o)),
    ("dy dtype", TypeError, r"^dy must have x's dtype",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy.half(), o)),
    ("dy rows", ValueError, r"^dy must have x's number of rows M=12",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy[:5], o)),
    ("dy device", ValueError, r"^dy is on meta", lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy.to(META), o)),
    ("offsets dtype", TypeError, r"^offsets must be int32 or int64",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy, o.double())),
    ("offsets rank", ValueError, r"^offsets must have shape \[E\] \(one entry per expert\), got \(1, 3\)",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy, o[None])),
    ("offsets device", ValueError, r"^offsets is on meta",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy, o.to(META))),
    ("offsets list", TypeError, r"^offsets must be a torch\.Tensor",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy, o.tolist())),
    ("group_sizes device", ValueError, r"^group_sizes is on meta",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy, group_sizes=o.to(META))),
    ("both", ValueError, r"exactly one of offsets", lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy, o, group_sizes=o)),
    ("neither", ValueError, r"exactly one of offsets", lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy)),
    ("out rank", ValueError, r"^out must have 3 dimensions",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy, o, out=out[0])),
    ("out shape E", ValueError, r"^out must have shape \[E, K, N\] = \[3, 8, 6\]",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy, o, out=out[:2])),
    ("out shape KN swapped", ValueError, r"^out must have shape \[E, K, N\]",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy, o, out=torch.zeros(E, N, K, device=out.device))),
    ("out dtype", TypeError, r"^out must have dtype",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy, o, out=out.half())),
    ("out device", ValueError, r"^out is on meta",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy, o, out=out.to(META))),
    ("out not a tensor", TypeError, r"^out must be a torch\.Tensor",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy, o, out=out.tolist())),
    ("accumulate int", TypeError, r"^accumulate must be a bool",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy, o, out=out, accumulate=1)),
    ("accumulate str", TypeError, r"^accumulate must be a bool",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy, o, out=out, accumulate="yes")),
    ("accumulate tensor dtype", ValueError, r"^accumulate as a tensor must be bool \[E\] = \[3\]",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy, o, out=out, accumulate=torch.ones(E, device=out.device))),
    ("accumulate tensor shape", ValueError, r"^accumulate as a tensor must be bool \[E\] = \[3\]",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(
         x, dy, o, out=out, accumulate=torch.ones(E + 1, dtype=torch.bool, device=out.device))),
    ("accumulate tensor device", ValueError, r"^accumulate is on meta",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(
         x, dy, o, out=out, accumulate=torch.ones(E, dtype=torch.bool, device=META))),
    ("accumulate without out", ValueError, r"^accumulate needs out=",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy, o, accumulate=True)),
    ("accumulate mask without out", ValueError, r"^accumulate needs out=",
     lambda x, dy, o, out: dropless.grouped_mm_wgrad(x, dy, o, accumulate=torch.ones(E, dtype=torch.bool))),
]


@pytest.mark.parametrize("name, error, pattern, call", WGRAD_BAD, ids=[c[0] for c in WGRAD_BAD])
def test_wgrad_bad_arguments(name, error, pattern, call, backend):
    _, device = backend
    x, _, dy, offsets = _operands(device)
    out = torch.full((E, K, N), 3.0, device=device)
    with pytest.raises(error, match=pattern):
        call(x, dy, offsets, out)
    assert bool((out == 3.0).all()), "a rejected call must not write out"


# ---------------------------------------------------------------------------------------------------
# Opt-in validation of offsets (torch._assert_async: raises at once on the CPU)

INVALID = {
    "decreasing": [5, 3, 8],
    "past_m": [4, 6, M + 1],
    "negative_first": [-1, 4, 6],
    "decreasing_to_negative": [4, 6, -2],
}


@pytest.mark.parametrize("case", list(INVALID))
@pytest.mark.parametrize("switch", ["set_validation", "env"])
def test_validation_rejects_malformed_offsets(case, switch, monkeypatch):
    # The reference backend on the CPU: the device-side assertion raises synchronously there.
    dropless.set_backend("reference")
    if switch == "set_validation":
        dropless.set_validation(True)
    else:
        monkeypatch.setenv("DROPLESS_VALIDATE", "1")
    x, w, dy, _ = _operands()
    bad = torch.tensor(INVALID[case], dtype=torch.int32)
    pattern = r"offsets must be non-decreasing and within \[0, M=12\]"
    with pytest.raises(RuntimeError, match=pattern):
        dropless.grouped_mm(x, w, bad)
    with pytest.raises(RuntimeError, match=pattern):
        dropless.grouped_mm_wgrad(x, dy, bad)
    with pytest.raises(RuntimeError, match=pattern):
        dropless.grouped_mm_wgrad(x, dy, bad, out=torch.zeros(E, K, N), accumulate=True)


def test_validation_names_the_split_dim():
    """Offsets split K in the ragged-K form and N in the ragged-N form: the assertion bounds them by that."""
    dropless.set_backend("reference")
    dropless.set_validation(True)
    x, w, _, _ = _operands()
    with pytest.raises(RuntimeError, match=r"offsets must be non-decreasing and within \[0, K=8\]"):
        dropless.grouped_mm(x, w[0], torch.tensor([2, 4, K + 1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"offsets must be non-decreasing and within \[0, N=6\]"):
        dropless.grouped_mm(x.view(E, 4, K), w[0], torch.tensor([5, 3, 6], dtype=torch.int32))


def test_validation_rejects_negative_group_sizes():
    dropless.set_validation(True)
    x, w, _, _ = _operands()
    with pytest.raises(RuntimeError, match="non-decreasing"):
        dropless.grouped_mm(x, w, group_sizes=torch.tensor([4, -2, 3]))
    with pytest.raises(RuntimeError, match="non-decreasing"):
        dropless.GroupedLinear(E, K, N)(x, torch.tensor([4, -2, 3]))


def test_validation_accepts_good_offsets(backend):
    _, device = backend
    dropless.set_validation(True)
    x, w, dy, _ = _operands(device)
    for sizes in ([4, 0, 6], [0, 0, 0], [0, 0, M], [M, 0, 0]):
        y = dropless.grouped_mm(x, w, offsets_of(sizes, device))
        assert y.shape == (M, N)
        dropless.grouped_mm_wgrad(x, dy, group_sizes=torch.tensor(sizes, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize()


def test_validation_off_by_default():
    x, w, _, _ = _operands()
    dropless.set_backend("reference")
    y = dropless.grouped_mm(x, w, torch.tensor([5, 3, 8], dtype=torch.int32))  # no error raised
    assert y.shape == (M, N)
    dropless.set_validation(True)
    dropless.set_validation(False)
    assert dropless.grouped_mm(x, w, torch.tensor([4, 6, M + 5], dtype=torch.int32)).shape == (M, N)
