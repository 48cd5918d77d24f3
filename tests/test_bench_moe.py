"""The whole MoE layer benchmark's quick run on the CPU: files written, one row per config and method,
every method checked against the fp32 reference; the README block between its markers."""

from __future__ import annotations

import json
import statistics

import pytest

pytest.importorskip("transformers", minversion="5.0")

from dropless.bench.__main__ import main  # noqa: E402
from dropless.bench.moe import BF16_METHODS  # noqa: E402
from dropless.bench.moe_layers import QUICK_CONFIGS  # noqa: E402
from dropless.bench.moe_report import MOE_END, MOE_START  # noqa: E402
from dropless.bench.readme import END, START  # noqa: E402

ROW_KEYS = {"config", "T", "E", "k", "d", "d_ff", "shared_d_ff", "method", "ms", "ms_rounds", "tflops",
            "fraction_of_dense", "peak_gib", "weight_cache_gib", "max_rel_err", "rel_errs", "failed", "error"}


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    import dropless

    dropless.set_backend("reference")
    try:
        out = tmp_path_factory.mktemp("bench_moe")
        assert main(["moe", "--quick", "--out", str(out), "--name", "quick"]) == 0
    finally:
        dropless.set_backend("auto")
    return out


def test_quick_moe_writes_json_and_plot(quick_run):
    result = json.loads((quick_run / "quick.json").read_text())
    assert set(result) == {"meta", "rows"}
    meta = result["meta"]
    assert {"gpu", "torch", "triton", "commit", "date", "transformers", "flops", "dense", "tolerance"} <= set(meta)
    assert meta["quick"] and meta["benchmark"] == "moe"
    rows = result["rows"]
    assert [(r["config"], r["method"]) for r in rows] == [(c.name, m) for c in QUICK_CONFIGS for m in BF16_METHODS]
    assert all(set(r) == ROW_KEYS for r in rows)
    for r in rows:
        # On the CPU every method runs, torch._grouped_mm and transformers' blocks included.
        assert not r["failed"], r
        assert r["ms"] > 0 and r["tflops"] > 0 and r["fraction_of_dense"] > 0 and r["peak_gib"] is None
        assert r["weight_cache_gib"] is None
        assert len(r["ms_rounds"]) == meta["rounds"] and r["ms"] == statistics.median(r["ms_rounds"])
        if r["method"] == "dense":
            assert r["fraction_of_dense"] == 1 and r["max_rel_err"] is None
            continue
        assert 0 <= r["max_rel_err"] <= meta["tolerance"]
        assert set(r["rel_errs"]) >= {"y", "dx", "router", "gate_up", "down"}
        assert ("shared_gate_up" in r["rel_errs"]) == (r["shared_d_ff"] > 0)
        cfg = next(c for c in QUICK_CONFIGS if c.name == r["config"])
        assert r["tflops"] == pytest.approx(cfg.useful_flops / r["ms"] / 1e9)
    dropless_rows = [r for r in rows if r["method"] == "dropless"]
    assert len(dropless_rows) == len(QUICK_CONFIGS) and all(r["max_rel_err"] < 1e-5 for r in dropless_rows)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (quick_run / "quick.png").stat().st_size > 0


def test_readme_moe_table_between_markers(quick_run, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# dropless\n\n{START}\ngemm\n{END}\n\n{MOE_START}\nstale\n{MOE_END}\n\nafter\n")
    assert main(["readme", str(quick_run / "quick.json"), "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "stale" not in text and text.endswith(f"{MOE_END}\n\nafter\n")
    assert f"{START}\ngemm\n{END}" in text  # the GEMM table is left alone without GEMM results
    assert all(c.label in text for c in QUICK_CONFIGS)


def test_readme_without_moe_markers_is_left_alone(quick_run, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# dropless\n\n{START}\ngemm\n{END}\n")
    before = readme.read_text()
    assert main(["readme", str(quick_run / "quick.json"), "--readme", str(readme)]) == 0
    assert readme.read_text() == before


def test_unknown_config_is_an_error(tmp_path):
    assert main(["moe", "--quick", "--configs", "nope", "--out", str(tmp_path)]) == 2


def test_fp8_methods_run_beside_bf16(tmp_path):
    """``--fp8``: dropless.MoE with FP8 expert GEMMs, checked with the FP8 tolerance (and off the
    reference by more than BF16 is, so FP8 did run), its cached weight copies reported."""
    import dropless

    dropless.set_backend("reference")
    try:
        assert main(["moe", "--quick", "--configs", "qwen3", "--methods", "dropless", "--fp8", "rowwise", "block128",
                     "--out", str(tmp_path), "--name", "fp8"]) == 0
    finally:
        dropless.set_backend("auto")
    result = json.loads((tmp_path / "fp8.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert list(rows) == ["dropless", "dropless_rowwise", "dropless_block128"]
    bf16 = rows["dropless"]
    for method in ("dropless_rowwise", "dropless_block128"):
        r = rows[method]
        assert not r["failed"] and r["ms"] > 0, r
        assert bf16["max_rel_err"] < r["max_rel_err"] <= result["meta"]["fp8_tolerance"]
        assert r["weight_cache_gib"] > 0


def test_unknown_fp8_recipe_is_an_error(tmp_path):
    with pytest.raises(SystemExit):
        main(["moe", "--quick", "--fp8", "fp4", "--out", str(tmp_path)])
