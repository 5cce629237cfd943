"""The sweeps behind the tile choices in docs/results.md. GPU only; run from the repository root:

    python -m tools tune merge --tiles 8192,1,4 8192,8,4 --tokens 32768 131072 --json merge.json
    python -m tools tune merge_n --tiles 8192,1,4 4096,4,4 --partials 4 8 --json merge_n.json
    python -m tools tune mask --json mask.json
    python -m tools tune merge_n --lse-layout HT TH --lse-base e 2 --partials-view contig gather --json l.json
    python -m tools tune merge_n --partials 128 --tokens 8192 --tiles 16384,8,4/2048,4096/64,16,8 --json wide.json

merge: for each tile (bytes of one input tile, fewest tokens, warps) sets it for every variant of both
frameworks' `MERGE_TILES`, then times plain / output-LSE / fused merges (Triton: CUDA-graph replay; JAX: profiler
kernel time) and reports % of a `torch.add` 2R1W ceiling measured first. The committed tuning_1..3 files
give tiles as (elements, fewest tokens, warps) of bf16, i.e. half the bytes used here.
merge_n: the same for the N-way merge's `MERGE_N_TILES` (N stacked partials; a tile's bytes are those of the
program's N input tiles together, `partial_tile_bytes`), plain / output-LSE / fused.
mask: MASK_NUM_WARPS x MASK_TILE_H on the docs/spec.md 7 seed workloads, both frameworks.
Layouts (every sweep runs each combination): `--lse-layout` HT ([H, T] LSEs) / TH ([T, H]), `--lse-base` e / 2,
and for merge_n `--partials-view` contig ([N, T, H, D]) / gather (the [T, N, H, D] all-gather buffer read through
a [N, T, H, D] view; Triton only: JAX arrays have no strides, its columns are NaN). Rows carry the layout.
The floors (an empty kernel, a `fill_` of each mask workload's bytes, the host and eager cost of an empty launch
and of a jitted JAX dispatch) are recorded by every `python -m parity bench` run (parity/tools/bench/).
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import itertools
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import pallas_impl  # noqa: E402
import triton_impl  # noqa: E402
from mla_lse_common import tiles  # noqa: E402
from parity.library import bridge
from parity.harness import cases  # noqa: E402
from parity.tools.bench import points, timers  # noqa: E402
from triton_impl import _plans as tplans  # noqa: E402

SEEDS = {c.name: c for c in cases.select("seed")}


def gpu_us_triton(fn) -> float:
    fn()  # compile outside the graph capture
    torch.cuda.synchronize()
    return timers.time_cudagraph(fn, 20)[0][1]


def gpu_us_jax(call, sync, n: int = 20) -> float:
    got = timers.time_jax_profiler(call, sync, n)
    return got[0][1] if got else float("nan")


def kernels_triton(fn, n: int = 10) -> dict:
    """{kernel name: mean device time per call (us)} of `fn`'s kernels, from torch.profiler over n calls."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return {e.key: round(e.device_time_total / n, 2) for e in prof.key_averages() if e.device_time_total > 0}


def kernels_jax(call, sync, n: int = 10) -> dict:
    """{kernel name: mean device time per call (us)} of a JAX call's kernels, from the profiler's events."""
    out = {}
    for _, dur_ns, name in timers.jax_kernel_events(call, sync, n):
        out[name] = out.get(name, 0.0) + dur_ns / 1e3 / n
    return {k: round(v, 2) for k, v in out.items()}


def lse_shape(layout: str, H: int, T: int) -> tuple[int, int]:
    return (H, T) if layout == "HT" else (T, H)


def layouts(args) -> list[tuple[str, str]]:
    """(lse_layout, lse_base) pairs of the sweep."""
    return list(itertools.product(args.lse_layout, args.lse_base))


COMMITTED = {k: copy.deepcopy(getattr(tiles, k)) for k in ("MERGE_TILES", "MERGE_N_TILES")}
# Every knob a tile or hint sets, so each tile starts from the committed values (a hint's knob does not outlive it).
DEFAULT_KNOBS = {k: getattr(tiles, k) for k in ("N_TILE_BYTES", "N_LOOPS", "N_OUTPUTS_EVICT", "N_OUT_STAGES",
                                              "N_EARLY_OUTPUTS", "N_SPLIT_ABOVE", "N_SPLIT_WEIGHTS",
                                              "N_SPLIT_WEIGHTS_LAYOUT", "MAX_SUM_POSITIONS", "MAX_SUM_WARPS",
                                              "MAX_SUM_FUSED_HEADS", "MAX_SUM_FUSED_POSITIONS",
                                              "MAX_SUM_FUSED_WARPS")}
# +hint: knobs of both frameworks; +ef / +normal: N_OUTPUTS_EVICT; +single: the N-way merge in one kernel at every N
# (N_SPLIT_ABOVE; without it, two beyond UNROLLED_PARTIALS); +mz / +w: the first of two kernels stores m and z
# only / the weights too (N_SPLIT_WEIGHTS); +wth: the stored weights in a [T, H] buffer with [H, T] LSEs
# (N_SPLIT_WEIGHTS_LAYOUT); +fhH: H heads per first-kernel program of the fused variant in [H, T] layout
# (MAX_SUM_FUSED_HEADS); +psP / +mwW: P LSE positions / W warps per first-kernel program, every variant's
# (MAX_SUM_POSITIONS and MAX_SUM_FUSED_POSITIONS, MAX_SUM_WARPS and MAX_SUM_FUSED_WARPS); +osS: S stages of the
# weighted sum's runtime loop (N_OUT_STAGES; Pallas: any S > 1 is one step ahead); +eoK: K output tiles loaded
# before the LSE passes at every N where the loops unroll (N_EARLY_OUTPUTS; capped at N - 1)
HINTS = {"ef": dict(N_OUTPUTS_EVICT={fw: "evict_first" for fw in tiles.FRAMEWORKS}),
         "normal": dict(N_OUTPUTS_EVICT={fw: "" for fw in tiles.FRAMEWORKS}),
         "single": dict(N_SPLIT_ABOVE=1 << 30),
         "mz": dict(N_SPLIT_WEIGHTS={fw: {v: dict.fromkeys(("HT", "TH"), False) for v in ("plain", "lse", "fused")}
                                   for fw in tiles.FRAMEWORKS}),
         "w": dict(N_SPLIT_WEIGHTS={fw: {v: dict.fromkeys(("HT", "TH"), True) for v in ("plain", "lse", "fused")}
                                   for fw in tiles.FRAMEWORKS}),
         "wth": dict(N_SPLIT_WEIGHTS_LAYOUT=dict.fromkeys(tiles.FRAMEWORKS, "TH")),
         **{f"fh{h}": dict(MAX_SUM_FUSED_HEADS=dict.fromkeys(tiles.FRAMEWORKS, h)) for h in (4, 8, 16, 32, 64)},
         **{f"ps{p}": dict(MAX_SUM_POSITIONS=p, MAX_SUM_FUSED_POSITIONS=dict.fromkeys(tiles.FRAMEWORKS, p))
            for p in (128, 256, 512, 1024, 2048, 4096)},
         **{f"mw{w}": dict(MAX_SUM_WARPS=w, MAX_SUM_FUSED_WARPS=dict.fromkeys(tiles.FRAMEWORKS, w))
            for w in (2, 4, 8, 16)},
         **{f"os{n}": dict(N_OUT_STAGES={fw: dict.fromkeys(("plain", "lse", "fused"), n) for fw in tiles.FRAMEWORKS})
            for n in (1, 2, 3, 4)},
         **{f"eo{k}": dict(N_EARLY_OUTPUTS={fw: {v: {1: k} for v in ("plain", "lse", "fused")}
                                            for fw in tiles.FRAMEWORKS})
            for k in (0, 1, 2, 3, 4, 5, 6, 8, 12, 16)}}


def parse_tile(text: str) -> dict:
    """"bytes,fewest_tokens,warps[/lo,hi[/chunk,exp_step,out_step]][+hint...]", "committed" in place of the tile or
    of the bounds: a tile (or the committed tables), and for merge_n optionally the bounds of one partial's tile
    (`N_TILE_BYTES`), the loops beyond UNROLLED_PARTIALS (`N_LOOPS`: max_chunk, exp_step, out_step) and `HINTS` (the
    policy of the partials' output loads there, one kernel or two, ...), for every variant of both frameworks."""
    text, *hints = text.split("+")
    parts = [None if p == "committed" else tuple(int(v) for v in p.split(",")) for p in text.split("/")]
    knobs = dict(DEFAULT_KNOBS)
    for hint in hints:
        if hint not in HINTS:
            raise argparse.ArgumentTypeError(f"the hints are {sorted(HINTS)}, got +{hint}")
        knobs.update(HINTS[hint])
    if len(parts) > 1 and parts[1] is not None:
        knobs["N_TILE_BYTES"] = parts[1]
    if len(parts) > 2:
        knobs["N_LOOPS"] = {fw: {v: tuple(parts[2]) for v in ("plain", "lse", "fused")} for fw in tiles.FRAMEWORKS}
    return dict(tile=parts[0], knobs=knobs, label="+".join([text, *hints]))


def set_merge_tiles(tile, table: str = "MERGE_TILES") -> None:
    """`tile` (a `parse_tile` dict) for every variant of both frameworks' `table` and its other knobs
    (mla_lse_common.tiles, the one place of the knobs)."""
    if tile["tile"] is None:  # the committed tables, with the tile's other knobs
        tiles.set_knobs(**{table: COMMITTED[table]}, **tile["knobs"])
        return clear_caches()

    def entry():
        if table == "MERGE_TILES":
            return tuple(tile["tile"])
        total, fewest, warps = tile["tile"]  # the N-way entry: the same fewest tokens at the floor
        return {layout: (total, fewest, fewest, warps) for layout in ("HT", "TH")}

    tiles.set_knobs(**{table: {fw: {variant: entry() for variant in per_fw}
                               for fw, per_fw in getattr(tiles, table).items()}}, **tile["knobs"])
    clear_caches()


def clear_caches() -> None:
    tplans.PLANS.clear()  # the Triton wrappers' launch plans hold tiles too
    jax.clear_caches()  # the Pallas wrapper's jit cache holds traced tiles
    gc.collect()  # the dropped executables go now, not during a CUDA-graph capture
    jax.effects_barrier()
    torch.cuda.synchronize()


def merge_sweep(args) -> list[dict]:
    ceiling = timers.torch_copy_ceiling_tbps()
    out = []
    for dtype, H, D, T, (layout, base) in itertools.product(args.dtypes, args.heads, args.dims, args.tokens,
                                                             layouts(args)):
        tdt = getattr(torch, dtype)
        g = torch.Generator(device="cuda").manual_seed(0)
        lay = dict(lse_layout=layout, lse_base=points.base_value(base))
        x = {k: torch.randn(T, H, D, generator=g, device="cuda", dtype=tdt) for k in ("a", "b")}
        x.update({k: torch.randn(*lse_shape(layout, H, T), generator=g, device="cuda") * 3 + 4 for k in ("pl", "sl")})
        o, olse = torch.empty_like(x["a"]), torch.empty_like(x["pl"])
        fc = cases.Case("fused", (128,) * (T // 128), tuple(range(0, T // 128, 2)), num_heads=H, head_dim=D)
        qsl_np, cu_np = cases.offsets(fc)
        offs = dict(query_start_loc=torch.from_numpy(qsl_np).cuda(), prefix_cu_seq_lens=torch.from_numpy(cu_np).cuda())
        joffs = dict(query_start_loc=jax.device_put(qsl_np), prefix_cu_seq_lens=jax.device_put(cu_np))
        jx = tuple(bridge.torch_to_jax(x[k]) for k in ("a", "pl", "b", "sl"))
        for tile in args.tiles:
            if time.monotonic() > args.deadline:
                break
            set_merge_tiles(tile)
            row = {"dtype": dtype, "T": T, "H": H, "D": D, "lse_layout": layout, "lse_base": base,
                   "tile": tile["label"]}
            for variant in ("plain", "lse", "fused"):
                kw = offs if variant == "fused" else {}
                olse_v = None if variant == "plain" else olse
                row[f"triton_{variant}_us"] = gpu_us_triton(functools.partial(
                    triton_impl.merge_attn_states, o, x["a"], x["pl"], x["b"], x["sl"], olse_v, **kw, **lay))
                f = jax.jit(functools.partial(pallas_impl.merge_attn_states, return_lse=variant != "plain", **lay))
                last = [None]

                def call(f=f, jkw=joffs if variant == "fused" else {}):
                    last[0] = f(*jx, **jkw)

                row[f"pallas_{variant}_us"] = gpu_us_jax(call, lambda: jax.block_until_ready(last[0]))
            for impl in ("triton", "pallas"):
                for variant in ("plain", "lse"):
                    nbytes = points.MergePoint(T, H, D, dtype, variant).bytes
                    row[f"{impl}_{variant}_pct"] = round(100 * nbytes / row[f"{impl}_{variant}_us"] / 1e6 / ceiling, 1)
                row[f"{impl}_fused_over_lse"] = round(row[f"{impl}_fused_us"] / row[f"{impl}_lse_us"] - 1, 4)
            print(json.dumps(row), flush=True)
            out.append(row)
        x = o = olse = jx = None
        torch.cuda.empty_cache()
    return [{"ceiling_tbps": ceiling}] + out


def merge_n_sweep(args) -> list[dict]:
    ceiling = timers.torch_copy_ceiling_tbps()
    out = []
    for N, dtype, H, D, T, (layout, base), view in itertools.product(
            args.partials, args.dtypes, args.heads, args.dims, args.tokens, layouts(args), args.partials_view):
        tdt = getattr(torch, dtype)
        g = torch.Generator(device="cuda").manual_seed(0)
        lay = dict(lse_layout=layout, lse_base=points.base_value(base))
        if view == "gather":  # the [T, N, H, D] all-gather buffer read through a [N, T, H, D] view
            o = torch.randn(T, N, H, D, generator=g, device="cuda", dtype=tdt).transpose(0, 1)
        else:
            o = torch.randn(N, T, H, D, generator=g, device="cuda", dtype=tdt)
        lse = torch.randn(N, *lse_shape(layout, H, T), generator=g, device="cuda") * 3 + 4
        out_t = torch.empty(T, H, D, dtype=tdt, device="cuda")
        olse = torch.empty(*lse_shape(layout, H, T), device="cuda")
        q_np, cu_np = cases.offsets_n(points.MergePoint(T, H, D, dtype, "fused", N).fused_case())
        offs = dict(query_start_loc=torch.from_numpy(q_np).cuda(), cu_seq_lens=torch.from_numpy(cu_np).cuda())
        joffs = dict(query_start_loc=jax.device_put(q_np), cu_seq_lens=jax.device_put(cu_np))
        jo = None if view == "gather" else bridge.torch_to_jax(o)  # JAX arrays have no strides
        jl = bridge.torch_to_jax(lse)
        for tile in args.tiles:
            if time.monotonic() > args.deadline:
                break
            set_merge_tiles(tile, "MERGE_N_TILES")
            row = {"N": N, "dtype": dtype, "T": T, "H": H, "D": D, "request_len": args.request_len,
                   "lse_layout": layout, "lse_base": base,
                   "partials_view": view, "tile": tile["label"],
                   "block": list(tiles.merge_tiles("triton", H, D, "lse", tdt.itemsize, N, layout))}
            for variant in args.variants:
                kw = offs if variant == "fused" else {}
                tcall = functools.partial(triton_impl.merge_attn_states_n, out_t, o, lse,
                                          None if variant == "plain" else olse, **kw, **lay)
                us = gpu_us_triton(tcall) if "triton" in args.frameworks else float("nan")
                if args.kernels and "triton" in args.frameworks:
                    row[f"triton_{variant}_kernels"] = kernels_triton(tcall)
                pus = float("nan")
                if jo is not None and "pallas" in args.frameworks:
                    f = jax.jit(functools.partial(pallas_impl.merge_attn_states_n, return_lse=variant != "plain",
                                                  **lay))
                    last = [None]

                    def call(f=f, jkw=joffs if variant == "fused" else {}):
                        last[0] = f(jo, jl, **jkw)

                    pus = gpu_us_jax(call, lambda: jax.block_until_ready(last[0]))
                    if args.kernels:
                        row[f"pallas_{variant}_kernels"] = kernels_jax(call, lambda: jax.block_until_ready(last[0]))
                nbytes = points.MergePoint(T, H, D, dtype, variant, N).bytes
                for impl, t_us in (("triton", us), ("pallas", pus)):
                    row[f"{impl}_{variant}_us"] = round(t_us, 2)
                    row[f"{impl}_{variant}_pct"] = round(100 * nbytes / t_us / 1e6 / ceiling, 1)
            print(json.dumps(row), flush=True)
            out.append(row)
        o = lse = out_t = olse = jo = jl = None
        torch.cuda.empty_cache()
    return [{"ceiling_tbps": ceiling}] + out


def mask_sweep(args) -> list[dict]:
    out = []
    for name, layout in itertools.product(args.workloads, args.lse_layout):
        case = SEEDS[name]
        qsl_np, cu_np = cases.offsets(case)
        lse = torch.randn(*lse_shape(layout, case.num_heads, case.num_tokens), device="cuda")
        qsl, cu = torch.from_numpy(qsl_np).cuda(), torch.from_numpy(cu_np).cuda()
        jq, jc = jax.device_put(qsl_np), jax.device_put(cu_np)
        for warps, tile_h in itertools.product(args.warps, args.tile_h):
            tiles.set_knobs(MASK_NUM_WARPS={"triton": warps, "pallas": warps}, MASK_TILE_H=tile_h)  # both frameworks
            tplans.PLANS.clear()
            jax.clear_caches()
            t_us = gpu_us_triton(functools.partial(triton_impl.mask_empty_context_lse, lse, qsl, cu, has_empty=True,
                                                   lse_layout=layout))
            state = [jnp.copy(bridge.torch_to_jax(lse))]
            step = jax.jit(functools.partial(pallas_impl.mask_empty_context_lse, has_empty=True, lse_layout=layout),
                           donate_argnums=0)

            def call():
                state[0] = step(state[0], jq, jc)

            row = {"workload": name, "lse_layout": layout, "warps": warps, "tile_h": tile_h, "triton_us": t_us,
                   "pallas_us": gpu_us_jax(call, lambda: jax.block_until_ready(state))}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=("merge", "merge_n", "mask"))
    p.add_argument("--tiles", nargs="+", type=parse_tile, default=None,
                   help="bytes,fewest_tokens,warps; merge_n: optionally /lo,hi (N_TILE_BYTES) and "
                        "/chunk,exp_step,out_step (N_LOOPS); default: merge 8192,1,4 8192,8,4 "
                        "16384,8,8 4096,1,2, merge_n the committed tables (\"committed\"; +ef / +normal: "
                        "N_OUTPUTS_EVICT)")
    p.add_argument("--frameworks", nargs="+", choices=("triton", "pallas"), default=["triton", "pallas"],
                   help="merge_n: the frameworks timed (Pallas's arrays are made from Triton's either way)")
    p.add_argument("--tokens", nargs="+", type=int, default=[32768, 131072])
    p.add_argument("--partials", nargs="+", type=int, default=[4, 8], help="merge_n: N")
    p.add_argument("--variants", nargs="+", default=["plain", "lse", "fused"], help="merge_n: variants timed")
    p.add_argument("--budget-s", type=float, default=1e9, help="start no new tile after this many seconds")
    p.add_argument("--heads", nargs="+", type=int, default=[64])
    p.add_argument("--dims", nargs="+", type=int, default=[128])
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"])
    p.add_argument("--warps", nargs="+", type=int, default=[2, 4, 8])
    p.add_argument("--tile-h", nargs="+", type=int, default=[16, 32, 64])
    p.add_argument("--workloads", nargs="+", default=list(SEEDS))
    p.add_argument("--lse-layout", nargs="+", choices=("HT", "TH"), default=["HT"], help="LSE layouts swept")
    p.add_argument("--lse-base", nargs="+", choices=("e", "2"), default=["e"], help="merge, merge_n: LSE bases")
    p.add_argument("--partials-view", nargs="+", choices=points.VIEWS, default=["contig"],
                   help="merge_n: partials contiguous [N, T, H, D] or the [T, N, H, D] all-gather view (Triton only)")
    p.add_argument("--request-len", type=int, default=points.FUSED_REQUEST_LEN,
                   help="merge, merge_n: tokens per request of the fused variant's offsets (R = T / it)")
    p.add_argument("--kernels", action="store_true",
                   help="merge_n: also each kernel's device time per call (the split merge's two), from the "
                        "framework's profiler; one framework per process")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.kernels and len(args.frameworks) > 1:
        p.error("--kernels profiles one framework per process (torch's and JAX's profilers share CUPTI): "
                "pass --frameworks triton or --frameworks pallas")
    args.deadline = time.monotonic() + args.budget_s
    points.FUSED_REQUEST_LEN = args.request_len  # read by MergePoint.fused_case
    if args.tiles is None:
        args.tiles = [parse_tile(t) for t in (("committed",) if args.what == "merge_n" else
                                              ("8192,1,4", "8192,8,4", "16384,8,8", "4096,1,2"))]
    if not torch.cuda.is_available():
        print("tools.tune needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = {"merge": merge_sweep, "merge_n": merge_n_sweep, "mask": mask_sweep}[args.what](args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"what": args.what, "argv": sys.argv[1:], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
