"""What a run leaves behind: the loss curve and expert-load pictures, and the summary."""

from __future__ import annotations

import json
from pathlib import Path


def load_balance(load: list[list[int]]) -> float:
    """Max over mean token copies per expert, averaged over layers: 1.0 is a perfect balance, ``E`` all
    tokens on one expert. ``load``: ``[n_layers][num_experts]`` counts."""
    ratios = [max(row) * len(row) / sum(row) for row in load if sum(row) > 0]
    return sum(ratios) / len(ratios) if ratios else float("nan")


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend, None without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_loss_curve(history: list[dict], path: Path, title: str) -> bool:
    """Training loss (mean of each logged interval) and held-out loss against the step; False
    (nothing written) without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], label="training")
    held_out = [h for h in history if "held_out_loss" in h]
    ax.plot([h["step"] for h in held_out], [h["held_out_loss"] for h in held_out], "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def plot_expert_load(history: list[dict], path: Path, title: str) -> bool:
    """Left: each layer's share of token copies per expert over the last logged interval. Right: each
    layer's max/mean expert load against the step. False (nothing written) without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    last = history[-1]["load"]
    layers, experts = len(last), len(last[0])
    share = [[100 * n / max(1, sum(row)) for n in row] for row in last]
    fig, (heat, lines) = plt.subplots(1, 2, figsize=(11, 0.45 * layers + 3), layout="constrained",
                                      gridspec_kw={"width_ratios": [max(experts, 4), 6]})
    image = heat.imshow(share, cmap="viridis", aspect="auto", vmin=0)
    bright = 0.6 * max(map(max, share))
    for layer in range(layers):
        for expert in range(experts):
            value = share[layer][expert]
            heat.text(expert, layer, f"{value:.0f}", ha="center", va="center", fontsize=7,
                      color="k" if value > bright else "w")
    heat.set_xticks(range(experts))
    heat.set_yticks(range(layers))
    heat.set_xlabel("expert")
    heat.set_ylabel("layer")
    first = history[-2]["step"] + 1 if len(history) > 1 else 1
    heat.set_title(f"% of token copies, steps {first}-{history[-1]['step']} (balanced: {100 / experts:.1f})",
                   fontsize=9)
    fig.colorbar(image, ax=heat, shrink=0.8)
    steps = [h["step"] for h in history]
    for layer in range(layers):
        lines.plot(steps, [load_balance([h["load"][layer]]) for h in history], lw=0.8, label=f"layer {layer}")
    lines.plot(steps, [h["load_balance"] for h in history], "k", lw=2, label="mean")
    lines.set_xlabel("step")
    lines.set_ylabel("max / mean tokens per expert")
    lines.grid(alpha=0.3)
    lines.legend(fontsize=7, ncol=2)
    fig.suptitle(title, fontsize=9)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def format_summary(summary: dict) -> str:
    """The end-of-run lines a person reads."""
    mfu = summary.get("mfu")
    held_out = summary.get("held_out_loss")
    lines = [
        f"trained {summary['preset']} to step {summary['step']} on {summary['device']}"
        + (f" x {summary['world_size']}" if summary["world_size"] > 1 else "")
        + f" in {summary['wall_s']:.0f} s",
        f"loss {summary['first_loss']:.3f} -> {summary['loss']:.3f}"
        + (f", held-out {held_out:.3f}" if held_out is not None else ""),
        f"{summary['tokens_per_s']:,.0f} tokens/s"
        + (f", MFU {100 * mfu:.1f}% of bf16 peak" if mfu is not None else ""),
        f"expert load max/mean {summary['load_balance']:.2f} (1.00 is balanced)",
    ]
    lines += [f"wrote {path}" for path in summary["files"]]
    return "\n".join(lines)


def write_summary(summary: dict, path: Path) -> None:
    """``summary`` as indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")
