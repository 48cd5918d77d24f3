"""The quotient ``fp8_math.quotient`` computes, checked in exact rational arithmetic on the CPU.

    python benchmarks/probe_quotient.py

For fp32 ``v`` and scales ``s = RN(amax / 448)`` with ``|v| <= amax``: the reciprocal ``r = RN(1/s)``, then
``q = RN(v r)``, the remainder ``RN(v - q s)`` (exact by FMA) and ``RN(q + rem r)``; each result is
compared with the correctly rounded ``v / s``. Half the cases are random, half are built to land next to
a midpoint between two floats (where a one-ulp error would show). Prints the count of differences.
"""

from __future__ import annotations

import random
from fractions import Fraction

import numpy as np


def rn32(f: Fraction) -> np.float32:
    """``f`` rounded to the nearest fp32, ties to even (the float64 guess and its two neighbours)."""
    if f == 0:
        return np.float32(0)
    guess = np.float32(float(f))
    candidates = (np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf)))
    return min((c for c in candidates if np.isfinite(c)),
               key=lambda c: (abs(Fraction(float(c)) - f), int(np.array(c).view(np.int32)) & 1))


def fma(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    return rn32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))


def quotient(v: np.float32, s: np.float32) -> np.float32:
    r = rn32(1 / Fraction(float(s)))
    q = rn32(Fraction(float(v)) * Fraction(float(r)))
    rem = fma(-q, s, v)
    return q if rem == 0 else fma(rem, r, q)


def main(cases: int = 20000) -> None:
    rng = random.Random(1)
    differences = 0
    for i in range(2 * cases):
        amax = np.float32(2.0 ** rng.uniform(-20, 20))
        s = rn32(Fraction(float(amax)) / 448)
        if i < cases:
            v = np.float32(rng.uniform(-1, 1) * float(amax))
        else:
            # v / s within rounding of a midpoint between two floats in [2**-10, 2**9).
            mantissa, exponent = rng.randint(2**23, 2**24 - 1), rng.randint(-10, 8)
            v = rn32(Fraction(2 * mantissa + 1, 2**24) * Fraction(2) ** exponent * Fraction(float(s)))
        differences += quotient(v, s) != rn32(Fraction(float(v)) / Fraction(float(s)))
    print(f"{2 * cases} cases ({cases} random, {cases} next to midpoints): {differences} differ from the "
          f"correctly rounded quotient")


if __name__ == "__main__":
    main()
