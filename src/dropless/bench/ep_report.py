"""The expert-parallel benchmark's results for people: the bars judged, the stdout tables and the PNG."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dropless.bench.ep_exchange import PEERS
from dropless.bench.ep_layer import EP_METHODS, reference
from dropless.bench.report import optional, unique

BOTH = "dispatch+combine"


def _num(value: float | None) -> str:
    """A rate as shown: one decimal on a GPU, three significant digits for the tiny figures of CPU runs."""
    return optional(value, ".1f" if value is None or abs(value) >= 10 else ".3g")


def _at(rows: Sequence[dict], **match) -> dict | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def _dropless_bf16(methods: Sequence[str]) -> list[str]:
    """The dropless methods whose rows travel in their own dtype (the ones the bandwidth bars judge)."""
    return [m for m in methods if m.startswith("dropless_") and not m.endswith("_fp8")]


def judge_bars(result: dict) -> list[dict]:
    """The issue's bars on this run's balanced rows, one verdict per (bar, case, method or recipe):
    ``bar``, ``where``, ``value``, ``threshold``, ``met`` (None: the bar is not for this run's GPUs, or a
    figure is missing) and ``note``."""
    meta, rows = result["meta"], result["rows"]
    bars, world, gpu = meta["bars"], meta["world_size"], meta["gpu"]
    exchange = [r for r in rows if r["part"] == "exchange" and r["routing"] == "balanced" and r["pass"] == BOTH]
    layer = [r for r in rows if r["part"] == "layer" and r["routing"] == "balanced"]
    out = []
    on_gpus = not gpu.startswith("cpu")  # the bars are about GPUs: a CPU run shows its figures, unjudged
    judged_p = on_gpus and world in bars["vs_a2a_with_counts_gpus"]
    for case in unique(exchange, "case"):
        peer = _at(exchange, case=case, method="a2a_with_counts")
        for method in _dropless_bf16(unique(exchange, "method")):
            ours = _at(exchange, case=case, method=method)
            value = (ours["gbps_per_rank"] / peer["gbps_per_rank"]
                     if ours and peer and ours["gbps_per_rank"] and peer["gbps_per_rank"] else None)
            note = f"{_num(ours and ours['gbps_per_rank'])} vs {_num(peer and peer['gbps_per_rank'])} GB/s per rank"
            out.append({"bar": "vs_a2a_with_counts", "where": f"{case} {method}", "value": value,
                        "threshold": bars["vs_a2a_with_counts"],
                        "met": value >= bars["vs_a2a_with_counts"] if value is not None and judged_p else None,
                        "note": note if judged_p else f"{note}; the bar is for {bars['vs_a2a_with_counts_gpus']} GPUs, "
                                                      f"this run {world} x {gpu}"})
    judged_gbps = world == bars["gbps_gpus"] and bars["gbps_device"] in gpu
    for case in unique(exchange, "case"):
        for method in _dropless_bf16(unique(exchange, "method")):
            ours = _at(exchange, case=case, method=method)
            value = ours["gbps_per_rank"] if ours else None
            note = f"slowest rank {_num(ours and ours['gbps_slowest_rank'])} GB/s"
            out.append({"bar": "gbps_per_rank", "where": f"{case} {method}", "value": value,
                        "threshold": bars["gbps_per_rank"],
                        "met": value >= bars["gbps_per_rank"] if value is not None and judged_gbps else None,
                        "note": note if judged_gbps else f"{note}; the bar is for {bars['gbps_gpus']} "
                                                         f"{bars['gbps_device']}s, this run {world} x {gpu}"})
    judged_ws = on_gpus and world in bars["weak_scaling_gpus"]
    ep_methods = [m for m in unique(layer, "method") if m in EP_METHODS]
    for case, recipe, method in ((c, r, m) for c in unique(layer, "case") for r in unique(layer, "recipe")
                                 for m in ep_methods):
        ep = _at(layer, case=case, recipe=recipe, method=method)
        one = _at(layer, case=case, recipe=recipe, method=reference(method))
        value = ep["weak_scaling"] if ep else None
        note = (f"{optional(one and one['ms'], '.2f')} ms on one GPU, "
                f"{optional(ep and ep['ms'], '.2f')} ms on {world}")
        out.append({"bar": "weak_scaling", "where": f"{case} {recipe} {method}", "value": value,
                    "threshold": bars["weak_scaling"],
                    "met": value >= bars["weak_scaling"] if value is not None and judged_ws else None,
                    "note": note if judged_ws else f"{note}; the bar is for {bars['weak_scaling_gpus']} GPUs, "
                                                   f"this run {world} x {gpu}"})
    return out


_BAR_TITLES = {
    "vs_a2a_with_counts": "dispatch+combine GB/s per rank >= {t:g}x NCCL all_to_all_single with its count exchange",
    "gbps_per_rank": "dispatch+combine >= {t:g} GB/s per rank on 4 H200s",
    "weak_scaling": "EP layer weak-scaling efficiency (one-GPU ms / P-GPU ms) >= {t:g}",
}


def format_bars(result: dict) -> str:
    """The bars, one line per verdict: the figure, met / NOT MET / not judged, and what it rests on."""
    verdicts = result.get("bars") or judge_bars(result)
    lines = [f"bars ({result['meta']['world_size']} x {result['meta']['gpu']}, balanced routing):"]
    for bar in unique(verdicts, "bar"):
        mine = [v for v in verdicts if v["bar"] == bar]
        met = [v for v in mine if v["met"]]
        judged = [v for v in mine if v["met"] is not None]
        lines.append(f"  {_BAR_TITLES[bar].format(t=mine[0]['threshold'])}: "
                     + (f"met at {len(met)} of {len(judged)}" if judged else "not judged in this run"))
        for v in mine:
            status = "not judged" if v["met"] is None else ("met" if v["met"] else "NOT MET")
            value = _num(v["value"]) if bar == "gbps_per_rank" else optional(v["value"], ".2f")
            lines.append(f"    {v['where']:<34}{value:>9}  {status:<11} {v['note']}")
    if not verdicts:
        lines.append("  no balanced rows in this run")
    fp8 = _fp8_lines(result)
    return "\n".join(lines + fp8)


def _fp8_lines(result: dict) -> list[str]:
    """The FP8 dispatch beside the bars: its dispatch+combine time against a2a_with_counts' (it moves fewer
    bytes, so time, not GB/s, is what compares)."""
    dtype = result["meta"]["dtype"]
    rows = [r for r in result["rows"] if r["part"] == "exchange" and r["routing"] == "balanced" and r["pass"] == BOTH]
    lines = []
    for r in rows:
        if not r["method"].endswith("_fp8"):
            continue
        peer = _at(rows, case=r["case"], method="a2a_with_counts")
        if r["ms"] and peer and peer["ms"]:
            lines.append(f"  {r['case']} {r['method']}: dispatch+combine in {r['ms']:.3f} ms, "
                         f"{peer['ms'] / r['ms']:.2f}x as fast as a2a_with_counts ({peer['ms']:.3f} ms, {dtype} rows)")
    return ([f"FP8 dispatch (rowwise; combine in {dtype}), slowest rank's time:"] + lines) if lines else []


def format_tables(result: dict) -> str:
    """The exchange table (a line per case, routing, method and pass) and the layer table."""
    meta, rows = result["meta"], result["rows"]
    lines = [f"expert parallelism on {meta['world_size']} x {meta['gpu']} ({meta['process_group_backend']}), "
             f"torch {meta['torch']}, commit {meta['commit']}, {meta['date']}; dispatch backends: "
             + ", ".join(f"{b} {s}" for b, s in meta["backends"].items())]
    exchange = [r for r in rows if r["part"] == "exchange"]
    if exchange:
        lines += ["exchange, per rank (ms: the slowest rank's; GB/s: bytes sent to other ranks / time, mean over "
                  "ranks and slowest rank)",
                  f"{'case':<9}{'routing':<9}{'method':<22}{'pass':<18}{'wire':<13}{'ms':>9}{'GB/s':>9}"
                  f"{'slowest':>9}{'MB/rank':>10}{'max_err':>9}  status"]
        for r in exchange:
            mb = [b for b in r["bytes_per_rank"] if b is not None]
            status = "ok" if not r["failed"] else (r["error"] or "FAIL")
            lines.append(f"{r['case']:<9}{r['routing']:<9}{r['method']:<22}{r['pass']:<18}{r['wire'] or '':<13}"
                         f"{optional(r['ms'], '.3f'):>9}{_num(r['gbps_per_rank']):>9}{_num(r['gbps_slowest_rank']):>9}"
                         f"{_num(sum(mb) / len(mb) / 1e6 if mb else None):>10}"
                         f"{optional(r['max_rel_err'], '.1e'):>9}  {status[:70]}")
    layer = [r for r in rows if r["part"] == "layer"]
    if layer:
        lines += ["EP MoE layer fwd+bwd (ms: the slowest rank's; TFLOP/s: one GPU's useful expert-GEMM FLOPs; "
                  "rows: token copies per rank, min-max)",
                  f"{'case':<9}{'routing':<9}{'recipe':<9}{'method':<18}{'ms':>9}{'TFLOP/s':>9}{'weak':>7}"
                  f"{'rows/rank':>16}  status"]
        for r in layer:
            counts = [c for c in r["rows_per_rank"] if c is not None]
            span = f"{min(counts)}-{max(counts)}" if counts else "-"
            status = "ok" if not r["failed"] else (r["error"] or "FAIL")
            lines.append(f"{r['case']:<9}{r['routing']:<9}{r['recipe']:<9}{r['method']:<18}"
                         f"{optional(r['ms'], '.2f'):>9}"
                         f"{optional(r['tflops'], '.0f' if (r['tflops'] or 0) >= 10 else '.3g'):>9}"
                         f"{optional(r['weak_scaling'], '.2f'):>7}{span:>16}  {status[:70]}")
    return "\n".join(lines)


def plot(result: dict, path: Path) -> bool:
    """A PNG: dispatch, combine and both, GB/s per rank per method (one panel per case and routing), and the
    layer's ms on P GPUs and on one (labelled with the weak-scaling efficiency). False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["rows"]
    exchange = [r for r in rows if r["part"] == "exchange"]
    layer = [r for r in rows if r["part"] == "layer"]
    panels = [(c, rt) for c in unique(exchange, "case") for rt in unique(exchange, "routing")] if exchange else []
    count = len(panels) + (1 if layer else 0)
    if not count:
        return False
    fig, axes = plt.subplots(count, 1, figsize=(9.0, 3.0 * count), squeeze=False, layout="constrained")
    colors: dict[str, str] = {}
    for ax, (case, routing) in zip(axes[:, 0], panels):
        mine = [r for r in exchange if r["case"] == case and r["routing"] == routing]
        passes, methods = unique(mine, "pass"), unique(mine, "method")
        width = 0.84 / len(methods)
        for j, method in enumerate(methods):
            xs, heights = [], []
            for i, pass_ in enumerate(passes):
                r = _at(mine, method=method, **{"pass": pass_})
                if r and r["gbps_per_rank"]:
                    xs.append(i + (j - (len(methods) - 1) / 2) * width)
                    heights.append(r["gbps_per_rank"])
            ax.bar(xs, heights, width, color=colors.setdefault(method, f"C{len(colors)}"), label=method,
                   hatch="//" if method in PEERS else "", edgecolor="white", linewidth=0.3)
        ax.set_title(f"{case}, {routing} routing", fontsize=9, loc="left")
        ax.set_ylabel("GB/s per rank")
        ax.set_xticks(range(len(passes)), passes, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    if panels:
        axes[0, 0].legend(fontsize=7, ncol=len(colors), loc="lower center", bbox_to_anchor=(0.5, 1.12))
    if layer:
        ax = axes[-1, 0]
        groups = [(c, rt, rc) for c in unique(layer, "case") for rt in unique(layer, "routing")
                  for rc in unique(layer, "recipe")]
        methods = unique(layer, "method")
        width = 0.84 / len(methods)
        for j, method in enumerate(methods):
            xs, heights, labels = [], [], []
            for i, (case, routing, recipe) in enumerate(groups):
                r = _at(layer, case=case, routing=routing, recipe=recipe, method=method)
                if r and r["ms"]:
                    xs.append(i + (j - (len(methods) - 1) / 2) * width)
                    heights.append(r["ms"])
                    labels.append(optional(r["weak_scaling"], ".2f") if r["weak_scaling"] else "")
            bars = ax.bar(xs, heights, width, color=f"C{j}", label=method)
            ax.bar_label(bars, labels, fontsize=7, padding=1)
        ax.set_title("EP MoE layer fwd+bwd, bar labels: weak-scaling efficiency", fontsize=9, loc="left")
        ax.set_ylabel("ms (slowest rank)")
        ax.set_xticks(range(len(groups)), [" ".join(g) for g in groups], fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=7)
    meta = result["meta"]
    fig.suptitle(f"expert parallelism, {meta['world_size']} x {meta['gpu']}, torch {meta['torch']}, "
                 f"commit {meta['commit']}, {meta['date']}", fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
