"""The mask against its fill floor on the docs/spec.md 7 seed workloads, with candidate grid splits. GPU only:

    python scripts/mask_floor.py                       # the committed constants and the default candidates
    python scripts/mask_floor.py --zero-split 1 2 4 8 16 32 64 --lse-split 2 4 --targets 4096 32768 --warps 4 \
        --budget-s 300

For each seed workload and variant ("lse": LSE-only; "lse+out": with output zeroing) it times the Triton mask
(CUDA-graph replay) and the Pallas mask (jax.profiler kernel time over back-to-back calls of the donated,
jitted form), both in place and idempotent, beside `fill_` and `zero_` of exactly the mask's bytes in one
contiguous buffer (`parity.tools.bench.mask_bytes`; CUDA-graph replay), and prints each time over the fill_ floor.
Candidates (docs/design.md, "Mask grid"): `--zero-split S` and `--lse-split S` fix the programs per 128-token
block of that variant (`MASK_*_SPLIT = S`, no program target); `--targets N` keeps the caps and grows the split
until the grid holds N programs (`MASK_TARGET_PROGRAMS`); `--warps W` sets `MASK_NUM_WARPS`. Every candidate is
set for both frameworks at once, in `mla_lse_common.tiles` (`tiles.set_knobs`). The committed constants run first
("committed"). About 2 minutes on an H200 with the defaults; `--budget-s` starts no new candidate after that many
seconds.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import pallas_impl  # noqa: E402
import triton_impl  # noqa: E402
from mla_lse_common import tiles  # noqa: E402
from pallas_impl import _backend as pbackend  # noqa: E402
from parity.library import bridge
from parity.harness import cases
from parity.tools import bench  # noqa: E402
from triton_impl import _plans as tplans  # noqa: E402

SEEDS = {c.name: c for c in cases.select("seed")}
KNOBS = ("MASK_TARGET_PROGRAMS", "MASK_ZERO_SPLIT", "MASK_LSE_SPLIT", "MASK_NUM_WARPS")
COMMITTED = {k: getattr(tiles, k) for k in KNOBS}
UNCAPPED = 1 << 30  # a program target no grid reaches: the split is the variant's cap (or the tile count)


def set_knobs(knobs: dict) -> None:
    tiles.set_knobs(**{k: knobs.get(k, COMMITTED[k]) for k in KNOBS})  # both frameworks' grids and warps
    tplans.PLANS.clear()  # the Triton wrappers' launch plans hold the grid
    jax.clear_caches()  # the Pallas wrapper's jit cache holds traced grids and warps
    gc.collect()  # dropped executables go now, not during a CUDA-graph capture
    torch.cuda.synchronize()


def candidates(args) -> list[tuple[str, dict, tuple[str, ...]]]:
    """(label, knobs, variants it changes)."""
    out = [("committed", {}, ("lse", "lse+out"))]
    out += [(f"zero_split={s}", {"MASK_TARGET_PROGRAMS": UNCAPPED, "MASK_ZERO_SPLIT": s}, ("lse+out",))
            for s in args.zero_split]
    out += [(f"lse_split={s}", {"MASK_TARGET_PROGRAMS": UNCAPPED, "MASK_LSE_SPLIT": s}, ("lse",))
            for s in args.lse_split]
    out += [(f"target={n}", {"MASK_TARGET_PROGRAMS": n, "MASK_ZERO_SPLIT": args.cap_zero,
                             "MASK_LSE_SPLIT": args.cap_lse}, ("lse", "lse+out")) for n in args.targets]
    out += [(f"warps={w}", {"MASK_NUM_WARPS": w}, ("lse", "lse+out")) for w in args.warps]
    return out


def graph_us(fn) -> float:
    fn()  # compile outside the graph capture
    torch.cuda.synchronize()
    return bench.time_cudagraph(fn, 20)[0][1]


def profiler_us(call, sync, n: int = 20) -> float:
    call()  # compile outside the profiler
    sync()
    got = bench.time_jax_profiler(call, sync, n)
    return got[0][1] if got else float("nan")


class Workload:
    def __init__(self, case: cases.Case):
        self.case = case
        T, H, D = case.num_tokens, case.num_heads, case.head_dim
        qsl_np, cu_np = cases.offsets(case)
        g = torch.Generator(device="cuda").manual_seed(0)
        self.lse = torch.randn(H, T, generator=g, device="cuda").mul_(3.0).add_(4.0)
        self.out = torch.randn(T, H, D, generator=g, device="cuda", dtype=getattr(torch, case.dtype))
        self.qsl, self.cu = torch.from_numpy(qsl_np).cuda(), torch.from_numpy(cu_np).cuda()
        self.jq, self.jc = jax.device_put(qsl_np), jax.device_put(cu_np)
        self.reset_jax()
        self.floors = {}
        for variant in ("lse", "lse+out"):
            nbytes = bench.mask_bytes(case, variant)
            buf = torch.empty(max(1, nbytes // 4), device="cuda")
            self.floors[variant] = {"fill_": graph_us(lambda: buf.fill_(1.0)), "zero_": graph_us(buf.zero_)}
            del buf

    def reset_jax(self) -> None:
        """Fresh JAX copies of the inputs (the donated ones are consumed)."""
        self.jlse = jnp.copy(bridge.torch_to_jax(self.lse))
        self.jout = jnp.copy(bridge.torch_to_jax(self.out))

    def grid(self, variant: str) -> tuple[int, int]:
        c = self.case
        zero = variant == "lse+out"
        return tiles.mask_grid(c.num_tokens, c.num_requests, c.num_heads, c.head_dim if zero else 1, zero)

    def triton_us(self, variant: str) -> float:
        out = self.out if variant == "lse+out" else None
        return graph_us(functools.partial(triton_impl.mask_empty_context_lse, self.lse, self.qsl, self.cu, out,
                                          has_empty=True))

    def pallas_us(self, variant: str) -> float:
        zero = variant == "lse+out"
        fn = functools.partial(pallas_impl.mask_empty_context_lse, has_empty=True, implementation="pallas")
        step = jax.jit(fn, donate_argnames=("lse", "output") if zero else ("lse",))
        state = [self.jlse, self.jout] if zero else [self.jlse]

        def call():
            got = step(state[0], self.jq, self.jc, state[1]) if zero else step(state[0], self.jq, self.jc)
            state[:] = list(got) if zero else [got]

        us = profiler_us(call, lambda: jax.block_until_ready(state))
        self.jlse = state[0]  # the donated inputs are gone: keep the results for the next candidate
        if zero:
            self.jout = state[1]
        return us


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--zero-split", nargs="*", type=int, default=[8, 64], help="fixed splits, lse+out")
    p.add_argument("--lse-split", nargs="*", type=int, default=[4], help="fixed splits, LSE-only")
    p.add_argument("--targets", nargs="*", type=int, default=[32768], help="MASK_TARGET_PROGRAMS")
    p.add_argument("--cap-zero", type=int, default=COMMITTED["MASK_ZERO_SPLIT"], help="zero cap with --targets")
    p.add_argument("--cap-lse", type=int, default=COMMITTED["MASK_LSE_SPLIT"], help="LSE cap with --targets")
    p.add_argument("--warps", nargs="*", type=int, default=[4], help="MASK_NUM_WARPS")
    p.add_argument("--impls", nargs="+", default=["triton", "pallas"], choices=("triton", "pallas"))
    p.add_argument("--workloads", nargs="+", default=list(SEEDS), choices=list(SEEDS))
    p.add_argument("--budget-s", type=float, default=100.0, help="start no new candidate after this many seconds")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("mask_floor.py needs a CUDA GPU", file=sys.stderr)
        return 2
    pbackend.filter_triton_deprecation()
    deadline = time.monotonic() + args.budget_s
    loads = {name: Workload(SEEDS[name]) for name in args.workloads}
    rows = []
    for label, knobs, variants in candidates(args):
        if time.monotonic() > deadline:
            print(f"# budget spent: skipped {label} and later candidates", flush=True)
            break
        set_knobs(knobs)
        for name, w in loads.items():
            for variant in variants:
                row = {"candidate": label, "workload": name, "variant": variant, "grid": list(w.grid(variant)),
                       "warps": tiles.MASK_NUM_WARPS, **{f"floor_{k}_us": round(v, 2) for k, v in w.floors[variant].items()}}
                for impl in args.impls:
                    try:
                        us = w.triton_us(variant) if impl == "triton" else w.pallas_us(variant)
                    except Exception as e:  # noqa: BLE001 - one failed candidate must not end the sweep
                        row[f"{impl}_error"] = f"{type(e).__name__}: {e}"[:200]
                        w.reset_jax()
                        continue
                    row[f"{impl}_us"] = round(us, 2)
                    row[f"{impl}_x_fill"] = round(us / w.floors[variant]["fill_"], 3)
                print(json.dumps(row), flush=True)
                rows.append(row)
    set_knobs({})
    print("\n# best candidate per workload, variant and framework (time / fill_ floor); targets: lse+out <= 1.2x,"
          " lse at 131k_skewed <= 1.25x")
    for name in loads:
        for variant in ("lse", "lse+out"):
            for impl in args.impls:
                got = [r for r in rows if r["workload"] == name and r["variant"] == variant and f"{impl}_us" in r]
                if not got:
                    continue
                best = min(got, key=lambda r: r[f"{impl}_us"])
                ref = next((r for r in got if r["candidate"] == "committed"), best)
                print(f"{name:13s} {variant:8s} {impl:7s} committed {ref[f'{impl}_us']:8.2f} us "
                      f"({ref[f'{impl}_x_fill']:.2f}x)  best {best['candidate']:18s} grid {best['grid']} "
                      f"{best[f'{impl}_us']:8.2f} us ({best[f'{impl}_x_fill']:.2f}x)  fill_ "
                      f"{best['floor_fill__us']:.2f} zero_ {best['floor_zero__us']:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"committed": COMMITTED, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
