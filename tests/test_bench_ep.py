"""The expert-parallel benchmark's quick run on 2 gloo CPU processes, started by torchrun as users start
it: the JSON (written by rank 0 alone) has every method in both directions and their sum, positive
bandwidths and the layer rows with their weak-scaling efficiency; one process, where no byte crosses;
the bars judged on made-up rows; the routing draws."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dropless.bench.__main__ import main
from dropless.bench.ep import BARS
from dropless.bench.ep_exchange import PASSES, QUICK_CASES
from dropless.bench.ep_layer import layer_methods
from dropless.bench.ep_layer import QUICK_CONFIGS, RECIPES
from dropless.bench.ep_report import format_bars, judge_bars
from dropless.bench.routing import draw_topk

TORCHRUN = shutil.which("torchrun") or str(Path(sys.executable).with_name("torchrun"))
METHODS = ["dropless_nccl", "dropless_symmetric_memory", "dropless_nccl_fp8", "dropless_symmetric_memory_fp8",
           "a2a_with_counts", "a2a_data_only"]
FP8_METHODS = [m for m in METHODS if m.endswith("_fp8")]
BOTH = "dispatch+combine"
WORLD = 2


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    if not Path(TORCHRUN).exists():
        pytest.skip("needs torchrun")
    out = tmp_path_factory.mktemp("bench_ep")
    command = [TORCHRUN, "--nproc-per-node", str(WORLD), "--master-port", str(random.randint(20000, 60000)), "-m",
               "dropless.bench", "ep", "--quick", "--fp8", "--rounds", "1", "--out", str(out), "--name", "quick"]
    run = subprocess.run(command, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads((out / "quick.json").read_text()), run.stdout, out


def test_exchange_rows_every_method_both_directions(quick_run):
    result, _, _ = quick_run
    meta = result["meta"]
    assert meta["benchmark"] == "ep" and meta["quick"] and meta["world_size"] == WORLD
    assert meta["process_group_backend"] == "gloo" and meta["devices"] == [meta["gpu"]] * WORLD
    assert meta["gpu"].startswith("cpu")
    assert meta["backends"] == {"nccl": "ok", "symmetric_memory": "ok"}
    assert meta["methods"] == METHODS
    assert {"gpu", "torch", "triton", "commit", "date", "timing", "bytes", "bars"} <= set(meta)
    rows = [r for r in result["rows"] if r["part"] == "exchange"]
    assert sorted((r["case"], r["method"], r["pass"]) for r in rows) == sorted(
        (c.name, m, p) for c in QUICK_CASES for m in METHODS for p in (*PASSES, BOTH))
    at = {(r["case"], r["method"], r["pass"]): r for r in rows}
    for r in rows:
        assert not r["failed"] and r["error"] is None, r
        assert r["gpus"] == WORLD and len(r["ms_per_rank"]) == WORLD and r["ms"] == max(r["ms_per_rank"])
        assert r["gbps_per_rank"] > 0 and 0 < r["gbps_slowest_rank"] <= r["gbps_per_rank"]
        assert all(b > 0 for b in r["bytes_per_rank"])
        if r["pass"] == BOTH:
            d, c = at[r["case"], r["method"], "dispatch"], at[r["case"], r["method"], "combine"]
            assert r["bytes_per_rank"] == [a + b for a, b in zip(d["bytes_per_rank"], c["bytes_per_rank"])]
            assert r["ms_per_rank"] == pytest.approx([a + b for a, b in zip(d["ms_per_rank"], c["ms_per_rank"])])
        elif r["method"] in FP8_METHODS and r["pass"] == "dispatch":
            assert 0 < r["max_rel_err"] <= meta["fp8_tolerance"] and r["wire"] == "fp8 rowwise"
        else:
            assert r["max_rel_err"] <= meta["tolerance"]
    for case in QUICK_CASES:
        # Every method moves the same rows; FP8 rows are about a quarter of fp32 ones (plus a scale).
        for pass_ in PASSES:
            sent = {m: at[case.name, m, pass_]["bytes_per_rank"] for m in METHODS if m not in FP8_METHODS}
            assert len({tuple(b) for b in sent.values()}) == 1
        for method in FP8_METHODS:
            fp8, fp32 = at[case.name, method, "dispatch"], at[case.name, "dropless_nccl", "dispatch"]
            assert [b * (case.d + 4) for b in fp32["bytes_per_rank"]] == [b * 4 * case.d
                                                                           for b in fp8["bytes_per_rank"]]


def test_layer_rows_and_weak_scaling(quick_run):
    result, _, _ = quick_run
    rows = [r for r in result["rows"] if r["part"] == "layer"]
    assert sorted((r["case"], r["method"], r["recipe"]) for r in rows) == sorted(
        (c.name, m, rc) for c in QUICK_CONFIGS for m in layer_methods(graphs=False) for rc in RECIPES)
    at = {(r["method"], r["recipe"]): r for r in rows}
    cfg = QUICK_CONFIGS[0]
    for r in rows:
        assert not r["failed"] and r["ms"] > 0 and r["tflops"] > 0 and r["pass"] == "layer_fwd+bwd", r
    for recipe, method in ((r, m) for r in RECIPES for m in ("dropless_ep", "dropless_ep_symmetric_memory")):
        ep, one = at[method, recipe], at["dropless_one_gpu", recipe]
        assert ep["weak_scaling"] == pytest.approx(one["ms"] / ep["ms"]) and one["weak_scaling"] is None
        # The same token copies per GPU: exactly T*k on one GPU, T*k on average over the EP ranks.
        assert one["rows_per_rank"] == [cfg.T * cfg.k] * WORLD and sum(ep["rows_per_rank"]) == WORLD * cfg.T * cfg.k


def test_rank_zero_writes_and_prints_the_bars_last(quick_run):
    result, stdout, out = quick_run
    assert stdout.count("wrote ") == 2 and sorted(p.name for p in out.iterdir())[0] == "quick.json"
    # The tables, then the bars last (the FP8 dispatch's line closing them).
    assert stdout.index("EP MoE layer fwd+bwd") < stdout.index(f"bars (2 x {result['meta']['gpu']}, balanced routing):")
    assert "dropless_symmetric_memory_fp8: dispatch+combine in" in stdout.rstrip().splitlines()[-1]
    # A CPU run shows the bars' figures without judging them (they are about GPUs).
    assert {v["bar"] for v in result["bars"]} == {"vs_a2a_with_counts", "gbps_per_rank", "weak_scaling"}
    assert all(v["met"] is None and v["value"] > 0 for v in result["bars"])


def test_one_process(tmp_path):
    """Plain ``python -m dropless.bench ep``: a group of one process, where no byte crosses ranks."""
    assert main(["ep", "--quick", "--parts", "exchange", "--cases", "mixtral", "--backends", "nccl", "--rounds", "1",
                 "--out", str(tmp_path), "--name", "one"]) == 0
    result = json.loads((tmp_path / "one.json").read_text())
    assert result["meta"]["world_size"] == 1 and result["meta"]["backends"] == {"nccl": "ok"}
    assert {r["method"] for r in result["rows"]} == {"dropless_nccl", "a2a_with_counts", "a2a_data_only"}
    for r in result["rows"]:
        assert not r["failed"] and r["ms"] > 0 and r["bytes_per_rank"] == [0] and r["gbps_per_rank"] is None


def test_unknown_names_are_errors(tmp_path):
    assert main(["ep", "--quick", "--cases", "nope", "--out", str(tmp_path)]) == 2
    assert main(["ep", "--quick", "--routing", "all-to-one", "--out", str(tmp_path)]) == 2
    assert not list(tmp_path.iterdir())


def _result(world: int, gpu: str, ours: float, peer: float, weak: float) -> dict:
    exchange = [{"part": "exchange", "routing": "balanced", "pass": BOTH, "case": "deepep", "method": method,
                 "gbps_per_rank": gbps, "gbps_slowest_rank": gbps * 0.9, "ms": 1.0}
                for method, gbps in (("dropless_nccl", ours), ("a2a_with_counts", peer), ("a2a_data_only", peer))]
    layer = [{"part": "layer", "routing": "balanced", "case": "dsv3", "recipe": "bf16", "method": "dropless_ep",
              "ms": 10.0, "weak_scaling": weak},
             {"part": "layer", "routing": "balanced", "case": "dsv3", "recipe": "bf16", "method": "dropless_one_gpu",
              "ms": 10.0 * weak, "weak_scaling": None}]
    return {"meta": {"bars": BARS, "world_size": world, "gpu": gpu, "dtype": "bfloat16"}, "rows": exchange + layer}


def test_bars_judged_where_they_apply():
    verdicts = {v["bar"]: v for v in judge_bars(_result(4, "NVIDIA H200", 400.0, 300.0, 0.9))}
    assert verdicts["vs_a2a_with_counts"]["value"] == pytest.approx(400 / 300) and verdicts["vs_a2a_with_counts"]["met"]
    assert verdicts["gbps_per_rank"]["met"] and verdicts["weak_scaling"]["met"]
    verdicts = {v["bar"]: v for v in judge_bars(_result(2, "NVIDIA H100 80GB HBM3", 250.0, 230.0, 0.8))}
    assert verdicts["vs_a2a_with_counts"]["met"] is False and verdicts["weak_scaling"]["met"] is False
    assert verdicts["gbps_per_rank"]["met"] is None  # 350 GB/s is the bar on 4 H200s only
    text = format_bars(_result(2, "NVIDIA H100 80GB HBM3", 250.0, 230.0, 0.8))
    assert "NOT MET" in text and "not judged" in text
    assert all(v["met"] is None for v in judge_bars(_result(8, "NVIDIA H200", 400.0, 300.0, 0.9)))


def test_graph_replayed_layers_weighed_against_the_graph_replayed_reference():
    """A CUDA run also times the symmetric-memory layer and the one-GPU reference as graph replays; each EP
    method's weak scaling is over the reference timed the same way."""
    assert layer_methods(graphs=True) == ("dropless_ep", "dropless_ep_symmetric_memory",
                                          "dropless_ep_symmetric_memory_graph", "dropless_one_gpu",
                                          "dropless_one_gpu_graph")
    result = _result(4, "NVIDIA H200", 400.0, 300.0, 0.8)
    result["rows"] += [{"part": "layer", "routing": "balanced", "case": "dsv3", "recipe": "bf16", "method": method,
                        "ms": ms, "weak_scaling": weak}
                       for method, ms, weak in (("dropless_ep_symmetric_memory_graph", 9.0, 0.9),
                                                ("dropless_one_gpu_graph", 8.1, None))]
    verdicts = {v["where"]: v for v in judge_bars(result) if v["bar"] == "weak_scaling"}
    assert set(verdicts) == {"dsv3 bf16 dropless_ep", "dsv3 bf16 dropless_ep_symmetric_memory_graph"}
    assert verdicts["dsv3 bf16 dropless_ep"]["met"] is False and "8.00 ms on one GPU" in verdicts["dsv3 bf16 dropless_ep"]["note"]
    graph = verdicts["dsv3 bf16 dropless_ep_symmetric_memory_graph"]
    assert graph["met"] and "8.10 ms on one GPU, 9.00 ms on 4" in graph["note"]


def test_draw_topk():
    ids = draw_topk(512, 16, 4, "balanced", 0, 1)
    assert ids.shape == (512, 4) and ids.dtype == torch.int64 and 0 <= ids.min() and ids.max() < 16
    assert (ids.sort(dim=1).values.diff(dim=1) > 0).all()  # k distinct experts per token
    assert torch.equal(ids, draw_topk(512, 16, 4, "balanced", 0, 1))
    assert not torch.equal(ids, draw_topk(512, 16, 4, "balanced", 0, 2))
    counts = torch.bincount(ids.flatten(), minlength=16)
    assert counts.min() > 0.6 * 128 and counts.max() < 1.4 * 128
    skewed = [torch.bincount(draw_topk(512, 16, 4, "skewed", 0, s).flatten(), minlength=16) for s in (1, 2)]
    assert torch.equal(skewed[0] == 0, skewed[1] == 0) and int((skewed[0] == 0).sum()) == 2  # ceil(16 / 8) empty
    assert skewed[0].argmax() == skewed[1].argmax() and skewed[0].max() > 2 * 128  # the same popular expert
    with pytest.raises(ValueError, match="distinct"):
        draw_topk(8, 8, 8, "skewed", 0, 1)
