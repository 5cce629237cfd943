"""`python -m parity check`: run both implementations on a suite of `parity.cases` and compare them.

For every case the numpy inputs of `parity.cases.make_inputs` are uploaded once to torch and shared with JAX
over DLPack (`parity.bridge.share_inputs`, zero-copy). Three operations run per case:

- `mask`: `mask_empty_context_lse` on the prefix LSE, zeroing the prefix output (SPEC 3);
- `merge`: the merge of the *masked* prefix with the suffix (mask then merge, two launches; SPEC 4);
- `merge_fused`: the merge of the raw prefix with the fused mask (`query_start_loc` + `prefix_cu_seq_lens`,
  SPEC 4.5); only for cases with an empty request.

Both merges use the case's options: `output_lse`, `prefill_tokens_with_context`, fp8 output with
`output_scale`, `lse_layout`, `lse_base`. Padded-V cases hand Triton views `[..., :D]` of the padded buffers
(own strides) and JAX slices (JAX arrays have no strides). Triton runs in place on clones of the shared torch
tensors (a torch write would show through the JAX arrays, SPEC 6); Pallas runs functionally.

Each result is compared (a) Triton vs Pallas bit for bit (`parity.compare.compare_bits`) and (b) each
implementation vs the float64 reference (`parity.reference`) with `parity.compare.compare_to_reference`:
exactly where the result is a bit copy (the mask; pass-through rows; rows empty on both sides, whose out is 0
and LSE -inf), within tolerance elsewhere, measured against `compare.merge_magnitude` (|a|*wp + |b|*ws). Which
comparisons are required depends on the mode (SPEC 5): see `RULES`.
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect
import json
import math
import os
import platform
import subprocess
import sys
import time
from typing import Any

import numpy as np

from parity import cases as cases_mod
from parity import reference

SCHEMA = "parity-check/1"
KINDS = ("triton_vs_pallas", "triton_vs_reference", "pallas_vs_reference")

RULES = {
    "gpu-bitwise": (
        "GPU, compiled kernels: Triton and Pallas must agree bit for bit (0 differing bits) on every output "
        "of the mask and of the merge (SPEC 5); each must also match the float64 reference, bit for bit where "
        "the result is a copy (mask, pass-through rows, rows empty on both sides) and within the stated "
        "tolerance elsewhere."),
    "cpu-interpreters": (
        "CPU, Triton interpreter and Pallas interpret mode: the mask must agree bit for bit between Triton and "
        "Pallas; for the merge the Triton-vs-Pallas differing bits are reported but not required, because the "
        "interpreters' float math differs (XLA:CPU contracts FMAs and has its own exp/log, SPEC 5); each "
        "implementation must match the float64 reference, bit for bit where the result is a copy (mask, "
        "pass-through rows, rows empty on both sides) and within the stated tolerance elsewhere."),
}

# Token chunk (in T*H*D elements) of the float64 reference: bounds its temporaries on the large workloads.
_REF_CHUNK_ELEMS = 1 << 23


# ---------------------------------------------------------------------------------------------------------
# Small helpers shared with parity.golden


def _call(func, *args, **kwargs):
    """Call `func`, dropping keyword arguments it does not declare (compare's optional extras)."""
    try:
        params = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return func(*args, **kwargs)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return func(*args, **kwargs)
    return func(*args, **{k: v for k, v in kwargs.items() if k in params})


def dtype_label(case: cases_mod.Case) -> str:
    short = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "fp8"}
    label = short[case.dtype]
    return label if case.out_dtype is None else f"{label}->{short[case.out_dtype]}"


def lse_as_th(lse: np.ndarray, lse_layout: str) -> np.ndarray:
    """View an LSE given in `lse_layout` as [T, H]."""
    return lse.T if lse_layout == "HT" else lse


def _token_slice_lse(lse: np.ndarray, lse_layout: str, t0: int, t1: int) -> np.ndarray:
    return lse[:, t0:t1] if lse_layout == "HT" else lse[t0:t1]


def reference_merge(case: cases_mod.Case, prefix_output, prefix_lse, suffix_output, suffix_lse, *,
                    query_start_loc=None, prefix_cu_seq_lens=None, output_scale=None):
    """`reference.merge_attn_states` with the case's options, in token chunks (every token is independent).

    Outputs are `[T, H, D']` for any D' (callers slice a head pad away). A chunk [t0, t1) gets its offsets
    rebased and clipped to the chunk (`clip(qsl - t0, 0, t1 - t0)`), which selects exactly the same tokens.
    Returns (out f64[T, H, D'], lse f64 in the case's layout and base).
    """
    T, H, Dx = prefix_output.shape
    ptwc = case.prefill_tokens_with_context
    step = max(1, _REF_CHUNK_ELEMS // max(1, H * Dx))
    out = np.empty((T, H, Dx), dtype=np.float64)
    lse = np.empty((H, T) if case.lse_layout == "HT" else (T, H), dtype=np.float64)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        kw: dict[str, Any] = {}
        if ptwc is not None:
            kw["prefill_tokens_with_context"] = int(np.clip(ptwc - t0, 0, t1 - t0))
        if query_start_loc is not None:
            kw["query_start_loc"] = np.clip(np.asarray(query_start_loc, np.int64) - t0, 0, t1 - t0)
            kw["prefix_cu_seq_lens"] = prefix_cu_seq_lens
        o, l = reference.merge_attn_states(
            prefix_output[t0:t1], _token_slice_lse(prefix_lse, case.lse_layout, t0, t1),
            suffix_output[t0:t1], _token_slice_lse(suffix_lse, case.lse_layout, t0, t1),
            output_scale=output_scale, lse_layout=case.lse_layout, lse_base=case.lse_base, **kw)
        out[t0:t1] = o
        _token_slice_lse(lse, case.lse_layout, t0, t1)[...] = l
    return out, lse


def merge_weights(case: cases_mod.Case, prefix_lse, suffix_lse, *, query_start_loc=None,
                  prefix_cu_seq_lens=None) -> tuple[np.ndarray, np.ndarray]:
    """(wp, ws) f64[T, H]: the reference's merge weights, read off the reference itself.

    Merging a = 1 with b = 0 (D = 1) gives wp, a = 0 with b = 1 gives ws; so pass-through rows (SPEC 4.4) get
    (0, 1) and rows empty on both sides (SPEC 4.2) get (0, 0).
    """
    T, H = case.num_tokens, case.num_heads
    one, zero = np.ones((T, H, 1), np.float32), np.zeros((T, H, 1), np.float32)
    kw = dict(query_start_loc=query_start_loc, prefix_cu_seq_lens=prefix_cu_seq_lens)
    wp, _ = reference_merge(case, one, prefix_lse, zero, suffix_lse, **kw)
    ws, _ = reference_merge(case, zero, prefix_lse, one, suffix_lse, **kw)
    return wp[..., 0], ws[..., 0]


def merge_exact_rows(case: cases_mod.Case, ref_lse: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(out_exact bool[T, H], lse_exact bool[T, H]): where the merge's result is a bit copy.

    Rows empty on both sides (reference LSE -inf: out is 0, LSE -inf, SPEC 4.2) and pass-through rows
    (t >= prefill_tokens_with_context: suffix row and raw suffix LSE, SPEC 4.4). With an fp8 output a
    pass-through row is scaled and cast like any other, so only its LSE is a copy.
    """
    lse_th = lse_as_th(ref_lse, case.lse_layout)
    both_empty = np.isneginf(lse_th)
    passthrough = np.zeros_like(both_empty)
    if case.prefill_tokens_with_context is not None:
        passthrough[case.prefill_tokens_with_context:] = True
    lse_exact = both_empty | passthrough
    out_exact = both_empty | passthrough if case.out_dtype is None else both_empty.copy()
    return out_exact, lse_exact


def git_commit() -> str | None:
    """HEAD of the checkout, else $GIT_COMMIT (a copied tree without .git, as on the device machine)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        r = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        head = r.stdout.strip() if r.returncode == 0 else ""
    except (OSError, subprocess.SubprocessError):
        head = ""
    return head or os.environ.get("GIT_COMMIT") or None


def collect_env(argv: list[str] | None = None) -> dict[str, Any]:
    """Devices, versions, git commit, UTC time and command line of this run."""
    versions: dict[str, str | None] = {"python": platform.python_version(), "numpy": np.__version__}
    devices: dict[str, Any] = {}
    for mod in ("torch", "triton", "jax", "jaxlib", "ml_dtypes"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - report what is importable
            versions[mod] = None
    try:
        import torch

        if torch.cuda.is_available():
            devices["torch"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            versions["cuda"] = torch.version.cuda
        else:
            devices["torch"] = ["cpu"]
    except Exception:  # noqa: BLE001
        devices["torch"] = None
    try:
        import jax

        devices["jax"] = [f"{d.platform}:{getattr(d, 'device_kind', '')}" for d in jax.devices()]
    except Exception:  # noqa: BLE001
        devices["jax"] = None
    command = "python -m parity " + " ".join(argv) if argv is not None else " ".join(sys.argv)
    return {
        "devices": devices,
        "versions": versions,
        "platform": platform.platform(),
        "git_commit": git_commit(),
        "utc_time": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": command,
        "environment_variables": {k: os.environ.get(k)
                                  for k in ("TRITON_INTERPRET", "XLA_PYTHON_CLIENT_PREALLOCATE")},
    }


# ---------------------------------------------------------------------------------------------------------
# Running the implementations


@dataclasses.dataclass
class Runtime:
    """The device, the mode and the imported implementation packages."""

    device: str  # torch device: "cuda" or "cpu"
    mode: str  # "gpu-bitwise" or "cpu-interpreters"
    triton_impl: Any
    pallas_impl: Any
    bridge: Any
    compare: Any


def make_runtime() -> Runtime:
    import torch

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        os.environ["TRITON_INTERPRET"] = "1"  # before triton_impl is imported (SPEC 6)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    import pallas_impl
    import triton_impl
    from parity import bridge, compare

    device = "cuda" if torch.cuda.is_available() else "cpu"
    jax_backend = jax.default_backend()
    if (device == "cuda") != (jax_backend == "gpu"):
        raise RuntimeError(f"torch uses {device!r} but JAX's default backend is {jax_backend!r}: "
                           "both frameworks must run on the same kind of device")
    mode = "gpu-bitwise" if device == "cuda" else "cpu-interpreters"
    return Runtime(device, mode, triton_impl, pallas_impl, bridge, compare)


def _required(mode: str, op: str) -> tuple[str, ...]:
    if mode == "gpu-bitwise" or op == "mask":
        return KINDS
    return ("triton_vs_reference", "pallas_vs_reference")


def _sync(rt: Runtime) -> None:
    if rt.device == "cuda":
        import torch

        torch.cuda.synchronize()


def _torch_poisoned(shape, dtype, device):
    """A NaN-filled torch tensor: any element a kernel fails to write shows up as a NaN mismatch."""
    import torch

    return torch.full(shape, float("nan"), dtype=torch.float32, device=device).to(dtype)


def _torch_dtype(name: str):
    import torch

    return getattr(torch, name)


def _jnp_dtype(name: str):
    import jax.numpy as jnp

    return jnp.dtype(cases_mod.DTYPES[name])


def run_triton_mask(rt: Runtime, case, t: dict):
    """In place on clones: returns (lse, output buffer with its head pad) as torch tensors."""
    lse = t["prefix_lse"].clone()
    out_buf = t["prefix_output"].clone()
    with np.errstate(all="ignore"):  # the interpreter evaluates with numpy: inf/NaN inputs are expected
        rt.triton_impl.mask_empty_context_lse(lse, t["query_start_loc"], t["cu_seq_lens"],
                                              out_buf[..., :case.head_dim], lse_layout=case.lse_layout)
    _sync(rt)
    return lse, out_buf


def run_pallas_mask(rt: Runtime, case, j: dict):
    lse, out = _call(rt.pallas_impl.mask_empty_context_lse, j["prefix_lse"], j["query_start_loc"],
                     j["cu_seq_lens"], j["prefix_output"][..., :case.head_dim], lse_layout=case.lse_layout,
                     implementation="pallas")
    return lse, out


def run_triton_merge(rt: Runtime, case, t: dict, prefix_output, prefix_lse, *, fused: bool):
    """Returns (out buffer with its head pad, output_lse) as torch tensors; `prefix_output` may be padded."""
    T, H, D = case.num_tokens, case.num_heads, case.head_dim
    out_dtype = _torch_dtype(case.out_dtype or case.dtype)
    out_buf = _torch_poisoned((T, H, D + case.head_pad), out_dtype, prefix_output.device)
    out_lse = _torch_poisoned(tuple(t["suffix_lse"].shape), _torch_dtype("float32"), prefix_output.device)
    kw = {}
    if fused:
        kw = dict(query_start_loc=t["query_start_loc"], prefix_cu_seq_lens=t["cu_seq_lens"])
    with np.errstate(all="ignore"):  # the interpreter evaluates with numpy: inf/NaN inputs are expected
        rt.triton_impl.merge_attn_states(
            out_buf[..., :D], prefix_output[..., :D], prefix_lse, t["suffix_output"][..., :D], t["suffix_lse"],
            out_lse, case.prefill_tokens_with_context, t.get("output_scale"),
            lse_layout=case.lse_layout, lse_base=case.lse_base, **kw)
    _sync(rt)
    return out_buf, out_lse


def run_pallas_merge(rt: Runtime, case, j: dict, prefix_output, prefix_lse, *, fused: bool):
    D = case.head_dim
    kw: dict[str, Any] = {}
    if fused:
        kw = dict(query_start_loc=j["query_start_loc"], prefix_cu_seq_lens=j["cu_seq_lens"])
    if case.prefill_tokens_with_context is not None:
        kw["prefill_tokens_with_context"] = case.prefill_tokens_with_context
    if case.out_dtype is not None:
        kw["out_dtype"] = _jnp_dtype(case.out_dtype)
        kw["output_scale"] = j["output_scale"]
    out, lse = rt.pallas_impl.merge_attn_states(
        prefix_output[..., :D], prefix_lse, j["suffix_output"][..., :D], j["suffix_lse"],
        return_lse=True, lse_layout=case.lse_layout, lse_base=case.lse_base, implementation="pallas", **kw)
    return out, lse


# ---------------------------------------------------------------------------------------------------------
# Records


@dataclasses.dataclass
class OpRecord:
    """The comparisons of one operation of one case."""

    case: cases_mod.Case
    op: str  # "mask", "merge" (mask then merge) or "merge_fused"
    mode: str
    comparisons: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)  # kind -> array -> Report
    error: str | None = None
    elapsed_s: float = 0.0

    @property
    def required(self) -> tuple[str, ...]:
        return _required(self.mode, self.op)

    @property
    def ok(self) -> bool:
        if self.error is not None:
            return False
        for kind in self.required:
            if not self.comparisons.get(kind):
                return False
            if not all(r.ok for r in self.comparisons[kind].values()):
                return False
        return True

    @property
    def status(self) -> str:
        return "ERROR" if self.error is not None else ("ok" if self.ok else "FAIL")

    def add(self, kind: str, report) -> None:
        self.comparisons.setdefault(kind, {})[report_name(report)] = report

    def to_dict(self) -> dict[str, Any]:
        c = self.case
        return {
            "case": c.name, "op": self.op, "dtype": c.dtype, "out_dtype": c.out_dtype or c.dtype,
            "num_tokens": c.num_tokens, "num_heads": c.num_heads, "head_dim": c.head_dim,
            "num_requests": c.num_requests, "lse_layout": c.lse_layout, "lse_base": "2" if c.lse_base == 2 else "e",
            "head_pad": c.head_pad, "prefill_tokens_with_context": c.prefill_tokens_with_context,
            "status": self.status.lower(), "ok": self.ok, "error": self.error,
            "required": list(self.required),
            "comparisons": {k: {n: r.to_dict() for n, r in v.items()} for k, v in self.comparisons.items()},
            "elapsed_s": round(self.elapsed_s, 3),
        }


def report_name(report) -> str:
    name = getattr(report, "name", None)
    if name is None and hasattr(report, "to_dict"):
        name = report.to_dict().get("name")
    return str(name)


def _sum_diff(reports) -> int:
    return int(sum(int(r.n_diff) for r in reports))


def _max_ulp(reports):
    vals = [r.max_ulp for r in reports if r.max_ulp is not None]
    if not vals:
        return None
    return max(float(v) for v in vals)


def _fmt_ulp(v) -> str:
    if v is None:
        return "-"
    if math.isinf(v):
        return "inf"
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.3g}"


def _fmt_vs_ref(rec: OpRecord, kind: str) -> str:
    """`ok (exact)` for bit comparisons; `ok (err/tol 0.41)`: the largest error as a fraction of the tolerance."""
    reports = list(rec.comparisons.get(kind, {}).values())
    if not reports:
        return "-"
    if not all(r.ok for r in reports):
        return f"FAIL ({_sum_diff(r for r in reports if not r.ok)} bad)"
    ratios = [r.max_err_ratio for r in reports if getattr(r, "max_err_ratio", None) is not None]
    return f"ok (err/tol {max(ratios):.2f})" if ratios else "ok (exact)"


def format_table(records: list[OpRecord]) -> str:
    head = ("case", "op", "dtype", "D", "tri-vs-pal bits", "max ulp", "triton-vs-ref", "pallas-vs-ref", "status")
    rows = [head]
    footnote = False
    for rec in records:
        tp = list(rec.comparisons.get("triton_vs_pallas", {}).values())
        bits = str(_sum_diff(tp)) if tp else "-"
        if tp and "triton_vs_pallas" not in rec.required:
            bits += "*"
            footnote = True
        status = rec.status
        rows.append((rec.case.name, rec.op, dtype_label(rec.case), str(rec.case.head_dim), bits,
                     _fmt_ulp(_max_ulp(tp)) if tp else "-", _fmt_vs_ref(rec, "triton_vs_reference"),
                     _fmt_vs_ref(rec, "pallas_vs_reference"), status))
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    right = {3, 4, 5}
    lines = []
    for n, row in enumerate(rows):
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    if footnote:
        lines.append("* reported, not required: the CPU interpreters' float math differs (SPEC 5)")
    for rec in records:
        if rec.error is not None:
            lines.append(f"{rec.case.name} {rec.op}: error: {rec.error}")
        elif not rec.ok:
            for kind in rec.required:
                for r in rec.comparisons.get(kind, {}).values():
                    if not r.ok:
                        lines.append(f"{rec.case.name} {rec.op} {kind}:")
                        lines.append("  " + r.format().replace("\n", "\n  "))
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# One case


def _ops_of(case: cases_mod.Case) -> tuple[str, ...]:
    return ("mask", "merge", "merge_fused") if case.empty else ("mask", "merge")


def _error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def run_case(rt: Runtime, case: cases_mod.Case, seed: int, on_record=None) -> list[OpRecord]:
    """Run the operations of one case; `on_record(rec)` is called as each finishes.

    Results stay on the device (torch tensors, JAX arrays): `parity.compare` scans them there in chunks.
    """
    cmp = rt.compare
    D = case.head_dim
    inputs = cases_mod.make_inputs(case, seed)
    qsl, cu = inputs["query_start_loc"], inputs["cu_seq_lens"]
    t, j = rt.bridge.share_inputs(inputs, rt.device)
    records: list[OpRecord] = []
    loc = dict(query_start_loc=qsl, lse_layout=case.lse_layout, case=case.name, seed=seed, mode=rt.mode)

    def bits(got, want, name):
        return _call(cmp.compare_bits, got, want, name=name, **loc)

    def to_ref(got, want, name, **kw):
        return _call(cmp.compare_to_reference, got, want, name=name, **loc, **kw)

    def finish(rec: OpRecord, t0: float) -> None:
        rec.elapsed_s = time.perf_counter() - t0
        records.append(rec)
        if on_record is not None:
            on_record(rec)

    # ---- mask (SPEC 3): bit-exact everywhere
    t0 = time.perf_counter()
    rec = OpRecord(case, "mask", rt.mode)
    want_lse, want_out = reference.mask_empty_context_lse(inputs["prefix_lse"], qsl, cu,
                                                          inputs["prefix_output"][..., :D],
                                                          lse_layout=case.lse_layout)
    tri = pal = None
    try:
        pal = run_pallas_mask(rt, case, j)
        tri = run_triton_mask(rt, case, t)
        for name, tg, pg, want in (("mask.lse", tri[0], pal[0], want_lse),
                                   ("mask.output", tri[1][..., :D], pal[1], want_out)):
            rec.add("triton_vs_pallas", bits(tg, pg, name))
            rec.add("triton_vs_reference", bits(tg, want, name))
            rec.add("pallas_vs_reference", bits(pg, want, name))
        if case.head_pad:  # the columns past D of the V-padded buffer are not the mask's to touch
            rec.add("triton_vs_reference", bits(tri[1][..., D:], t["prefix_output"][..., D:], "mask.output[pad]"))
    except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
        rec.error = _error_text(e)
    finish(rec, t0)

    # ---- merge: mask then merge (each implementation merges its own masked prefix), then the fused mask
    variants = [("merge", False)] + ([("merge_fused", True)] if case.empty else [])
    mag = None
    scale = inputs.get("output_scale")
    ref_b, ref_s = inputs["suffix_output"][..., :D], inputs["suffix_lse"]
    for op, fused in variants:
        t0 = time.perf_counter()
        rec = OpRecord(case, op, rt.mode)
        try:
            if fused:
                ref_a, ref_p = inputs["prefix_output"][..., :D], inputs["prefix_lse"]
                ref_kw = dict(query_start_loc=qsl, prefix_cu_seq_lens=cu)
                tri_args, pal_args = (t["prefix_output"], t["prefix_lse"]), (j["prefix_output"], j["prefix_lse"])
            else:
                if tri is None or pal is None:
                    raise RuntimeError("the mask failed, so mask-then-merge has no input")
                ref_a, ref_p = want_out, want_lse
                ref_kw = {}
                tri_args, pal_args = (tri[1], tri[0]), (pal[1], pal[0])
            want_o, want_l = reference_merge(case, ref_a, ref_p, ref_b, ref_s, output_scale=scale, **ref_kw)
            if mag is None:  # the same for both variants (the fused mask gives the masked rows weight 0)
                wp, ws = merge_weights(case, ref_p, ref_s, **ref_kw)
                mag = cmp.merge_magnitude(ref_a, ref_b, wp, ws, scale)
                del wp, ws
            out_exact, lse_exact = merge_exact_rows(case, want_l)
            out_exact = np.broadcast_to(out_exact[:, :, None], want_o.shape)
            lse_exact = lse_exact.T if case.lse_layout == "HT" else lse_exact

            p_out, p_lse = run_pallas_merge(rt, case, j, *pal_args, fused=fused)
            t_buf, t_lse = run_triton_merge(rt, case, t, *tri_args, fused=fused)
            t_out = t_buf[..., :D]
            for name, tg, pg, want, exact, kw in (
                    (f"{op}.out", t_out, p_out, want_o, out_exact, dict(mag=mag)),
                    (f"{op}.lse", t_lse, p_lse, want_l, lse_exact, dict(tol="lse"))):
                rec.add("triton_vs_pallas", bits(tg, pg, name))
                rec.add("triton_vs_reference", to_ref(tg, want, name, exact_mask=exact, **kw))
                rec.add("pallas_vs_reference", to_ref(pg, want, name, exact_mask=exact, **kw))
            if case.head_pad:  # the columns past D of the output buffer keep their NaN poison
                rec.add("triton_vs_reference", bits(t_buf[..., D:], _torch_poisoned(
                    tuple(t_buf[..., D:].shape), t_buf.dtype, t_buf.device), f"{op}.out[pad]"))
        except Exception as e:  # noqa: BLE001
            rec.error = _error_text(e)
        finish(rec, t0)
    return records


# ---------------------------------------------------------------------------------------------------------
# The command


def count_ops(selected) -> int:
    return sum(len(_ops_of(c)) for c in selected)


def run_check(*, suite: str, name_filter: str | None, seed: int, quiet: bool = False,
              progress=None) -> tuple[Runtime, list[OpRecord]]:
    selected = cases_mod.select(suite, name_filter)
    rt = make_runtime()
    total = count_ops(selected)
    records: list[OpRecord] = []

    def on_record(rec: OpRecord) -> None:
        records.append(rec)
        if not quiet:
            line = (f"[{len(records)}/{total}] {rec.case.name} {rec.op} {dtype_label(rec.case)} "
                    f"D={rec.case.head_dim} {rec.status} ({rec.elapsed_s:.1f}s)")
            print(line, file=progress or sys.stderr, flush=True)

    for case in selected:
        run_case(rt, case, seed, on_record)
    return rt, records


def build_report(rt: Runtime, records: list[OpRecord], *, suite: str, name_filter, seed: int,
                 argv: list[str] | None) -> dict[str, Any]:
    n_fail = sum(not r.ok for r in records)
    return {
        "schema": SCHEMA,
        "env": collect_env(argv),
        "mode": rt.mode,
        "rule": RULES[rt.mode],
        "tolerances": {k: v.describe() for k, v in getattr(rt.compare, "TOLERANCES", {}).items()},
        "suite": suite,
        "filter": name_filter,
        "seed": seed,
        "summary": {"records": len(records), "failed": n_fail, "ok": n_fail == 0,
                    "cases": len({r.case.name for r in records})},
        "records": [r.to_dict() for r in records],
    }


def main(args) -> int:
    """Handler of `python -m parity check` (args from parity.cli)."""
    selected = cases_mod.select(args.suite, args.name_filter)
    if not selected:
        print(f"error: no case in suite {args.suite!r} matches -k {args.name_filter!r}", file=sys.stderr)
        return 2
    rt, records = run_check(suite=args.suite, name_filter=args.name_filter, seed=args.seed, quiet=args.quiet)
    print(format_table(records))
    ok = all(r.ok for r in records)
    print(f"{rt.mode}: {sum(r.ok for r in records)}/{len(records)} ok" + ("" if ok else " -- PARITY FAILURE"))
    if args.json:
        report = build_report(rt, records, suite=args.suite, name_filter=args.name_filter, seed=args.seed,
                              argv=getattr(args, "argv", None))
        with open(args.json, "w") as f:
            json.dump(jsonable(report), f, indent=1)
            f.write("\n")
    return 0 if ok else 1


def jsonable(x):
    """A copy of `x` that strict JSON accepts: numpy scalars as numbers, non-finite floats as strings."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x
