"""The probe's situations, their float64 ground truth and the classification of what a kernel left (numpy only).

A situation is a packed varlen batch (`Spec`): requests with `q_lens[r]` query rows and `kv_lens[r]` KV rows,
optionally causal, optionally with query rows masked out entirely and with padding rows past the last request.
A backend runs it in its own form (varlen offsets, a padded batch with lengths, a dense mask) and hands back
its results in packed rows (`Raw`); `judge` compares them with the float64 reference of the same visibility and
classifies the rows that attend to nothing.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

ALIGNMENTS = ("bottom-right", "top-left")  # causal masks when a request has more query rows than KV rows
# Finite values reported per situation (the distinct ones, in order of appearance).
MAX_FINITE_VALUES = 3
LSE_CLASSES = ("+inf", "-inf", "nan", "finite")
OUT_CLASSES = ("zero", "nan", "mean_v", "unwritten", "other")


class Unsupported(Exception):
    """The backend cannot express the situation; the message says why."""


@dataclasses.dataclass(frozen=True)
class Spec:
    """A packed batch: request r owns query rows [qsl[r], qsl[r+1]) and KV rows [cu[r], cu[r+1]).

    `masked_rows` are packed query rows whose mask is all False (an explicit mask); `pad_rows` rows follow the
    last request (padding: no request owns them). `causal` aligns each request's causal mask by the backend's
    convention (`ALIGNMENTS`).
    """

    q_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    causal: bool = False
    masked_rows: tuple[int, ...] = ()
    pad_rows: int = 0

    @property
    def qsl(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.q_lens)]).astype(np.int32)

    @property
    def cu(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.kv_lens)]).astype(np.int32)

    @property
    def num_tokens(self) -> int:
        return int(sum(self.q_lens))

    @property
    def num_rows(self) -> int:
        return self.num_tokens + self.pad_rows

    @property
    def num_kv(self) -> int:
        return int(sum(self.kv_lens))

    @property
    def single_request(self) -> bool:
        return len(self.q_lens) == 1 and not self.pad_rows


@dataclasses.dataclass(frozen=True)
class Situation:
    name: str
    spec: Spec
    what: str


SITUATIONS: dict[str, Situation] = {s.name: s for s in (
    Situation("plain", Spec((16,), (16,)), "one request, every row sees every key: the LSE's base and layout"),
    Situation("zero_kv", Spec((3, 2, 3), (4, 0, 5)),
              "a varlen batch whose request 1 has no KV rows (chunked prefill: its context ran out)"),
    Situation("fully_masked", Spec((4,), (5,), masked_rows=(2,)),
              "one request, query row 2 masked out entirely by an explicit mask"),
    Situation("causal_no_key", Spec((5,), (3,), causal=True),
              "causal, 5 query rows over 3 KV rows: bottom-right alignment leaves rows 0-1 without a key"),
    Situation("padding", Spec((3, 2), (4, 3), pad_rows=3),
              "3 padding rows past the last request (for a padded batch: the slots past each query length)"),
)}
NUM_HEADS, HEAD_DIM = 2, 64


@dataclasses.dataclass
class Inputs:
    """Packed numpy inputs of a `Spec`, already rounded to the backend's dtype (kept as f32)."""

    q: np.ndarray  # f32[num_rows, H, D]
    k: np.ndarray  # f32[num_kv, H, D]
    v: np.ndarray  # f32[num_kv, H, D]
    scale: float


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "float32":
        return x.astype(np.float32)
    import ml_dtypes

    return x.astype(getattr(ml_dtypes, dtype)).astype(np.float32)


def make_inputs(spec: Spec, dtype: str, seed: int = 0) -> Inputs:
    rng = np.random.default_rng(seed)

    def normal(n):
        return round_to(rng.standard_normal((n, NUM_HEADS, HEAD_DIM), dtype=np.float32), dtype)

    # At least one KV row, so a backend that indexes KV always has a buffer (no row attends to it when unused).
    n_kv = max(spec.num_kv, 1)
    return Inputs(q=normal(spec.num_rows), k=normal(n_kv), v=normal(n_kv), scale=HEAD_DIM ** -0.5)


@dataclasses.dataclass
class Raw:
    """What a backend returned, in packed rows: the requests' rows, then its padding rows.

    `lse` is `[H, rows]` in the backend's base (None when it neither returns one nor has a way to derive it);
    `lse_layout` is the backend's own layout; an LSE with fewer columns than `out` has rows (padding the kernel
    does not report) leaves those rows out of the LSE classes. `mean_v` is, per row, the mean of V over the keys
    its score row spans (the kernel's "uniform softmax" answer); `poison` what unwritten memory reads as.
    """

    out: np.ndarray
    lse: np.ndarray | None
    lse_layout: str
    lse_dtype: str
    out_dtype: str
    lse_source: str = "returned by the kernel"
    mean_v: np.ndarray | None = None
    poison: dict | None = None  # {"out": value, "lse": value} that unwritten memory reads as
    note: str = ""


def visibility(spec: Spec, alignment: str, num_rows: int | None = None) -> np.ndarray:
    """bool[rows, num_kv]: which key each packed query row sees. Rows past the last request see nothing."""
    rows = spec.num_rows if num_rows is None else num_rows
    qsl, cu = spec.qsl, spec.cu
    vis = np.zeros((rows, max(spec.num_kv, 1)), bool)
    for r, (nq, nk) in enumerate(zip(spec.q_lens, spec.kv_lens)):
        i = np.arange(nq)[:, None]
        j = np.arange(nk)[None, :]
        block = np.ones((nq, nk), bool)
        if spec.causal:
            block = j <= i + (nk - nq if alignment == "bottom-right" else 0)
        vis[qsl[r]:qsl[r + 1], cu[r]:cu[r + 1]] = block
    vis[list(spec.masked_rows)] = False
    return vis


def reference(inputs: Inputs, vis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(f64[rows, H, D] output, f64[H, rows] natural-log LSE) of the visible keys; NaN in rows that see none."""
    rows = vis.shape[0]
    q = inputs.q[:rows].astype(np.float64)
    if q.shape[0] < rows:  # a padded batch reports more padding rows than the packed buffer has: they see nothing
        q = np.concatenate([q, np.zeros((rows - q.shape[0],) + q.shape[1:])])
    s = np.einsum("qhd,khd->hqk", q, inputs.k.astype(np.float64)) * inputs.scale
    s = np.where(vis[None], s, -np.inf)
    with np.errstate(invalid="ignore", divide="ignore"):
        m = s.max(axis=-1, keepdims=True)
        p = np.exp(s - m)
        lse = np.log(p.sum(axis=-1)) + m[..., 0]
        out = np.einsum("hqk,khd->qhd", p / p.sum(axis=-1, keepdims=True), inputs.v.astype(np.float64))
    empty = ~vis.any(axis=1)
    out[empty], lse[:, empty] = np.nan, np.nan
    return out, lse


def _tolerance(dtype: str) -> float:
    """Data rows against float64: f32 kernels may use TF32 on a GPU (XLA's default), bf16 rounds its output. A
    wiring mistake (wrong layout, alignment, scale) is off by O(1)."""
    return 1e-2 if dtype == "float32" else 5e-2


def lse_classes(lse: np.ndarray, poison: float | None = None) -> tuple[dict, list[float]]:
    """Counts of each LSE class over `lse` ("unwritten": the poison value), and its first distinct finite values."""
    unwritten = np.zeros(lse.shape, bool) if poison is None else lse == poison
    finite = np.isfinite(lse) & ~unwritten
    counts = {"+inf": int(np.isposinf(lse).sum()), "-inf": int(np.isneginf(lse).sum()),
              "nan": int(np.isnan(lse).sum()), "finite": int(finite.sum())}
    if unwritten.any():
        counts["unwritten"] = int(unwritten.sum())
    values: list[float] = []
    for x in lse[finite].ravel().tolist():
        if x not in values:
            values.append(float(x))
        if len(values) == MAX_FINITE_VALUES:
            break
    return counts, values


def _finite_max(lse: np.ndarray, poison: float | None) -> float:
    finite = np.isfinite(lse) & (lse != poison if poison is not None else True)
    return float(lse[finite].max())


def out_classes(out: np.ndarray, mean_v: np.ndarray | None, poison: float | None, dtype: str) -> dict:
    """Counts of each output class over rows `out[rows, H, D]` (a row's class over all its heads)."""
    counts = dict.fromkeys(OUT_CLASSES, 0)
    tol = _tolerance(dtype)
    for i in range(out.shape[0]):
        row = out[i]
        if poison is not None and np.all(row == poison):
            counts["unwritten"] += 1
        elif np.isnan(row).any():
            counts["nan"] += 1
        elif np.all(row == 0):
            counts["zero"] += 1
        elif mean_v is not None and np.all(np.isfinite(mean_v[i])) and np.allclose(row, mean_v[i], atol=tol,
                                                                                    rtol=tol):
            counts["mean_v"] += 1
        else:
            counts["other"] += 1
    return counts


def _err(a: np.ndarray, b: np.ndarray) -> float:
    if a.size == 0:
        return 0.0
    with np.errstate(invalid="ignore"):
        d = np.abs(np.asarray(a, np.float64) - b)
    return float(np.nanmax(np.where(np.isnan(a) != np.isnan(b), np.inf, d)))


def judge(spec: Spec, inputs: Inputs, raw: Raw, dtype: str, alignments=ALIGNMENTS) -> dict:
    """The situation's result: alignment (causal), base, data-row errors, and the classes of the empty rows."""
    rows = raw.out.shape[0]
    best = None
    for alignment in (alignments if spec.causal else (None,)):
        vis = visibility(spec, alignment or "top-left", rows)
        ref_out, ref_lse = reference(inputs, vis)
        data = vis.any(axis=1)
        err = _err(raw.out[data], ref_out[data])
        if best is None or err < best[0]:
            best = (err, alignment, vis, ref_out, ref_lse, data)
    err, alignment, vis, ref_out, ref_lse, data = best
    tol = _tolerance(dtype)
    request_rows = np.arange(rows) < spec.num_tokens
    empty = ~data & request_rows
    padding = ~request_rows
    r: dict = dict(lse_layout=raw.lse_layout, lse_dtype=raw.lse_dtype, out_dtype=raw.out_dtype,
                   lse_source=raw.lse_source, data_rows=int(data.sum()), data_max_err=err,
                   data_ok=bool(err <= tol), empty_rows=int(empty.sum()), padding_rows=int(padding.sum()))
    if raw.note:
        r["note"] = raw.note
    if spec.causal:
        r["alignment"] = alignment
    base = None
    n_lse = 0 if raw.lse is None else raw.lse.shape[1]
    if raw.lse is not None and data[:n_lse].any():
        sel = data[:n_lse]
        got = raw.lse[:, sel]
        e, two = _err(got, ref_lse[:, :n_lse][:, sel]), _err(got, ref_lse[:, :n_lse][:, sel] / math.log(2))
        base = "e" if e <= tol and e <= two else ("2" if two <= tol else None)
        r["lse_max_err"] = min(e, two)
    r["lse_base"] = base if raw.lse is not None else None
    for key, sel in (("empty", empty), ("padding", padding)):
        if not sel.any():
            continue
        poison = raw.poison or {}
        if raw.lse is not None:
            in_lse = sel[:raw.lse.shape[1]]
            if in_lse.any():
                counts, values = lse_classes(raw.lse[:, :in_lse.size][:, in_lse], poison.get("lse"))
                r[f"{key}_lse"], r[f"{key}_lse_finite"] = counts, values
                if counts["finite"]:
                    r[f"{key}_lse_finite_range"] = [min(values), _finite_max(raw.lse[:, :in_lse.size][:, in_lse],
                                                                             poison.get("lse"))]
            if in_lse.sum() < sel.sum():
                r[f"{key}_lse_missing"] = int(sel.sum() - in_lse.sum())  # rows the kernel's LSE does not have
        mean_v = None if raw.mean_v is None else raw.mean_v[sel]
        r[f"{key}_out"] = out_classes(raw.out[sel], mean_v, poison.get("out"), dtype)
    r["status"] = "ok" if empty.any() or padding.any() else "no_empty_rows"
    if r["status"] == "no_empty_rows" and spec.causal:
        r["reason"] = f"every row sees a key: the causal mask is {alignment} aligned"
    if not r["data_ok"]:  # the rows that see keys are wrong: the classes of the others mean nothing
        r["status"] = "bad_data"
        r["reason"] = (f"the rows that see keys differ from float64 attention by {err:.3g} (tolerance {tol:g}): the "
                       "kernel does not compute this case")
    return r


def class_label(counts: dict | None, values: list | None = None) -> str:
    """'+inf', 'finite (-2.38e+38)', 'zero/nan', ...: the classes present, with the finite values."""
    if not counts:
        return "-"
    parts = []
    for k, n in counts.items():
        if not n:
            continue
        if k == "finite" and values:
            parts.append("finite " + ",".join(f"{v:.3g}" for v in values))
        else:
            parts.append(k)
    return "/".join(parts) or "-"
