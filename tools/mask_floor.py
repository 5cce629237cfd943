"""The mask against its fill floor on the docs/spec.md 7 seed workloads, with candidate grid splits. GPU only:

    python -m tools mask-floor --json mask_floor.json   # the committed constants and the default candidates
    python -m tools mask-floor --zero-split 1 2 4 8 16 32 64 --lse-split 2 4 --targets 4096 32768 --warps 4 \
        --budget-s 300

For each seed workload and variant ("lse": LSE-only; "lse+out": with output zeroing) it times the Triton mask
(CUDA-graph replay) and the Pallas mask (jax.profiler kernel time over back-to-back calls of the donated,
jitted form), both in place and idempotent, beside `fill_` and `zero_` of exactly the mask's bytes in one
contiguous buffer (`parity.tools.bench.mask_bytes`; CUDA-graph replay), and prints each time over the fill_ floor.
Candidates (docs/design.md, "Mask grid"): `--zero-split S` and `--lse-split S` fix the programs per 128-token
block of that variant (`MASK_*_SPLIT = S`, no program target); `--targets N` keeps the caps and grows the split
until the grid holds N programs (`MASK_TARGET_PROGRAMS`); `--lse-targets N` does so for the LSE-only mask alone
(a target of its own: split 4 on the small grid of 2k_balanced, 1 on the large ones); `--warps W` sets
`MASK_NUM_WARPS` of both frameworks (the committed ones differ: the warps column shows triton/pallas). Every
candidate is set for both frameworks at once, in `mla_lse_common.tiles` (`tiles.set_knobs`; each framework's
time is its own column: the best constants may differ), with Triton's launch plans off so that each launches its own
grid. The committed constants run first ("committed") and again last
("committed again": the drift of the run); "4cb29dd" is the earlier constants (LSE split 1, 8192 target programs).

Beside them, in the same process: the LSE-only mask of upstream's design, re-implemented from docs/spec.md 3
(`mask_upstream_design.py`: one program per 128-token block, no second grid axis), checked bit for bit against
`triton_impl` on each workload before it is timed. Triton and that comparator are timed twice: on one buffer
("warm": the repeated calls find the LSE in L2, as the committed figures were measured) and cycling through
enough copies of the inputs that one pass exceeds 3x L2 ("cold"). The closing table gives, per workload and
variant, each candidate's time beside `fill_` and the comparator, and the decision lines name the candidate
with the lowest geometric-mean time over the seed workloads per framework and variant. About 5 minutes on an
H200 with the defaults; `--budget-s` starts no new candidate after that many seconds ("committed again" runs
regardless).
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# Every candidate must launch its own grid: Triton's per-signature launch plans hold the grid of the constants
# they were made with, so they are off here (graph replay times the kernels alone: the host path is not timed).
os.environ["MLA_LSE_MERGE_PLAN_CACHE"] = "0"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import pallas_impl  # noqa: E402
import triton_impl  # noqa: E402
from mla_lse_common import tiles  # noqa: E402
from pallas_impl import mask as pmask  # noqa: E402
from parity.library import bridge
from parity.harness import cases
from parity.tools import bench  # noqa: E402
from triton_impl import _plans as tplans  # noqa: E402

from tools.mask_upstream_design import mask_upstream_design

SEEDS = {c.name: c for c in cases.select("seed")}
KNOBS = ("MASK_TARGET_PROGRAMS", "MASK_ZERO_SPLIT", "MASK_LSE_SPLIT", "MASK_NUM_WARPS")
COMMITTED = {k: getattr(tiles, k) for k in KNOBS}
UNCAPPED = 1 << 30  # a program target no grid reaches: the split is the variant's cap (or the tile count)
BEFORE = {"MASK_TARGET_PROGRAMS": 8192, "MASK_LSE_SPLIT": 1}  # the constants at 4cb29dd (README's mask figures)
UPSTREAM = "upstream design (re-implemented)"
COLD_BYTES = 3 * bench.L2_BYTES  # one pass over the cycled input copies writes more than this
MAX_COPIES = 512


def set_knobs(knobs: dict) -> None:
    want = {k: knobs.get(k, COMMITTED[k]) for k in KNOBS}
    tiles.set_knobs(**want)  # both frameworks' grids and warps
    tplans.PLANS.clear()  # the Triton wrappers' launch plans hold the grid
    pmask._PLANS.clear()  # the Pallas mask's plans hold its jitted call
    # The grid functions must read what was just set (they would not if the constants moved elsewhere).
    got = (tiles.mask_split_cap(False), tiles.mask_split_cap(True), tiles.mask_split(0, 1, 1024, 1, False))
    expect = (want["MASK_LSE_SPLIT"], want["MASK_ZERO_SPLIT"],
              min(64, want["MASK_LSE_SPLIT"], tiles.next_pow2(want["MASK_TARGET_PROGRAMS"])))
    if got != expect:
        raise SystemExit(f"mla_lse_common.tiles: the mask constants did not take ({got} != {expect}): "
                         "update set_knobs to where they live")
    if tplans.PLAN_CACHE:
        raise SystemExit("triton_impl's plan cache is on: candidates would reuse the committed grid")
    jax.clear_caches()  # the Pallas wrapper's jit cache holds traced grids and warps
    gc.collect()  # dropped executables go now, not during a CUDA-graph capture
    torch.cuda.synchronize()


def candidates(args) -> list[tuple[str, dict, tuple[str, ...]]]:
    """(label, knobs, variants it changes)."""
    out = [("committed", {}, ("lse", "lse+out")), ("4cb29dd", BEFORE, ("lse", "lse+out"))]
    out += [(f"zero_split={s}", {"MASK_TARGET_PROGRAMS": UNCAPPED, "MASK_ZERO_SPLIT": s}, ("lse+out",))
            for s in args.zero_split]
    out += [(f"lse_split={s}", {"MASK_TARGET_PROGRAMS": UNCAPPED, "MASK_LSE_SPLIT": s}, ("lse",))
            for s in args.lse_split]
    out += [(f"target={n}", {"MASK_TARGET_PROGRAMS": n, "MASK_ZERO_SPLIT": args.cap_zero,
                             "MASK_LSE_SPLIT": args.cap_lse}, ("lse", "lse+out")) for n in args.targets]
    out += [(f"lse_target={n}", {"MASK_TARGET_PROGRAMS": n, "MASK_LSE_SPLIT": args.cap_lse}, ("lse",))
            for n in args.lse_targets]
    out += [(f"warps={w}", {"MASK_NUM_WARPS": {"triton": w, "pallas": w}}, ("lse", "lse+out")) for w in args.warps]
    return out + [("committed again", {}, ("lse", "lse+out"))]


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
        self.cold = {}  # variant -> [(lse, out)] copies cycled by the "cold" timings, made on first use
        self.check_upstream()

    def copies(self, variant: str) -> list:
        """Copies of the inputs, enough that one pass over them writes more than 3x L2 (the masked bytes)."""
        if variant not in self.cold:
            n = max(1, min(MAX_COPIES, -(-int(COLD_BYTES) // bench.mask_bytes(self.case, variant))))
            out = self.out if variant == "lse+out" else None
            self.cold[variant] = [(self.lse.clone(), None if out is None else out.clone()) for _ in range(n)]
        return self.cold[variant]

    def check_upstream(self) -> None:
        """The comparator must write what `triton_impl` writes, bit for bit, before it is timed."""
        want, got = self.lse.clone(), self.lse.clone()
        triton_impl.mask_empty_context_lse(want, self.qsl, self.cu)
        mask_upstream_design(got, self.qsl, self.cu)
        if not torch.equal(want.view(torch.int32), got.view(torch.int32)):
            raise SystemExit(f"{UPSTREAM} differs from triton_impl on {self.case.name}")

    def upstream_us(self, warps: int, cold: bool) -> float:
        if not cold:
            return graph_us(functools.partial(mask_upstream_design, self.lse, self.qsl, self.cu, warps))
        sets, i = self.copies("lse"), [0]

        def call():
            mask_upstream_design(sets[i[0] % len(sets)][0], self.qsl, self.cu, warps)
            i[0] += 1

        return graph_us(call)

    def reset_jax(self) -> None:
        """Fresh JAX copies of the inputs (the donated ones are consumed)."""
        self.jlse = jnp.copy(bridge.torch_to_jax(self.lse))
        self.jout = jnp.copy(bridge.torch_to_jax(self.out))

    def grid(self, variant: str) -> tuple[int, int]:
        c = self.case
        zero = variant == "lse+out"
        return tiles.mask_grid(c.num_tokens, c.num_requests, c.num_heads, c.head_dim if zero else 1, zero)

    def triton_us(self, variant: str, cold: bool = False) -> float:
        if not cold:
            out = self.out if variant == "lse+out" else None
            return graph_us(functools.partial(triton_impl.mask_empty_context_lse, self.lse, self.qsl, self.cu, out,
                                              has_empty=True))
        sets, i = self.copies(variant), [0]

        def call():  # each call of the captured graph masks the next copy
            lse, out = sets[i[0] % len(sets)]
            triton_impl.mask_empty_context_lse(lse, self.qsl, self.cu, out, has_empty=True)
            i[0] += 1

        return graph_us(call)

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


COLUMNS = {"triton": ("triton_us", "triton_cold_us"), "pallas": ("pallas_us",)}
UPSTREAM_COLUMNS = ("upstream_us", "upstream_cold_us")


def timed(row: dict, key: str, fn, fill_us: float) -> None:
    """row[key] = fn() in us (and its ratio to the fill_ floor), or row[key minus _us + _error]."""
    try:
        us = fn()
    except Exception as e:  # noqa: BLE001 - one failed candidate must not end the sweep
        row[key[:-3] + "_error"] = f"{type(e).__name__}: {e}"[:200]
        return
    row[key] = round(us, 2)
    row[key[:-3] + "_x_fill"] = round(us / fill_us, 3)


def geomean(xs) -> float:
    xs = list(xs)
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def report(rows: list[dict], workloads: list[str]) -> None:
    """The closing tables: per workload and variant every candidate beside fill_ and the comparator, then the
    decision lines (the lowest geometric mean over the workloads, per framework, timing and variant)."""
    keys = [k for ks in COLUMNS.values() for k in ks]
    for name in workloads:
        for variant in ("lse", "lse+out"):
            got = [r for r in rows if r["workload"] == name and r["variant"] == variant]
            if not got:
                continue
            print(f"\n## {name} {variant}: fill_ {got[0]['floor_fill__us']:.2f} us, zero_ "
                  f"{got[0]['floor_zero__us']:.2f} us (us, and x fill_)")
            print(f"{'candidate':34s} {'grid':12s} {'warps':>5s} " + " ".join(f"{k[:-3]:>16s}" for k in keys)
                  + " " + " ".join(f"{k[:-3]:>16s}" for k in UPSTREAM_COLUMNS))
            for r in got:
                cells = [f"{r[k]:8.2f} ({r[k[:-3] + '_x_fill']:.2f}x)" if k in r else f"{'-':>16s}"
                         for k in keys + list(UPSTREAM_COLUMNS)]
                warps = r["warps"] if isinstance(r["warps"], int) else "{triton}/{pallas}".format(**r["warps"])
                print(f"{r['candidate']:34s} {str(r['grid']):12s} {warps:>5} " + " ".join(cells))
    print("\n# decision: per framework, timing and variant, the candidate with the lowest geometric mean over "
          f"{', '.join(workloads)} (ratio to committed)")
    for variant in ("lse", "lse+out"):
        for key in keys:
            by = {}
            for r in rows:
                if r["variant"] == variant and key in r and r["candidate"] != UPSTREAM:
                    by.setdefault(r["candidate"], {})[r["workload"]] = r[key]
            full = {c: geomean(v.values()) for c, v in by.items() if len(v) == len(workloads)}
            if "committed" not in full:
                continue
            best = min((c for c in full if c != "committed again"), key=full.get)
            print(f"{variant:8s} {key[:-3]:12s} best {best:20s} {full[best]:8.2f} us, committed {full['committed']:8.2f} us "
                  f"({full[best] / full['committed']:.3f}); committed again {full.get('committed again', float('nan')):.2f}")
    print("\n# Triton LSE-only mask (committed constants) against " + UPSTREAM + ", same timing, best warps of each")
    for name in workloads:
        ours = next((r for r in rows if r["workload"] == name and r["variant"] == "lse"
                     and r["candidate"] == "committed"), None)
        theirs = [r for r in rows if r["workload"] == name and r["candidate"] == UPSTREAM]
        if ours is None or not theirs:
            continue
        cells = []
        for mine, up in zip(COLUMNS["triton"], UPSTREAM_COLUMNS):
            ups = [r[up] for r in theirs if up in r]
            if mine in ours and ups:
                cells.append(f"{up[9:-3] or 'warm'}: {ours[mine]:.2f} vs {min(ups):.2f} us ({ours[mine] / min(ups):.3f})")
        print(f"{name:13s} " + "; ".join(cells))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--zero-split", nargs="*", type=int, default=[8, 64], help="fixed splits, lse+out")
    p.add_argument("--lse-split", nargs="*", type=int, default=[1, 2, 4], help="fixed splits, LSE-only")
    p.add_argument("--targets", nargs="*", type=int, default=[8192, 32768], help="MASK_TARGET_PROGRAMS")
    p.add_argument("--lse-targets", nargs="*", type=int, default=[256, 1024],
                   help="MASK_TARGET_PROGRAMS for the LSE-only mask alone (split up to --cap-lse)")
    p.add_argument("--cap-zero", type=int, default=COMMITTED["MASK_ZERO_SPLIT"], help="zero cap with --targets")
    p.add_argument("--cap-lse", type=int, default=COMMITTED["MASK_LSE_SPLIT"], help="LSE cap with --targets")
    p.add_argument("--warps", nargs="*", type=int, default=[4], help="MASK_NUM_WARPS")
    p.add_argument("--upstream-warps", nargs="*", type=int, default=[4, 8], help="warps of the comparator")
    p.add_argument("--no-cold", action="store_true", help="time on one buffer only (no cycled copies)")
    p.add_argument("--impls", nargs="+", default=["triton", "pallas"], choices=("triton", "pallas"))
    p.add_argument("--workloads", nargs="+", default=list(SEEDS), choices=list(SEEDS))
    p.add_argument("--budget-s", type=float, default=300.0, help="start no new candidate after this many seconds")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("mask_floor.py needs a CUDA GPU", file=sys.stderr)
        return 2
    deadline = time.monotonic() + args.budget_s
    loads = {name: Workload(SEEDS[name]) for name in args.workloads}
    rows = []
    for name, w in loads.items():  # the comparator has no constants: once per workload and warp count
        fill = w.floors["lse"]["fill_"]
        for warps in args.upstream_warps:
            row = {"candidate": UPSTREAM, "workload": name, "variant": "lse",
                   "grid": [tiles.mask_blocks(w.case.num_tokens, w.case.num_requests)], "warps": warps,
                   **{f"floor_{k}_us": round(v, 2) for k, v in w.floors["lse"].items()}}
            for cold in (False,) if args.no_cold else (False, True):
                timed(row, UPSTREAM_COLUMNS[cold], functools.partial(w.upstream_us, warps, cold), fill)
            print(json.dumps(row), flush=True)
            rows.append(row)
    for label, knobs, variants in candidates(args):
        if time.monotonic() > deadline and label != "committed again":
            print(f"# budget spent: skipped {label}", flush=True)
            continue
        set_knobs(knobs)
        for name, w in loads.items():
            for variant in variants:
                fill = w.floors[variant]["fill_"]
                row = {"candidate": label, "workload": name, "variant": variant, "grid": list(w.grid(variant)),
                       "warps": dict(tiles.MASK_NUM_WARPS), **{f"floor_{k}_us": round(v, 2) for k, v in w.floors[variant].items()}}
                for impl in args.impls:
                    if impl == "pallas":
                        timed(row, "pallas_us", functools.partial(w.pallas_us, variant), fill)
                        if "pallas_error" in row:
                            w.reset_jax()
                        continue
                    for cold in (False,) if args.no_cold else (False, True):
                        timed(row, COLUMNS["triton"][cold], functools.partial(w.triton_us, variant, cold), fill)
                print(json.dumps(row), flush=True)
                rows.append(row)
    set_knobs({})
    report(rows, list(loads))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"committed": COMMITTED, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
