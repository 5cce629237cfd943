"""`cross_check`'s verdicts on a catalogue of pairs made of the frameworks' own functions (not this project's
kernels), each with the verdict it must get under the default error model (docs/parity-library.md, "The
low-precision baseline"): faithful pairs whose outputs cancel inside their own precision pass; every planted
divergence fails, on the planted side only."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import parity

RNG = np.random.default_rng(7)


def _dominant_logits(rows=48, cols=74):
    """The example of docs/parity-library.md: one logit of 30 per row among N(0, 9) ones (3,552 elements)."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
    x[np.arange(rows), rng.integers(0, cols, rows)] = 30.0
    return {"x": x}


def _lse64(x, axis=-1):
    x = np.asarray(x, np.float64)
    m = x.max(axis, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis, keepdims=True))).squeeze(axis)


def _log_softmax_ref(x):
    return np.asarray(x, np.float64) - _lse64(x)[..., None]


# Ragged log-sum-exp over requests (query_start_loc-style offsets), heads last: [T, H] -> [R, H].
QSL = np.array([0, 5, 5, 17, 18, 40, 64], np.int32)


def _ragged_inputs():
    x = (RNG.standard_normal((64, 4)) * 2).astype(np.float32)
    return {"x": x, "qsl": QSL}


def _ragged_ref(x, qsl, base=math.e):
    x = np.asarray(x, np.float64)
    out = np.full((len(qsl) - 1, x.shape[1]), -np.inf)
    for r in range(len(qsl) - 1):
        if qsl[r + 1] > qsl[r]:
            out[r] = _lse64(x[qsl[r]:qsl[r + 1]], axis=0)
    return out


def _ragged_torch(x, qsl, drop=0, dup=False, shift=0, base2=False, no_max=False):
    rows = []
    q = qsl.tolist()
    for r in range(len(q) - 1):
        lo, hi = q[r] + shift, q[r + 1] - drop
        seg = x[lo:hi]
        if dup and hi > lo:
            seg = torch.cat([seg, seg[-1:]])
        if hi <= lo:
            rows.append(torch.full((x.shape[1],), -math.inf))
        elif base2:
            rows.append(torch.log2(torch.exp2(seg).sum(0)))
        elif no_max:
            rows.append(torch.log(torch.exp(seg).sum(0)))
        else:
            rows.append(torch.logsumexp(seg, 0))
    return torch.stack(rows)


def _ragged_jax(x, qsl):
    q = np.asarray(qsl).tolist()
    return jnp.stack([jax.nn.logsumexp(x[q[r]:q[r + 1]], axis=0) if q[r + 1] > q[r]
                      else jnp.full((x.shape[1],), -jnp.inf) for r in range(len(q) - 1)])


def _rmsnorm_inputs():
    return {"x": (RNG.standard_normal((32, 64)) * 0.3).astype(np.float32)}


def _rmsnorm_torch(x, eps=1e-6):
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps)


def _rmsnorm_jax(x, eps=1e-6):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps)


def _rmsnorm_ref(x):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)


def _wsum_inputs():
    logits = (RNG.standard_normal((16, 24)) * 2).astype(np.float32)
    logits[:, 20:] = -np.inf  # masked keys: zero weight
    v = RNG.standard_normal((24, 8)).astype(np.float32)
    v[20:] = np.nan  # their values are garbage (unwritten scratch)
    return {"logits": logits, "v": v}


def _wsum_ref(logits, v):
    p = np.exp(np.asarray(logits, np.float64) - np.asarray(logits, np.float64).max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    vv = np.where(np.isfinite(v), np.asarray(v, np.float64), 0.0)
    return p @ vv


def _wsum_torch(logits, v, guard=True):
    p = torch.softmax(logits, -1)
    return p @ torch.where(p[0:1].T > 0, v, 0.0) if guard else p @ v


def _wsum_jax(logits, v):
    p = jax.nn.softmax(logits, -1)
    return p @ jnp.where(p[0:1].T > 0, v, 0.0)


def _centred_inputs():
    return {"x": (1000 + RNG.standard_normal((16, 128))).astype(np.float32)}


def _lse_diff_inputs():
    a = (RNG.standard_normal((32, 64)) * 4).astype(np.float32)
    b = (a + RNG.standard_normal((32, 64)).astype(np.float32) * 1e-3).astype(np.float32)
    return {"a": a, "b": b}


def _var_inputs():
    return {"x": (3 + RNG.standard_normal((16, 256))).astype(np.float32)}


# name: (torch_fn, jax_fn, inputs, reference, outputs, ragged, the verdict)
FAITHFUL = {
    "log_softmax at a dominant logit": (
        lambda x: torch.nn.functional.log_softmax(x, -1), lambda x: jax.nn.log_softmax(x, -1), _dominant_logits,
        _log_softmax_ref, {"out": ("row", "col")}, None),
    "log-sum-exp-normalised differences": (
        lambda a, b: torch.logsumexp(a, -1) - torch.logsumexp(b, -1),
        lambda a, b: jax.nn.logsumexp(a, -1) - jax.nn.logsumexp(b, -1), _lse_diff_inputs,
        lambda a, b: _lse64(a) - _lse64(b), {"out": ("row",)}, None),
    "mean-centred values": (
        lambda x: x - x.mean(-1, keepdim=True), lambda x: x - jnp.mean(x, -1, keepdims=True), _centred_inputs,
        lambda x: np.asarray(x, np.float64) - np.asarray(x, np.float64).mean(-1, keepdims=True),
        {"out": ("row", "col")}, None),
    "two-pass vs one-pass variance": (
        lambda x: torch.var(x, -1, unbiased=False),
        lambda x: jnp.mean(x * x, -1) - jnp.mean(x, -1) ** 2, _var_inputs,
        lambda x: np.asarray(x, np.float64).var(-1), {"out": ("row",)}, None),
    "ragged log-sum-exp": (_ragged_torch, _ragged_jax, _ragged_inputs, _ragged_ref, {"out": ("req", "head")}, None),
    "rmsnorm": (_rmsnorm_torch, _rmsnorm_jax, _rmsnorm_inputs, _rmsnorm_ref, {"out": ("row", "dim")}, None),
    "softmax-weighted sum with masked keys": (
        _wsum_torch, _wsum_jax, _wsum_inputs, _wsum_ref, {"out": ("row", "dim")}, None),
}

PLANTED = {
    "a dropped token": (lambda x, qsl: _ragged_torch(x, qsl, drop=1), _ragged_jax, _ragged_inputs, _ragged_ref),
    "a duplicated token": (lambda x, qsl: _ragged_torch(x, qsl, dup=True), _ragged_jax, _ragged_inputs,
                           _ragged_ref),
    "an off-by-one ragged boundary": (lambda x, qsl: _ragged_torch(x, qsl, shift=1), _ragged_jax,
                                      _ragged_inputs, _ragged_ref),
    "a wrong base": (lambda x, qsl: _ragged_torch(x, qsl, base2=True), _ragged_jax, _ragged_inputs, _ragged_ref),
    "a missing max-shift that overflows": (lambda x, qsl: _ragged_torch(x, qsl, no_max=True), _ragged_jax,
                                           lambda: {"x": _ragged_inputs()["x"] + np.float32(90), "qsl": QSL},
                                           _ragged_ref),
    "a wrong epsilon": (lambda x: _rmsnorm_torch(x, eps=1e-5), _rmsnorm_jax, _rmsnorm_inputs, _rmsnorm_ref),
    "a NaN through a zero weight": (lambda logits, v: _wsum_torch(logits, v, guard=False), _wsum_jax,
                                    _wsum_inputs, _wsum_ref),
    "a side that loses digits (bf16 inside)": (
        lambda x: torch.nn.functional.log_softmax(x.bfloat16(), -1).float(), lambda x: jax.nn.log_softmax(x, -1),
        _dominant_logits, _log_softmax_ref),
}


def _check(torch_fn, jax_fn, make, reference, outputs=None, **kw):
    return parity.cross_check(torch_fn, jax_fn, make(), reference=reference, outputs=outputs or ["out"],
                              bitwise=False, device="cpu", **kw)


@pytest.mark.parametrize("name", list(FAITHFUL))
def test_a_faithful_pair_passes_with_the_defaults(name):
    torch_fn, jax_fn, make, reference, outputs, _ = FAITHFUL[name]
    report = _check(torch_fn, jax_fn, make, reference, outputs)
    assert report.ok, report


@pytest.mark.parametrize("name", list(PLANTED))
def test_a_planted_divergence_fails_on_its_side_only(name):
    torch_fn, jax_fn, make, reference = PLANTED[name]
    report = _check(torch_fn, jax_fn, make, reference)
    assert not report.ok
    assert not report["out"]["torch_vs_reference"].ok, report
    assert report["out"]["jax_vs_reference"].ok, report


def test_the_log_softmax_example_passed_only_with_the_baseline():
    """docs/parity-library.md's numbers: the error model alone fails 48 of 3,552 elements of both faithful sides
    (torch and jax return 0.0 where the float64 reference says about -1e-10); the baseline passes them."""
    from parity.library import errormodel

    torch_fn, jax_fn, make, reference, outputs, _ = FAITHFUL["log_softmax at a dominant logit"]
    report = _check(torch_fn, jax_fn, make, reference, outputs)
    audit = report.audit["out"]
    assert report.ok and audit.lowp == errormodel.LOWP_DERIVED and audit.upcasts == "the reference"
    x = make()["x"]
    native, ref64, eps, _ = errormodel.evaluate(lambda a: reference(**a), {"x": x}, lambda r: {"out": r})
    want, model, _, _ = errormodel.audit_and_bound(native["out"], ref64["out"], eps["out"], "float32")
    got = torch_fn(torch.from_numpy(x)).numpy().astype(np.float64)
    counts = errormodel.deciding_bound(got, want, model, model)
    assert counts[errormodel.BOUND_MODEL] == 48 and x.size == 3552


def test_a_low_precision_reference_sets_the_baseline_and_an_upcasting_one_is_flagged():
    torch_fn, jax_fn, make, reference, outputs, _ = FAITHFUL["log_softmax at a dominant logit"]

    def lowp(x):  # the same computation in f32 numpy
        m = x.max(-1, keepdims=True)
        return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))

    measured = _check(torch_fn, jax_fn, make, reference, outputs, reference_lowp=lowp)
    assert measured.ok and measured.audit["out"].lowp == "reference_lowp" and not measured.audit["out"].upcasts
    upcast = _check(torch_fn, jax_fn, make, reference, outputs, reference_lowp=reference)
    assert upcast.ok and upcast.audit["out"].upcasts == "reference_lowp"
    assert "reference_lowp upcasts" in str(upcast)


def test_the_report_names_the_bound_that_decided_each_failing_element():
    torch_fn, jax_fn, make, reference = PLANTED["a side that loses digits (bf16 inside)"]
    report = _check(torch_fn, jax_fn, make, reference)
    decided = report.audit["out"].decided
    assert set(decided) == {"torch_fn"} and sum(decided["torch_fn"].values()) > 0
    assert "torch_fn fails" in str(report) and "bound" in str(report)


def test_reference_lowp_needs_a_reference():
    with pytest.raises(ValueError, match="reference_lowp needs a reference"):
        parity.cross_check(lambda x: x, lambda x: x, {"x": np.ones(4, np.float32)}, reference_lowp=lambda x: x)
