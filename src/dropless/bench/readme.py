"""The README's performance table, generated from result files (never typed by hand)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from dropless.bench.report import (LABELS, RATIO_PEERS, headline, index_rows, ratio, ratio_cell, tflops_cell,
                                   timed_optional_peers, unique)

START = "<!-- perf-table:start -->"
END = "<!-- perf-table:end -->"
TABLE_PASSES = ("fwd", "fwd+bwd")
TABLE_METHODS = ("dense", "dropless", "torch_grouped_mm", "loop")


def render_table(result: dict, source: str) -> str:
    """Markdown: a line naming the run, then one table row per shape and routing it ran under, with
    the TFLOP/s of dense, dropless, ``torch._grouped_mm`` and the loop (those the run has, and quack
    where it timed it) for fwd and fwd+bwd, and dropless's ratios to dense, to ``torch._grouped_mm``
    (and to quack): all of one run, so the ratios compare like with like."""
    rows = result["rows"]
    at = index_rows(rows)
    extra = timed_optional_peers(rows)
    run = {r["method"] for r in rows}
    methods, peers = tuple(m for m in TABLE_METHODS if m in run) + extra, RATIO_PEERS + extra
    head = ["shape (E, M, K, N)", "routing"]
    for pass_ in TABLE_PASSES:
        head += [f"{pass_} {LABELS[m]}" for m in methods]
        head += [f"{pass_} dropless/{LABELS[m]}" for m in peers]
    named = ["the dense GEMM", "torch._grouped_mm", *extra]
    lines = [f"Measured on {headline(result['meta'])} (`{source}`). TFLOP/s of useful FLOPs "
             f"(2MKN per GEMM, 6MKN for fwd+bwd); ratios are to {', '.join(named[:-1])} and to {named[-1]}, "
             "timed in the same run.", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape in unique(rows, "shape"):
        first = next(r for r in rows if r["shape"] == shape)
        label = f"{shape} ({first['E']}, {first['M']}, {first['K']}, {first['N']})"
        for routing in unique([r for r in rows if r["shape"] == shape], "routing"):
            cells = [label, routing]
            for pass_ in TABLE_PASSES:
                get = {m: at.get((shape, routing, pass_, m)) for m in (*methods, *peers)}
                cells += [tflops_cell(get[m]) for m in methods]
                cells += [ratio_cell(ratio(get["dropless"], get[m])) for m in peers]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render(results: Sequence[tuple[str, dict]]) -> str:
    """The generated block for several ``(source name, result)`` pairs, one table each."""
    return "\n\n".join(render_table(result, source) for source, result in results)


def replace_between_markers(text: str, block: str, start_marker: str = START, end_marker: str = END) -> str | None:
    """``text`` with everything between ``start_marker`` and ``end_marker`` (the GEMM table's by default)
    replaced by ``block``; None if the markers are missing or out of order."""
    start, end = text.find(start_marker), text.find(end_marker)
    if start < 0 or end < start:
        return None
    return f"{text[:start + len(start_marker)]}\n{block}\n{text[end:]}"


def update_readme(path: Path, block: str, start_marker: str = START, end_marker: str = END) -> bool:
    """Write ``block`` between the markers of the README at ``path``; False (and nothing written) if it
    has none in order."""
    if not path.is_file():
        return False
    text = replace_between_markers(path.read_text(), block, start_marker, end_marker)
    if text is None:
        return False
    path.write_text(text)
    return True
