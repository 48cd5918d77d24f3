"""The GEMM benchmark's quick run: files written, one row per case, ratios to dense consistent."""

from __future__ import annotations

import json
import statistics

import pytest

from dropless.bench.__main__ import main
from dropless.bench.peers import METHODS
from dropless.bench.problem import PASSES
from dropless.bench.readme import END, START, render_table
from dropless.bench.report import decode_bar, format_decode_bar, format_summary, summarize
from dropless.bench.routing import ALL_ROUTINGS, ROUTINGS, group_sizes
from dropless.bench.shapes import DECODE_SHAPES, QUICK_DECODE_SHAPES, QUICK_SHAPES, SHAPES, select_shapes
from dropless.bench.timing import queued_median_ms, round_order

ROW_KEYS = {"shape", "E", "M", "K", "N", "routing", "max_group", "method", "pass", "ms", "ms_rounds", "tflops",
            "ratio_to_dense", "max_rel_err", "failed", "error"}
ROUNDS = 2


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    assert main(["gemm", "--quick", "--rounds", str(ROUNDS), "--out", str(out), "--name", "quick"]) == 0
    return out


def test_quick_gemm_writes_json_and_plot(quick_run):
    result = json.loads((quick_run / "quick.json").read_text())
    assert set(result) == {"meta", "rows"}
    assert {"gpu", "torch", "triton", "commit", "date"} <= set(result["meta"])
    assert result["meta"]["rounds"] == ROUNDS
    rows = result["rows"]
    assert len(rows) == len(QUICK_SHAPES) * len(ROUTINGS) * len(PASSES) * len(METHODS)
    assert all(set(r) == ROW_KEYS for r in rows)
    assert {(r["shape"], r["routing"], r["method"], r["pass"]) for r in rows} == {
        (s.name, routing, m, p) for s in QUICK_SHAPES for routing in ROUTINGS for m in METHODS for p in PASSES}
    for r in rows:
        # A peer may be unsupported or not installed; dropless and the torch.mm-based methods never fail.
        assert not r["failed"] or r["method"] in ("torch_grouped_mm", "padded_bmm", "quack"), r
        if r["failed"]:
            assert r["tflops"] is None and (r["error"] or r["max_rel_err"] is not None)
            continue
        assert r["tflops"] > 0 and r["ms"] > 0 and r["max_rel_err"] >= 0
        assert len(r["ms_rounds"]) == ROUNDS and r["ms"] == statistics.median(r["ms_rounds"])
        if r["method"] == "dense":
            assert r["ratio_to_dense"] == 1
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (quick_run / "quick.png").stat().st_size > 0


@pytest.fixture(scope="module")
def decode_run(tmp_path_factory):
    """One training shape and the decode group: each shape under its own routings."""
    out = tmp_path_factory.mktemp("bench_decode")
    assert main(["gemm", "--quick", "--rounds", "1", "--shapes", "tiny-few", "decode", "--out", str(out),
                 "--name", "decode"]) == 0
    return json.loads((out / "decode.json").read_text())


def test_decode_group_runs_every_routing_and_method(decode_run):
    rows = decode_run["rows"]
    expected = {("tiny-few", routing) for routing in ROUTINGS}
    expected |= {(s.name, routing) for s in QUICK_DECODE_SHAPES for routing in ALL_ROUTINGS}
    assert {(r["shape"], r["routing"]) for r in rows} == expected
    assert len(rows) == len(expected) * len(PASSES) * len(METHODS)
    for r in rows:
        assert not r["failed"] or r["method"] == "quack", r
    sizes = decode_run["meta"]["group_sizes"]
    for shape in QUICK_DECODE_SHAPES:
        assert shape.M <= 16 * shape.E
        assert sorted(sizes[shape.name]["all-to-one"]) == [0] * (shape.E - 1) + [shape.M]
    assert max(s.E for s in QUICK_DECODE_SHAPES) > 100  # the case: every row on one of over 100 experts
    bar = decode_bar(rows)
    assert len(bar["ratios"]) == len(QUICK_DECODE_SHAPES) * len(ALL_ROUTINGS) * len(PASSES)  # tiny-few is no decode
    assert format_decode_bar(rows) in format_summary(rows)


def test_readme_table_shows_each_shape_under_its_own_routings(decode_run):
    lines = render_table(decode_run, "decode.json").splitlines()
    assert sum("tiny-few" in line for line in lines) == len(ROUTINGS)
    assert sum("| all-to-one |" in line for line in lines) == len(QUICK_DECODE_SHAPES)
    assert not any(" - | - | - |" in line for line in lines)  # no row of a routing a shape was not run under


def test_shape_groups():
    assert select_shapes(None, quick=False) == list(SHAPES)
    assert select_shapes(["decode"], quick=False) == list(DECODE_SHAPES)
    assert select_shapes(["decode"], quick=True) == list(QUICK_DECODE_SHAPES)
    decode = DECODE_SHAPES[0].name
    assert select_shapes([decode, "training", decode], quick=False) == [DECODE_SHAPES[0], *SHAPES]
    assert all(s.M <= 16 * s.E and s.routings == ALL_ROUTINGS for s in DECODE_SHAPES)
    assert all(s.routings == ROUTINGS for s in SHAPES)
    with pytest.raises(ValueError, match="unknown shape"):
        select_shapes(["nope"], quick=False)


def test_readme_table_between_markers(quick_run, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# dropless\n\n{START}\nstale\n{END}\n\nafter\n")
    assert main(["readme", str(quick_run / "quick.json"), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "stale" not in text and text.endswith(f"{END}\n\nafter\n")
    assert all(s.name in text for s in QUICK_SHAPES)
    assert f"the median of {ROUNDS} rounds" in text  # how each case was timed


@pytest.mark.parametrize("E, M", [(4, 16384), (32, 32768), (128, 65536), (16, 500)])
def test_skewed_routing_sums_to_M_with_empty_experts(E, M):
    sizes = group_sizes(E, M, "skewed")
    assert len(sizes) == E and sum(sizes) == M
    assert sizes.count(0) == -(-E // 8)
    assert group_sizes(E, M, "skewed") == sizes  # seeded
    balanced = group_sizes(E, M, "balanced")
    assert sum(balanced) == M and max(balanced) - min(balanced) <= 1


@pytest.mark.parametrize("E, M, align", [(4, 64, 1), (128, 1536, 1), (128, 1536, 16), (1, 8, 1)])
def test_all_to_one_routing_puts_every_row_on_one_expert(E, M, align):
    sizes = group_sizes(E, M, "all-to-one", align=align)
    assert len(sizes) == E and sorted(sizes) == [0] * (E - 1) + [M]
    assert group_sizes(E, M, "all-to-one", align=align) == sizes  # seeded


def test_round_order_shuffles_each_round_reproducibly():
    cases = list(range(20))
    orders = [round_order(cases, r, seed=0) for r in range(3)]
    assert all(sorted(o) == cases for o in orders)
    assert len({tuple(o) for o in orders}) == 3
    assert orders == [round_order(cases, r, seed=0) for r in range(3)]
    assert round_order(cases, 0, seed=1) != orders[0]
    assert cases == list(range(20))


def test_queued_timing_waits_once_per_batch_for_its_last_call():
    calls, waited = [], []
    ms = queued_median_ms(lambda: calls.append(len(calls)) or len(calls), waited.append, warmup=1.0, rep=5.0)
    assert ms > 0
    assert 2 <= len(waited) < len(calls)  # calls are queued: far fewer waits than calls
    assert waited[-1] == len(calls) and waited == sorted(set(waited))  # each wait gets its batch's last result


def _row(shape: str, routing: str, method: str, pass_: str, tflops: float | None, M: int = 8) -> dict:
    return {"shape": shape, "E": 2, "M": M, "K": 4, "N": 4, "routing": routing, "method": method, "pass": pass_,
            "tflops": tflops, "error": None if tflops else "RuntimeError: quack-kernels is not installed"}


def test_decode_bar_counts_decode_and_all_to_one_rows():
    train, decode = 64, 32  # rows in all over E=2 experts: 32 and 16 per expert
    rows = [_row(shape, routing, method, pass_, tflops, M) for shape, routing, pass_, M, dl, peer in (
        ("t", "balanced", "fwd", train, 50.0, 100.0),  # a training-size balanced row: not counted
        ("t", "all-to-one", "fwd", train, 120.0, 100.0),
        ("d", "skewed", "fwd", decode, 90.0, 100.0),
        ("d", "skewed", "wgrad", decode, None, 100.0),  # dropless failed: missed
        ("d", "balanced", "fwd", decode, 90.0, None),  # the peer failed: left out
    ) for method, tflops in (("dropless", dl), ("torch_grouped_mm", peer))]
    bar = decode_bar(rows)
    assert bar["ratios"] == {"t all-to-one fwd": pytest.approx(1.2), "d skewed fwd": pytest.approx(0.9),
                             "d skewed wgrad": 0.0}
    assert bar["met"] == 1 and bar["lowest"] == ("d skewed wgrad", 0.0) and bar["peer_failed"] == ["d balanced fwd"]
    line = format_decode_bar(rows)
    assert "met on 1 of 3, lowest 0.00 (d skewed wgrad)" in line and "failed on d balanced fwd" in line
    assert format_decode_bar(rows[:2]).endswith("no such rows in this run")


def test_summary_is_the_geomean_over_each_peer():
    rows = [_row("a", "balanced", "dense", "fwd", 400.0), _row("a", "balanced", "dropless", "fwd", 300.0),
            _row("a", "balanced", "quack", "fwd", 200.0), _row("b", "balanced", "dense", "fwd", 100.0),
            _row("b", "balanced", "dropless", "fwd", 90.0), _row("b", "balanced", "quack", "fwd", None)]
    s = summarize(rows)["fwd"]
    assert s["vs"]["dense"] == pytest.approx((0.75 * 0.9) ** 0.5)
    assert s["vs"]["quack"] == pytest.approx(1.5)  # only where both were timed
    assert (s["min_balanced_vs_dense"], s["min_balanced_shape"]) == (pytest.approx(0.75), "a")


def test_readme_table_shows_quack_only_where_it_was_timed():
    meta = {"gpu": "GPU", "torch": "t", "triton": "tr", "dtype": "bfloat16", "commit": "c", "date": "d", "rounds": 3,
            "rep_ms": 1, "warmup_ms": 1}
    rows = [_row("a", "balanced", m, p, 100.0 + i) for i, m in enumerate(("dense", "dropless", "torch_grouped_mm"))
            for p in ("fwd", "fwd+bwd")]
    without = render_table({"meta": meta, "rows": rows + [_row("a", "balanced", "quack", "fwd", None)]}, "f.json")
    assert "quack" not in without
    table = render_table({"meta": meta, "rows": rows + [_row("a", "balanced", "quack", p, 50.0)
                                                        for p in ("fwd", "fwd+bwd")]}, "f.json")
    header, cells = table.splitlines()[2], table.splitlines()[4].split(" | ")
    assert "fwd dropless/quack" in header and "fwd+bwd quack" in header
    assert cells[header.split(" | ").index("fwd dropless/quack")] == "2.02"


def test_quack_rows_say_it_is_missing(quick_run):
    try:
        import quack  # noqa: F401
    except ImportError:
        rows = json.loads((quick_run / "quick.json").read_text())["rows"]
        quack_rows = [r for r in rows if r["method"] == "quack"]
        assert quack_rows and all(r["failed"] and "quack-kernels is not installed" in r["error"] for r in quack_rows)
    else:
        pytest.skip("quack-kernels is installed here")


def test_merge_joins_runs_of_disjoint_shapes(tmp_path):
    from dropless.bench.merge import merge_results

    def run(shape: str, date: str, seconds: float) -> dict:
        meta = {"gpu": "GPU", "torch": "t", "triton": "tr", "dtype": "bfloat16", "dropless_backend": "triton",
                "warmup_ms": 300.0, "rep_ms": 150.0, "rounds": 3, "seed": 0, "quick": False, "tolerance": 0.02,
                "commit": "abc+dirty", "date": date, "seconds": seconds,
                "group_sizes": {shape: {"balanced": [4, 4]}}, "tuned_configs": {"ragged_m": {shape: "cfg"}}}
        return {"meta": meta, "rows": [_row(shape, "balanced", m, "fwd", 100.0) for m in ("dense", "dropless")]}

    a, b = run("a", "d1", 10.0), run("b", "d2", 5.5)
    merged = merge_results([a, b], commit="1234567")
    assert merged["rows"] == a["rows"] + b["rows"]
    meta = merged["meta"]
    assert meta["commit"] == "1234567" and meta["seconds"] == 15.5
    assert meta["group_sizes"] == {"a": {"balanced": [4, 4]}, "b": {"balanced": [4, 4]}}
    assert meta["tuned_configs"] == {"ragged_m": {"a": "cfg", "b": "cfg"}}
    assert [r["date"] for r in meta["runs"]] == ["d1", "d2"] and meta["runs"][1]["shapes"] == ["b"]
    with pytest.raises(ValueError, match="more than one file"):
        merge_results([a, run("a", "d3", 1.0)])
    other = run("b", "d2", 1.0)
    other["meta"]["rounds"] = 5
    with pytest.raises(ValueError, match="rounds"):
        merge_results([a, other])
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    out = tmp_path / "m.json"
    assert main(["merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(out)]) == 0
    assert "2 runs split by shape (d1, d2)" in render_table(json.loads(out.read_text()), "m.json")
