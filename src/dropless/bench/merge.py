"""Joining result files of runs that split one benchmark by shape into a single result."""

from __future__ import annotations

from collections.abc import Sequence

# What must agree for the runs' ratios to be read as one table.
SAME = ("gpu", "torch", "triton", "dtype", "dropless_backend", "warmup_ms", "rep_ms", "rounds", "seed", "quick",
        "tolerance")


def merge_results(results: Sequence[dict], commit: str | None = None) -> dict:
    """One result from runs over disjoint (shape, routing) cases on the same machine and settings.

    Every row keeps the timings of the run that made it, so each ratio still compares methods timed
    in one run. ``meta`` is the first run's, with ``runs`` listing each run's commit, date and shapes,
    the per-shape records (group sizes, tuned configs) joined, ``seconds`` summed, and ``commit``
    replaced by ``commit`` where given (the code the runs ran, for copies outside git).
    """
    if len(results) < 2:
        raise ValueError("merge needs at least two result files")
    first = results[0]["meta"]
    for result in results[1:]:
        differ = [k for k in SAME if result["meta"].get(k) != first.get(k)]
        if differ:
            raise ValueError(f"the runs differ in {differ}; only runs on the same machine and settings merge")
    seen: set[tuple[str, str]] = set()
    for result in results:
        cases = {(r["shape"], r["routing"]) for r in result["rows"]}
        if cases & seen:
            raise ValueError(f"cases {sorted(cases & seen)} are in more than one file")
        seen |= cases
    meta = dict(first)
    meta["runs"] = [{"commit": r["meta"]["commit"], "date": r["meta"]["date"],
                     "shapes": list(dict.fromkeys(row["shape"] for row in r["rows"]))} for r in results]
    for key in ("group_sizes", "tuned_configs"):
        joined: dict = {}
        for result in results:
            for name, value in result["meta"].get(key, {}).items():
                joined[name] = {**joined.get(name, {}), **value}
        meta[key] = joined
    meta["seconds"] = round(sum(r["meta"].get("seconds", 0.0) for r in results), 1)
    if commit:
        meta["commit"] = commit
    merged = {"meta": meta, "rows": [row for result in results for row in result["rows"]]}
    # Other lists of rows (the FP8 benchmark's ``quantization``) are joined in run order.
    for key in dict.fromkeys(k for result in results for k in result if k not in ("meta", "rows")):
        merged[key] = [row for result in results for row in result.get(key, [])]
    return merged
