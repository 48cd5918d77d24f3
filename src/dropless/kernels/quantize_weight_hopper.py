"""FP8 quantization of 3D expert weights in both orientations on Hopper, in Gluon: what
``quantize_weight_3d`` runs for mxfp8 and block128x128 on a 16-bit ``w [E, K, N]`` that TMA can read
(``quantize_weight_hopper_ok``), from one read of w.

The kernel sees w's storage as ``[E, R, C]`` with C its contiguous dim: R = N, C = K for nn.Linear
storage ``[E, N, K]`` (w a transposed view of it), R = K, C = N for a contiguous ``[E, K, N]``. Quantized
along C, the data is stored like w (``data_c [E, R, C]``); along R, transposed (``data_r [E, C, R]``,
R contiguous). So the two storage orders are one kernel with the roles of ``(data_k, data_n)`` and of
their scales swapped on the host, where the scales become views ``[E, R, cdiv(C, 32)]`` and ``[E,
cdiv(R, 32), C]`` (block128x128: ``[E, cdiv(R, 128), cdiv(C, 128)]``), written through their strides.
How a tile moves:
- persistent programs, about two a multiprocessor, take the tiles ``(expert, 128 rows, 64 columns)``
  (block128x128: 128 columns, two halves) of all experts in turn, ``pid, pid + P, ...``, the column
  tiles of a row running fastest, so the time per byte does not depend on E;
- a loader warp brings each ``[128, 64]`` half (128 bytes a row) into a ring of shared-memory stages by
  TMA through a 3D descriptor: a tile never crosses into the next expert, and rows or columns past R or C
  read as zeros, which leave every block's amax alone, so no extent needs to divide by 128;
- four compute warps read a stage in a layout (``_LAYOUT``) where warp w holds rows ``32 w`` to
  ``32 w + 31`` and a thread 4 neighbouring rows of 4 neighbouring columns, twice along the rows (16
  apart) and twice along the columns (32 apart): each 1x32 block along C and each 32x1 block along R
  lies inside one warp (amaxes across at most 8 lanes, no exchange between warps), the 8-byte
  shared-memory reads meet no bank conflicts under the 128-byte swizzle, and a thread's 4 rows of a
  column are neighbouring bytes of the transposed output (4-byte shared-memory stores);
- the FP8 tile along C is written to shared memory as read, the one along R transposed, and both leave
  by asynchronous TMA stores (3D descriptors of the outputs, clipped at R and C) while the next tile is
  computed; the scales are stored from registers.
block128x128 has one scale per 128x128 tile, the amax of both halves: a program holds the two stages,
reads each twice from shared memory (its amax, then its values), and writes the same FP8 values in
both orientations.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from dropless.kernels import fp8_math
from dropless.kernels.direct_launch import DirectLaunch
from dropless.kernels.hopper import descriptor, release, stage_barriers
from dropless.kernels.launch import LaunchInfo, cdiv, hopper_kernels_ok, interpreting, launch_info
from dropless.kernels.quantize_hopper import MAX_REGISTERS, column_amax, stage_values, take_stage
from dropless.quantized import Recipe

ROWS: gl.constexpr = gl.constexpr(128)  # rows (R) a tile
COLUMNS: gl.constexpr = gl.constexpr(64)  # columns (C) a stage: 128 bytes of a 16-bit w
MX_BLOCK: gl.constexpr = gl.constexpr(32)  # mxfp8's elements a scale
STAGES = 4
PROGRAMS_PER_SM = 2  # 4 stages of 16 KB and 32 KB of output buffers a program
COMPUTE_WARPS = 4
LOADER_WARPS: gl.constexpr = gl.constexpr(1)
# Bases of (row, column) bits. Row bits 5 and 6 on the warps, so that 32-row blocks stay in one warp;
# column bits 0-1 in registers (8-byte reads), 2-4 on lanes (a 1x32 block in 8 lanes), row bits 2-3 on
# lanes: under the 128-byte swizzle the first 16 lanes read a whole 128-byte row. Row bits 0-1 in
# registers make a column's 4 rows neighbouring bytes of the transposed tile.
_LAYOUT: gl.constexpr = gl.constexpr(gl.DistributedLinearLayout(
    reg_bases=[[0, 1], [0, 2], [1, 0], [2, 0], [16, 0], [0, 32]],
    lane_bases=[[0, 4], [0, 8], [0, 16], [4, 0], [8, 0]],
    warp_bases=[[32, 0], [64, 0]],
    block_bases=[],
    shape=[128, 64],
))

# block128x128 stores the same FP8 tile both ways. Stored transposed from the registers of the one along C
# (``_LAYOUT``), the kernel Triton 3.6 compiled wrote wrong bytes into about 3/8 of the transposed tile
# once the values were one product an element; converted to this layout first (4 neighbouring rows of 4
# columns a thread, a warp's 8 x 4 threads over 32 rows and 16 columns), the bytes are right at the same speed.
_TRANSPOSED_LAYOUT: gl.constexpr = gl.constexpr(gl.BlockedLayout([4, 4], [8, 4], [1, 4], [1, 0]))


@gluon.jit
def _tile_count(E, R, C, WIDTH: gl.constexpr):
    """``(row tiles, column tiles, all tiles)`` of the experts, tiles ``ROWS x WIDTH``."""
    tiles_r = gl.cdiv(R, ROWS)
    tiles_c = gl.cdiv(C, WIDTH)
    return tiles_r, tiles_c, E * tiles_r * tiles_c


@gluon.jit
def _origin(tile, tiles_r, tiles_c, WIDTH: gl.constexpr):
    """Tile number -> ``(expert, first row, first column)``, the column tiles of a row running fastest."""
    per_expert = tiles_r * tiles_c
    e = tile // per_expert
    rest = tile - e * per_expert
    tile_r = rest // tiles_c
    return e, tile_r * ROWS, (rest - tile_r * tiles_c) * WIDTH


@gluon.jit
def _loader(w_desc, w_bufs, ready, empty, E, R, C, HALVES: gl.constexpr, STAGES: gl.constexpr):
    """TMA loads of the program's tiles, ``[128, 64]`` halves (those that start before C), into the ring."""
    tiles_r, tiles_c, tiles = _tile_count(E, R, C, HALVES * COLUMNS)
    step = 0
    for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
        e, row0, col0 = _origin(tile, tiles_r, tiles_c, HALVES * COLUMNS)
        for half in gl.static_range(HALVES):
            if col0 + half * COLUMNS < C:
                stage = step % STAGES
                mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(stage), w_desc.block_type.nbytes)
                tma.async_copy_global_to_shared(w_desc, [e, row0, col0 + half * COLUMNS], ready.index(stage),
                                                w_bufs.index(stage).reshape([1, ROWS, COLUMNS]))
                step += 1


@gluon.jit
def _store_scales(scale_ptr, scale, e, stride_e, first_a, stride_a, end_a, first_b, stride_b, end_b):
    """Write ``scale [A, B]`` (any layout) to ``scale_ptr + e stride_e + (first_a + a) stride_a + (first_b +
    b) stride_b`` where ``first_a + a < end_a`` and ``first_b + b < end_b``."""
    layout: gl.constexpr = scale.type.layout
    a = gl.arange(0, scale.shape[0], layout=gl.SliceLayout(1, layout))
    b = gl.arange(0, scale.shape[1], layout=gl.SliceLayout(0, layout))
    base = scale_ptr + e.to(gl.int64) * stride_e + first_a.to(gl.int64) * stride_a + first_b.to(gl.int64) * stride_b
    gl.store(base + a[:, None] * stride_a + b[None, :] * stride_b, scale.to(scale_ptr.dtype.element_ty),
             mask=(a < end_a - first_a)[:, None] & (b < end_b - first_b)[None, :])


@gluon.jit
def _send(q_c, q_r, out_c, out_r, written, c_desc, r_desc, e, row0, col0):
    """Asynchronous TMA stores of the FP8 tile ``[ROWS, COLUMNS]`` at ``(e, row0, col0)``: ``q_c`` as it is
    to ``data_c``, ``q_r`` transposed to ``data_r``, through the output buffers of the ``written``-th tile."""
    slot = written % 2
    # The two stores that last read these buffers (two tiles ago) are done; the last tile's may run on.
    tma.store_wait(pendings=2)
    gl.thread_barrier()
    out_c.index(slot).store(q_c)
    out_r.index(slot).store(q_r.permute((1, 0)))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(c_desc, [e, row0, col0], out_c.index(slot).reshape([1, ROWS, COLUMNS]))
    tma.async_copy_shared_to_global(r_desc, [e, col0, row0], out_r.index(slot).reshape([1, COLUMNS, ROWS]))


@gluon.jit
def _mx_compute(w_bufs, ready, empty, out_c, out_r, c_desc, r_desc,
                scale_c_ptr, stride_sce, stride_scr, stride_scb, scale_r_ptr, stride_sre, stride_srb, stride_src,
                E, R, C, RCEIL: gl.constexpr, STAGES: gl.constexpr):
    """mxfp8, the default partition: each tile's 32x1 and 1x32 block scales, its FP8 values both ways."""
    tiles_r, tiles_c, tiles = _tile_count(E, R, C, COLUMNS)
    step = 0
    for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
        e, row0, col0 = _origin(tile, tiles_r, tiles_c, COLUMNS)
        v = take_stage(w_bufs, ready, empty, step, _LAYOUT, STAGES)
        v_r = v.reshape([ROWS // MX_BLOCK, MX_BLOCK, COLUMNS])
        scale_r = fp8_math.gluon_block_scale(column_amax(v_r, 1), True, False, RCEIL)
        q_r = fp8_math.gluon_to_fp8(v_r, scale_r[:, None, :], True, False).reshape([ROWS, COLUMNS])
        v_c = v.reshape([ROWS, COLUMNS // MX_BLOCK, MX_BLOCK])
        scale_c = fp8_math.gluon_block_scale(column_amax(v_c, 2), True, False, RCEIL)
        q_c = fp8_math.gluon_to_fp8(v_c, scale_c[:, :, None], True, False).reshape([ROWS, COLUMNS])
        _store_scales(scale_r_ptr, scale_r, e, stride_sre, row0 // MX_BLOCK, stride_srb, gl.cdiv(R, MX_BLOCK),
                      col0, stride_src, C)
        _store_scales(scale_c_ptr, scale_c, e, stride_sce, row0, stride_scr, R,
                      col0 // MX_BLOCK, stride_scb, gl.cdiv(C, MX_BLOCK))
        _send(q_c, q_r, out_c, out_r, step, c_desc, r_desc, e, row0, col0)
        step += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _half(w_bufs, ready, step, STAGES: gl.constexpr):
    """The loaded half of ``step``, as fp32 in ``_LAYOUT``; its stage stays the program's."""
    return stage_values(w_bufs, ready, step, _LAYOUT, STAGES).to(gl.float32)


@gluon.jit
def _tile_amax(v):
    """``max |v|`` over the whole tile as a ``[1, 1]`` tensor, NaN counted as 0 (``column_amax``'s rule)."""
    return gl.maximum(gl.max(gl.max(gl.abs(v), axis=1, keep_dims=True), axis=0, keep_dims=True), 0.0)


@gluon.jit
def _tile128_compute(w_bufs, ready, empty, out_c, out_r, c_desc, r_desc,
                     scale_ptr, stride_se, stride_sr, stride_sc, E, R, C, POW2: gl.constexpr, STAGES: gl.constexpr):
    """block128x128, the default partition: each 128x128 tile's scale from the amax of its halves (the
    second absent past C), then each half's FP8 values, written both ways."""
    tiles_r, tiles_c, tiles = _tile_count(E, R, C, 2 * COLUMNS)
    step = 0
    for tile in range(gl.program_id(0), tiles, gl.num_programs(0)):
        e, row0, col0 = _origin(tile, tiles_r, tiles_c, 2 * COLUMNS)
        two = col0 + COLUMNS < C
        amax = _tile_amax(_half(w_bufs, ready, step, STAGES))
        if two:
            amax = gl.maximum(amax, _tile_amax(_half(w_bufs, ready, step + 1, STAGES)))
        scale = fp8_math.gluon_block_scale(amax, False, POW2, False)
        _store_scales(scale_ptr, scale, e, stride_se, row0 // ROWS, stride_sr, gl.cdiv(R, ROWS),
                      col0 // (2 * COLUMNS), stride_sc, tiles_c)
        q = fp8_math.gluon_to_fp8(_half(w_bufs, ready, step, STAGES), scale, False, False)
        release(empty, step, STAGES)
        _send(q, gl.convert_layout(q, _TRANSPOSED_LAYOUT), out_c, out_r, step, c_desc, r_desc, e, row0, col0)
        step += 1
        if two:
            q = fp8_math.gluon_to_fp8(_half(w_bufs, ready, step, STAGES), scale, False, False)
            release(empty, step, STAGES)
            _send(q, gl.convert_layout(q, _TRANSPOSED_LAYOUT), out_c, out_r, step, c_desc, r_desc, e, row0,
                  col0 + COLUMNS)
            step += 1
    tma.store_wait(pendings=0)


@gluon.jit
def _quantize_weight_kernel(w_desc, c_desc, r_desc,
                            scale_c_ptr, stride_sce, stride_scr, stride_scb,
                            scale_r_ptr, stride_sre, stride_srb, stride_src, E, R, C,
                            TILE128: gl.constexpr, POW2: gl.constexpr, RCEIL: gl.constexpr,
                            STAGES: gl.constexpr, num_warps: gl.constexpr):
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES, ROWS, COLUMNS],
                                       gl.NVMMASharedLayout.get_default_for([ROWS, COLUMNS], w_desc.dtype))
    out_c = gl.allocate_shared_memory(gl.float8e4nv, [2, ROWS, COLUMNS],
                                      gl.NVMMASharedLayout.get_default_for([ROWS, COLUMNS], gl.float8e4nv))
    out_r = gl.allocate_shared_memory(gl.float8e4nv, [2, COLUMNS, ROWS],
                                      gl.NVMMASharedLayout.get_default_for([COLUMNS, ROWS], gl.float8e4nv))
    ready, empty = stage_barriers(STAGES)
    if TILE128:
        gl.warp_specialize([
            (_tile128_compute, (w_bufs, ready, empty, out_c, out_r, c_desc, r_desc,
                                scale_c_ptr, stride_sce, stride_scr, stride_scb, E, R, C, POW2, STAGES)),
            (_loader, (w_desc, w_bufs, ready, empty, E, R, C, 2, STAGES)),
        ], [LOADER_WARPS], [40])
    else:
        gl.warp_specialize([
            (_mx_compute, (w_bufs, ready, empty, out_c, out_r, c_desc, r_desc,
                           scale_c_ptr, stride_sce, stride_scr, stride_scb,
                           scale_r_ptr, stride_sre, stride_srb, stride_src, E, R, C, RCEIL, STAGES)),
            (_loader, (w_desc, w_bufs, ready, empty, E, R, C, 1, STAGES)),
        ], [LOADER_WARPS], [40])


_LAUNCH = DirectLaunch(_quantize_weight_kernel)


def _storage_nk(w: torch.Tensor) -> bool | None:
    """Whether ``w [E, K, N]`` is a transposed view of ``[E, N, K]`` storage (K contiguous: True) or is
    stored ``[E, K, N]`` (N contiguous: False); None for neither."""
    if w.stride(2) == 1:
        return False
    if w.stride(1) == 1:
        return True
    return None


def _rows_columns(w: torch.Tensor, data_k: torch.Tensor, data_n: torch.Tensor,
                  nk: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, data_c, data_r)`` as the kernel sees them: w's storage ``x [E, R, C]`` (C contiguous), the data
    along C ``[E, R, C]`` and along R ``[E, C, R]``."""
    if nk:
        return w.transpose(1, 2), data_k.transpose(1, 2), data_n
    return w, data_n, data_k.transpose(1, 2)


def quantize_weight_hopper_ok(w: torch.Tensor, data_k: torch.Tensor, data_n: torch.Tensor,
                              recipe: Recipe) -> bool:
    """Whether the Gluon kernel quantizes ``w [E, K, N]`` into ``data_k`` and ``data_n``
    (``quantize_weight_3d``'s outputs) with ``recipe``: mxfp8 or block128x128, a non-empty 16-bit w
    stored as ``[E, N, K]`` or ``[E, K, N]`` on an sm_90 GPU, w and both outputs readable by TMA as
    stored (for the FP8 outputs: K and N multiples of 16), not under the interpreter."""
    nk = _storage_nk(w)
    if interpreting() or not (recipe.tile or recipe.name == "mxfp8") or nk is None:
        return False
    x, data_c, data_r = _rows_columns(w, data_k, data_n, nk)
    return hopper_kernels_ok(x) and LaunchInfo.tma_ok(data_c) and LaunchInfo.tma_ok(data_r)


def quantize_weight_hopper(w: torch.Tensor, data_k: torch.Tensor, data_n: torch.Tensor, scale_k: torch.Tensor,
                           scale_n: torch.Tensor, recipe: Recipe) -> None:
    """Write ``w [E, K, N]`` quantized along K and along N into ``data_k`` (a view of ``[E, N, K]``
    storage) and ``data_n`` (contiguous), and their scales ``scale_k [E, cdiv(K, 32), N]`` and ``scale_n
    [E, K, cdiv(N, 32)]`` (the raw bytes of mxfp8's E8M0 scales; block128x128: the one fp32 ``[E, cdiv(K,
    128), cdiv(N, 128)]`` passed as both), for operands ``quantize_weight_hopper_ok`` accepts."""
    nk = _storage_nk(w)
    x, data_c, data_r = _rows_columns(w, data_k, data_n, nk)
    # Along C: [E, R, cdiv(C, 32)]; along R: [E, cdiv(R, 32), C]; block128x128's [E, cdiv(R, 128), cdiv(C, 128)].
    scale_c, scale_r = (scale_k.transpose(1, 2), scale_n.transpose(1, 2)) if nk else (scale_n, scale_k)
    E, R, C = x.shape
    tiles = E * cdiv(R, ROWS.value) * cdiv(C, (2 if recipe.tile else 1) * COLUMNS.value)
    grid = (min(tiles, PROGRAMS_PER_SM * launch_info(w.device).num_programs),)
    _LAUNCH(grid, w_desc=descriptor(x, [1, ROWS.value, COLUMNS.value]),
            c_desc=descriptor(data_c, [1, ROWS.value, COLUMNS.value]),
            r_desc=descriptor(data_r, [1, COLUMNS.value, ROWS.value]),
            scale_c_ptr=scale_c, stride_sce=scale_c.stride(0), stride_scr=scale_c.stride(1),
            stride_scb=scale_c.stride(2), scale_r_ptr=scale_r, stride_sre=scale_r.stride(0),
            stride_srb=scale_r.stride(1), stride_src=scale_r.stride(2), E=E, R=R, C=C, TILE128=recipe.tile,
            POW2=recipe.pow2, RCEIL=recipe.mx_rounding == "rceil", STAGES=STAGES, num_warps=COMPUTE_WARPS,
            maxnreg=MAX_REGISTERS)
