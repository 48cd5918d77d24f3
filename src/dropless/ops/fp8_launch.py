"""From QuantizedTensors to the FP8 kernels: each recipe's scale blocks, and which kernel runs.

A GEMM recipe fixes how its operands' scales are blocked (``dropless.quantized``): the kernels take
the blocks as data. Rowwise products accumulate in the tensor cores' fast FP8 mode and scale once in
the epilogue (as cuBLAS's and CUTLASS's FP8 grouped GEMMs do); blockwise ones promote every block's
partial product into fp32 (DeepGEMM's scheme), which also bounds the accumulation error.
"""

from __future__ import annotations

import torch

from dropless.kernels.config import GemmConfig
from dropless.kernels.launch import LaunchInfo, hopper_gluon_device, launch_info, weight_nk
from dropless.kernels.quantize import scale_bits
from dropless.kernels.tuning import run_ragged_k_fp8, run_ragged_m_fp8
from dropless.quantized import QuantizedTensor

# (rows, ks) blocks of a's scales and (ks, cols) blocks of b's, by the recipe of each operand.
_A_BLOCKS = {"rowwise": (1, None), "block128": (1, 128), "mxfp8": (1, 32)}
_B_BLOCKS = {"rowwise": (None, 1), "block128x128": (128, 128), "mxfp8": (32, 1)}
# The warp-specialized Hopper kernel's FP8 config: 128-deep stages, the whole output tile staged.
GLUON_FP8 = GemmConfig(128, 256, 128, num_warps=8, num_stages=3, gluon=True)


def gluon_ok(a: QuantizedTensor, b: QuantizedTensor, c: torch.Tensor, recipe: str) -> bool:
    """A Hopper Gluon kernel takes the product: a of ``recipe``, an sm_90 GPU, TMA-readable a and K-major b,
    and 16-bit c."""
    return (a.recipe.name == recipe and hopper_gluon_device(a.device) and c.dtype in (torch.bfloat16, torch.float16)
            and weight_nk(b.data) and LaunchInfo.tma_ok(a.data) and LaunchInfo.tma_ok(b.data.transpose(1, 2))
            and LaunchInfo.tma_ok(c) and a.data.numel() > 0)


def launch_ragged_m_fp8(a: QuantizedTensor, b: QuantizedTensor, offsets: torch.Tensor, c: torch.Tensor,
                        config: GemmConfig | None = None, tail: bool = True) -> None:
    """``c = ragged-M product`` of ``a [M, K]`` quantized along K and ``b [E, K, N]`` quantized along K
    (its data K-contiguous), into ``c [M, N]``, its rows past ``offsets[-1]`` zeroed (left alone with
    ``tail=False``); no host sync."""
    if config is None and b.recipe.name == "block128x128" and gluon_ok(a, b, c, "block128"):
        from dropless.kernels.ragged_m_block128_hopper import ragged_m_block128_hopper

        ragged_m_block128_hopper(a.data, a.scale, b.data, b.scale, offsets, c, launch_info(c.device).num_programs,
                                 tail=tail)
        return
    if (config is None or config.gluon) and gluon_ok(a, b, c, "rowwise"):
        from dropless.kernels.ragged_m_hopper import ragged_m_mm_hopper

        # The kernel reads a row's scales and an expert's column scales at unit stride.
        scales = (a.scale.reshape(-1).contiguous(), b.scale.reshape(b.shape[0], -1).contiguous())
        ragged_m_mm_hopper(a.data, b.data, offsets, c, config or GLUON_FP8, launch_info(c.device).num_programs,
                           scales, tail)
        return
    run_ragged_m_fp8(a.data, scale_bits(a.scale), _A_BLOCKS[a.recipe.name], b.data, scale_bits(b.scale), _B_BLOCKS[b.recipe.name],
                     offsets, c, fast_accum=a.recipe.name == "rowwise", config=config, tail=tail)


def launch_ragged_k_fp8(a: QuantizedTensor, b: QuantizedTensor, offsets: torch.Tensor, c: torch.Tensor,
                        accumulate: int, flags: torch.Tensor | None, config: GemmConfig | None = None) -> None:
    """``c[e] (+)= a_e^T b_e`` of ``a`` and ``b`` quantized along the tokens per group (data ``[Mp, K]`` and
    ``[Mp, N]``, each group from a 128-aligned row), into (or added to) ``c [E, K, N]`` (any strides); no
    host sync."""
    run_ragged_k_fp8(a.data, scale_bits(a.scale), b.data, scale_bits(b.scale), a.recipe.block, offsets, c, accumulate, flags,
                     fast_accum=a.recipe.name == "rowwise", config=config)
