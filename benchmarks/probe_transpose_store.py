"""What bounds the quantizers that write transposed FP8 tiles (the per-group activations, the weights'
second orientation) at 0.6-0.7 of a copy on an H200: their arithmetic, or the way the data moves?

    PYTHONPATH=src python benchmarks/probe_transpose_store.py

A Gluon kernel that moves the data as ``quantize_hopper``'s per-group kernel does, with no arithmetic but
the cast: persistent programs take contiguous shares of ``[ROWS, COLS]`` tiles of a bf16 ``x [M, K]``
(the column tiles of a row of tiles running fastest), a loader warp brings each into a ring of stages by
TMA, the compute warps read it, cast it to float8_e4m3fn and store it transposed through two output
buffers by TMA into ``[K, M]`` storage: each tile leaves as COLS data rows of ROWS bytes. Timed, replayed
from a CUDA graph, for several tile shapes (ROWS = 256 makes the stored pieces 256 bytes), next to the
per-group block128 quantizer on the same x (balanced groups) and a device copy. GB/s count x read and the
FP8 copy written (3 bytes an element). If the cast-only kernel at ROWS = 128 runs near the quantizer, the
movement bounds both; if a ROWS = 256 tile runs faster, the stored pieces' size is the lever.
"""

from __future__ import annotations

import os

os.environ.setdefault("DROPLESS_AUTOTUNE", "0")

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

import dropless
from dropless.bench.fp8 import hbm_gbps
from dropless.bench.routing import group_sizes
from dropless.bench.timing import graphed_median_ms
from dropless.kernels.hopper import descriptor, stage_barriers
from dropless.kernels.launch import launch_info
from dropless.kernels.quantize_hopper import _send as send
from dropless.kernels.quantize_hopper import take_stage

DEV = torch.device("cuda")
TENSORS = [("qwen3 x", 128, 65536, 2048), ("qwen3-down x", 128, 65536, 768), ("dsv3 dy", 32, 32768, 7168)]
# (ROWS, COLS, STAGES, compute warps, programs a multiprocessor): the quantizer's tile first; 128 registers
# a thread fit two programs of 4 compute warps and a loader warp, one of 8.
SHAPES = [(128, 64, 4, 4, 2), (256, 64, 3, 8, 1), (256, 32, 4, 4, 2), (128, 128, 3, 8, 1), (128, 64, 8, 4, 1)]


@gluon.jit
def _share(tiles):
    """This program's tiles: a contiguous share of them."""
    return gl.program_id(0) * tiles // gl.num_programs(0), (gl.program_id(0) + 1) * tiles // gl.num_programs(0)


@gluon.jit
def _loader(x_desc, bufs, ready, empty, tiles_k, tiles, ROWS: gl.constexpr, COLS: gl.constexpr,
            STAGES: gl.constexpr):
    first, last = _share(tiles)
    for step in range(last - first):
        tile = first + step
        stage = step % STAGES
        mbarrier.wait(empty.index(stage), ((step // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(stage), x_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(x_desc, [(tile // tiles_k) * ROWS, (tile % tiles_k) * COLS],
                                        ready.index(stage), bufs.index(stage))


@gluon.jit
def _cast(bufs, ready, empty, out_bufs, out_desc, tiles_k, tiles, ROWS: gl.constexpr, COLS: gl.constexpr,
          STAGES: gl.constexpr, num_warps: gl.constexpr):
    # The quantizer's thread tile (2 rows x 4 columns, 8 x 4 lanes), the warps across the columns first.
    WC: gl.constexpr = COLS // 16
    layout: gl.constexpr = gl.BlockedLayout([2, 4], [8, 4], [num_warps // WC, WC], [1, 0])
    first, last = _share(tiles)
    for step in range(last - first):
        tile = first + step
        q = take_stage(bufs, ready, empty, step, layout, STAGES).to(gl.float8e4nv)
        send(q, out_bufs, step, out_desc, (tile % tiles_k) * COLS, (tile // tiles_k) * ROWS)
    tma.store_wait(pendings=0)


@gluon.jit
def _cast_transposed_kernel(x_desc, out_desc, tiles_k, tiles, ROWS: gl.constexpr, COLS: gl.constexpr,
                            STAGES: gl.constexpr, num_warps: gl.constexpr):
    bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, ROWS, COLS], x_desc.layout)
    out_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2, COLS, ROWS], out_desc.layout)
    ready, empty = stage_barriers(STAGES)
    gl.warp_specialize([
        (_cast, (bufs, ready, empty, out_bufs, out_desc, tiles_k, tiles, ROWS, COLS, STAGES, num_warps)),
        (_loader, (x_desc, bufs, ready, empty, tiles_k, tiles, ROWS, COLS, STAGES)),
    ], [1], [40])


def cast_transposed(x: torch.Tensor, out: torch.Tensor, shape: tuple[int, int, int, int, int]) -> None:
    """``out [K, M]`` (contiguous) = ``x [M, K]`` cast to FP8, through ``shape``'s tiles (M a multiple of ROWS)."""
    rows, cols, stages, warps, per_sm = shape
    M, K = x.shape
    tiles_k = -(-K // cols)
    tiles = M // rows * tiles_k
    programs = min(tiles, per_sm * launch_info(x.device).num_programs)
    _cast_transposed_kernel[(programs,)](descriptor(x, [rows, cols]), descriptor(out, [cols, rows]), tiles_k, tiles,
                                         ROWS=rows, COLS=cols, STAGES=stages, num_warps=warps, maxnreg=128)


def main() -> None:
    copy = hbm_gbps(DEV, 10, 30)
    print(f"{torch.cuda.get_device_name()}: copy {copy:.0f} GB/s (bytes read + written); shares of it, 3 bytes an element")
    heads = ["quantize block128"] + [f"cast {r}x{c} s{s} w{w} p{p}" for r, c, s, w, p in SHAPES]
    print(f"{'tensor':14s} " + " ".join(f"{h:>22s}" for h in heads))
    for name, E, M, K in TENSORS:
        x = torch.randn(M, K, device=DEV, dtype=torch.bfloat16)
        offsets = torch.tensor(group_sizes(E, M, "balanced", 0, 16), device=DEV).cumsum(0).to(torch.int32)
        out = torch.empty(K, M, device=DEV, dtype=torch.float8_e4m3fn)
        want = x.t().to(torch.float8_e4m3fn)
        cells = [3 * M * K / (graphed_median_ms(lambda: dropless.quantize(x, "block128", dim=0, offsets=offsets),
                                                DEV, 10, 30) / 1e3) / 1e9 / copy]
        for shape in SHAPES:
            try:
                out.view(torch.uint8).fill_(0xFF)
                cast_transposed(x, out, shape)
                same = torch.equal(out.view(torch.uint8), want.view(torch.uint8))
                seconds = graphed_median_ms(lambda: cast_transposed(x, out, shape), DEV, 10, 30) / 1e3
                cells.append(3 * M * K / seconds / 1e9 / copy if same else float("nan"))
            except Exception as error:  # a shape past the device's shared memory or registers
                print(f"  {shape}: {type(error).__name__}: {str(error)[:80]}")
                cells.append(float("nan"))
        print(f"{name:14s} " + " ".join(f"{c:22.3f}" for c in cells), flush=True)
        del x, out, want
    print("nan: the shape did not run, or its bytes differ from x.t() cast")


if __name__ == "__main__":
    main()
