"""dropless.ops.grouped_forms: the four forms of torch._grouped_mm (ragged M, ragged K, ragged N, batched)
and out_dtype through dropless.grouped_mm, forward and both gradients, on the reference backend and on the
Triton kernels (the interpreter on CPU), against fp64 oracles with their fp64 autograd, and against
torch._grouped_mm itself where it runs on this build."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import assert_close, bounds_of, offsets_of, random_group_sizes

import dropless

# Sizes of the dim the offsets split (K for ragged K, N for ragged N) and the length past the last offset
# (entering no product). Empty groups, one giant group, sizes that fill no tile, all-empty groups.
SPLITS = {
    "zeros_tail": ([0, 13, 0, 21], 5),
    "giant": ([0, 70, 0], 0),
    "odd": ([17, 0, 33], 3),
    "all_empty": ([0, 0, 0], 6),
    "one_tail": ([37], 4),
    "many": (random_group_sizes(12, 50, zero_frac=0.5, rng=random.Random(3)), 2),
}
# The other two dims of the product (rows of the output and the dim that is neither split nor grouped).
DIMS = {"zeros_tail": (9, 7), "giant": (33, 5), "odd": (1, 40), "all_empty": (6, 3), "one_tail": (20, 33),
        "many": (5, 9)}
# (G, M, K, N) of the batched form: M, K or G zero included.
BATCHED = {"small": (3, 9, 7, 5), "one_group": (1, 40, 33, 17), "m0": (4, 0, 5, 6), "k0": (2, 5, 0, 3),
           "g0": (0, 4, 5, 6)}


@pytest.fixture
def nan_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.empty`` gives NaN-filled float tensors: an output element no kernel writes shows as NaN."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


def _matrix(rows: int, cols: int, dtype: torch.dtype, device, layout: str) -> torch.Tensor:
    """Random ``[rows, cols]``, row-major or a column-major view (the transpose of a contiguous one)."""
    if layout == "row":
        return torch.randn(rows, cols, dtype=dtype, device=device)
    return torch.randn(cols, rows, dtype=dtype, device=device).t()


def _operands(form: str, sizes: list[int], tail: int, rows: int, other: int, dtype, device, layout: str):
    """``(x, w)`` leaves of ``form`` whose split dim holds ``sizes`` then ``tail`` more."""
    G, split = len(sizes), sum(sizes) + tail
    if form == "ragged_m":
        x = _matrix(split, other, dtype, device, layout)
        w = torch.randn(G, rows, other, dtype=dtype, device=device).transpose(1, 2)
    elif form == "ragged_k":
        x, w = _matrix(rows, split, dtype, device, layout), _matrix(split, other, dtype, device, "row")
    else:  # ragged_n
        x = torch.randn(G, rows, other, dtype=dtype, device=device)
        x = x if layout == "row" else x.transpose(1, 2).contiguous().transpose(1, 2)
        w = _matrix(other, split, dtype, device, layout)
    return x.requires_grad_(), w.requires_grad_()


def _oracle(form: str, x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The product in fp64, group by group with plain matmuls, differentiable (zero where no group is)."""
    if form == "batched":
        return torch.bmm(x, w)
    parts = []
    for g, (s, t) in enumerate(bounds_of(sizes)):
        if form == "ragged_m":
            parts.append(x[s:t] @ w[g])
        elif form == "ragged_k":
            parts.append(x[:, s:t] @ w[s:t])
        else:
            parts.append(x[g] @ w[:, s:t])
    if form == "ragged_k":
        return torch.stack(parts)
    tail = (x.shape[0] - sum(sizes), w.shape[-1]) if form == "ragged_m" else (x.shape[1], w.shape[1] - sum(sizes))
    return torch.cat([*parts, x.new_zeros(tail)], dim=0 if form == "ragged_m" else 1)


def _fp64_leaves(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().double().cpu().requires_grad_() for t in tensors]


def _check(form: str, x: torch.Tensor, w: torch.Tensor, sizes: list[int] | None, dtype: torch.dtype,
           grad_dtype: torch.dtype, offsets: torch.Tensor | None, out_dtype: torch.dtype | None = None) -> None:
    """Output and both gradients of ``dropless.grouped_mm`` against the fp64 oracle and its autograd: every
    element finite, each group within the tolerance of ``dtype`` (the output's) or ``grad_dtype``, and the
    rows or columns past the last offset exactly zero in the output and in the gradients."""
    y = dropless.grouped_mm(x, w, offsets, out_dtype=out_dtype)
    x64, w64 = _fp64_leaves(x, w)
    y64 = _oracle(form, x64, w64, sizes)
    assert y.dtype == (out_dtype or x.dtype) and y.is_contiguous() and y.device == x.device
    assert_close(y, y64, dtype, "y")
    dy = torch.randn(y.shape, dtype=y.dtype, device=y.device)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.double().cpu())
    assert dx.dtype == x.dtype and dw.dtype == w.dtype
    if w.dim() == 3 and w.numel() > 0:
        assert dw.stride() == w.stride(), "the weight gradient keeps the weight's layout"
    assert_close(dx, dx64, grad_dtype, "dx")
    assert_close(dw, dw64, grad_dtype, "dw")
    if sizes is None:
        return
    zero = []  # (what, part) that must be exactly zero
    for g, (s, t) in enumerate(bounds_of(sizes)):
        if t == s:  # an empty group: its own slice of the output or of a gradient
            zero.append((f"group {g}'s", {"ragged_m": dw, "ragged_k": y, "ragged_n": dx}[form][g]))
        elif form == "ragged_m":
            assert_close(y[s:t], y64[s:t], dtype, f"y rows of group {g}")
        elif form == "ragged_k":
            assert_close(y[g], y64[g], dtype, f"y[{g}]")
        else:
            assert_close(y[:, s:t], y64[:, s:t], dtype, f"y columns of group {g}")
    total = sum(sizes)
    past = {"ragged_m": [("y rows", y[total:]), ("dx rows", dx[total:])],
            "ragged_k": [("dx columns", dx[:, total:]), ("dw rows", dw[total:])],
            "ragged_n": [("y columns", y[:, total:]), ("dw columns", dw[:, total:])]}[form]
    zero += [(f"{what} past the last offset", part) for what, part in past]
    for what, part in zero:
        assert bool((part == 0).all()), f"{form}: {what} not all zero"


def _check_split(form, case, dtype, device, layout="row", out_dtype=None, grad_dtype=None):
    sizes, tail = SPLITS[case]
    rows, other = DIMS[case]
    x, w = _operands(form, sizes, tail, rows, other, dtype, device, layout)
    _check(form, x, w, sizes, out_dtype or dtype, grad_dtype or dtype, offsets_of(sizes, device), out_dtype)


def _batched_operands(G, M, K, N, dtype, device, layout="row"):
    """x ``[G, M, K]`` (``split``: a view whose G and M dims do not merge) and w ``[G, K, N]`` (nn.Linear layout)."""
    x = torch.randn(G, M, K, dtype=dtype, device=device)
    if layout == "split":
        x = torch.randn(M, G, K, dtype=dtype, device=device).transpose(0, 1)
    w = torch.randn(G, N, K, dtype=dtype, device=device).transpose(1, 2)
    return x.requires_grad_(), w.requires_grad_()


# ---------------------------------------------------------------------------------------------------
# Ragged K (2d/2d) and ragged N (3d/2d): every split, both backends, operands row-major or transposed views


@pytest.mark.parametrize("layout", ["row", "col"])
@pytest.mark.parametrize("case", list(SPLITS))
@pytest.mark.parametrize("form", ["ragged_k", "ragged_n"])
def test_ragged_forms(form, case, layout, backend, nan_empty):
    _, device = backend
    _check_split(form, case, torch.float32, device, layout)


@pytest.mark.parametrize("case", list(SPLITS))
@pytest.mark.parametrize("form", ["ragged_m", "ragged_k", "ragged_n"])
def test_ragged_forms_fp64(form, case, reference_backend):
    _check_split(form, case, torch.float64, reference_backend)


def test_group_sizes_instead_of_offsets(backend):
    _, device = backend
    sizes, tail = SPLITS["zeros_tail"]
    for form in ("ragged_k", "ragged_n"):
        x, w = _operands(form, sizes, tail, 6, 5, torch.float32, device, "row")
        by_offsets = dropless.grouped_mm(x, w, offs=offsets_of(sizes, device))
        by_sizes = dropless.grouped_mm(x, w, group_sizes=torch.tensor(sizes, device=device))
        assert torch.equal(by_offsets, by_sizes), form


# ---------------------------------------------------------------------------------------------------
# Batched (3d/3d)


@pytest.mark.parametrize("case", list(BATCHED))
def test_batched(case, backend, nan_empty):
    _, device = backend
    x, w = _batched_operands(*BATCHED[case], torch.float32, device)
    _check("batched", x, w, None, torch.float32, torch.float32, None)


@pytest.mark.parametrize("layout", ["row", "split"])
def test_batched_fp64_and_layouts(layout, backend):
    name, device = backend
    dtype = torch.float64 if name == "reference" else torch.float32
    x, w = _batched_operands(3, 10, 6, 4, dtype, device, layout)
    _check("batched", x, w, None, dtype, dtype, None)


# ---------------------------------------------------------------------------------------------------
# out_dtype: bf16 operands written in fp32 (straight from the fp32 accumulator), fp32 ones in bf16


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["ragged_m", "ragged_k", "ragged_n", "batched"])
def test_out_dtype(form, out_dtype, backend, nan_empty):
    _, device = backend
    dtype = torch.bfloat16 if out_dtype == torch.float32 else torch.float32
    if form == "batched":
        x, w = _batched_operands(3, 9, 7, 5, dtype, device)
        _check(form, x, w, None, out_dtype, dtype, None, out_dtype)
    else:
        # The output's tolerance: fp32 for fp32 out of bf16 operands (the oracle reads the same bf16 values).
        _check_split(form, "zeros_tail", dtype, device, out_dtype=out_dtype, grad_dtype=dtype)


# ---------------------------------------------------------------------------------------------------
# torch._grouped_mm itself, where this build runs it (it needs int32 offsets and 16-byte aligned strides,
# and leaves the rows and columns past the last offset, and their gradients, unwritten: compared inside)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("form", ["ragged_m", "ragged_k", "ragged_n", "batched"])
def test_matches_torch_grouped_mm(form, dtype, backend):
    _, device = backend
    sizes, G = [8, 0, 24, 16], 4
    end, total = sum(sizes), sum(sizes) + 8  # the last offset, and 8 past it
    offsets = offsets_of(sizes, device) if form != "batched" else None
    shapes = {"ragged_m": ((total, 16), (G, 16, 24)), "ragged_k": ((16, total), (total, 24)),
              "ragged_n": ((G, 16, 24), (24, total)), "batched": ((G, 16, 24), (G, 24, 8))}[form]
    x = torch.randn(shapes[0], dtype=dtype, device=device, requires_grad=True)
    w = torch.randn(shapes[1], dtype=dtype, device=device, requires_grad=True)
    try:
        y_torch = torch._grouped_mm(x, w, offs=offsets)
    except RuntimeError as exc:  # not on this build or device, or not in this dtype (CUDA takes bf16 only)
        pytest.skip(f"torch._grouped_mm does not run it here: {exc}")
    y = dropless.grouped_mm(x, w, offs=offsets)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad(y, (x, w), dy)
    grads_torch = torch.autograd.grad(y_torch, (x, w), dy)
    inside = {"ragged_m": ((slice(0, end),), (slice(0, end),), (...,)),
              "ragged_k": ((...,), (slice(None), slice(0, end)), (slice(0, end),)),
              "ragged_n": ((slice(None), slice(0, end)), (...,), (slice(None), slice(0, end))),
              "batched": ((...,), (...,), (...,))}[form]
    for what, ours, theirs, index in zip(("y", "dx", "dw"), (y, *grads), (y_torch, *grads_torch), inside):
        assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, what
        assert_close(ours[index], theirs[index].double(), dtype, f"{form} {what} against torch._grouped_mm")


# ---------------------------------------------------------------------------------------------------
# torch.compile (reference backend on the CPU: the custom ops' fake impls carry the tracing)


@pytest.mark.slow
def test_compile_every_form(reference_backend):
    torch._dynamo.reset()
    sizes = [3, 0, 5]
    offsets = offsets_of(sizes)

    def f(a, b, c, d):
        k = dropless.grouped_mm(a, b, offsets)                       # [3, 4, 6], offsets split a's 10 columns
        n = dropless.grouped_mm(k, c, offs=offsets)                  # [4, 10]: offsets split c's columns
        return dropless.grouped_mm(k, d, out_dtype=torch.float32), n  # batched, [3, 4, 2]

    a, b = torch.randn(4, 10, dtype=torch.float64), torch.randn(10, 6, dtype=torch.float64)
    c, d = torch.randn(6, 10, dtype=torch.float64), torch.randn(3, 6, 2, dtype=torch.float64)
    leaves = [t.requires_grad_() for t in (a, b, c, d)]
    outs = torch.compile(f, fullgraph=True)(*leaves)
    loss = outs[0].double().square().sum() + outs[1].square().sum()
    grads = torch.autograd.grad(loss, leaves)

    ref = _fp64_leaves(*leaves)
    k64 = _oracle("ragged_k", ref[0], ref[1], sizes)
    n64 = _oracle("ragged_n", k64, ref[2], sizes)
    loss64 = torch.bmm(k64, ref[3]).square().sum() + n64.square().sum()
    assert outs[0].dtype == torch.float32
    assert_close(outs[0], torch.bmm(k64, ref[3]), torch.float32, "batched")
    assert_close(outs[1], n64, torch.float64, "ragged_n")
    for what, g, g64 in zip("abcd", grads, torch.autograd.grad(loss64, ref)):
        assert_close(g, g64, torch.float32, f"d{what}")
