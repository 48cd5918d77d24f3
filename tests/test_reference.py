"""dropless.reference, the oracle of every other test, against independent row-by-row fp64 oracles."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import (
    assert_experts_close,
    assert_rows_close,
    bounds_of,
    make_w,
    make_x,
    offsets_of,
    oracle_grouped_mm,
    oracle_wgrad,
    random_group_sizes,
)

from dropless import reference

# (M, K, N, sizes): zeros, one giant group, E=1, E=256, M=0, M=1, tails, odd K and N.
CASES = {
    "zeros_and_tail": (50, 7, 5, [0, 12, 0, 0, 30, 0]),
    "giant_group": (40, 3, 17, [0, 0, 40, 0]),
    "e1": (9, 4, 6, [9]),
    "e1_tail": (9, 4, 6, [5]),
    "e256": (300, 3, 2, random_group_sizes(256, 280, zero_frac=0.5, rng=random.Random(256))),
    "m0": (0, 5, 3, [0, 0, 0]),
    "m1": (1, 17, 1, [0, 1, 0]),
    "all_empty": (6, 3, 4, [0, 0]),
    "k1_n100": (33, 1, 100, [10, 20, 0]),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_mm_matches_oracle(case, dtype):
    M, K, N, sizes = CASES[case]
    x = make_x(M, K, dtype, "cpu")
    w = make_w(len(sizes), K, N, dtype, "cpu")
    y = reference.grouped_mm(x, w, offsets_of(sizes))
    assert y.dtype == dtype and y.shape == (M, N)
    assert_rows_close(y, oracle_grouped_mm(x, w, sizes), sizes, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(CASES))
def test_wgrad_matches_oracle(case, dtype):
    M, K, N, sizes = CASES[case]
    x = make_x(M, K, dtype, "cpu")
    dy = torch.randn(M, N, dtype=dtype)
    dw = reference.grouped_mm_wgrad(x, dy, offsets_of(sizes))
    assert dw.dtype == dtype and dw.shape == (len(sizes), K, N)
    assert_experts_close(dw, oracle_wgrad(x, dy, sizes), dtype)
    for e, (s, t) in enumerate(bounds_of(sizes)):
        if s == t:
            assert bool((dw[e] == 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_accumulates_in_fp32(dtype):
    # Long groups of 16-bit values: a 16-bit accumulator would lose far more than the output rounding.
    sizes = [0, 700, 300]
    x = make_x(1000, 64, dtype, "cpu")
    w = make_w(3, 64, 8, dtype, "cpu")
    y = reference.grouped_mm(x, w, offsets_of(sizes))
    assert y.dtype == dtype
    assert_rows_close(y, oracle_grouped_mm(x, w, sizes), sizes, dtype)
    dy = torch.randn(1000, 8, dtype=dtype)
    dw = reference.grouped_mm_wgrad(x, dy, offsets_of(sizes))
    assert dw.dtype == torch.float32
    assert_experts_close(dw, oracle_wgrad(x, dy, sizes), torch.float32)


def test_strided_operands():
    sizes = [3, 0, 8]
    x = make_x(14, 10, torch.float64, "cpu", "col_major")
    w = make_w(3, 10, 7, torch.float64, "cpu", "nk")
    assert_rows_close(reference.grouped_mm(x, w, offsets_of(sizes)), oracle_grouped_mm(x, w, sizes), sizes,
                      torch.float64)


@pytest.mark.parametrize(
    "offsets, M, expected",
    [
        ([2, 5, 9], 9, [(0, 2), (2, 5), (5, 9)]),
        ([3, 3, 4], 10, [(0, 3), (3, 3), (3, 4)]),
        ([4, 20, 30], 10, [(0, 4), (4, 10), (10, 10)]),  # past M: clamped
        ([-3, 2, 2], 5, [(0, 0), (0, 2), (2, 2)]),  # negative: clamped to 0
        ([6, 2, 8], 10, [(0, 6), (6, 6), (6, 8)]),  # decreasing: a group never starts before the last end
    ],
)
def test_group_bounds_clamps(offsets, M, expected):
    assert reference.group_bounds(torch.tensor(offsets, dtype=torch.int32), M) == expected


def test_accumulate_into_modes():
    E, K, N = 4, 3, 5
    dw = torch.randn(E, K, N, dtype=torch.float64)
    init = torch.randn(E, K, N, dtype=torch.float32)

    out = torch.full((E, K, N), float("nan"))
    reference.accumulate_into(out, dw, False)
    torch.testing.assert_close(out, dw.float(), rtol=0, atol=0)

    out = init.clone()
    reference.accumulate_into(out, dw, True)
    torch.testing.assert_close(out, init + dw.float(), rtol=0, atol=0)

    flags = torch.tensor([True, False, True, False])
    out = init.clone()
    reference.accumulate_into(out, dw, flags)
    torch.testing.assert_close(out[flags], init[flags] + dw[flags].float(), rtol=0, atol=0)
    torch.testing.assert_close(out[~flags], dw[~flags].float(), rtol=0, atol=0)
