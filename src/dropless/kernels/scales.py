"""Scales of FP8 operands inside the grouped GEMM kernels: fp32 values or E8M0 bytes.

An E8M0 scale (MXFP8) is one byte holding a biased exponent: ``2**(byte - 127)``, with 255 meaning NaN.
The kernels take such scales as a uint8 view and build the fp32 value from its bits, which is exact
(``exp2`` on the GPU is an approximation). The smallest, ``2**-127``, is an fp32 subnormal: its bits
are not the byte shifted into the exponent field, so it is set apart.

``SCALE_EPILOGUE`` and ``SCALE_PER_STEP`` name where a kernel applies the scales: once to the finished
fp32 accumulator (scales constant along the reduction), or to the partial product of each reduction
step before it is added to the accumulator (scales that change along the reduction, DeepGEMM's
promotion).
"""

import triton
import triton.language as tl

SCALE_EPILOGUE, SCALE_PER_STEP = tl.constexpr(0), tl.constexpr(1)
FP8_MIN_STEP = 32  # the reduction depth of one FP8 tensor-core instruction: the shortest step

_E8M0_MIN = tl.constexpr(2.0**-127)


@triton.jit
def load_scale(ptrs, mask, E8M0: tl.constexpr):
    """The fp32 scales at ``ptrs`` (fp32, or E8M0 bytes when ``E8M0``); 1 where ``mask`` is off.

    Masked-off scales multiply zero-filled operands, so 1 keeps them zero whatever lies behind them.
    """
    if E8M0:
        bits = tl.load(ptrs, mask=mask, other=127).to(tl.int32)
        value = (bits << 23).to(tl.float32, bitcast=True)
        value = tl.where(bits == 0, _E8M0_MIN, value)
        return tl.where(bits == 255, float("nan"), value)
    return tl.load(ptrs, mask=mask, other=1.0).to(tl.float32)
