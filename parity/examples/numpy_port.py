"""A port of the mask and the merges to plain numpy, in f32: the worked example of docs/porting.md.

It is written the way a port to another runtime would be (f32 math, one rounding at the end, the rules of
docs/spec.md sections 3, 4 and 8 spelled out), and it is checked the way any port is:

    python -m parity export golden --suite ci
    python -m parity verify golden --impl parity.examples.numpy_port:port

`port(op, inputs, params)` is the entry point `verify --impl` calls (docs/porting.md, "The callable").
numpy and ml_dtypes only.
"""

from __future__ import annotations

import numpy as np

import ml_dtypes

FP8_MAX = np.float32(448.0)
LN2 = np.float32(np.log(2.0))
LOG2E = np.float32(1.0 / np.log(2.0))
DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(ml_dtypes.bfloat16), "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn)}


def empty_rows(query_start_loc, cu_seq_lens, num_tokens):
    """bool[T]: the tokens of requests with no KV in these offsets (3). Padding tokens are not."""
    empty = np.zeros(num_tokens, dtype=bool)
    for r in range(len(query_start_loc) - 1):
        if cu_seq_lens[r + 1] == cu_seq_lens[r]:
            empty[query_start_loc[r]:query_start_loc[r + 1]] = True
    return empty


def to_th(lse, layout):
    """An LSE of either layout as [T, H] (stacked LSEs: [N, T, H])."""
    return np.swapaxes(lse, -1, -2) if layout == "HT" else lse


def from_th(lse_th, layout):
    return np.swapaxes(lse_th, -1, -2) if layout == "HT" else lse_th


def normalise(lse_th):
    """f32 in the LSEs' own base, with the empty sentinels +inf and NaN read as -inf (4.1)."""
    lse = lse_th.astype(np.float32)
    return np.where(np.isposinf(lse) | np.isnan(lse), np.float32(-np.inf), lse)


def weights(l, base):
    """(w f32[N, T, H], m, z, all_empty) of normalised LSEs l f32[N, T, H] (4.2, 4.3 and 8.2, 8.3). Base-2 LSEs
    stay in base 2: their differences are exponentiated as exp((l - m) * ln2), so a lone partial's weight is
    exactly 1 and its LSE comes back unchanged."""
    m = l.max(axis=0)
    all_empty = m == -np.inf
    m = np.where(all_empty, np.float32(0.0), m)  # every partial empty: no -inf - -inf = NaN
    with np.errstate(divide="ignore", invalid="ignore"):
        e = np.exp((l - m) * LN2) if base == "2" else np.exp(l - m)
        z = e[0].copy()
        for i in range(1, len(e)):  # index order
            z = z + e[i]
        w = e / z
    return w, m, z, all_empty


def combine(outputs, w):
    """sum_i w_i * o_i in index order; a zero weight contributes exactly 0, NaN garbage included (4.3)."""
    with np.errstate(invalid="ignore"):
        out = np.where(w[0][..., None] > 0, outputs[0].astype(np.float32) * w[0][..., None], np.float32(0.0))
        for i in range(1, len(outputs)):
            out = out + np.where(w[i][..., None] > 0, outputs[i].astype(np.float32) * w[i][..., None],
                                 np.float32(0.0))
    return out


def passthrough_rows(num_tokens, prefill_tokens_with_context):
    """bool[T]: tokens at or past prefill_tokens_with_context copy the last partial (4.4, 8.4)."""
    n = num_tokens if prefill_tokens_with_context is None else prefill_tokens_with_context
    return np.arange(num_tokens) >= n


def merge_partials(outputs, lses_th, empty, params):
    """The N-way merge (8) of partials outputs [N, T, H, D] and raw LSEs [N, T, H]; `empty` bool[N, T] or None."""
    l = normalise(lses_th)
    if empty is not None:
        l = np.where(empty[:, :, None], np.float32(-np.inf), l)
    w, m, z, all_empty = weights(l, params["lse_base"])
    out = np.where(all_empty[..., None], np.float32(0.0), combine(outputs, w))
    with np.errstate(divide="ignore"):
        lz = np.log(z) * LOG2E if params["lse_base"] == "2" else np.log(z)
        lse = np.where(all_empty, np.float32(-np.inf), lz) + m  # m is 0 where every partial is empty
    copy = passthrough_rows(out.shape[0], params["prefill_tokens_with_context"])
    out_dtype = DTYPES[params["out_dtype"]]
    if params["out_dtype"] == "float8_e4m3fn":  # 4.6: scale, clamp with comparisons (NaN stays NaN), cast
        out = np.where(copy[:, None, None], outputs[-1].astype(np.float32), out) / params["output_scale"]
        out = np.where(out < -FP8_MAX, -FP8_MAX, np.where(out > FP8_MAX, FP8_MAX, out)).astype(out_dtype)
    else:
        out = np.where(copy[:, None, None], outputs[-1], out.astype(out_dtype))
    last_lse = lses_th[-1]  # 8.4: the last partial's raw bits; -inf where the fused mask empties that partial
    if empty is not None:
        last_lse = np.where(empty[-1][:, None], np.float32(-np.inf), last_lse)
    lse = np.where(copy[:, None], last_lse, lse).astype(np.float32)
    return out, lse


def port(op, inputs, params):
    """The entry point of `python -m parity verify --impl`: one operation on numpy inputs."""
    D, layout = params["head_dim"], params["lse_layout"]
    if "output_scale" in inputs:
        params = dict(params, output_scale=np.float32(inputs["output_scale"].reshape(-1)[0]))
    qsl = inputs["query_start_loc"]
    if op == "mask":
        lse, out = inputs["lse"].copy(), inputs["output"][..., :D].copy()
        empty = empty_rows(qsl, inputs["cu_seq_lens"], out.shape[0])
        lse_th = to_th(lse, layout)  # a view: writes land in lse
        lse_th[empty] = -np.inf
        out[empty] = 0
        return {"lse": lse, "output": out}
    if op in ("merge", "merge_fused"):
        outputs = np.stack([inputs["prefix_output"][..., :D], inputs["suffix_output"][..., :D]])
        lses = np.stack([to_th(inputs["prefix_lse"], layout), to_th(inputs["suffix_lse"], layout)])
        empty = None
        if op == "merge_fused":  # the fused mask covers the prefix (4.5)
            empty = np.zeros((2, outputs.shape[1]), dtype=bool)
            empty[0] = empty_rows(qsl, inputs["prefix_cu_seq_lens"], outputs.shape[1])
    elif op in ("merge_n", "merge_n_fused"):
        outputs, lses = inputs["outputs"][..., :D], to_th(inputs["lses"], layout)
        empty = None
        if op == "merge_n_fused":
            empty = np.stack([empty_rows(qsl, cu, outputs.shape[1]) for cu in inputs["cu_seq_lens"]])
    else:
        raise ValueError(f"unknown op {op!r}")
    out, lse = merge_partials(outputs, lses, empty, params)
    return {"out": out, "lse": from_th(lse, layout)}
