"""Candidate tile configurations of the grouped GEMM kernels, and the config each call runs with."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from dropless.kernels.autotune import Autotuner, problem_class
from dropless.kernels.config import GemmConfig
from dropless.kernels.launch import (LaunchInfo, cdiv, hopper_fp8_wgrad_ok, hopper_kernels_ok, hopper_wgrad_ok,
                                     launch_info, weight_nk)
from dropless.kernels.padded import readable, run_into_readable
from dropless.kernels.ragged_k import oriented, ragged_k_mm
from dropless.kernels.ragged_k_fp8 import ragged_k_fp8_mm
from dropless.kernels.ragged_m import ragged_m_mm
from dropless.kernels.ragged_m_fp8 import ragged_m_fp8_mm, scale_map

# Output tile BLOCK_M x BLOCK_N, reduction step BLOCK_K. Measured winners on an H100 (benchmarks/NOTES.md):
# flattened 128x256 tiles for short K, warp-specialized ones with TMA stores for long K, two 128x128
# programs per SM for some transposed layouts; the small tiles are what fits fp32 operands.
_RAGGED_M = Autotuner(
    "ragged_m",
    candidates=[
        GemmConfig(128, 256, 64, num_warps=8, num_stages=4, flatten=True),
        GemmConfig(128, 256, 64, num_warps=8, num_stages=3, flatten=True),
        GemmConfig(128, 256, 64, num_warps=8, num_stages=3, warp_specialize=True, tma_store=True),
        GemmConfig(128, 256, 64, num_warps=8, num_stages=3, warp_specialize=True),
        GemmConfig(128, 128, 64, num_warps=4, num_stages=3, flatten=True, programs_per_sm=2),
        GemmConfig(64, 256, 64, num_warps=4, num_stages=4, flatten=True),
        GemmConfig(64, 128, 32, num_warps=4, num_stages=3),
    ],
    default=GemmConfig(128, 256, 64, num_warps=8, num_stages=4, flatten=True),
    small_default=GemmConfig(64, 128, 32, num_warps=4, num_stages=3),
    interpreter_config=GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1),
)

# Output tile BLOCK_K x BLOCK_N of dw[e], reduction step BLOCK_M rows.
_RAGGED_K = Autotuner(
    "ragged_k",
    candidates=[
        GemmConfig(64, 256, 128, num_warps=8, num_stages=4, flatten=True),
        GemmConfig(64, 256, 128, num_warps=8, num_stages=4),
        GemmConfig(64, 256, 128, num_warps=8, num_stages=3, warp_specialize=True, tma_store=True),
        GemmConfig(64, 256, 128, num_warps=8, num_stages=3, by_work=True, tma_store=True),
        GemmConfig(64, 128, 128, num_warps=4, num_stages=3, programs_per_sm=2),
        GemmConfig(64, 128, 128, num_warps=8, num_stages=3, flatten=True, programs_per_sm=2),
        GemmConfig(32, 128, 64, num_warps=4, num_stages=3),
    ],
    default=GemmConfig(64, 256, 128, num_warps=8, num_stages=4, flatten=True),
    small_default=GemmConfig(32, 128, 64, num_warps=4, num_stages=3),
    interpreter_config=GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1),
)


# On Hopper, 16-bit operands that TMA can read: the warp-specialized Gluon kernel, with 3 stages and
# the whole output tile staged in shared memory (the default) or with 4 stages and the tile leaving in
# halves, and the two Triton configs that win some classes. In one probe run 4 stages were 1.07-1.09x
# the 3 at mixtral, 1.00-1.12x at qwen3 and 0.93-1.06x at dsv3 and gpt-oss; the better Triton config
# was 0.91-1.07x the better Gluon one (benchmarks/NOTES.md, v5), and the tuner picked the
# warp-specialized one for two of the four Mixtral MoE classes. The 32-deep Gluon config (0.83-1.03x)
# and the 128x128 Triton tiles (never picked in a benchmark run) are no longer candidates. 64-row tiles
# for groups of a few rows (decode: at most 16 rows an expert), where a 128-row tile is mostly empty:
# 0.91-0.97x the tuned time at Mixtral's decode shapes in one probe (benchmarks/NOTES.md, v33).
_RAGGED_M_HOPPER = Autotuner(
    "ragged_m_hopper",
    candidates=[
        GemmConfig(128, 256, 64, num_warps=8, num_stages=3, gluon=True),
        GemmConfig(128, 256, 64, num_warps=8, num_stages=4, gluon=True),
        GemmConfig(128, 256, 64, num_warps=8, num_stages=4, flatten=True),
        GemmConfig(128, 256, 64, num_warps=8, num_stages=3, warp_specialize=True, tma_store=True),
        GemmConfig(64, 256, 64, num_warps=4, num_stages=4, gluon=True),
        GemmConfig(64, 256, 64, num_warps=4, num_stages=4, flatten=True),
    ],
    default=GemmConfig(128, 256, 64, num_warps=8, num_stages=3, gluon=True),
)

# On Hopper, products whose rows, all in one group, would make fewer 128x256 tiles than the GPU has
# multiprocessors (a decode step: a few rows an expert, thousands of K). The routing decides how many
# tiles there are, and one step's routing says little of the next's: these classes time each candidate
# on the call's group sizes and with every row in one group, and keep the best over both. Five configs
# split K over up to 4 programs, chosen on the device where the tiles are at most half the programs
# (unsplit otherwise). In one probe (benchmarks/NOTES.md, v40) the Gluon 64x128 split config on 6 stages,
# the default, was the best or within 3% of it on 19 of the 24 decode passes, every balanced one among
# them; on three of dsv3's all-to-one passes and two of qwen3-down's, 64x256 and 128x256 tiles lead (by up
# to 1.27x). With the tuner's choice every pass was 1.01-1.54x torch._grouped_mm, on the GPU alone. The
# Triton 64x128 split config is the untimed default for an fp32 output (out_dtype).
SPLIT_K = GemmConfig(64, 128, 64, num_warps=4, num_stages=6, gluon=True, split_k=4)
TRITON_SPLIT_K = GemmConfig(64, 128, 64, num_warps=4, num_stages=4, split_k=4)
_RAGGED_M_HOPPER_FEW_TILES = Autotuner(
    "ragged_m_hopper_few_tiles",
    candidates=[SPLIT_K, TRITON_SPLIT_K, GemmConfig(64, 256, 64, num_warps=8, num_stages=4, split_k=4),
                GemmConfig(64, 256, 64, num_warps=4, num_stages=4, gluon=True, split_k=4),
                GemmConfig(128, 256, 64, num_warps=8, num_stages=3, gluon=True, split_k=4),
                *_RAGGED_M_HOPPER.candidates],
    default=SPLIT_K, small_default=TRITON_SPLIT_K)


def few_tiles(M: int, N: int, programs: int) -> bool:
    """Whether ``M`` rows in one group make fewer 128x256 output tiles of ``N`` columns than ``programs``."""
    return cdiv(M, 128) * cdiv(N, 256) < programs


# On Hopper, 16-bit operands written without accumulation: the Gluon kernel, 1.0-1.3x the best Triton
# config on every shape measured. 32-row steps in 6 stages win with short groups (many experts), 64-row
# steps in 3 stages with long ones. The by-work schedule (tiles from a counter, largest groups first)
# is 1.16-1.23x the static one with skewed routing at qwen3 and within noise elsewhere, balanced
# routing included (benchmarks/NOTES.md, v4): real routing is rarely balanced, so it is the default,
# kept unless a static config is clearly faster on the call a class is timed on.
_RAGGED_K_HOPPER = Autotuner(
    "ragged_k_hopper",
    candidates=[
        GemmConfig(32, 256, 128, num_warps=8, num_stages=6, by_work=True, gluon=True),
        GemmConfig(64, 256, 128, num_warps=8, num_stages=3, by_work=True, gluon=True),
        GemmConfig(32, 256, 128, num_warps=8, num_stages=6, gluon=True),
        GemmConfig(64, 256, 128, num_warps=8, num_stages=3, gluon=True),
    ],
    default=GemmConfig(32, 256, 128, num_warps=8, num_stages=6, by_work=True, gluon=True),
)

# The same kernel adding into (or writing) an fp32 main_grad: 128x128 output tiles, whose fp32 copy in
# shared memory (64 KB) and current values in registers fit beside a deep stage ring.
_RAGGED_K_HOPPER_ACCUMULATE = Autotuner(
    "ragged_k_hopper_accumulate",
    candidates=[
        GemmConfig(32, 128, 128, num_warps=8, num_stages=8, by_work=True, gluon=True),
        GemmConfig(64, 128, 128, num_warps=8, num_stages=4, by_work=True, gluon=True),
        GemmConfig(32, 128, 128, num_warps=8, num_stages=8, gluon=True),
        GemmConfig(64, 128, 128, num_warps=8, num_stages=4, gluon=True),
    ],
    default=GemmConfig(32, 128, 128, num_warps=8, num_stages=8, by_work=True, gluon=True),
)


# FP8 operands (Hopper's FP8 tensor cores, both operands K-major): a stage holds half the bytes of a
# 16-bit one, so steps are 128 deep. Where each step's product is promoted into the fp32 accumulator,
# the step's product and the accumulator both live in registers: 128x128 tiles over 8 warps hold 64 + 64
# registers a thread, 128x256 ones would spill (DeepGEMM reaches 128x256 with setmaxnreg, which plain
# Triton lacks). One H100 probe (M=16384, K=4096, N=2048, E=8, bf16 out; 16-bit kernel 724 TFLOP/s):
# rowwise 826 TFLOP/s promoted, 1167 with fast accumulation; block128 589 warp-specialized, 329-423
# flattened; mxfp8 120 unflattened with 3 stages, 5-50 flattened with 4-8 stages (flattening a loop
# that loads scales every step collapses it).
_RAGGED_M_FP8 = Autotuner(
    "ragged_m_fp8",
    candidates=[
        GemmConfig(128, 128, 128, num_warps=8, num_stages=4, flatten=True),
        GemmConfig(128, 128, 128, num_warps=8, num_stages=5, flatten=True),
        GemmConfig(128, 128, 128, num_warps=8, num_stages=4, warp_specialize=True, tma_store=True),
        GemmConfig(64, 128, 128, num_warps=4, num_stages=4, flatten=True),
    ],
    default=GemmConfig(128, 128, 128, num_warps=8, num_stages=4, flatten=True),
    interpreter_config=GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1),
)

# Scales in the epilogue with fast accumulation: one accumulator, so the 16-bit kernels' 128x256 tiles.
# A flattened loop keeps its stages alive through the epilogue, beside the fp32 tile it reshapes on the
# way out (128 KB at 128x256): 64-deep stages are what leave room for an fp32 output.
_RAGGED_M_FP8_FAST = Autotuner(
    "ragged_m_fp8_fast",
    candidates=[
        GemmConfig(128, 256, 64, num_warps=8, num_stages=4, flatten=True),
        GemmConfig(128, 256, 128, num_warps=8, num_stages=3, flatten=True),
        GemmConfig(128, 256, 128, num_warps=8, num_stages=3, warp_specialize=True, tma_store=True),
        GemmConfig(128, 128, 128, num_warps=8, num_stages=4, flatten=True),
        GemmConfig(128, 128, 128, num_warps=4, num_stages=3, flatten=True, programs_per_sm=2),
    ],
    default=GemmConfig(128, 256, 64, num_warps=8, num_stages=4, flatten=True),
    interpreter_config=GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1),
)

# Scales promoted every 128 or more along K (1x128 activations, 128x128 weight tiles).
_RAGGED_M_FP8_STEP128 = Autotuner(
    "ragged_m_fp8_step128",
    candidates=[
        GemmConfig(128, 128, 128, num_warps=8, num_stages=4, warp_specialize=True, tma_store=True),
        GemmConfig(128, 128, 128, num_warps=8, num_stages=3, warp_specialize=True, tma_store=True),
        GemmConfig(128, 128, 128, num_warps=8, num_stages=3),
        GemmConfig(64, 128, 128, num_warps=4, num_stages=4, flatten=True),
    ],
    default=GemmConfig(128, 128, 128, num_warps=8, num_stages=4, warp_specialize=True, tma_store=True),
    interpreter_config=GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1),
)

# Scales promoted every 32 along K (MXFP8's 1x32 blocks, emulated on Hopper): one tensor-core
# instruction deep per step.
_RAGGED_M_FP8_STEP32 = Autotuner(
    "ragged_m_fp8_step32",
    candidates=[
        GemmConfig(128, 128, 32, num_warps=8, num_stages=3),
        GemmConfig(128, 128, 32, num_warps=8, num_stages=4),
        GemmConfig(128, 128, 32, num_warps=8, num_stages=6, warp_specialize=True, tma_store=True),
        GemmConfig(64, 128, 32, num_warps=4, num_stages=3),
    ],
    default=GemmConfig(128, 128, 32, num_warps=8, num_stages=3),
    interpreter_config=GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1),
)

# Output tile BLOCK_K x BLOCK_N of dw[e], reduction step BLOCK_M tokens, each step's product promoted
# (token blocks of 128, or one scale per group with precise accumulation): 128x128 output tiles. The same
# H100 probe (M=16384, K=N=2048, E=8): rowwise 677 TFLOP/s promoted, 1008 with fast accumulation;
# blockwise scales then took the pointer path (groups started anywhere along the tokens, where TMA
# cannot read): 64-66 TFLOP/s. Groups now start aligned in the data and every recipe reads through
# TMA; these candidates were chosen before that and are not yet measured on it.
_RAGGED_K_FP8 = Autotuner(
    "ragged_k_fp8",
    candidates=[
        GemmConfig(128, 128, 128, num_warps=8, num_stages=4, by_work=True),
        GemmConfig(64, 128, 128, num_warps=8, num_stages=6, by_work=True),
        GemmConfig(128, 128, 128, num_warps=8, num_stages=4),
        GemmConfig(128, 128, 128, num_warps=8, num_stages=3, by_work=True, tma_store=True),
    ],
    default=GemmConfig(128, 128, 128, num_warps=8, num_stages=4, by_work=True),
    interpreter_config=GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1),
)

# One scale per group with fast accumulation: 128x256 output tiles, 48 KB stages of 128 tokens.
_RAGGED_K_FP8_FAST = Autotuner(
    "ragged_k_fp8_fast",
    candidates=[
        GemmConfig(128, 256, 128, num_warps=8, num_stages=4, by_work=True),
        GemmConfig(128, 256, 128, num_warps=8, num_stages=4),
        GemmConfig(64, 256, 128, num_warps=8, num_stages=6, by_work=True),
        GemmConfig(128, 256, 128, num_warps=8, num_stages=3, by_work=True, tma_store=True),
        GemmConfig(128, 128, 128, num_warps=8, num_stages=4, by_work=True),
    ],
    default=GemmConfig(128, 256, 128, num_warps=8, num_stages=4, by_work=True),
    interpreter_config=GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1),
)

# One scale per group on Hopper: the warp-specialized Gluon kernel (ragged_k_hopper.py) on tokens-major
# FP8 stages, 128 or 64 tokens deep. Written in 16 bits: 128x256 output tiles (64 KB staged for the
# store) beside 144 KB of stages; added into (or written as) fp32: 128x128 tiles, 64 KB staged.
_RAGGED_K_FP8_HOPPER = Autotuner(
    "ragged_k_fp8_hopper",
    candidates=[
        GemmConfig(128, 256, 128, num_warps=8, num_stages=3, by_work=True, gluon=True),
        GemmConfig(64, 256, 128, num_warps=8, num_stages=6, by_work=True, gluon=True),
        GemmConfig(128, 256, 128, num_warps=8, num_stages=3, gluon=True),
        GemmConfig(64, 256, 128, num_warps=8, num_stages=6, gluon=True),
    ],
    default=GemmConfig(128, 256, 128, num_warps=8, num_stages=3, by_work=True, gluon=True),
)
_RAGGED_K_FP8_HOPPER_ACCUMULATE = Autotuner(
    "ragged_k_fp8_hopper_accumulate",
    candidates=[
        GemmConfig(128, 128, 128, num_warps=8, num_stages=4, by_work=True, gluon=True),
        GemmConfig(64, 128, 128, num_warps=8, num_stages=8, by_work=True, gluon=True),
        GemmConfig(128, 128, 128, num_warps=8, num_stages=4, gluon=True),
    ],
    default=GemmConfig(128, 128, 128, num_warps=8, num_stages=4, by_work=True, gluon=True),
)

# Token blocks of 32 (MXFP8): 32-row steps.
_RAGGED_K_FP8_STEP32 = Autotuner(
    "ragged_k_fp8_step32",
    candidates=[
        GemmConfig(32, 128, 128, num_warps=8, num_stages=8, by_work=True),
        GemmConfig(32, 128, 128, num_warps=8, num_stages=6, by_work=True),
        GemmConfig(32, 128, 128, num_warps=8, num_stages=8),
        GemmConfig(32, 128, 64, num_warps=4, num_stages=8, by_work=True),
    ],
    default=GemmConfig(32, 128, 128, num_warps=8, num_stages=8, by_work=True),
    interpreter_config=GemmConfig(32, 32, 32, group_m=2, num_warps=4, num_stages=1),
)


def _fp8_tuner(step: int | None, fast_accum: bool, fast: Autotuner, promoted: Autotuner, step128: Autotuner,
               step32: Autotuner) -> Autotuner:
    """The tuner for a promotion ``step`` along the reduction (None: scales in the epilogue, promoted
    into fp32 every BLOCK_K unless ``fast_accum``)."""
    if step is None:
        return fast if fast_accum else promoted
    return step128 if step >= 128 else step32


FP8_TUNERS = (_RAGGED_M_FP8, _RAGGED_M_FP8_FAST, _RAGGED_M_FP8_STEP128, _RAGGED_M_FP8_STEP32, _RAGGED_K_FP8,
              _RAGGED_K_FP8_FAST, _RAGGED_K_FP8_HOPPER, _RAGGED_K_FP8_HOPPER_ACCUMULATE, _RAGGED_K_FP8_STEP32)


class _Decisions(dict):
    """The launch facts, tuner and problem class of a product decided once per call signature on a GPU,
    so a repeated call skips the checks that decide them (tens of microseconds of host time a call)."""

    def decide(self, a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, tma: bool | None, extra: Hashable,
               make: Callable[[], tuple]) -> tuple:
        """``make()``'s result, kept per signature: the operands' shapes, strides, dtypes, device and
        16-byte alignment (what TMA needs), ``tma`` and ``extra``. Computed afresh off the GPU."""
        if not a.is_cuda:
            return make()
        signature = (a.shape, a.stride(), b.shape, b.stride(), c.shape, c.stride(), a.dtype, b.dtype, c.dtype, a.device,
                     a.data_ptr() % 16, b.data_ptr() % 16, c.data_ptr() % 16, tma, extra)
        decided = self.get(signature)
        if decided is None:
            if len(self) >= 4096:
                self.clear()
            decided = self[signature] = make()
        return decided


_RAGGED_M_CLASSES = _Decisions()
_RAGGED_K_CLASSES = _Decisions()


def run_ragged_m(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, c: torch.Tensor,
                 tma: bool | None = None, config: GemmConfig | None = None, tail: bool = True) -> None:
    """``c = ragged-M product of a [M, K] and b [E, K, N]`` with the tuned config of its class, or
    with ``config`` (a Gluon one only where ``hopper_kernels_ok`` holds); ``tail=False`` leaves c's rows
    past ``offsets[-1]`` as they are instead of zeroing them. On Hopper, an operand that TMA cannot read
    (rows not a multiple of 16 bytes) goes through a padded copy, and then so does an output that TMA
    cannot write (``kernels/padded.py``)."""
    def decide() -> tuple:
        info = launch_info(a.device, tma)
        b_stored = b.transpose(1, 2) if weight_nk(b) else b
        hopper = info.tma and hopper_kernels_ok(a, b_stored, c)
        # Padded copies where an operand is what keeps the Hopper kernels out (kernels/padded.py).
        padded = (info.tma and not hopper and hopper_kernels_ok(a, b_stored, c, padded=True)
                  and not (LaunchInfo.tma_ok(a) and LaunchInfo.tma_ok(b_stored)))
        key = problem_class(a.device, a.dtype, c.dtype, b.stride(1) == 1, info.tma, a.shape[1], b.shape[2],
                            b.shape[0], M=a.shape[0])
        tuner = _RAGGED_M
        if hopper:
            few = few_tiles(a.shape[0], b.shape[2], info.num_programs)
            tuner = _RAGGED_M_HOPPER_FEW_TILES if few else _RAGGED_M_HOPPER
        return info, tuner, key, padded

    info, tuner, key, padded = _RAGGED_M_CLASSES.decide(a, b, c, tma, (), decide)
    if padded:
        b_read = readable(b.transpose(1, 2)).transpose(1, 2) if weight_nk(b) else readable(b)
        a_read = readable(a)
        run_into_readable(c, not tail, lambda out: run_ragged_m(a_read, b_read, offsets, out, tma, config, tail))
        return

    def run(config: GemmConfig, out: torch.Tensor = c, groups: torch.Tensor = offsets) -> None:
        if config.gluon:
            # Imported on first use: the Gluon kernels need Triton 3.6 (hopper_kernels_ok checks).
            from dropless.kernels.ragged_m_hopper import ragged_m_mm_hopper
            ragged_m_mm_hopper(a, b, groups, out, config, info.num_programs, tail=tail)
        else:
            ragged_m_mm(a, b, groups, out, config, info, tail)

    flops = 2 * a.shape[0] * a.shape[1] * b.shape[2]
    # An fp32 c of 16-bit operands (out_dtype) needs the small tiles' shared memory too: the epilogue
    # stages a whole fp32 output tile, which beside the default's 4 stages is past the 227 KiB of an SM.
    element_size = max(a.element_size(), c.element_size())
    also = None
    if config is None and tuner is _RAGGED_M_HOPPER_FEW_TILES:
        def also(cfg: GemmConfig) -> None:
            run(cfg, torch.empty_like(c), torch.full_like(offsets, a.shape[0]))
    config = config or tuner.choose(key, a.device, element_size, flops, lambda cfg: run(cfg, torch.empty_like(c)), also)
    run(config)


def run_ragged_k(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, c: torch.Tensor,
                 accumulate: int, flags: torch.Tensor | None, tma: bool | None = None,
                 config: GemmConfig | None = None) -> None:
    """``c[e] (+)= a_e^T @ b_e`` for a [M, K], b [M, N], c [E, K, N], with the tuned config of its
    class, or with ``config`` (a Gluon one only where ``hopper_kernels_ok`` holds). On Hopper, an
    operand that TMA cannot read goes through a padded copy, and then so does an output that TMA cannot
    write (``kernels/padded.py``)."""
    a, b, c = oriented(a, b, c)
    def decide() -> tuple:
        info = launch_info(a.device, tma)
        hopper = info.tma and hopper_wgrad_ok(a, b, c)
        if hopper:
            tuner = _RAGGED_K_HOPPER if c.dtype == a.dtype and not accumulate else _RAGGED_K_HOPPER_ACCUMULATE
        else:
            tuner = _RAGGED_K
        key = problem_class(a.device, a.dtype, c.dtype, info.tma, a.shape[1], b.shape[1], c.shape[0], M=a.shape[0])
        padded = (info.tma and not hopper and hopper_wgrad_ok(a, b, c, padded=True)
                  and not (LaunchInfo.tma_ok(a) and LaunchInfo.tma_ok(b)))
        return info, tuner, key, padded

    info, tuner, key, padded = _RAGGED_K_CLASSES.decide(a, b, c, tma, accumulate != 0, decide)
    if padded:
        a_read, b_read = readable(a), readable(b)
        run_into_readable(c, accumulate != 0, lambda out: run_ragged_k(a_read, b_read, offsets, out, accumulate,
                                                                       flags, tma, config))
        return

    def run(config: GemmConfig, out: torch.Tensor = c) -> None:
        if config.gluon:
            from dropless.kernels.ragged_k_hopper import ragged_k_mm_hopper
            ragged_k_mm_hopper(a, b, offsets, out, accumulate, flags, config, info.num_programs)
        else:
            ragged_k_mm(a, b, offsets, out, accumulate, flags, config, info)

    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    config = config or tuner.choose(key, a.device, a.element_size(), flops, lambda cfg: run(cfg, torch.empty_strided(
        c.shape, c.stride(), dtype=c.dtype, device=c.device)))
    run(config)


def run_ragged_m_fp8(a: torch.Tensor, a_scale: torch.Tensor, a_block: tuple[int | None, int | None],
                     b: torch.Tensor, b_scale: torch.Tensor, b_block: tuple[int | None, int | None],
                     offsets: torch.Tensor, c: torch.Tensor, fast_accum: bool = False, tma: bool | None = None,
                     config: GemmConfig | None = None, tail: bool = True) -> None:
    """``c[s_e:t_e] = (a * sa)[s_e:t_e] @ (b[e] * sb[e])``, zero past ``offsets[-1]`` (left as it is with
    ``tail=False``), with the tuned config of its class or with ``config``; nothing syncs with the host.

    a: float8_e4m3fn ``[M, K]`` (K contiguous for TMA); b: float8_e4m3fn ``[E, K, N]`` (K contiguous, a
    view of ``[E, N, K]`` storage, for TMA); c: ``[M, N]`` bf16, fp16 or fp32; offsets: int32 ``[E]``.
    a_scale: 2D, one scale per ``a_block = (rows, ks)`` block of a; b_scale: 3D ``[E, ., .]``, one per
    ``b_block = (ks, cols)`` block of each expert; any strides, fp32 or E8M0 (``float8_e8m0fnu`` or its
    uint8 view); None spans the whole dim. So, as ``dropless.quantized`` lays them out:
    rowwise ``a_block=(1, None)`` with ``[M, 1]`` and ``b_block=(None, 1)`` with ``[E, 1, N]``; block128
    ``(1, 128)`` with ``[M, cdiv(K, 128)]`` and ``(128, 128)`` with ``[E, cdiv(K, 128), cdiv(N, 128)]``;
    mxfp8 ``(1, 32)`` with ``[M, cdiv(K, 32)]`` and ``(32, 1)`` with ``[E, cdiv(K, 32), N]``. Blocks along
    K are powers of two of at least 32 (ValueError otherwise). fast_accum: see ``ragged_m_fp8_mm``.
    """
    info = launch_info(a.device, tma)
    scales = scale_map(a, a_scale, a_block, b, b_scale, b_block)
    step = scales.step
    tuner = _fp8_tuner(step, fast_accum, _RAGGED_M_FP8_FAST, _RAGGED_M_FP8, _RAGGED_M_FP8_STEP128,
                       _RAGGED_M_FP8_STEP32)
    key = problem_class(a.device, c.dtype, step, fast_accum, b.stride(1) == 1, info.tma, a.shape[1], b.shape[2],
                        b.shape[0], M=a.shape[0])

    def run(config: GemmConfig, out: torch.Tensor = c) -> None:
        ragged_m_fp8_mm(a, a_scale, b, b_scale, scales, offsets, out, config, info, fast_accum, tail)

    flops = 2 * a.shape[0] * a.shape[1] * b.shape[2]
    config = config or tuner.choose(key, a.device, a.element_size(), flops, lambda cfg: run(cfg, torch.empty_like(c)))
    run(config)


def _unit_stride(scale: torch.Tensor) -> torch.Tensor:
    """``scale [rows, cols]`` with unit stride along its columns (K or N), as the Gluon kernels read it."""
    return scale if scale.stride(1) == 1 else scale.contiguous()


def run_ragged_k_fp8(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                     block: int | None, offsets: torch.Tensor, c: torch.Tensor, accumulate: int,
                     flags: torch.Tensor | None, fast_accum: bool = False, tma: bool | None = None,
                     config: GemmConfig | None = None) -> None:
    """``c[e] (+)= (a * sa)[s_e:t_e]^T @ (b * sb)[s_e:t_e]`` with the tuned config of its class or with
    ``config``; nothing syncs with the host. On sm_90, block128 (promoted, no ``config``) runs the Gluon
    kernel ``ragged_k_block128_hopper`` and rowwise with fast accumulation the Gluon ``ragged_k_hopper``.

    a: float8_e4m3fn ``[Mp, K]``, b: float8_e4m3fn ``[Mp, N]``, both quantized per group along the tokens
    of M tokens in E groups as ``dropless.quantized`` lays them out: ``Mp = 128 * (cdiv(M, 128) + E)`` rows,
    group e from row ``128 * (s_e // 128 + e)``, zeros between, the tokens contiguous (views of ``[K, Mp]``
    and ``[N, Mp]`` storage, which TMA reads for every recipe); c: ``[E, K, N]`` bf16 or fp32, any
    strides (a transposed view is computed as ``c^T = b^T a``, so its stores stay along its contiguous
    dim); E is offsets' length and c's first dim. block: tokens per scale block (128 for block128, 32 for
    mxfp8; a power of two of at least 32), None for rowwise. a_scale: ``[E, K]`` (rowwise) or
    ``[cdiv(Mp - 128 E, block) + E, K]``, b_scale likewise with N, laid out as ``dropless.quantized`` says, any
    strides, fp32 or E8M0. accumulate and flags: as ``run_ragged_k``. fast_accum: see ``ragged_k_fp8_mm``.
    """
    if weight_nk(c):
        a, a_scale, b, b_scale, c = b, b_scale, a, a_scale, c.transpose(1, 2)
    info = launch_info(a.device, tma)
    if config is None and info.tma and block == 128 and not fast_accum and hopper_fp8_wgrad_ok(a, b, c):
        from dropless.kernels.ragged_k_block128_hopper import ragged_k_block128_hopper
        ragged_k_block128_hopper(a, _unit_stride(a_scale), b, _unit_stride(b_scale), offsets, c, accumulate, flags,
                                 info.num_programs)
        return
    if info.tma and block is None and fast_accum and hopper_fp8_wgrad_ok(a, b, c):
        written = c.dtype != torch.float32 and not accumulate
        tuner = _RAGGED_K_FP8_HOPPER if written else _RAGGED_K_FP8_HOPPER_ACCUMULATE
    else:
        tuner = _fp8_tuner(block, fast_accum, _RAGGED_K_FP8_FAST, _RAGGED_K_FP8, _RAGGED_K_FP8, _RAGGED_K_FP8_STEP32)
    key = problem_class(a.device, c.dtype, block, fast_accum, accumulate != 0, info.tma, a.shape[1], b.shape[1],
                        c.shape[0], M=a.shape[0])

    def run(config: GemmConfig, out: torch.Tensor = c) -> None:
        if config.gluon:
            from dropless.kernels.ragged_k_hopper import ragged_k_mm_hopper
            scales = (_unit_stride(a_scale), _unit_stride(b_scale))
            ragged_k_mm_hopper(a, b, offsets, out, accumulate, flags, config, info.num_programs, scales)
        else:
            ragged_k_fp8_mm(a, a_scale, b, b_scale, block, offsets, out, accumulate, flags, config, info, fast_accum)

    flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
    config = config or tuner.choose(key, a.device, a.element_size(), flops, lambda cfg: run(cfg, torch.empty_strided(
        c.shape, c.stride(), dtype=c.dtype, device=c.device)))
    run(config)


def hopper_candidates() -> dict[str, list[GemmConfig]]:
    """The configs each tuner chooses from where the Hopper kernels apply: ``ragged_m``, ``ragged_k``
    (written in the operands' dtype) and ``ragged_k_accumulate`` (fp32 output, or added into)."""
    return {"ragged_m": list(_RAGGED_M_HOPPER_FEW_TILES.candidates), "ragged_k": list(_RAGGED_K_HOPPER.candidates),
            "ragged_k_accumulate": list(_RAGGED_K_HOPPER_ACCUMULATE.candidates)}


def tuned_configs() -> dict[str, dict[str, str]]:
    """The configuration chosen so far for each problem class, by kernel: for logs and benchmarks."""
    return {tuner.name: {repr(key): str(config) for key, config in tuner.cache.items()}
            for tuner in (_RAGGED_M, _RAGGED_K, _RAGGED_M_HOPPER, _RAGGED_M_HOPPER_FEW_TILES, _RAGGED_K_HOPPER,
                          _RAGGED_K_HOPPER_ACCUMULATE, *FP8_TUNERS)}
