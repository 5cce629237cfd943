"""The parity check (`python -m parity check`): run every implementation on a suite of `parity.harness.cases` and
compare them.

For every case the numpy inputs (`cases.make_inputs` / `make_inputs_n`) are uploaded once to torch and
shared with JAX over DLPack (`parity.library.bridge.share_inputs`, zero-copy). Every implementation runs through
`parity.harness.impls` (reference, triton, pallas, jnp, torch). The operations (`impls.OPS`):

- 2-way cases: `mask` (the prefix LSE, zeroing the prefix output; docs/spec.md 3); `merge` (each
  implementation merges its own masked prefix with the suffix: mask then merge, 4); `merge_fused` (the raw
  prefix with the fused mask, 4.5), for cases with an empty request;
- N-way cases (8): `merge_n` (the partials with the reference-masked LSEs: their NaN garbage stays, under
  -inf) and `merge_n_fused` (the raw partials with each partial's KV offsets). At N = 2 both must also give
  the bits of the 2-way kernels on the same partials.

Each result is compared, through `parity.library.crosscheck.compare_results`, bit for bit between implementations
(Triton vs Pallas, Pallas vs jnp, Triton vs its torch path) and with the float64 reference: exactly where the result is a bit copy
(`parity.harness.expected.exact_masks`), within tolerance elsewhere, measured against
`parity.harness.expected.magnitude`. Which comparisons are required depends on the mode (docs/spec.md 5):
`RULES`; the records, the table and the JSON report are `parity.harness.check_report`'s.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from parity.harness import cases as cases_mod
from parity.harness import expected, impls
from parity.harness.check_report import (KINDS, N2_KINDS, NVFP4_KINDS, PAIRS, RULES, SCHEMA, OpRecord, build_report,
                                         dtype_label, format_table)

__all__ = ["KINDS", "N2_KINDS", "NVFP4_KINDS", "PAIRS", "RULES", "SCHEMA", "OpRecord", "build_report", "count_ops", "dtype_label",
           "format_table", "run_case", "run_check", "select"]


# ---------------------------------------------------------------------------------------------------------
# One case


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _record_error(rec: OpRecord, e: BaseException) -> None:
    """An exception of one record: `unsupported` when the explicitly chosen experimental Pallas backend, available in
    this jax, refuses spec-valid input it documents it cannot run (NotImplementedError: a head row TMA cannot
    move), else an error (a failure; also a backend this jax lacks)."""
    import pallas_impl._backend

    if isinstance(e, NotImplementedError) and impls.pallas_backend() == "mosaic_gpu" and pallas_impl._backend.has_mosaic_gpu():
        rec.unsupported = _error_text(e)
    else:
        rec.error = _error_text(e)


class _Judge:
    """Adds the comparisons of one record: implementations pairwise bit for bit, each one against the reference.

    Every comparison goes through `parity.library.crosscheck.compare_results`, the engine of `parity.cross_check`.
    """

    def __init__(self, rt: impls.Runtime, case: cases_mod.Case, seed: int, query_start_loc):
        from parity.library import compare, crosscheck

        self.engine = crosscheck.compare_results
        self.locating = crosscheck.Locating(query_start_loc, context=compare._context(case.name, seed, rt.mode))
        self.lse_layout = case.lse_layout

    def _axes(self, x) -> str | None:
        """[T, H, D] outputs "THD", [H, T] / [T, H] LSEs the case's layout."""
        return self.lse_layout if len(x.shape) == 2 else None

    def _run(self, rec: OpRecord, results, key: str, op: str, **kw) -> None:
        axes = {key: ("token", "group") if key == "scales" else self._axes(next(iter(results.values()))[key])}
        for kind, report in self.engine(results, [key], locating=self.locating, axes=axes, prefix=f"{op}.", **kw):
            rec.add(kind, report)

    def bits(self, rec: OpRecord, kind: str, got, want, name: str) -> None:
        op, _, key = name.partition(".")
        axes = {key: ("token", "group") if key.startswith("scales") else self._axes(got)}
        for _, report in self.engine({"got": {key: got}, "want": {key: want}}, [key], pairs=[("got", "want")],
                                     locating=self.locating, axes=axes, prefix=f"{op}."):
            rec.add(kind, report)

    def all_bits(self, rec: OpRecord, results: dict[str, dict], key: str, op: str, want=None) -> None:
        self._run(rec, results, key, op, pairs=PAIRS, reference=None if want is None else {key: want},
                  reference_bitwise=True, against=impls.KERNEL_IMPLS)

    def to_reference(self, rec: OpRecord, results: dict[str, dict], key: str, op: str, want, exact, *, tol=None,
                     mag=None) -> None:
        self._run(rec, results, key, op, pairs=(), reference={key: want}, against=impls.KERNEL_IMPLS,
                  tolerance={key: tol}, exact={key: exact}, mag={key: mag})


def _shared(rt: impls.Runtime, inputs: dict[str, np.ndarray]) -> dict[str, dict[str, Any]]:
    """The inputs of every implementation: numpy for the reference, one device buffer for the others."""
    from parity.library import bridge

    t, j = bridge.share_inputs(inputs, rt.device)
    return {"reference": inputs, "triton": t, "pallas": j, "jnp": j, "torch": t}


def _judge_merge(rec: OpRecord, judge: _Judge, case: cases_mod.Case, op: str, results: dict,
                 ref_arrays: dict[str, np.ndarray]) -> None:
    """The comparisons of a merge record: pairwise bits, and each implementation against the reference."""
    D = case.head_dim
    w = expected.merge_weights(case, op, ref_arrays)
    mag = expected.magnitude(case, op, ref_arrays, w)
    out_exact, lse_exact = expected.exact_masks(case, w)
    ref = results["reference"]
    if case.group_size:  # per-group FP8 (docs/spec.md 4.7): the magnitude in each group's units, and the scales
        T, H, _ = mag.shape
        mag = (mag.reshape(T, -1, case.group_size) / ref["scales"][..., None]).reshape(T, H, D)
        judge.all_bits(rec, results, "scales", op)
        judge.to_reference(rec, results, "scales", op, ref["scales"], False, tol="float32")
    if case.nvfp4:  # NVFP4 (4.8): the magnitude in each block's units (x * g / s), and the e4m3 block scales
        mag = expected.nvfp4_units(mag, ref["scales"], ref_arrays["output_scale"])
        judge.all_bits(rec, results, "scales", op)
        judge.to_reference(rec, results, "scales", op, ref["scales"], False, tol="nvfp4_block_scale")
    judge.all_bits(rec, results, "out", op)
    judge.all_bits(rec, results, "lse", op)
    against = results
    if case.nvfp4:  # the codes' values against the reference's quotients, in the reference's block units
        against = {impl: dict(r, out=expected.nvfp4_in_reference_units(r["out"], r["scales"], ref["scales"]))
                   if impl in impls.KERNEL_IMPLS and r and r.get("out") is not None and r.get("scales") is not None
                   else r for impl, r in results.items()}
    judge.to_reference(rec, against, "out", op, ref["out"], np.broadcast_to(out_exact[..., None], mag.shape), mag=mag,
                       tol="float4_e2m1fn" if case.nvfp4 else None)
    judge.to_reference(rec, results, "lse", op, ref["lse"], lse_exact, tol="lse")
    if case.head_pad:  # the columns past D of Triton's output buffer keep their NaN poison
        pad = results["triton"]["out_buffer"][..., D:]
        judge.bits(rec, "triton_vs_reference", pad, impls.poisoned(pad.shape, case.out_dtype or case.dtype, pad.device),
                   f"{op}.out[pad]")


def run_case(rt: impls.Runtime, case: cases_mod.Case, seed: int, on_record=None) -> list[OpRecord]:
    """Run the operations of one case; `on_record(rec)` is called as each finishes.

    Results stay on the device (torch tensors, JAX arrays): `parity.library.compare` scans them there in chunks.
    """
    records: list[OpRecord] = []

    def finish(rec: OpRecord, t0: float) -> None:
        rec.elapsed_s = time.perf_counter() - t0
        records.append(rec)
        if on_record is not None:
            on_record(rec)

    if case.n_way:
        _run_n_way(rt, case, seed, finish)
    else:
        _run_two_way(rt, case, seed, finish)
    return records


def _run_two_way(rt, case, seed, finish) -> None:
    D = case.head_dim
    inputs = cases_mod.make_inputs(case, seed)
    arrays = _shared(rt, inputs)
    judge = _Judge(rt, case, seed, inputs["query_start_loc"])

    # ---- mask (docs/spec.md 3): bit-exact everywhere
    t0 = time.perf_counter()
    rec = OpRecord(case, "mask", rt.mode)
    masked: dict[str, dict] = {}
    try:
        masked = {impl: impls.run(rt, impl, "mask", case, arrays[impl]) for impl in impls.IMPLS}
        judge.all_bits(rec, masked, "lse", "mask", masked["reference"]["lse"])
        judge.all_bits(rec, masked, "output", "mask", masked["reference"]["output"])
        if case.head_pad:  # the columns past D of the V-padded buffer are not the mask's to touch
            judge.bits(rec, "triton_vs_reference", masked["triton"]["output_buffer"][..., D:],
                       inputs["prefix_output"][..., D:], "mask.output[pad]")
    except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
        _record_error(rec, e)
    finish(rec, t0)

    # ---- merge: mask then merge (each implementation merges its own masked prefix), then the fused mask
    for op in impls.ops_of(case)[1:]:
        t0 = time.perf_counter()
        rec = OpRecord(case, op, rt.mode)
        try:
            if op == "merge":
                if len(masked) < len(impls.IMPLS):
                    raise RuntimeError("the mask failed, so mask-then-merge has no input")
                ops = {impl: dict(arrays[impl], prefix_output=masked[impl]["output"], prefix_lse=masked[impl]["lse"])
                       for impl in impls.IMPLS}
            else:
                ops = arrays
            results = {impl: impls.run(rt, impl, op, case, ops[impl]) for impl in impls.IMPLS}
            _judge_merge(rec, judge, case, op, results, ops["reference"])
            if case.nvfp4:
                _swizzled_vs_row(rt, rec, judge, case, op, ops, results)
        except Exception as e:  # noqa: BLE001
            _record_error(rec, e)
        finish(rec, t0)


def _run_n_way(rt, case, seed, finish) -> None:
    inputs = cases_mod.make_inputs_n(case, seed)
    inputs["masked_lses"] = impls.masked_lses(case, inputs)
    arrays = _shared(rt, inputs)
    judge = _Judge(rt, case, seed, inputs["query_start_loc"])
    for op in impls.ops_of(case):
        t0 = time.perf_counter()
        rec = OpRecord(case, op, rt.mode)
        try:
            ops = arrays if op == "merge_n_fused" else {
                impl: dict(arrays[impl], lses=arrays[impl]["masked_lses"]) for impl in impls.IMPLS}
            results = {impl: impls.run(rt, impl, op, case, ops[impl]) for impl in impls.IMPLS}
            _judge_merge(rec, judge, case, op, results, ops["reference"])
            if case.nvfp4:
                _swizzled_vs_row(rt, rec, judge, case, op, ops, results)
            if case.partials == 2:
                _n2_vs_two_way(rt, rec, judge, case, op, arrays, results)
        except Exception as e:  # noqa: BLE001
            _record_error(rec, e)
        finish(rec, t0)


def _swizzled_vs_row(rt, rec, judge, case, op, ops, results) -> None:
    """docs/spec.md 4.8: the block scales' layout moves the scales, never a code. Every implementation runs the
    operation again writing swizzled scales (read back row-major by its adapter); codes and scales must be the
    row-major run's bits (on the GPU the swizzled store once changed the compiled Triton kernel's codes)."""
    swizzled = dataclasses.replace(case, scale_layout="swizzled")
    for impl in impls.KERNEL_IMPLS:
        got = impls.run(rt, impl, op, swizzled, ops[impl])
        for key in ("out", "scales"):
            judge.bits(rec, "swizzled_vs_row", got[key], results[impl][key], f"{op}.{key}[{impl}]")


def _n2_vs_two_way(rt, rec, judge, case, op, arrays, results) -> None:
    """docs/spec.md 8: at N = 2 the N-way kernel gives the 2-way kernel's bits. The 2-way fused mask covers the
    prefix only, so partial 1 goes in with its reference-masked LSE (the mask is exact)."""
    two_way_op = "merge_fused" if op == "merge_n_fused" else "merge"
    for impl in ("triton", "pallas"):
        a = arrays[impl]
        lses = a["lses"] if op == "merge_n_fused" else a["masked_lses"]
        two = dict(prefix_output=a["outputs"][0], prefix_lse=lses[0], suffix_output=a["outputs"][1],
                   suffix_lse=a["masked_lses"][1], query_start_loc=a["query_start_loc"],
                   cu_seq_lens=a["cu_seq_lens"][0], output_scale=a.get("output_scale"))
        got = impls.run(rt, impl, two_way_op, case, two)
        for key in ("out", "lse"):
            judge.bits(rec, f"{impl}_n2_vs_2way", results[impl][key], got[key], f"{op}.{key}")


# ---------------------------------------------------------------------------------------------------------
# The run


def count_ops(selected) -> int:
    return sum(len(impls.ops_of(c)) for c in selected)


def select(suite: str, name_filter: str | None, shard: tuple[int, int] | None = None) -> list:
    """The cases of a check run: the suite's (its GPU-only cases on a GPU), filtered by name, then every N-th from
    the K-th with shard=(K, N)."""
    selected = cases_mod.select(suite, name_filter, kind="all", gpu=impls.make_runtime().on_gpu)
    return selected if shard is None else selected[shard[0]::shard[1]]


def run_check(*, suite: str, name_filter: str | None, seed: int, shard=None,
              progress=None) -> tuple[impls.Runtime, list[OpRecord]]:
    """Run the selected cases; a line per finished record goes to `progress` (a stream) unless it is None."""
    selected = select(suite, name_filter, shard)
    rt = impls.make_runtime()
    total = count_ops(selected)
    records: list[OpRecord] = []

    def on_record(rec: OpRecord) -> None:
        records.append(rec)
        if progress is not None:
            print(f"[{len(records)}/{total}] {rec.case.name} {rec.op} {dtype_label(rec.case)} "
                  f"D={rec.case.head_dim} {rec.status} ({rec.elapsed_s:.1f}s)", file=progress, flush=True)

    for case in selected:
        run_case(rt, case, seed, on_record)
    return rt, records
