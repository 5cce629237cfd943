"""The default error model of `parity.cross_check` (parity/library/errormodel.py) on pairs written for it: the ragged
log-sum-exp and the softmax-weighted sum of parity/examples/ (Triton and Pallas), and torch-vs-jnp merges of two
attention states. Faithful pairs pass with the defaults where a fixed relative tolerance raises false alarms
(log-domain outputs near 0, cancellation, bf16 under Triton's truncating interpreter); wrong kernels (a dropped
token, the wrong base, a NaN leaking through a zero weight) fail; a planted reordered sum or FMA is within the
bound and found, located, by the bit comparison. Also the reference audit and special values."""

from __future__ import annotations

import functools
import itertools
import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import parity
from parity.examples import lse_pallas, lse_reference, lse_triton, wsum_pallas, wsum_reference, wsum_triton
from parity.library import bridge, errormodel

GPU = torch.cuda.is_available()
LSE_OUT = {"lse": ("req", "head")}
WSUM_OUT = {"out": ("row", "dim")}


def _lse(torch_fn=lse_triton.ragged_lse, jax_fn=lse_pallas.ragged_lse, **kw):
    return functools.partial(parity.cross_check, torch_fn, jax_fn, reference=lse_reference.ragged_lse,
                             outputs=LSE_OUT, **kw)


def _wsum(torch_fn=wsum_triton.softmax_wsum, jax_fn=wsum_pallas.softmax_wsum, **kw):
    return functools.partial(parity.cross_check, torch_fn, jax_fn, reference=wsum_reference.softmax_wsum,
                             outputs=WSUM_OUT, **kw)


def _on_jax(fn):
    """A torch-side kernel run as the "jax" side (its jax inputs handed back to torch): under the CPU
    interpreters the two frameworks do not share float math, so a planted divergence is pitted against the
    faithful kernel of its own framework."""
    def run(*args, **kw):
        to = lambda x: bridge.jax_to_torch(x) if bridge._is_jax_array(x) else x  # noqa: E731
        return fn(*map(to, args), **{k: to(v) for k, v in kw.items()})
    return run


def _on_torch(fn):
    def run(*args, **kw):
        to = lambda x: bridge.torch_to_jax(x) if isinstance(x, torch.Tensor) else x  # noqa: E731
        return fn(*map(to, args), **{k: to(v) for k, v in kw.items()})
    return run


# ---------------------------------------------------------------------------------------------------------
# Ragged log-sum-exp: log-domain outputs near 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lse_faithful_pair_passes_with_defaults_where_a_relative_tolerance_fails(dtype):
    inputs = lse_reference.make_inputs(seed=1, dtype=dtype)
    want = lse_reference.ragged_lse(inputs["x"], inputs["query_start_loc"])
    assert np.sum(np.abs(want) < 3e-3) >= 6 and np.isneginf(want[1]).all()  # near 0; the empty request
    report = _lse(bitwise=GPU)(inputs)
    assert report.ok, report
    assert not report.audit["lse"].imprecise and report.audit["lse"].eps_ulp > 100  # near 0: many ulps
    fixed = _lse(bitwise=GPU, tolerance="float32")(inputs)  # |got-want| <= ~17 ulp of |want|: the false alarm
    assert not fixed.ok and not fixed["lse"]["jax_vs_reference"].ok


@pytest.mark.parametrize("bug, located", [("off_by_one", r"(worst: )?req [02345] head \d"),
                                          ("base2", r"(worst: )?req [0-5] head \d")])
def test_lse_wrong_kernels_fail_with_defaults(bug, located):
    inputs = lse_reference.make_inputs(seed=1, dtype="float32")
    report = _lse(functools.partial(lse_triton.ragged_lse, **{bug: True}), bitwise=GPU)(inputs)
    assert not report.ok and report["lse"]["jax_vs_reference"].ok
    shown = report.mismatches("lse", "torch_vs_reference")
    assert shown and all(re.match(located, m) for m in shown), shown


def test_lse_reordered_sum_is_within_the_bound_and_found_by_the_bits():
    """`reverse` sums each request's tokens last to first: a few roundings apart, within the reference bound,
    found and located by the bit comparison (only requests of 3 or more tokens can differ)."""
    inputs = lse_reference.make_inputs(seed=1, dtype="float32")
    long_reqs = {r for r, n in enumerate(np.diff(inputs["query_start_loc"])) if n >= 3}
    pairs = [(functools.partial(lse_triton.ragged_lse, reverse=True), _on_jax(lse_triton.ragged_lse)),
             (_on_torch(functools.partial(lse_pallas.ragged_lse, reverse=True)), lse_pallas.ragged_lse)]
    if GPU:
        pairs.append((functools.partial(lse_triton.ragged_lse, reverse=True), lse_pallas.ragged_lse))
    for torch_fn, jax_fn in pairs:
        report = _lse(torch_fn, jax_fn)(inputs)
        assert not report.ok
        assert report["lse"]["torch_vs_reference"].ok and report["lse"]["jax_vs_reference"].ok
        assert report.n_diff("lse") > 0
        reqs = {int(re.match(r"(?:worst: )?req (\d+) head", m).group(1)) for m in report.mismatches("lse")}
        assert reqs <= long_reqs, (reqs, long_reqs)


# ---------------------------------------------------------------------------------------------------------
# Softmax-weighted sum: cancellation, zero weights


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_wsum_faithful_pair_passes_with_defaults_where_a_relative_tolerance_fails(dtype):
    """Half the columns cancel to near 0; bf16 under Triton's interpreter is truncated, not rounded."""
    inputs = wsum_reference.make_inputs(seed=2, dtype=dtype)
    report = _wsum(bitwise=GPU)(inputs)
    assert report.ok, report
    fixed = _wsum(bitwise=GPU, tolerance=dtype)(inputs)
    assert not fixed.ok, fixed


def test_wsum_nan_leak_through_a_zero_weight_fails_and_the_faithful_pair_does_not():
    inputs = wsum_reference.make_inputs(seed=2, dtype="float32", poison=True)  # NaN behind every zero weight
    assert _wsum(bitwise=GPU)(inputs).ok
    report = _wsum(functools.partial(wsum_triton.softmax_wsum, nan_leak=True), bitwise=GPU)(inputs)
    rep = report["out"]["torch_vs_reference"]
    assert not report.ok and rep.n_class_mismatch > 0 and report["out"]["jax_vs_reference"].ok
    assert "classes nan vs finite" in rep.first_mismatches[0] and rep.first_mismatches[0].startswith("row ")


def test_wsum_reordered_sum_is_within_the_bound_and_found_by_the_bits():
    inputs = wsum_reference.make_inputs(seed=2, dtype="float32")
    pairs = [(functools.partial(wsum_triton.softmax_wsum, reverse=True), _on_jax(wsum_triton.softmax_wsum)),
             (_on_torch(functools.partial(wsum_pallas.softmax_wsum, reverse=True)), wsum_pallas.softmax_wsum)]
    for torch_fn, jax_fn in pairs:
        report = _wsum(torch_fn, jax_fn)(inputs)
        assert not report.ok and report["out"]["torch_vs_reference"].ok and report["out"]["jax_vs_reference"].ok
        assert report.n_diff("out") > 0
        assert all(re.match(r"(worst: )?row (1?\d) dim \d+: got 0x", m) for m in report.mismatches("out"))


# ---------------------------------------------------------------------------------------------------------
# Special values


def test_special_values_agree_on_faithful_pairs_and_catch_a_leak():
    lse_in = lse_reference.make_inputs(seed=1, dtype="float32")
    report = _lse(bitwise=GPU, special_values=2)(lse_in)
    assert report.ok, report
    assert len(report.special) == 10 and all(re.match(r"x\[\d+, \d+\] = ", p) for p in report.special)
    assert report["lse"]["special_torch_vs_jax"].kind == "classes"
    wsum_in = wsum_reference.make_inputs(seed=2, dtype="float32")
    assert _wsum(bitwise=GPU, special_values=4)(wsum_in).ok
    leak = _wsum(functools.partial(wsum_triton.softmax_wsum, nan_leak=True), bitwise=GPU, special_values=4)(wsum_in)
    assert leak["out"]["torch_vs_reference"].ok  # no NaN behind a zero weight in the inputs as given
    assert not leak.ok and not leak["out"]["special_torch_vs_jax"].ok
    assert "classes nan vs finite" in leak["out"]["special_torch_vs_jax"].first_mismatches[0]
    assert "special values planted at: scores[" in str(leak)


# ---------------------------------------------------------------------------------------------------------
# Merges of two attention states, torch against jnp (vLLM-style natural base, FlashInfer-style base 2)


def _merge_inputs(seed, dtype, T=29, H=4, D=16):
    rng = np.random.default_rng(seed)
    dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    a, b = ((rng.standard_normal((T, H, D)) * 3).astype(dt) for _ in range(2))
    la = (rng.standard_normal((H, T)) * 2).astype(np.float32)
    lb = (la + rng.standard_normal((H, T)) * 0.3).astype(np.float32)
    la[0, :5] = np.inf  # vLLM: an +inf LSE is an empty partial
    lb[1, 3:8] = -np.inf
    la[2, 7:9] = lb[2, 7:9] = -np.inf  # padding rows: both empty
    la[3] = -0.69  # merged LSE near 0
    lb[3] = -0.7
    return dict(a=a, b=b, la=la, lb=lb)


def _merge_ref(a, b, la, lb):
    a, b, la, lb = (np.asarray(x, np.float64) for x in (a, b, la, lb))
    la, lb = np.where(la == np.inf, -np.inf, la), np.where(lb == np.inf, -np.inf, lb)
    m = np.maximum(la, lb)
    m = np.where(np.isinf(m), 0.0, m)
    ea, eb = np.exp(la - m), np.exp(lb - m)
    s = ea + eb
    sd = np.where(s > 0, s, 1.0)
    wa, wb = np.where(s > 0, ea / sd, 0.0), np.where(s > 0, eb / sd, 0.0)
    return a * wa.T[:, :, None] + b * wb.T[:, :, None], np.where(s > 0, m + np.log(sd), -np.inf)


def _merge(X, *, base2=False, truncate=False, bug=None):
    L2E = 1.4426950408889634

    def f(a, b, la, lb):
        inf = float("inf")
        la, lb = X.where(la == inf, -inf, la), X.where(lb == inf, -inf, lb)
        m = X.maximum(la, lb)
        m = X.where(X.isinf(m), 0.0, m)
        if base2:
            ea, eb = X.exp2((la - m) * L2E), X.exp2((lb - m) * L2E)
        else:
            ea, eb = X.exp(la - m), X.exp(lb - m)
        s = ea + eb
        sd = X.where(s > 0, s, 1.0)
        wa, wb = X.where(s > 0, ea / sd, 0.0), X.where(s > 0, eb / sd, 0.0)
        if bug == "nan_leak":
            wa = ea / s
        f32 = (lambda x: x.float()) if X is torch else (lambda x: x.astype(jnp.float32))
        out = f32(a) * wa.T[:, :, None] + f32(b) * wb.T[:, :, None]
        if bug == "off_by_one":
            out = X.concatenate([out[:1] * 0, out[1:]]) if X is jnp else torch.cat([out[:1] * 0, out[1:]])
        log = X.log2 if bug == "base" else X.log
        lse = X.where(s > 0, (m * L2E + X.log2(sd)) / L2E if base2 else m + log(sd), -inf)
        if X is torch and truncate and a.dtype == torch.bfloat16:  # the Triton interpreter's f32 -> bf16
            return (out.contiguous().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16), lse
        return (out.to(a.dtype) if X is torch else out.astype(a.dtype)), lse
    return f


MERGE_OUT = {"out": ("token", "head", "dim"), "lse": ("head", "token")}


@pytest.mark.parametrize("dtype, base2", list(itertools.product(["float32", "bfloat16", "float16"], [False, True])))
def test_merge_pairs_pass_with_defaults(dtype, base2):
    for seed in (0, 1):
        inputs = _merge_inputs(seed, dtype)
        report = parity.cross_check(_merge(torch, base2=base2, truncate=True), _merge(jnp, base2=base2), inputs,
                                    reference=_merge_ref, outputs=MERGE_OUT, bitwise=False)
        assert report.ok, report


@pytest.mark.parametrize("bug", ["nan_leak", "off_by_one", "base"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_wrong_merges_fail_with_defaults(bug, dtype):
    report = parity.cross_check(_merge(torch, bug=bug), _merge(jnp), _merge_inputs(0, dtype), reference=_merge_ref,
                                outputs=MERGE_OUT, bitwise=False)
    assert not report.ok
    assert all(report[k]["jax_vs_reference"].ok for k in MERGE_OUT)


# ---------------------------------------------------------------------------------------------------------
# The reference audit


def test_an_imprecise_reference_is_flagged_instead_of_failing_the_kernels():
    x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((256,)).astype(np.float32)

    def ref_f64(x, w):
        return np.asarray(x, np.float64) @ np.asarray(w, np.float64)

    def ref_as_given(x, w):  # numpy arithmetic in the inputs' dtype: bf16 here
        return x @ w

    def kernel(x, w):
        return (x.float() @ w.float()).to(x.dtype) if isinstance(x, torch.Tensor) else (
            (x.astype(jnp.float32) @ w.astype(jnp.float32)).astype(x.dtype))

    xb, wb = x.astype(ml_dtypes.bfloat16), w.astype(ml_dtypes.bfloat16)
    cpu = dict(device="cpu", bitwise=False)  # f32 matmuls: on a GPU XLA may take TF32
    good = parity.cross_check(kernel, kernel, {"x": xb, "w": wb}, reference=ref_f64, outputs=["y"], **cpu)
    assert good.ok and not good.audit["y"].imprecise, good
    flagged = parity.cross_check(kernel, kernel, {"x": xb, "w": wb}, reference=ref_as_given, outputs=["y"], **cpu)
    assert flagged.ok and flagged.audit["y"].imprecise, flagged
    assert "differs from its result on float64 copies" in flagged.audit["y"].why
    assert "IMPRECISE REFERENCE" in str(flagged)


def test_a_wrong_reference_still_fails_and_is_suspected():
    x = np.linspace(1, 2, 16, dtype=np.float32)
    report = parity.cross_check(lambda x: x * 3, lambda x: x * 3, {"x": x}, reference=lambda x: x * 3.0 + 1e-4)
    assert not report.ok and report.audit["out"].sides_agree_better
    assert "suspect the reference" in str(report)


def test_the_bound_scales_with_what_feeds_each_element():
    """A cancelling sum: eps (the reference's move under one f32 rounding of its inputs) follows the terms, not
    the result, so the bound of a result near 0 is hundreds of its own ulps."""
    a, b = np.array([1001.0, 1.0], np.float32), np.array([-1000.0, 0.5], np.float32)
    native, ref64, eps, _ = errormodel.evaluate(lambda args: np.float64(args["a"]) + args["b"], {"a": a, "b": b},
                                                lambda r: {"out": r})
    want, bound, _, audit = errormodel.audit_and_bound(native["out"], ref64["out"], eps["out"], "float32")
    assert list(want) == [1.0, 1.5] and eps["out"][0] >= 1000 * 2.0**-24
    assert bound[0] >= 16 * 1000 * 2.0**-24 and not audit.imprecise


# ---------------------------------------------------------------------------------------------------------
# On the GPU: the Triton and Pallas sides agree bit for bit; a planted FMA or reordered sum is found


LSE_GPU = dict(query_lens=(70, 0, 333, 1, 190, 64), padding=21, H=8)
WSUM_GPU = dict(T=203, N=40, D=128)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_lse_pair_is_bit_identical_on_gpu(dtype):
    report = _lse(bitwise=True, device="cuda")(lse_reference.make_inputs(seed=3, dtype=dtype, **LSE_GPU))
    assert report.ok, report
    assert report.n_diff("lse") == 0 and report.device.startswith("cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_wsum_pair_is_bit_identical_on_gpu(dtype):
    report = _wsum(bitwise=True, device="cuda")(wsum_reference.make_inputs(seed=3, dtype=dtype, **WSUM_GPU))
    assert report.ok, report
    assert report.n_diff("out") == 0 and report.device.startswith("cuda")


@pytest.mark.gpu
def test_special_values_agree_on_gpu():
    assert _lse(device="cuda", special_values=3)(lse_reference.make_inputs(seed=3, **LSE_GPU)).ok
    assert _wsum(device="cuda", special_values=3)(wsum_reference.make_inputs(seed=3, **WSUM_GPU)).ok


@pytest.mark.gpu
@pytest.mark.parametrize("planted", [dict(fma=True), dict(reverse=True)])
def test_wsum_planted_divergence_is_found_on_gpu(planted):
    inputs = wsum_reference.make_inputs(seed=3, dtype="float32", **WSUM_GPU)
    report = _wsum(functools.partial(wsum_triton.softmax_wsum, **planted), device="cuda")(inputs)
    assert not report.ok and report["out"]["torch_vs_reference"].ok and report["out"]["jax_vs_reference"].ok
    assert report.n_diff("out") > 0
    assert all(re.match(r"(worst: )?row \d+ dim \d+: got 0x", m) for m in report.mismatches("out"))


@pytest.mark.gpu
def test_lse_planted_reordered_sum_is_found_on_gpu():
    inputs = lse_reference.make_inputs(seed=3, dtype="float32", **LSE_GPU)
    report = _lse(functools.partial(lse_triton.ragged_lse, reverse=True), device="cuda")(inputs)
    assert not report.ok and report["lse"]["torch_vs_reference"].ok and report.n_diff("lse") > 0
    assert all(re.match(r"(worst: )?req [0245] head \d: got 0x", m) for m in report.mismatches("lse"))
