"""GPU time of the merges with per-group FP8 (docs/spec.md 4.7) or NVFP4 (4.8) fused beside the same merge with a
bf16 output and beside that merge followed by a separate quantizer, with the bytes each must move against the copy
ceiling of the same run; both frameworks, one process per call of this script.

    python -m tools group-fp8-speed [--json OUT.json] [--tokens 2048 32768 131072] [--heads 16 128]
                                    [--partials 2 4 8] [--frameworks triton pallas] [--group-size 128]
                                    [--format fp8|nvfp4]
    TRITON_INTERPRET=1 python -m tools group-fp8-speed --smoke     # the plumbing on a CPU: tiny shapes, no timing

Per point (T tokens, H heads, D = 128, N bf16 partials with f32 [H, T] LSEs, no output LSE): N = 2 runs the 2-way
merge, N > 2 the N-way merge.
- `bf16`: the merge into a bf16 output: N reads, one 2-byte write;
- `fused`: the merge into fp8 with per-group scales (row-major f32[T, H * D / G]): N reads, one 1-byte write and
  the scales;
- `unfused`: the bf16 merge, then a separate quantizer reading its output (Triton: `_quant_kernel` below, vLLM's
  per_token_group_quant_fp8 re-expressed from its documented algorithm; JAX: the same jnp operations, jitted).
With --format nvfp4, `fused` writes two e2m1 codes a byte and an e4m3 scale per 16 elements (row-major), and
`unfused` quantizes with `triton_impl.cp_merge._nvfp4_rows_kernel` (the merges' own store, `_store_nvfp4`, on the
bf16 rows; one program per token, all heads) or the jnp quantizer, jitted.
GPU time p50 (Triton: CUDA-graph replay; JAX: profiler kernel time), and for `fused` its bytes / time as a share of
the two-read-one-write ceiling (`torch.add`) of the run; the fused merge wants 95% of it and to beat `unfused`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch
import triton
import triton.language as tl

from mla_lse_common import constants
from triton_impl._backend import interpreting
from triton_impl._device import _cast_rne
from triton_impl.cp_merge import _nvfp4_rows_kernel

SMOKE = dict(tokens=[64], heads=[2], partials=[2, 3], head_dim=64, group_size=64)
FP8_MAX = tl.constexpr(constants.FP8_E4M3_MAX)
GROUP_EPS = tl.constexpr(constants.GROUP_EPS)
ROUND_UP = tl.constexpr(constants.UE8M0_ROUND_UP)
EXPONENT = tl.constexpr(constants.UE8M0_EXPONENT)


@triton.jit
def _quant_kernel(x_ptr, q_ptr, s_ptr, num_groups, GROUP: tl.constexpr, BLOCK: tl.constexpr, UE8M0: tl.constexpr,
                  INTERPRET: tl.constexpr = False):
    """The separate quantizer: BLOCK groups of GROUP consecutive elements per program (docs/spec.md 4.7's steps;
    the cast through `_cast_rne`, the hardware's round-to-nearest-even also under Triton's interpreter)."""
    g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    offs = g[:, None].to(tl.int64) * GROUP + tl.arange(0, GROUP)[None, :]
    mask = (g < num_groups)[:, None]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.where(x == x, tl.abs(x), 0.0), axis=1)
    amax = tl.where(amax > GROUP_EPS, amax, GROUP_EPS)
    scale = amax / FP8_MAX
    if UE8M0:
        scale = ((scale.to(tl.int32, bitcast=True) + ROUND_UP) & EXPONENT).to(tl.float32, bitcast=True)
    q = x / scale[:, None]
    q = tl.where(q < -FP8_MAX, -FP8_MAX, q)
    q = tl.where(q > FP8_MAX, FP8_MAX, q)
    tl.store(q_ptr + offs, _cast_rne(q, q_ptr.dtype.element_ty, INTERPRET), mask=mask)
    tl.store(s_ptr + g, scale, mask=g < num_groups)


def _torch_merge(T, H, D, N, device):
    """`merge(out, **options)`: the 2-way merge (N = 2) or the N-way merge of N bf16 partials, into `out`."""
    import triton_impl

    gen = torch.Generator(device=device).manual_seed(0)
    outs = torch.randn(N, T, H, D, generator=gen, device=device, dtype=torch.bfloat16)
    lses = torch.randn(N, H, T, generator=gen, device=device).mul_(3.0).add_(4.0)

    def merge(out, **kw):
        if N == 2:
            triton_impl.merge_attn_states(out, outs[0], lses[0], outs[1], lses[1], **kw)
        else:
            triton_impl.merge_attn_states_n(out, outs, lses, **kw)

    return merge


def _jax_merge(T, H, D, N):
    """`merge(**options)`: the Pallas 2-way merge (N = 2) or N-way merge of N bf16 partials, without the LSE."""
    import jax
    import jax.numpy as jnp

    import pallas_impl

    key = jax.random.PRNGKey(0)
    outs = jax.random.normal(key, (N, T, H, D), jnp.bfloat16)
    lses = jax.random.normal(key, (N, H, T), jnp.float32) * 3 + 4
    kw = dict(return_lse=False, implementation="pallas")
    # the 2-way merge's operands sliced once: a slice per call is an XLA copy the profiler counts as the merge's
    two_way = jax.block_until_ready((outs[0], lses[0], outs[1], lses[1])) if N == 2 else None

    def merge(**more):
        if N == 2:
            return pallas_impl.merge_attn_states(*two_way, **kw, **more)
        return pallas_impl.merge_attn_states_n(outs, lses, **kw, **more)

    return merge


def _torch_nvfp4_calls(T, H, D, N, device):
    merge = _torch_merge(T, H, D, N, device)
    bf16 = torch.empty(T, H, D, dtype=torch.bfloat16, device=device)
    q = torch.empty(T, H, D // 2, dtype=torch.uint8, device=device)
    scales = torch.empty(T, H * D // 16, dtype=torch.float8_e4m3fn, device=device)
    g = torch.full((1,), 448 * 6 / 8.0, device=device)
    block_t = 1

    def unfused():
        merge(bf16)
        _nvfp4_rows_kernel[(triton.cdiv(T, block_t), 1)](bf16, q, g, scales, T, *q.stride(), *scales.stride(),
                                                         NUM_HEADS=H, HEAD_DIM=D, BLOCK_T=block_t, BLOCK_H=H,
                                                         SWIZZLED=False, num_warps=4)

    return {"bf16": lambda: merge(bf16), "fused": lambda: merge(q, output_scale=g, output_block_scale=scales),
            "unfused": unfused}


def _jax_nvfp4_calls(T, H, D, N):
    import jax
    import jax.numpy as jnp

    from pallas_impl import _math, jnp_fallback

    merge = _jax_merge(T, H, D, N)
    g = jnp.float32(448 * 6 / 8.0)
    # the jnp path's own NVFP4 store (packed codes, row-major block scales) on the bf16 rows
    quant = jax.jit(lambda x: jnp_fallback._stored_grouped(x.astype(jnp.float32), (16, _math.NVFP4, "row"),
                                                           global_scale=g))
    return {"bf16": lambda: merge(), "fused": lambda: merge(out_dtype=jnp.float4_e2m1fn, output_scale=g),
            "unfused": lambda: quant(merge())}


def _torch_calls(T, H, D, N, G, device):
    merge = _torch_merge(T, H, D, N, device)
    bf16 = torch.empty(T, H, D, dtype=torch.bfloat16, device=device)
    fp8 = torch.empty(T, H, D, dtype=torch.float8_e4m3fn, device=device)
    scales = torch.empty(T, H * D // G, dtype=torch.float32, device=device)
    groups = T * H * D // G
    block = 8

    def unfused():
        merge(bf16)
        _quant_kernel[(triton.cdiv(groups, block),)](bf16, fp8, scales, groups, GROUP=G, BLOCK=block, UE8M0=False,
                                                     INTERPRET=interpreting(), num_warps=4)

    return {"bf16": lambda: merge(bf16), "fused": lambda: merge(fp8, group_size=G, output_group_scale=scales),
            "unfused": unfused}


def _jax_calls(T, H, D, N, G):
    import jax
    import jax.numpy as jnp

    from pallas_impl import _math

    merge = _jax_merge(T, H, D, N)
    quant = jax.jit(lambda x: tuple(a.astype(t) for a, t in zip(
        _math.group_quant(x.astype(jnp.float32).reshape(T, -1), G, False), (jnp.float8_e4m3fn, jnp.float32))))
    return {"bf16": lambda: merge(), "fused": lambda: merge(group_size=G), "unfused": lambda: quant(merge())}


def _bytes(T, H, D, N, G, variant, fmt="fp8"):
    reads = N * T * H * (D * 2 + 4)
    # the quantized row and its scales: fp8 bytes and f32 scales per G, or half a byte and an e4m3 scale per 16
    quantized = T * H * D + T * H * D // G * 4 if fmt == "fp8" else T * H * D // 2 + T * H * D // 16
    if variant == "bf16":
        return reads + T * H * D * 2
    if variant == "fused":
        return reads + quantized
    return reads + T * H * D * 2 + T * H * D * 2 + quantized


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools group-fp8-speed", description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[2048, 32768, 131072])
    p.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    p.add_argument("--partials", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--frameworks", nargs="+", default=["triton", "pallas"], choices=["triton", "pallas"])
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--format", default="fp8", choices=["fp8", "nvfp4"], help="per-group FP8 or NVFP4 output")
    p.add_argument("--json", help="write the records to this file")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, each call once, no timing (a CPU check)")
    args = p.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if not (on_gpu or args.smoke):
        print("group-fp8-speed needs a CUDA GPU (or --smoke under TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    if args.smoke:
        args.tokens, args.heads, args.partials = SMOKE["tokens"], SMOKE["heads"], SMOKE["partials"]
    D = SMOKE["head_dim"] if args.smoke else 128
    G = SMOKE["group_size"] if args.smoke else args.group_size
    from parity.tools.bench import timers

    ceiling = None if args.smoke else timers.torch_copy_ceiling_tbps()
    records = []
    for fw in args.frameworks:
        for T in args.tokens:
            for H in args.heads:
                for N in args.partials:
                    device = "cuda" if on_gpu else "cpu"
                    if args.format == "nvfp4":
                        calls = _torch_nvfp4_calls(T, H, D, N, device) if fw == "triton" else _jax_nvfp4_calls(
                            T, H, D, N)
                    else:
                        calls = (_torch_calls(T, H, D, N, G, device) if fw == "triton"
                                 else _jax_calls(T, H, D, N, G))
                    row = dict(framework=fw, format=args.format, T=T, H=H, D=D, N=N,
                               group_size=G if args.format == "fp8" else 16)
                    try:
                        for variant, call in calls.items():
                            if args.smoke:
                                call()
                                row[variant] = "ran"
                                continue
                            if fw == "triton":
                                us = timers.time_cudagraph(call, 20)[0][1]
                            else:
                                import jax

                                us = timers.time_jax_gpu(call, lambda: jax.block_until_ready(call()), 20, 3,
                                                         True)[0][1]
                            row[f"{variant}_us"] = us
                            row[f"{variant}_pct"] = (100 * _bytes(T, H, D, N, G, variant, args.format) / us / 1e6
                                                     / ceiling)
                    except Exception as e:  # a point too large for this GPU's memory: said, and the next one
                        if "RESOURCE_EXHAUSTED" not in str(e) and not isinstance(e, torch.OutOfMemoryError):
                            raise
                        row["skipped"] = "out of memory"
                    del calls
                    gc.collect()
                    records.append(row)
                    print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ceiling_tbps": ceiling, "records": records, "commit": os.environ.get("GIT_COMMIT")}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
