"""Ragged-M grouped GEMM on FP8 operands (forward and input gradient).

    c[s_e:t_e, :] = (a * sa)[s_e:t_e, :] @ (b[e] * sb[e])   for every group e, s_e = offsets[e-1], t_e = offsets[e]
    c[offsets[E-1]:M, :] = 0                                 (no expert's rows; left alone with tail=False)

a: float8_e4m3fn [M, K] with K contiguous; b: float8_e4m3fn [E, K, N] with K contiguous (a view of
``[E, N, K]`` storage). Both operands are then K-major, the layout Hopper's FP8 tensor cores read; they
come through TMA descriptors where the strides allow it and through masked pointer loads otherwise.
c: [M, N], bf16, fp16 or fp32, any strides.

Scales are fp32, or E8M0 bytes (``2**(byte - 127)``, see scales.py), each broadcast over its block:

    sa(m, k)    = a_scale[(m // A_BM) * sa_m + (k // A_BK) * sa_k]
    sb(e, k, n) = b_scale[e * sb_e + (k // B_BK) * sb_k + (n // B_BN) * sb_n]

Where neither changes along K (rowwise recipes), the fp32 accumulator is scaled once in the epilogue,
``c = acc * sa(m) * sb(e, n)``. Otherwise every BLOCK_K step (which divides A_BK and B_BK) adds its
partial product to the accumulator scaled by ``sa(rows, k0) * sb(e, k0, cols)`` (DeepGEMM's
promotion: 1x128 activations with 128x128 weight tiles, or MXFP8's 1x32 blocks on both operands).

Tiles are numbered and walked as in ragged_m.py: a persistent grid over the tiles of all groups, the
numbering derived from ``offsets`` on the device, nothing read on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dropless.kernels.config import GemmConfig
from dropless.kernels.groups import locate_tile, pick, tile_table, zero_tail
from dropless.kernels.launch import LaunchInfo, cdiv, next_power_of_2
from dropless.kernels.scales import FP8_MIN_STEP, SCALE_EPILOGUE, SCALE_PER_STEP, load_scale


@triton.jit
def _ragged_m_fp8_kernel(
    a, b, c, c_desc, offsets_ptr, a_scale, b_scale,
    M, N, K, E,
    stride_am, stride_ak, stride_be, stride_bk, stride_bn, stride_cm, stride_cn,
    stride_sam, stride_sak, stride_sbe, stride_sbk, stride_sbn,
    A_BM: tl.constexpr, A_BK: tl.constexpr, B_BK: tl.constexpr, B_BN: tl.constexpr,
    A_E8M0: tl.constexpr, B_E8M0: tl.constexpr, SCALE_MODE: tl.constexpr, MAX_IMPRECISE_ACC: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, E_POW2: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    USE_TMA: tl.constexpr, UPCAST: tl.constexpr,
    FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, TMA_STORE: tl.constexpr, ZERO_TAIL: tl.constexpr,
):
    starts, ends, tiles, tiles_end = tile_table(offsets_ptr, E, M, N, BLOCK_M, BLOCK_N, E_POW2)
    # The groups' tiles; the unrouted tail (entry E) gets its zeros after them (zero_tail).
    routed_tiles = pick(tiles_end, E - 1, E_POW2)
    k_tiles = tl.cdiv(K, BLOCK_K)

    for tile_id in tl.range(tl.program_id(0), routed_tiles, NUM_PROGRAMS,
                            flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE):
        group, row_end, row0, col0 = locate_tile(tile_id, starts, ends, tiles, tiles_end, N, BLOCK_M, BLOCK_N,
                                                 GROUP_M, E_POW2)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, BLOCK_N)
        row_ok = rows < row_end
        col_ok = cols < N
        sa_ptrs = a_scale + (rows // A_BM).to(tl.int64) * stride_sam
        sb_ptrs = b_scale + group.to(tl.int64) * stride_sbe + (cols // B_BN) * stride_sbn

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_step in range(k_tiles):
            k0 = k_step * BLOCK_K
            if USE_TMA:
                a_tile = a.load([row0, k0])
                b_tile = b.load([group, col0, k0]).reshape(BLOCK_N, BLOCK_K).T
            else:
                ks = k0 + tl.arange(0, BLOCK_K)
                a_tile = tl.load(a + rows.to(tl.int64)[:, None] * stride_am + ks[None, :] * stride_ak,
                                 mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
                b_ptrs = b + group.to(tl.int64) * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bn
                b_tile = tl.load(b_ptrs, mask=(ks < K)[:, None] & col_ok[None, :], other=0.0)
            if UPCAST:
                a_tile = a_tile.to(tl.float32)
                b_tile = b_tile.to(tl.float32)
            if SCALE_MODE == SCALE_PER_STEP:
                sa = load_scale(sa_ptrs + (k0 // A_BK) * stride_sak, row_ok, A_E8M0)
                sb = load_scale(sb_ptrs + (k0 // B_BK) * stride_sbk, col_ok, B_E8M0)
                # A fresh product per step: the tensor cores' FP8 accumulation is short of fp32, so
                # each step's sum is promoted into the fp32 accumulator, scaled as it goes in.
                acc += tl.dot(a_tile, b_tile) * (sa[:, None] * sb[None, :])
            else:
                acc = tl.dot(a_tile, b_tile, acc, max_num_imprecise_acc=MAX_IMPRECISE_ACC)

        if SCALE_MODE == SCALE_EPILOGUE:
            acc *= load_scale(sa_ptrs, row_ok, A_E8M0)[:, None] * load_scale(sb_ptrs, col_ok, B_E8M0)[None, :]
        if TMA_STORE and row0 + BLOCK_M <= row_end:
            c_desc.store([row0, col0], acc.to(c_desc.dtype))
        else:
            # A tile that ends past its group's last row: mask the rows of the next group.
            c_ptrs = c + rows.to(tl.int64)[:, None] * stride_cm + cols[None, :] * stride_cn
            tl.store(c_ptrs, acc.to(c.dtype.element_ty), mask=(rows < row_end)[:, None] & (cols < N)[None, :])
    if ZERO_TAIL:
        zero_tail(c, starts, ends, N, stride_cm, stride_cn, E, NUM_PROGRAMS, BLOCK_M, BLOCK_N, E_POW2)


@dataclass(frozen=True)
class ScaleMap:
    """Where the ragged-M kernel finds the scales of ``a [M, K]`` and ``b [E, K, N]``.

    Each dim of a scale block is ``(block, stride)``: elements ``i`` of that dim read the scale at
    ``(i // block) * stride``. A block that spans its whole dim is ``(1, 0)``, so one compiled kernel
    serves every size. ``b_e`` is b_scale's stride between experts. ``step``: the promotion step
    along K, None where no scale changes along K (the scales apply in the epilogue).
    """

    a_m: tuple[int, int]
    a_k: tuple[int, int]
    b_k: tuple[int, int]
    b_n: tuple[int, int]
    b_e: int
    a_e8m0: bool
    b_e8m0: bool

    @property
    def step(self) -> int | None:
        along_k = [block for block, stride in (self.a_k, self.b_k) if stride != 0]
        return min(along_k) if along_k else None


def _dim(block: int | None, size: int, stride: int) -> tuple[int, int]:
    if block is None or block >= size or stride == 0:
        return 1, 0
    return block, stride


def kernel_scale(scale: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``(scale as the kernels take it, whether it is E8M0)``: E8M0 scales (``float8_e8m0fnu``, or
    already their uint8 view) go in as bytes, fp32 ones as they are."""
    e8m0 = scale.dtype in (torch.float8_e8m0fnu, torch.uint8)
    return (scale.view(torch.uint8) if e8m0 else scale), e8m0


def scale_map(a: torch.Tensor, a_scale: torch.Tensor, a_block: tuple[int | None, int | None],
              b: torch.Tensor, b_scale: torch.Tensor, b_block: tuple[int | None, int | None]) -> ScaleMap:
    """The ``ScaleMap`` of ``a [M, K]`` scaled by ``a_scale`` (2D, one entry per ``a_block = (rows, ks)``
    block) and ``b [E, K, N]`` scaled by ``b_scale`` (3D ``[E, ., .]``, one entry per ``b_block =
    (ks, cols)`` block of each expert). None spans the whole dim. Raises ValueError for blocks along K
    that the kernel cannot step through: they must be powers of two of at least 32.
    """
    (M, K), N = a.shape, b.shape[2]
    scales = ScaleMap(
        a_m=_dim(a_block[0], M, a_scale.stride(0)), a_k=_dim(a_block[1], K, a_scale.stride(1)),
        b_k=_dim(b_block[0], K, b_scale.stride(1)), b_n=_dim(b_block[1], N, b_scale.stride(2)),
        b_e=b_scale.stride(0), a_e8m0=kernel_scale(a_scale)[1], b_e8m0=kernel_scale(b_scale)[1])
    for block, stride in (scales.a_k, scales.b_k):
        if stride != 0 and (block < FP8_MIN_STEP or block & (block - 1)):
            raise ValueError(f"scale blocks along K must be powers of two of at least {FP8_MIN_STEP}, "
                             f"got a_block {a_block} and b_block {b_block} for K={K}")
    return scales


def ragged_m_fp8_mm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                    scales: ScaleMap, offsets: torch.Tensor, c: torch.Tensor, config: GemmConfig,
                    info: LaunchInfo, fast_accum: bool = False, tail: bool = True) -> None:
    """Launch the FP8 ragged-M kernel writing ``c [M, N]``; nothing syncs with the host.

    a: float8_e4m3fn ``[M, K]``; b: float8_e4m3fn ``[E, K, N]`` (TMA needs ``a.stride(1) == 1`` and
    ``b.stride(1) == 1`` with 16-byte aligned other strides; any other layout takes the pointer path);
    a_scale / b_scale: fp32, or E8M0 (``float8_e8m0fnu`` or its uint8 view), laid out as ``scales``
    (from ``scale_map``) says; offsets: int32 ``[E]`` on a's device; c: ``[M, N]``. Where the scales
    change along K, BLOCK_K is cut to the promotion step. fast_accum: with scales applied in the
    epilogue, let Hopper's tensor cores accumulate the whole reduction in their reduced-precision
    FP8 accumulation; otherwise every BLOCK_K step is promoted into fp32. tail: write zeros over the
    rows past ``offsets[-1]`` (False: leave them as they are).
    """
    M, K = a.shape
    E, _, N = b.shape
    step = scales.step
    bm, bn = config.block_m, config.block_n
    bk = config.block_k if step is None else min(config.block_k, step)
    b_kn = b.transpose(1, 2)
    use_tma = info.tma and info.tma_ok(a) and info.tma_ok(b_kn)
    a_arg = info.descriptor(a, [bm, bk]) if use_tma else a
    b_arg = info.descriptor(b_kn, [1, bn, bk]) if use_tma else b
    tma_store = use_tma and config.tma_store and info.tma_ok(c)
    c_desc = info.descriptor(c, [bm, bn]) if tma_store else None
    max_tiles = (cdiv(M, bm) + E + 1) * cdiv(N, bn)
    num_programs = max(1, min(info.num_programs * config.programs_per_sm, max_tiles))
    _ragged_m_fp8_kernel[(num_programs,)](
        a_arg, b_arg, c, c_desc, offsets,
        kernel_scale(a_scale)[0], kernel_scale(b_scale)[0],
        M, N, K, E,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        scales.a_m[1], scales.a_k[1], scales.b_e, scales.b_k[1], scales.b_n[1],
        A_BM=scales.a_m[0], A_BK=scales.a_k[0], B_BK=scales.b_k[0], B_BN=scales.b_n[0],
        A_E8M0=scales.a_e8m0, B_E8M0=scales.b_e8m0,
        SCALE_MODE=SCALE_EPILOGUE if step is None else SCALE_PER_STEP,
        MAX_IMPRECISE_ACC=None if fast_accum or step is not None else bk,
        NUM_PROGRAMS=num_programs, E_POW2=next_power_of_2(E + 1),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=config.group_m,
        USE_TMA=use_tma, UPCAST=info.upcast,
        FLATTEN=config.flatten, WARP_SPECIALIZE=config.warp_specialize, TMA_STORE=tma_store, ZERO_TAIL=tail,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
