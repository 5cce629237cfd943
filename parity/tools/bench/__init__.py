"""Benchmarks: `python -m parity bench`. One GPU, one run, both frameworks.

Modules: `points` (the workload points and their byte formulas), `timers` (graph replay, do_bench, profiler,
wall clock, JAX trace counting), `runner` (what is measured, through `parity.harness.impls`), `report` (the tables
and the PNG, from the JSON only), `schedule` (the order of a run); this module holds `measure`, the run. The options, the output and the exit
status are parity/cli.py's.

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

- `gpu_time`: Triton by CUDA-graph replay (`timers.time_cudagraph`: thread-local capture on a side stream;
  quantiles over its replays, each the mean of the calls in the graph). JAX via `jax.profiler` kernel time (CUPTI; the sum of
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

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU (docs/spec.md 6)

from parity.tools.bench.points import (CEILING_ELEMS, FORMULAS, HEAD_DIMS, HOST_T, L2_BYTES,  # noqa: E402
                                 LAYOUTS, MASK_VARIANTS, MEMORY_CAP_BYTES, MERGE_VARIANTS, N_WAY_VARIANTS, UPSTREAM,
                                 VIEWS, MergePoint, layout_points, mask_bytes, mask_cases, masked_tokens,
                                 merge_points, parse_layout, rotation)
from parity.tools.bench.report import format_table, plot_from_json, serving_rows  # noqa: E402
from parity.tools.bench.records import SCHEMA, write_json  # noqa: E402
from parity.tools.bench import schedule  # noqa: E402
from parity.tools.bench.runner import Runner  # noqa: E402
from parity.tools.bench.timers import (QUANTILES, TraceCounter, log, per_call_us, time_cudagraph,  # noqa: E402
                                 time_do_bench, time_jax_profiler)

__all__ = ["CEILING_ELEMS", "FORMULAS", "HEAD_DIMS", "HOST_T", "L2_BYTES", "LAYOUTS", "MASK_VARIANTS",
           "MEMORY_CAP_BYTES", "MERGE_VARIANTS", "N_WAY_VARIANTS", "QUANTILES", "SCHEMA", "UPSTREAM", "VIEWS",
           "MergePoint", "Runner", "TraceCounter", "format_table", "layout_points", "log", "mask_bytes",
           "mask_cases", "masked_tokens", "measure", "merge_points", "parse_layout", "per_call_us", "plot_from_json",
           "rotation", "serving_rows", "time_cudagraph", "time_do_bench", "time_jax_profiler", "write_json"]


def measure(options, mode: str, device: str, argv: list[str] | None = None) -> dict:
    """Run the benchmark of `mode` ("full", "quick" or "smoke") on `device` ("cuda", or "cpu" for smoke) with
    the parsed options of `python -m parity bench` (parity/cli.py); returns the JSON document, also written to
    `options.json` after every point. `argv` is recorded as the command (`parity.harness.provenance`)."""
    from parity.harness import impls, provenance

    impls.configure()
    runner = Runner(options, mode, device)
    runner.doc["env"] = dict(provenance.collect_env(argv), l2_bytes_assumed=L2_BYTES)
    runner.save()
    try:
        schedule.run(runner)
    finally:
        runner.save()
    return runner.doc
