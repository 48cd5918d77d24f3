"""Experiment: the Gluon ragged-M kernel on 2-CTA clusters, each weight tile multicast to both CTAs.

Variants (constexprs): MCAST 1 multicasts the weight halves, 0 has each CTA load the whole weight tile
itself (the same inline PTX without ``.multicast::cluster``). REMOTE 0: each CTA releases only its own
stages (count 1; valid only without multicast), 1: the consumers also arrive on the peer's empty barrier
with ``.release.cluster`` semantics, 2: the same arrival with the default semantics.

A cluster takes two row tiles of one group (rows row0 .. row0 + 2*BLOCK_M) and one column block. Each CTA
loads its own x block and half of the weight block, multicast into both CTAs' stage (inline PTX:
Triton 3.6 has no multicast TMA). A stage goes back to a loader once the consumers of both CTAs are
done with it: each consumer arrives on its own empty barrier and, through mapa, on the peer's.
The kernel is compiled for one CTA a program and launched with a cluster dimension of 2.
"""
from __future__ import annotations

import re

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from dropless.kernels.config import GemmConfig
from dropless.kernels.hopper import descriptor, stage_barriers
from dropless.kernels.launch import next_power_of_2, weight_nk
from dropless.kernels.ragged_m_hopper import _b_block, _group_table, _locate, _store_from, output_in_halves

LOADER_WARPS: gl.constexpr = gl.constexpr(4)
KERNEL_NAME = "_rm_cluster_kernel"


@gluon.jit
def _one_per_thread(WARPS: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    return gl.arange(0, 32 * WARPS, layout=layout)


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
def _remote_arrive(addr, peer, WARPS: gl.constexpr, SEM: gl.constexpr):
    """One thread arrives (release, cluster scope) on the mbarrier at shared offset ``addr`` of CTA ``peer``."""
    idx = _one_per_thread(WARPS)
    gl.inline_asm_elementwise(
        "{\n.reg .pred p;\n.reg .b32 ra;\n"
        "setp.eq.u32 p, $1, 32;\n"
        "mapa.shared::cluster.u32 ra, $2, $3;\n"
        "@p mbarrier.arrive" + SEM + ".shared::cluster.b64 _, [ra];\n"
        "mov.u32 $0, 0;\n}", "=r,r,r,r", [idx, idx * 0 + addr, idx * 0 + peer], dtype=gl.int32, is_pure=False,
        pack=1)


@gluon.jit
def _multicast_load(dst, bar, c0, c1, c2, PARAM: gl.constexpr, WARPS: gl.constexpr, MCAST: gl.constexpr = 1):
    """One thread: a 3-D TMA load through the tensor map kernel parameter PARAM into shared offset ``dst``
    of both CTAs, completing bytes on the mbarrier at offset ``bar`` of each."""
    idx = _one_per_thread(WARPS)
    z = idx * 0
    gl.inline_asm_elementwise(
        "{\n.reg .pred p;\n.reg .b64 d;\n.reg .b16 m;\n"
        "setp.eq.u32 p, $1, 0;\n"
        "mov.b64 d, " + PARAM + ";\n"
        "cvta.param.u64 d, d;\n"
        "mov.b16 m, 3;\n"
        + ("@p cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster"
           " [$2], [d, {$3, $4, $5}], [$6], m;\n" if MCAST else
           "@p cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
           " [$2], [d, {$3, $4, $5}], [$6];\n") +
        "mov.u32 $0, 0;\n}", "=r,r,r,r,r,r,r", [idx, z + dst, z + c0, z + c1, z + c2, z + bar], dtype=gl.int32,
        is_pure=False, pack=1)


@gluon.jit
def _release(empty, step, STAGES: gl.constexpr, empty_addr, peer, WARPS: gl.constexpr, REMOTE: gl.constexpr):
    """The stage of ``step`` is consumed here: arrive on this CTA's empty barrier and on the peer's."""
    gl.thread_barrier()
    mbarrier.arrive(empty.index(step % STAGES), count=1)
    if REMOTE == 1:
        _remote_arrive(empty_addr + (step % STAGES) * 8, peer, WARPS, ".release.cluster")
    elif REMOTE == 2:
        _remote_arrive(empty_addr + (step % STAGES) * 8, peer, WARPS, "")


@gluon.jit
def _loader(a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, M, N, K, E, B_OFF, READY_OFF,
            BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
            STAGES: gl.constexpr, E_POW2: gl.constexpr, B_NK: gl.constexpr, PARAM: gl.constexpr,
            MCAST: gl.constexpr):
    _cluster_sync(LOADER_WARPS)
    pid = gl.program_id(0)
    rank = pid % 2
    base = _smem_base(LOADER_WARPS)
    starts, ends, tiles, tiles_end = _group_table(offsets_ptr, E, M, N, 2 * BLOCK_M, BLOCK_N, E_POW2, LOADER_WARPS)
    total_tiles = gl.sum(tiles, axis=0)
    A_BYTES: gl.constexpr = BLOCK_M * BLOCK_K * 2
    B_BYTES: gl.constexpr = BLOCK_N * BLOCK_K * 2
    HALF: gl.constexpr = BLOCK_N // 2
    step = 0
    for tile_id in range(pid // 2, total_tiles, gl.num_programs(0) // 2):
        group, pair0, end, col0 = _locate(tile_id, starts, ends, tiles, tiles_end, N, 2 * BLOCK_M, BLOCK_N,
                                          GROUP_M, E_POW2, LOADER_WARPS)
        row0 = pair0 + rank * BLOCK_M
        mine = row0 < end
        k_end = gl.where(group < E, K, 0)
        for k0 in range(0, k_end, BLOCK_K):
            slot = step % STAGES
            mbarrier.wait(empty.index(slot), ((step // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, A_BYTES + B_BYTES, pred=mine)
            mbarrier.expect(bar, B_BYTES, pred=row0 >= end)
            tma.async_copy_global_to_shared(a_desc, [row0, k0], bar, a_bufs.index(slot), pred=mine)
            bar_addr = base + READY_OFF + slot * 8
            if MCAST:
                dst = base + B_OFF + slot * B_BYTES + rank * (B_BYTES // 2)
                if B_NK:
                    # The stage holds [BLOCK_N, BLOCK_K], K contiguous: this CTA's half is HALF rows, one box.
                    _multicast_load(dst, bar_addr, k0, col0 + rank * HALF, group, PARAM, LOADER_WARPS)
                else:
                    # [BLOCK_K, BLOCK_N], N contiguous, in 64-column boxes of BLOCK_K * 128 bytes each.
                    for j in gl.static_range(HALF // 64):
                        _multicast_load(dst + j * BLOCK_K * 128, bar_addr, col0 + rank * HALF + j * 64, k0, group,
                                        PARAM, LOADER_WARPS)
            else:
                for h in gl.static_range(2):
                    dst = base + B_OFF + slot * B_BYTES + h * (B_BYTES // 2)
                    if B_NK:
                        _multicast_load(dst, bar_addr, k0, col0 + h * HALF, group, PARAM, LOADER_WARPS, 0)
                    else:
                        for j in gl.static_range(HALF // 64):
                            _multicast_load(dst + j * BLOCK_K * 128, bar_addr, col0 + h * HALF + j * 64, k0, group,
                                            PARAM, LOADER_WARPS, 0)
            if K < 0:
                # Never runs: it makes b_desc a tensor map parameter of the kernel (the loads above use it).
                view = b_bufs.index(slot)._reinterpret(b_desc.dtype, b_desc.block_type.shape, b_desc.layout)
                if B_NK:
                    tma.async_copy_global_to_shared(b_desc, [group, col0, k0], bar, view)
                else:
                    tma.async_copy_global_to_shared(b_desc, [group, k0, col0], bar, view)
            step += 1
    _cluster_sync(LOADER_WARPS)


@gluon.jit
def _compute(c_desc, c_ptr, stride_cm, a_bufs, b_bufs, c_smem, ready, empty, offsets_ptr, M, N, K, E, EMPTY_OFF,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
             STAGES: gl.constexpr, E_POW2: gl.constexpr, B_NK: gl.constexpr, EPI_HALVES: gl.constexpr,
             REMOTE: gl.constexpr, num_warps: gl.constexpr):
    _cluster_sync(num_warps)
    pid = gl.program_id(0)
    rank = pid % 2
    peer = 1 - rank
    empty_addr = _smem_base(num_warps) + EMPTY_OFF
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    starts, ends, tiles, tiles_end = _group_table(offsets_ptr, E, M, N, 2 * BLOCK_M, BLOCK_N, E_POW2, num_warps)
    total_tiles = gl.sum(tiles, axis=0)
    step = 0
    held = False
    for tile_id in range(pid // 2, total_tiles, gl.num_programs(0) // 2):
        group, pair0, end, col0 = _locate(tile_id, starts, ends, tiles, tiles_end, N, 2 * BLOCK_M, BLOCK_N,
                                          GROUP_M, E_POW2, num_warps)
        row0 = pair0 + rank * BLOCK_M
        mine = row0 < end
        k_end = gl.where(group < E, K, 0)
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
        for k0 in range(0, k_end, BLOCK_K):
            slot = step % STAGES
            mbarrier.wait(ready.index(slot), (step // STAGES) & 1)
            b_buf = b_bufs.index(slot)
            if B_NK:
                b_buf = b_buf.permute((1, 0))
            # A row tile past its group's end (the odd last one of a group) only passes the stages on.
            if mine:
                acc = warpgroup_mma(a_bufs.index(slot), b_buf, acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
            if k0 > 0:
                _release(empty, step - 1, STAGES, empty_addr, peer, num_warps, REMOTE)
            elif held:
                tma.store_wait(pendings=0)
                _release(empty, step - 1, STAGES, empty_addr, peer, num_warps, REMOTE)
                held = False
            step += 1
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        if held:
            tma.store_wait(pendings=0)
            _release(empty, step - 1, STAGES, empty_addr, peer, num_warps, REMOTE)
            held = False
        whole = mine & (row0 + BLOCK_M <= end)
        if k_end > 0:
            if not EPI_HALVES:
                _release(empty, step - 1, STAGES, empty_addr, peer, num_warps, REMOTE)
            elif not whole:
                _release(empty, step - 1, STAGES, empty_addr, peer, num_warps, REMOTE)
        out = acc.to(c_desc.dtype)
        if whole:
            tma.store_wait(pendings=0)
            if EPI_HALVES:
                left, right = out.reshape([BLOCK_M, 2, BLOCK_N // 2]).permute(0, 2, 1).split()
                _store_from(c_desc, c_smem, left, row0, col0)
                if k_end > 0:
                    last = b_bufs.index((step - 1) % STAGES)._reinterpret(c_desc.dtype, c_desc.block_type.shape,
                                                                          c_desc.layout)
                    _store_from(c_desc, last, right, row0, col0 + BLOCK_N // 2)
                    held = True
                else:
                    tma.store_wait(pendings=0)
                    _store_from(c_desc, c_smem, right, row0, col0 + BLOCK_N // 2)
            else:
                _store_from(c_desc, c_smem, out, row0, col0)
        elif mine:
            rows = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, acc_layout))
            cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
            ptrs = c_ptr + rows.to(gl.int64)[:, None] * stride_cm + cols[None, :]
            gl.store(ptrs, out, mask=(rows < end)[:, None] & (cols < N)[None, :])
    if held:
        tma.store_wait(pendings=0)
        _release(empty, step - 1, STAGES, empty_addr, peer, num_warps, REMOTE)
    tma.store_wait(pendings=0)
    _cluster_sync(num_warps)


@gluon.jit
def _rm_cluster_kernel(a_desc, b_desc, c_desc, c_ptr, stride_cm, offsets_ptr, M, N, K, E, B_OFF, READY_OFF,
                       EMPTY_OFF, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                       GROUP_M: gl.constexpr, STAGES: gl.constexpr, E_POW2: gl.constexpr, B_NK: gl.constexpr,
                       EPI_HALVES: gl.constexpr, PARAM: gl.constexpr, MCAST: gl.constexpr, REMOTE: gl.constexpr,
                       num_warps: gl.constexpr):
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_block: gl.constexpr = _b_block(BLOCK_K, BLOCK_N, B_NK)
    b_bufs = gl.allocate_shared_memory(dtype, [STAGES, b_block[0], b_block[1]],
                                       gl.NVMMASharedLayout.get_default_for(b_block, dtype))
    c_smem = gl.allocate_shared_memory(dtype, c_desc.block_type.shape, c_desc.layout)
    ready, empty = stage_barriers(STAGES, 1 + (REMOTE > 0))
    gl.warp_specialize([
        (_compute, (c_desc, c_ptr, stride_cm, a_bufs, b_bufs, c_smem, ready, empty, offsets_ptr, M, N, K, E,
                    EMPTY_OFF, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, E_POW2, B_NK, EPI_HALVES, REMOTE, num_warps)),
        (_loader, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, offsets_ptr, M, N, K, E, B_OFF, READY_OFF,
                   BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, E_POW2, B_NK, PARAM, MCAST)),
    ], [LOADER_WARPS], [40])


_CACHE: dict = {}


def offsets_from_llir(llir):
    """The shared-memory offsets of the first ready and empty barriers, from the compiled LLVM IR."""
    inits = re.findall(r'mbarrier\.init\.shared::cta\.b64 \[\$1\], (\d);", "b,r"\(i1 %\w+, ptr addrspace\(3\) getelementptr \(i8, ptr addrspace\(3\) @global_smem, i32 (\d+)\)', llir)
    ready = min(int(o) for c, o in inits if c == "1")
    empty = min(int(o) for c, o in inits if c == "2") if any(c == "2" for c, o in inits) else 0
    return ready, empty, inits


def args_for(a, b, offsets, c, bm=128, bn=256, bk=64, stages=4, group_m=4, mcast=1, remote=1):
    """The kernel's arguments; the weight descriptor loads half a weight tile. The weight ring is the
    largest allocation, so the compiler places it at shared offset 0 (B_OFF); the barriers' offsets are
    read from the compiled kernel (compile_for)."""
    M, K = a.shape
    E, _, N = b.shape
    cfg = GemmConfig(bm, bn, bk, num_warps=8, num_stages=stages, gluon=True)
    halves = output_in_halves(cfg, a.element_size())
    b_nk = weight_nk(b)
    b_desc = descriptor(b.transpose(1, 2), [1, bn // 2, bk]) if b_nk else descriptor(b, [1, bk, bn // 2])
    return dict(a_desc=descriptor(a, [bm, bk]), b_desc=b_desc,
                c_desc=descriptor(c, [bm, bn // 2 if halves else bn]), c_ptr=c, stride_cm=c.stride(0),
                offsets_ptr=offsets, M=M, N=N, K=K, E=E, B_OFF=0, READY_OFF=0, EMPTY_OFF=0, BLOCK_M=bm, BLOCK_N=bn,
                BLOCK_K=bk, GROUP_M=group_m, STAGES=stages, E_POW2=next_power_of_2(E + 1), B_NK=b_nk,
                EPI_HALVES=halves, PARAM=KERNEL_NAME + "_param_5", MCAST=mcast, REMOTE=remote,
                num_warps=8)


def compile_for(args):
    """The compiled kernel, set to launch as 2-CTA clusters, and its barrier offsets."""
    key = tuple((k, v) for k, v in args.items() if isinstance(v, (int, str, bool)) and k.isupper())
    hit = _CACHE.get(key)
    if hit is None:
        k = _rm_cluster_kernel.warmup(**args, grid=(1,))
        ready, empty, inits = offsets_from_llir(k.asm["llir"])
        assert len(inits) == 2 * args["STAGES"], inits
        nw, nc, shared = k.packed_metadata
        k.packed_metadata = (nw, 2, shared)
        hit = _CACHE[key] = (k, ready, empty)
    return hit


def run(a, b, offsets, c, clusters=66, **kw):
    """c = the ragged-M product of a [M, K] and b [E, K, N] (any of the two weight layouts), on ``clusters`` clusters."""
    args = args_for(a, b, offsets, c, **kw)
    k, ready, empty = compile_for(args)
    args.update(READY_OFF=ready, EMPTY_OFF=empty)
    values = [args[p.name] for p in _rm_cluster_kernel.params]
    k[(clusters, 1, 1)](*values)
