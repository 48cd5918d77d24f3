"""Row moves between the ranks of an expert-parallel group through their symmetric buffers.

Every rank of the group holds a buffer at an address the others can load from and store to (torch's
symmetric memory on GPUs, peer-mapped over NVLink; shared memory between CPU processes). ``peers`` is
an int64 ``[P]`` tensor of those addresses, one region of the buffer on each rank, each region a table
of rows of ``W`` elements.

    pull_rows:  out[i] = scale(i) * peers[rank[i]][row(i)]          for i < n (n read on the device)
    push_rows:  peers[rank[i]][row[i]] = src[i]                     for i < n

where ``row(i)`` is ``row[i]``, or with slot tables the token ``slot // top_k`` of the slot read from
the source rank's table (``slot_peers[rank[i]][row[i]]``, also written to ``slot_out``). ``scale(i)`` is 1 or ``scale[i]`` (fp32), and with
``y`` the pull also writes ``dots[i] = <pulled row, y[i]>`` in fp32. A row whose rank is negative is written as zeros (a copy that belongs to no rank). Rows at or
past n are not touched: the callers size their outputs for the worst case and read the count on the
device, so nothing waits for the host. Each output element is written by exactly one program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dropless.kernels.launch import cdiv, interpreting, launch_info, next_power_of_2

_BLOCK_BYTES = 2048  # bytes of a row a program moves per step
_NUM_WARPS = 4


def _block_m() -> int:
    """Rows per program: 4 on GPUs (many programs in flight hide the peers' latency); 64 under the
    interpreter, which runs programs one after another."""
    return 64 if interpreting() else 4

@triton.jit
def _pull_kernel(
    peers, rank_ptr, row_ptr, n_ptr, out, slot_peers, slot_out, scale, y, dots,
    R, W, top_k,
    SLOTS: tl.constexpr, SCALE: tl.constexpr, DOT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
):
    n = tl.load(n_ptr)
    if tl.program_id(0) * BLOCK_M < n:
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        ok = (rows < n) & (rows < R)
        rank = tl.load(rank_ptr + rows, mask=ok, other=-1)
        live = ok & (rank >= 0)
        rank = tl.where(live, rank, 0)
        row = tl.load(row_ptr + rows, mask=live, other=0).to(tl.int64)
        if SLOTS:
            table = tl.load(slot_peers + rank, mask=live, other=0).to(slot_out.dtype)
            slot = tl.load(table + row, mask=live, other=0)
            if tl.program_id(1) == 0:
                tl.store(slot_out + rows, tl.where(live, slot, -1), mask=ok)
            row = slot.to(tl.int64) // top_k
        if SCALE:
            w = tl.load(scale + rows, mask=live, other=0.0)
        base = tl.load(peers + rank, mask=live, other=0).to(out.dtype)
        rows64 = rows.to(tl.int64)
        dot = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for c0 in range(tl.program_id(1) * BLOCK_W, W, BLOCK_W * tl.num_programs(1)):
            cols = c0 + tl.arange(0, BLOCK_W)
            col_ok = cols < W
            v = tl.load(base[:, None] + row[:, None] * W + cols[None, :], mask=live[:, None] & col_ok[None, :],
                        other=0)
            if DOT:
                other = tl.load(y + rows64[:, None] * W + cols[None, :], mask=live[:, None] & col_ok[None, :],
                                other=0.0)
                dot += tl.sum(v.to(tl.float32) * other.to(tl.float32), axis=1)
            if SCALE:
                v = v.to(tl.float32) * w[:, None]
            tl.store(out + rows64[:, None] * W + cols[None, :], v.to(out.dtype.element_ty),
                     mask=ok[:, None] & col_ok[None, :])
        if DOT:
            tl.store(dots + rows, dot, mask=ok)


@triton.jit
def _push_kernel(src, peers, rank_ptr, row_ptr, n_ptr, R, W, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr):
    n = tl.load(n_ptr)
    if tl.program_id(0) * BLOCK_M < n:
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rank = tl.load(rank_ptr + rows, mask=(rows < n) & (rows < R), other=-1)
        live = (rows < n) & (rows < R) & (rank >= 0)
        rank = tl.where(live, rank, 0)
        row = tl.load(row_ptr + rows, mask=live, other=0).to(tl.int64)
        base = tl.load(peers + rank, mask=live, other=0).to(src.dtype)
        cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        m = live[:, None] & (cols[None, :] < W)
        v = tl.load(src + rows.to(tl.int64)[:, None] * W + cols[None, :], mask=m)
        tl.store(base[:, None] + row[:, None] * W + cols[None, :], v, mask=m)


def _block_w(W: int, element_size: int) -> int:
    return max(16, min(next_power_of_2(W), _BLOCK_BYTES // element_size))


def pull_rows(peers: torch.Tensor, rank: torch.Tensor, row: torch.Tensor, n: torch.Tensor, out: torch.Tensor, *,
              top_k: int = 1, slot_peers: torch.Tensor | None = None,
              slot_out: torch.Tensor | None = None, scale: torch.Tensor | None = None,
              y: torch.Tensor | None = None, dots: torch.Tensor | None = None) -> None:
    """Fill the first ``n`` rows of ``out [R, W]`` (contiguous) from the peers' regions (module docstring).

    rank, row: int32 ``[R]``; n: int ``[1]`` on the device (at most R); slot_peers: int64 ``[P]``
    addresses of int32 slot tables, with slot_out: int32 ``[R]``; scale: fp32 ``[R]``, each row's factor; y ``[R, W]``
    and dots fp32 ``[R]``: the dot products of the pulled rows with y's. The peers' regions hold rows
    of out's dtype. Arguments are not checked: the callers build them.
    """
    launch_info(out.device)
    R, W = out.shape
    if R == 0 or W == 0:
        return
    dot = y is not None
    block_w, block_m = _block_w(W, out.element_size()), _block_m()
    grid = (cdiv(R, block_m), 1 if dot else cdiv(W, block_w))
    _pull_kernel[grid](
        peers, rank, row, n, out, slot_peers if slot_peers is not None else peers,
        slot_out if slot_out is not None else rank, scale if scale is not None else out,
        y if dot else out, dots if dot else out, R, W, top_k,
        SLOTS=slot_peers is not None, SCALE=scale is not None, DOT=dot, BLOCK_M=block_m, BLOCK_W=block_w,
        num_warps=_NUM_WARPS,
    )


def push_rows(src: torch.Tensor, peers: torch.Tensor, rank: torch.Tensor, row: torch.Tensor,
              n: torch.Tensor) -> None:
    """Store the first ``n`` rows of ``src [R, W]`` (contiguous) at row ``row[i]`` of rank ``rank[i]``'s
    region (rows of src's dtype); rows with a negative rank are skipped. rank, row: int32 ``[R]``; n: int
    ``[1]`` on the device."""
    launch_info(src.device)
    R, W = src.shape
    if R == 0 or W == 0:
        return
    block_w, block_m = _block_w(W, src.element_size()), _block_m()
    _push_kernel[(cdiv(R, block_m), cdiv(W, block_w))](src, peers, rank, row, n, R, W, BLOCK_M=block_m,
                                                        BLOCK_W=block_w, num_warps=_NUM_WARPS)
