"""Turning result rows into what people read: the stdout table, the summary, the JSON file."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

LABELS = {"dense": "dense", "dropless": "dropless", "torch_grouped_mm": "_grouped_mm", "loop": "loop",
          "padded_bmm": "padded_bmm", "quack": "quack"}

Key = tuple[str, str, str, str]  # shape, routing, pass, method
RATIO_PEERS = ("dense", "torch_grouped_mm")  # what dropless is always compared with
OPTIONAL_PEERS = ("quack",)  # compared with where a run timed them
# A decode-size GEMM: at most this many rows per expert on average (M <= 16 E).
DECODE_ROWS_PER_EXPERT = 16


def index_rows(rows: Sequence[dict]) -> dict[Key, dict]:
    """Rows by (shape, routing, pass, method)."""
    return {(r["shape"], r["routing"], r["pass"], r["method"]): r for r in rows}


def unique(rows: Sequence[dict], key: str) -> list[str]:
    """The values of ``key`` in the rows, in order of first appearance."""
    return list(dict.fromkeys(r[key] for r in rows))


def tflops_cell(row: dict | None) -> str:
    """A row's TFLOP/s as shown: a number, ``FAIL`` (wrong result), ``ERR`` (raised) or ``-`` (not run)."""
    if row is None:
        return "-"
    if row["tflops"] is None:
        return "ERR" if row["error"] else "FAIL"
    # Whole TFLOP/s on a GPU; three significant digits for the tiny figures of CPU smoke runs.
    return f"{row['tflops']:.0f}" if row["tflops"] >= 10 else f"{row['tflops']:.3g}"


def ratio(num: dict | None, den: dict | None) -> float | None:
    """TFLOP/s of ``num`` over that of ``den``, None unless both were timed."""
    if num is None or den is None or num["tflops"] is None or not den["tflops"]:
        return None
    return num["tflops"] / den["tflops"]


def ratio_cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def headline(meta: dict) -> str:
    """One line naming the device, software, commit and date of a run, and how it timed each case."""
    when = meta["date"]
    if "runs" in meta:
        when = f"{len(meta['runs'])} runs split by shape ({', '.join(run['date'] for run in meta['runs'])})"
    return (f"{meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, {meta['dtype']}, "
            f"commit {meta['commit']}, {when}; each time the median of {meta['rounds']} rounds, a round "
            f"timing {meta['rep_ms']:g} ms of runs after {meta['warmup_ms']:g} ms of warm-up")


def timed_optional_peers(rows: Sequence[dict]) -> tuple[str, ...]:
    """The optional peers (``OPTIONAL_PEERS``) with at least one timed row."""
    timed = {r["method"] for r in rows if r["tflops"] is not None}
    return tuple(m for m in OPTIONAL_PEERS if m in timed)


def optional(value: float | None, spec: str) -> str:
    """``value`` formatted with ``spec``, or ``-`` where it was not measured."""
    return "-" if value is None else format(value, spec)


def grid_lines(rows: Sequence[dict], methods: Sequence[str], labels: Sequence[str], subject: str,
               peers: Sequence[str], peer_labels: Sequence[str], width: int) -> list[str]:
    """A header and one line per shape x routing x pass that ran: the largest group, each method's TFLOP/s
    (columns ``labels``), then ``subject``'s ratio to each of ``peers`` (columns ``peer_labels``), every
    column ``width`` wide."""
    at = index_rows(rows)
    shape_width = max([22, *(len(s) + 1 for s in unique(rows, "shape"))])
    routing_width = max([9, *(len(r) + 1 for r in unique(rows, "routing"))])
    head = f"{'shape':<{shape_width}}{'routing':<{routing_width}}{'pass':<8}{'max_grp':>8}"
    lines = [head + "".join(f"{c:>{width}}" for c in [*labels, *peer_labels])]
    for shape in unique(rows, "shape"):
        for routing in unique(rows, "routing"):
            for pass_ in unique(rows, "pass"):
                cells = {m: at.get((shape, routing, pass_, m)) for m in methods}
                some = next((r for r in cells.values() if r is not None), None)
                if some is None:
                    continue
                line = f"{shape:<{shape_width}}{routing:<{routing_width}}{pass_:<8}{some['max_group']:>8}"
                line += "".join(f"{tflops_cell(cells[m]):>{width}}" for m in methods)
                line += "".join(f"{ratio_cell(ratio(cells.get(subject), cells.get(p))):>{width}}" for p in peers)
                lines.append(line)
    return lines


def format_table(result: dict) -> str:
    """One line per shape x routing x pass: TFLOP/s per method, then dropless over dense, over
    ``torch._grouped_mm`` and over each optional peer the run timed."""
    rows = result["rows"]
    methods = unique(rows, "method")
    peers = RATIO_PEERS + timed_optional_peers(rows)
    peer_labels = [f"dl/{'_gmm' if m == 'torch_grouped_mm' else m}" for m in peers]
    lines = [f"grouped GEMM, TFLOP/s of useful FLOPs: {headline(result['meta'])}",
             "FAIL = result off the reference, ERR = raised; dl = dropless, _gmm = torch._grouped_mm"]
    return "\n".join(lines + grid_lines(rows, methods, [LABELS.get(m, m) for m in methods], "dropless", peers,
                                        peer_labels, 12))


def summarize(rows: Sequence[dict]) -> dict[str, dict]:
    """Per pass: ``vs`` maps each peer (every method but dropless) to the geometric mean of dropless
    over it, over the (shape, routing) pairs where both were timed; and the smallest dropless / dense
    of the balanced pairs (with its shape)."""
    at = index_rows(rows)
    peers = [m for m in unique(rows, "method") if m != "dropless"]
    pairs = [(shape, routing) for shape in unique(rows, "shape") for routing in unique(rows, "routing")]
    out = {}
    for pass_ in unique(rows, "pass"):
        ratios = {peer: {(s, r): ratio(at.get((s, r, pass_, "dropless")), at.get((s, r, pass_, peer)))
                         for s, r in pairs} for peer in peers}
        vs = {peer: _geomean([v for v in by_pair.values() if v is not None]) for peer, by_pair in ratios.items()}
        balanced = [(v, s) for (s, r), v in ratios.get("dense", {}).items() if r == "balanced" and v is not None]
        worst = min(balanced) if balanced else (None, None)
        out[pass_] = {"vs": vs, "min_balanced_vs_dense": worst[0], "min_balanced_shape": worst[1]}
    return out


def _geomean(values: Sequence[float]) -> float | None:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def is_decode_or_all_to_one(row: dict) -> bool:
    """A row of the decode bar: at most ``DECODE_ROWS_PER_EXPERT`` rows per expert, or all-to-one routing."""
    return row["M"] <= DECODE_ROWS_PER_EXPERT * row["E"] or row["routing"] == "all-to-one"


def decode_bar(rows: Sequence[dict]) -> dict:
    """The bar "dropless at least ``torch._grouped_mm``" over every (shape, routing, pass) of the
    decode-size and all-to-one rows: ``ratios`` (dropless over it where it was timed; 0 where dropless
    was not), ``met`` (how many reach 1), ``lowest`` (the smallest ratio and where) and ``peer_failed``
    (where ``torch._grouped_mm`` failed or raised, left out of the count)."""
    at = index_rows(rows)
    ratios: dict[str, float] = {}
    peer_failed = []
    for r in rows:
        if r["method"] != "dropless" or not is_decode_or_all_to_one(r):
            continue
        where = f"{r['shape']} {r['routing']} {r['pass']}"
        peer = at.get((r["shape"], r["routing"], r["pass"], "torch_grouped_mm"))
        if peer is None:
            continue
        if peer["tflops"] is None:
            peer_failed.append(where)
            continue
        ratios[where] = ratio(r, peer) or 0.0  # dropless failed here: the bar is missed
    lowest = min(ratios.items(), key=lambda item: item[1]) if ratios else None
    return {"ratios": ratios, "met": sum(v >= 1 for v in ratios.values()), "lowest": lowest,
            "peer_failed": peer_failed}


def format_decode_bar(rows: Sequence[dict]) -> str:
    """One line: on how many decode-size and all-to-one rows dropless reached ``torch._grouped_mm``,
    the lowest ratio and where, and where the peer failed."""
    bar = decode_bar(rows)
    line = f"bar dropless >= torch._grouped_mm on decode-size (M/E <= {DECODE_ROWS_PER_EXPERT}) and all-to-one rows: "
    if not bar["ratios"] and not bar["peer_failed"]:
        return line + "no such rows in this run"
    line += f"met on {bar['met']} of {len(bar['ratios'])}"
    if bar["lowest"]:
        line += f", lowest {bar['lowest'][1]:.2f} ({bar['lowest'][0]})"
    if bar["peer_failed"]:
        line += f"; torch._grouped_mm failed on {', '.join(bar['peer_failed'])}"
    return line


def format_summary(rows: Sequence[dict]) -> str:
    lines = ["summary: dropless over each peer, geometric mean over shape x routing"]
    for pass_, s in summarize(rows).items():
        worst = ratio_cell(s["min_balanced_vs_dense"])
        where = f" ({s['min_balanced_shape']})" if s["min_balanced_shape"] else ""
        peers = "   ".join(f"vs {LABELS.get(m, m)} {ratio_cell(v)}" for m, v in s["vs"].items())
        lines.append(f"  {pass_:<8} {peers}   min balanced vs dense {worst}{where}")
    lines.append(format_decode_bar(rows))
    return "\n".join(lines)


def write_json(result: dict, path: Path) -> None:
    """``{"meta": {...}, "rows": [...]}`` (and any other list of rows the result holds, such as the FP8
    benchmark's ``quantization``) with one row per line, so committed results diff by row."""
    meta = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in result["meta"].items())
    lists = "".join(f',\n {json.dumps(key)}: [\n' + ",\n".join(f"  {json.dumps(r)}" for r in rows) + "\n ]"
                    for key, rows in result.items() if key != "meta")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'{{\n "meta": {{\n{meta}\n }}{lists}\n}}\n')


def read_json(path: Path) -> dict:
    result = json.loads(Path(path).read_text())
    if not isinstance(result, dict) or "meta" not in result or "rows" not in result:
        raise ValueError(f"{path} is not a benchmark result (no meta and rows)")
    return result
