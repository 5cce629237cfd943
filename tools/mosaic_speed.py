"""GPU time of the Mosaic GPU kernels of pallas_impl beside the Pallas Triton backend's, and a sweep of the Mosaic GPU
launch choices (`pallas_impl.mosaic._common.TUNING`), in one process on one GPU (jax >= 0.11).

    python -m tools mosaic-speed [--json OUT.json] [--budget-s 140] [--no-sweep | --grid]

What it times (jax.profiler kernel time per call, `parity.tools.bench.timers.time_jax_gpu`; median of 20 calls):
- the mask on the docs/spec.md 7 seed workloads (`parity.harness.cases`, tag "seed"), LSE only and with output zeroing,
  as `jax.jit(mask_empty_context_lse, donate)` chained (the documented in-place form; has_empty=True);
- the 2-way merge, variants plain / lse / fused, at T = 32768 and 2048 (H = 64, D = 128, bf16), and the N-way
  merge at N = 2, 4, 8 (T = 32768), as a fraction of the two-read-one-write ceiling measured here (an XLA
  `a + b` of 2 x 1 GiB bf16; bytes as `parity.tools.bench.FORMULAS`);
- the quantized merges (`QUANTIZED`: per-group FP8 with G = 128 and 64, NVFP4), 2-way and N = 4 at T = 32768,
  their bytes with the quantized output and its scales.
Every point runs on the Triton backend and on Mosaic GPU with the shipped defaults first, then with the other
candidates of `CANDIDATES` (until `--budget-s`). The table ends with each kernel's candidates ranked over its
points (the mask's two variants apart): put the best in `TUNING` if it is not the default. `--no-sweep` times
the defaults only; `--grid` times the merges' whole table (`GRID_PARTIALS`, both LSE layouts) with the defaults (and
the first `--first` candidates with it);
`--match REGEX` keeps the points whose label matches.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import sys
import time
from pathlib import Path


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402

import pallas_impl  # noqa: E402
from pallas_impl.mosaic import _common as mc  # noqa: E402
from parity.harness import cases  # noqa: E402
from parity.tools.bench import timers  # noqa: E402

H, D, DTYPE = 64, 128, jnp.bfloat16
CALLS = 20
# Launch candidates per Mosaic GPU kernel (`TUNING` keys), the shipped default first.
CANDIDATES = {
    "mask": [dict(mc.TUNING["mask"]), dict(heads=8, tokens=8, offsets_in_smem=False)]
            + [dict(heads=k, tokens=8, offsets_in_smem=True) for k in (4, 16)],
    "mask_lse": [dict(mc.TUNING["mask_lse"]), dict(heads=16, offsets_in_smem=False)]
                + [dict(heads=k, offsets_in_smem=True) for k in (8, 32)],
    # (Candidates well behind in the committed sweeps are left out: docs/results.md.)
    # ctas_per_sm > 0: persistent CTAs (`mc.Tiles`); 32 KiB 2-way tiles hold one CTA per SM, 16 KiB ones two (for
    # the issue-bound quantized merges, more warps per scheduler).
    # th_boxes: `[T, H]` LSEs read in boxes of heads, one token tile of 8 heads per CTA (`mc.lse_boxes`; a grid);
    # compute_wgs=2: warp-specialised (`mc.compute_warpgroups`); lse_tma=False: the LSE rows by per-thread loads;
    # grouped={}: per-group FP8 and NVFP4 outputs with the plain merges' choices (`mc.merge_tuning`); split="rows":
    # two compute warpgroups of 64 rows each (`mc.warpgroup_tile`); nvfp4=...: the N-way NVFP4 merge on two compute
    # warpgroups by rows (`mc.merge_n_tuning`; by columns its second half was wrong on the H100, docs/results.md).
    "merge": [dict(mc.TUNING["merge"]),
              dict(mc.TUNING["merge"], th_boxes=True),
              dict(mc.TUNING["merge"], grouped=dict(compute_wgs=2)),
              dict(mc.TUNING["merge"], compute_wgs=2, split="rows", grouped=dict(compute_wgs=2, split="rows")),
              dict(mc.TUNING["merge"], lse_tma=False),
              dict(mc.TUNING["merge"], grouped={}),
              dict(mc.TUNING["merge"], row_weights=False),
              dict(mc.TUNING["merge"], compute_wgs=2),
              dict(mc.TUNING["merge"], ctas_per_sm=1),
              dict(mc.TUNING["merge"], compute_wgs=2, ctas_per_sm=1),
              dict(mc.TUNING["merge"], long_tile_bytes=16 * 1024),
              dict(mc.TUNING["merge"], compute_wgs=2, long_tile_bytes=16 * 1024),
              dict(mc.TUNING["merge"], ctas_per_sm=2, long_tile_bytes=16 * 1024),
              dict(mc.TUNING["merge"], ctas_per_sm=1, concurrent=3, long_tile_bytes=16 * 1024),
              dict(steps=16, concurrent=2, tile_bytes=32 * 1024, stores=2)],
    "merge_n": [dict(mc.TUNING["merge_n"]),
                dict(mc.TUNING["merge_n"], th_boxes=True),
                dict(mc.TUNING["merge_n"], nvfp4=dict(compute_wgs=2, split="rows")),
                dict(mc.TUNING["merge_n"], ctas_per_sm=0),
                dict(mc.TUNING["merge_n"], compute_wgs=2),
                dict(mc.TUNING["merge_n"], lse_tma=False),
                dict(mc.TUNING["merge_n"], ctas_per_sm=1),
                dict(mc.TUNING["merge_n"], compute_wgs=2, ctas_per_sm=1),
                dict(mc.TUNING["merge_n"], lse_step=16),
                dict(steps=16, concurrent=2, tile_bytes=32 * 1024, stores=1, lse_step=4)],
}


def gpu_us(call, sync) -> float:
    q, _, _ = timers.time_jax_gpu(call, sync, CALLS, 3, use_profiler=True)
    return q[1]


def ceiling_tbps() -> float:
    n = 1 << 29  # 1 GiB of bf16 per operand
    a, b = jnp.ones((n,), DTYPE), jnp.ones((n,), DTYPE)
    add = jax.jit(lambda a, b: a + b)
    out = [None]
    us = gpu_us(lambda: out.__setitem__(0, add(a, b)), lambda: out[0].block_until_ready())
    return 3 * 2 * n / (us * 1e-6) / 1e12


def empty_kernel_point(backend: str) -> float:
    """GPU time of a Pallas kernel of 64 programs that does nothing (the floor of a short kernel such as the
    LSE-only mask at 2k_balanced: 64 CTAs)."""
    out = jax.ShapeDtypeStruct((mc.BLOCK_T,), jnp.float32)
    if backend == "mosaic_gpu":
        f = jax.jit(lambda: mc.kernel(lambda o_g: None, out_type=out, grid=(64,), grid_names=("b",),
                                      interpret=False)())
    else:
        f = jax.jit(lambda: pl.pallas_call(lambda o_ref: None, out_shape=out, grid=(64,),
                                           compiler_params=pallas_impl._backend.pltriton.CompilerParams())())
    res = [None]
    return gpu_us(lambda: res.__setitem__(0, f()), lambda: jax.block_until_ready(res[0]))


def mask_point(case, with_out: bool, backend: str) -> float:
    qsl, cu = cases.offsets(case)
    T = int(case.num_tokens)
    key = jax.random.key(0)
    state = {"lse": jax.random.normal(key, (case.num_heads, T), jnp.float32)}
    if with_out:
        state["out"] = jax.random.normal(key, (T, case.num_heads, case.head_dim), jnp.dtype(case.dtype))
    qsl, cu = jnp.asarray(qsl), jnp.asarray(cu)
    fn = functools.partial(pallas_impl.mask_empty_context_lse, has_empty=True, backend=backend)
    if with_out:
        step = jax.jit(lambda l, o: fn(l, qsl, cu, o), donate_argnums=(0, 1))

        def call():
            state["lse"], state["out"] = step(state["lse"], state["out"])
    else:
        step = jax.jit(lambda l: fn(l, qsl, cu), donate_argnums=0)

        def call():
            state["lse"] = step(state["lse"])
    return gpu_us(call, lambda: state["lse"].block_until_ready())


# Quantized variants (docs/spec.md 4.7, 4.8): the output's options and its bytes per element, scales included.
QUANTIZED = {"fp8_g128": (dict(group_size=128), 1 + 4 / 128), "fp8_g64": (dict(group_size=64), 1 + 4 / 64),
             "nvfp4": (dict(out_dtype=jnp.float4_e2m1fn, output_scale=jnp.float32(40.0)), 0.5 + 1 / 16)}


def merge_call(T: int, n: int, variant: str, backend: str, lse_layout: str = "HT"):
    """(call, bytes) of the 2-way merge (n = 0) or the N-way merge: `call()` runs it once on its inputs (on the
    GPU); `variant` plain, lse, fused or one of QUANTIZED (no output LSE)."""
    key = jax.random.key(1)
    parts = max(n, 2)
    o = jax.random.normal(key, (parts, T, H, D), DTYPE)
    lse = jax.random.normal(key, (parts, H, T), jnp.float32) * 3 + 4
    if lse_layout == "TH":
        lse = jnp.swapaxes(lse, 1, 2)
    quant, out_bytes = QUANTIZED.get(variant, ({}, 2))
    kw = dict(return_lse=variant in ("lse", "fused"), backend=backend, lse_layout=lse_layout, **quant)
    if variant == "fused":  # 128-token requests, every even one empty in the prefix (every partial but the last)
        qsl = np.arange(0, T + 1, 128, dtype=np.int32)
        lens = np.where(np.arange(len(qsl) - 1) % 2 == 0, 0, 64)
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        cus = np.stack([cu] * (parts - 1) + [np.arange(len(qsl), dtype=np.int32) * 64])
        kw["query_start_loc"] = jnp.asarray(qsl)
        if n:
            kw["cu_seq_lens"] = jnp.asarray(cus[-n:])
        else:
            kw["prefix_cu_seq_lens"] = jnp.asarray(cu)
    if n:
        f = jax.jit(lambda o, l: pallas_impl.merge_attn_states_n(o, l, **kw))
        args = (o[:n], lse[:n])
    else:  # separate prefix and suffix arrays: slicing a stacked one inside the jit would time XLA's copies too
        f = jax.jit(lambda a, p, b, s: pallas_impl.merge_attn_states(a, p, b, s, **kw))
        args = (o[0], lse[0], o[1], lse[1])
    elems = T * H * D
    lse_out = T * H * 4 if kw["return_lse"] else 0
    return (lambda: f(*args)), parts * (elems * 2 + T * H * 4) + int(elems * out_bytes) + lse_out


def merge_point(T: int, n: int, variant: str, backend: str, lse_layout: str = "HT") -> tuple[float, int]:
    """(GPU us, bytes) of `merge_call`'s merge."""
    call, nbytes = merge_call(T, n, variant, backend, lse_layout)
    res = [None]
    us = gpu_us(lambda: res.__setitem__(0, call()), lambda: jax.block_until_ready(res[0]))
    return us, nbytes


# --grid: every merge cell of the Mosaic GPU speed table (docs/design.md, "Mosaic GPU backend"): the 2-way merge
# (N = 0 here) and the N-way merge at N = 2-16 at T = 2K / 32K / 131K, N = 128 and 256 at T = 8K (their partials
# at 131K would not fit the GPU: 256 x 131K x 64 x 128 bf16 is 550 GB); plain, + LSE, fused; [H, T] and [T, H].
GRID_TOKENS = (2048, 32768, 131072)
GRID_PARTIALS = ((0, GRID_TOKENS), (2, GRID_TOKENS), (4, GRID_TOKENS), (8, GRID_TOKENS), (16, GRID_TOKENS),
                 (128, (8192,)), (256, (8192,)))


def grid_points():
    """(kernel, label, fn(backend)) of every --grid cell, N = 0 for the 2-way merge."""
    out = []
    for n, tokens in GRID_PARTIALS:
        for T in tokens:
            for variant in ("plain", "lse", "fused"):
                for layout in ("HT", "TH"):
                    label = f"{'merge' if not n else f'merge_n N={n}'} T={T} {variant} {layout}"
                    out.append(("merge_n" if n else "merge", label,
                                lambda b, n=n, T=T, v=variant, lay=layout: merge_point(T, n, v, b, lay)))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default=None)
    p.add_argument("--budget-s", type=float, default=140.0, help="start no new point after this many seconds")
    p.add_argument("--no-sweep", action="store_true", help="time the default TUNING only")
    p.add_argument("--first", type=int, default=None, help="sweep only the first FIRST candidates of each kernel")
    p.add_argument("--kernels", nargs="+", choices=sorted(CANDIDATES), default=None,
                   help="only the points of these kernels (TUNING keys)")
    p.add_argument("--match", default=None, help="only the points whose label matches this regular expression")
    p.add_argument("--grid", action="store_true",
                   help="the merges' whole table instead of the default points (GRID; implies --no-sweep unless "
                        "--first is given)")
    args = p.parse_args(argv)
    if args.grid and args.first is None:
        args.no_sweep = True
    if jax.default_backend() != "gpu":
        print("mosaic_speed: needs a GPU (jax sees none)", file=sys.stderr)
        return 2
    start = time.time()
    defaults = {k: dict(v) for k, v in mc.TUNING.items()}
    ceil = ceiling_tbps()
    print(f"two-read-one-write ceiling (XLA a + b, bf16): {ceil:.2f} TB/s", flush=True)
    records = []

    points = [("empty", "empty kernel, 64 programs", lambda b: (empty_kernel_point(b), None))]
    # (kernel, label, fn(backend) -> (us, bytes or None)); "empty" has no launch choices
    for case in cases.select("seed"):
        for with_out in (False, True):
            points.append(("mask" if with_out else "mask_lse", f"mask {'lse+out' if with_out else 'lse'} {case.name}",
                           lambda b, c=case, w=with_out: (mask_point(c, w, b), None)))
    for T in (32768, 2048):
        for variant in ("plain", "lse", "fused"):
            points.append(("merge", f"merge T={T} {variant}", lambda b, T=T, v=variant: merge_point(T, 0, v, b)))
    for n in (2, 4, 8):
        for variant in ("plain", "lse", "fused"):
            points.append(("merge_n", f"merge_n N={n} T=32768 {variant}",
                           lambda b, n=n, v=variant: merge_point(32768, n, v, b)))
    # N = 128: the runtime loops over the partials' LSE rows (`lse_step`)
    points.append(("merge_n", "merge_n N=128 T=8192 plain", lambda b: merge_point(8192, 128, "plain", b)))
    for variant in QUANTIZED:  # the quantized merges: per-group FP8 (G = 128, and 64: two compute warpgroups split
        # it) and NVFP4, 2-way and N = 4
        points.append(("merge", f"merge T=32768 {variant}", lambda b, v=variant: merge_point(32768, 0, v, b)))
        points.append(("merge_n", f"merge_n N=4 T=32768 {variant}", lambda b, v=variant: merge_point(32768, 4, v, b)))

    if args.grid:
        points = points[:1] + grid_points()
    if args.kernels:
        points = [p for p in points if p[0] in args.kernels or p[0] == "empty"]
    if args.match:
        points = [p for p in points if re.search(args.match, p[1]) or p[0] == "empty"]

    def run(kernel, label, fn, backend, cand):
        if time.time() - start > args.budget_s:
            print(f"  budget spent: skipping {label} {backend} {cand}", flush=True)
            return
        if kernel in defaults:
            mc.TUNING[kernel] = dict(cand or defaults[kernel])
        jax.clear_caches()
        try:
            us, nb = fn(backend)
            rec = dict(kernel=kernel, point=label, backend=backend, tuning=cand, us=us)
            if nb is not None:
                rec.update(tbps=nb / (us * 1e-6) / 1e12, frac_ceiling=nb / (us * 1e-6) / 1e12 / ceil)
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile or fit is reported
            first = str(e).splitlines()[0][:200] if str(e) else ""
            rec = dict(kernel=kernel, point=label, backend=backend, tuning=cand, error=f"{type(e).__name__}: {first}")
        finally:
            if kernel in defaults:
                mc.TUNING[kernel] = dict(defaults[kernel])
        records.append(rec)
        frac = f"  {100 * rec['frac_ceiling']:5.1f}% of 2R1W" if "frac_ceiling" in rec else ""
        what = rec.get("error") or f"{rec['us']:9.2f} us{frac}"
        print(f"{label:28s} {backend:10s} {json.dumps(cand) if cand else '':72s} {what}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(dict(ceiling_tbps=ceil, records=records), indent=1))

    # First every point on the Triton backend and on Mosaic GPU with the defaults, then the other candidates.
    for kernel, label, fn in points:
        run(kernel, label, fn, "triton", None)
        run(kernel, label, fn, "mosaic_gpu", CANDIDATES.get(kernel, [None])[0])
    if not args.no_sweep:
        print("\nsweep of the other candidates:", flush=True)
        for kernel, label, fn in points:
            for cand in CANDIDATES.get(kernel, [None])[1:args.first]:
                run(kernel, label, fn, "mosaic_gpu", cand)

    print("\nbest Mosaic GPU candidate per kernel (geometric mean of its time over the Triton backend's):")
    groups = [("mask_lse", "mask lse "), ("mask", "mask lse+out "), ("merge", "merge "), ("merge_n", "merge_n ")]
    for kernel, prefix in groups:
        mine = [r for r in records if r["kernel"] == kernel and r["point"].startswith(prefix) and "us" in r]
        tri = {r["point"]: r["us"] for r in mine if r["backend"] == "triton"}
        scores = []
        for cand in CANDIDATES[kernel]:
            ratios = [r["us"] / tri[r["point"]] for r in mine if r["tuning"] == cand and r["point"] in tri]
            if ratios:
                scores.append((float(np.exp(np.mean(np.log(ratios)))), len(ratios), cand))
        for score, count, cand in sorted(scores, key=lambda s: s[0]):
            print(f"  {prefix:14s} {score:6.3f}x Triton over {count} points: {json.dumps(cand)}")
    print(f"({time.time() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
