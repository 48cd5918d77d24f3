"""The JAX benchmark's rows read for people: ratios of ``dropless.jax`` to its peers, the issue's bars,
the table printed last. No JAX here: a result file is read without it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dropless.bench.report import grid_lines, headline, index_rows, ratio, unique

PASSES = ("fwd", "fwd+bwd")
SUBJECT = "dropless_jax"
# The methods, in the table's order, with their labels.
LABELS = {"dense": "dense jnp", SUBJECT: "dropless.jax", "jax_ragged_dot": "lax.ragged_dot",
          "dropless": "dropless torch"}
# What dropless.jax is divided by, with the labels of those ratio columns.
PEERS = {"dense": "dl.jax/dense", "dropless": "dl.jax/torch", "jax_ragged_dot": "dl.jax/lax"}


@dataclass(frozen=True)
class Bar:
    """dropless.jax's TFLOP/s over ``peer``'s must reach ``at_least`` on every (shape, routing) of
    ``pass_``; rows where the peer failed (jax.lax.ragged_dot out of memory) are left out."""

    pass_: str
    peer: str
    at_least: float


# What the project asks of dropless.jax: no JAX tax over the PyTorch op, and 3x what JAX users get today.
BARS = (Bar("fwd+bwd", "dropless", 0.95), Bar("fwd", "jax_ragged_dot", 3.0), Bar("fwd+bwd", "jax_ragged_dot", 3.0))


def add_ratio_keys(rows: Sequence[dict]) -> None:
    """``ratio_to_<peer>`` for the PyTorch dropless and jax.lax.ragged_dot peers: a row's TFLOP/s over
    that peer's on the same shape, routing and pass (``ratio_to_dense`` is the GEMM benchmark's)."""
    at = index_rows(rows)
    for r in rows:
        for peer in ("dropless", "jax_ragged_dot"):
            r[f"ratio_to_{peer}"] = ratio(r, at.get((r["shape"], r["routing"], r["pass"], peer)))


def format_bar(rows: Sequence[dict], bar: Bar) -> str:
    """One line: on how many rows the bar holds, the lowest ratio and where, the rows whose peer failed."""
    at = index_rows(rows)
    ratios: dict[str, float] = {}
    peer_failed = []
    for shape in unique(rows, "shape"):
        for routing in unique(rows, "routing"):
            where = f"{shape} {routing}"
            subject, peer = at.get((shape, routing, bar.pass_, SUBJECT)), at.get((shape, routing, bar.pass_, bar.peer))
            if subject is None or peer is None:
                continue
            if peer["tflops"] is None:
                peer_failed.append(where)
                continue
            ratios[where] = ratio(subject, peer) or 0.0  # dropless.jax failed here: the bar is missed
    met = sum(value >= bar.at_least for value in ratios.values())
    line = f"bar {bar.pass_} {LABELS[SUBJECT]} >= {bar.at_least:g}x {LABELS[bar.peer]}: "
    line += f"met on {met} of {len(ratios)} rows"
    if ratios:
        lowest = min(ratios, key=ratios.__getitem__)
        line += f", lowest {ratios[lowest]:.2f} ({lowest})"
    return line + (f"; {LABELS[bar.peer]} failed on {', '.join(peer_failed)}" if peer_failed else "")


def format_jax_table(result: dict) -> str:
    """One line per shape x routing x pass: each method's TFLOP/s, then dropless.jax over dense, over
    the PyTorch dropless and over jax.lax.ragged_dot; then the bars."""
    rows, meta = result["rows"], result["meta"]
    methods = [m for m in LABELS if m in unique(rows, "method")]
    lines = [f"JAX grouped GEMM, TFLOP/s of useful FLOPs: {headline(meta)}; jax {meta['jax']} on "
             f"{meta['jax_device']}, dropless.jax on {meta['dropless_jax_backend']}",
             "every method timed alike: host clock over queued calls, one wait per batch; "
             "FAIL = result off the reference, ERR = raised (out of memory included)"]
    lines += grid_lines(rows, methods, [LABELS[m] for m in methods], SUBJECT, list(PEERS), list(PEERS.values()), 16)
    passes = unique(rows, "pass")
    return "\n".join(lines + [format_bar(rows, bar) for bar in BARS if bar.pass_ in passes])