"""`python -m parity loop`: the chunked-context prefill of a batch as one captured serving step, in both frameworks.

For C context chunks (planned from the workspace as upstream plans them), the step gathers each chunk into the
workspace, attends it with a real attention kernel, attends the new tokens causally, and combines the C + 1
partials either **chained** (one in-place 2-way merge per chunk into the running partial, then the new tokens:
upstream's loop) or **fused** (one N-way merge over the stacked partials with every partial's KV offsets). Both
are compared with monolithic float64 attention (`reference_prefill`): corrupted rows and max error, per batch.

The step has a fixed capacity (`capacity.Capacity`: tokens, requests, chunks) and reads its batch from device
buffers only. torch: eager, then captured as one CUDA graph and replayed for every batch after writing its inputs,
bits compared with the eager step (GPU; a CPU has no CUDA graphs). JAX: one jitted function per method, whose
traces and compiles are counted across the batches (one compile, no re-trace), bits compared between two calls.
On the GPU (`measure`) the merges' and the step's GPU time and the host time per step (`measure.py`).

Modules: `capacity` (sizes, batches at a capacity), `torch_step`, `jax_step`, `measure`. docs/design.md,
"Chunked-context loop", says when to use which combine.
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np

from parity.tools.chunked_prefill.reference import PrefillBatch, reference_prefill, rounded
from parity.tools.loop.capacity import CAPACITIES, Capacity, loop_batches, step_inputs

FRAMEWORKS = ("torch", "jax")
METHODS = ("chained", "fused")
CHUNKS = (1, 2, 4, 8)
TOLERANCE = 1e-3  # fp32 partials: the chain's roundings are ~1e-6 of values of a few units
TOLERANCE_BF16 = 5e-2  # bf16 partials: each rounding (partials, every merge's output) is up to 2^-9 of a value



def _judge(got: np.ndarray, batch: PrefillBatch, want: np.ndarray, tolerance: float) -> dict:
    from parity.tools.demo import compare_rows

    r = compare_rows(got, want, batch.query_start_loc, tolerance=tolerance)
    plan = batch.plan()
    return dict(tokens=batch.num_tokens, requests=batch.num_requests, chunks=plan.num_chunks, budget=plan.budget,
                rows_corrupted=r["rows_corrupted"], rows_total=r["rows_total"], max_abs_err=r["max_abs_err"],
                any_nan=r["any_nan"])


def _summary(row: dict) -> dict:
    b = row["batches"]
    row["rows_corrupted"] = sum(x["rows_corrupted"] for x in b)
    row["rows_total"] = sum(x["rows_total"] for x in b)
    row["max_abs_err"] = max(x["max_abs_err"] for x in b)
    return row


def run_torch(cap: Capacity, batches, wants, *, device: str, on_gpu: bool, tolerance: float, measure: bool) -> list:
    """One row per method: eager per batch vs float64; on a GPU, the graph replayed per batch vs the eager bits."""
    import torch

    from parity.tools.loop import torch_step

    dtype = "bfloat16" if on_gpu else "float32"
    loop = torch_step.TorchLoop(cap, device=device, kernel="flash" if on_gpu else "dense", dtype=dtype)
    inputs = [step_inputs(cap, b) for b in batches]
    rows = []
    for method in METHODS:
        row = dict(framework="torch", num_chunks=cap.num_chunks, method=method, device=device,
                   kernel="FlashAttention-2 varlen" if on_gpu else "dense masked (torch)", dtype=dtype, batches=[])
        eager = []
        with np.errstate(all="ignore"):
            for b, x, want in zip(batches, inputs, wants):
                loop.write(x)
                out = loop.step(method)[:b.num_tokens]
                loop.sync()
                eager.append(out.contiguous().view(torch.uint8).cpu().numpy().copy())
                row["batches"].append(_judge(out.float().cpu().numpy(), b, want, tolerance))
        row["replay_bits_equal"] = None
        if on_gpu:
            loop.capture(method)
            same = []
            for b, x, bits in zip(batches, inputs, eager):
                loop.write(x)
                out = loop.replay(method)[:b.num_tokens]
                loop.sync()
                same.append(bool(np.array_equal(out.contiguous().view(torch.uint8).cpu().numpy(), bits)))
            row["replay_bits_equal"] = all(same)
            if measure:
                from parity.tools.loop import measure as measure_mod

                loop.write(inputs[0])
                row.update(measure_mod.measure_torch(loop, method))
        rows.append(_summary(row))
    return rows


def run_jax(cap: Capacity, batches, wants, *, on_gpu: bool, tolerance: float, measure: bool, merge_impl: str) -> list:
    """One row per method: the jitted step per batch vs float64, its traces and compiles, bits of two calls."""
    import jax

    from parity.harness import impls
    from parity.tools.bench.timers import TraceCounter
    from parity.tools.loop import jax_step

    attention, dtype = ("cudnn", "bfloat16") if on_gpu else ("xla", "float32")
    v_cols = cap.qk_dim  # jax.nn.dot_product_attention takes one head size: V zero-padded, the output sliced back
    inputs = [jax_step.inputs_jax(step_inputs(cap, b), dtype=dtype, v_cols=v_cols) for b in batches]
    jax.block_until_ready(inputs)
    rows = []
    for method in METHODS:
        step = jax_step.make_step(cap, method=method, attention=attention, merge_impl=merge_impl,
                                  backend=impls.pallas_backend())
        row = dict(framework="jax", num_chunks=cap.num_chunks, method=method, device=str(jax.devices()[0]),
                   kernel=f"jax.nn.dot_product_attention ({attention}), merges {merge_impl}", dtype=dtype, batches=[])
        counts, outs = [], []
        with np.errstate(all="ignore"):
            for x in inputs:
                with TraceCounter() as tc:
                    outs.append(jax.block_until_ready(step(x)))
                counts.append((tc.traces, tc.compiles))
            again = jax.block_until_ready(step(inputs[0]))
        for b, out, want in zip(batches, outs, wants):
            got = np.asarray(out)[:b.num_tokens]  # sliced on the host: no eager JAX op per batch length
            row["batches"].append(_judge(got.astype(np.float32), b, want, tolerance))
        row["first_call_traces"], row["first_call_compiles"] = counts[0]
        row["later_traces"] = sum(t for t, _ in counts[1:])
        row["later_compiles"] = sum(c for _, c in counts[1:])
        # The batch's rows only: rows past its tokens are capacity padding that no one reads, and the attention
        # kernel leaves them undefined (cuDNN does not write them).
        rows0 = batches[0].num_tokens
        row["repeat_bits_equal"] = np.asarray(again)[:rows0].tobytes() == np.asarray(outs[0])[:rows0].tobytes()
        if on_gpu and measure:
            from parity.tools.loop import measure as measure_mod

            x = inputs[0]
            parts = (*jax_step.make_partials(cap, attention=attention)(x), x["query_start_loc"], x["cu_seq_lens"],
                     x["context_cu"])
            merges = jax_step.merges_only(method, merge_impl, impls.pallas_backend())
            row.update(measure_mod.measure_jax(step, inputs[0], merges, parts))
        rows.append(_summary(row))
    return rows


def row_ok(row: dict) -> bool:
    if row["rows_corrupted"] or any(b["any_nan"] for b in row["batches"]):
        return False
    if row["framework"] == "torch":
        return row["replay_bits_equal"] is not False
    return row["later_traces"] == 0 and row["later_compiles"] == 0 and row["repeat_bits_equal"]


def run_loop(*, framework: str = "both", chunks=CHUNKS, size: str | None = None, num_batches: int = 3, seed: int = 0,
             measure: bool = True, merge_impl: str = "pallas", device: str | None = None) -> tuple[dict, bool]:
    """Runs the step for every framework and chunk count on `num_batches` batches of different lengths.

    Args:
        framework: "both", "torch" (Triton merges) or "jax" (pallas_impl merges).
        chunks: the chunk counts C (the capacity's); each C gets its own batches, the first using all C chunks.
        size: a key of `capacity.CAPACITIES` ("ci": tiny, for the CPU interpreters; "gpu"); None: "gpu" on a GPU.
        measure: on a GPU, also time the merges, the step and its host cost (`measure.py`).
        merge_impl: pallas_impl's implementation for the JAX merges ("pallas" or "jnp").

    Returns:
        (report, ok): report {"capacity", "rows", "ok"}; a row per (framework, C, method) with per-batch corrupted
        rows and max error against float64, and torch's `replay_bits_equal` (None on a CPU) or JAX's trace and
        compile counts and `repeat_bits_equal`. ok: every row clean, replays and repeats bit-equal, no re-trace.
    """
    if framework not in ("both", *FRAMEWORKS):
        raise ValueError(f"framework must be 'both', 'torch' or 'jax', got {framework!r}")
    from parity.harness import impls

    rt = impls.make_runtime()
    size = size or ("gpu" if rt.on_gpu else "ci")
    if size not in CAPACITIES:
        raise ValueError(f"size must be one of {list(CAPACITIES)}, got {size!r}")
    chunks = tuple(int(c) for c in chunks)
    if not chunks or min(chunks) < 1 or max(chunks) > 255:
        raise ValueError(f"chunks must be between 1 and 255 (C + 1 partials per merge; the N-way merge is tested to "
                         f"256), got {chunks}")
    frameworks = FRAMEWORKS if framework == "both" else (framework,)
    dtype = "bfloat16" if rt.on_gpu else "float32"
    tolerance = TOLERANCE_BF16 if rt.on_gpu else TOLERANCE
    rows = []
    for c in chunks:
        cap = CAPACITIES[size].with_chunks(c)
        batches = [rounded(b, dtype) for b in loop_batches(cap, num_batches, seed)]
        wants = [reference_prefill(b) for b in batches]
        for fw in frameworks:
            if fw == "torch":
                rows += run_torch(cap, batches, wants, device=device or rt.device, on_gpu=rt.on_gpu,
                                  tolerance=tolerance, measure=measure)
            else:
                rows += run_jax(cap, batches, wants, on_gpu=rt.on_gpu, tolerance=tolerance, measure=measure,
                                merge_impl=merge_impl)
    for r in rows:
        r["ok"] = row_ok(r)
    ok = all(r["ok"] for r in rows)
    return dict(capacity=dataclasses.asdict(CAPACITIES[size]), size=size, tolerance=tolerance, rows=rows, ok=ok), ok


def format_loop_table(report: dict) -> str:
    """The correctness table, then (when measured) the timing table with the byte ratio beside the measured one."""
    from parity.tools.loop.measure import byte_ratio

    cap = report["capacity"]
    lines = [f"chunked-context step at capacity T={cap['num_tokens']} R={cap['num_requests']} H={cap['num_heads']} "
             f"Dqk={cap['qk_dim']} Dv={cap['v_dim']} workspace={cap['workspace_rows']}; tolerance "
             f"{report['tolerance']:g} (abs, vs float64 monolithic attention)"]
    header = ("framework", "C", "method", "batches (T)", "corrupted rows", "max abs err", "replay / re-trace", "result")
    body = []
    for r in report["rows"]:
        if r["framework"] == "torch":
            again = {None: "no graph (CPU)", True: "replay = eager bits",
                     False: "REPLAY DIFFERS"}[r["replay_bits_equal"]]
        else:
            again = (f"{r['first_call_compiles']} compile, {r['later_traces']} re-traces, "
                     + ("repeat = bits" if r["repeat_bits_equal"] else "REPEAT DIFFERS"))
        tokens = ",".join(str(b["tokens"]) for b in r["batches"])
        body.append((r["framework"], str(r["num_chunks"]), r["method"], tokens,
                     f"{r['rows_corrupted']}/{r['rows_total']}", f"{r['max_abs_err']:.2e}", again,
                     "ok" if r["ok"] else "FAIL"))
    lines += _table(header, body)
    timed = [r for r in report["rows"] if "step_gpu_us" in r]
    if timed:
        lines.append("")
        header = ("framework", "C", "method", "merges GPU us", "chained/fused", "bytes 3C/(C+2)", "of bytes",
                  "step GPU us", "host us eager", "host us replay")
        by = {(r["framework"], r["num_chunks"], r["method"]): r for r in timed}
        body = []
        for r in timed:
            other = by.get((r["framework"], r["num_chunks"], "chained"))
            ratio = share = bytes_ = ""
            if r["method"] == "fused" and other:
                measured, bytes_ = other["merges_gpu_us"] / r["merges_gpu_us"], byte_ratio(r["num_chunks"])
                ratio, share, bytes_ = f"{measured:.2f}", f"{measured / bytes_:.0%}", f"{bytes_:.2f}"
            eager = r.get("host_eager_us", r.get("host_dispatch_us"))
            replay = r.get("host_replay_us")
            body.append((r["framework"], str(r["num_chunks"]), r["method"], f"{r['merges_gpu_us']:.1f}", ratio,
                         bytes_, share, f"{r['step_gpu_us']:.1f}", f"{eager:.1f}",
                         "-" if replay is None else f"{replay:.1f}"))
        lines += _table(header, body)
        lines.append("host us: torch eager = issuing the step's launches, replay = one graph replay; JAX eager = one "
                     "jitted dispatch (the whole step), no replay column.")
    return "\n".join(lines)


def _table(header, body) -> list[str]:
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(b) for b in body]


def write_json(report: dict, path: str, argv=None) -> None:
    from parity.harness import provenance

    with open(path, "w") as f:
        json.dump(dict(report, env=provenance.collect_env(argv)), f, indent=1, default=float)


__all__ = ["CAPACITIES", "CHUNKS", "Capacity", "METHODS", "format_loop_table", "loop_batches", "run_jax", "run_loop",
           "run_torch", "step_inputs", "write_json"]
