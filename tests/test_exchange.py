"""dropless.kernels.exchange: the row moves between ranks' buffers, in one process whose "ranks" are
several tensors (the kernels see only their addresses), against loop oracles in fp64. Outputs are
NaN-poisoned: the rows the kernels must write are all finite and the others are left as they were."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE, REL_TOL, poisoned

from dropless.bench.check import rel_err
from dropless.kernels.exchange import pull_rows, pull_to_copies, push_rows, sum_and_push
from dropless.kernels.exchange_plan import receive_plan, send_plan
from dropless.ops.permute import sort_by_expert

# (rows on each peer, pulled/pushed rows U, count n, copy rows R, K copies a row, width W).
# W includes 1, 3, 33 and 1,100 (more than one 2 KiB block of fp32); n includes 0 and U.
CASES = {
    "k1": ([7, 5], 6, 5, 6, 1, 33),
    "k8_wide": ([9, 4, 6], 10, 8, 50, 8, 1100),
    "k3_w1": ([3, 8], 9, 9, 20, 3, 1),
    "n0": ([4, 4], 5, 0, 10, 2, 3),
    "one_peer": ([12], 12, 11, 24, 2, 17),
}
DTYPES = (torch.float64, torch.float32, torch.bfloat16)
SUM_DTYPES = (torch.float32, torch.bfloat16)  # the rows combine sums (it accumulates in fp32)


def _case(name: str, dtype: torch.dtype, seed: int):
    """Peers' tables, each pulled row's rank (some -1) and row, the count, and a copy table in which
    every copy row appears at most once (some copy rows in none: left untouched)."""
    sizes, U, n, R, K, W = CASES[name]
    gen = torch.Generator().manual_seed(seed)
    tables = [torch.randn(s, W, generator=gen).to(KERNEL_DEVICE, dtype) for s in sizes]
    rank = torch.randint(0, len(sizes), (U,), generator=gen, dtype=torch.int32)
    rank[torch.rand(U, generator=gen) < 0.15] = -1
    row = torch.tensor([int(torch.randint(0, sizes[r], (1,), generator=gen)) if r >= 0 else 0 for r in rank.tolist()],
                       dtype=torch.int32)
    slots = torch.randperm(U * K, generator=gen)[:min(R, U * K) - 1]
    copies = torch.full((U * K,), R, dtype=torch.int32)
    copies[slots] = torch.randperm(R, generator=gen)[:slots.numel()].to(torch.int32)
    return (tables, rank.to(KERNEL_DEVICE), row.to(KERNEL_DEVICE), torch.tensor([n], device=KERNEL_DEVICE),
            copies.view(U, K).to(KERNEL_DEVICE), R, W, gen)


def _peers(tables: list[torch.Tensor]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tables], dtype=torch.int64, device=KERNEL_DEVICE)


def _check(out: torch.Tensor, ref: torch.Tensor, written: torch.Tensor, dtype: torch.dtype) -> None:
    """The written rows match ref in the dtype's tolerance (all finite); the others are still NaN."""
    assert bool(torch.isfinite(out[written]).all()), "a row that must be written was not"
    assert bool(torch.isnan(out[~written]).all()), "a row that must be left was written"
    if bool(written.any()):
        assert rel_err(out[written].double(), ref[written]) <= REL_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("mode", ["plain", "lookup", "scale", "dot"])
def test_pull_to_copies(name, dtype, mode):
    tables, rank, row, n, copies, R, W, gen = _case(name, dtype, seed=len(name) + len(mode))
    U, K = copies.shape
    lookups = [torch.randint(0, t.shape[0], (U,), generator=gen, dtype=torch.int32).to(KERNEL_DEVICE)
               for t in tables]
    scale = torch.rand(R, generator=gen).to(KERNEL_DEVICE) if mode in ("scale", "dot") else None
    y = torch.randn(R, W, generator=gen).to(KERNEL_DEVICE, dtype) if mode == "dot" else None
    out = poisoned((R, W), dtype, KERNEL_DEVICE)
    dots = poisoned((R,), torch.float32, KERNEL_DEVICE) if mode == "dot" else None
    found = torch.full((U,), -7, dtype=torch.int32, device=KERNEL_DEVICE)
    options = {"lookup_peers": _peers(lookups), "lookup_out": found} if mode == "lookup" else {}
    pull_to_copies(_peers(tables), rank, row, n, copies, out, scale=scale, y=y, dots=dots, **options)

    ref, ref_dots = torch.zeros(R, W, dtype=torch.float64), torch.zeros(R, dtype=torch.float64)
    written = torch.zeros(R, dtype=torch.bool)
    for i in range(int(n)):
        r = int(rank[i])
        at = int(lookups[r][row[i]]) if mode == "lookup" and r >= 0 else int(row[i])
        if mode == "lookup":
            assert int(found[i]) == (at if r >= 0 else -1)
        v = tables[r][at].double().cpu() if r >= 0 else torch.zeros(W, dtype=torch.float64)
        for c in copies[i].tolist():
            if c < R:
                written[c] = True
                ref[c] = v * (float(scale[c]) if scale is not None else 1.0)
                if y is not None:
                    ref_dots[c] = (v * y[c].double().cpu()).sum()
    if mode == "lookup":
        assert bool((found[int(n):] == -7).all()), "lookup_out written past the count"
    _check(out.cpu(), ref, written, dtype)
    if dots is not None:
        _check(dots.cpu().view(R, 1), ref_dots.view(R, 1), written, torch.float32)


@pytest.mark.parametrize("dtype", SUM_DTYPES, ids=str)
@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_sum_and_push(name, dtype, weighted):
    tables, rank, row, n, copies, R, W, gen = _case(name, dtype, seed=len(name) + weighted)
    U, K = copies.shape
    src = torch.randn(R, W, generator=gen).to(KERNEL_DEVICE, dtype)
    scale = torch.rand(R, generator=gen).to(KERNEL_DEVICE) if weighted else None
    # Each pushed row lands on a row of its own: a permutation of each peer's rows.
    targets = [poisoned((U, W), dtype, KERNEL_DEVICE) for _ in tables]
    row = torch.randperm(U, generator=gen).to(KERNEL_DEVICE, torch.int32)
    sum_and_push(src, copies, n, _peers(targets), rank, row, scale=scale)

    refs = [torch.zeros(U, W, dtype=torch.float64) for _ in tables]
    written = [torch.zeros(U, dtype=torch.bool) for _ in tables]
    for i in range(int(n)):
        r = int(rank[i])
        if r < 0:
            continue
        written[r][int(row[i])] = True
        for c in copies[i].tolist():
            if c < R:
                refs[r][int(row[i])] += src[c].double().cpu() * (float(scale[c]) if weighted else 1.0)
    for target, ref, w in zip(targets, refs, written):
        _check(target.cpu(), ref, w, dtype)


@pytest.mark.parametrize("name", CASES)
def test_pull_and_push_rows(name):
    """The plain moves, on int64 words (as the callers pass rows): exact."""
    tables, rank, row, n, _, _, W, gen = _case(name, torch.float64, seed=3)
    words = [t.view(torch.int64) for t in tables]
    U = rank.shape[0]
    out = torch.full((U, W), -5, dtype=torch.int64, device=KERNEL_DEVICE)
    pull_rows(_peers(words), rank, row, n, out)
    for i in range(U):
        r = int(rank[i])
        expected = (words[r][int(row[i])] if r >= 0 else torch.zeros(W, dtype=torch.int64, device=KERNEL_DEVICE)
                    ) if i < int(n) else torch.full((W,), -5, dtype=torch.int64, device=KERNEL_DEVICE)
        assert torch.equal(out[i], expected), f"pulled row {i}"
    targets = [torch.full((U, W), -5, dtype=torch.int64, device=KERNEL_DEVICE) for _ in tables]
    spots = torch.randperm(U, generator=gen).to(KERNEL_DEVICE, torch.int32)
    push_rows(out, _peers(targets), rank, spots, n)
    for i in range(U):
        r = int(rank[i])
        if i < int(n) and r >= 0:
            assert torch.equal(targets[r][int(spots[i])], out[i]), f"pushed row {i}"
    pushed = sum(int(((rank[:int(n)] == r)).sum()) for r in range(len(tables)))
    assert sum(int((t != -5).any(1).sum()) for t in targets) == pushed, "a row was pushed that should not be"


@pytest.mark.parametrize("world, E, k, rank, seed", [(2, 4, 2, 0, 0), (4, 8, 2, 3, 1), (3, 6, 4, 1, 2),
                                                     (4, 256, 8, 2, 3), (1, 5, 3, 0, 4), (2, 2, 1, 1, 5)])
def test_receive_plan(world, E, k, rank, seed):
    """The receive layout from a random table of counts (zeros included) and random per-copy tables,
    against a loop over the blocks: every row of every output, the rows past the counts included
    (``inverse`` poisoned: its slots that no copy takes keep the poison)."""
    gen = torch.Generator().manual_seed(seed)
    local, facts = E // world, 3
    counts = torch.randint(0, 4, (world, E), generator=gen, dtype=torch.int32)
    counts[torch.rand(world, E, generator=gen) < 0.3] = 0
    mine = counts[:, rank * local:(rank + 1) * local].sum(1)
    to_me = (mine + k - 1) // k + torch.randint(0, 2, (world,), generator=gen, dtype=torch.int32)
    table = torch.cat([counts, torch.zeros(world, facts + world, dtype=torch.int32)], 1)
    table[:, E + facts + rank] = to_me
    uniques, slots, weights = [], [], []
    for s in range(world):
        total, first = int(counts[s].sum()), int(counts[s, :rank * local].sum())
        unique = torch.randint(0, 100, (total + 1,), generator=gen, dtype=torch.int32)
        slot = torch.randint(0, 100, (total + 1,), generator=gen, dtype=torch.int32)
        pairs = torch.randperm(int(to_me[s]) * k, generator=gen)[:int(mine[s])].to(torch.int32)
        mine_s = slice(first, first + int(mine[s]))
        unique[mine_s], slot[mine_s] = pairs // k, pairs  # token u, slot u*k + j
        uniques.append(unique.to(KERNEL_DEVICE))
        slots.append(slot.to(KERNEL_DEVICE))
        weights.append(torch.rand(max(int(to_me[s]) * k, 101), generator=gen).to(KERNEL_DEVICE))
    R, U = int(mine.sum()) + 5, int(to_me.sum()) + 3
    inverse = torch.full((U * k,), -9, dtype=torch.int32, device=KERNEL_DEVICE)
    plan = receive_plan(table.to(KERNEL_DEVICE), rank, world, E, k, E + facts + rank, R, U, _peers(uniques),
                        _peers(slots), _peers(weights), inverse)

    src_rank, src_pos, weight = [-1] * R, [None] * R, [0.0] * R
    expected_inverse = [-9] * (U * k)
    stage_start = [int(to_me[:s].sum()) for s in range(world)]
    i = 0
    for e in range(local):
        for s in range(world):
            for p in range(int(counts[s, rank * local + e])):
                pos = int(counts[s, :rank * local + e].sum()) + p
                slot = int(slots[s][pos])
                src_rank[i], src_pos[i], weight[i] = s, pos, float(weights[s][slot])
                expected_inverse[(stage_start[s] + int(uniques[s][pos])) * k + slot % k] = i
                i += 1
    received = i
    assert plan["received"].tolist() == [received] and plan["staged"].tolist() == [int(to_me.sum())]
    assert plan["group_sizes"].tolist() == counts[:, rank * local:(rank + 1) * local].sum(0).tolist()
    assert plan["src_rank"].tolist() == src_rank
    assert plan["src_pos"][:received].tolist() == src_pos[:received]
    assert torch.equal(plan["row_weight"].cpu(), torch.tensor(weight, dtype=torch.float32))
    assert inverse.tolist() == expected_inverse
    stage_src = [s for s in range(world) for _ in range(int(to_me[s]))]
    assert plan["stage_src"].tolist() == stage_src + [-1] * (U - len(stage_src))
    assert plan["stage_place"][:len(stage_src)].tolist() == [p for s in range(world) for p in range(int(to_me[s]))]


@pytest.mark.parametrize("T, E, k, world, max_tokens, seed", [(37, 8, 2, 2, 40, 0), (300, 16, 4, 4, 300, 1),
                                                              (5, 6, 3, 3, 9, 2), (0, 4, 2, 2, 4, 3),
                                                              (260, 256, 8, 4, 300, 4), (9, 3, 1, 1, 9, 5)])
def test_send_plan(T, E, k, world, max_tokens, seed):
    """The published regions and from_ranks against loops over the tokens, with ids outside [0, E) mixed
    in; the regions poisoned (the lists' unused places must keep it)."""
    gen = torch.Generator().manual_seed(seed)
    local = E // world
    ids = (torch.stack([torch.randperm(E + 2, generator=gen)[:k] for _ in range(T)]) if T
           else torch.empty(0, k, dtype=torch.int64))
    ids[ids == E + 1] = -1  # E and -1: no expert
    ids = ids.to(KERNEL_DEVICE)
    weights = torch.rand(T, k, generator=gen).to(KERNEL_DEVICE, torch.bfloat16)
    slots, sizes, offsets = sort_by_expert(ids, E)
    table = torch.full((E + 3 + world,), -9, dtype=torch.int32, device=KERNEL_DEVICE)
    slots_out, unique_out = (torch.full((T * k,), -9, dtype=torch.int32, device=KERNEL_DEVICE) for _ in range(2))
    weights_out = poisoned((T * k,), torch.float32, KERNEL_DEVICE)
    lists = torch.full((world * max_tokens,), -9, dtype=torch.int32, device=KERNEL_DEVICE)
    from_ranks = send_plan(ids, slots, sizes, offsets, weights, world, E, max_tokens, 2, 77, table, slots_out,
                           unique_out, weights_out, lists)

    ids_cpu = ids.cpu().tolist()
    ranks_of = [{i // local for i in row if 0 <= i < E} for row in ids_cpu]
    place, expected_lists = {}, [-9] * (world * max_tokens)
    per_rank = [0] * world
    for t, ranks in enumerate(ranks_of):
        for r in sorted(ranks):
            place[t, r] = per_rank[r]
            expected_lists[r * max_tokens + per_rank[r]] = t
            per_rank[r] += 1
    invalid = sum(1 for row in ids_cpu for i in row if not 0 <= i < E)
    assert table.tolist() == sizes.tolist() + [invalid, 2, 77] + per_rank
    assert torch.equal(slots_out, slots)
    expected_unique = []
    for s in slots.tolist():
        i = ids_cpu[s // k][s % k]
        expected_unique.append(place[s // k, i // local] if 0 <= i < E else 0)
    assert unique_out.tolist() == expected_unique
    assert torch.equal(weights_out, weights.float().reshape(-1))
    assert lists.tolist() == expected_lists
    assert from_ranks.tolist() == [t * world + r if r in ranks_of[t] else T * world
                                   for t in range(T) for r in range(world)]
