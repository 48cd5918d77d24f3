"""The arithmetic of FP8 quantization, shared by the Triton and Gluon kernels that quantize.

    amax  = max |x| over the block                   (a NaN element counts as 0: it stays NaN in the data)
    fp32 recipes:  scale = max(amax / 448, 2**-126)  (correctly rounded; 1 where amax is 0)
                   pow2:  scale = 2**ceil(log2(max(amax / 448, 2**-126)))
    mxfp8 (E8M0):  scale = 2**e, e = floor(log2(amax)) - 8                   ("floor", OCP MX v1.0)
                                 e = ceil(log2(fl(amax / 448)))              ("rceil")
                   clamped to [-127, 127], amax 0 gives 2**-127; stored as the byte e + 127
    data  = e4m3(clamp(x * (1 / scale), -448, 448))  (round to nearest even; NaN stays NaN)

Every exponent is read off the fp32 bits (subnormals included; rceil needs no division). The data is x
times the scale's reciprocal, rounded to fp32 (``div_rn`` once a block), as DeepSeek-V3, torchao and
Transformer Engine quantize: one multiplication an element. For power-of-two scales (pow2, mxfp8) that
is the exact quotient; for the others it is within an fp32 rounding of ``x / scale``, so an element
differs from the rounded quotient's e4m3 value only where ``x / scale`` lies within that rounding of a
midpoint between two e4m3 values. The floor of 2**-126 keeps every reciprocal finite (amax below
448 * 2**-126, about 5e-36, is the only case it changes). The kernels match
``dropless.reference.quantize`` bit for bit. The functions are ``@triton.jit``; Gluon
kernels call the ``gluon_`` forms at the end of this module (``gluon.jit(f.fn)``).
"""

import triton
import triton.language as tl
from triton.experimental import gluon

FP8_MAX = tl.constexpr(448.0)  # float8_e4m3fn's largest finite value
E8M0_ONE = tl.constexpr(127)  # the E8M0 byte of 2**0
FP32_TINY = tl.constexpr(1.1754943508222875e-38)  # 2**-126, fp32's smallest normal value


@triton.jit
def magnitude(v):
    """``|v|`` with NaN as 0, so that a NaN element leaves its block's scale alone (and amax is an
    ordinary non-negative float whose bits order like integers)."""
    return tl.where(v == v, tl.abs(v), 0.0)


@triton.jit
def block_amax(v, axis: tl.constexpr, EMULATE_FP8: tl.constexpr):
    """``max |v|`` along ``axis`` with NaN elements as 0 (``magnitude``'s rule), the rule of the Gluon
    kernels' ``quantize_hopper.column_amax``: on the GPU the reduction's max (IEEE maxNum, PTX ``max.f32``)
    passes over a NaN by itself, and a block of NaN alone, which comes out NaN, is made 0 by a last max
    with 0, one per block instead of a select per element. The interpreter's max propagates NaN: there each
    NaN is made 0 first."""
    if EMULATE_FP8:
        amax = tl.max(magnitude(v), axis=axis)
    else:
        amax = tl.maximum(tl.max(tl.abs(v), axis=axis), 0.0)
    return amax


@triton.jit
def pow2_ceil(s):
    """The smallest power of two ``>= s`` for a normal (or infinite) ``s > 0``, exactly: adding a
    mantissa's worth to the bits carries a non-zero mantissa into the exponent."""
    return ((s.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def block_scale(amax, MX: tl.constexpr, POW2: tl.constexpr, RCEIL: tl.constexpr):
    """The scale of blocks whose largest magnitude is ``amax``: fp32, or the biased E8M0 exponent (int32
    in ``[0, 254]``) when MX."""
    if MX:
        bits = amax.to(tl.int32, bitcast=True)
        # floor(log2(amax)) is the exponent field less 127; a subnormal amax clamps to -127 below.
        biased = (bits >> 23) - 8
        if RCEIL:
            # ceil(log2(fl(amax / 448))) with no division: while the quotient is normal, fl(amax / 448) <= 2**k
            # exactly when amax <= 448 * 2**k = 1.75 * 2**(k + 8), so k is one more than floor's where the
            # mantissa exceeds 1.75's. Where the quotient is subnormal its coarser grid rounds the one
            # amax just above 448 * 2**-127 down to 2**-127; an infinite quotient saturates. (Checked
            # against the division for every fp32 amax.)
            biased += ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
            biased = tl.where(bits == 0x04600001, 0, biased)
            biased = tl.where(bits >= 0x7F800000, 254, biased)
        scale = tl.minimum(tl.maximum(biased, 0), 254)
    else:
        scale = tl.maximum(tl.math.div_rn(amax, FP8_MAX), FP32_TINY)
        if POW2:
            scale = pow2_ceil(scale)
        scale = tl.where(amax > 0.0, scale, 1.0)
    return scale


@triton.jit
def to_e4m3(y, EMULATE_FP8: tl.constexpr):
    """fp32 ``y`` within ``[-448, 448]`` (or NaN) to float8_e4m3fn, rounded to nearest even."""
    if EMULATE_FP8:
        bits = y.to(tl.int32, bitcast=True)
        magnitude = bits & 0x7FFFFFFF
        # |y| >= 2**-6 (normal in e4m3): drop 20 mantissa bits, ties to even, rebias the exponent 127 -> 7.
        normal = ((magnitude + 0x7FFFF + ((magnitude >> 20) & 1)) >> 20) - (120 << 3)
        # Smaller: the subnormal count |y| * 2**9, ties to even, from the 24-bit significand.
        shift = tl.minimum(tl.maximum(141 - (magnitude >> 23), 21), 31)
        significand = (magnitude & 0x7FFFFF) | 0x800000
        count = significand >> shift
        rest = significand & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        count += ((rest > half) | ((rest == half) & ((count & 1) == 1))).to(tl.int32)
        code = tl.where(magnitude < (121 << 23), count, normal)
        code = tl.where(magnitude > 0x7F800000, 0x7F, code) | ((bits >> 24) & 0x80)
        q = code.to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        q = y.to(tl.float8e4nv)
    return q


@triton.jit
def to_fp8(v, scale, MX: tl.constexpr, EMULATE_FP8: tl.constexpr):
    """``e4m3(clamp(v * (1 / scale)))`` for fp32 ``v`` and a ``scale`` shared by many elements that
    broadcasts to it (fp32, or a biased E8M0 exponent when MX): the reciprocal once for each scale, one
    product an element. On the GPU the cast's saturation is the clamp (``cvt.rn.satfinite``: NaN stays
    NaN, anything past +-448 becomes +-448)."""
    if MX:
        # 2**-(scale - 127) is an fp32 (a subnormal for 2**-127), exactly the reciprocal.
        inverse = tl.where(scale == 254, 0x400000, (254 - scale) << 23).to(tl.float32, bitcast=True)
    else:
        inverse = tl.math.div_rn(1.0, scale)
    y = v * tl.broadcast_to(inverse, v.shape)
    if EMULATE_FP8:
        y = tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return to_e4m3(y, EMULATE_FP8)


# The forms Gluon kernels call (a Gluon kernel cannot call a @triton.jit function).
gluon_block_scale = gluon.jit(block_scale.fn)
gluon_to_fp8 = gluon.jit(to_fp8.fn)
