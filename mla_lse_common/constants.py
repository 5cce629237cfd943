"""The numbers of the semantics both kernel packages use (docs/spec.md), as plain Python values."""

from __future__ import annotations

LN2 = 0.6931471805599453  # base-2 LSE to natural log: x * LN2 at the load (docs/spec.md 4.1)
LOG2E = 1.4426950408889634  # natural log to base 2: y * LOG2E at the store
FP8_E4M3_MAX = 448.0  # the largest finite float8_e4m3fn (docs/spec.md 4.6)
# Per-group FP8 output (docs/spec.md 4.7): a group's |x| maximum is floored at GROUP_EPS (as f32) before the scale
# amax / FP8_E4M3_MAX; with UE8M0 scales the scale's f32 bits are rounded up to a power of two by adding
# UE8M0_ROUND_UP and keeping the exponent bits (UE8M0_EXPONENT).
GROUP_EPS = 1e-10
GROUP_SIZES = (64, 128)  # the group sizes of DeepSeek-style FP8 GEMMs; any power of two from 16 dividing D works
MIN_GROUP_SIZE = 16
UE8M0_ROUND_UP = 0x007FFFFF
UE8M0_EXPONENT = 0x7F800000
SCALE_LAYOUTS = ("row", "col", "col_tma")  # f32[T, G#], f32[G#, T], f32[G#, T padded to TMA_ALIGN_T]
TMA_ALIGN_T = 4  # DeepGEMM's TMA-aligned column-major scales: T padded to a multiple of 16 bytes of f32
# NVFP4 output (docs/spec.md 4.8): e2m1 values (largest 6), one e4m3 block scale per NVFP4_BLOCK elements, and the
# thresholds of the e2m1 magnitude codes 1..7 as (value, inclusive): |y| > 0.25, >= 0.75, ... (ties to the even code).
FP4_E2M1_MAX = 6.0
NVFP4_BLOCK = 16
FP4_E2M1_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
                       (5.0, False))
NVFP4_SWIZZLE = (128, 4)  # the FP4 GEMMs' scale tiles: 128 rows (tokens) x 4 scale columns, 512 bytes each
NVFP4_SCALE_LAYOUTS = ("row", "swizzled")  # e4m3[T, H * D / 16], or the 128x4-swizzled tiles (flat)
LSE_LAYOUTS = ("HT", "TH")  # f32[H, T] (vLLM, FA2) or f32[T, H] (FlashInfer, SGLang)
# The N-way loops over the partials (docs/spec.md 8, "Any N"): unrolled up to N = UNROLLED_PARTIALS (fast code, a
# short compile); beyond, runtime loops whose partition is a launch knob (`tiles.N_LOOPS`): a compile that does
# not grow with N, and the same bits whatever the partition.
UNROLLED_PARTIALS = 16
CP_METHODS = ("gather", "reduce_scatter")  # the context-parallel combine's methods (docs/spec.md 9)
