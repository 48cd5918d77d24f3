"""The MoE layer benchmark's results for people: the stdout table, the PNG and the README block."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dropless.bench import readme
from dropless.bench.report import headline, optional, unique

MOE_START = "<!-- moe-table:start -->"
MOE_END = "<!-- moe-table:end -->"
LABELS = {"dense": "dense mm", "dropless": "dropless.MoE", "dropless_recompute": "dropless.MoE, recompute_activation",
          "dropless_recompute_all": "dropless.MoE, recompute_activation + recompute_permute",
          "torch_grouped_mm": "torch._grouped_mm layer",
          "hf_grouped_mm": "transformers grouped_mm", "hf_eager": "transformers eager",
          "hf_dropless": "transformers + dropless", "dropless_rowwise": "dropless.MoE FP8 rowwise",
          "dropless_block128": "dropless.MoE FP8 block128", "dropless_mxfp8": "dropless.MoE FP8 mxfp8"}
# The issue's bar: dropless.MoE's own memory at most this share of the torch._grouped_mm layer's, at each config.
LAYER_MEMORY_BAR = 0.75


def _tflops(row: dict) -> str:
    if row["tflops"] is None:
        return "ERR" if row["error"] else ("FAIL" if row["failed"] else "-")
    return f"{row['tflops']:.0f}" if row["tflops"] >= 10 else f"{row['tflops']:.3g}"


def _speedup(row: dict, rows: Sequence[dict]) -> float | None:
    """How many times faster dropless.MoE ran than ``row``'s method on the same config."""
    dl = next((r for r in rows if r["config"] == row["config"] and r["method"] == "dropless"), None)
    if dl is None or dl["ms"] is None or row["ms"] is None or row["method"] == "dense":
        return None
    return row["ms"] / dl["ms"]


def config_label(result: dict, row: dict) -> str:
    info = result["meta"].get("configs", {}).get(row["config"], {})
    shared = f", shared {row['shared_d_ff']}" if row["shared_d_ff"] else ""
    return (f"{info.get('label', row['config'])} (T={row['T']}, E={row['E']}, k={row['k']}, d={row['d']}, "
            f"d_ff={row['d_ff']}{shared})")


def _own_gib(row: dict | None) -> float | None:
    """The layer's own memory: its step's peak above the weights and inputs (``layer_gib``) less the
    gradients the step returns (``grad_gib``), which every method makes alike."""
    if row is None or row.get("layer_gib") is None or row.get("grad_gib") is None:
        return None
    return row["layer_gib"] - row["grad_gib"]


def layer_memory_ratios(rows: Sequence[dict]) -> dict[str, float]:
    """Per config: dropless.MoE's own memory (``_own_gib``; the smallest of the plain layer and its
    recompute options, of those run) over the torch._grouped_mm layer's, where both were measured."""
    at = {(r["config"], r["method"]): r for r in rows}
    out = {}
    for config in unique(rows, "config"):
        ours = [m for m in (_own_gib(at.get((config, name))) for name in ("dropless", "dropless_recompute",
                                                                             "dropless_recompute_all"))
                if m is not None]
        peer = _own_gib(at.get((config, "torch_grouped_mm")))
        if ours and peer:
            out[config] = min(ours) / peer
    return out


def format_layer_memory_bar(rows: Sequence[dict]) -> str:
    """One line: at how many configs dropless.MoE's own memory is within the bar of the torch._grouped_mm
    layer's, the highest ratio, and each config's ratio (with the gradients' GiB both count)."""
    line = (f"bar layer memory: dropless.MoE <= {LAYER_MEMORY_BAR:g}x the torch._grouped_mm layer's own memory "
            "(layer_gib - grad_gib): ")
    ratios = layer_memory_ratios(rows)
    if not ratios:
        return line + "not measured in this run (layer_gib is measured on CUDA only)"
    grads = {r["config"]: r.get("grad_gib") for r in rows if r["method"] == "dropless"}
    worst = max(ratios, key=ratios.__getitem__)
    each = ", ".join(f"{c} {v:.2f}" + (f" (gradients {grads[c]:.2f} GiB)" if grads.get(c) is not None else "")
                     for c, v in ratios.items())
    met = sum(v <= LAYER_MEMORY_BAR for v in ratios.values())
    return line + f"met at {met} of {len(ratios)}, highest {ratios[worst]:.2f} ({worst}); {each}"


def format_table(result: dict) -> str:
    """One line per config and method: ms, TFLOP/s, fraction of dense, peak GiB, the layer's own GiB,
    error, and how many times faster dropless.MoE was; then the layer-memory bar."""
    rows = result["rows"]
    head = (f"{'config':<10}{'method':<18}{'ms':>10}{'TFLOP/s':>9}{'of dense':>9}{'peak GiB':>10}{'layer GiB':>10}"
            f"{'max_rel_err':>12}{'dl speedup':>11}  status")
    lines = [f"MoE layer fwd+bwd, useful GEMM TFLOP/s: {headline(result['meta'])}",
             "FAIL = result off the reference, ERR = raised; dl speedup = this method's ms / dropless's", head]
    for config in unique(rows, "config"):
        for r in (r for r in rows if r["config"] == config):
            status = "ok" if not r["failed"] else (r["error"] or f"FAIL (err {optional(r['max_rel_err'], '.2e')})")
            lines.append(f"{config:<10}{r['method']:<18}{optional(r['ms'], '.3f'):>10}{_tflops(r):>9}"
                         f"{optional(r['fraction_of_dense'], '.2f'):>9}{optional(r['peak_gib'], '.2f'):>10}"
                         f"{optional(r.get('layer_gib'), '.2f'):>10}{optional(r['max_rel_err'], '.1e'):>12}"
                         f"{optional(_speedup(r, rows), '.2f'):>11}  {status[:70]}")
    return "\n".join([*lines, format_layer_memory_bar(rows)])


def plot(result: dict, path: Path) -> bool:
    """A PNG: TFLOP/s per config, one bar per method, each labelled with its fraction of dense; a
    missing bar is a failed or raised method. False (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = result["rows"]
    configs, methods = unique(rows, "config"), unique(rows, "method")
    at = {(r["config"], r["method"]): r for r in rows}
    width = 0.84 / len(methods)
    fig, ax = plt.subplots(figsize=(max(8.0, 3.0 * len(configs) + 2), 4.2), layout="constrained")
    for j, method in enumerate(methods):
        xs, heights, labels = [], [], []
        for i, config in enumerate(configs):
            row = at.get((config, method))
            if row is not None and row["tflops"] is not None:
                xs.append(i + (j - (len(methods) - 1) / 2) * width)
                heights.append(row["tflops"])
                labels.append(optional(row["fraction_of_dense"], ".2f"))
        bars = ax.bar(xs, heights, width, color=f"C{j}", label=LABELS.get(method, method))
        ax.bar_label(bars, labels, fontsize=6, padding=1)
    ax.set_ylabel("TFLOP/s (useful GEMM FLOPs, fwd+bwd)")
    ax.set_xticks(range(len(configs)), configs)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=3, loc="upper right")
    fig.suptitle(f"MoE layer forward+backward, bar labels: fraction of dense\n{headline(result['meta'])}",
                 fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def render_table(result: dict, source: str) -> str:
    """Markdown: a line naming the run, then one row per config and method; the layer's own memory
    (``layer_gib``) where the run measured it (result files from before it have no such column)."""
    rows = result["rows"]
    layer = any("layer_gib" in r for r in rows)
    head = ["layer", "method", "ms", "TFLOP/s", "of dense", "peak GiB", *(["layer GiB"] if layer else []),
            "dropless speedup"]
    about_layer = (" \"layer GiB\": the peak above what the weights and inputs hold (activations saved for the "
                   "backward, workspace and the step's gradients)." if layer else "")
    lines = [f"Measured on {headline(result['meta'])} (`{source}`). Whole MoE layer (router included), forward "
             "and backward on the same weights and tokens; TFLOP/s of the useful expert-GEMM FLOPs "
             "(`3 * T * k * 6 * d * d_ff`, plus the shared experts'); \"of dense\" over a torch.mm of the same "
             f"FLOPs timed in the same run; speedup = that method's time over dropless.MoE's.{about_layer}", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for config in unique(rows, "config"):
        for n, r in enumerate(r for r in rows if r["config"] == config and r["method"] != "dense"):
            cells = [config_label(result, r) if n == 0 else "", LABELS.get(r["method"], r["method"]),
                     optional(r["ms"], ".1f"), _tflops(r), optional(r["fraction_of_dense"], ".2f"),
                     optional(r["peak_gib"], ".1f")]
            cells += [optional(r.get("layer_gib"), ".1f")] if layer else []
            cells.append(optional(_speedup(r, rows), ".2f"))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render(results: Sequence[tuple[str, dict]]) -> str:
    """The README block for several ``(source name, result)`` pairs, one table each."""
    return "\n\n".join(render_table(result, source) for source, result in results)


def is_moe_result(result: dict) -> bool:
    """True for a result file of this benchmark (its rows are by config, not by GEMM shape)."""
    return bool(result["rows"]) and "config" in result["rows"][0] or result["meta"].get("benchmark") == "moe"


def update_readme(path: Path, block: str) -> bool:
    """Write ``block`` between ``MOE_START`` and ``MOE_END`` of the README at ``path``; False (and
    nothing written) if it has no such markers in order."""
    return readme.update_readme(path, block, MOE_START, MOE_END)
