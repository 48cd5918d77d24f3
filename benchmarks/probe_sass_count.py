"""SASS instructions per element of the Gluon quantizers' compute loops, compiled for sm_90 on any machine
(no GPU needed: ``triton.compile`` with an sm_90 target, then ``cuobjdump`` from Triton's bundled tools).

    PYTHONPATH=src python benchmarks/probe_sass_count.py

For each kernel (the per-group quantizer's blockwise tiles, block128 and mxfp8; the weight kernel, mxfp8
and block128x128), the compute partition's persistent loop is the longest backward branch's span; it
prints, per element of a thread's share of a tile (64 elements: ``[128, 64]`` tiles over 128 compute
threads), that span's instructions and those from the tile's stage wait to its TMA stores, both less the
divisions' slow paths, and the tile part's commonest opcodes. Both still hold paths a full tile
skips (the loop: the slot lookup and the tiles with no rows; the tile part: the mask of a group's last
tile), so they bound what a full tile runs from above.
"""

from __future__ import annotations

import collections
import re
import subprocess
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

from dropless.kernels import quantize_hopper, quantize_weight_hopper

CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
ELEMENTS = 64  # a compute thread's elements of a [128, 64] tile
LINE = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def desc(dtype: str, shape: list[int], gl_dtype) -> str:
    """A Gluon TMA descriptor's signature type: ``dtype[shape]`` with its default swizzled layout."""
    return f"tensordesc<{dtype}[{', '.join(map(str, shape))}],{gl.NVMMASharedLayout.get_default_for(shape, gl_dtype)!r}>"


def compile_sass(fn, signature: dict[str, str], constants: dict[str, object], num_warps: int) -> str:
    names = list(signature)
    consts = {(names.index(k),): v for k, v in constants.items()}
    kernel = triton.compile(GluonASTSource(fn, signature, consts), target=GPUTarget("cuda", 90, 32),
                            options=dict(num_warps=num_warps, maxnreg=128))
    path = Path("/tmp/dropless_sass.cubin")
    path.write_bytes(kernel.asm["cubin"])
    return subprocess.run([str(CUOBJDUMP), "-sass", str(path)], capture_output=True, text=True, check=True).stdout


def loop_histogram(sass: str) -> tuple[collections.Counter, collections.Counter]:
    """The opcodes of the longest backward branch's span (the loop) and of the tile's part of it, from its
    first stage wait to its last TMA store, both less the divisions' slow paths (each a ``BSSY`` .. ``BSYNC`` region holding a ``CALL``: the
    scales' reciprocals, run for operands the fast path cannot take)."""
    code = []
    for line in sass.splitlines():
        m = LINE.match(line)
        if m:
            tokens = m.group(2).split()
            op = tokens[1] if tokens[0].startswith("@") else tokens[0]
            target = re.search(r"BRA (?:!?U?P\w+, )?0x([0-9a-f]+)", m.group(2))
            code.append((int(m.group(1), 16), op.split(".")[0], int(target.group(1), 16) if target else None))
    spans = [(a - t, t, a) for a, _, t in code if t is not None and t < a]
    _, first, last = max(spans)
    fallback, region = set(), None
    for a, op, _ in code:
        if op == "BSSY":
            region = [a]
        elif region is not None:
            region.append(a)
            if op == "BSYNC":
                if any(o == "CALL" for b, o, _ in code if region[0] <= b <= a):
                    fallback.update(region)
                region = None
    def count(lo: int, hi: int) -> collections.Counter:
        return collections.Counter(op for a, op, _ in code if lo <= a <= hi and a not in fallback)

    loop = count(first, last)
    waits = [a for a, op, _ in code if first <= a <= last and op == "SYNCS"]
    stores = [a for a, op, _ in code if first <= a <= last and op == "UTMASTG"]
    return loop, count(waits[0], stores[-1])


def group_kernel(recipe: str) -> str:
    mx = recipe == "mxfp8"
    signature = dict(
        x_desc=desc("bf16", [128, 64], gl.bfloat16), x_ptr="*bf16", rows_ptr="*bf16", stride_x="i32",
        data_desc=desc("fp8e4nv", [64, 128], gl.float8e4nv), scale_ptr="*u8" if mx else "*fp32", work_ptr="*i32",
        offsets_ptr="*i32", M="i32", C="i32", E="i32", SLOTS="i32", SCALE_ROWS="i32", CHUNK="i32",
        **{k: "constexpr" for k in ("BLOCK", "MX", "POW2", "RCEIL", "GATHER", "BOUNDED", "BY_WORK", "E_POW2",
                                    "STAGES", "LOADERS", "THREAD_ROWS", "num_warps")})
    constants = dict(BLOCK=32 if mx else 128, MX=mx, POW2=False, RCEIL=False, GATHER=False, BOUNDED=False,
                     BY_WORK=False, E_POW2=256, STAGES=quantize_hopper.STAGES,
                     LOADERS=quantize_hopper.TMA_LOADER_WARPS, THREAD_ROWS=quantize_hopper.TILE_THREAD_ROWS,
                     num_warps=4)
    return compile_sass(quantize_hopper._quantize_groups_kernel, signature, constants, 4)


def weight_kernel(recipe: str) -> str:
    scale = "*u8" if recipe == "mxfp8" else "*fp32"
    signature = dict(
        w_desc=desc("bf16", [1, 128, 64], gl.bfloat16), c_desc=desc("fp8e4nv", [1, 128, 64], gl.float8e4nv),
        r_desc=desc("fp8e4nv", [1, 64, 128], gl.float8e4nv), scale_c_ptr=scale, stride_sce="i32",
        stride_scr="i32", stride_scb="i32", scale_r_ptr=scale, stride_sre="i32", stride_srb="i32",
        stride_src="i32", E="i32", R="i32", C="i32",
        **{k: "constexpr" for k in ("TILE128", "POW2", "RCEIL", "STAGES", "num_warps")})
    constants = dict(TILE128=recipe == "block128x128", POW2=False, RCEIL=False, STAGES=quantize_weight_hopper.STAGES,
                     num_warps=quantize_weight_hopper.COMPUTE_WARPS)
    return compile_sass(quantize_weight_hopper._quantize_weight_kernel, signature, constants,
                        quantize_weight_hopper.COMPUTE_WARPS)


def main() -> None:
    # block128x128's loop walks a 128x128 tile (two halves) an iteration: 128 elements a thread.
    cases = [("per group, block128", group_kernel("block128"), ELEMENTS),
             ("per group, mxfp8", group_kernel("mxfp8"), ELEMENTS),
             ("weight, mxfp8", weight_kernel("mxfp8"), ELEMENTS),
             ("weight, block128x128", weight_kernel("block128x128"), 2 * ELEMENTS)]
    for name, sass, elements in cases:
        loop, tile = loop_histogram(sass)
        common = ", ".join(f"{op} {n / elements:.2f}" for op, n in tile.most_common(12))
        print(f"{name:22s} an element: loop {loop.total() / elements:5.1f}, tile {tile.total() / elements:5.1f} | "
              f"{common}", flush=True)


if __name__ == "__main__":
    main()
