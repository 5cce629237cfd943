"""Benchmarks: `python -m parity bench`. One GPU, one run, both frameworks.

Modules: `points` (the workload points and their byte formulas), `timers` (graph replay, do_bench, profiler,
wall clock, JAX trace counting), `runner` (what is measured, through `parity.harness.impls`), `report` (the tables
and the PNG, from the JSON only); this module holds the command line.

What is measured, in this order:

1. **Ceilings and floors** of the same run: two-read-one-write `torch.add(a, b, out=c)` and write-only
   `c.fill_(1)` on 2 GiB bf16 tensors (bytes = reads + writes), timed by CUDA-graph replay; an empty
   `@triton.jit` kernel (gpu_time, host, eager) and a jitted JAX identity on a tiny array (host, eager).
2. **JAX re-trace check** (`retrace` in the JSON): each jitted public `pallas_impl` function (mask, fused merge,
   fused N-way merge) on tiny inputs, then a batch of the same shapes with other offsets and
   `prefill_tokens_with_context`: the second must trace and compile nothing (counted by `jax.monitoring`).
3. **Mask** on the docs/spec.md 7 seed workloads (`parity.harness.cases`, tag "seed"), public API with `has_empty=True`,
   variants `lse` (LSE only, as upstream) and `lse+out` (the output rows are zeroed too).
   Bytes = masked tokens * H * 4 (+ masked tokens * H * D * out bytes for `lse+out`); compared with the
   write-only ceiling and with upstream's published H200 numbers (docs/spec.md 7, `UPSTREAM`).
4. **Merge** over T x H x D x dtype x variant (`merge_points`): `plain` (no output LSE), `lse` (output LSE),
   `fused` (fused mask, docs/spec.md 4.5, plus output LSE; 128-token requests, every even one empty in the
   prefix). Bytes = 2*T*H*D*in + T*H*D*out + 2*T*H*4 (+ T*H*4 with an output LSE); offsets are not counted.
   Compared with the two-read-one-write ceiling and upstream's 1.18 TB/s.
5. **N-way merge** (docs/spec.md 8) over N x T x variant at H = 64, D = 128, bf16 (`merge_points`): the same
   variants (`fused`: each partial's KV offsets, with partials empty for some requests), and `chain`: the same
   N-way merge done as N - 1 chained 2-way merges with output LSE (the alternative the N-way kernel replaces).
   Bytes = N*(T*H*D*in + T*H*4) + T*H*D*out (+ T*H*4 with an output LSE), for `chain` too (its useful bytes).
6. **Layouts** (`layout_points`, `--layouts`, `--head-dims`, `--views`): the LSE layout HT ([H, T]) or TH
   ([T, H]) and base (e or 2) of 2-way and N-way merges at D = 64, 128, 256, 512 (the MLA latent), T = 32K,
   H = 64, bf16; for the N-way merge (N = 4) also the partials as the `[T, N, H, D]` all-gather buffer read
   through a `[N, T, H, D]` view (`gather`, Triton only: JAX arrays have no strides); the mask in TH. Every
   record carries `lse_layout`, `lse_base`, `partials_view`.

Metrics per point and implementation (each record carries its `method`):

- `gpu_time`: Triton via `triton.testing.do_bench_cudagraph` (graph replay on a side stream; quantiles over its
  replays, each the mean of the calls in the graph). JAX via `jax.profiler` kernel time (CUPTI; the sum of
  the kernels of one call, quantiles over calls); if the trace holds no GPU kernels, back-to-back dispatches
  of the jitted call with one sync at the end, divided by N (labelled; an upper bound when the kernel is
  shorter than a dispatch). Never a jitted `fori_loop` chain (docs/spec.md 6: XLA copies the loop-carried buffers).
- `latency`: wall clock over N back-to-back calls of the public API with one sync at the end, divided by N;
  quantiles over trials. The JAX mask is the documented in-place form, `jax.jit(..., donate_argnums=0)`,
  chained (output fed back as input; the mask is idempotent).
- `eager`: what a step waits for per call, launch included. Triton: `triton.testing.do_bench` (CUDA events
  around each of many back-to-back calls), the method behind upstream's launch-inclusive figures, also for the
  mask's `torch.library` op (impl "triton-op", `torch.ops.mla_lse_merge.mask_empty_context_lse`; also its
  `latency`). JAX: the wall clock of a call and its sync (torch's CUDA events do not see JAX's stream).
- `host` (records at T = `HOST_T` = 16): the per-call host cost, wall clock over many back-to-back calls of
  the point's op, variant, shape and layout on 16 tokens, one sync at the end; beside the floors of the same
  run (the table's serving section: host, eager, GPU and floor ratios).

Inputs are rotated over enough copies that one pass exceeds 3x the L2 (`L2_BYTES`) for the merge; the mask's
working set is L2-resident on every seed workload (as in upstream's graph-replay numbers) and its records
say so in `note`. `--smoke` checks the plumbing with tiny shapes (interpreters on CPU): no claims.

Output: tables on stdout, progress on stderr, `--json FILE` (schema below, rewritten after every point so a
killed run keeps what it measured), `--plot FILE` (PNG drawn from the JSON only, `plot_from_json`).

JSON: {"schema": 2, "mode", "env": {...}, "reference": UPSTREAM, "formulas", "ceilings": {...}, "records": [{op,
impl, workload, T, H, D, dtype, variant, metric, unit, method, p20, p50, p80, bytes, tbps, frac_ceiling, n, note,
lse_layout, lse_base, partials_view, ...}], "retrace": [{op, impl, first_batch, new_batch, ok, ...}],
"skipped": [...], "errors": [...]}.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU (docs/spec.md 6)

from parity.tools.bench.points import (CEILING_ELEMS, FORMULAS, HEAD_DIMS, HOST_T, L2_BYTES,  # noqa: E402
                                 LAYOUTS, MASK_VARIANTS, MEMORY_CAP_BYTES, MERGE_VARIANTS, N_WAY_VARIANTS, UPSTREAM,
                                 VIEWS, MergePoint, layout_points, mask_bytes, mask_cases, masked_tokens,
                                 merge_points, parse_layout, rotation)
from parity.tools.bench.report import format_table, plot_from_json, serving_rows  # noqa: E402
from parity.tools.bench.runner import SCHEMA, Runner, write_json  # noqa: E402
from parity.tools.bench.timers import (QUANTILES, TraceCounter, log, per_call_us, time_cudagraph,  # noqa: E402
                                 time_do_bench, time_jax_profiler)

__all__ = ["CEILING_ELEMS", "FORMULAS", "HEAD_DIMS", "HOST_T", "L2_BYTES", "LAYOUTS", "MASK_VARIANTS",
           "MEMORY_CAP_BYTES", "MERGE_VARIANTS", "N_WAY_VARIANTS", "QUANTILES", "SCHEMA", "UPSTREAM", "VIEWS",
           "MergePoint", "Runner", "TraceCounter", "add_bench_arguments", "format_table", "layout_points",
           "main", "mask_bytes", "mask_cases", "masked_tokens", "merge_points", "parse_layout", "per_call_us",
           "plot_from_json", "rotation", "run_bench", "serving_rows", "time_cudagraph", "time_do_bench",
           "time_jax_profiler"]


def _layout_arg(s: str) -> str:
    try:
        parse_layout(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return s


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of `python -m parity bench` (added to the `bench` subparser by parity/cli.py)."""
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="subset: merge T in {2K, 32K, 131K}, H=64, D=128, bf16 (all variants); mask as full; "
                           "layouts HT/e and TH/2 at D=128 and 512 (2-way lse; N-way lse, contiguous and gather)")
    size.add_argument("--smoke", action="store_true",
                      help="tiny shapes, 1-2 reps, runs on CPU (interpreters): checks the plumbing, no claims")
    parser.add_argument("--json", metavar="FILE", default=None,
                        help="write the records to FILE (rewritten after every point)")
    parser.add_argument("--plot", metavar="FILE", default=None, help="draw a PNG from the JSON to FILE")
    parser.add_argument("--replot", metavar="JSON", default=None,
                        help="measure nothing: print the table of an existing JSON (and --plot it)")
    parser.add_argument("--impl", choices=("both", "triton", "pallas"), default="both")
    parser.add_argument("--only", choices=("mask", "merge", "layouts"), default=None,
                        help="one op only, or the layout section only (ceilings always run)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, metavar="T",
                        help="merge points with these T only")
    parser.add_argument("--layouts", type=_layout_arg, nargs="+", default=None, metavar="L",
                        help=f"layout section: LSE layout/base of {', '.join(LAYOUTS)} (default per mode)")
    parser.add_argument("--head-dims", type=int, nargs="+", default=None, metavar="D",
                        help=f"layout section: head sizes (full: {' '.join(map(str, HEAD_DIMS))})")
    parser.add_argument("--views", choices=VIEWS, nargs="+", default=None,
                        help="layout section: N-way partials contiguous [N, T, H, D] and/or the [T, N, H, D] "
                             "all-gather view (Triton only)")
    parser.add_argument("-k", dest="name_filter", metavar="SUBSTR", default=None,
                        help="only points whose label contains SUBSTR (e.g. 'merge T=32768', 'bfloat16 fused', "
                             "'TH/2', 'gather')")
    parser.add_argument("--budget-s", type=float, default=None, metavar="S",
                        help="stop starting new points after S seconds (the JSON and plot are still written)")
    parser.add_argument("--jax-timer", choices=("profiler", "dispatch"), default="profiler",
                        help="JAX gpu_time: profiler kernel time (default) or the labelled dispatch loop")
    parser.add_argument("--no-retrace", action="store_true", help="skip the JAX re-trace check")
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def run_bench(args) -> int:
    """Run the benchmark described by parsed `args`; returns the exit status (0 ok, 1 errors, 2 usage)."""
    argv = getattr(args, "argv", None)
    replot = getattr(args, "replot", None)
    if replot:
        import json

        with open(replot) as f:
            doc = json.load(f)
        print(format_table(doc))
        if getattr(args, "plot", None):
            plot_from_json(replot, args.plot)
        return 0
    mode = "smoke" if getattr(args, "smoke", False) else "quick" if getattr(args, "quick", False) else "full"
    try:
        import torch
    except ImportError as e:
        log(f"error: bench needs torch: {e}")
        return 2
    has_cuda = torch.cuda.is_available()
    if mode != "smoke" and not has_cuda:
        log("error: `bench` measures on a CUDA GPU and none is visible; use --smoke to check the plumbing")
        return 2
    from parity.harness import impls, provenance

    impls.configure()
    device = "cuda" if has_cuda else "cpu"
    runner = Runner(args, mode, device)
    runner.doc["env"] = dict(provenance.collect_env(argv), l2_bytes_assumed=L2_BYTES)
    runner.save()
    try:
        runner.run()
    finally:
        runner.save()
    doc = runner.doc
    print(format_table(doc), flush=True)
    if getattr(args, "plot", None):
        path = getattr(args, "json", None)
        tmp = None
        if not path:
            fd, tmp = tempfile.mkstemp(suffix=".json")
            os.close(fd)
            write_json(doc, tmp)
            path = tmp
        try:
            plot_from_json(path, args.plot)
            runner.progress(f"plot written to {args.plot}")
        finally:
            if tmp:
                os.unlink(tmp)
    return 1 if doc["errors"] else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m parity.tools.bench ...` (same options as `python -m parity bench`)."""
    parser = argparse.ArgumentParser(prog="python -m parity.tools.bench", description=__doc__.splitlines()[0])
    add_bench_arguments(parser)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = ["bench", *argv]  # recorded as the equivalent `python -m parity bench ...`
    return run_bench(args)
