"""The FP8 benchmark: its quick run (files, rows, FP8 keys, quantization rows) and its roofline model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from dropless.bench.__main__ import main
from dropless.bench.fp8 import add_fp8_keys, format_quantization_table, method_recipe, quantization_bytes
from dropless.bench.fp8_peers import FP8_METHODS
from dropless.bench.fp8_report import FP8_END, FP8_START
from dropless.bench.problem import PASSES
from dropless.bench.readme import END, START
from dropless.bench.routing import ROUTINGS, group_sizes
from dropless.bench.shapes import QUICK_SHAPES
from dropless.bench.timing import graphed_median_ms, median_ms

FP8_KEYS = {"recipe", "weights", "roofline_tflops", "ratio_to_bf16", "sqnr_db"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_fp8")
    assert main(["fp8", "--quick", "--rounds", "1", "--out", str(out), "--name", "quick"]) == 0
    return json.loads((out / "quick.json").read_text())


def test_quick_fp8_rows(quick_run):
    rows = quick_run["rows"]
    assert len(rows) == len(QUICK_SHAPES) * len(ROUTINGS) * len(PASSES) * len(FP8_METHODS)
    for r in rows:
        assert FP8_KEYS <= set(r)
        assert r["recipe"] == method_recipe(r["method"])[0]
        # Peers that need a GPU (or torchao) may fail on the CPU; dropless and dense never do.
        if r["method"].startswith("dropless") or r["method"] == "dense":
            assert not r["failed"], r
            assert r["max_rel_err"] <= 0.1
        if r["method"].startswith("dropless_") and not r["failed"]:
            assert r["sqnr_db"] >= 20, r
            assert r["ratio_to_bf16"] == pytest.approx(r["tflops"] / next(
                q["tflops"] for q in rows if q["method"] == "dropless" and q["shape"] == r["shape"]
                and q["routing"] == r["routing"] and q["pass"] == r["pass"]))
    # group sizes are multiples of 16 (what torchao and _scaled_grouped_mm take), skewed ones included
    for shape in quick_run["meta"]["group_sizes"].values():
        assert all(size % 16 == 0 for sizes in shape.values() for size in sizes)


def test_quick_fp8_quantization_rows(quick_run):
    rows = quick_run["quantization"]
    weights = [r for r in rows if r["operand"] == "weight"]
    assert {r["recipe"] for r in weights} == {"rowwise", "block128x128", "mxfp8"}
    activations = [r for r in rows if r["operand"] == "activation"]
    assert {(r["dim"], r["recipe"]) for r in activations} == {(d, n) for d in (0, 1)
                                                               for n in ("rowwise", "block128", "mxfp8")}
    assert all(r["ms"] > 0 and r["gbps"] > 0 for r in rows)
    # The table says how its rows were timed: on a GPU the kernels replayed from a CUDA graph; results
    # from before the key timed each call from Python.
    assert quick_run["meta"]["quantization_timing"] == "host"
    assert format_quantization_table(quick_run).startswith("Quantization (a host clock)")
    older = {**quick_run, "meta": {k: v for k, v in quick_run["meta"].items() if k != "quantization_timing"}}
    assert format_quantization_table(older).startswith("Quantization (each call from Python)")


@pytest.mark.gpu
def test_graphed_timing_counts_the_kernels_alone():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.randn(1 << 24, device="cuda")
    ms = graphed_median_ms(lambda: x.mul_(1.0), x.device, 10, 20)
    assert 0 < ms < median_ms(lambda: x.mul_(1.0), x.device, 10, 20) * 1.5


def test_group_sizes_aligned():
    for routing in ROUTINGS:
        sizes = group_sizes(16, 4096, routing, seed=3, align=16)
        assert sum(sizes) == 4096 and all(s % 16 == 0 for s in sizes)
    with pytest.raises(ValueError, match="align"):
        group_sizes(4, 100, "balanced", align=16)


def test_quantization_bytes_and_roofline():
    E, M, K, N = 4, 1024, 256, 512
    # fwd, weights cached: x read in bf16 and written in FP8 with fp32 row scales (no bytes to speak of)
    assert quantization_bytes(E, M, K, N, "fwd", "rowwise", "cached") == 3 * M * K
    # a rowwise weight is read twice (amax, then values) and written in two orientations
    assert quantization_bytes(E, M, K, N, "fwd", "rowwise", "in_call") == 3 * M * K + 6 * E * K * N
    mx = 2 + 2 * (1 + 1 / 32)
    assert quantization_bytes(E, M, K, N, "dgrad", "mxfp8", "in_call") == pytest.approx(
        (3 + 1 / 32) * M * N + mx * E * K * N)
    assert quantization_bytes(E, M, K, N, "fwd+bwd", "rowwise", "cached") == 6 * (M * K + M * N)

    base = {"shape": "s", "routing": "balanced", "pass": "fwd", "E": E, "M": M, "K": K, "N": N, "max_rel_err": 0.03}
    rows = [dict(base, method="dropless", tflops=500.0), dict(base, method="dense_fp8", tflops=1000.0),
            dict(base, method="dropless_rowwise_cached", tflops=800.0)]
    add_fp8_keys(rows, bandwidth=2000.0)
    fp8 = rows[2]
    assert fp8["recipe"] == "rowwise" and fp8["weights"] == "cached"
    assert fp8["ratio_to_bf16"] == pytest.approx(1.6)
    assert fp8["sqnr_db"] == pytest.approx(-20 * math.log10(0.03))
    seconds = 2 * M * K * N / 1e15 + 3 * M * K / 2e12
    assert fp8["roofline_tflops"] == pytest.approx(2 * M * K * N / seconds / 1e12)
    assert rows[0]["roofline_tflops"] is None and rows[0]["recipe"] == "bf16"


def test_split_runs_merge(tmp_path):
    """Two runs split by shape (the second without the weights' quantization rows) merge into one."""
    names = []
    for shape, quantization in (("tiny-few", "all"), ("tiny-many", "activations")):
        assert main(["fp8", "--quick", "--rounds", "1", "--out", str(tmp_path), "--name", shape, "--shapes", shape,
                     "--methods", "dense", "dropless", "dropless_rowwise", "--passes", "fwd",
                     "--quantization", quantization]) == 0
        names.append(str(tmp_path / f"{shape}.json"))
    assert main(["merge", *names, "--out", str(tmp_path / "merged.json")]) == 0
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert {r["shape"] for r in merged["rows"]} == {"tiny-few", "tiny-many"}
    weights = [r for r in merged["quantization"] if r["operand"] == "weight"]
    assert len(weights) == 3 * 2  # three recipes at the two quick E, once
    assert {r["shape"] for r in merged["quantization"] if r["operand"] == "activation"} == {"tiny-few", "tiny-many"}


def test_readme_fp8_table_between_markers(quick_run, tmp_path):
    """``readme`` writes the FP8 table (every shape and routing of the run, and the quantization table)
    between its markers and leaves the GEMM table's alone."""
    readme, source = tmp_path / "README.md", tmp_path / "fp8-quick.json"
    source.write_text(json.dumps(quick_run))
    readme.write_text(f"# dropless\n\n{START}\ngemm\n{END}\n\n{FP8_START}\nstale\n{FP8_END}\n\nafter\n")
    assert main(["readme", str(source), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "stale" not in text and text.endswith(f"{FP8_END}\n\nafter\n")
    assert f"{START}\ngemm\n{END}" in text
    block = text[text.index(FP8_START):text.index(FP8_END)]
    shapes = {r["shape"] for r in quick_run["rows"]}
    assert all(f"| {s} (" in block for s in shapes)
    assert sum(line.startswith(f"| {s} (") for s in shapes for line in block.splitlines()) == 2 * len(shapes)
    assert "| rowwise |" in block  # the quantization table
