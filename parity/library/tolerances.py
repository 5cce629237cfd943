"""Fixed tolerances of float outputs against a float64 reference: `Tolerance` and the `TOLERANCES` table (the error
model of this project's merges, used by `python -m parity check` and by callers who pass a table key)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Tolerance:
    """`|got - want| <= atol + rtol * mag`, elementwise, in float64."""

    rtol: float
    atol: float
    text: str = ""  # the description in reports, when the bound is not a plain (rtol, atol) pair

    def describe(self) -> str:
        return self.text or f"|got-want| <= {self.atol:.3g} + {self.rtol:.4g}*mag"


_F32_COMPUTE = 16 * 2.0**-24  # f32 math of the merge: exp, divide, multiply-add, log (a few ulp each)

TOLERANCES: dict[str, Tolerance] = {
    "float32": Tolerance(rtol=2.0**-24 + _F32_COMPUTE + 2.0**-24, atol=2.0**-120),
    "float16": Tolerance(rtol=2.0**-11 + _F32_COMPUTE + 2.0**-24, atol=2.0**-24),
    "bfloat16": Tolerance(rtol=2.0**-8 + _F32_COMPUTE + 2.0**-24, atol=2.0**-120),
    "float8_e4m3fn": Tolerance(rtol=2.0**-4 + _F32_COMPUTE + 2.0**-24, atol=2.0**-9),
    "float8_e5m2": Tolerance(rtol=2.0**-3 + _F32_COMPUTE + 2.0**-24, atol=2.0**-16),
    # NVFP4's e2m1 codes (docs/spec.md 4.8), compared as values in the reference block's units: half a step, 2^-2 of
    # the value, and below 1 half the 0.5 step (times up to 9/8 where the block's scale is one e4m3 step above)
    "float4_e2m1fn": Tolerance(rtol=2.0**-2 + _F32_COMPUTE + 2.0**-24, atol=2.0**-2 + 2.0**-5),
    # NVFP4's e4m3 block scales: one e4m3 step (an ulp of the f32 rows moves a block's amax across a rounding
    # boundary of the scale), at most 2^-3 of the value, 2^-9 among the subnormals
    "nvfp4_block_scale": Tolerance(rtol=2.0**-3 + _F32_COMPUTE + 2.0**-24, atol=2.0**-9),
    "lse": Tolerance(rtol=2.0**-24 + _F32_COMPUTE, atol=2.0**-20),
}
"""Tolerances of float outputs against the float64 reference (docs/spec.md 5: on CPU the interpreters do not
agree bitwise, so the merge is checked against float64 within these bounds; the mask is exact).

Derivation. The kernels compute in f32 and round once, at the store, to the output dtype with unit
roundoff u (half an ULP at 1): u = 2^-24 (fp32), 2^-11 (fp16), 2^-8 (bf16), 2^-4 (fp8 e4m3). Let
`mag = |a|*wp + |b|*ws` (float64; `parity.harness.expected.merge_out_magnitude`), the size of the terms before any cancellation.
The f32 evaluation of `a*wp + b*ws` (exp and divide within a few f32 ULPs, FMA or not, FTZ or not) errs
by at most e*mag with e = 16 * 2^-24 = 2^-20. Rounding that f32 value y to the output dtype adds at most
u*|y| <= u*(1 + e)*mag. Hence `rtol = u + e + 2^-24` (the last term bounds u*e). `|want| <= mag`, so the
default `mag = |want|` is valid for a plain rounding and stricter otherwise.

atol covers what scales with nothing: fp16 and fp8 round tiny values to multiples of their smallest
subnormal (2^-24, 2^-9, e5m2 2^-16: a full quantum, half for the rounding, half for a flushed f32 intermediate); for
fp32 and bf16 (8-bit exponent) a flushed f32 intermediate (< 2^-126) times a partial value (< 64) stays
below 2^-120. fp8 outputs are `out / scale`: pass `mag / scale`.

LSE (`lse = log(z) + m`, f32 out): log and the final add err by a few f32 ULPs of |m| + log(z) with
0 <= log(z) <= ln 2, and |lse| >= |m| - ln 2, so `rtol = 2^-24 + 2^-20` relative to |lse| plus
`atol = 2^-20` absolute (16 ULP at 1, for |lse| near 0). Base-2 LSEs add one f32 multiply each way.
"""

def tolerance_for(dtype, *, lse: bool = False) -> Tolerance:
    """The `TOLERANCES` entry of an output dtype (a torch or numpy dtype, or its name), or the LSE entry."""
    if lse:
        return TOLERANCES["lse"]
    key = str(dtype).replace("torch.", "")
    if key not in TOLERANCES:
        raise TypeError(f"no tolerance for {dtype=}; known: {sorted(TOLERANCES)}")
    return TOLERANCES[key]


__all__ = ["TOLERANCES", "Tolerance", "tolerance_for"]
