"""The result as a picture: TFLOP/s per shape, one bar per method and routing, a panel per pass."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from dropless.bench.report import LABELS, headline, index_rows, unique

HATCHES = {"skewed": "//", "all-to-one": "xx"}


def plot(result: dict, path: Path, labels: Mapping[str, str] = LABELS, title: str = "grouped GEMM") -> bool:
    """Write a PNG of ``result`` to ``path``, methods named by ``labels``; False (and nothing written)
    without matplotlib.

    Balanced routing is drawn solid, skewed and all-to-one hatched; a missing bar is a failed or raised case.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError:
        return False
    rows = result["rows"]
    at = index_rows(rows)
    shapes, routings = unique(rows, "shape"), unique(rows, "routing")
    passes, methods = unique(rows, "pass"), unique(rows, "method")
    colors = {m: f"C{i}" for i, m in enumerate(methods)}
    hatches = {r: HATCHES.get(r, "") for r in routings}
    bars = [(r, m) for r in routings for m in methods]
    width = 0.84 / len(bars)
    fig, axes = plt.subplots(len(passes), 1, figsize=(max(8.0, 2.0 * len(shapes) + 2), 3.0 * len(passes)),
                             squeeze=False, layout="constrained")
    for ax, pass_ in zip(axes[:, 0], passes):
        for k, (routing, method) in enumerate(bars):
            xs, heights = [], []
            for i, shape in enumerate(shapes):
                row = at.get((shape, routing, pass_, method))
                if row is not None and row["tflops"] is not None:
                    xs.append(i + (k - (len(bars) - 1) / 2) * width)
                    heights.append(row["tflops"])
            ax.bar(xs, heights, width, color=colors[method], hatch=hatches[routing], edgecolor="white",
                   linewidth=0.3)
        ax.set_title(pass_, fontsize=10, loc="left")
        ax.set_ylabel("TFLOP/s")
        ax.set_xticks(range(len(shapes)), shapes, fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    handles = [Patch(color=colors[m], label=labels.get(m, m)) for m in methods]
    handles += [Patch(facecolor="lightgray", hatch=hatches[r], edgecolor="white", label=r) for r in routings]
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=8)
    fig.suptitle(f"{title}, TFLOP/s of useful FLOPs\n{headline(result['meta'])}", fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
