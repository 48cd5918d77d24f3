"""The README's FP8 table, generated from FP8 benchmark result files (never typed by hand)."""

from __future__ import annotations

from collections.abc import Sequence

from dropless.bench.fp8 import format_quantization_table
from dropless.bench.report import headline, index_rows, ratio, ratio_cell, tflops_cell, unique

FP8_START = "<!-- fp8-table:start -->"
FP8_END = "<!-- fp8-table:end -->"
# fwd+bwd columns: (method, label); each FP8 one also shows its ratio to dropless BF16.
COLUMNS = (("dropless", "dropless BF16"), ("dropless_rowwise_cached", "rowwise, weights cached"),
           ("dropless_rowwise", "rowwise, all in the call"), ("dropless_block128_cached", "block128, cached"),
           ("dropless_mxfp8_cached", "mxfp8, cached"), ("torchao_rowwise", "torchao rowwise"))


def is_fp8_result(result: dict) -> bool:
    """True for a result file of the FP8 benchmark (it carries the quantization rows)."""
    return "quantization" in result


def _cell(row: dict | None, bf16: dict | None) -> str:
    value = ratio(row, bf16)
    cell = tflops_cell(row)
    if value is not None and row is not bf16:
        cell += f" ({value:.2f}x)"
    if row is not None and row.get("roofline_tflops") and row["tflops"] and row["method"].startswith("dropless_"):
        cell += f" [{row['tflops'] / row['roofline_tflops']:.2f}]"
    return cell


def render_table(result: dict, source: str) -> str:
    """Markdown: a line naming the run, one row per shape and routing with each method's fwd+bwd TFLOP/s
    (x dropless BF16) [share of its roofline], dropless rowwise over torchao (both quantizing everything
    in the call), then the quantization kernels' table."""
    rows = result["rows"]
    at = index_rows(rows)
    head = ["shape (E, M, K, N)", "routing", *(label for _, label in COLUMNS), "rowwise / torchao"]
    lines = [f"Measured on {headline(result['meta'])} (`{source}`). Forward + backward TFLOP/s of useful FLOPs "
             "(6MKN), quantization of what each method quantizes included; (x) over dropless BF16 and "
             "[share of the roofline: the FLOPs at the dense FP8 rate plus the quantization's bytes at the HBM "
             f"bandwidth, both measured in the same run, {result['meta'].get('hbm_gbps') or 0:.0f} GB/s].", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for shape in unique(rows, "shape"):
        first = next(r for r in rows if r["shape"] == shape)
        label = f"{shape} ({first['E']}, {first['M']}, {first['K']}, {first['N']})"
        for routing in unique([r for r in rows if r["shape"] == shape], "routing"):
            get = {m: at.get((shape, routing, "fwd+bwd", m)) for m, _ in COLUMNS}
            cells = [label, routing, *(_cell(get[m], get["dropless"]) for m, _ in COLUMNS),
                     ratio_cell(ratio(get["dropless_rowwise"], get["torchao_rowwise"]))]
            lines.append("| " + " | ".join(cells) + " |")
    title, table = format_quantization_table(result).split("\n", 1)
    return "\n".join(lines + ["", title + ":", "", table])


def render(results: Sequence[tuple[str, dict]]) -> str:
    """The README block for several ``(source name, result)`` pairs, one table each."""
    return "\n\n".join(render_table(result, source) for source, result in results)
