"""dropless.kernels: the launchers ``run_ragged_m`` / ``run_ragged_k`` called directly on NaN-poisoned
outputs, through TMA descriptors and through pointers (the interpreter on CPU, the real kernels on GPU)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import (
    INTERPRETING,
    KERNEL_DEVICE,
    assert_close,
    assert_experts_close,
    assert_rows_close,
    bounds_of,
    make_w,
    make_x,
    offsets_of,
    oracle_grouped_mm,
    oracle_wgrad,
    poisoned,
)

import dropless
from dropless import reference
from dropless.kernels import launch, tuning
from dropless.kernels.config import GemmConfig
from dropless.kernels.ragged_k import ACCUMULATE_ALL, ACCUMULATE_FLAGGED, NO_ACCUMULATE, ragged_k_mm
from dropless.kernels.ragged_m import ragged_m_mm, zeroed_counters
from dropless.kernels.tuning import run_ragged_k, run_ragged_m
from triton.runtime.errors import OutOfResources

DEVICE = KERNEL_DEVICE

# (M, K, N, sizes); K and N multiples of 8 take TMA descriptors for every dtype, the others pointers.
SHAPES = {
    "aligned": (100, 64, 48, [20, 0, 45, 21]),
    "odd": (77, 17, 100, [0, 30, 0, 0, 40, 0]),
    "giant_group": (130, 32, 8, [0, 130, 0]),
    "m1": (1, 16, 16, [1, 0]),
    "e1_tail": (50, 3, 130, [13]),
}


@pytest.fixture
def descriptor_calls(monkeypatch):
    """Counts the TMA descriptors the launchers build, the Triton kernels' and the Hopper Gluon kernels'
    (0 means the pointer path ran)."""
    from dropless.kernels import ragged_k_hopper, ragged_m_hopper

    calls = []

    def counting(original):
        def build(t, block_shape):
            calls.append(tuple(t.shape))
            return original(t, block_shape)
        return build

    monkeypatch.setattr(launch.LaunchInfo, "descriptor", staticmethod(counting(launch.LaunchInfo.descriptor)))
    for module in (ragged_k_hopper, ragged_m_hopper):
        monkeypatch.setattr(module, "descriptor", counting(module.descriptor))
    return calls


def _padded(rows: int, cols: int, dtype, pad=(3, 5)):
    """A NaN ``[rows, cols]`` window into a larger NaN buffer, so stray writes outside it show."""
    big = torch.full((rows + pad[0], cols + pad[1]), float("nan"), dtype=dtype, device=DEVICE)
    return big, big[1:1 + rows, 2:2 + cols]


def _outside_untouched(big: torch.Tensor, window_mask: torch.Tensor) -> bool:
    return bool(torch.isnan(big[~window_mask]).all())


# ---------------------------------------------------------------------------------------------------
# Ragged M (forward, dgrad)


@pytest.mark.parametrize("tma", [None, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("w_layout", ["nk", "kn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_ragged_m_writes_every_element(shape, dtype, w_layout, tma, descriptor_calls):
    M, K, N, sizes = SHAPES[shape]
    x = make_x(M, K, dtype, DEVICE)
    w = make_w(len(sizes), K, N, dtype, DEVICE, w_layout)
    big, y = _padded(M, N, dtype)
    run_ragged_m(x, w, offsets_of(sizes, DEVICE), y, tma=tma)
    assert_rows_close(y, oracle_grouped_mm(x, w, sizes), sizes, dtype)
    window = torch.zeros(big.shape, dtype=torch.bool, device=DEVICE)
    window[1:1 + M, 2:2 + N] = True
    assert _outside_untouched(big, window), "the kernel wrote outside y"
    tma_able = (K * x.element_size()) % 16 == 0 and (N * x.element_size()) % 16 == 0
    assert bool(descriptor_calls) == (tma is None and tma_able), descriptor_calls


@pytest.mark.parametrize("tma", [None, False], ids=["tma", "pointers"])
def test_ragged_m_e256(tma):
    sizes = [0, 1, 0, 2] * 64  # E=256, 192 rows, 8 tail rows
    x = make_x(200, 8, torch.float32, DEVICE)
    w = make_w(256, 8, 4, torch.float32, DEVICE)
    y = poisoned((200, 4), torch.float32, DEVICE)
    run_ragged_m(x, w, offsets_of(sizes, DEVICE), y, tma=tma)
    assert_rows_close(y, oracle_grouped_mm(x, w, sizes), sizes, torch.float32)


@pytest.mark.parametrize("tma", [None, False], ids=["tma", "pointers"])
def test_ragged_m_strided_x(tma, descriptor_calls):
    sizes = [30, 0, 33]
    x = make_x(70, 32, torch.float32, DEVICE, "col_slice")  # 16-byte aligned rows of a wider matrix
    w = make_w(3, 32, 16, torch.float32, DEVICE)
    y = poisoned((70, 16), torch.float32, DEVICE)
    run_ragged_m(x, w, offsets_of(sizes, DEVICE), y, tma=tma)
    assert_rows_close(y, oracle_grouped_mm(x, w, sizes), sizes, torch.float32)
    assert bool(descriptor_calls) == (tma is None)


# ---------------------------------------------------------------------------------------------------
# Ragged K (wgrad)


@pytest.mark.parametrize("tma", [None, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("transposed", [False, True], ids=["ekn", "enk_view"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_ragged_k_writes_every_element(shape, dtype, transposed, tma, descriptor_calls):
    M, K, N, sizes = SHAPES[shape]
    E = len(sizes)
    x = make_x(M, K, dtype, DEVICE)
    dy = torch.randn(M, N, dtype=dtype, device=DEVICE)
    out = poisoned((E, K, N), torch.float32, DEVICE, transposed)
    run_ragged_k(x, dy, offsets_of(sizes, DEVICE), out, NO_ACCUMULATE, None, tma=tma)
    assert_experts_close(out, oracle_wgrad(x, dy, sizes), dtype)
    tma_able = (K * x.element_size()) % 16 == 0 and (N * x.element_size()) % 16 == 0
    assert bool(descriptor_calls) == (tma is None and tma_able), descriptor_calls


@pytest.mark.parametrize("tma", [None, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_ragged_k_into_strided_window(out_dtype, tma):
    """out is a window of a larger NaN buffer: every element of it written, nothing around it."""
    sizes = [0, 40, 7, 0, 50]
    M, K, N = 100, 24, 40
    x = make_x(M, K, torch.bfloat16, DEVICE)
    dy = torch.randn(M, N, dtype=torch.bfloat16, device=DEVICE)
    big = torch.full((6, K + 3, N + 5), float("nan"), dtype=out_dtype, device=DEVICE)
    out = big[1:, 2:2 + K, 1:1 + N]
    run_ragged_k(x, dy, offsets_of(sizes, DEVICE), out, NO_ACCUMULATE, None, tma=tma)
    assert_experts_close(out, oracle_wgrad(x, dy, sizes), torch.bfloat16)
    window = torch.zeros(big.shape, dtype=torch.bool, device=DEVICE)
    window[1:, 2:2 + K, 1:1 + N] = True
    assert _outside_untouched(big, window), "the kernel wrote outside out"


@pytest.mark.parametrize("tma", [None, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("transposed", [False, True], ids=["ekn", "enk_view"])
@pytest.mark.parametrize("mode", [ACCUMULATE_ALL, ACCUMULATE_FLAGGED], ids=["all", "flagged"])
def test_ragged_k_accumulate(mode, transposed, tma):
    sizes = [0, 33, 0, 60, 5, 0]
    M, K, N = 100, 32, 16
    flags = torch.tensor([True, False, False, True, True, False], device=DEVICE) \
        if mode == ACCUMULATE_FLAGGED else None
    x = make_x(M, K, torch.float32, DEVICE)
    dy = torch.randn(M, N, device=DEVICE)
    out = poisoned((6, K, N), torch.float32, DEVICE, transposed)
    out.copy_(torch.randn(6, K, N))
    init = out.clone().cpu()
    run_ragged_k(x, dy, offsets_of(sizes, DEVICE), out, mode, flags, tma=tma)
    ref = oracle_wgrad(x, dy, sizes)
    add = torch.ones(6, dtype=torch.bool) if flags is None else flags.cpu()
    assert_experts_close(out, torch.where(add.view(-1, 1, 1), init.double() + ref, ref), torch.float32)
    for e, (s, t) in enumerate(bounds_of(sizes)):
        if s == t:
            assert torch.equal(out[e].cpu(), init[e] if add[e] else torch.zeros_like(init[e]))


@pytest.mark.parametrize("tma", [None, False], ids=["tma", "pointers"])
def test_ragged_k_e256(tma):
    sizes = [3, 0, 0, 1] * 64
    x = make_x(260, 8, torch.float32, DEVICE)
    dy = torch.randn(260, 4, device=DEVICE)
    out = poisoned((256, 8, 4), torch.float32, DEVICE)
    run_ragged_k(x, dy, offsets_of(sizes, DEVICE), out, NO_ACCUMULATE, None, tma=tma)
    assert_experts_close(out, oracle_wgrad(x, dy, sizes), torch.float32)


# A worst-case-sized buffer's rows past offsets[-1] may hold anything (uninitialized memory, NaN
# included), and so may other groups' rows: neither may leak into an expert's result.


@pytest.mark.parametrize("tma", [None, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("transposed", [False, True], ids=["ekn", "enk_view"])
def test_ragged_k_ignores_rows_outside_the_group(transposed, tma):
    sizes = [20, 0, 45, 15]  # 20 tail rows
    M, K, N = 100, 32, 48
    x = make_x(M, K, torch.float32, DEVICE)
    dy = torch.randn(M, N, device=DEVICE)
    clean_ref = oracle_wgrad(x, dy, sizes)
    for operand in (x, dy):
        operand[80:] = float("nan")  # the tail
        operand[65:80] = float("inf")  # the last group: may only spoil its own gradient
    out = poisoned((4, K, N), torch.float32, DEVICE, transposed)
    run_ragged_k(x, dy, offsets_of(sizes, DEVICE), out, NO_ACCUMULATE, None, tma=tma)
    assert_experts_close(out[:3], clean_ref[:3], torch.float32)


@pytest.mark.parametrize("tma", [None, False], ids=["tma", "pointers"])
def test_ragged_m_tail_rows_are_zero_whatever_x_holds(tma):
    sizes = [20, 0, 45, 15]
    x = make_x(100, 32, torch.float32, DEVICE)
    w = make_w(4, 32, 48, torch.float32, DEVICE)
    ref = oracle_grouped_mm(x, w, sizes)
    x[80:] = float("nan")  # uninitialized rows of a worst-case-sized buffer
    y = poisoned((100, 48), torch.float32, DEVICE)
    run_ragged_m(x, w, offsets_of(sizes, DEVICE), y, tma=tma)
    assert_rows_close(y, ref, sizes, torch.float32)


@pytest.mark.parametrize("tma", [None, False], ids=["tma", "pointers"])
def test_ragged_m_rows_depend_only_on_their_own_group(tma):
    """Non-finite rows in one group leave every other group's output rows intact."""
    sizes = [20, 0, 45, 15]
    x = make_x(100, 32, torch.float32, DEVICE)
    w = make_w(4, 32, 48, torch.float32, DEVICE)
    ref = oracle_grouped_mm(x, w, sizes)
    x[20:25] = float("nan")  # first rows of group 2, read by the tiles of group 0 through TMA
    x[64] = float("inf")  # last row of group 2
    y = poisoned((100, 48), torch.float32, DEVICE)
    run_ragged_m(x, w, offsets_of(sizes, DEVICE), y, tma=tma)
    assert_close(y[:20], ref[:20], torch.float32, "group 0")
    assert_close(y[65:80], ref[65:80], torch.float32, "group 3")
    assert bool(torch.isfinite(y[25:64]).all())


# ---------------------------------------------------------------------------------------------------
# Malformed offsets without validation: the kernels clamp and never touch memory outside the operands.

MALFORMED = {
    "past_m": [10, 70, 200, 300],
    "negative": [-5, -1, 20, 40],
    "huge_last": [10, 10, 20, 2**31 - 1],
}


@pytest.mark.parametrize("tma", [None, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_offsets_are_clamped(case, tma):
    """Out-of-range but non-decreasing offsets behave as if clamped to [0, M], like the reference."""
    M, K, N = 64, 16, 24
    offsets = torch.tensor(MALFORMED[case], dtype=torch.int32, device=DEVICE)
    x = make_x(M, K, torch.float32, DEVICE)
    w = make_w(4, K, N, torch.float32, DEVICE)
    big, y = _padded(M, N, torch.float32)
    run_ragged_m(x, w, offsets, y, tma=tma)
    ref_y = reference.grouped_mm(x.double().cpu(), w.double().cpu(), offsets.cpu())
    assert_close(y, ref_y, torch.float32, "y")
    window = torch.zeros(big.shape, dtype=torch.bool, device=DEVICE)
    window[1:1 + M, 2:2 + N] = True
    assert _outside_untouched(big, window)
    dy = torch.randn(M, N, device=DEVICE)
    out = poisoned((4, K, N), torch.float32, DEVICE)
    run_ragged_k(x, dy, offsets, out, NO_ACCUMULATE, None, tma=tma)
    assert_close(out, reference.grouped_mm_wgrad(x.double().cpu(), dy.double().cpu(), offsets.cpu()),
                 torch.float32, "dw")


def test_decreasing_offsets_do_not_crash(triton_backend):
    """Decreasing offsets (no validation): the ops finish and every output element is written, finite."""
    device = triton_backend
    offsets = torch.tensor([40, 10, 60, 30], dtype=torch.int32, device=device)
    x = torch.randn(64, 16, device=device, requires_grad=True)
    W = torch.randn(4, 24, 16, device=device, requires_grad=True)
    y = dropless.grouped_mm(x, W.transpose(1, 2), offsets)
    y.backward(torch.randn_like(y))
    main_grad = poisoned((4, 16, 24), torch.float32, device)
    dropless.grouped_mm_wgrad(x.detach(), torch.randn(64, 24, device=device), offsets, out=main_grad)
    for t in (y, x.grad, W.grad, main_grad):
        assert bool(torch.isfinite(t).all())
    if device.type == "cuda":
        torch.cuda.synchronize()


def test_decreasing_offsets_match_reference(triton_backend):
    """Decreasing offsets: a group never starts before the previous one ends (reference.group_bounds)."""
    device = triton_backend
    offsets = torch.tensor([40, 10, 60, 30], dtype=torch.int32, device=device)
    x = torch.randn(64, 16, device=device)
    w = make_w(4, 16, 24, torch.float32, device)
    dy = torch.randn(64, 24, device=device)
    y = dropless.grouped_mm(x, w, offsets)
    dw = dropless.grouped_mm_wgrad(x, dy, offsets)
    x64, off = x.double().cpu(), offsets.cpu()
    assert_close(y, reference.grouped_mm(x64, w.double().cpu(), off), torch.float32, "y")
    assert_close(dw, reference.grouped_mm_wgrad(x64, dy.double().cpu(), off), torch.float32, "dw")


# ---------------------------------------------------------------------------------------------------
# Every candidate tile configuration the autotuner may pick gives the same answer. On the interpreter
# the candidates keep their schedule switches (flatten, warp specialization, TMA stores, work order,
# programs per SM) with 32x32x32 tiles.


def _candidates(tuner):
    configs = tuner.candidates + [tuner.default, tuner.small_default]
    if INTERPRETING:
        configs = [dataclasses.replace(c, block_m=32, block_n=32, block_k=32, num_stages=1) for c in configs]
    return list(dict.fromkeys(configs))


def _run_config(launcher, *args):
    try:
        launcher(*args)
    except OutOfResources as error:
        if INTERPRETING:
            raise
        # The autotuner skips such a candidate for this problem too (e.g. a TMA-store buffer of fp32
        # main_grad tiles beside the operand stages exceeds the shared memory).
        pytest.skip(f"does not fit this GPU for these dtypes: {error}")


@pytest.mark.parametrize("shape", ["aligned", "odd"])
@pytest.mark.parametrize("w_layout", ["nk", "kn"])
@pytest.mark.parametrize("config", _candidates(tuning._RAGGED_M), ids=str)
def test_ragged_m_every_candidate_config(config, w_layout, shape):
    M, K, N, sizes = SHAPES[shape]
    dtype = torch.bfloat16
    x = make_x(M, K, dtype, DEVICE)
    w = make_w(len(sizes), K, N, dtype, DEVICE, w_layout)
    y = poisoned((M, N), dtype, DEVICE)
    _run_config(ragged_m_mm, x, w, offsets_of(sizes, DEVICE), y, config, launch.launch_info(DEVICE))
    assert_rows_close(y, oracle_grouped_mm(x, w, sizes), sizes, dtype)


@pytest.mark.parametrize("w_layout", ["nk", "kn"])
@pytest.mark.parametrize("M, K, N, sizes", [
    (40, 300, 48, [0, 40, 0]),  # every row to one expert: one row of tiles, K split into parts
    (77, 170, 100, [0, 30, 0, 0, 40, 0]),  # odd K and N (pointer loads), a tail, K steps not divisible
    (50, 96, 16, [13]),  # a tail of 37 rows (zeros), three K steps for up to eight parts
    (300, 64, 64, [100, 100, 100]),  # more tiles than parts fit: routings like this one run unsplit
])
@pytest.mark.parametrize("split", [2, 8])
def test_ragged_m_split_k(w_layout, M, K, N, sizes, split):
    """Split K (``config.split_k``): each tile's K steps over up to ``split`` programs, chosen on the
    device from the tile count, the fp32 partials added in order by the part that arrives last, every row
    of the poisoned output written (the tail's zeros too), against the fp64 oracle. The tile counters are
    left zeroed for the next launch, which a second launch on new operands relies on."""
    config = GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1, split_k=split)
    info = dataclasses.replace(launch.launch_info(DEVICE), num_programs=16)
    for _ in range(2):
        x = make_x(M, K, torch.float32, DEVICE)
        w = make_w(len(sizes), K, N, torch.float32, DEVICE, w_layout)
        y = poisoned((M, N), torch.float32, DEVICE)
        ragged_m_mm(x, w, offsets_of(sizes, DEVICE), y, config, info)
        assert_rows_close(y, oracle_grouped_mm(x, w, sizes), sizes, torch.float32)
        assert not y.isnan().any()
        assert not zeroed_counters(y.device, 16).any()


@pytest.mark.parametrize("mode", ["overwrite", "flagged"])
@pytest.mark.parametrize("transposed", [False, True], ids=["ekn", "enk_view"])
@pytest.mark.parametrize("config", _candidates(tuning._RAGGED_K), ids=str)
def test_ragged_k_every_candidate_config(config, transposed, mode):
    M, K, N, sizes = SHAPES["aligned"]
    E = len(sizes)
    dtype = torch.bfloat16
    x = make_x(M, K, dtype, DEVICE)
    dy = torch.randn(M, N, dtype=dtype, device=DEVICE)
    out = poisoned((E, K, N), torch.float32, DEVICE, transposed)
    flags = None
    if mode == "flagged":
        out.copy_(torch.randn(E, K, N))
        flags = torch.tensor([True, True, False, False], device=DEVICE)
    init = out.clone().cpu()
    _run_config(ragged_k_mm, x, dy, offsets_of(sizes, DEVICE), out,
                NO_ACCUMULATE if flags is None else ACCUMULATE_FLAGGED, flags, config, launch.launch_info(DEVICE))
    ref = oracle_wgrad(x, dy, sizes)
    if flags is not None:
        ref = torch.where(flags.cpu().view(-1, 1, 1), init.double() + ref, ref)
    assert_experts_close(out, ref, dtype)


# ---------------------------------------------------------------------------------------------------
# Launch plumbing


def test_launch_info_forcing_pointers():
    assert launch.launch_info(DEVICE, tma=False).tma is False
    info = launch.launch_info(DEVICE)
    assert info.num_programs >= 1


def test_tma_ok():
    assert launch.LaunchInfo.tma_ok(torch.empty(8, 16, device=DEVICE))
    assert not launch.LaunchInfo.tma_ok(torch.empty(8, 3, device=DEVICE))  # 12-byte rows
    assert not launch.LaunchInfo.tma_ok(torch.empty(16, 8, device=DEVICE).t())  # non-unit last stride
    assert not launch.LaunchInfo.tma_ok(torch.empty(8, 20, device=DEVICE)[:, 1:17])  # misaligned base


def test_hopper_ragged_m_output_staging():
    """3 stages leave room for the whole output tile, 4 only for half (the other half goes out through
    a stage's weight buffer, which must hold it); a config that fits neither way is refused by name."""
    from dropless.kernels.ragged_m_hopper import output_in_halves

    assert not output_in_halves(GemmConfig(128, 256, 64, num_stages=3), 2)
    assert output_in_halves(GemmConfig(128, 256, 64, num_stages=4), 2)
    with pytest.raises(ValueError, match="128x256x32.* does not fit"):
        output_in_halves(GemmConfig(128, 256, 32, num_stages=8), 2)  # the weight buffer holds a quarter tile
    with pytest.raises(ValueError, match="does not fit"):
        output_in_halves(GemmConfig(128, 256, 64, num_stages=5), 2)
    for config in tuning.hopper_candidates()["ragged_m"]:
        output_in_halves(config, 2)


def test_direct_launch_key_follows_specialization():
    """The compiled-kernel key of a direct launch changes with everything the JIT specializes on (a
    descriptor's block shape and dtype, an integer's divisibility, a pointer's alignment, a constexpr)
    and with nothing else (the values of integers and the tensors behind the descriptors)."""
    from dropless.kernels.direct_launch import _specialization
    from dropless.kernels.hopper import descriptor
    from dropless.kernels.ragged_m_hopper import _LAUNCH

    params = {param.name: param for param in _LAUNCH.params}

    def key(name, value):
        return _specialization(params[name], value)

    x = torch.randn(256, 64, dtype=torch.bfloat16)
    assert key("a_desc", descriptor(x, [128, 64])) == key("a_desc", descriptor(torch.randn(512, 128, dtype=torch.bfloat16), [128, 64]))
    assert key("a_desc", descriptor(x, [128, 64])) != key("a_desc", descriptor(x, [64, 64]))
    assert key("a_desc", descriptor(x, [128, 64])) != key("a_desc", descriptor(x.half(), [128, 64]))
    assert key("M", 4096) == key("M", 65536) != key("M", 4095) != key("M", 1)
    assert key("M", 2**31) != key("M", 2**30)  # a 64-bit integer
    flat = torch.empty(64, dtype=torch.bfloat16)
    assert key("c_ptr", flat) == key("c_ptr", flat[8:]) != key("c_ptr", flat[1:])
    assert key("STAGES", 3) != key("STAGES", 4)


def test_direct_launch_call_key_is_as_fine_as_the_specialization():
    """Two arguments with one per-call key have one JIT specialization (the per-call key maps to the
    compiled kernel of the first call with it), and a call key changes with each tensor's dtype and
    16-byte alignment, each integer's value and each descriptor's block shape."""
    from dropless.kernels.direct_launch import _call_key, _specialization
    from dropless.kernels.hopper import descriptor
    from dropless.kernels.ragged_m_hopper import _LAUNCH

    params = {param.name: param for param in _LAUNCH.params}
    flat = torch.empty(256, dtype=torch.bfloat16)
    x = torch.randn(256, 64, dtype=torch.bfloat16)
    samples = {
        "c_ptr": [flat, flat[8:], flat[1:], flat[3:], flat.half(), flat.float()[4:]],
        "M": [1, 2, 15, 16, 4096, 4095, 2**31, 2**31 + 16, 2**33],
        "a_desc": [descriptor(x, [128, 64]), descriptor(torch.randn(512, 128, dtype=torch.bfloat16), [128, 64]),
                   descriptor(x, [64, 64]), descriptor(x.half(), [128, 64])],
    }
    for name, values in samples.items():
        for u in values:
            for v in values:
                if _call_key(u) == _call_key(v):
                    assert _specialization(params[name], u) == _specialization(params[name], v), (name, u, v)
    assert _call_key(flat) == _call_key(flat[8:]) != _call_key(flat[1:]) != _call_key(flat.half())
    assert _call_key(4096) != _call_key(65536) and _call_key(1) != _call_key(True)
    assert _call_key(samples["a_desc"][0]) == _call_key(samples["a_desc"][1]) != _call_key(samples["a_desc"][2])
    # The constexprs and the compile options (num_warps) are in the key; runtime arguments are not.
    args = {param: 0 for param in params}
    keys = {_LAUNCH._constant_values({**args, "num_warps": w, "M": m}) for w in (4, 8) for m in (16, 32)}
    assert len(keys) == 2


def test_host_integer_helpers_match_triton():
    import triton

    for n in (*range(0, 70), 255, 256, 257, 2**31 - 1, 2**31):
        assert launch.next_power_of_2(n) == triton.next_power_of_2(max(n, 1)), n
        for d in (1, 3, 16, 64, 128, 256):
            assert launch.cdiv(n, d) == triton.cdiv(n, d), (n, d)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_padded_copies_are_tma_readable_and_equal(dtype):
    """``readable``: t itself where TMA can read it, else an equal copy whose strides are 16-byte multiples
    (odd rows, a column-major view, an nn.Linear-layout weight viewed as [E, K, N]);
    ``run_into_readable`` writes the output back, keeping its values where asked."""
    from dropless.kernels.launch import LaunchInfo
    from dropless.kernels.padded import padded_like, readable, run_into_readable

    aligned = torch.randn(6, 64).to(dtype)
    assert readable(aligned) is aligned
    for t in (torch.randn(7, 1001).to(dtype), torch.randn(9, 13).to(dtype).t(),
              torch.randn(3, 17, 1001).to(dtype).transpose(1, 2).transpose(1, 2)):
        copy = readable(t)
        assert copy is not t and LaunchInfo.tma_ok(copy) and torch.equal(copy, t)
    weight = torch.randn(3, 5, 11).to(dtype)
    copy = readable(weight.transpose(1, 2)).transpose(1, 2)
    assert torch.equal(copy, weight)
    padded = padded_like(weight)
    assert padded.shape == weight.shape and LaunchInfo.tma_ok(padded) and not LaunchInfo.tma_ok(weight)

    out = torch.randn(5, 11).to(dtype)
    kept = out.clone()
    run_into_readable(out, True, lambda c: c[:2].fill_(7))
    assert bool((out[:2] == 7).all()) and torch.equal(out[2:], kept[2:])
    run_into_readable(out, False, lambda c: c.fill_(3))
    assert bool((out == 3).all())
