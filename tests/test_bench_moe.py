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
from dropless.bench.moe_report import MOE_END, MOE_START, format_layer_memory_bar, render_table  # noqa: E402
from dropless.bench.readme import END, START  # noqa: E402

ROW_KEYS = {"config", "T", "E", "k", "d", "d_ff", "shared_d_ff", "method", "ms", "ms_rounds", "tflops",
            "fraction_of_dense", "peak_gib", "layer_gib", "grad_gib", "weight_cache_gib", "max_rel_err", "rel_errs",
            "failed", "error"}


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
        assert r["ms"] > 0 and r["tflops"] > 0 and r["fraction_of_dense"] > 0
        assert r["peak_gib"] is None and r["layer_gib"] is None and r["weight_cache_gib"] is None
        assert len(r["ms_rounds"]) == meta["rounds"] and r["ms"] == statistics.median(r["ms_rounds"])
        if r["method"] == "dense":
            assert r["fraction_of_dense"] == 1 and r["max_rel_err"] is None
            continue
        assert 0 <= r["max_rel_err"] <= meta["tolerance"]
        assert set(r["rel_errs"]) >= {"y", "dx", "router", "gate_up", "down"}
        assert ("shared_gate_up" in r["rel_errs"]) == (r["shared_d_ff"] > 0)
        cfg = next(c for c in QUICK_CONFIGS if c.name == r["config"])
        assert r["tflops"] == pytest.approx(cfg.useful_flops / r["ms"] / 1e9)
        # dx and every weight gradient (router, experts, shared experts), fp32 on the CPU
        d, f, s = cfg.d, cfg.d_ff, cfg.shared_d_ff
        grads = cfg.T * d + cfg.E * d + cfg.E * 3 * f * d + 3 * s * d
        assert r["grad_gib"] == pytest.approx(4 * grads / 2**30)
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


def test_layer_memory_column_only_for_results_that_have_it(quick_run):
    result = json.loads((quick_run / "quick.json").read_text())
    header = render_table(result, "quick.json").splitlines()[2]
    assert header == "| layer | method | ms | TFLOP/s | of dense | peak GiB | layer GiB | dropless speedup |"
    for r in result["rows"]:  # as in the result files from before layer_gib was measured
        del r["layer_gib"]
    header = render_table(result, "quick.json").splitlines()[2]
    assert header == "| layer | method | ms | TFLOP/s | of dense | peak GiB | dropless speedup |"


def test_layer_memory_bar():
    def row(config: str, method: str, layer_gib: float | None) -> dict:
        return {"config": config, "method": method, "layer_gib": layer_gib, "grad_gib": 1.0}

    # Own memory = layer_gib - grad_gib: a 0.5 / 2.0, b 1.8 / 2.0 (0.9) or with recompute 1.4 / 2.0 (0.7).
    rows = [row("a", "dropless", 1.5), row("a", "torch_grouped_mm", 3.0), row("b", "dropless", 2.8),
            row("b", "dropless_recompute", 2.4), row("b", "torch_grouped_mm", 3.0), row("c", "dropless", None),
            row("c", "torch_grouped_mm", 3.0), row("d", "dropless", 2.9), row("d", "torch_grouped_mm", 3.0)]
    line = format_layer_memory_bar(rows)
    assert "met at 2 of 3, highest 0.95 (d)" in line and "a 0.25 (gradients 1.00 GiB), b 0.70" in line
    assert "not measured" in format_layer_memory_bar([row("a", "dropless", None), row("a", "torch_grouped_mm", None)])


def test_layer_memory_counts_what_the_layer_keeps_beyond_its_weights(monkeypatch):
    """``layer_gib``: the step's peak above what was held before the layer was built plus its parameters,
    so state the layer keeps between steps counts; ``peak_gib`` counts only the step's own allocations.
    The CUDA allocator's counters are simulated, so the arithmetic is checked on the CPU."""
    import torch

    from dropless.bench import moe
    from dropless.bench.moe_layers import build_torch_grouped_mm, make_weights

    memory = {"allocated": 0, "peak": 0}

    def allocate(nbytes: int) -> None:
        memory["allocated"] += nbytes
        memory["peak"] = max(memory["peak"], memory["allocated"])

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats",
                        lambda device=None: memory.update(peak=memory["allocated"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: memory["allocated"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: memory["peak"])
    cfg = QUICK_CONFIGS[0]
    built = build_torch_grouped_mm(cfg, make_weights(cfg, torch.float32, torch.device("cpu")))
    gib = 2**30
    allocate(5 * gib)  # the weights and inputs every method shares
    held = moe._allocated(torch.device("cuda"))
    allocate(sum(p.numel() * p.element_size() for p in built.module.parameters()))  # the layer's own weights
    allocate(gib)  # kept between steps

    def step() -> tuple:
        allocate(3 * gib)
        allocate(-3 * gib)
        return ()

    peak_gib, layer_gib = moe._memory_gib(step, torch.device("cuda"), held, built)
    assert (peak_gib, layer_gib) == (pytest.approx(3.0), pytest.approx(4.0))


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
