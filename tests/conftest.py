"""Shared helpers of the test suite: devices, backends, random routings, poisoning, tolerances.

Without CUDA the Triton kernels run on the CPU through Triton's interpreter; the variable must be set
before triton (and so dropless) is first imported, hence at the very top of this file. With CUDA the
same tests run the real kernels on the GPU.
"""

from __future__ import annotations

import os

import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    # JAX on the CPU with several devices, for the shard_map tests (read when JAX starts).
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
else:
    # Autotuning compiles and times every candidate for each new problem class: minutes over this
    # suite. Tests take the default configs; test_kernels checks every candidate, and the tests of
    # test_gpu.py that need tuned configs (sync-free, CUDA graphs) turn it back on.
    os.environ.setdefault("DROPLESS_AUTOTUNE", "0")
    # JAX takes GPU memory as it needs it, leaving the rest to PyTorch in the same process.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import hashlib  # noqa: E402
import importlib  # noqa: E402
import random  # noqa: E402
from collections.abc import Sequence  # noqa: E402

import pytest  # noqa: E402

import dropless  # noqa: E402
from dropless import backend as backend_module  # noqa: E402
from dropless.ops import checks as checks_module  # noqa: E402
quantize_module = importlib.import_module("dropless.ops.quantize")  # the module: ops exports the function too

# The device the Triton kernels run on: the GPU when there is one, else the CPU under the interpreter.
KERNEL_DEVICE = torch.device("cuda" if CUDA else "cpu")
INTERPRETING = not CUDA
# Tests whose gloo ranks run Triton kernels on CPU tensors: the interpreter, which this suite turns on only
# where there is no GPU (above). Their GPU twins cover the same paths on GPUs.
CPU_KERNELS = pytest.mark.skipif(CUDA, reason="Triton kernels on CPU tensors run only under the interpreter, "
                                              "which the suite uses where there is no GPU")

# Relative Frobenius error ||out - ref|| / ||ref|| allowed against an fp64 reference computed from the
# same (rounded) inputs. fp32 kernels multiply with full-fp32 'ieee' dots.
REL_TOL = {
    torch.float64: 1e-12,
    torch.float32: 1e-5,
    torch.float16: 5e-3,
    torch.bfloat16: 1e-2,
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: takes tens of seconds on a CPU (torch.compile)")
    # Triton 3.6's interpreter converts 1-element arrays to scalars, which numpy 2.x deprecates.
    config.addinivalue_line("filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning")
    # Tests that plant NaN/Inf in operands make the interpreter's numpy matmul warn.
    config.addinivalue_line("filterwarnings", "ignore:invalid value encountered:RuntimeWarning")
    config.addinivalue_line("filterwarnings", "ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")


# ---------------------------------------------------------------------------------------------------
# Global state: every test starts on the default backend with validation off, and leaves it so.


@pytest.fixture(autouse=True)
def _seed_and_restore_state(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Seed torch and random from the test's id (fresh data per test, reproducible per test), undo any
    ``set_backend`` / ``set_validation`` the test makes, and start ``quantize`` with no plans kept (a test
    that changes what the kernels choose then sees its change)."""
    seed = int.from_bytes(hashlib.sha256(request.node.nodeid.encode()).digest()[:4], "little")
    torch.manual_seed(seed)
    random.seed(seed)
    monkeypatch.delenv("DROPLESS_BACKEND", raising=False)
    monkeypatch.delenv("DROPLESS_VALIDATE", raising=False)
    monkeypatch.setattr(backend_module, "_backend", None)
    monkeypatch.setattr(checks_module, "_validate", None)
    monkeypatch.setattr(quantize_module, "_PLANS", {})
    yield
    dropless.set_backend("auto")


@pytest.fixture
def triton_backend():
    """Run ops on the Triton kernels (the interpreter on CPU tensors); yields the device to use."""
    dropless.set_backend("triton")
    try:
        yield KERNEL_DEVICE
    finally:
        dropless.set_backend("auto")


@pytest.fixture
def reference_backend():
    """Run ops on the PyTorch reference; yields the device to use (the CPU)."""
    dropless.set_backend("reference")
    try:
        yield torch.device("cpu")
    finally:
        dropless.set_backend("auto")


@pytest.fixture(params=["reference", "triton"])
def backend(request: pytest.FixtureRequest):
    """Both backends: yields ``(name, device)`` with the backend selected."""
    dropless.set_backend(request.param)
    try:
        yield request.param, (KERNEL_DEVICE if request.param == "triton" else torch.device("cpu"))
    finally:
        dropless.set_backend("auto")


# ---------------------------------------------------------------------------------------------------
# Routings


def random_group_sizes(E: int, total: int, zero_frac: float = 0.3, rng: random.Random | None = None) -> list[int]:
    """E non-negative sizes summing to ``total``; about ``zero_frac`` of the experts get no rows
    (at least one expert gets rows when ``total > 0``)."""
    rng = rng or random
    if total == 0:
        return [0] * E
    active = [e for e in range(E) if rng.random() >= zero_frac] or [rng.randrange(E)]
    cuts = sorted(rng.randint(0, total) for _ in range(len(active) - 1))
    parts = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
    sizes = [0] * E
    for e, p in zip(active, parts):
        sizes[e] = p
    return sizes


def offsets_of(sizes: Sequence[int], device: torch.device | str = "cpu", dtype=torch.int32) -> torch.Tensor:
    """Cumulative group ends of ``sizes`` as an int tensor on ``device``."""
    ends, total = [], 0
    for s in sizes:
        total += s
        ends.append(total)
    return torch.tensor(ends, dtype=dtype, device=device)


def bounds_of(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """``(start, end)`` row range of each group."""
    out, start = [], 0
    for s in sizes:
        out.append((start, start + s))
        start += s
    return out


def data_rows_of(sizes: Sequence[int], M: int) -> tuple[list[int], int]:
    """``([p_e], Mp)`` of data quantized per group along the tokens, as ``dropless.quantized`` lays it out
    (written out here, not taken from the library): group e's first row ``p_e = 128 * (s_e // 128 + e)``
    and the rows ``Mp = 128 * (cdiv(M, 128) + E)``."""
    return ([128 * (start // 128 + e) for e, (start, _) in enumerate(bounds_of(sizes))],
            128 * (-(-M // 128) + len(sizes)))


# ---------------------------------------------------------------------------------------------------
# Operands in the layouts the API accepts


def make_x(M: int, K: int, dtype: torch.dtype, device, layout: str = "contiguous") -> torch.Tensor:
    """Random ``[M, K]`` in one of the layouts:

    contiguous; ``col_slice`` (columns 8.. of a wider matrix: 16-byte aligned, TMA-able rows);
    ``col_slice_odd`` (columns 1.. of a wider matrix: misaligned, the pointer path);
    ``col_major`` (the transpose of a transposed copy: unit stride along M).
    """
    if layout == "contiguous":
        return torch.randn(M, K, dtype=dtype, device=device)
    if layout == "col_slice":
        return torch.randn(M, K + 24, dtype=dtype, device=device)[:, 8:8 + K]
    if layout == "col_slice_odd":
        return torch.randn(M, K + 5, dtype=dtype, device=device)[:, 1:1 + K]
    if layout == "col_major":
        return torch.randn(M, K, dtype=dtype, device=device).t().contiguous().t()
    raise ValueError(layout)


def make_w(E: int, K: int, N: int, dtype: torch.dtype, device, layout: str = "nk") -> torch.Tensor:
    """Random ``[E, K, N]``: ``nk`` is a transposed view of nn.Linear-layout ``[E, N, K]`` weights,
    ``kn`` is contiguous ``[E, K, N]``."""
    if layout == "nk":
        return torch.randn(E, N, K, dtype=dtype, device=device).transpose(1, 2)
    if layout == "kn":
        return torch.randn(E, K, N, dtype=dtype, device=device)
    raise ValueError(layout)


def poisoned(shape, dtype: torch.dtype, device, transposed: bool = False) -> torch.Tensor:
    """A NaN-filled output buffer; ``transposed``: a ``[E, K, N]`` view of ``[E, N, K]`` storage."""
    if transposed:
        E, K, N = shape
        return torch.full((E, N, K), float("nan"), dtype=dtype, device=device).transpose(1, 2)
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


# ---------------------------------------------------------------------------------------------------
# Independent oracles in fp64 (row by row; they do not share code with dropless.reference)


def oracle_grouped_mm(x: torch.Tensor, w: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """fp64 ``y`` with ``y[i] = x[i] @ w[g(i)]`` for the rows of each group, zero past the last."""
    x64, w64 = x.detach().double().cpu(), w.detach().double().cpu()
    y = torch.zeros(x.shape[0], w.shape[2], dtype=torch.float64)
    for e, (s, t) in enumerate(bounds_of(sizes)):
        for i in range(s, t):
            y[i] = x64[i] @ w64[e]
    return y


def oracle_wgrad(x: torch.Tensor, dy: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """fp64 ``dw[e] = sum over rows i of group e of outer(x[i], dy[i])``; zero for empty groups."""
    x64, dy64 = x.detach().double().cpu(), dy.detach().double().cpu()
    dw = torch.zeros(len(sizes), x.shape[1], dy.shape[1], dtype=torch.float64)
    for e, (s, t) in enumerate(bounds_of(sizes)):
        if t > s:
            dw[e] = torch.einsum("mk,mn->kn", x64[s:t], dy64[s:t])
    return dw


# ---------------------------------------------------------------------------------------------------
# Comparisons


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``||out - ref|| / ||ref||`` in fp64 (inf when ref is zero and out is not, 0 when both are)."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    num = torch.linalg.vector_norm(out64 - ref64).item()
    den = torch.linalg.vector_norm(ref64).item()
    if den == 0:
        return 0.0 if num == 0 else float("inf")
    return num / den


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "output") -> None:
    """Every element finite and the relative Frobenius error within ``REL_TOL[dtype]``."""
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    finite = torch.isfinite(out.detach())
    assert bool(finite.all()), f"{what}: {int((~finite).sum())} non-finite elements (unwritten or poisoned)"
    err = rel_err(out, ref)
    assert err <= REL_TOL[dtype], f"{what}: relative error {err:.3g} > {REL_TOL[dtype]:g} ({dtype})"


def assert_rows_close(y: torch.Tensor, ref: torch.Tensor, sizes: Sequence[int], dtype: torch.dtype,
                      what: str = "y") -> None:
    """``y [M, N]`` against ``ref`` group by group (so a small group's error is not drowned by a big one),
    and the rows past the last group exactly zero."""
    assert_close(y, ref, dtype, what)
    for e, (s, t) in enumerate(bounds_of(sizes)):
        if t > s:
            assert_close(y[s:t], ref[s:t], dtype, f"{what} rows of group {e}")
    tail = y[sum(sizes):]
    assert bool((tail == 0).all()), f"{what}: rows past offsets[-1] are not all zero"


def assert_experts_close(dw: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str = "dw") -> None:
    """``dw [E, K, N]`` against ``ref`` expert by expert; an all-zero reference expert must be exactly zero."""
    assert_close(dw, ref, dtype, what)
    for e in range(dw.shape[0]):
        assert_close(dw[e], ref[e], dtype, f"{what}[{e}]")
