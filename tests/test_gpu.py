"""The real Triton kernels on a CUDA GPU at realistic sizes, sync-freedom and CUDA-graph capture.

Skipped without CUDA. The oracle is dropless.reference in fp64 on the same GPU.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from conftest import (
    assert_close,
    assert_experts_close,
    assert_rows_close,
    bounds_of,
    make_w,
    make_x,
    offsets_of,
    poisoned,
    random_group_sizes,
)

import dropless
from dropless import GroupedLinear, reference
from dropless.kernels.ragged_k import ACCUMULATE_ALL, ACCUMULATE_FLAGGED, NO_ACCUMULATE
from dropless.kernels import tuning
from dropless.kernels.launch import hopper_kernels_ok, hopper_wgrad_ok, launch_info
from dropless.kernels.ragged_m import zeroed_counters
from dropless.kernels.tuning import hopper_candidates, run_ragged_k, run_ragged_m

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = torch.device("cuda")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _sizes(E, total, seed, zero_frac=0.3):
    return random_group_sizes(E, total, zero_frac=zero_frac, rng=random.Random(seed))


# (M, K, N, sizes)
CASES = {
    "e8_tail": (4096, 1024, 768, _sizes(8, 3900, 0)),
    "e16_odd": (3000, 1000, 777, _sizes(16, 2990, 1)),
    "giant_group": (4096, 512, 512, [0, 0, 4096, 0, 0, 0, 0, 0]),
    "e1": (2048, 256, 384, [2000]),
    "e256": (8192, 256, 128, _sizes(256, 8000, 2, zero_frac=0.5)),
    "m0": (0, 256, 128, [0, 0, 0]),
    "m1": (1, 256, 128, [0, 1, 0]),
    "small_kn": (1000, 8, 16, _sizes(4, 999, 3)),
    "unaligned_kn": (1000, 3, 17, _sizes(4, 990, 4)),
    "k130_n100": (1500, 130, 100, _sizes(5, 1400, 5)),
}


def _reference_forward_backward(x, w, offsets, dy):
    x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
    return (reference.grouped_mm(x64, w64, offsets), reference.grouped_mm(dy64, w64.transpose(1, 2), offsets),
            reference.grouped_mm_wgrad(x64, dy64, offsets))


def _forward_backward(M, K, N, sizes, dtype, x_layout="contiguous", w_layout="nk"):
    E = len(sizes)
    x = make_x(M, K, dtype, DEVICE, x_layout).requires_grad_()
    W = (torch.randn(E, N, K, dtype=dtype, device=DEVICE) if w_layout == "nk"
         else torch.randn(E, K, N, dtype=dtype, device=DEVICE)).requires_grad_()
    w = W.transpose(1, 2) if w_layout == "nk" else W
    offsets = offsets_of(sizes, DEVICE)
    y = dropless.grouped_mm(x, w, offsets)
    dy = torch.randn(M, N, dtype=dtype, device=DEVICE)
    y.backward(dy)
    y_ref, dx_ref, dw_ref = _reference_forward_backward(x, w, offsets, dy)
    assert_rows_close(y, y_ref, sizes, dtype, "y")
    assert_rows_close(x.grad, dx_ref, sizes, dtype, "dx")
    assert_experts_close(W.grad.transpose(1, 2) if w_layout == "nk" else W.grad, dw_ref, dtype, "dw")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_backward(dtype, case):
    M, K, N, sizes = CASES[case]
    _forward_backward(M, K, N, sizes, dtype)


@pytest.mark.parametrize("w_layout", ["nk", "kn"])
@pytest.mark.parametrize("x_layout", ["contiguous", "col_slice", "col_slice_odd", "col_major"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_layouts(dtype, x_layout, w_layout):
    _forward_backward(2048, 512, 384, _sizes(8, 2000, 6), dtype, x_layout, w_layout)


@pytest.mark.parametrize("accumulate", ["false", "true", "mask"])
@pytest.mark.parametrize("out_kind", ["fp32", "fp32_transposed", "same"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_wgrad_out(dtype, out_kind, accumulate):
    sizes = [0, 700, 3, 0, 1200, 1, 0, 90]
    M, K, N, E = 2100, 512, 384, len(sizes)
    x = torch.randn(M, K, dtype=dtype, device=DEVICE)
    dy = torch.randn(M, N, dtype=dtype, device=DEVICE)
    offsets = offsets_of(sizes, DEVICE)
    ref = reference.grouped_mm_wgrad(x.double(), dy.double(), offsets)
    out = poisoned((E, K, N), dtype if out_kind == "same" else torch.float32, DEVICE, out_kind == "fp32_transposed")
    if accumulate == "false":
        acc, flags = False, torch.zeros(E, dtype=torch.bool, device=DEVICE)
    else:
        out.copy_(torch.randn(E, K, N))
        flags = (torch.ones(E, dtype=torch.bool, device=DEVICE) if accumulate == "true"
                 else torch.tensor([True, True, False, False, True, False, True, False], device=DEVICE))
        acc = True if accumulate == "true" else flags
    init = out.clone()
    assert dropless.grouped_mm_wgrad(x, dy, offsets, out=out, accumulate=acc) is out
    expected = torch.where(flags.view(-1, 1, 1), init.double() + ref, ref)
    assert_experts_close(out, expected, dtype, "out")
    for e, (s, t) in enumerate(bounds_of(sizes)):
        if s == t:
            assert torch.equal(out[e], init[e] if flags[e] else torch.zeros_like(init[e]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_wgrad_one_huge_group_among_many(dtype):
    E, K, N = 64, 512, 512
    sizes = _sizes(E, 4000, 7, zero_frac=0.4)
    sizes[17] += 60000
    M = sum(sizes) + 100
    x = torch.randn(M, K, dtype=dtype, device=DEVICE)
    dy = torch.randn(M, N, dtype=dtype, device=DEVICE)
    offsets = offsets_of(sizes, DEVICE)
    ref = reference.grouped_mm_wgrad(x.double(), dy.double(), offsets)
    main_grad = poisoned((E, N, K), torch.float32, DEVICE).transpose(1, 2)
    dropless.grouped_mm_wgrad(x, dy, offsets, out=main_grad)
    assert_experts_close(main_grad, ref, dtype, "main_grad")
    dw = dropless.grouped_mm_wgrad(x, dy, offsets)
    assert_experts_close(dw, ref, dtype, "dw")


@pytest.mark.parametrize("tma", [None, False], ids=["tma", "pointers"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_launchers_write_every_element(dtype, tma):
    M, K, N, sizes = 3000, 512, 640, _sizes(12, 2900, 8)
    x = torch.randn(M, K, dtype=dtype, device=DEVICE)
    w = make_w(len(sizes), K, N, dtype, DEVICE, "nk")
    offsets = offsets_of(sizes, DEVICE)
    y = poisoned((M, N), dtype, DEVICE)
    run_ragged_m(x, w, offsets, y, tma=tma)
    assert_rows_close(y, reference.grouped_mm(x.double(), w.double(), offsets), sizes, dtype, "y")
    dy = torch.randn(M, N, dtype=dtype, device=DEVICE)
    for transposed in (False, True):
        out = poisoned((len(sizes), K, N), torch.float32, DEVICE, transposed)
        run_ragged_k(x, dy, offsets, out, NO_ACCUMULATE, None, tma=tma)
        assert_experts_close(out, reference.grouped_mm_wgrad(x.double(), dy.double(), offsets), dtype, "dw")


# Shapes every dimension of which TMA can read (rows of 16 bytes and up, 16-byte aligned strides).
HOPPER_CASES = {
    "e8_tail": CASES["e8_tail"],
    "giant_group": CASES["giant_group"],
    "e1": CASES["e1"],
    "e256": CASES["e256"],
    "m1": CASES["m1"],
    "k_n_tails": (1500, 200, 136, _sizes(6, 1400, 9)),
    "tiny_groups": (700, 256, 256, [1, 63, 64, 65, 0, 127, 128, 129, 2]),
    # Groups ending 64 rows or fewer into a tile, and 40 unrouted rows after them.
    "short_tails": (690, 192, 264, [64, 192, 1, 0, 200, 130, 63]),
}
needs_sm90 = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                reason="the Gluon kernels are for sm_90")


# Shapes TMA cannot read as laid out (rows not a multiple of 16 bytes): K or N odd.
ODD_CASES = {
    "k_odd": (1500, 1001, 256, _sizes(6, 1400, 11)),
    "n_odd": (1500, 256, 1001, _sizes(6, 1400, 12)),
    "k3_n17": CASES["unaligned_kn"],
}


@needs_sm90
@pytest.mark.parametrize("case", list(ODD_CASES))
def test_odd_shapes_run_on_the_hopper_kernels(case, monkeypatch):
    """Odd K or N: the forward, the input gradient and the weight gradient go through padded copies into
    the Gluon kernels (each called), against fp64 into NaN-poisoned outputs; ``tail=False`` leaves the
    rows past the groups as they were; the weight gradient is added where flagged into an fp32
    nn.Linear-layout main_grad."""
    from dropless.kernels import ragged_k_hopper, ragged_m_hopper

    calls = []
    for module, name in ((ragged_m_hopper, "ragged_m_mm_hopper"), (ragged_k_hopper, "ragged_k_mm_hopper")):
        def spy(*args, _fn=getattr(module, name), _name=name, **kwargs):
            calls.append(_name)
            return _fn(*args, **kwargs)
        monkeypatch.setattr(module, name, spy)
    M, K, N, sizes = ODD_CASES[case]
    E, routed = len(sizes), sum(sizes)
    x = torch.randn(M, K, dtype=torch.bfloat16, device=DEVICE)
    dy = torch.randn(M, N, dtype=torch.bfloat16, device=DEVICE)
    offsets = offsets_of(sizes, DEVICE)
    for w_layout in ("nk", "kn"):
        w = make_w(E, K, N, torch.bfloat16, DEVICE, w_layout)
        y = poisoned((M, N), torch.bfloat16, DEVICE)
        run_ragged_m(x, w, offsets, y)
        ref = reference.grouped_mm(x.double(), w.double(), offsets)
        assert_rows_close(y, ref, sizes, torch.bfloat16, f"y ({w_layout})")
        y = poisoned((M, N), torch.bfloat16, DEVICE)
        run_ragged_m(x, w, offsets, y, tail=False)
        assert_close(y[:routed], ref[:routed], torch.bfloat16, f"y, tail=False ({w_layout})")
        assert bool(y[routed:].isnan().all()), "tail=False wrote rows past the groups"
        dx = poisoned((M, K), torch.bfloat16, DEVICE)
        run_ragged_m(dy, w.transpose(1, 2), offsets, dx)
        assert_rows_close(dx, reference.grouped_mm(dy.double(), w.double().transpose(1, 2), offsets), sizes,
                          torch.bfloat16, f"dx ({w_layout})")
    ref = reference.grouped_mm_wgrad(x.double(), dy.double(), offsets)
    flags = torch.tensor([e % 2 == 0 for e in range(E)], device=DEVICE)
    main_grad = torch.randn(E, N, K, device=DEVICE).transpose(1, 2)
    init = main_grad.clone()
    run_ragged_k(x, dy, offsets, main_grad, ACCUMULATE_FLAGGED, flags)
    assert_experts_close(main_grad, torch.where(flags.view(-1, 1, 1), init.double() + ref, ref), torch.bfloat16,
                         "main_grad")
    dw = poisoned((E, K, N), torch.bfloat16, DEVICE)
    run_ragged_k(x, dy, offsets, dw, NO_ACCUMULATE, None)
    assert_experts_close(dw, ref, torch.bfloat16, "dw")
    assert {"ragged_m_mm_hopper", "ragged_k_mm_hopper"} <= set(calls)


def _rows_past_end_poisoned(M, K, N, sizes, dtype):
    x = torch.randn(M, K, dtype=dtype, device=DEVICE)
    dy = torch.randn(M, N, dtype=dtype, device=DEVICE)
    x[sum(sizes):] = float("nan")
    dy[sum(sizes):] = float("nan")
    return x, dy


@needs_sm90
@pytest.mark.parametrize("config", hopper_candidates()["ragged_m"], ids=str)
@pytest.mark.parametrize("case", list(HOPPER_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_ragged_m_every_hopper_candidate(dtype, case, config):
    """Every config the Hopper ragged-M tuner may choose, both weight layouts, NaN past the last offset."""
    M, K, N, sizes = HOPPER_CASES[case]
    x, _ = _rows_past_end_poisoned(M, K, N, sizes, dtype)
    offsets = offsets_of(sizes, DEVICE)
    for w_layout in ("nk", "kn"):
        w = make_w(len(sizes), K, N, dtype, DEVICE, w_layout)
        y = poisoned((M, N), dtype, DEVICE)
        assert hopper_kernels_ok(x, w.transpose(1, 2) if w_layout == "nk" else w, y)
        run_ragged_m(x, w, offsets, y, config=config)
        ref = reference.grouped_mm(torch.nan_to_num(x.double()), w.double(), offsets)
        assert_rows_close(y, ref, sizes, dtype, f"y ({w_layout})")


@needs_sm90
@pytest.mark.parametrize("config", [c for c in hopper_candidates()["ragged_m"] if c.gluon], ids=str)
@pytest.mark.parametrize("programs", [1, 3])
def test_ragged_m_hopper_tile_sequences(config, programs):
    """A few programs, so each runs a long sequence of whole tiles, partial tiles (a group's last rows)
    and unrouted-tail tiles in a row: every hand-back of a stage between them is right, with the output
    leaving whole or in halves."""
    from dropless.kernels.ragged_m_hopper import ragged_m_mm_hopper

    sizes = [300, 64, 1, 0, 256, 129, 63, 500, 2, 192]
    M, K, N = sum(sizes) + 50, 320, 520
    x, _ = _rows_past_end_poisoned(M, K, N, sizes, torch.bfloat16)
    offsets = offsets_of(sizes, DEVICE)
    for w_layout in ("nk", "kn"):
        w = make_w(len(sizes), K, N, torch.bfloat16, DEVICE, w_layout)
        y = poisoned((M, N), torch.bfloat16, DEVICE)
        ragged_m_mm_hopper(x, w, offsets, y, config, programs)
        ref = reference.grouped_mm(torch.nan_to_num(x.double()), w.double(), offsets)
        assert_rows_close(y, ref, sizes, torch.bfloat16, f"y ({w_layout})")


@needs_sm90
@pytest.mark.parametrize("config", [c for c in hopper_candidates()["ragged_m"] if c.split_k > 1], ids=str)
@pytest.mark.parametrize("w_layout", ["nk", "kn"])
def test_split_k_graph_replays_decode_routings(w_layout, config):
    """A split-K config captured in a CUDA graph under balanced routing (64x128 tiles: 128, unsplit) and
    replayed with every row in one expert (fewer tiles: K split up to 4 ways on the device), a tail of
    unrouted rows, and balanced again: each replay's output against the fp64 product, NaN rows past the
    end."""
    E, M, K, N = 4, 64, 4096, 4096
    w = make_w(E, K, N, torch.bfloat16, DEVICE, w_layout)
    static_x = torch.randn(M, K, dtype=torch.bfloat16, device=DEVICE)
    static_offsets = offsets_of([16, 16, 16, 16], DEVICE)
    static_y = torch.empty(M, N, dtype=torch.bfloat16, device=DEVICE)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run_ragged_m(static_x, w, static_offsets, static_y, config=config)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_ragged_m(static_x, w, static_offsets, static_y, config=config)
    for sizes in ([0, 64, 0, 0], [0, 0, 0, 27], [16, 16, 16, 16], [64, 0, 0, 0]):
        x, _ = _rows_past_end_poisoned(M, K, N, sizes, torch.bfloat16)
        static_x.copy_(x)
        static_offsets.copy_(offsets_of(sizes, DEVICE))
        static_y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.grouped_mm(torch.nan_to_num(x.double()), w.double(), offsets_of(sizes, DEVICE))
        assert_rows_close(static_y, ref, sizes, torch.bfloat16, f"y (sizes {sizes})")


@needs_sm90
def test_decode_classes_take_split_k(monkeypatch):
    """A product whose rows in one group would leave multiprocessors idle (a decode step) is given the
    tuner whose default splits K; a training-size one the Hopper tuner."""
    monkeypatch.setenv("DROPLESS_AUTOTUNE", "0")
    E, K = 4, 512
    for M, N, few in ((64, 2048, True), (8192, 4096, False)):
        assert tuning.few_tiles(M, N, launch_info(DEVICE).num_programs) == few
        x = torch.randn(M, K, dtype=torch.bfloat16, device=DEVICE)
        w = make_w(E, K, N, torch.bfloat16, DEVICE, "nk")
        y = torch.empty(M, N, dtype=torch.bfloat16, device=DEVICE)
        run_ragged_m(x, w, offsets_of([M // 4] * 4, DEVICE), y)
        tuners = {decided[1] for signature, decided in tuning._RAGGED_M_CLASSES.items() if signature[0] == x.shape}
        expected = tuning._RAGGED_M_HOPPER_FEW_TILES if few else tuning._RAGGED_M_HOPPER
        assert tuners == {expected}
    assert tuning._RAGGED_M_HOPPER_FEW_TILES.default == tuning.SPLIT_K and tuning.SPLIT_K.gluon


@needs_sm90
@pytest.mark.parametrize("config", hopper_candidates()["ragged_k"], ids=str)
@pytest.mark.parametrize("case", list(HOPPER_CASES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_wgrad_every_hopper_candidate(dtype, case, config):
    """Every config the Hopper wgrad tuner may choose, both output layouts, NaN past the last offset; a
    by-work config leaves its draw counter zeroed for the next launch (the second layout's)."""
    M, K, N, sizes = HOPPER_CASES[case]
    x, dy = _rows_past_end_poisoned(M, K, N, sizes, dtype)
    offsets = offsets_of(sizes, DEVICE)
    routed = sum(sizes)
    ref = reference.grouped_mm_wgrad(x[:routed].double(), dy[:routed].double(), offsets)
    for transposed in (False, True):
        out = poisoned((len(sizes), K, N), dtype, DEVICE, transposed)
        assert hopper_kernels_ok(x, dy, out.transpose(1, 2) if transposed else out)
        run_ragged_k(x, dy, offsets, out, NO_ACCUMULATE, None, config=config)
        assert_experts_close(out, ref, dtype, "dw")
        assert not zeroed_counters(x.device, 1).any()


@needs_sm90
@pytest.mark.parametrize("config", hopper_candidates()["ragged_k_accumulate"], ids=str)
@pytest.mark.parametrize("mode", ["write", "add", "mask"])
@pytest.mark.parametrize("case", list(HOPPER_CASES))
def test_wgrad_into_fp32_every_hopper_candidate(case, mode, config):
    """Every config of the Hopper fp32-output tuner: written, added to, or added to where flagged, into
    both layouts of an fp32 main_grad, with NaN past the last offset."""
    M, K, N, sizes = HOPPER_CASES[case]
    E = len(sizes)
    x, dy = _rows_past_end_poisoned(M, K, N, sizes, torch.bfloat16)
    offsets = offsets_of(sizes, DEVICE)
    routed = sum(sizes)
    ref = reference.grouped_mm_wgrad(x[:routed].double(), dy[:routed].double(), offsets)
    flags = torch.tensor([e % 3 != 1 for e in range(E)], device=DEVICE)
    accumulate = {"write": NO_ACCUMULATE, "add": ACCUMULATE_ALL, "mask": ACCUMULATE_FLAGGED}[mode]
    for transposed in (False, True):
        out = poisoned((E, K, N), torch.float32, DEVICE, transposed)
        if mode != "write":
            out.copy_(torch.randn(E, K, N))
        init = out.clone()
        assert hopper_wgrad_ok(*((dy, x, out.transpose(1, 2)) if transposed else (x, dy, out)))
        run_ragged_k(x, dy, offsets, out, accumulate, flags if mode == "mask" else None, config=config)
        added = torch.ones_like(flags) if mode == "add" else flags if mode == "mask" else ~torch.ones_like(flags)
        expected = torch.where(added.view(-1, 1, 1), init.double() + ref, ref)
        assert_experts_close(out, expected, torch.bfloat16, f"main_grad ({mode})")


# ---------------------------------------------------------------------------------------------------
# GroupedLinear


def _loop(x, weight, bias, sizes):
    y = torch.zeros(x.shape[0], weight.shape[1], dtype=torch.float64, device=x.device)
    for e, (s, t) in enumerate(bounds_of(sizes)):
        y[s:t] = torch.nn.functional.linear(x[s:t], weight[e], None if bias is None else bias[e])
    return y


@pytest.mark.parametrize("form", ["list", "cpu_tensor", "cuda_tensor"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_linear(dtype, form):
    E, K, N = 8, 512, 384
    sizes = _sizes(E, 1900, 9)
    group_sizes = {"list": sizes, "cpu_tensor": torch.tensor(sizes),
                   "cuda_tensor": torch.tensor(sizes, device=DEVICE, dtype=torch.int32)}[form]
    layer = GroupedLinear(E, K, N, bias=True, device=DEVICE, dtype=dtype)
    x = torch.randn(2000, K, device=DEVICE, dtype=dtype, requires_grad=True)
    y = layer(x, group_sizes)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    w64 = layer.weight.detach().double().requires_grad_()
    b64 = layer.bias.detach().double().requires_grad_()
    ref = _loop(x64, w64, b64, sizes)
    ref.backward(dy.double())
    assert_rows_close(y, ref, sizes, dtype, "y")
    assert_rows_close(x.grad, x64.grad, sizes, dtype, "dx")
    assert_experts_close(layer.weight.grad, w64.grad, dtype, "dweight")
    assert_close(layer.bias.grad, b64.grad, dtype, "dbias")


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_linear_bias_grad(dtype):
    """The bias gradient is a sum over each group's rows, accumulated in fp32 (a scatter-add in the
    16-bit dtype was ~3% off in bf16 at a few hundred rows per expert)."""
    E, K, N = 4, 64, 384
    sizes = [600, 0, 900, 400]
    layer = GroupedLinear(E, K, N, bias=True, device=DEVICE, dtype=dtype)
    x = torch.randn(2000, K, device=DEVICE, dtype=dtype)
    y = layer(x, torch.tensor(sizes, device=DEVICE))
    dy = torch.randn_like(y)
    y.backward(dy)
    ref = torch.stack([dy[s:t].double().sum(0) for s, t in bounds_of(sizes)])
    assert_experts_close(layer.bias.grad[:, None], ref[:, None], dtype, "dbias")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_linear_fused_wgrad(dtype):
    E, K, N = 8, 256, 512
    layer = GroupedLinear(E, K, N, device=DEVICE, dtype=dtype, fuse_wgrad_accumulation=True)
    layer.weight.main_grad = poisoned((E, N, K), torch.float32, DEVICE)
    expected = torch.zeros(E, N, K, dtype=torch.float64, device=DEVICE)
    masks = [torch.zeros(E, dtype=torch.bool, device=DEVICE),  # first micro-batch overwrites the NaNs
             torch.tensor([True] * 4 + [False] * 4, device=DEVICE), None]  # None: all accumulate
    for step, mask in enumerate(masks):
        sizes = _sizes(E, 1000, 10 + step)
        x = torch.randn(1024, K, dtype=dtype, device=DEVICE)
        y = layer(x, torch.tensor(sizes, device=DEVICE), mask)
        dy = torch.randn_like(y)
        y.backward(dy)
        g = reference.grouped_mm_wgrad(dy.double(), x.double(), offsets_of(sizes, DEVICE))
        add = torch.ones(E, dtype=torch.bool, device=DEVICE) if mask is None else mask
        expected = torch.where(add.view(-1, 1, 1), expected + g, g)
        assert_experts_close(layer.weight.main_grad, expected, dtype, f"main_grad after step {step}")
    assert layer.weight.grad is None


# ---------------------------------------------------------------------------------------------------
# No host sync, CUDA graphs


@pytest.fixture
def autotune(monkeypatch):
    """These tests run the tuned configs, as bf16 training does (tuning fp32 takes minutes)."""
    monkeypatch.setenv("DROPLESS_AUTOTUNE", "1")


def test_no_host_sync(autotune):
    E, K, N, M = 8, 512, 768, 4096  # over MIN_TUNED_FLOPS: tuned configs
    sizes = torch.tensor(_sizes(E, 4000, 11), device=DEVICE)
    layer = GroupedLinear(E, K, N, bias=True, device=DEVICE, dtype=torch.bfloat16)
    fused = GroupedLinear(E, K, N, device=DEVICE, dtype=torch.bfloat16, fuse_wgrad_accumulation=True)
    fused.weight.main_grad = torch.zeros(E, N, K, device=DEVICE)
    mask = torch.tensor([True, False] * 4, device=DEVICE)
    x = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16)
    main_grad = torch.zeros(E, K, N, device=DEVICE)

    def step():
        layer(x, sizes).backward(dy)
        fused(x, sizes, mask).backward(dy)
        y = dropless.grouped_mm(x.detach(), layer.weight.detach().transpose(1, 2), group_sizes=sizes)
        dropless.grouped_mm_wgrad(x.detach(), y, group_sizes=sizes, out=main_grad, accumulate=mask)

    step()  # warm-up: autotuning syncs on the first call of each problem class
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@pytest.mark.parametrize("dtype, bias", [(torch.bfloat16, True), (torch.float32, False)])
def test_cuda_graph_replay_with_new_group_sizes(dtype, bias, monkeypatch):
    if dtype != torch.float32:
        monkeypatch.setenv("DROPLESS_AUTOTUNE", "1")
    E, K, N, M = 8, 1024, 768, 2048  # over MIN_TUNED_FLOPS: bf16 runs a tuned config
    layer = GroupedLinear(E, K, N, bias=bias, device=DEVICE, dtype=dtype)
    static_x = torch.randn(M, K, device=DEVICE, dtype=dtype, requires_grad=True)
    static_sizes = torch.tensor(_sizes(E, 2000, 12), device=DEVICE)
    static_dy = torch.randn(M, N, device=DEVICE, dtype=dtype)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up and autotuning outside the capture
            static_x.grad = None
            layer.zero_grad(set_to_none=True)
            layer(static_x, static_sizes).backward(static_dy)
    torch.cuda.current_stream().wait_stream(side)

    static_x.grad = None
    layer.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = layer(static_x, static_sizes)
        static_y.backward(static_dy)

    for seed, zero_frac in ((13, 0.3), (14, 0.6), (15, 0.0)):
        sizes = _sizes(E, int(M * (0.5 + 0.4 * random.Random(seed).random())), seed, zero_frac)
        static_sizes.copy_(torch.tensor(sizes))
        with torch.no_grad():
            static_x.copy_(torch.randn(M, K, dtype=dtype))
            static_dy.copy_(torch.randn(M, N, dtype=dtype))
        graph.replay()
        torch.cuda.synchronize()
        x64 = static_x.detach().double().requires_grad_()
        w64 = layer.weight.detach().double().requires_grad_()
        b64 = layer.bias.detach().double().requires_grad_() if bias else None
        ref = _loop(x64, w64, b64, sizes)
        ref.backward(static_dy.double())
        assert_rows_close(static_y, ref, sizes, dtype, f"y (sizes {sizes})")
        assert_rows_close(static_x.grad, x64.grad, sizes, dtype, "dx")
        assert_experts_close(layer.weight.grad, w64.grad, dtype, "dweight")
        if bias:
            assert_close(layer.bias.grad, b64.grad, dtype, "dbias")


# ---------------------------------------------------------------------------------------------------
# Past 2^31 elements


def test_output_past_2_pow_31_elements():
    free, _ = torch.cuda.mem_get_info()
    if free < 40 * 2**30:
        pytest.skip(f"needs 40 GB of free GPU memory, has {free / 2**30:.0f} GB")
    dtype = torch.bfloat16
    K, N, E = 64, 2048, 4
    M = 2**31 // N + 5000  # y and dy hold more than 2^31 elements
    sizes = [M // 4, 0, M // 3, M - M // 4 - M // 3 - 1000]  # 1000 tail rows
    x = torch.randn(M, K, dtype=dtype, device=DEVICE, requires_grad=True)
    W = torch.randn(E, N, K, dtype=dtype, device=DEVICE, requires_grad=True)
    offsets = offsets_of(sizes, DEVICE)
    y = dropless.grouped_mm(x, W.transpose(1, 2), offsets)
    dy = torch.randn(M, N, dtype=dtype, device=DEVICE)
    y.backward(dy)
    del offsets

    def rows_ref(a, b, rows):  # fp64 rows of the grouped product a @ b[e] over a row range
        out = torch.zeros(rows.stop - rows.start, b.shape[2], dtype=torch.float64, device=DEVICE)
        for e, (s, t) in enumerate(bounds_of(sizes)):
            lo, hi = max(s, rows.start), min(t, rows.stop)
            if hi > lo:
                out[lo - rows.start:hi - rows.start] = a[lo:hi].double() @ b[e].double()
        return out

    boundary = 2**31 // N
    end = sum(sizes)
    for rows in (range(0, 300), range(boundary - 200, boundary + 200), range(end - 300, end)):
        assert_close(y[rows.start:rows.stop], rows_ref(x.detach(), W.detach().transpose(1, 2), rows), dtype,
                     f"y rows {rows}")
        assert_close(x.grad[rows.start:rows.stop], rows_ref(dy, W.detach(), rows), dtype, f"dx rows {rows}")
    assert bool((y[end:] == 0).all()) and bool((x.grad[end:] == 0).all())
    for e, (s, t) in enumerate(bounds_of(sizes)):
        ref = torch.zeros(N, K, dtype=torch.float64, device=DEVICE)
        for c in range(s, t, 1 << 18):
            ref += dy[c:min(t, c + (1 << 18))].double().t() @ x.detach()[c:min(t, c + (1 << 18))].double()
        assert_close(W.grad[e], ref, dtype, f"dw[{e}]")


@needs_sm90
def test_direct_launch_reuses_compiled_kernels():
    """A Gluon kernel compiles once per specialization: a second problem with the same one launches the
    compiled kernel directly and is right, and so is the same problem again (the per-call key); a
    problem with another (an M not divisible by 16, offsets not 16-byte aligned) compiles its own."""
    from dropless.kernels.ragged_m_hopper import _LAUNCH

    config = hopper_candidates()["ragged_m"][0]
    K, N = 256, 384
    w = make_w(6, K, N, torch.bfloat16, DEVICE, "kn")
    _LAUNCH.clear()
    compiled_before = 0
    for M, seed, aligned, new_kernels in ((4096, 0, True, 1), (2048, 1, True, 0), (2048, 4, True, 0),
                                          (4095, 2, True, 1), (4095, 3, False, 1), (4095, 5, False, 0)):
        sizes = _sizes(6, M - 5, seed)
        x = torch.randn(M, K, dtype=torch.bfloat16, device=DEVICE)
        offsets = offsets_of(sizes, DEVICE)
        if not aligned:
            offsets = torch.cat([offsets[:1], offsets])[1:]
            assert offsets.data_ptr() % 16 != 0
        y = poisoned((M, N), torch.bfloat16, DEVICE)
        run_ragged_m(x, w, offsets, y, config=config)
        assert_rows_close(y, reference.grouped_mm(x.double(), w.double(), offsets), sizes, torch.bfloat16)
        assert len(_LAUNCH.compiled) == compiled_before + new_kernels, (M, seed)
        compiled_before = len(_LAUNCH.compiled)


@needs_sm90
@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "triton"])
def test_launch_from_a_thread_without_cuda_work(gluon):
    """A compiled kernel with TMA descriptors (Gluon, through the direct launch, or Triton, through its
    JIT) launched from a thread that has made no CUDA call yet (as autograd's device thread is when a
    dropless op's backward is the first CUDA work in it) is right."""
    config = next(c for c in hopper_candidates()["ragged_m"] if c.gluon == gluon)
    M, K, N, E = 1000, 256, 384, 5
    w = make_w(E, K, N, torch.bfloat16, DEVICE, "kn")
    x = torch.randn(M, K, dtype=torch.bfloat16, device=DEVICE)
    sizes = _sizes(E, M - 7, 3)
    offsets = offsets_of(sizes, DEVICE)
    run_ragged_m(x, w, offsets, poisoned((M, N), torch.bfloat16, DEVICE), config=config)  # compiles here
    y = poisoned((M, N), torch.bfloat16, DEVICE)
    errors = []

    def launch() -> None:
        try:
            run_ragged_m(x, w, offsets, y, config=config)
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    thread = threading.Thread(target=launch)
    thread.start()
    thread.join()
    assert not errors, errors
    torch.cuda.synchronize()
    assert_rows_close(y, reference.grouped_mm(x.double(), w.double(), offsets), sizes, torch.bfloat16)
