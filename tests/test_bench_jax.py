"""The JAX benchmark's quick run on both backends (the kernels under Triton's interpreter on the CPU):
files written, one checked and timed row per method, shape, routing and pass; its bars; JAX kept out of
every other command; and the jax-train benchmark's quick run (both training steps checked and timed on
the same weights and batches)."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
import torch

pytest.importorskip("jax")

import dropless  # noqa: E402
from dropless.bench.__main__ import main  # noqa: E402
from dropless.bench.jax_peers import JAX_METHODS  # noqa: E402
from dropless.bench.jax_report import BARS, LABELS, PASSES, format_bar  # noqa: E402
from dropless.bench.routing import ROUTINGS  # noqa: E402
from dropless.bench.shapes import QUICK_SHAPES  # noqa: E402

JAX_KEYS = {"jax", "jaxlib", "jax_plugins", "jax_platform", "jax_device", "dropless_jax_backend", "xla_memory"}


@pytest.fixture(scope="module", params=["reference", "triton"])
def quick_run(request, tmp_path_factory):
    dropless.set_backend(request.param)
    try:
        out = tmp_path_factory.mktemp(f"bench_jax_{request.param}")
        assert main(["jax", "--quick", "--rounds", "1", "--out", str(out), "--name", "quick"]) == 0
    finally:
        dropless.set_backend("auto")
    return request.param, out


def test_quick_jax_rows_checked_and_timed(quick_run):
    backend, out = quick_run
    result = json.loads((out / "quick.json").read_text())
    meta, rows = result["meta"], result["rows"]
    assert JAX_KEYS <= set(meta) and meta["quick"] and meta["xla_memory"]["XLA_PYTHON_CLIENT_PREALLOCATE"]
    assert meta["dropless_jax_backend"] == ("kernels" if backend == "triton" else "jax.lax.ragged_dot")
    assert [(r["shape"], r["routing"], r["method"], r["pass"]) for r in rows] == [
        (s.name, routing, m, p) for s in QUICK_SHAPES for routing in ROUTINGS for m in LABELS for p in PASSES]
    at = {(r["shape"], r["routing"], r["method"], r["pass"]): r for r in rows}
    for r in rows:
        assert not r["failed"] and r["error"] is None, r
        assert 0 <= r["max_rel_err"] <= meta["tolerance"]
        assert r["ms"] == statistics.median(r["ms_rounds"]) and r["tflops"] > 0
        for peer in ("dense", "dropless", "jax_ragged_dot"):
            other = at[(r["shape"], r["routing"], peer, r["pass"])]
            assert r[f"ratio_to_{peer}"] == pytest.approx(r["tflops"] / other["tflops"])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "quick.png").stat().st_size > 0


def test_methods_in_the_tables_order():
    assert list(JAX_METHODS) == list(LABELS)


def _row(shape: str, method: str, pass_: str, tflops: float | None) -> dict:
    return {"shape": shape, "routing": "balanced", "method": method, "pass": pass_, "tflops": tflops}


def test_bar_leaves_out_rows_whose_peer_failed_and_misses_where_dropless_jax_failed():
    fwd_vs_lax = next(b for b in BARS if b.pass_ == "fwd" and b.peer == "jax_ragged_dot")
    rows = [_row("a", "dropless_jax", "fwd", 400.0), _row("a", "jax_ragged_dot", "fwd", 100.0),
            _row("b", "dropless_jax", "fwd", 200.0), _row("b", "jax_ragged_dot", "fwd", 100.0),
            _row("c", "dropless_jax", "fwd", 300.0), _row("c", "jax_ragged_dot", "fwd", None),
            _row("d", "dropless_jax", "fwd", None), _row("d", "jax_ragged_dot", "fwd", 100.0)]
    line = format_bar(rows, fwd_vs_lax)
    assert "met on 1 of 3 rows, lowest 0.00 (d balanced)" in line
    assert line.endswith("lax.ragged_dot failed on c balanced")


def test_other_commands_do_not_import_jax():
    code = "import sys, dropless.bench.__main__; sys.exit('jax' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == 0


def test_quick_jax_train_times_both_steps_on_the_same_weights_and_data(tmp_path):
    from dropless.bench.jax_train import LOGITS_TOL, METHODS

    assert main(["jax-train", "--quick", "--out", str(tmp_path), "--name", "quick"]) == 0
    result = json.loads((tmp_path / "quick.json").read_text())
    meta, rows = result["meta"], result["rows"]
    assert JAX_KEYS <= set(meta) and meta["quick"] and meta["preset"] == "tiny"
    assert [r["method"] for r in rows] == list(METHODS)
    for r in rows:
        assert r["error"] is None and not r["failed"], r
        assert r["tokens_per_s"] > 0 and r["ms"] == statistics.median(r["ms_rounds"])
        assert r["max_rel_err"] <= LOGITS_TOL[torch.float32] and r["loss"] < r["first_loss"]
    jax_row, torch_row = rows
    assert jax_row["ratio_to_dropless"] == pytest.approx(jax_row["tokens_per_s"] / torch_row["tokens_per_s"])
    # The same weights and batches in fp32: the same losses, step for step.
    assert jax_row["first_loss"] == pytest.approx(torch_row["first_loss"], rel=1e-5)
    assert jax_row["loss"] == pytest.approx(torch_row["loss"], rel=1e-3)
