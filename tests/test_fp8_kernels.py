"""dropless.kernels FP8 grouped GEMMs: ``run_ragged_m_fp8`` / ``run_ragged_k_fp8`` on operands built here in
the layouts of ``dropless.quantized``, against the fp64 product of the dequantized operands.

The oracle broadcasts every scale over its block with its own code (``_expand``, ``_token_scales``),
and places the weight gradient's groups at their 128-aligned data rows with its own (``_grouped_data``),
not the kernels'. Outputs start as NaN, so an element the kernel skips shows; operand rows and scales
that no group may read hold NaN too (in the weight gradient's operands, the gaps between groups as well,
which the layout fills with zeros).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from conftest import (
    CUDA,
    INTERPRETING,
    KERNEL_DEVICE,
    REL_TOL,
    bounds_of,
    data_rows_of,
    offsets_of,
    poisoned,
    random_group_sizes,
    rel_err,
)

from dropless.kernels import launch, tuning
from dropless.kernels.config import GemmConfig
from dropless.kernels.ragged_k import ACCUMULATE_ALL, ACCUMULATE_FLAGGED, NO_ACCUMULATE
from dropless.kernels.ragged_k_fp8 import ragged_k_fp8_mm
from dropless.kernels.ragged_m_fp8 import ragged_m_fp8_mm, scale_map
from dropless.kernels.tuning import run_ragged_k_fp8, run_ragged_m_fp8

DEVICE = KERNEL_DEVICE
FP8 = torch.float8_e4m3fn
E8M0 = torch.float8_e8m0fnu
# Relative Frobenius error of a product against the fp64 oracle. FP8 values multiply exactly in fp32 and
# the interpreter sums in fp32; Hopper's FP8 tensor cores sum with fewer bits than fp32 (about 1e-4 of
# the result over one 64-deep step), which the kernels' promotion into fp32 after every step bounds, and
# fast accumulation (no promotion) lets grow with the reduction.
FP8_PRODUCT_TOL = REL_TOL[torch.float32] if INTERPRETING else 5e-4
FP8_FAST_ACCUM_TOL = REL_TOL[torch.float32] if INTERPRETING else 2e-3
# bf16 keeps 8 significant bits: an ulp is at most 2**-7 of the value. Rounding to nearest is within half
# of it, but Triton's interpreter truncates, so a whole ulp is allowed, element by element.
BF16_ULP = 2.0**-7


# ---------------------------------------------------------------------------------------------------
# Operands and the oracle's view of their scales


def _fp8(*shape: int) -> torch.Tensor:
    """Random float8_e4m3fn over its whole range [-448, 448]."""
    return (torch.rand(*shape) * 896 - 448).to(FP8).to(DEVICE)


def _scales(*shape: int, e8m0: bool = False) -> torch.Tensor:
    """Random positive scales: fp32 of any mantissa, or E8M0 bytes 115..135 (2**-12 .. 2**8)."""
    if e8m0:
        return torch.randint(115, 136, shape, dtype=torch.uint8).view(E8M0).to(DEVICE)
    return torch.exp2(torch.empty(shape).uniform_(-4, 4)).to(DEVICE)


def _values(scale: torch.Tensor) -> torch.Tensor:
    """fp64 values of fp32 or E8M0 scales (``2**(byte - 127)``)."""
    if scale.dtype in (E8M0, torch.uint8):
        return torch.exp2(scale.view(torch.uint8).double() - 127)
    return scale.double()


def _expand(scale: torch.Tensor, blocks: Sequence[int | None], shape: Sequence[int]) -> torch.Tensor:
    """The fp64 scale of every element of a tensor of ``shape``: each scale repeated over its block
    (None: the whole dim), cropped to the shape."""
    s = _values(scale)
    for dim, (block, size) in enumerate(zip(blocks, shape)):
        s = s.repeat_interleave(size if block is None else block, dim).narrow(dim, 0, size)
    return s


def _token_scales(scale: torch.Tensor, block: int | None, sizes: Sequence[int], M: int) -> torch.Tensor:
    """fp64 ``[M, cols]``: the scale row of each token quantized per group along the tokens (rowwise: row
    e for group e; blocks: row ``s_e // B + e + j`` for block j of group e), NaN for rows of no group."""
    s = _values(scale)
    out = torch.full((M, s.shape[1]), float("nan"), dtype=torch.float64, device=s.device)
    for e, (start, end) in enumerate(bounds_of(sizes)):
        for i in range(start, end):
            out[i] = s[e] if block is None else s[start // block + e + (i - start) // block]
    return out


def _token_scale_rows(cols: int, block: int | None, sizes: Sequence[int], M: int, e8m0: bool) -> torch.Tensor:
    """Random scales ``[E, cols]`` (rowwise) or ``[cdiv(Mp - 128 E, B) + E, cols]``; rows that no group's
    block uses (an empty group's, the padding) hold NaN, so a kernel that reads them shows."""
    E = len(sizes)
    rows = E if block is None else -(-128 * -(-M // 128) // block) + E
    scale = _scales(rows, cols, e8m0=e8m0).cpu()
    used = torch.zeros(rows, dtype=torch.bool)
    for e, (start, end) in enumerate(bounds_of(sizes)):
        if end > start:
            first = e if block is None else start // block + e
            used[first:first + (1 if block is None else -(-(end - start) // block))] = True
    if e8m0:
        scale.view(torch.uint8)[~used] = 255
    else:
        scale[~used] = float("nan")
    return scale.to(DEVICE)


def _oracle_grouped_mm(a64: torch.Tensor, b64: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """fp64 ``y[s_e:t_e] = a64[s_e:t_e] @ b64[e]``, zero past the last group."""
    y = torch.zeros(a64.shape[0], b64.shape[2], dtype=torch.float64, device=a64.device)
    for e, (s, t) in enumerate(bounds_of(sizes)):
        y[s:t] = a64[s:t] @ b64[e]
    return y


def _oracle_wgrad(a64: torch.Tensor, b64: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
    """fp64 ``dw[e] = a64[s_e:t_e]^T @ b64[s_e:t_e]``, zero for an empty group."""
    dw = torch.zeros(len(sizes), a64.shape[1], b64.shape[1], dtype=torch.float64, device=a64.device)
    for e, (s, t) in enumerate(bounds_of(sizes)):
        dw[e] = a64[s:t].T @ b64[s:t]
    return dw


def _assert_close(out: torch.Tensor, ref: torch.Tensor, what: str, product_tol: float = FP8_PRODUCT_TOL) -> None:
    """Every element finite; the relative Frobenius error within ``product_tol`` (and within ``REL_TOL``
    of a 16-bit output, whose every element is also within an ulp of the reference plus the product's
    error). An all-zero reference must be matched exactly."""
    finite = torch.isfinite(out.detach())
    assert bool(finite.all()), f"{what}: {int((~finite).sum())} non-finite elements (unwritten or poisoned)"
    err = rel_err(out, ref)
    tol = max(product_tol, REL_TOL[out.dtype])
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g} ({out.dtype})"
    if out.dtype != torch.float32:
        off = (out.detach().double() - ref).abs()
        bound = BF16_ULP * ref.abs() + product_tol * ref.abs().max()
        assert bool((off <= bound).all()), f"{what}: {int((off > bound).sum())} elements off by more than an ulp"


def _check_rows(y: torch.Tensor, ref: torch.Tensor, sizes: Sequence[int], fast_accum: bool = False) -> None:
    """``y [M, N]`` against ``ref`` group by group (a small group's error is not drowned by a big one's),
    and the rows past the last group exactly zero."""
    tol = FP8_FAST_ACCUM_TOL if fast_accum else FP8_PRODUCT_TOL
    _assert_close(y, ref, "y", tol)
    for e, (s, t) in enumerate(bounds_of(sizes)):
        if t > s:
            _assert_close(y[s:t], ref[s:t], f"y rows of group {e}", tol)
    assert bool((y[sum(sizes):] == 0).all()), "y: rows past offsets[-1] are not all zero"


def _check_experts(dw: torch.Tensor, ref: torch.Tensor, fast_accum: bool = False) -> None:
    """``dw [E, K, N]`` against ``ref`` expert by expert; an empty group's expert exactly as the reference."""
    tol = FP8_FAST_ACCUM_TOL if fast_accum else FP8_PRODUCT_TOL
    _assert_close(dw, ref, "dw", tol)
    for e in range(dw.shape[0]):
        _assert_close(dw[e], ref[e], f"dw[{e}]", tol)


# ---------------------------------------------------------------------------------------------------
# Ragged M (forward, dgrad)

# name: (a_block, b_block, a_e8m0, b_e8m0), as dropless.quantized lays the recipes out, and generic maps.
SCALE_MAPS = {
    "rowwise": ((1, None), (None, 1), False, False),
    "block128": ((1, 128), (128, 128), False, False),
    "mxfp8": ((1, 32), (32, 1), True, True),
    "block64x32": ((1, 64), (64, 32), False, False),  # several blocks along K and N at small shapes
    "a32_b_rowwise": ((1, 32), (None, 1), False, True),  # only a's scales change along K
}

# (M, K, N, sizes, out dtype); K a multiple of 16 gives fp8 rows TMA can read, the others take pointers.
SHAPES_M = {
    "aligned": (100, 64, 48, [20, 0, 45, 21], torch.float32),
    "odd": (77, 80, 100, [0, 30, 0, 0, 40, 0], torch.bfloat16),
    "unaligned_k": (60, 72, 40, [7, 33, 0, 11], torch.float32),
    "giant_group": (130, 96, 32, [0, 130, 0], torch.bfloat16),
    "m1": (1, 32, 16, [1, 0], torch.float32),
    "e1_tail": (50, 48, 40, [13], torch.float32),
}


def _ragged_m_operands(M, K, N, sizes, scale_map_name, scale_view=False):
    """a, a_scale, b, b_scale and the fp64 oracle; a's rows past the last group and their scales are NaN.

    scale_view: b_scale as a transposed view (the dgrad's weight scales are one)."""
    a_block, b_block, a_e8m0, b_e8m0 = SCALE_MAPS[scale_map_name]
    E = len(sizes)
    a = _fp8(M, K)
    b = _fp8(E, N, K).transpose(1, 2)  # [E, K, N], K contiguous
    a_scale = _scales(-(-M // a_block[0]), 1 if a_block[1] is None else -(-K // a_block[1]), e8m0=a_e8m0)
    b_shape = (E, 1 if b_block[0] is None else -(-K // b_block[0]), -(-N // b_block[1]))
    if scale_view:
        b_scale = _scales(E, b_shape[2], b_shape[1], e8m0=b_e8m0).transpose(1, 2)
    else:
        b_scale = _scales(*b_shape, e8m0=b_e8m0)
    a64 = a.double() * _expand(a_scale, a_block, (M, K))
    b64 = b.double() * _expand(b_scale, (1, *b_block), (E, K, N))
    ref = _oracle_grouped_mm(a64, b64, sizes)
    tail = sum(sizes)
    a[tail:] = float("nan")  # the unused rows of a worst-case-sized buffer
    if a_e8m0:
        a_scale.view(torch.uint8)[tail:] = 255
    else:
        a_scale[tail:] = float("nan")
    return a, a_scale, a_block, b, b_scale, b_block, ref


@pytest.fixture
def descriptor_calls(monkeypatch):
    """Counts the TMA descriptors the launchers build (0: the pointer path ran)."""
    calls = []
    original = launch.LaunchInfo.descriptor

    def counting(t, block_shape):
        calls.append(tuple(t.shape))
        return original(t, block_shape)

    monkeypatch.setattr(launch.LaunchInfo, "descriptor", staticmethod(counting))
    return calls


@pytest.mark.parametrize("tma", [None, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("scales", list(SCALE_MAPS))
@pytest.mark.parametrize("shape", list(SHAPES_M))
def test_ragged_m_fp8(shape, scales, tma, descriptor_calls):
    M, K, N, sizes, dtype = SHAPES_M[shape]
    a, a_scale, a_block, b, b_scale, b_block, ref = _ragged_m_operands(M, K, N, sizes, scales)
    y = poisoned((M, N), dtype, DEVICE)
    run_ragged_m_fp8(a, a_scale, a_block, b, b_scale, b_block, offsets_of(sizes, DEVICE), y, tma=tma)
    _check_rows(y, ref, sizes)
    assert bool(descriptor_calls) == (tma is None and K % 16 == 0), descriptor_calls


@pytest.mark.parametrize("tma", [None, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("scales", ["block128", "mxfp8"])
def test_ragged_m_fp8_many_blocks(scales, tma):
    """Several 128-deep blocks along K and 128-wide ones along N; b's scales as a transposed view."""
    M, K, N, sizes = 90, 288, 136, [25, 0, 50]
    a, a_scale, a_block, b, b_scale, b_block, ref = _ragged_m_operands(M, K, N, sizes, scales, scale_view=True)
    y = poisoned((M, N), torch.float32, DEVICE)
    run_ragged_m_fp8(a, a_scale, a_block, b, b_scale, b_block, offsets_of(sizes, DEVICE), y, tma=tma)
    _check_rows(y, ref, sizes)


@pytest.mark.parametrize("tma", [None, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("scales", ["rowwise", "block64x32"])
def test_ragged_m_fp8_rows_depend_only_on_their_own_group(scales, tma):
    """Non-finite rows of one group leave the other groups' rows intact (TMA tiles read across groups)."""
    M, K, N, sizes = 100, 64, 48, [20, 0, 45, 21]
    a, a_scale, a_block, b, b_scale, b_block, ref = _ragged_m_operands(M, K, N, sizes, scales)
    a[20:25] = float("nan")  # first rows of group 2, inside the last tile of group 0
    y = poisoned((M, N), torch.float32, DEVICE)
    run_ragged_m_fp8(a, a_scale, a_block, b, b_scale, b_block, offsets_of(sizes, DEVICE), y, tma=tma)
    _assert_close(y[:20], ref[:20], "group 0")
    _assert_close(y[65:86], ref[65:86], "group 3")
    assert bool((y[86:] == 0).all())


@pytest.mark.parametrize("scales", ["rowwise", "mxfp8"])
def test_ragged_m_fp8_scale_dtypes_and_fast_accum(scales):
    """E8M0 scales given as their uint8 view, and fast accumulation, give the same product."""
    M, K, N, sizes = 64, 64, 32, [30, 34]
    a, a_scale, a_block, b, b_scale, b_block, ref = _ragged_m_operands(M, K, N, sizes, scales)
    if a_scale.dtype == E8M0:
        a_scale = a_scale.view(torch.uint8)
    y = poisoned((M, N), torch.float32, DEVICE)
    run_ragged_m_fp8(a, a_scale, a_block, b, b_scale, b_block, offsets_of(sizes, DEVICE), y, fast_accum=True)
    _check_rows(y, ref, sizes, fast_accum=True)


def test_ragged_m_fp8_scale_map():
    """Blocks that span their dim need no stride (one kernel for every size); the promotion step is the
    shortest block along K; blocks along K that no FP8 step fits are refused."""
    a, b = _fp8(64, 256), _fp8(2, 96, 256).transpose(1, 2)
    rowwise = scale_map(a, _scales(64, 1), (1, None), b, _scales(2, 1, 96), (None, 1))
    assert (rowwise.a_k, rowwise.b_k, rowwise.step) == ((1, 0), (1, 0), None)
    block = scale_map(a, _scales(64, 2), (1, 128), b, _scales(2, 8, 96), (32, 1))
    assert (block.a_k, block.b_k, block.b_n, block.step) == ((128, 1), (32, 96), (1, 1), 32)
    assert scale_map(a, _scales(64, 1), (1, 256), b, _scales(2, 1, 1), (256, 128)).step is None
    for a_block in ((1, 16), (1, 48)):
        with pytest.raises(ValueError, match="powers of two of at least 32"):
            scale_map(a, _scales(64, 16), a_block, b, _scales(2, 1, 96), (None, 1))


# ---------------------------------------------------------------------------------------------------
# Ragged K (weight gradient)

# name: (token block, e8m0); blocks of 32 and 64 give several blocks per group at small shapes.
TOKEN_SCALES = {"rowwise": (None, False), "block128": (128, False), "block64": (64, False), "mxfp8": (32, True)}

# (M, K, N, sizes): M tokens in groups of ``sizes``, the operands ``[Mp, K]`` and ``[Mp, N]`` with every
# group starting 128-aligned, which TMA reads for every recipe (the interpreter, as the GPU, refuses a
# TMA window that does not start 16-byte aligned).
SHAPES_K = {
    "aligned": (96, 64, 48, [20, 0, 45, 21]),
    "odd": (77, 40, 24, [0, 30, 0, 0, 40, 0]),
    "giant_group": (144, 32, 16, [0, 144, 0]),
    "m1": (16, 16, 32, [1, 0]),
    "every_phase": (200, 32, 16, [1, 15, 17, 31, 33, 0, 47, 2, 16, 32]),  # starts at many phases of 16
}


def _grouped_data(t: torch.Tensor, sizes: Sequence[int], offset: int = 0, gap: float = float("nan")) -> torch.Tensor:
    """``t [M, C]`` (one token a row) laid out per group along the tokens: ``[Mp, C]``, a transposed view
    of ``[C, Mp]`` storage, group e's tokens from row ``128 * (s_e // 128 + e)``; every other row ``gap``:
    NaN poisons the layout's zeros (a kernel that reads them shows), 0 is the layout itself. offset: the
    storage starts that many elements into its allocation (1 misaligns it for TMA)."""
    firsts, Mp = data_rows_of(sizes, t.shape[0])
    storage = torch.full((t.shape[1], Mp + offset), gap, device=t.device).to(t.dtype)[:, offset:]
    data = storage.t()
    for first, (s, e) in zip(firsts, bounds_of(sizes)):
        data[first:first + e - s] = t[s:e]
    return data


def _ragged_k_operands(M, K, N, sizes, scales_name, offset=0, gap=float("nan")):
    """a [Mp, K] and b [Mp, N] quantized per group along the tokens (``_grouped_data``, ``gap`` between the
    groups), their per-group scales and the fp64 oracle; the tokens past the last group are not in the
    data."""
    block, e8m0 = TOKEN_SCALES[scales_name]
    a_tokens, b_tokens = _fp8(M, K), _fp8(M, N)
    a_scale = _token_scale_rows(K, block, sizes, M, e8m0)
    b_scale = _token_scale_rows(N, block, sizes, M, e8m0)
    a64 = a_tokens.double() * _token_scales(a_scale, block, sizes, M)
    b64 = b_tokens.double() * _token_scales(b_scale, block, sizes, M)
    ref = _oracle_wgrad(a64, b64, sizes)
    return (_grouped_data(a_tokens, sizes, offset, gap), a_scale, _grouped_data(b_tokens, sizes, offset, gap), b_scale,
            block, ref)


@pytest.mark.parametrize("tma", [None, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("scales", list(TOKEN_SCALES))
@pytest.mark.parametrize("shape", list(SHAPES_K))
def test_ragged_k_fp8(shape, scales, tma, descriptor_calls):
    """NaN between the groups, which no kernel may read, except where block128 on sm_90 runs the Gluon
    kernel: it reads each group's last window whole, whose rows after the group the layout holds zero
    (``dropless.quantized``), so there they are zeros; it builds its descriptors itself."""
    M, K, N, sizes = SHAPES_K[shape]
    gluon = scales == "block128" and tma is None and CUDA and launch.hopper_gluon_device(torch.device(DEVICE))
    a, a_scale, b, b_scale, block, ref = _ragged_k_operands(M, K, N, sizes, scales,
                                                            gap=0.0 if gluon else float("nan"))
    dtype = torch.bfloat16 if shape == "odd" else torch.float32
    out = poisoned((len(sizes), K, N), dtype, DEVICE)
    run_ragged_k_fp8(a, a_scale, b, b_scale, block, offsets_of(sizes, DEVICE), out, NO_ACCUMULATE, None, tma=tma)
    _check_experts(out, ref)
    # Every recipe reads through TMA where the device has it (blockwise scales too).
    assert bool(descriptor_calls) == (tma is None and not gluon), descriptor_calls


@pytest.mark.parametrize("scales", ["block128", "block64", "mxfp8"])
def test_ragged_k_fp8_blockwise_reads_through_tma(scales, descriptor_calls):
    """Every group's data starts 16-aligned, so blockwise scales read both operands through TMA: both
    descriptors are built, and every window the kernel loads through them starts 16-byte aligned
    (the interpreter asserts it, as the GPU faults)."""
    M, K, N, sizes = SHAPES_K["every_phase"]
    a, a_scale, b, b_scale, block, ref = _ragged_k_operands(M, K, N, sizes, scales)
    for first in data_rows_of(sizes, M)[0]:
        assert a[first].data_ptr() % 16 == 0 and b[first].data_ptr() % 16 == 0
    out = poisoned((len(sizes), K, N), torch.float32, DEVICE)
    run_ragged_k_fp8(a, a_scale, b, b_scale, block, offsets_of(sizes, DEVICE), out, NO_ACCUMULATE, None)
    _check_experts(out, ref)
    assert descriptor_calls[:2] == [(K, a.shape[0]), (N, b.shape[0])], descriptor_calls


def test_ragged_k_fp8_misaligned_storage_takes_pointers(descriptor_calls):
    """Operands whose storage does not start 16-byte aligned cannot be read through TMA: the pointer path
    runs, with the same result."""
    M, K, N, sizes = SHAPES_K["aligned"]
    a, a_scale, b, b_scale, block, ref = _ragged_k_operands(M, K, N, sizes, "block64", offset=1)
    out = poisoned((len(sizes), K, N), torch.float32, DEVICE)
    run_ragged_k_fp8(a, a_scale, b, b_scale, block, offsets_of(sizes, DEVICE), out, NO_ACCUMULATE, None)
    _check_experts(out, ref)
    assert not descriptor_calls


@pytest.mark.parametrize("tma", [None, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("transposed", [False, True], ids=["ekn", "enk_view"])
@pytest.mark.parametrize("mode", [NO_ACCUMULATE, ACCUMULATE_ALL, ACCUMULATE_FLAGGED],
                         ids=["overwrite", "all", "flagged"])
@pytest.mark.parametrize("scales", ["rowwise", "block64"])
def test_ragged_k_fp8_accumulate(scales, mode, transposed, tma):
    """Into an fp32 main_grad (a transposed view too); an empty group leaves its expert unchanged when
    it accumulates and zero when it does not."""
    M, K, N, sizes = 112, 48, 32, [0, 33, 0, 60, 5, 0]
    E = len(sizes)
    a, a_scale, b, b_scale, block, ref = _ragged_k_operands(M, K, N, sizes, scales)
    flags = torch.tensor([True, False, False, True, True, False], device=DEVICE) \
        if mode == ACCUMULATE_FLAGGED else None
    out = poisoned((E, K, N), torch.float32, DEVICE, transposed)
    if mode != NO_ACCUMULATE:
        out.copy_(torch.randn(E, K, N) * 1e6)
    init = out.clone()
    run_ragged_k_fp8(a, a_scale, b, b_scale, block, offsets_of(sizes, DEVICE), out, mode, flags, tma=tma)
    add = torch.full((E,), mode == ACCUMULATE_ALL, device=DEVICE) if flags is None else flags
    _check_experts(out, torch.where(add.view(-1, 1, 1), init.double() + ref, ref))
    for e, (s, t) in enumerate(bounds_of(sizes)):
        if s == t:
            assert torch.equal(out[e], init[e] if add[e] else torch.zeros_like(init[e]))


@pytest.mark.parametrize("tma", [None, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("scales", ["rowwise", "mxfp8"])
def test_ragged_k_fp8_ignores_rows_outside_the_group(scales, tma):
    """Non-finite tokens of one group stay in their own: group 1 starts at row 128, right after the window
    of group 0's last rows (0-39, in rows 0-127)."""
    M, K, N, sizes = 96, 32, 48, [40, 45, 0, 11]
    a, a_scale, b, b_scale, block, ref = _ragged_k_operands(M, K, N, sizes, scales)
    assert data_rows_of(sizes, M)[0][1] == 128
    a[128] = float("nan")  # group 1's first token
    b[129] = float("inf")
    out = poisoned((4, K, N), torch.float32, DEVICE)
    run_ragged_k_fp8(a, a_scale, b, b_scale, block, offsets_of(sizes, DEVICE), out, NO_ACCUMULATE, None, tma=tma)
    for e in (0, 2, 3):
        _assert_close(out[e], ref[e], f"dw[{e}]")


def test_ragged_k_fp8_refuses_other_token_blocks_and_rows():
    a, b = _fp8(16, 64 + 16).t(), _fp8(16, 64 + 16).t()
    with pytest.raises(ValueError, match="power of two of at least 32"):
        run_ragged_k_fp8(a, _scales(6, 16), b, _scales(6, 16), 48, offsets_of([64], DEVICE),
                         torch.empty(1, 16, 16, device=DEVICE), NO_ACCUMULATE, None)
    with pytest.raises(ValueError, match=r"rows Mp = 128 \* \(cdiv\(M, 128\) \+ E\)"):
        run_ragged_k_fp8(a[:70], _scales(6, 16), b[:70], _scales(6, 16), 32, offsets_of([64], DEVICE),
                         torch.empty(1, 16, 16, device=DEVICE), NO_ACCUMULATE, None)


# ---------------------------------------------------------------------------------------------------
# Schedules: every switch a candidate config may turn on (static or by-work order, flattened or
# warp-specialized loops, TMA stores, two programs per SM), at small tiles on the interpreter.

SCHEDULES = [
    GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1, flatten=True, programs_per_sm=2),
    GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1, warp_specialize=True, tma_store=True),
    GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1, by_work=True, tma_store=True),
]


@pytest.mark.parametrize("scales", ["rowwise", "mxfp8"])
@pytest.mark.parametrize("config", SCHEDULES, ids=str)
def test_ragged_m_fp8_schedules(config, scales):
    M, K, N, sizes = 100, 64, 48, [40, 0, 45, 1]
    a, a_scale, a_block, b, b_scale, b_block, ref = _ragged_m_operands(M, K, N, sizes, scales)
    y = poisoned((M, N), torch.bfloat16, DEVICE)
    ragged_m_fp8_mm(a, a_scale, b, b_scale, scale_map(a, a_scale, a_block, b, b_scale, b_block),
                    offsets_of(sizes, DEVICE), y, config, launch.launch_info(DEVICE))
    _check_rows(y, ref, sizes)


@pytest.mark.parametrize("scales", ["rowwise", "mxfp8"])
@pytest.mark.parametrize("config", SCHEDULES, ids=str)
def test_ragged_k_fp8_schedules(config, scales):
    M, K, N, sizes = 96, 64, 32, [40, 0, 45, 1]
    a, a_scale, b, b_scale, block, ref = _ragged_k_operands(M, K, N, sizes, scales)
    out = poisoned((len(sizes), K, N), torch.float32, DEVICE)
    ragged_k_fp8_mm(a, a_scale, b, b_scale, block, offsets_of(sizes, DEVICE), out, NO_ACCUMULATE, None,
                    config, launch.launch_info(DEVICE))
    _check_experts(out, ref)


# ---------------------------------------------------------------------------------------------------
# The GPU: realistic shapes, and every candidate config of each FP8 tuner with the scales it serves.

# (M, K, N, E); sizes drawn at random with empty groups and rows past the last group.
GPU_SHAPES = {"e8": (4096, 1024, 768, 8), "e16_odd": (3000, 1040, 520, 16)}


def _gpu_cases(fast, promoted, step128, step32) -> list:
    """``(scales, fast_accum, config)`` for every candidate of the tuners of one kernel: rowwise scales with
    fast or promoted accumulation, blocks of 128, MXFP8's blocks of 32."""
    return ([("rowwise", True, config) for config in fast.candidates]
            + [("rowwise", False, config) for config in promoted.candidates]
            + [("block128", False, config) for config in step128.candidates]
            + [("mxfp8", False, config) for config in step32.candidates])


def _case_id(case) -> str:
    scales, fast_accum, config = case
    return f"{scales}{'-fast' if fast_accum else ''}-{config}"


def _skip_if_it_does_not_fit(launcher, *args) -> None:
    from triton.runtime.errors import OutOfResources

    try:
        launcher(*args)
    except OutOfResources as error:
        pytest.skip(f"does not fit this GPU: {error}")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("shape", list(GPU_SHAPES))
@pytest.mark.parametrize("case", _gpu_cases(tuning._RAGGED_M_FP8_FAST, tuning._RAGGED_M_FP8,
                                            tuning._RAGGED_M_FP8_STEP128, tuning._RAGGED_M_FP8_STEP32), ids=_case_id)
def test_ragged_m_fp8_every_candidate_gpu(case, shape):
    scales, fast_accum, config = case
    M, K, N, E = GPU_SHAPES[shape]
    sizes = random_group_sizes(E, M - 37)
    a, a_scale, a_block, b, b_scale, b_block, ref = _ragged_m_operands(M, K, N, sizes, scales)
    y = poisoned((M, N), torch.bfloat16, DEVICE)  # what activations are; an fp32 tile needs more shared memory
    _skip_if_it_does_not_fit(ragged_m_fp8_mm, a, a_scale, b, b_scale,
                             scale_map(a, a_scale, a_block, b, b_scale, b_block), offsets_of(sizes, DEVICE), y,
                             config, launch.launch_info(DEVICE), fast_accum)
    _check_rows(y, ref, sizes, fast_accum)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["overwrite", "flagged"])
@pytest.mark.parametrize("case", _gpu_cases(tuning._RAGGED_K_FP8_FAST, tuning._RAGGED_K_FP8, tuning._RAGGED_K_FP8,
                                            tuning._RAGGED_K_FP8_STEP32), ids=_case_id)
def test_ragged_k_fp8_every_candidate_gpu(case, mode):
    scales, fast_accum, config = case
    M, K, N, E = 4096, 512, 768, 8
    sizes = random_group_sizes(E, M - 37)
    a, a_scale, b, b_scale, block, ref = _ragged_k_operands(M, K, N, sizes, scales)
    out = poisoned((E, K, N), torch.float32, DEVICE)
    flags = None
    if mode == "flagged":
        out.copy_(torch.randn(E, K, N, device=DEVICE) * ref.abs().max())
        flags = torch.arange(E, device=DEVICE) % 2 == 0
        ref = torch.where(flags.view(-1, 1, 1), out.double() + ref, ref)
    _skip_if_it_does_not_fit(ragged_k_fp8_mm, a, a_scale, b, b_scale, block, offsets_of(sizes, DEVICE), out,
                             NO_ACCUMULATE if flags is None else ACCUMULATE_FLAGGED, flags, config,
                             launch.launch_info(DEVICE), fast_accum)
    _check_experts(out, ref, fast_accum)


def _wgrad_case(shape: str, recipe: str, mode: str):
    """A GPU weight-gradient case: ``(sizes, (a, a_scale, b, b_scale, block), ref, flags, accumulate)`` with
    the operands quantized per group with ``recipe`` (zeros between the groups, which the Hopper kernels read
    in each group's last window), the fp64 oracle ``[E, K, N]``, and for ``mode`` (bf16, fp32, added or
    flagged) the experts' flags (every other one, flagged only) and the accumulate mode."""
    if shape in SHAPES_K:
        M, K, N, sizes = SHAPES_K[shape]
    else:
        M, K, N, E = GPU_SHAPES[shape]
        sizes = random_group_sizes(E, M - 37)
    a, a_scale, b, b_scale, block, ref = _ragged_k_operands(M, K, N, sizes, recipe, gap=0.0)
    flags = torch.arange(len(sizes), device=DEVICE) % 2 == 0 if mode == "flagged" else None
    accumulate = {"bf16": NO_ACCUMULATE, "fp32": NO_ACCUMULATE, "added": ACCUMULATE_ALL,
                  "flagged": ACCUMULATE_FLAGGED}[mode]
    return sizes, (a, a_scale, b, b_scale, block), ref, flags, accumulate


def _with_prior(out: torch.Tensor, ref: torch.Tensor, flags: torch.Tensor | None, accumulate: int) -> torch.Tensor:
    """The expected ``[E, K, N]`` result in ``out``: ``ref`` where it is written; where it is added to, ``out``
    first filled with random prior values (of ref's magnitude) and the expected sum returned."""
    if accumulate == NO_ACCUMULATE:
        return ref
    out.copy_(torch.randn(tuple(out.shape), device=DEVICE) * ref.abs().max())
    E = out.shape[0]
    added = flags.view(-1, 1, 1) if flags is not None else torch.ones(E, 1, 1, dtype=torch.bool, device=DEVICE)
    return torch.where(added, out.double() + ref, ref)


def _hopper_fp8_wgrad_cases() -> list:
    """``(mode, config)``: each candidate of the Hopper FP8 wgrad tuners with the outputs it serves."""
    return ([("bf16", config) for config in tuning._RAGGED_K_FP8_HOPPER.candidates]
            + [(mode, config) for config in tuning._RAGGED_K_FP8_HOPPER_ACCUMULATE.candidates
               for mode in ("fp32", "added", "flagged")])


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA and launch.hopper_gluon_device(torch.device(DEVICE))),
                    reason="the Gluon kernels are for sm_90")
@pytest.mark.parametrize("shape", ["e8", "e16_odd", *SHAPES_K])
@pytest.mark.parametrize("case", _hopper_fp8_wgrad_cases(), ids=lambda case: f"{case[0]}-{case[1]}")
def test_ragged_k_fp8_hopper_every_candidate_gpu(case, shape):
    """The warp-specialized Hopper kernel on rowwise operands (fast accumulation): every candidate, both
    output layouts (a transposed one swaps the operands). The kernel reads the layout's zeros after each
    group's rows (its last window), so they are zeros here, not NaN."""
    mode, config = case
    sizes, (a, a_scale, b, b_scale, block), ref, flags, accumulate = _wgrad_case(shape, "rowwise", mode)
    for transposed in (False, True):
        out = poisoned(tuple(ref.shape), torch.bfloat16 if mode == "bf16" else torch.float32, DEVICE, transposed)
        expected = _with_prior(out, ref, flags, accumulate)
        oriented = (b, a, out.transpose(1, 2)) if transposed else (a, b, out)
        assert launch.hopper_fp8_wgrad_ok(*oriented)
        run_ragged_k_fp8(a, a_scale, b, b_scale, block, offsets_of(sizes, DEVICE), out, accumulate, flags,
                         fast_accum=True, config=config)
        _check_experts(out, expected, fast_accum=True)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", tuning._RAGGED_M_FP8_STEP128.candidates, ids=str)
def test_ragged_m_fp8_block128_into_fp32_gpu(config):
    """block128 products written in fp32 (what fp32 activations get), with the op tests' small K and N and
    NaN rows past the last group, for every candidate of the block-scaled tuner."""
    M, K, N, sizes = 143, 96, 64, [0, 37, 0, 90, 5]
    a, a_scale, a_block, b, b_scale, b_block, ref = _ragged_m_operands(M, K, N, sizes, "block128")
    y = poisoned((M, N), torch.float32, DEVICE)
    _skip_if_it_does_not_fit(ragged_m_fp8_mm, a, a_scale, b, b_scale,
                             scale_map(a, a_scale, a_block, b, b_scale, b_block), offsets_of(sizes, DEVICE), y,
                             config, launch.launch_info(DEVICE), False)
    _check_rows(y, ref, sizes)


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA and launch.hopper_gluon_device(torch.device(DEVICE))),
                    reason="the Gluon kernels are for sm_90")
@pytest.mark.parametrize("scale_view", [False, True], ids=["scales", "scale_view"])
@pytest.mark.parametrize("shape", ["e8", "e16_odd", "aligned", "giant_group", "m1", "e1_tail"])
def test_ragged_m_block128_hopper_gpu(shape, scale_view):
    """The warp-specialized block128 kernel (two warpgroups on the halves of each tile), with and without
    the tail's zeros; weight scales as stored and as the transposed view the input gradient reads."""
    from dropless.kernels.ragged_m_block128_hopper import ragged_m_block128_hopper

    if shape in GPU_SHAPES:
        M, K, N, E = GPU_SHAPES[shape]
        sizes = random_group_sizes(E, M - 37)
    else:
        M, K, N, sizes, _ = SHAPES_M[shape]
    a, a_scale, _, b, b_scale, _, ref = _ragged_m_operands(M, K, N, sizes, "block128", scale_view)
    for tail in (True, False):
        y = poisoned((M, N), torch.bfloat16, DEVICE)
        ragged_m_block128_hopper(a, a_scale, b, b_scale, offsets_of(sizes, DEVICE), y,
                                 launch.launch_info(torch.device(DEVICE)).num_programs, tail=tail)
        if tail:
            _check_rows(y, ref, sizes)
        else:
            end = sum(sizes)
            _check_rows(y[:end], ref[:end], sizes)
            assert bool(y[end:].isnan().all()), "y: rows past offsets[-1] written with tail=False"


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA and launch.hopper_gluon_device(torch.device(DEVICE))),
                    reason="the Gluon kernels are for sm_90")
@pytest.mark.parametrize("mode", ["bf16", "fp32", "added", "flagged"])
@pytest.mark.parametrize("shape", ["e8", "e16_odd", *SHAPES_K])
def test_ragged_k_block128_hopper_gpu(shape, mode):
    """The warp-specialized block128 weight gradient (two warpgroups on the halves of each tile), written
    in bf16 or fp32, or added to fp32 values for every expert or the flagged ones. The kernel reads the
    layout's zeros after each group's rows (its last window), so they are zeros here, not NaN."""
    from dropless.kernels.ragged_k_block128_hopper import ragged_k_block128_hopper

    sizes, (a, a_scale, b, b_scale, _), ref, flags, accumulate = _wgrad_case(shape, "block128", mode)
    out = poisoned(tuple(ref.shape), torch.bfloat16 if mode == "bf16" else torch.float32, DEVICE)
    expected = _with_prior(out, ref, flags, accumulate)
    ragged_k_block128_hopper(a, a_scale, b, b_scale, offsets_of(sizes, DEVICE), out, accumulate, flags,
                             launch.launch_info(torch.device(DEVICE)).num_programs)
    _check_experts(out, expected)
