"""The expert-parallel exchange benchmark's cases, inputs and methods: dropless's dispatch and combine
against NCCL ``all_to_all_single`` with and without its count exchange, on the same rows.

Every rank holds ``T`` tokens of width ``d``, each routed to ``k`` of ``E`` experts (rank r owns experts
``r*E/P .. (r+1)*E/P - 1``). A method's ``dispatch`` brings every (token, slot) copy to the rank of its
expert; its ``combine`` sends the expert outputs back. The peers start from the copies already in send
order (sorted by expert, as a permute leaves them) and time only the exchanges:

- ``a2a_with_counts``: dispatch = the ``[P, E/P]`` count table counted from the expert ids on the device,
  exchanged with ``all_to_all_single``, read on the host (one sync, as ``.tolist()`` in Megatron's and
  torchtitan's all-to-all dispatchers), then the data ``all_to_all_single``; combine = the data sent back
  with the sizes the dispatch read (no second count exchange, as ``combine`` reuses its handle).
- ``a2a_data_only``: the two data exchanges alone, with the sizes known on the host beforehand.
- ``dropless_<backend>``: ``dropless.parallel.dispatch`` (routing ids in, rows grouped by local expert out:
  its count exchange, sort, gathers and reorder included) and ``combine`` (the weighted sum back at each
  token's rank); ``dropless_<backend>_fp8``: dispatch with the rowwise FP8 recipe (quantized at the
  source, FP8 bytes and fp32 scales on the wire), combine in the rows' dtype as without it.
- ``dropless_<backend>_graph`` (on GPUs, for the backends with no host sync): the same dispatch and
  combine, each captured in a CUDA graph and replayed, as a training step captured whole runs them: the
  GPU's time without the host's launches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from dropless.bench.check import rel_err
from dropless.bench.options import select_by_name
from dropless.bench.routing import draw_topk
from dropless.ops.grouped_mm_fp8 import resolve_recipe
from dropless.ops.quantize import quantize
from dropless.parallel import combine, dispatch
from dropless.quantized import operand_recipes

PASSES = ("dispatch", "combine")
PEERS = ("a2a_with_counts", "a2a_data_only")
# Backends tried with dispatch; a method ``dropless_<backend>`` runs for each one dispatch accepts.
DISPATCH_BACKENDS = ("nccl", "symmetric_memory")
# Backends with no host sync, which a CUDA graph can capture.
GRAPH_BACKENDS = ("symmetric_memory",)
FP8_RECIPE = "rowwise"


@dataclass(frozen=True)
class ExchangeCase:
    """T tokens per rank of width d, top-k of E experts."""

    name: str
    label: str
    T: int
    d: int
    k: int
    E: int


CASES = (
    # DeepEP's standard setting: 4096 tokens per rank, hidden 7168, top-8 of 256 experts (DeepSeek-V3).
    ExchangeCase("deepep", "DeepEP standard (DeepSeek-V3)", T=4096, d=7168, k=8, E=256),
    ExchangeCase("mixtral", "Mixtral-8x7B", T=8192, d=4096, k=2, E=8),
)
QUICK_CASES = (
    ExchangeCase("deepep", "DeepEP standard (tiny)", T=64, d=64, k=4, E=16),
    ExchangeCase("mixtral", "Mixtral-8x7B (tiny)", T=128, d=32, k=2, E=8),
)


def select_cases(names: Sequence[str] | None, quick: bool) -> list[ExchangeCase]:
    return select_by_name(names, CASES, QUICK_CASES, quick, "case")


@dataclass
class ExchangeInputs:
    """One rank's tokens and routing, the copies in send order, the split sizes, and what every method
    must deliver (computed from all ranks' inputs gathered, not by an all-to-all).

    x ``[T, d]``; ids int64 ``[T, k]``; weights ``[T, k]`` (each token's summing to 1, so a combine of the
    dispatched rows gives x back); send ``[T*k, d]``: the copies sorted by expert; send_splits /
    recv_splits: rows to and from each rank; recv_table: ``[P, E/P]`` rows from each rank for each local
    expert (host); expected_recv ``[R, d]``: the rows in the order ``all_to_all_single`` delivers them
    (source-rank-major, each source's sorted by expert); expected_rows: the same grouped by local expert
    (each expert's in source-rank then token order), the layout dispatch returns.
    """

    case: ExchangeCase
    routing: str
    group: dist.ProcessGroup | None
    rank: int
    world: int
    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor
    send: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    recv_table: torch.Tensor
    expected_recv: torch.Tensor
    expected_rows: torch.Tensor = field(repr=False)

    def bytes_out(self, pass_: str, row_bytes: int) -> int:
        """Bytes this rank sends to other ranks in ``pass_``: the copies it dispatches, or the rows it
        received and combine sends back; its own rows never cross."""
        splits = self.send_splits if pass_ == "dispatch" else self.recv_splits
        return (sum(splits) - splits[self.rank]) * row_bytes


def make_inputs(case: ExchangeCase, routing: str, group: dist.ProcessGroup | None, device: torch.device,
                dtype: torch.dtype, seed: int) -> ExchangeInputs:
    """This rank's inputs (seeded by ``seed`` and the rank), with what every method must deliver.
    Collective: every rank of ``group`` calls it."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if case.E % world:
        raise ValueError(f"case {case.name}: {world} ranks do not divide its {case.E} experts")
    local = case.E // world
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    x = torch.randn(case.T, case.d, generator=gen).to(device, dtype)
    ids = draw_topk(case.T, case.E, case.k, routing, seed, seed * 1000 + rank).to(device)
    weights = torch.rand(case.T, case.k, generator=gen).add_(0.1)
    weights = (weights / weights.sum(1, keepdim=True)).to(device)
    order = torch.sort(ids.flatten(), stable=True).indices
    send = x[order // case.k]
    counts = torch.bincount(ids.flatten().cpu(), minlength=case.E).view(world, local).to(device)
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    recv_table = received.cpu()
    send_splits = counts.sum(1).tolist()
    recv_splits = recv_table.sum(1).tolist()

    # What this rank must receive, from every rank's x and ids gathered (all ranks hold T tokens).
    xs = [torch.empty_like(x) for _ in range(world)]
    all_ids = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(xs, x, group=group)
    dist.all_gather(all_ids, ids, group=group)
    parts = []
    for source_x, source_ids in zip(xs, all_ids):
        flat = source_ids.flatten()
        source_order = torch.sort(flat, stable=True).indices
        mine = source_order[flat[source_order] // local == rank]
        parts.append(source_x[mine // case.k])
    expected_recv = torch.cat(parts)
    del xs, all_ids, parts
    expert_of_row = torch.repeat_interleave(torch.arange(local).repeat(world), recv_table.flatten())
    expected_rows = expected_recv[torch.sort(expert_of_row, stable=True).indices.to(device)]
    return ExchangeInputs(case, routing, group, rank, world, x, ids, weights, send, send_splits, recv_splits,
                          recv_table, expected_recv, expected_rows)


@dataclass
class ExchangeMethod:
    """A method ready to time: ``fns[pass_]()`` runs one dispatch or combine; ``row_bytes[pass_]``: bytes of
    one row on the wire; ``errors[pass_]``: its result's relative error against what it must deliver."""

    fns: dict[str, Callable[[], object]]
    row_bytes: dict[str, int]
    errors: dict[str, float]


def _all_to_all(rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None) -> torch.Tensor:
    out = rows.new_empty((sum(recv), *rows.shape[1:]))
    dist.all_to_all_single(out, rows, recv, send, group=group)
    return out


def _row_bytes(t: torch.Tensor) -> int:
    return t[0].numel() * t.element_size()


def build_peer(name: str, inp: ExchangeInputs) -> ExchangeMethod:
    """``a2a_with_counts`` or ``a2a_data_only`` on ``inp``, checked once."""
    if name not in PEERS:
        raise ValueError(f"unknown peer {name!r}")
    g, E, world = inp.group, inp.case.E, inp.world
    flat_ids = inp.ids.flatten()
    ones = torch.ones_like(flat_ids)

    def data_only() -> torch.Tensor:
        return _all_to_all(inp.send, inp.send_splits, inp.recv_splits, g)

    def with_counts() -> torch.Tensor:
        counts = torch.zeros(E, dtype=torch.int64, device=flat_ids.device).scatter_add_(0, flat_ids, ones)
        counts = counts.view(world, E // world)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=g)
        send, recv = torch.stack([counts.sum(1), received.sum(1)]).tolist()  # the host sync this peer pays
        return _all_to_all(inp.send, send, recv, g)

    recv = inp.expected_recv

    def back() -> torch.Tensor:
        return _all_to_all(recv, inp.recv_splits, inp.send_splits, g)

    fns = {"dispatch": with_counts if name == "a2a_with_counts" else data_only, "combine": back}
    with torch.no_grad():
        errors = {"dispatch": rel_err(fns["dispatch"](), inp.expected_recv), "combine": rel_err(back(), inp.send)}
    return ExchangeMethod(fns, {"dispatch": _row_bytes(inp.send), "combine": _row_bytes(inp.send)}, errors)


@dataclass
class Graphed:
    """A call captured in a CUDA graph; calling replays it. It holds ``fn``, whose closure holds the
    tensors the graph reads (freed, their memory would be handed to other tensors)."""

    fn: Callable[[], object]
    graph: torch.cuda.CUDAGraph

    def __call__(self) -> None:
        self.graph.replay()


def graphed(fn: Callable[[], object]) -> Graphed:
    """``fn`` (already run once) captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return Graphed(fn, graph)


def build_dropless(backend: str, inp: ExchangeInputs, recipe: str | None = None, graph: bool = False) -> ExchangeMethod:
    """``dispatch`` and ``combine`` of ``dropless.parallel`` with ``backend`` (and an FP8 ``recipe`` for the
    dispatch), checked once: the rows and group sizes dispatch returns, and combine of those rows, which
    gives the tokens back (the weights sum to 1; with a recipe, the tokens as their FP8 rows hold them).
    With ``graph``, each pass is then captured in a CUDA graph and timed as its replay."""
    E = inp.case.E

    def run_dispatch():
        return dispatch(inp.x, inp.ids, inp.weights, inp.group, num_experts=E, backend=backend, recipe=recipe)

    row_bytes = {"dispatch": _row_bytes(inp.x), "combine": _row_bytes(inp.x)}
    tokens = inp.x
    with torch.no_grad():
        if recipe is not None:
            # The tokens as the FP8 rows carry them (rowwise: each row quantized on its own, at its rank),
            # and the bytes of one row on the wire: its FP8 data and scales.
            q = quantize(inp.x, operand_recipes(resolve_recipe(recipe))[0], dim=1)
            tokens = q.dequantize(inp.x.dtype)
            row_bytes["dispatch"] = _row_bytes(q.data) + _row_bytes(q.scale)
        rows, group_sizes, handle = run_dispatch()
        values = rows[0] if recipe is not None else rows
        if group_sizes.tolist() != inp.recv_table.sum(0).tolist():
            raise RuntimeError(f"dispatch returned group sizes {group_sizes.tolist()}, "
                               f"expected {inp.recv_table.sum(0).tolist()}")
        expected_out = (tokens.float() * inp.weights.sum(1, keepdim=True).float()).to(inp.x.dtype)
        # Dispatch against the tokens themselves (with a recipe: the FP8 rows' error, which the tolerance for
        # FP8 bounds); combine against the tokens it was given.
        # The symmetric-memory backend returns rows for the most a rank can receive; the first are the copies.
        errors = {"dispatch": rel_err(values[:len(inp.expected_rows)], inp.expected_rows),
                  "combine": rel_err(combine(values, handle), expected_out)}
    fns = {"dispatch": run_dispatch, "combine": lambda: combine(values, handle)}
    if graph:
        with torch.no_grad():
            fns = {pass_: graphed(fn) for pass_, fn in fns.items()}
    return ExchangeMethod(fns, row_bytes, errors)


def method_names(backends: Sequence[str], fp8: bool, graphs: bool = False) -> list[str]:
    """The methods of a run: each accepted backend (and with ``graphs`` its graph-replayed version where it
    has one, with ``fp8`` its FP8 dispatch), then the peers."""
    names = [f"dropless_{b}" for b in backends]
    if graphs:
        names += [f"dropless_{b}_graph" for b in backends if b in GRAPH_BACKENDS]
    if fp8:
        names += [f"dropless_{b}_fp8" for b in backends]
    return names + list(PEERS)


def build_method(name: str, inp: ExchangeInputs) -> ExchangeMethod:
    if name in PEERS:
        return build_peer(name, inp)
    backend = name.removeprefix("dropless_")
    if backend.endswith("_graph"):
        return build_dropless(backend.removesuffix("_graph"), inp, graph=True)
    if backend.endswith("_fp8"):
        return build_dropless(backend.removesuffix("_fp8"), inp, FP8_RECIPE)
    return build_dropless(backend, inp)


def probe_backend(backend: str, group: dist.ProcessGroup | None, device: torch.device) -> str | None:
    """None if ``dispatch`` runs with ``backend`` on this rank, else why not (the error it raised).

    A backend dispatch does not know is refused before any collective, on every rank alike; a known one
    runs one tiny dispatch of 2 tokens with top-1 (collective: every rank calls this)."""
    world = dist.get_world_size(group)
    x = torch.randn(2, 8, device=device)
    ids = torch.tensor([[0], [world - 1]], device=device)
    try:
        with torch.no_grad():
            dispatch(x, ids, torch.ones(2, 1, device=device), group, num_experts=world, backend=backend)
    except Exception as exc:  # a backend dispatch does not accept (yet): a skip reason, not a crash
        return f"{type(exc).__name__}: {exc}"
    return None
