"""What an expert rank receives in a symmetric-memory dispatch, worked out in one kernel from the counts
every rank published (``parallel.symmetric``).

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

_CHUNK = 256  # table columns a step when summing a source's copies before this rank's experts
_ELEMENTS = 8192  # rows x blocks a program compares


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
