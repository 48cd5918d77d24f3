"""Experiment: the Gluon wgrad (ragged-K) kernel on 2-CTA clusters, each dy block multicast to both CTAs.

    dw[e] = x_e^T @ dy_e

A cluster takes two output tiles of one group that lie next to each other along K (dw rows k0 and
k0 + BLOCK_K) and share a column block, so both reduce over the same rows of dy: each CTA loads its
own x block and half of the dy block, multicast into the same stage of both CTAs (inline PTX: Triton
3.6 has no multicast TMA). Per 32-row step a CTA then reads 16 KB from L2 instead of 24 KB. A stage
goes back to the loaders once the consumers of both CTAs are done with it: each consumer arrives on
its own empty barrier and, through mapa, on the peer's (MCAST 0: the same coupling, each CTA loading
the whole dy block itself). Static schedule: pair p takes every (num_programs / 2)-th pair tile.

The kernel is compiled for one CTA a program and launched with a cluster dimension of 2; shared memory
is addressed as ``global_smem`` plus offsets (the dy ring, the largest buffer, at 0; the barriers'
offsets read from the compiled LLVM IR), as in the ragged-M experiment of commit 96a5f4f.
"""
from __future__ import annotations

import re

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from dropless.kernels.hopper import descriptor, stage_barriers
from dropless.kernels.ragged_k_hopper import _group_rows, _tile_of, _zero_rows_past

LOADER_WARPS: gl.constexpr = gl.constexpr(4)  # 8 + 4 warps: no idle warp that would miss barrier.cluster
KERNEL_NAME = "_rk_cluster_kernel"


@gluon.jit
def _one_per_thread(WARPS: gl.constexpr):
    return gl.arange(0, 32 * WARPS, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))


@gluon.jit
def _cluster_sync(WARPS: gl.constexpr):
    """All threads of both CTAs: barrier.cluster (after making mbarrier inits visible to the cluster)."""
    idx = _one_per_thread(WARPS)
    gl.inline_asm_elementwise(
        "fence.mbarrier_init.release.cluster;\n"
        "barrier.cluster.arrive.release.aligned;\n"
        "barrier.cluster.wait.acquire.aligned;\n"
        "mov.u32 $0, $1;", "=r,r", [idx], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _smem_base(WARPS: gl.constexpr):
    idx = _one_per_thread(WARPS)
    return gl.inline_asm_elementwise("mov.u32 $0, global_smem;", "=r,r", [idx], dtype=gl.int32, is_pure=True,
                                     pack=1)


@gluon.jit
def _remote_arrive(addr, peer, WARPS: gl.constexpr):
    """One thread arrives on the mbarrier at shared offset ``addr`` of CTA ``peer`` (default semantics)."""
    idx = _one_per_thread(WARPS)
    gl.inline_asm_elementwise(
        "{\n.reg .pred p;\n.reg .b32 ra;\n"
        "setp.eq.u32 p, $1, 0;\n"
        "mapa.shared::cluster.u32 ra, $2, $3;\n"
        "@p mbarrier.arrive.shared::cluster.b64 _, [ra];\n"
        "mov.u32 $0, 0;\n}", "=r,r,r,r", [idx, idx * 0 + addr, idx * 0 + peer], dtype=gl.int32, is_pure=False,
        pack=1)


@gluon.jit
def _load_2d(dst, bar, c0, c1, PARAM: gl.constexpr, WARPS: gl.constexpr, MCAST: gl.constexpr):
    """One thread: a 2-D TMA load through the tensor map kernel parameter PARAM into shared offset ``dst``
    (of both CTAs with MCAST), completing bytes on the mbarrier at offset ``bar`` (of each)."""
    idx = _one_per_thread(WARPS)
    z = idx * 0
    gl.inline_asm_elementwise(
        "{\n.reg .pred p;\n.reg .b64 d;\n.reg .b16 m;\n"
        "setp.eq.u32 p, $1, 0;\n"
        "mov.b64 d, " + PARAM + ";\n"
        "cvta.param.u64 d, d;\n"
        "mov.b16 m, 3;\n"
        + ("@p cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
           " [$2], [d, {$3, $4}], [$5], m;\n" if MCAST else
           "@p cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
           " [$2], [d, {$3, $4}], [$5];\n") +
        "mov.u32 $0, 0;\n}", "=r,r,r,r,r,r", [idx, z + dst, z + c0, z + c1, z + bar], dtype=gl.int32,
        is_pure=False, pack=1)


@gluon.jit
def _release(empty, step, STAGES: gl.constexpr, empty_addr, peer, WARPS: gl.constexpr):
    """The stage of ``step`` is consumed here: arrive on this CTA's empty barrier and on the peer's."""
    gl.thread_barrier()
    mbarrier.arrive(empty.index(step % STAGES), count=1)
    _remote_arrive(empty_addr + (step % STAGES) * 8, peer, WARPS)


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, M, total_pairs, pairs_k, tiles_n, READY_OFF,
            BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
            STAGES: gl.constexpr, PARAM: gl.constexpr, MCAST: gl.constexpr):
    _cluster_sync(LOADER_WARPS)
    pid = gl.program_id(0)
    rank = pid % 2
    base = _smem_base(LOADER_WARPS)
    A_BYTES: gl.constexpr = BLOCK_M * BLOCK_K * 2
    B_BYTES: gl.constexpr = BLOCK_M * BLOCK_N * 2
    BOX_BYTES: gl.constexpr = BLOCK_M * 128  # one 64-column box of the 128-byte-swizzled dy stage
    BOXES: gl.constexpr = BLOCK_N // 64
    step = 0
    for pair in range(pid // 2, total_pairs, gl.num_programs(0) // 2):
        group, pid_k, pid_n = _tile_of(pair, pairs_k, tiles_n, GROUP_M)
        start, end = _group_rows(offsets_ptr, group, M)
        k0 = (2 * pid_k + rank) * BLOCK_K
        for row in range(start, end, BLOCK_M):
            slot = step % STAGES
            mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, A_BYTES + B_BYTES)
            tma.async_copy_global_to_shared(a_desc, [row, k0], bar, a_bufs.index(slot))
            bar_addr = base + READY_OFF + slot * 8
            if MCAST:
                for j in gl.static_range(BOXES // 2):
                    box = rank * (BOXES // 2) + j
                    _load_2d(base + slot * B_BYTES + box * BOX_BYTES, bar_addr, pid_n * BLOCK_N + box * 64, row,
                             PARAM, LOADER_WARPS, 1)
            else:
                for box in gl.static_range(BOXES):
                    _load_2d(base + slot * B_BYTES + box * BOX_BYTES, bar_addr, pid_n * BLOCK_N + box * 64, row,
                             PARAM, LOADER_WARPS, 0)
            if M < 0:
                # Never runs: it makes b_desc a tensor map parameter of the kernel (the loads above use it).
                view = b_bufs.index(slot)._reinterpret(b_desc.dtype, b_desc.block_type.shape, b_desc.layout)
                tma.async_copy_global_to_shared(b_desc, [row, pid_n * BLOCK_N], bar, view)
            step += 1
    _cluster_sync(LOADER_WARPS)


@gluon.jit
def _compute(c_desc, a_bufs, b_bufs, c_smem, ready, empty, offsets_ptr, M, total_pairs, pairs_k, tiles_n, EMPTY_OFF,
             BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
             STAGES: gl.constexpr, num_warps: gl.constexpr):
    _cluster_sync(num_warps)
    pid = gl.program_id(0)
    rank = pid % 2
    peer = 1 - rank
    empty_addr = _smem_base(num_warps) + EMPTY_OFF
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    step = 0
    for pair in range(pid // 2, total_pairs, gl.num_programs(0) // 2):
        group, pid_k, pid_n = _tile_of(pair, pairs_k, tiles_n, GROUP_M)
        start, end = _group_rows(offsets_ptr, group, M)
        k0 = (2 * pid_k + rank) * BLOCK_K
        acc = gl.zeros((BLOCK_K, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        for row in range(start, end, BLOCK_M):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            a_buf = a_bufs.index(slot)
            b_buf = b_bufs.index(slot)
            if row + BLOCK_M > end:
                _zero_rows_past(a_buf, row, end, BLOCK_M, BLOCK_K, num_warps)
                _zero_rows_past(b_buf, row, end, BLOCK_M, BLOCK_N, num_warps)
                fence_async_shared()
                gl.thread_barrier()
            acc = warpgroup_mma(a_buf.permute((1, 0)), b_buf, acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if row > start:
                _release(empty, step - 1, STAGES, empty_addr, peer, num_warps)
            step += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        if end > start:
            _release(empty, step - 1, STAGES, empty_addr, peer, num_warps)
        tma.store_wait(pendings=0)
        c_smem.store(acc.to(c_desc.dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(c_desc, [group, k0, pid_n * BLOCK_N], c_smem.reshape([1, BLOCK_K, BLOCK_N]))
    tma.store_wait(pendings=0)
    _cluster_sync(num_warps)


@gluon.jit
def _rk_cluster_kernel(a_desc, b_desc, c_desc, offsets_ptr, M, N, K, E, READY_OFF, EMPTY_OFF,
                       BLOCK_M: gl.constexpr, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
                       STAGES: gl.constexpr, PARAM: gl.constexpr, MCAST: gl.constexpr, num_warps: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    # The dy ring first and largest: the compiler places it at shared offset 0, where the loads address it.
    b_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], dtype)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_N], b_layout)
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [BLOCK_K, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], c_desc.dtype))
    ready, empty = stage_barriers(STAGES, 2)
    pairs_k = gl.cdiv(K, 2 * BLOCK_K)
    tiles_n = gl.cdiv(N, BLOCK_N)
    total_pairs = E * pairs_k * tiles_n
    gl.warp_specialize([
        (_compute, (c_desc, a_bufs, b_bufs, c_smem, ready, empty, offsets_ptr, M, total_pairs, pairs_k, tiles_n,
                    EMPTY_OFF, BLOCK_M, BLOCK_K, BLOCK_N, GROUP_M, STAGES, num_warps)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, M, total_pairs, pairs_k, tiles_n,
                   READY_OFF, BLOCK_M, BLOCK_K, BLOCK_N, GROUP_M, STAGES, PARAM, MCAST)),
    ], [LOADER_WARPS], [40])


_CACHE: dict = {}


def offsets_from_llir(llir: str):
    """The shared-memory offsets of the first ready (count 1) and empty (count 2) barriers."""
    inits = re.findall(r'mbarrier\.init\.shared::cta\.b64 \[\$1\], (\d);", "b,r"\(i1 %\w+, ptr addrspace\(3\) '
                       r'getelementptr \(i8, ptr addrspace\(3\) @global_smem, i32 (\d+)\)', llir)
    ready = min(int(o) for c, o in inits if c == "1")
    empty = min(int(o) for c, o in inits if c == "2")
    return ready, empty, inits


def args_for(a, b, offsets, c, bm=32, bk=128, bn=256, stages=6, group_m=8, mcast=1):
    """The kernel's arguments for ``c [E, K, N] = ragged-K product of a [M, K] and b [M, N]``; the dy
    descriptor loads 64-column boxes."""
    M, K = a.shape
    N = b.shape[1]
    E = c.shape[0]
    return dict(a_desc=descriptor(a, [bm, bk]), b_desc=descriptor(b, [bm, 64]), c_desc=descriptor(c, [1, bk, bn]),
                offsets_ptr=offsets, M=M, N=N, K=K, E=E, READY_OFF=0, EMPTY_OFF=0, BLOCK_M=bm, BLOCK_K=bk,
                BLOCK_N=bn, GROUP_M=group_m, STAGES=stages, PARAM=KERNEL_NAME + "_param_5", MCAST=mcast, num_warps=8)


def compile_for(args):
    """The compiled kernel, set to launch as 2-CTA clusters, and its barrier offsets."""
    key = tuple((k, v) for k, v in args.items() if isinstance(v, (int, str, bool)) and k.isupper())
    hit = _CACHE.get(key)
    if hit is None:
        k = _rk_cluster_kernel.warmup(**args, grid=(1,))
        ready, empty, inits = offsets_from_llir(k.asm["llir"])
        assert len(inits) == 2 * args["STAGES"], inits
        nw, nc, shared = k.packed_metadata
        k.packed_metadata = (nw, 2, shared)
        hit = _CACHE[key] = (k, ready, empty)
    return hit


def run(a, b, offsets, c, clusters=66, **kw):
    """c [E, K, N] = the ragged-K product of a [M, K] and b [M, N] on ``clusters`` clusters (the launcher
    multiplies the grid by the cluster size)."""
    args = args_for(a, b, offsets, c, **kw)
    k, ready, empty = compile_for(args)
    args.update(READY_OFF=ready, EMPTY_OFF=empty)
    values = [args[p.name] for p in _rk_cluster_kernel.params]
    k[(clusters, 1, 1)](*values)
