"""Nsight Compute's view of one merge kernel on Mosaic GPU beside the Pallas Triton backend's, in one run: what
limits the Mosaic GPU merges where they trail (docs/results.md, "Missed targets and what limits them").

    python -m tools mosaic-profile [--op merge|merge_n] [--variant plain|lse|fused|fp8_g128|fp8_g64|nvfp4]
                                   [--tokens 32768] [--partials 4] [--lse-layout HT|TH] [--out DIR]
                                   [--tuning '{"ctas_per_sm": 1}']

For each backend it runs `ncu` (on the PATH; the device image has it) on a child process of this module that calls
the merge once to compile and once to be profiled (`--launch-skip 1 --launch-count 1`), keeping the kernel by its
name: Mosaic GPU names its kernels `body_mosaic_gpu_kernel`, the Triton backend after the op (`*merge*`); a filter
on "merge" alone profiles nothing on Mosaic GPU (2026-12-07). Sections: speed of light, memory workload, occupancy,
warp state (the stall reasons), scheduler, launch, source counters. It prints each report's headline lines and the
SASS instructions with the most warp stall samples (`top_stalls`: where the warps wait, which the sections alone
did not say on 2026-12-07); the reports are `DIR/ncu_BACKEND.txt` (and `.ncu-rep`, `_sass.csv`). The merge and its inputs are `python -m tools mosaic-speed`'s (`merge_call`: bf16, H = 64,
D = 128); no timing here: Nsight Compute's replays are its own. `--tuning` sets launch choices of the op's
Mosaic GPU kernel (`mc.TUNING[op]` keys, as `mosaic-speed` sweeps them) for the Mosaic GPU report.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

SECTIONS = ("SpeedOfLight", "MemoryWorkloadAnalysis", "Occupancy", "WarpStateStats", "SchedulerStats", "LaunchStats",
            "SourceCounters")  # SourceCounters: the warp stall samples per SASS instruction (`top_stalls`)
KERNELS = "regex:body_mosaic|merge"  # Mosaic GPU's kernel name, then the Triton backend's
HEADLINES = re.compile(r"Duration|DRAM Throughput|Registers Per Thread|Achieved Occupancy|Warp Cycles Per Issued|"
                       r"Issued Warp Per Scheduler|No Eligible|Active Warps Per Scheduler|Eligible Warps|Block Size|"
                       r"Grid Size|Dynamic Shared Memory Per Block|Stall")


def run_once(args) -> None:
    """The child: the merge called twice on `args.backend` (compile, then the profiled launch)."""
    import jax

    from pallas_impl.mosaic import _common as mc
    from tools import mosaic_speed

    mc.TUNING[args.op] = dict(mc.TUNING[args.op], **json.loads(args.tuning))
    n = args.partials if args.op == "merge_n" else 0
    call, _ = mosaic_speed.merge_call(args.tokens, n, args.variant, args.backend, args.lse_layout)
    jax.block_until_ready(call())
    jax.block_until_ready(call())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", choices=("merge", "merge_n"), default="merge")
    p.add_argument("--variant", choices=("plain", "lse", "fused", "fp8_g128", "fp8_g64", "nvfp4"), default="plain")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--partials", type=int, default=4, help="N of the N-way merge")
    p.add_argument("--lse-layout", choices=("HT", "TH"), default="HT")
    p.add_argument("--out", default=".", help="folder of the reports")
    p.add_argument("--tuning", default="{}", help="JSON: launch choices of the op's Mosaic GPU kernel (TUNING keys)")
    p.add_argument("--backend", choices=("triton", "mosaic_gpu"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.backend:  # the child under ncu
        run_once(args)
        return 0
    ncu = shutil.which("ncu")
    if ncu is None:
        print("mosaic_profile: needs Nsight Compute's `ncu` on the PATH", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    child = [sys.executable, "-m", "tools.mosaic_profile", "--op", args.op, "--variant", args.variant, "--tokens",
             str(args.tokens), "--partials", str(args.partials), "--lse-layout", args.lse_layout, "--tuning",
             args.tuning]
    failed = 0
    for backend in ("triton", "mosaic_gpu"):
        saved = out / f"ncu_{backend}.ncu-rep"
        cmd = [ncu, "-f", "-o", str(saved.with_suffix("")), "-k", KERNELS, "--launch-skip", "1", "--launch-count", "1"]
        cmd += [a for s in SECTIONS for a in ("--section", s)] + child + ["--backend", backend]
        done = subprocess.run(cmd, capture_output=True, text=True)
        details = subprocess.run([ncu, "-i", str(saved), "--page", "details"], capture_output=True, text=True)
        report = out / f"ncu_{backend}.txt"
        report.write_text(done.stdout + done.stderr + details.stdout + details.stderr)
        lines = [line.strip() for line in details.stdout.splitlines() if HEADLINES.search(line)]
        tuning = f", {args.tuning}" if backend == "mosaic_gpu" and args.tuning != "{}" else ""
        print(f"== {backend} ({args.op} {args.variant}, T = {args.tokens}, {args.lse_layout}{tuning}): "
              f"rc={done.returncode}")
        print("\n".join(lines) if lines else f"  no kernel profiled: see {report}")
        source = subprocess.run([ncu, "-i", str(saved), "--page", "source", "--print-source", "sass", "--csv"],
                                capture_output=True, text=True)
        (out / f"ncu_{backend}_sass.csv").write_text(source.stdout)
        print("\n".join(top_stalls(source.stdout)))
        failed |= done.returncode != 0 or not lines
    return 1 if failed else 0


def top_stalls(csv_text: str, count: int = 8) -> list[str]:
    """The SASS instructions with the most warp stall samples in Nsight Compute's source page (CSV), each with its
    share of the samples: where the warps wait. Empty (with a line saying so) where the page has no such column."""
    import csv
    import io

    rows = list(csv.reader(io.StringIO(csv_text)))
    header = next((i for i, row in enumerate(rows) if any("Sampling" in cell for cell in row)), None)
    if header is None:
        return ["  no warp stall samples in the source page"]
    names = rows[header]
    samples = next(i for i, name in enumerate(names) if "Sampling" in name and "Not" not in name)
    source = next((i for i, name in enumerate(names) if name.strip() == "Source"), 1)

    def number(row):
        try:
            return float(row[samples].replace(",", ""))
        except (IndexError, ValueError):
            return 0.0

    body = [row for row in rows[header + 1:] if len(row) == len(names)]
    total = sum(map(number, body)) or 1.0
    top = sorted(body, key=number, reverse=True)[:count]
    return [f"  top stalls ({names[samples]}):"] + [f"  {100 * number(r) / total:5.1f}%  {r[source].strip()}"
                                                   for r in top]


if __name__ == "__main__":
    sys.exit(main())
