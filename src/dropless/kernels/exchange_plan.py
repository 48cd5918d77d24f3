"""What a rank publishes for a symmetric-memory dispatch, and what an expert rank receives, worked out by
kernels from the routing and from the counts every rank published (``parallel.symmetric``).

**Sending** (``send_plan``, three kernels after the copies are sorted by expert): each token's ranks (those
of its valid expert ids, ``rank = id // L``), each (token, rank)'s place among the tokens sent to that
rank (a count per block of tokens, then each block's running count from the blocks before it), and
straight into the published regions: each rank's list of tokens, the sorted copies' slots, their places,
the routing weights (by slot), and the table row (copies per expert, the facts, tokens per rank). Also
``from_ranks``: where each (token, rank)'s row lands when rows come back.

**Receiving** (``receive_plan``):

Inputs: the ``[P, width]`` int32 table of the ranks' published rows (columns ``0..E-1``: each source's
copies per expert; column ``to_me``: how many of its tokens each source sends to this rank), and the
peers' published per-copy tables (each copy's place among the tokens it sends to the copy's rank, its slot,
the routing weights by slot). This rank holds experts ``rank*L .. rank*L + L - 1`` (L = E/P).

The received copies (``R`` rows, the first ``received`` used) are laid out expert-major: local expert e's
copies from source 0, then from source 1, ..., each source's in its sorted order. For copy i:
``src_rank[i]`` (-1 past the count) and ``src_pos[i]``, its place in the source's sorted copies;
``row_weight[i]``, its routing weight; and ``inverse[u * k + slot % k] = i``, where u is the pulled token
the copy takes its row from. The pulled tokens (``U`` rows, the first ``staged`` used) are laid out
source-major: ``stage_src[u]`` (-1 past the count) and ``stage_place[u]``, the token's place in its
source's list for this rank. Also ``received``, ``staged`` and the local group sizes ``[L]``.

Every row is found by counting the block ends at or below it (an ``[rows, blocks]`` comparison a
program): no search, no sort, no host sync. The slots of ``inverse`` that no copy takes keep what the
caller filled them with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dropless.kernels.launch import cdiv, interpreting, launch_info, next_power_of_2

_CHUNK = 256  # table columns (or earlier token blocks) a step when summing
_ELEMENTS = 8192  # rows x blocks a program compares
_TOKEN_ELEMENTS = 4096  # tokens x slots x ranks a program compares
_COPIES = 1024  # sorted copies a program


@triton.jit
def _rank_sends(ids_ptr, tokens, T, top_k, local, E, KK: tl.constexpr, PP: tl.constexpr):
    """``[tokens, PP]`` int32: 1 where the token has a copy on that rank."""
    slots = tl.arange(0, KK)
    ok = (tokens[:, None] < T) & (slots[None, :] < top_k)
    ids = tl.load(ids_ptr + tokens.to(tl.int64)[:, None] * top_k + slots[None, :], mask=ok, other=-1)
    dest = tl.where((ids >= 0) & (ids < E), ids // local, -1)
    ranks = tl.arange(0, PP)
    return tl.max((dest[:, :, None] == ranks[None, None, :]).to(tl.int32), axis=1)


@triton.jit
def _blocks_sum(counts, limit, PP: tl.constexpr, CHUNK: tl.constexpr):
    """``[PP]``: the sum of the ``[blocks, PP]`` table's rows below ``limit``."""
    ranks = tl.arange(0, PP)
    total = tl.zeros((PP,), dtype=tl.int32)
    for b0 in range(0, limit, CHUNK):
        blocks = b0 + tl.arange(0, CHUNK)
        total += tl.sum(tl.load(counts + blocks[:, None] * PP + ranks[None, :], mask=blocks[:, None] < limit,
                                other=0), axis=0)
    return total


@triton.jit
def _send_counts_kernel(ids_ptr, counts_out, T, top_k, local, E,
                        KK: tl.constexpr, PP: tl.constexpr, BLOCK: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    sends = _rank_sends(ids_ptr, tokens, T, top_k, local, E, KK, PP)
    tl.store(counts_out + tl.program_id(0) * PP + tl.arange(0, PP), tl.sum(sends, axis=0))


@triton.jit
def _send_lists_kernel(ids_ptr, counts, place_out, lists_out, from_ranks_out, T, top_k, local, E, P, max_tokens,
                       KK: tl.constexpr, PP: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    ranks = tl.arange(0, PP)
    before = _blocks_sum(counts, pid, PP, CHUNK)
    tokens = pid * BLOCK + tl.arange(0, BLOCK)
    sends = _rank_sends(ids_ptr, tokens, T, top_k, local, E, KK, PP)
    place = tl.cumsum(sends, axis=0) - sends + before[None, :]
    live = (tokens[:, None] < T) & (ranks[None, :] < P)
    tl.store(place_out + tokens[:, None] * PP + ranks[None, :], place, mask=live)
    tl.store(lists_out + ranks[None, :] * max_tokens + place, tokens[:, None] + 0 * place,
             mask=live & (sends > 0))
    pair = tokens[:, None] * P + ranks[None, :]
    tl.store(from_ranks_out + pair, tl.where(sends > 0, pair, T * P), mask=live)


@triton.jit
def _send_copies_kernel(ids_ptr, slots, weights, place, counts, num_blocks, sizes, offsets,
                        table_out, slots_out, unique_out, weights_out,
                        T, top_k, local, E, P, dtype_code, row_width,
                        PP: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr, EB: tl.constexpr):
    pid = tl.program_id(0)
    copies = pid * BLOCK + tl.arange(0, BLOCK)
    ok = copies < T * top_k
    slot = tl.load(slots + copies, mask=ok, other=0)
    ids = tl.load(ids_ptr + slot, mask=ok, other=-1)
    valid = ok & (ids >= 0) & (ids < E)
    rank = tl.where(valid, ids // local, 0)
    unique = tl.load(place + (slot // top_k).to(tl.int64) * PP + rank, mask=valid, other=0)
    tl.store(slots_out + copies, slot, mask=ok)
    tl.store(unique_out + copies, unique, mask=ok)
    tl.store(weights_out + copies, tl.load(weights + copies, mask=ok, other=0.0).to(tl.float32), mask=ok)
    if pid == 0:
        experts = tl.arange(0, EB)
        tl.store(table_out + experts, tl.load(sizes + experts, mask=experts < E, other=0), mask=experts < E)
        sorted_valid = tl.load(offsets + E - 1)
        tl.store(table_out + E, T * top_k - sorted_valid)
        tl.store(table_out + E + 1, dtype_code)
        tl.store(table_out + E + 2, row_width)
        ranks = tl.arange(0, PP)
        tl.store(table_out + E + 3 + ranks, _blocks_sum(counts, num_blocks, PP, CHUNK), mask=ranks < P)


@triton.jit
def _receive_plan_kernel(
    table, width, to_me, rank, P, local, top_k, R, U,
    unique_peers, slot_peers, weight_peers,
    src_rank_out, src_pos_out, weight_out, inverse_out, stage_src_out, stage_place_out,
    received_out, staged_out, sizes_out,
    PP: tl.constexpr, LL: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
):
    pid = tl.program_id(0)
    # The blocks of received copies, b = e * PP + s: local expert e's copies from source s.
    b = tl.arange(0, LL * PP)
    e_of, s_of = b // PP, b % PP
    sizes = tl.load(table + s_of * width + rank * local + e_of, mask=(e_of < local) & (s_of < P), other=0)
    ends = tl.cumsum(sizes, axis=0)
    received = tl.sum(sizes, axis=0)
    sources = tl.arange(0, PP)
    # Where each block starts in its source's sorted copies: the source's copies to the experts before
    # this rank's, then to this rank's experts before e.
    before = tl.zeros((PP,), dtype=tl.int32)
    for x0 in range(0, rank * local, CHUNK):
        x = x0 + tl.arange(0, CHUNK)
        m = (sources[:, None] < P) & (x[None, :] < rank * local)
        before += tl.sum(tl.load(table + sources[:, None] * width + x[None, :], mask=m, other=0), axis=1)
    grid2 = tl.reshape(sizes, (LL, PP))
    first = tl.reshape(tl.cumsum(grid2, axis=0) - grid2 + before[None, :], (LL * PP,))
    # The pulled tokens, source-major.
    from_each = tl.load(table + sources * width + to_me, mask=sources < P, other=0)
    stage_ends = tl.cumsum(from_each, axis=0)
    staged = tl.sum(from_each, axis=0)
    if pid == 0:
        tl.store(received_out, received)
        tl.store(staged_out, staged)
        experts = tl.arange(0, LL)
        tl.store(sizes_out + experts, tl.sum(grid2, axis=1), mask=experts < local)

    rows = pid * BLOCK + tl.arange(0, BLOCK)
    live = rows < received
    below = ends[None, :] <= rows[:, None]
    block = tl.sum(below.to(tl.int32), axis=1)
    start = tl.max(tl.where(below, ends[None, :], 0), axis=1)
    pos = tl.sum(tl.where(b[None, :] == block[:, None], first[None, :], 0), axis=1) + rows - start
    source = tl.where(live, block % PP, 0)
    tl.store(src_rank_out + rows, tl.where(live, source, -1), mask=rows < R)
    tl.store(src_pos_out + rows, tl.where(live, pos, 0), mask=rows < R)
    weight = tl.zeros((BLOCK,), dtype=tl.float32)
    if pid * BLOCK < received:
        unique = tl.load(tl.load(unique_peers + source, mask=live, other=0).to(src_pos_out.dtype) + pos,
                         mask=live, other=0)
        slot = tl.load(tl.load(slot_peers + source, mask=live, other=0).to(src_pos_out.dtype) + pos,
                       mask=live, other=0)
        weight = tl.load(tl.load(weight_peers + source, mask=live, other=0).to(weight_out.dtype) + slot,
                         mask=live, other=0.0)
        stage_start = tl.sum(tl.where(sources[None, :] == source[:, None], (stage_ends - from_each)[None, :], 0),
                             axis=1)
        stage_row = (stage_start + unique).to(tl.int64)
        tl.store(inverse_out + stage_row * top_k + slot % top_k, rows, mask=live)
    tl.store(weight_out + rows, weight, mask=rows < R)

    stage_below = stage_ends[None, :] <= rows[:, None]
    stage_source = tl.sum(stage_below.to(tl.int32), axis=1)
    stage_start_row = tl.max(tl.where(stage_below, stage_ends[None, :], 0), axis=1)
    tl.store(stage_src_out + rows, tl.where(rows < staged, stage_source, -1), mask=rows < U)
    tl.store(stage_place_out + rows, rows - stage_start_row, mask=rows < U)


def receive_plan(table: torch.Tensor, rank: int, world: int, num_experts: int, top_k: int, to_me: int,
                 rows: int, pulled: int, unique_peers: torch.Tensor, slot_peers: torch.Tensor,
                 weight_peers: torch.Tensor, inverse: torch.Tensor) -> dict[str, torch.Tensor]:
    """This rank's receive layout (module docstring) from ``table`` (int32 ``[P, width]``, contiguous).

    rows: R, the received copies' rows; pulled: U, the pulled tokens' rows; ``to_me``: the table's column
    of tokens sent to this rank; the peers: int64 ``[P]`` addresses of each source's int32 places and
    slots and fp32 weights (by slot). ``inverse`` (int32 ``[U * k]``) gets the copies of the pulled tokens'
    slots (the rest left as it is). Returns int32 ``src_rank``, ``src_pos`` ``[R]``, fp32 ``row_weight
    [R]``, int32 ``stage_src``, ``stage_place`` ``[U]``, ``received`` ``[1]``, ``staged`` ``[1]`` and
    ``group_sizes [E/P]``. Arguments are not checked: the caller builds them.
    """
    launch_info(table.device)
    device = table.device
    local = num_experts // world
    out = {
        "src_rank": torch.empty(rows, dtype=torch.int32, device=device),
        "src_pos": torch.empty(rows, dtype=torch.int32, device=device),
        "row_weight": torch.empty(rows, dtype=torch.float32, device=device),
        "stage_src": torch.empty(pulled, dtype=torch.int32, device=device),
        "stage_place": torch.empty(pulled, dtype=torch.int32, device=device),
        "received": torch.empty(1, dtype=torch.int32, device=device),
        "staged": torch.empty(1, dtype=torch.int32, device=device),
        "group_sizes": torch.empty(local, dtype=torch.int32, device=device),
    }
    PP, LL = next_power_of_2(world), next_power_of_2(local)
    block = max(16, min(128, _ELEMENTS // (PP * LL)))
    if interpreting():
        block = max(block, 64)
    _receive_plan_kernel[(max(cdiv(max(rows, pulled), block), 1),)](
        table, table.shape[1], to_me, rank, world, local, top_k, rows, pulled,
        unique_peers, slot_peers, weight_peers,
        out["src_rank"], out["src_pos"], out["row_weight"], inverse, out["stage_src"], out["stage_place"],
        out["received"], out["staged"], out["group_sizes"],
        PP=PP, LL=LL, BLOCK=block, CHUNK=_CHUNK, num_warps=4,
    )
    return out


def send_plan(topk_idx: torch.Tensor, slots: torch.Tensor, group_sizes: torch.Tensor, offsets: torch.Tensor,
              weights: torch.Tensor, world: int, num_experts: int, max_tokens: int, dtype_code: int,
              row_width: int, table_out: torch.Tensor, slots_out: torch.Tensor, unique_out: torch.Tensor,
              weights_out: torch.Tensor, lists_out: torch.Tensor) -> torch.Tensor:
    """Fill this rank's published regions (module docstring) and return ``from_ranks`` int32 ``[T * P]``.

    topk_idx: int ``[T, k]`` (contiguous; ids outside ``[0, E)`` go to no rank); slots int32 ``[T*k]``, the
    copies sorted by expert (``ops.permute.sort_by_expert``), with its group sizes and offsets ``[E]``;
    weights ``[T, k]`` (contiguous). Writes table_out int32 ``[E + 3 + P]`` (copies per expert, the copies
    with no valid id, ``dtype_code``, ``row_width``, tokens per rank), slots_out, unique_out (each sorted
    copy's place among the tokens sent to its rank), weights_out (fp32, by slot) ``[T*k]``, and lists_out
    ``[P * max_tokens]`` (rank r's tokens from ``r * max_tokens``; the rest left as it is). Arguments are
    not checked: the caller builds them.
    """
    launch_info(topk_idx.device)
    device = topk_idx.device
    T, k = topk_idx.shape
    local = num_experts // world
    PP, KK = next_power_of_2(world), next_power_of_2(k)
    block = max(16, min(256, _TOKEN_ELEMENTS // (PP * KK)))
    if interpreting():
        block = max(block, 64)
    num_blocks = cdiv(T, block)
    counts = torch.empty(max(num_blocks, 1) * PP, dtype=torch.int32, device=device)
    place = torch.empty(max(T, 1) * PP, dtype=torch.int32, device=device)
    from_ranks = torch.empty(T * world, dtype=torch.int32, device=device)
    if T:
        _send_counts_kernel[(num_blocks,)](topk_idx, counts, T, k, local, num_experts, KK=KK, PP=PP, BLOCK=block,
                                           num_warps=4)
        _send_lists_kernel[(num_blocks,)](topk_idx, counts, place, lists_out, from_ranks, T, k, local, num_experts,
                                          world, max_tokens, KK=KK, PP=PP, BLOCK=block, CHUNK=_CHUNK, num_warps=4)
    _send_copies_kernel[(max(cdiv(T * k, _COPIES), 1),)](
        topk_idx, slots, weights, place, counts, num_blocks, group_sizes, offsets,
        table_out, slots_out, unique_out, weights_out, T, k, local, num_experts, world, dtype_code, row_width,
        PP=PP, BLOCK=_COPIES, CHUNK=_CHUNK, EB=next_power_of_2(num_experts), num_warps=4,
    )
    return from_ranks
