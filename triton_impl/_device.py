"""The @triton.jit device helpers that several Triton kernels share, and the constants they read.

The request search (`_count_keys_le`, the two-level 32-wide compare-and-sum of the mask and the fused merges), the
exact cast of the interpreter (`_cast_rne`), libdevice exp/log and the base-2 exponential, the LSE sentinels, a merge program's tile (`_program_tile`), the fused
mask's token requests, the store of a merged tile and of its LSE (2-way, N-way and the context-parallel rescale),
and the N-way weights (N-way merge and rescale). `pallas_impl/_device.py` holds the same helpers under the same
names, statement by statement (the N-way maximum and sum there: `pallas_impl/_math.n_way_max_and_sum`); a helper
used by one kernel only stays in that kernel's file.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mla_lse_common import constants
from triton_impl import _backend

if not _backend.interpreting():
    from triton.language.extra.cuda import libdevice

# The shared constants as compile-time values (a jitted function may read only constexpr globals).
LN2 = tl.constexpr(constants.LN2)
LOG2E = tl.constexpr(constants.LOG2E)
FP8_MAX = tl.constexpr(constants.FP8_E4M3_MAX)
GROUP_EPS = tl.constexpr(constants.GROUP_EPS)
UE8M0_ROUND_UP = tl.constexpr(constants.UE8M0_ROUND_UP)
UE8M0_EXPONENT = tl.constexpr(constants.UE8M0_EXPONENT)
FP4_MAX = tl.constexpr(constants.FP4_E2M1_MAX)
FP4_INV_MAX = tl.constexpr(1 / constants.FP4_E2M1_MAX)  # f32(1/6), as the reference's
NVFP4_BLOCK = tl.constexpr(constants.NVFP4_BLOCK)


@triton.jit
def _scan_bound(num_keys, N_INTERPRET: tl.constexpr):
    if N_INTERPRET > 0:
        return N_INTERPRET
    else:
        return num_keys


@triton.jit
def _count_keys_le(qsl_ptr, x, num_keys, KEY_DIV: tl.constexpr, KEY_STEP: tl.constexpr,
                   SCAN: tl.constexpr, N_INTERPRET: tl.constexpr):
    """i32[N]: for each x, how many of key(r) = qsl[r] // KEY_DIV + r * KEY_STEP, r < num_keys, are <= x.

    Keys are non-decreasing in r. Two levels of 32-wide compare-and-sum: the first key of every 32-key chunk
    (one step covers 1024 keys), then the 32 keys of the chunk holding the last key <= x.
    """
    coarse = tl.zeros_like(x)
    for r0 in range(0, _scan_bound(num_keys, N_INTERPRET), SCAN * SCAN):
        r = r0 + tl.arange(0, SCAN) * SCAN
        key = tl.load(qsl_ptr + tl.minimum(r, num_keys - 1)) // KEY_DIV + r * KEY_STEP
        coarse += tl.sum(((r < num_keys)[None, :] & (key[None, :] <= x[:, None])).to(tl.int32), axis=1)
    base = (coarse - 1) * SCAN  # key(0) <= x always: coarse >= 1
    r = base[:, None] + tl.arange(0, SCAN)[None, :]
    key = tl.load(qsl_ptr + tl.minimum(r, num_keys - 1)) // KEY_DIV + r * KEY_STEP
    return base + tl.sum(((r < num_keys) & (key <= x[:, None])).to(tl.int32), axis=1)


@triton.jit
def _cast_rne(x, dtype: tl.constexpr, INTERPRET: tl.constexpr):
    """f32 -> dtype with round-to-nearest-even, as the GPU's cvt does.

    Triton's interpreter truncates f32 -> bf16 and loses the carry when rounding to fp8; under it the value
    is first rounded to dtype's precision with exact f32 arithmetic (power-of-two scaling and the 1.5 * 2^23
    trick), so the final cast is exact, and the sign of a value rounded to zero is kept (-0). Magnitudes below 2^-100
    are left to the interpreter.
    """
    if INTERPRET:
        if (dtype == tl.bfloat16) or (dtype == tl.float8e4nv):
            MANT: tl.constexpr = 7 if dtype == tl.bfloat16 else 3
            EMIN: tl.constexpr = -126 if dtype == tl.bfloat16 else -6
            r = _round_float(x, MANT, EMIN)
            x = tl.where((tl.abs(x) >= 7.888609052210118e-31) & (tl.abs(x) < float("inf")), r, x)
        if dtype == tl.float8e4nv:  # the interpreter also turns NaN into 0x7c
            y = x.to(dtype).to(tl.uint8, bitcast=True)
            return tl.where(x != x, (y & 0x80) | 0x7F, y).to(dtype, bitcast=True)
    return x.to(dtype)


@triton.jit
def _round_float(x, MANT: tl.constexpr, EMIN: tl.constexpr):
    """f32 `x` rounded to nearest even at MANT mantissa bits and minimum exponent EMIN (bf16: 7, -126; e4m3: 3, -6),
    as an f32, in exact f32 arithmetic: power-of-two scaling and the 1.5 * 2^23 trick. The sign of a value rounded
    to zero is kept (-0, as the GPU's cvt stores it: fp8 0x80). For magnitudes from 2^-100 to the format's maximum."""
    e = ((x.to(tl.uint32, bitcast=True) >> 23) & 0xFF).to(tl.int32) - 127
    q = ((tl.maximum(e, EMIN) - MANT + 127) << 23).to(tl.float32, bitcast=True)
    r = ((x / q + 12582912.0) - 12582912.0) * q
    return (r.to(tl.uint32, bitcast=True) | (x.to(tl.uint32, bitcast=True) & 0x80000000)).to(tl.float32, bitcast=True)


@triton.jit
def _exp(x, INTERPRET: tl.constexpr):
    if INTERPRET:  # libdevice does not run in the interpreter
        return tl.exp(x)
    else:
        return libdevice.exp(x)


@triton.jit
def _log(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        return tl.log(x)
    else:
        return libdevice.log(x)


@triton.jit
def _exp_base(x, LSE_BASE2: tl.constexpr, INTERPRET: tl.constexpr):
    """exp(x), or for a difference x of base-2 LSEs 2^x = exp(x * ln2) (docs/spec.md 4.3): the weights are computed
    from differences in the LSEs' own base (x = 0 gives exactly 1)."""
    if LSE_BASE2:
        x = x * LN2
    return _exp(x, INTERPRET)


@triton.jit
def _clean_lse(x):
    """docs/spec.md 4.1: +inf (FA2's empty row) and NaN read as -inf; no base conversion."""
    return tl.where((x == float("inf")) | (x != x), float("-inf"), x)


@triton.jit
def _program_tile(num_tokens, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's [BLOCK_T, BLOCK_H, BLOCK_D] tile, head blocks fastest (consecutive programs sweep the
    [T, H, D] buffers front to back): its tokens t, the masks, and 64-bit index columns t64, h64, d64."""
    num_h_blocks: tl.constexpr = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    pid = tl.program_id(0)
    t = (pid // num_h_blocks) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = (pid % num_h_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    t_mask = t < num_tokens
    th_mask = t_mask[:, None] & (h < NUM_HEADS)[None, :]
    thd_mask = th_mask[:, :, None] & (d < HEAD_DIM)[None, None, :]
    return t, t_mask, th_mask, thd_mask, t.to(tl.int64)[:, None], h.to(tl.int64)[None, :], d.to(tl.int64)[None, None, :]


@triton.jit
def _token_requests(qsl_ptr, t, t_mask, num_requests, SCAN: tl.constexpr, N_INTERPRET: tl.constexpr,
                    FUSED_MASK: tl.constexpr):
    """(req, in_req) of the fused mask: each token's request (clamped to R - 1) and whether it is in one."""
    req = t  # placeholders unless FUSED_MASK
    in_req = t_mask
    if FUSED_MASK:
        req = _count_keys_le(qsl_ptr, t, num_requests + 1, 1, 0, SCAN, N_INTERPRET) - 1  # R: padding
        in_req = t_mask & (req < num_requests)
        req = tl.minimum(req, num_requests - 1)
    return req, in_req


@triton.jit
def _store_output(out_ptr, out_ptrs, out, last, copy_t, scale_ptr, thd_mask, FP8_OUT: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """The merged f32 tile `out` to `out_ptrs` (docs/spec.md 4.4, 4.6): pass-through tokens take `last` (the
    suffix, or the last partial) bit for bit where the output has its dtype, else rounded once to the output dtype
    (through the scale and clamp of a merged row for fp8)."""
    if FP8_OUT:
        out = tl.where(copy_t[:, None, None], last.to(tl.float32), out)
        out = out / tl.load(scale_ptr)
        out = tl.where(out < -FP8_MAX, -FP8_MAX, out)  # comparisons, not min/max: NaN stays NaN
        out = tl.where(out > FP8_MAX, FP8_MAX, out)
        tl.store(out_ptrs, _cast_rne(out, out_ptr.dtype.element_ty, INTERPRET), mask=thd_mask)
    else:
        if last.dtype == out_ptr.dtype.element_ty:
            tl.store(out_ptrs, tl.where(copy_t[:, None, None], last,
                                        _cast_rne(out, out_ptr.dtype.element_ty, INTERPRET)), mask=thd_mask)
        else:  # 4.4: another output dtype: the copied row, as f32, takes the one rounding of a merged row
            out = tl.where(copy_t[:, None, None], last.to(tl.float32), out)
            tl.store(out_ptrs, _cast_rne(out, out_ptr.dtype.element_ty, INTERPRET), mask=thd_mask)


@triton.jit
def _store_group_fp8(out_ptr, out_ptrs, out, last, copy_t, gs_ptr, t64, h64, stride_gs_t, stride_gs_g, th_mask,
                     thd_mask, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_D: tl.constexpr, GROUP_SIZE: tl.constexpr, UE8M0: tl.constexpr, INTERPRET: tl.constexpr):
    """The merged f32 tile `out` quantized per group of GROUP_SIZE elements of a head row (docs/spec.md 4.7) to
    `out_ptrs` (fp8), and its scales f32 to `gs_ptr` [T, H * D / G] through (stride_gs_t, stride_gs_g):
    pass-through tokens take `last` as f32 (4.4) and are quantized like any other row."""
    out = tl.where(copy_t[:, None, None], last.to(tl.float32), out)
    GROUPS: tl.constexpr = BLOCK_D // GROUP_SIZE
    x = tl.reshape(out, (BLOCK_T, BLOCK_H, GROUPS, GROUP_SIZE))
    amax = tl.max(tl.where(x == x, tl.abs(x), 0.0), axis=3)  # NaN left out of the maximum
    amax = tl.where(amax > GROUP_EPS, amax, GROUP_EPS)
    scale = amax / FP8_MAX
    if UE8M0:  # rounded up to a power of two on the bits: exactly 2^ceil(log2(scale))
        scale = ((scale.to(tl.int32, bitcast=True) + UE8M0_ROUND_UP) & UE8M0_EXPONENT).to(tl.float32, bitcast=True)
    q = x / scale[:, :, :, None]
    q = tl.where(q < -FP8_MAX, -FP8_MAX, q)  # comparisons, not min/max: NaN stays NaN
    q = tl.where(q > FP8_MAX, FP8_MAX, q)
    q = tl.reshape(q, (BLOCK_T, BLOCK_H, BLOCK_D))
    tl.store(out_ptrs, _cast_rne(q, out_ptr.dtype.element_ty, INTERPRET), mask=thd_mask)
    g = tl.arange(0, GROUPS)
    g_ptrs = gs_ptr + t64[:, :, None] * stride_gs_t + (h64[:, :, None] * (HEAD_DIM // GROUP_SIZE) + g) * stride_gs_g
    tl.store(g_ptrs, scale, mask=th_mask[:, :, None] & (g < HEAD_DIM // GROUP_SIZE)[None, None, :])


@triton.jit
def _e4m3_bits(v):
    """The float8_e4m3fn bits (u8) of an f32 `v` that is an e4m3 value (`_round_float`'s) or NaN, by integer
    operations: exponent bits 6-3 (bias 7), mantissa bits 2-0, exponent 0 subnormal (v = m * 2^-9), NaN S.1111.111."""
    b = v.to(tl.uint32, bitcast=True)
    e = ((b >> 23) & 0xFF).to(tl.int32) - 127
    code = tl.where(e >= -6, ((e + 7) << 3) | ((b >> 20) & 7).to(tl.int32), (tl.abs(v) * 512.0).to(tl.int32))
    code = tl.where(v != v, 0x7F, code) | ((b >> 31).to(tl.int32) << 7)
    return code.to(tl.uint8)


@triton.jit
def _e2m1_code(a):
    """The e2m1 magnitude code (0..7) of |y| = `a` (docs/spec.md 4.8): the thresholds it passes, ties to even."""
    return ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a >= 1.75).to(tl.int32)
            + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))


@triton.jit
def _store_nvfp4(out_ptr, out, last, copy_t, scale_ptr, bs_ptr, t64, h64, stride_out_t, stride_out_h,
                 stride_out_d, stride_bs_t, stride_bs_k, th_mask, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                 BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SWIZZLED: tl.constexpr):
    """The merged f32 tile `out` quantized to NVFP4 (docs/spec.md 4.8) with the f32 global scale at `scale_ptr`: two
    e2m1 codes a byte to `out_ptr` u8[T, H, D / 2], the e4m3 block scales to `bs_ptr` [T, H * D / 16] through
    (stride_bs_t, stride_bs_k), or at their offsets in the 128x4-swizzled layout; pass-through tokens take `last` as
    f32 (4.4), quantized like any other row."""
    out = tl.where(copy_t[:, None, None], last.to(tl.float32), out)
    g = tl.load(scale_ptr)
    BLOCKS: tl.constexpr = BLOCK_D // NVFP4_BLOCK
    x = tl.reshape(out, (BLOCK_T, BLOCK_H, BLOCKS, NVFP4_BLOCK))
    amax = tl.max(tl.where(x == x, tl.abs(x), 0.0), axis=3)  # NaN left out of the maximum
    s = (amax * FP4_INV_MAX) * g
    # The e4m3 block scale as an f32 (its value) and as bits, without an f32 -> e4m3 -> f32 cast round trip: compiled
    # (triton 3.6, H100), that round trip's e4m3x2 / f16x2 conversions gave 0 for two heads of every four in the
    # 2-way merge with the fused mask and swizzled scales (sign-only codes), which the interpreter cannot show
    # (docs/design.md, "NVFP4"). The same values and bits as the cast (round to nearest even).
    sf = _round_float(tl.where(s > FP8_MAX, FP8_MAX, s), 3, -6)  # the nearest e4m3 value (0 stays 0)
    s8 = _e4m3_bits(sf).to(bs_ptr.dtype.element_ty, bitcast=True)
    inv = tl.where(sf == 0.0, 0.0, 1.0 / tl.where(sf == 0.0, 1.0, sf * (1.0 / g)))
    y = x * inv[:, :, :, None]
    y = tl.where(y < -FP4_MAX, -FP4_MAX, y)  # comparisons, not min/max: NaN stays NaN
    y = tl.where(y > FP4_MAX, FP4_MAX, y)
    sign = (y.to(tl.uint32, bitcast=True) >> 31).to(tl.int32)
    codes = tl.reshape(_e2m1_code(tl.abs(y)) | (sign << 3), (BLOCK_T, BLOCK_H, BLOCK_D // 2, 2))
    lo, hi = tl.split(codes)
    j = tl.arange(0, BLOCK_D // 2)
    tl.store(out_ptr + t64[:, :, None] * stride_out_t + h64[:, :, None] * stride_out_h + j * stride_out_d,
             (lo | (hi << 4)).to(tl.uint8), mask=th_mask[:, :, None] & (j < HEAD_DIM // 2)[None, None, :])
    k = h64[:, :, None] * (HEAD_DIM // NVFP4_BLOCK) + tl.arange(0, BLOCKS)  # the block's scale column
    if SWIZZLED:  # scale (t, k) at ((t // 128) * (K_pad / 4) + k // 4) * 512 + (t % 32) * 16
        #                              + ((t % 128) // 32) * 4 + k % 4
        K_TILES: tl.constexpr = (NUM_HEADS * HEAD_DIM // NVFP4_BLOCK + 3) // 4
        t3 = t64[:, :, None]
        offsets = ((t3 // 128) * K_TILES + k // 4) * 512 + (t3 % 32) * 16 + ((t3 % 128) // 32) * 4 + k % 4
    else:
        offsets = t64[:, :, None] * stride_bs_t + k * stride_bs_k
    tl.store(bs_ptr + offsets, s8,
             mask=th_mask[:, :, None] & (tl.arange(0, BLOCKS) < HEAD_DIM // NVFP4_BLOCK)[None, None, :])


@triton.jit
def _merged_lse(z, m, empty, copy_t, passthrough, LSE_BASE2: tl.constexpr, INTERPRET: tl.constexpr):
    """The merge's LSE tile (docs/spec.md 4.2, 4.3, 4.4, 8.4), in the LSEs' base: log(z) + m, or for base 2
    log(z) * log2(e) + m (m is base 2 there); -inf where every partial is empty (m = 0 there)."""
    lz = _log(z, INTERPRET)
    if LSE_BASE2:
        lz = lz * LOG2E
    lse = tl.where(empty, float("-inf"), lz) + m
    return tl.where(copy_t[:, None], passthrough, lse)


@triton.jit
def _empty_tokens(cu_ptr, req, in_req):
    """bool[BLOCK_T]: the tokens of requests with no KV in the partial whose offsets are `cu_ptr` (8.1)."""
    return in_req & (tl.load(cu_ptr + req + 1) == tl.load(cu_ptr + req))


@triton.jit
def _partial_lse(lse_ptr, lse_offs, th_mask, cu_ptr, req, in_req, FUSED_MASK: tl.constexpr):
    """f32[BLOCK_T, BLOCK_H]: one partial's LSE tile in the LSEs' base, empty rows -inf (8.1)."""
    lse = _clean_lse(tl.load(lse_ptr + lse_offs, mask=th_mask, other=float("-inf")))  # 4.1
    if FUSED_MASK:  # 8.1: a token of a request with no KV in this partial has LSE -inf
        lse = tl.where(_empty_tokens(cu_ptr, req, in_req)[:, None], float("-inf"), lse)
    return lse


@triton.jit
def _max_step(m, i, lses_ptr, stride_lse_n, lse_offs, th_mask, cu_ptr, stride_cu_n, req, in_req,
              FUSED_MASK: tl.constexpr):
    """max(m, lse_i): one step of the maximum (8.2)."""
    return tl.maximum(m, _partial_lse(lses_ptr + i * stride_lse_n, lse_offs, th_mask, cu_ptr + i * stride_cu_n, req,
                                      in_req, FUSED_MASK))


@triton.jit
def _chunk_max(m, first, lses_ptr, stride_lse_n, lse_offs, th_mask, cu_ptr, stride_cu_n, req, in_req,
               NUM_PARTIALS: tl.constexpr, MAX_CHUNK: tl.constexpr, FUSED_MASK: tl.constexpr):
    """max(m, lse_first, ..., lse_{first + MAX_CHUNK - 1}) over the partials below N, their LSE tiles in one
    [MAX_CHUNK, BLOCK_T, BLOCK_H] load (8.2; a maximum is exact in any order). Partials past N read as -inf."""
    i = first + tl.arange(0, MAX_CHUNK)
    live = i < NUM_PARTIALS
    i64 = tl.minimum(i, NUM_PARTIALS - 1).to(tl.int64)
    lse = _clean_lse(tl.load(lses_ptr + i64[:, None, None] * stride_lse_n + lse_offs[None, :, :],
                             mask=live[:, None, None] & th_mask[None, :, :], other=float("-inf")))  # 4.1
    if FUSED_MASK:  # 8.1, for each partial of the chunk
        empty = _empty_tokens(cu_ptr + i64[:, None] * stride_cu_n, req[None, :], in_req[None, :])
        lse = tl.where(empty[:, :, None], float("-inf"), lse)
    return tl.maximum(m, tl.max(lse, axis=0))


@triton.jit
def _max_and_sum(lses_ptr, stride_lse_n, lse_offs, th_mask, cu_ptr, stride_cu_n, req, in_req, e_ptr, stride_e_n,
                 e_offs, NUM_PARTIALS: tl.constexpr, LSE_BASE2: tl.constexpr, FUSED_MASK: tl.constexpr,
                 INTERPRET: tl.constexpr, LSE_STEPS: tl.constexpr, EXP_STEP: tl.constexpr,
                 MAX_CHUNKS: tl.constexpr, MAX_CHUNK: tl.constexpr, STORE_EXPS: tl.constexpr):
    """(m, all_empty, z) of the N-way weights (8.2, 8.3): the largest LSE (0 where every partial is empty) and
    z = e_0 + ... + e_{N-1} in index order. Up to N = UNROLLED_PARTIALS every loop unrolls (LSE_STEPS = MAX_CHUNKS
    = 0). Beyond, the maximum over partials 1 .. N-1 takes MAX_CHUNKS runtime steps of MAX_CHUNK partials (one load
    each, `_chunk_max`) or, with MAX_CHUNKS = 0, steps of EXP_STEP partials as the sum: LSE_STEPS runtime steps
    (`range`, each step unrolled), then the rest unrolled (`tl.static_range`); `tiles.max_chunks`,
    `tiles.loop_steps`. The same bits either way. With STORE_EXPS every e_i of the sum is stored to
    e_ptr + i * stride_e_n + e_offs (the split merge's first kernel, `_sum_step`)."""
    m = _partial_lse(lses_ptr, lse_offs, th_mask, cu_ptr, req, in_req, FUSED_MASK)
    if MAX_CHUNKS > 0:
        for k in range(0, MAX_CHUNKS):
            m = _chunk_max(m, 1 + k * MAX_CHUNK, lses_ptr, stride_lse_n, lse_offs, th_mask, cu_ptr, stride_cu_n, req,
                           in_req, NUM_PARTIALS, MAX_CHUNK, FUSED_MASK)
    else:
        for k in range(0, LSE_STEPS):
            for j in tl.static_range(EXP_STEP):
                m = _max_step(m, 1 + k * EXP_STEP + j, lses_ptr, stride_lse_n, lse_offs, th_mask, cu_ptr, stride_cu_n,
                              req, in_req, FUSED_MASK)
        for i in tl.static_range(1 + LSE_STEPS * EXP_STEP, NUM_PARTIALS):
            m = _max_step(m, i, lses_ptr, stride_lse_n, lse_offs, th_mask, cu_ptr, stride_cu_n, req, in_req,
                          FUSED_MASK)
    all_empty = m == float("-inf")
    m = tl.where(all_empty, 0.0, m)
    z = _sum_step(0.0, 0, lses_ptr, stride_lse_n, lse_offs, th_mask, cu_ptr, stride_cu_n, req, in_req, m, e_ptr,
                  stride_e_n, e_offs, LSE_BASE2, FUSED_MASK, INTERPRET, STORE_EXPS, True)
    for k in range(0, LSE_STEPS):
        for j in tl.static_range(EXP_STEP):
            z = _sum_step(z, 1 + k * EXP_STEP + j, lses_ptr, stride_lse_n, lse_offs, th_mask, cu_ptr, stride_cu_n, req,
                          in_req, m, e_ptr, stride_e_n, e_offs, LSE_BASE2, FUSED_MASK, INTERPRET, STORE_EXPS, False)
    for i in tl.static_range(1 + LSE_STEPS * EXP_STEP, NUM_PARTIALS):
        z = _sum_step(z, i, lses_ptr, stride_lse_n, lse_offs, th_mask, cu_ptr, stride_cu_n, req, in_req, m, e_ptr,
                      stride_e_n, e_offs, LSE_BASE2, FUSED_MASK, INTERPRET, STORE_EXPS, False)
    return m, all_empty, z


@triton.jit
def _sum_step(z, i, lses_ptr, stride_lse_n, lse_offs, th_mask, cu_ptr, stride_cu_n, req, in_req, m, e_ptr, stride_e_n,
              e_offs, LSE_BASE2: tl.constexpr, FUSED_MASK: tl.constexpr, INTERPRET: tl.constexpr,
              STORE_EXPS: tl.constexpr, FIRST: tl.constexpr):
    """z + e_i (FIRST: e_0, the sum's start): one step of the sum of the exponentials (8.3); with STORE_EXPS e_i is
    also stored (at e_ptr + i * stride_e_n + e_offs). e_i as `_partial_exp` computes it, its body inlined (one
    nested call less per partial under the interpreter)."""
    e = _exp_base(_partial_lse(lses_ptr + i * stride_lse_n, lse_offs, th_mask, cu_ptr + i * stride_cu_n, req, in_req,
                               FUSED_MASK) - m, LSE_BASE2, INTERPRET)
    if STORE_EXPS:
        tl.store(e_ptr + i * stride_e_n + e_offs, e, mask=th_mask)
    if FIRST:
        return e
    return z + e


@triton.jit
def _partial_exp(lses_ptr, stride_lse_n, i, lse_offs, th_mask, cu_ptr, stride_cu_n, req, in_req, m,
                 LSE_BASE2: tl.constexpr, FUSED_MASK: tl.constexpr, INTERPRET: tl.constexpr):
    """e_i = exp(lse_i - m) (base 2: exp((lse_i - m) * ln2)) of partial i (8.3); its weight is e_i / z."""
    return _exp_base(_partial_lse(lses_ptr + i * stride_lse_n, lse_offs, th_mask, cu_ptr + i * stride_cu_n, req,
                                  in_req, FUSED_MASK) - m, LSE_BASE2, INTERPRET)


@triton.jit
def _weighted(x, w):
    # 4.3: a zero weight gives exactly 0, so NaN in an empty partial cannot leak.
    return tl.where(w[:, :, None] > 0.0, x.to(tl.float32) * w[:, :, None], 0.0)


@triton.jit
def _copied_lse(last_raw, last_cu_ptr, req, in_req, FUSED_MASK: tl.constexpr):
    """The pass-through LSE tile (8.4): the last partial's raw bits; the fused mask reaches them too (the mask,
    then the merge): -inf for a token of a request with no KV in the last partial."""
    if FUSED_MASK:
        last_raw = tl.where(_empty_tokens(last_cu_ptr, req, in_req)[:, None], float("-inf"), last_raw)
    return last_raw
