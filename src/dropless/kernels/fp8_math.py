"""The arithmetic of FP8 quantization, shared by the Triton and Gluon kernels that quantize.

    amax  = max |x| over the block                   (a NaN element counts as 0: it stays NaN in the data)
    fp32 recipes:  scale = amax / 448                (correctly rounded; 1 where it is 0)
                   pow2:  scale = 2**ceil(log2(amax / 448))
    mxfp8 (E8M0):  scale = 2**e, e = floor(log2(amax)) - 8                   ("floor", OCP MX v1.0)
                                 e = ceil(log2(fl(amax / 448)))              ("rceil")
                   clamped to [-127, 127], amax 0 gives 2**-127; stored as the byte e + 127
    data  = e4m3(clamp(x / scale, -448, 448))        (round to nearest even; NaN stays NaN)

Every exponent is read off the fp32 bits (subnormals included; rceil needs no division), and every
division is correctly rounded (``div_rn``; mxfp8 multiplies by the exact power of two ``2**-e``), so
the kernels match ``dropless.reference.quantize`` bit for bit. The functions are ``@triton.jit``; Gluon
kernels call the ``gluon_`` forms at the end of this module (``gluon.jit(f.fn)``).
"""

import triton
import triton.language as tl
from triton.experimental import gluon

FP8_MAX = tl.constexpr(448.0)  # float8_e4m3fn's largest finite value
E8M0_ONE = tl.constexpr(127)  # the E8M0 byte of 2**0
QUOTIENT_LOW = tl.constexpr(2.0**-90)  # the scales ``quotient`` divides by without div_rn
QUOTIENT_HIGH = tl.constexpr(2.0**100)
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
    """The smallest power of two ``>= s`` for ``s >= 0``, exactly: adding a mantissa's worth to the bits
    carries a non-zero mantissa into the exponent. A subnormal s is scaled by 2**23 first (both exact)."""
    tiny = s < FP32_TINY
    t = s * tl.where(tiny, 8388608.0, 1.0)
    p = ((t.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)
    return p * tl.where(tiny, 1.1920928955078125e-07, 1.0)


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
        scale = tl.math.div_rn(amax, FP8_MAX)
        if POW2:
            scale = pow2_ceil(scale)
        scale = tl.where(scale > 0.0, scale, 1.0)
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
def quotient(v, scale, outside=None):
    """``v / scale`` correctly rounded (``div_rn``), for a ``scale`` that broadcasts to ``v`` and is shared
    by many elements: its reciprocal ``r`` once (``div_rn``, correctly rounded), then per element the
    product ``q = v r`` and Markstein's correction ``q + (v - q scale) r`` with the remainder exact by
    FMA, which is the correctly rounded quotient whenever nothing leaves fp32's normal range (Markstein,
    1990): three operations an element instead of a division's ten and a branch. The remainder is taken
    negated, ``q scale - v``, and subtracted: then a zero v keeps its sign (``-0 + -0``; the remainder
    added would give ``+0``) with no select, and a NaN v stays NaN. (v is finite where this is used: an
    infinite element gives an infinite scale, which is outside the range below.) The sign flips are
    products by -1, which the compiler folds into the FMAs' operands (``0 - v`` it cannot: +0 - +0 is
    +0). Scales outside ``[2**-90, 2**100]`` (a reciprocal past the normal range, or remainders that could
    be subnormal for the quotients e4m3 can tell apart) send the whole call to the division. ``outside``:
    whether any scale the caller will pass is outside that range (``scales_outside``), known beforehand;
    a kernel that quantizes many tiles with scales known up front then skips the reduction over each tile."""
    s = tl.broadcast_to(scale, v.shape)
    r = tl.math.div_rn(1.0, scale)
    q = v * tl.broadcast_to(r, v.shape)
    negated_rem = tl.math.fma(q, s, v * -1.0)
    y = tl.math.fma(negated_rem, tl.broadcast_to(r * -1.0, v.shape), q)
    if outside is None:
        outside = scales_outside(scale)
    if outside > 0:
        y = tl.math.div_rn(v, s)
    return y


@triton.jit
def scales_outside(scale):
    """1 if any of ``scale`` lies outside the range ``quotient`` divides by without ``div_rn``, else 0."""
    outside = ((scale < QUOTIENT_LOW) | (scale > QUOTIENT_HIGH)).to(tl.int32)
    if outside.type.is_block():
        outside = tl.max(tl.reshape(outside, [outside.numel]), axis=0)
    return outside


@triton.jit
def to_fp8(v, scale, MX: tl.constexpr, EMULATE_FP8: tl.constexpr, outside=None):
    """``e4m3(clamp(v / scale))`` for fp32 ``v`` and a ``scale`` that broadcasts to it (fp32, or a biased
    E8M0 exponent when MX). On the GPU the cast's saturation is the clamp (``cvt.rn.satfinite``: NaN stays
    NaN, anything past +-448 becomes +-448). ``outside``: as ``quotient`` takes it (fp32 scales)."""
    if MX:
        # 2**-(scale - 127) is an fp32 (a subnormal for 2**-127), so the product is the exact quotient.
        inverse = tl.where(scale == 254, 0x400000, (254 - scale) << 23).to(tl.float32, bitcast=True)
        y = v * inverse
    elif EMULATE_FP8:
        y = tl.math.div_rn(v, tl.broadcast_to(scale, v.shape))
    else:
        y = quotient(v, scale, outside)
    if EMULATE_FP8:
        y = tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return to_e4m3(y, EMULATE_FP8)


# The forms Gluon kernels call (a Gluon kernel cannot call a @triton.jit function).
gluon_block_scale = gluon.jit(block_scale.fn)
gluon_to_fp8 = gluon.jit(to_fp8.fn)
