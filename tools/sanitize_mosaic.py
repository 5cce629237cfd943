"""The Mosaic GPU kernels of pallas_impl once each on a small ragged batch, for `compute-sanitizer` (memcheck): the
mask in place (donated; LSE only and with output zeroing), the 2-way merge (plain and fused, with pass-through
rows), the N-way merge (fused, N = 4; N = 256; D = 20; other output dtypes), the quantized outputs (static fp8,
per-group FP8, NVFP4 with row and swizzled scales; on one compute warpgroup, and split over two by columns and by
rows; `--without-quantized` leaves them out) and the context-parallel rescale (reduce_scatter over 4 ranks
simulated by a named vmap); then 200 requests over 16384 tokens (the mask's window search, the 2-way merge's long
tiles).
jax >= 0.11 on a GPU.

    XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_PYTHON_CLIENT_ALLOCATOR=platform \\
        compute-sanitizer --tool memcheck --error-exitcode 1 python -m tools sanitize-mosaic
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import pallas_impl
from pallas_impl.mosaic import _common as mc

T, H, D, N = 300, 8, 128, 4
KW = dict(backend="mosaic_gpu")
QUANTIZED = {"static fp8": dict(out_dtype=jnp.float8_e4m3fn, output_scale=jnp.float32(0.5)),
             "per-group FP8 G = 128": dict(group_size=128),
             "per-group FP8 G = 64 UE8M0": dict(group_size=64, scale_ue8m0=True),
             "NVFP4": dict(out_dtype=jnp.float4_e2m1fn, output_scale=jnp.float32(40.0)),
             "NVFP4 swizzled": dict(out_dtype=jnp.float4_e2m1fn, output_scale=jnp.float32(40.0),
                                    scale_layout="swizzled")}
DEFAULTS = {k: dict(mc.TUNING[k]) for k in ("merge", "merge_n")}
# the quantized merges' schedules: one compute warpgroup, two splitting each tile by columns, by rows
SCHEDULES = (dict(compute_wgs=1), dict(compute_wgs=2), dict(compute_wgs=2, split="rows"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--without-quantized", action="store_true",
                   help="leave out the quantized merges (the rest still runs under compute-sanitizer if they crash it)")
    skip_quantized = p.parse_args(argv).without_quantized
    key = jax.random.key(0)
    o = jax.random.normal(key, (N, T, H, D), jnp.bfloat16)
    lse = jax.random.normal(key, (N, H, T), jnp.float32)
    qsl = jnp.array([0, 100, 101, 250, 300], jnp.int32)
    cu = jnp.array([0, 0, 5, 5, 9], jnp.int32)  # requests 0 and 2 empty
    cus = jnp.tile(cu, (N, 1))
    mask_out = jax.jit(lambda l, x, q, c: pallas_impl.mask_empty_context_lse(l, q, c, x, **KW), donate_argnums=(0, 1))
    jax.block_until_ready(mask_out(lse[0] + 0, o[0] + 0, qsl, cu))
    mask = jax.jit(lambda l, q, c: pallas_impl.mask_empty_context_lse(l, q, c, **KW), donate_argnums=0)
    jax.block_until_ready(mask(lse[1] + 0, qsl, cu))
    print("mask (with and without output zeroing) ok", flush=True)
    for fused in (dict(), dict(query_start_loc=qsl, prefix_cu_seq_lens=cu)):
        jax.block_until_ready(pallas_impl.merge_attn_states(o[0], lse[0], o[1], lse[1], prefill_tokens_with_context=290,
                                                            **fused, **KW))
    print("merge (plain, fused) ok", flush=True)
    jax.block_until_ready(pallas_impl.merge_attn_states_n(o, lse, query_start_loc=qsl, cu_seq_lens=cus,
                                                          prefill_tokens_with_context=290, **KW))
    print("merge_n ok", flush=True)
    # N = 256 (the weights in blocks of 64, runtime loops over the partials), to f32, and heads of D = 20 (padded to
    # whole TMA rows) with an f16 output; per-group FP8 (the f32 rows quantized in XLA).
    wide = jnp.tile(o[:, :, :2], (64, 1, 1, 1))
    wide_lse = jnp.tile(lse[:, :2], (64, 1, 1))
    jax.block_until_ready(pallas_impl.merge_attn_states_n(wide, wide_lse, query_start_loc=qsl,
                                                          cu_seq_lens=jnp.tile(cu, (wide.shape[0], 1)), out_dtype=jnp.float32,
                                                          prefill_tokens_with_context=290, **KW))
    jax.block_until_ready(pallas_impl.merge_attn_states_n(o[..., :20], lse, out_dtype=jnp.float16, **KW))
    print("merge_n (N = 256, D = 20) ok", flush=True)
    # The quantized stores in the kernels (T = 300: the shifted last tile's scale rows), on one compute warpgroup
    # and split over two (`compute_wgs`; the 2-way merge by columns and by rows). Each call is named before it
    # runs, so a crash names its kernel (compute-sanitizer's own process crashed in this part, 2026-12-07).
    for schedule in ([] if skip_quantized else SCHEDULES):
        for kernel in ("merge", "merge_n"):
            own = dict(grouped={}) if kernel == "merge" else dict(nvfp4={})
            mc.TUNING[kernel] = dict(DEFAULTS[kernel], **schedule, **own)
        jax.clear_caches()
        for name, quant in QUANTIZED.items():
            print(f"  {name}, {schedule}: 2-way", flush=True)
            jax.block_until_ready(pallas_impl.merge_attn_states(o[0], lse[0], o[1], lse[1], return_lse=True,
                                                                prefill_tokens_with_context=290, **quant, **KW))
            print(f"  {name}, {schedule}: N-way", flush=True)
            jax.block_until_ready(pallas_impl.merge_attn_states_n(o, lse, query_start_loc=qsl, cu_seq_lens=cus,
                                                                  **quant, **KW))
        print(f"quantized merges (static fp8, per-group FP8, NVFP4) with {schedule} ok", flush=True)
    for kernel in ("merge", "merge_n"):
        mc.TUNING[kernel] = dict(DEFAULTS[kernel])
    jax.clear_caches()
    combine = jax.vmap(lambda a, b, c: pallas_impl.cp_merge_attn_states(
        a, b, axis_name="cp", method="reduce_scatter", query_start_loc=qsl, cu_seq_lens=c, **KW), axis_name="cp")
    jax.block_until_ready(jax.jit(combine)(o, lse, cus))
    print("cp rescale ok", flush=True)
    # 200 requests (the mask's window search of the request bounds) over T = 16384 (the 2-way merge's long tiles).
    t, r = 16384, 200
    qsl = jnp.minimum(jnp.arange(r + 1, dtype=jnp.int32) * 83, t - 5)
    cu = jnp.arange(r + 1, dtype=jnp.int32) // 2 * 7  # every other request empty
    o = jax.random.normal(key, (2, t, 2, D), jnp.bfloat16)
    lse = jax.random.normal(key, (2, 2, t), jnp.float32)
    jax.block_until_ready(mask_out(lse[0] + 0, o[0] + 0, qsl, cu))
    jax.block_until_ready(mask(lse[1] + 0, qsl, cu))
    jax.block_until_ready(pallas_impl.merge_attn_states(o[0], lse[0], o[1], lse[1], query_start_loc=qsl,
                                                        prefix_cu_seq_lens=cu, **KW))
    print(f"mask of {r} requests, merge at T = {t} ok", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
