"""Row moves between the ranks of an expert-parallel group through their symmetric buffers.

Every rank of the group holds a buffer at an address the others can load from and store to (torch's
symmetric memory on GPUs, peer-mapped over NVLink; shared memory between CPU processes). ``peers`` is
an int64 ``[P]`` tensor of those addresses, one region of the buffer on each rank, each region a table
of rows of ``W`` elements. For i < n (n read on the device):

    pull_rows:       out[i] = peers[rank[i]][row[i]]
    push_rows:       peers[rank[i]][row[i]] = src[i]
    pull_to_copies:  out[c] = scale[c] * v,  dots[c] = <v, y[c]>  for each c = copies[i, j] < R,
                     where v = peers[rank[i]][row(i)] is read once
    sum_and_push:    peers[rank[i]][row[i]] = sum_j scale[c] * src[c]  over c = copies[i, j] < R (fp32, in j order)

In pull_to_copies, ``row(i)`` is ``row[i]``, or with lookup tables the row read from the source rank's
table (``lookup_peers[rank[i]][row[i]]``, also written to ``lookup_out``); ``scale`` is optional (1
without it) and so are ``y`` and ``dots``. A row whose rank is negative is pulled as zeros (its copies
are written as zeros) and pushed nowhere. Rows at or past n are not touched: the callers size their
outputs for the worst case and read the count on the device, so nothing waits for the host. Each output
element is written by exactly one program.

A token that sends several copies to one rank crosses once: pull_to_copies reads its row from the source
and writes it to each of its copies' rows here, and sum_and_push sums the copies here and stores the one
row at the source.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dropless.kernels.launch import cdiv, interpreting, launch_info, next_power_of_2

_BLOCK_BYTES = 1024  # bytes of a row a program moves per step
_STEP_BYTES = 8192  # bytes a program moves per step: rows per program = _STEP_BYTES // (BLOCK_W's bytes)
_MAX_ROWS = 256
_NUM_WARPS = 4


def _blocks(W: int, element_size: int) -> tuple[int, int]:
    """(rows per program, BLOCK_W). Many rows in flight hide the peers' latency: 8 rows of 1 KiB blocks
    for wide rows, up to 256 rows for narrow ones (a row of indices). Under the interpreter, which
    runs programs one after another: at least 64 rows."""
    block_w = max(16, min(next_power_of_2(W), _BLOCK_BYTES // element_size))
    rows = max(1, min(_MAX_ROWS, _STEP_BYTES // (block_w * element_size)))
    return (max(rows, 64) if interpreting() else rows), block_w


@triton.jit
def _peer_rows(peers, rank_ptr, row_ptr, n, count, like, BLOCK_M: tl.constexpr):
    """This program's ``BLOCK_M`` rows: which are below the count (``ok``) and have a rank (``live``),
    their ranks (0 where not live), their rows on the peers (int64) and their peers' regions (pointers
    of ``like``'s type)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = (rows < n) & (rows < count)
    rank = tl.load(rank_ptr + rows, mask=ok, other=-1)
    live = ok & (rank >= 0)
    rank = tl.where(live, rank, 0)
    row = tl.load(row_ptr + rows, mask=live, other=0).to(tl.int64)
    base = tl.load(peers + rank, mask=live, other=0).to(like.dtype)
    return rows, ok, live, rank, row, base


@triton.jit
def _pull_kernel(peers, rank_ptr, row_ptr, n_ptr, out, R, W, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    n = tl.load(n_ptr)
    if tl.program_id(0) * BLOCK_M < n:
        rows, ok, live, _, row, base = _peer_rows(peers, rank_ptr, row_ptr, n, R, out, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        col_ok = cols < W
        v = tl.load(base[:, None] + row[:, None] * W + cols[None, :], mask=live[:, None] & col_ok[None, :], other=0)
        tl.store(out + rows.to(tl.int64)[:, None] * W + cols[None, :], v, mask=ok[:, None] & col_ok[None, :])


@triton.jit
def _push_kernel(src, peers, rank_ptr, row_ptr, n_ptr, R, W, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    n = tl.load(n_ptr)
    if tl.program_id(0) * BLOCK_M < n:
        rows, _, live, _, row, base = _peer_rows(peers, rank_ptr, row_ptr, n, R, src, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        m = live[:, None] & (cols[None, :] < W)
        v = tl.load(src + rows.to(tl.int64)[:, None] * W + cols[None, :], mask=m)
        tl.store(base[:, None] + row[:, None] * W + cols[None, :], v, mask=m)


@triton.jit
def _pull_to_copies_kernel(
    peers, rank_ptr, row_ptr, n_ptr, copies, out, lookup_peers, lookup_out, scale, y, dots,
    U, R, W, top_k,
    LOOKUP: tl.constexpr, SCALE: tl.constexpr, DOT: tl.constexpr, K_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
):
    n = tl.load(n_ptr)
    if tl.program_id(0) * BLOCK_M < n:
        rows, ok, live, rank, row, base = _peer_rows(peers, rank_ptr, row_ptr, n, U, out, BLOCK_M)
        rows64 = rows.to(tl.int64)
        if LOOKUP:
            table = tl.load(lookup_peers + rank, mask=live, other=0).to(lookup_out.dtype)
            found = tl.load(table + row, mask=live, other=0)
            if tl.program_id(1) == 0:
                tl.store(lookup_out + rows, tl.where(live, found, -1), mask=ok)
            row = found.to(tl.int64)
        slot_of = tl.arange(0, K_POW2)
        dot = tl.zeros((BLOCK_M, K_POW2), dtype=tl.float32)
        for c0 in range(tl.program_id(1) * BLOCK_W, W, BLOCK_W * tl.num_programs(1)):
            cols = c0 + tl.arange(0, BLOCK_W)
            col_ok = cols < W
            v = tl.load(base[:, None] + row[:, None] * W + cols[None, :], mask=live[:, None] & col_ok[None, :],
                        other=0)
            for j in range(top_k):
                copy = tl.load(copies + rows64 * top_k + j, mask=ok, other=R)
                has = ok & (copy < R)
                copy64 = copy.to(tl.int64)
                m = has[:, None] & col_ok[None, :]
                value = v
                if DOT:
                    other = tl.load(y + copy64[:, None] * W + cols[None, :], mask=m, other=0.0)
                    part = tl.sum(v.to(tl.float32) * other.to(tl.float32), axis=1)
                    dot += tl.where(slot_of[None, :] == j, part[:, None], 0.0)
                if SCALE:
                    w = tl.load(scale + copy64, mask=has, other=0.0)
                    value = v.to(tl.float32) * w[:, None]
                tl.store(out + copy64[:, None] * W + cols[None, :], value.to(out.dtype.element_ty), mask=m)
        if DOT:
            for j in range(top_k):
                copy = tl.load(copies + rows64 * top_k + j, mask=ok, other=R)
                has = ok & (copy < R)
                tl.store(dots + copy.to(tl.int64), tl.sum(tl.where(slot_of[None, :] == j, dot, 0.0), axis=1), mask=has)


@triton.jit
def _sum_and_push_kernel(
    src, copies, n_ptr, scale, peers, rank_ptr, row_ptr, U, R, W, top_k,
    SCALE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
):
    n = tl.load(n_ptr)
    if tl.program_id(0) * BLOCK_M < n:
        rows, _, live, _, row, base = _peer_rows(peers, rank_ptr, row_ptr, n, U, src, BLOCK_M)
        cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        col_ok = cols < W
        acc = tl.zeros((BLOCK_M, BLOCK_W), dtype=tl.float32)
        # The copies are summed in slot order: the result is deterministic.
        for j in range(top_k):
            copy = tl.load(copies + rows.to(tl.int64) * top_k + j, mask=live, other=R)
            has = live & (copy < R)
            copy64 = copy.to(tl.int64)
            v = tl.load(src + copy64[:, None] * W + cols[None, :], mask=has[:, None] & col_ok[None, :],
                        other=0.0).to(tl.float32)
            if SCALE:
                v = v * tl.load(scale + copy64, mask=has, other=0.0)[:, None]
            acc += v
        tl.store(base[:, None] + row[:, None] * W + cols[None, :], acc.to(src.dtype.element_ty),
                 mask=live[:, None] & col_ok[None, :])


def pull_rows(peers: torch.Tensor, rank: torch.Tensor, row: torch.Tensor, n: torch.Tensor, out: torch.Tensor) -> None:
    """Fill the first ``n`` rows of ``out [R, W]`` (contiguous) from the peers' regions (rows of out's
    dtype). rank, row: int32 ``[R]``; n: int ``[1]`` on the device (at most R). Arguments are not checked:
    the callers build them."""
    launch_info(out.device)
    R, W = out.shape
    if R == 0 or W == 0:
        return
    block_m, block_w = _blocks(W, out.element_size())
    _pull_kernel[(cdiv(R, block_m), cdiv(W, block_w))](peers, rank, row, n, out, R, W, BLOCK_M=block_m,
                                                        BLOCK_W=block_w, num_warps=_NUM_WARPS)


def push_rows(src: torch.Tensor, peers: torch.Tensor, rank: torch.Tensor, row: torch.Tensor,
              n: torch.Tensor) -> None:
    """Store the first ``n`` rows of ``src [R, W]`` (contiguous) at row ``row[i]`` of rank ``rank[i]``'s
    region (rows of src's dtype); rows with a negative rank are skipped. rank, row: int32 ``[R]``; n: int
    ``[1]`` on the device."""
    launch_info(src.device)
    R, W = src.shape
    if R == 0 or W == 0:
        return
    block_m, block_w = _blocks(W, src.element_size())
    _push_kernel[(cdiv(R, block_m), cdiv(W, block_w))](src, peers, rank, row, n, R, W, BLOCK_M=block_m,
                                                        BLOCK_W=block_w, num_warps=_NUM_WARPS)


def pull_to_copies(peers: torch.Tensor, rank: torch.Tensor, row: torch.Tensor, n: torch.Tensor,
                   copies: torch.Tensor, out: torch.Tensor, *,
                   lookup_peers: torch.Tensor | None = None, lookup_out: torch.Tensor | None = None,
                   scale: torch.Tensor | None = None, y: torch.Tensor | None = None,
                   dots: torch.Tensor | None = None) -> None:
    """For the first ``n`` of ``U`` pulled rows, read each from its peer once and write it to each of its
    copies' rows of ``out [R, W]`` (contiguous; module docstring).

    rank, row: int32 ``[U]``; n: int ``[1]`` on the device (at most U); copies: int32 ``[U, K]``, the rows
    of out that take pulled row i (R where a slot holds none; every row of out appears at most once);
    lookup_peers: int64 ``[P]`` addresses of int32 tables of rows, with lookup_out: int32 ``[U]``; scale:
    fp32 ``[R]``, each copy's factor; y ``[R, W]`` and dots fp32 ``[R]``: each copy's dot product of the
    pulled row with its row of y. The peers' regions hold rows of out's dtype. Arguments are not checked:
    the callers build them.
    """
    launch_info(out.device)
    R, W = out.shape
    U = copies.shape[0]
    if U == 0 or W == 0:
        return
    dot = y is not None
    block_m, block_w = _blocks(W, out.element_size())
    grid = (cdiv(U, block_m), 1 if dot else cdiv(W, block_w))
    _pull_to_copies_kernel[grid](
        peers, rank, row, n, copies, out, lookup_peers if lookup_peers is not None else peers,
        lookup_out if lookup_out is not None else rank, scale if scale is not None else out,
        y if dot else out, dots if dot else out, U, R, W, copies.shape[1],
        LOOKUP=lookup_peers is not None, SCALE=scale is not None, DOT=dot,
        K_POW2=next_power_of_2(copies.shape[1]), BLOCK_M=block_m, BLOCK_W=block_w, num_warps=_NUM_WARPS,
    )


def sum_and_push(src: torch.Tensor, copies: torch.Tensor, n: torch.Tensor, peers: torch.Tensor,
                 rank: torch.Tensor, row: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """For the first ``n`` of ``U`` rows, sum the copies' rows of ``src [R, W]`` (contiguous), each times
    its ``scale`` (fp32 ``[R]``, 1 without it), in fp32 in slot order, and store the sum (in src's
    dtype) at row ``row[i]`` of rank ``rank[i]``'s region; rows with a negative rank are skipped.

    copies: int32 ``[U, K]`` (R where a slot holds none); rank, row: int32 ``[U]``; n: int ``[1]`` on
    the device (at most U). Arguments are not checked: the callers build them.
    """
    launch_info(src.device)
    R, W = src.shape
    U = copies.shape[0]
    if U == 0 or W == 0:
        return
    block_m, block_w = _blocks(W, src.element_size())
    _sum_and_push_kernel[(cdiv(U, block_m), cdiv(W, block_w))](
        src, copies, n, scale if scale is not None else src, peers, rank, row, U, R, W, copies.shape[1],
        SCALE=scale is not None, BLOCK_M=block_m, BLOCK_W=block_w, num_warps=_NUM_WARPS,
    )
