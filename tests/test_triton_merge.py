"""triton_impl.merge_attn_states against parity.harness.reference (docs/spec.md 4).

Exact bits where the result is exact (pass-through copies, rows with one or both sides empty, -inf LSEs);
elsewhere within `parity.library.compare.TOLERANCES` of the float64 reference, with the magnitude of the merge's
terms (`merge_out_magnitude`). Runs in the process's Triton mode (conftest): the interpreter on CPU,
compiled on a GPU.
"""

import dataclasses
import math

import numpy as np
import pytest
from triton_keys import Recorder, assert_one_variant, kernel_params, lse_strides, variants
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import triton_impl
from parity.harness import expected
from parity.library import bridge, compare
from parity.harness import cases, reference
from parity.library.compare import assert_bitwise_equal, assert_matches_reference
from mla_lse_common import constants
from triton_impl import _backend as triton_backend
from triton_impl import _plans as triton_plans
from triton_impl import merge as merge_mod

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
OUT_PAD = 8  # extra NaN columns in every output buffer: the kernel must not write them
HEAD_SIZES = [64, 80, 96, 128, 192, 256, 512]
# Each dtype with its tolerance entry.
DTYPES = [pytest.param(name, compare.TOLERANCES[name], id=name) for name in TORCH_DTYPES]
_DEFAULT = object()


def _tiny_lens(seed: int, num_requests: int, max_len: int = 3) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    return tuple(int(x) for x in rng.integers(0, max_len + 1, size=num_requests))


def _default_ptwc(case):
    """The case's own prefill_tokens_with_context, else 3/4 of the real tokens merge and the rest (and the
    padding) pass through."""
    if case.prefill_tokens_with_context is not None:
        return case.prefill_tokens_with_context
    n_real = sum(case.query_lens)
    return n_real - n_real // 4


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({4: torch.int32, 2: torch.int16, 1: torch.int8}[x.element_size()])


# --------------------------------------------------------------------------------------------------------
# Expected values


def _expected(a, p, b, s, *, ptwc, scale, fused_kw, lse_layout, lse_base):
    """Reference (out, lse), the tolerance magnitude, and the masks of the elements that are exact.

    Exact: pass-through rows (bit copies, unless the output is fp8); rows where the reference gives one
    side weight exactly 0 (the other side exactly, or 0 when both are empty); the LSE of pass-through
    rows, of both-empty rows (-inf) and, in base e, of one-empty rows (log(1) + m == m).
    """
    kw = dict(lse_layout=lse_layout, lse_base=lse_base, **fused_kw)
    want_out, want_lse = reference.merge_attn_states(a, p, b, s, prefill_tokens_with_context=ptwc,
                                                     output_scale=scale, **kw)
    mag = expected.merge_out_magnitude(a, p, b, s, prefill_tokens_with_context=ptwc, output_scale=scale, **kw)
    T, H = a.shape[:2]
    ones, zeros = np.ones((T, H, 1)), np.zeros((T, H, 1))
    wp = reference.merge_attn_states(ones, p, zeros, s, **kw)[0][..., 0]  # f64[T, H]
    ws = reference.merge_attn_states(zeros, p, ones, s, **kw)[0][..., 0]
    copied = (np.arange(T) >= (T if ptwc is None else ptwc))[:, None]
    both_empty = (wp == 0) & (ws == 0) & ~copied
    one_side = ((wp == 0) | (ws == 0)) & ~copied
    exact_th = both_empty if scale is not None else (one_side | copied)
    exact_out = np.broadcast_to(exact_th[..., None], want_out.shape)
    exact_lse = copied | both_empty | (one_side if lse_base != 2 else False)
    exact_lse = exact_lse.T if lse_layout == "HT" else exact_lse
    return want_out, want_lse, mag, exact_out, exact_lse


def _check(out, out_lse, a, p, b, s, *, ptwc=None, scale=None, fused_kw=None, lse_layout="HT",
           lse_base=math.e, case=None, query_start_loc=None, tol=None):
    want_out, want_lse, mag, exact_out, exact_lse = _expected(
        a, p, b, s, ptwc=ptwc, scale=scale, fused_kw=fused_kw or {}, lse_layout=lse_layout, lse_base=lse_base)
    assert_matches_reference(out, want_out, case=case, exact=exact_out, mag=mag, name="merge.out",
                             query_start_loc=query_start_loc, tol=tol)
    if out_lse is not None:
        assert_matches_reference(out_lse, want_lse, case=case, exact=exact_lse, name="merge.lse",
                                 layout=lse_layout, query_start_loc=query_start_loc)


def _merge_case(case, *, seed=0, ptwc=_DEFAULT, fused=True, output_lse=True, check=True, tol=None):
    """Runs the Triton merge on a case with every option it names (layout, base, fp8 and scale, the
    padded-V views `[..., :D]` of its buffers) plus the fused mask and output_lse, into NaN-filled padded
    output buffers; checks against the reference. Returns (out_buf [T, H, D + OUT_PAD], out_lse, inputs)."""
    inp = cases.make_inputs(case, seed)
    T, H, D = case.num_tokens, case.num_heads, case.head_dim
    if ptwc is _DEFAULT:
        ptwc = _default_ptwc(case)
    t = {k: bridge.to_torch(v, DEVICE) for k, v in inp.items()}
    out_dtype = FP8 if case.out_dtype else t["prefix_output"].dtype
    out_buf = torch.full((T, H, D + OUT_PAD), float("nan"), device=DEVICE).to(out_dtype)
    pad_before = out_buf[..., D:].clone()
    out_lse = torch.full_like(t["prefix_lse"], float("nan")) if output_lse else None
    fused_kw = dict(query_start_loc=inp["query_start_loc"], prefix_cu_seq_lens=inp["cu_seq_lens"]) if fused else {}
    triton_impl.merge_attn_states(
        out_buf[..., :D], t["prefix_output"][..., :D], t["prefix_lse"], t["suffix_output"][..., :D],
        t["suffix_lse"], out_lse, ptwc, t.get("output_scale"),
        **{k: bridge.to_torch(v, DEVICE) for k, v in fused_kw.items()},
        lse_layout=case.lse_layout, lse_base=case.lse_base)
    if check:
        _check(out_buf[..., :D], out_lse, inp["prefix_output"][..., :D], inp["prefix_lse"],
               inp["suffix_output"][..., :D], inp["suffix_lse"], ptwc=ptwc, scale=inp.get("output_scale"),
               fused_kw=fused_kw, lse_layout=case.lse_layout, lse_base=case.lse_base, case=case, tol=tol)
        # The padding columns of the output buffer keep their NaN bits.
        assert torch.equal(_bits(out_buf[..., D:]), _bits(pad_before)), "the kernel wrote past D"
        if fused:  # docs/spec.md 4.3: NaN garbage of empty partials never reaches a merged real token
            merged = min(T if ptwc is None else ptwc, sum(case.query_lens))
            assert not bool(torch.isnan(out_buf[:merged, :, :D].float()).any())
    return out_buf, out_lse, inp


# --------------------------------------------------------------------------------------------------------
# Workloads


@pytest.mark.parametrize("case", cases.select("ci"), ids=lambda c: c.name)
def test_ci_cases_full_options(case):
    _merge_case(case)


@pytest.mark.parametrize("head_dim", HEAD_SIZES)
def test_head_sizes(head_dim):
    case = cases.Case(f"d{head_dim}", (5, 0, 11, 7), (0,), num_heads=3, head_dim=head_dim, specials=True,
                      padding=2)
    _merge_case(case, ptwc=None)


@pytest.mark.parametrize("dtype,tol", DTYPES)
def test_dtypes(dtype, tol):
    case = cases.Case(f"dtype_{dtype}", (9, 20, 4), (1,), num_heads=5, head_dim=80, dtype=dtype,
                      lse_layout="TH", specials=True, padding=3)
    out_buf, _, _ = _merge_case(case, ptwc=30, tol=tol)
    assert out_buf.dtype == TORCH_DTYPES[dtype]


@pytest.mark.parametrize("ptwc", [0, 1, 17, 33, 36], ids=lambda n: f"ptwc{n}")
def test_prefill_tokens_with_context(ptwc):
    # 0: every row passes through; 33 = qsl[R]: only the padding does; 36 = T: none does.
    case = cases.Case("ptwc", (16, 0, 17), (0,), num_heads=2, head_dim=16, dtype="float16", specials=True,
                      padding=3)
    _merge_case(case, ptwc=ptwc)


def test_fused_mask_r1100():
    # R = 1100 requests of 0-3 tokens: the fused mask's request count crosses a 1024-request coarse step.
    lens = _tiny_lens(41, 1100)
    case = cases.Case("r1100_tiny", lens, tuple(range(1, 1100, 2)), num_heads=1, head_dim=16, dtype="float32",
                      padding=5)
    _merge_case(case)


def test_without_fused_mask():
    # Without the fused mask an empty request's finite garbage LSE is merged as real data, like the reference.
    _merge_case(cases.by_name("d192_fp16"), fused=False)


def test_output_lse_none():
    case = cases.by_name("d256_bf16_th")
    with_lse, _, _ = _merge_case(case, check=False)
    without, none_lse, _ = _merge_case(case, output_lse=False)
    assert none_lse is None
    assert_bitwise_equal(without, with_lse, name="merge.out (output_lse=None)")


# --------------------------------------------------------------------------------------------------------
# Layouts and strides


@pytest.mark.parametrize("stored", ["TH", "HT"])
def test_lse_buffers_via_transposed_views(stored):
    # LSE buffers stored in one layout and passed through .t() under the other layout's name (the kernel of that
    # name, with its specialisation: docs/design.md "Runtime values") must give the same bits as the buffers
    # themselves under their own layout, output LSE included.
    case = cases.Case("transposed_lse", (12, 0, 30, 5), (0, 1), num_heads=5, head_dim=64, dtype="float32",
                      lse_layout=stored, specials=True, padding=4)
    inp = cases.make_inputs(case)
    t = {k: bridge.to_torch(v, DEVICE) for k, v in inp.items()}
    T, H, D = case.num_tokens, case.num_heads, case.head_dim
    fused = dict(query_start_loc=t["query_start_loc"], prefix_cu_seq_lens=t["cu_seq_lens"])
    results = {}
    for layout in ("HT", "TH"):
        out = torch.full((T, H, D), float("nan"), device=DEVICE)
        out_lse = torch.full((H, T) if stored == "HT" else (T, H), float("nan"), device=DEVICE)  # stored in both runs
        view = (lambda x: x) if layout == stored else (lambda x: x.t())
        triton_impl.merge_attn_states(out, t["prefix_output"], view(t["prefix_lse"]), t["suffix_output"],
                                      view(t["suffix_lse"]), view(out_lse), 30, lse_layout=layout, **fused)
        results[layout] = out, out_lse
    given = "TH" if stored == "HT" else "HT"
    assert_bitwise_equal(results[given][0], results[stored][0], name=f"merge.out {given}-view vs {stored}")
    assert_bitwise_equal(results[given][1], results[stored][1], name=f"merge.lse {given}-view vs {stored}",
                         layout=stored)
    _check(*results[stored], inp["prefix_output"], inp["prefix_lse"], inp["suffix_output"], inp["suffix_lse"],
           ptwc=30, fused_kw=dict(query_start_loc=inp["query_start_loc"], prefix_cu_seq_lens=inp["cu_seq_lens"]),
           lse_layout=stored, case=case)


def _in_slack(x: torch.Tensor) -> torch.Tensor:
    """A copy of `x` with the same strides at the start of a NaN allocation 4x its span: a kernel that
    reads or writes it with another tensor's strides stays inside the allocation (the comparison fails)
    instead of corrupting the heap."""
    span = 1 + sum((n - 1) * st for n, st in zip(x.shape, x.stride()))
    storage = torch.full((4 * span + 4096,), float("nan"), dtype=x.dtype, device=x.device)
    y = storage.as_strided(x.shape, x.stride())
    y.copy_(x)
    return y


_T, _H, _D = 37, 3, 64


def _padded_thd(x):  # [T, H, D] view of a [T, H, 96] buffer
    buf = torch.full((_T, _H, 96), float("nan"), dtype=x.dtype, device=x.device)
    buf[..., :_D] = x
    return buf[..., :_D]


def _permuted_thd(x):  # [T, H, D] view of an [H, T, D] buffer
    return x.permute(1, 0, 2).contiguous().permute(1, 0, 2)


def _window_ht(x):  # [H, T] window of an [H + 2, T + 9] buffer
    buf = torch.full((_H + 2, _T + 9), float("nan"), dtype=x.dtype, device=x.device)
    buf[2:, 9:] = x
    return buf[2:, 9:]


def _transposed_ht(x):  # [H, T] view (.t()) of a [T, H] buffer
    return x.t().contiguous().t()


def _stepped_ht(x):  # every other column of an [H, 2T] buffer
    buf = torch.full((_H, 2 * _T), float("nan"), dtype=x.dtype, device=x.device)
    buf[:, ::2] = x
    return buf[:, ::2]


# (which tensor, how it is laid out): one tensor at a time differs from the contiguous layout, so a kernel
# that borrows another tensor's strides fails on the variant that names the culprit.
OWN_STRIDES = [("output", _padded_thd), ("output", _permuted_thd), ("prefix_output", _padded_thd),
               ("prefix_output", _permuted_thd), ("suffix_output", _padded_thd), ("suffix_output", _permuted_thd),
               ("prefix_lse", _window_ht), ("prefix_lse", _transposed_ht), ("suffix_lse", _window_ht),
               ("suffix_lse", _transposed_ht), ("output_lse", _stepped_ht), ("output_lse", _transposed_ht)]


@pytest.mark.parametrize("name,layout", OWN_STRIDES, ids=[f"{n}-{f.__name__[1:]}" for n, f in OWN_STRIDES])
def test_every_tensor_has_its_own_strides(name, layout):
    rng = np.random.default_rng(5)
    a = rng.standard_normal((_T, _H, _D)).astype(np.float32)
    b = rng.standard_normal((_T, _H, _D)).astype(np.float32)
    p = rng.normal(2.0, 3.0, (_H, _T)).astype(np.float32)
    s = rng.normal(2.0, 3.0, (_H, _T)).astype(np.float32)
    p[:, :5] = -np.inf  # a few empty prefix rows: exact copies of the suffix
    t = dict(prefix_output=a, prefix_lse=p, suffix_output=b, suffix_lse=s,
             output=np.full_like(a, np.nan), output_lse=np.full_like(p, np.nan))
    t = {k: bridge.to_torch(v, DEVICE) for k, v in t.items()}
    t[name] = layout(t[name])
    t = {k: _in_slack(v) for k, v in t.items()}
    triton_impl.merge_attn_states(t["output"], t["prefix_output"], t["prefix_lse"], t["suffix_output"],
                                  t["suffix_lse"], t["output_lse"], 30)
    _check(t["output"], t["output_lse"], a, p, b, s, ptwc=30)


# --------------------------------------------------------------------------------------------------------
# Exact paths


MASK_THEN_MERGE = [
    # R = 33 tiny requests (the scan crosses 32), bf16, [H, T] LSE, NaN padding.
    cases.Case("r33_tiny_bf16", _tiny_lens(30, 33), tuple(range(0, 33, 3)), num_heads=3, head_dim=32,
               padding=5, specials=True),
    # [T, H] LSE in base 2, H not a power of two.
    cases.Case("th_base2_h5", (20, 0, 9, 41), (1, 3), num_heads=5, head_dim=16, dtype="float32", lse_layout="TH",
               lse_base=2, specials=True, padding=2),
]


@pytest.mark.parametrize("case", MASK_THEN_MERGE, ids=lambda c: c.name)
def test_mask_then_merge_equals_fused(case):
    fused_out, fused_lse, inp = _merge_case(case)
    t = {k: bridge.to_torch(v, DEVICE) for k, v in inp.items()}
    masked = t["prefix_lse"].clone()
    triton_impl.mask_empty_context_lse(masked, t["query_start_loc"], t["cu_seq_lens"], lse_layout=case.lse_layout)
    D = case.head_dim
    out = torch.full_like(fused_out[..., :D], float("nan"))
    out_lse = torch.full_like(fused_lse, float("nan"))
    triton_impl.merge_attn_states(out, t["prefix_output"][..., :D], masked, t["suffix_output"][..., :D],
                                  t["suffix_lse"], out_lse, _default_ptwc(case), lse_layout=case.lse_layout,
                                  lse_base=case.lse_base)
    assert_bitwise_equal(out, fused_out[..., :D], name="merge.out mask-then-merge vs fused", case=case)
    assert_bitwise_equal(out_lse, fused_lse, name="merge.lse mask-then-merge vs fused", case=case)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pass_through_rows_are_bit_copies(dtype):
    # docs/spec.md 4.4: suffix rows and raw LSEs at or past prefill_tokens_with_context, NaN payloads, infinities
    # and -0.0 included, come out bit for bit; the prefix is ignored there even when its LSE wins.
    T, H, D, ptwc = 24, 3, 16, 9
    rng = np.random.default_rng(7)
    tdt = TORCH_DTYPES[dtype]
    payloads = {torch.float32: [0x7FC12345, -0x3FF5, 0x7F800000, -0x80000000],  # qNaN, -NaN, +inf, -0.0
                torch.bfloat16: [0x7FC1, -0x2B, 0x7F80, -0x8000]}[tdt]
    a = torch.from_numpy(rng.standard_normal((T, H, D)).astype(np.float32)).to(tdt)
    b = torch.from_numpy(rng.standard_normal((T, H, D)).astype(np.float32)).to(tdt)
    b_bits = _bits(b)
    for i, v in enumerate(payloads):
        b_bits[ptwc + i, :, :2] = v
    p = torch.from_numpy(rng.normal(50.0, 1.0, (H, T)).astype(np.float32))  # the prefix would dominate
    s = torch.from_numpy(rng.normal(0.0, 3.0, (H, T)).astype(np.float32))
    s_bits = _bits(s)
    for i, v in enumerate([0x7FC12345, -0x3FF5, 0x7F800000, -0x80000000, 0xFF800000 - (1 << 32)]):
        s_bits[:, ptwc + 1 + i] = v
    a, b, p, s = (x.to(DEVICE) for x in (a, b, p, s))
    out = torch.empty_like(a)
    out_lse = torch.empty_like(p)
    triton_impl.merge_attn_states(out, a, p, b, s, out_lse, ptwc)
    assert_bitwise_equal(out[ptwc:], b[ptwc:], name="merge.out pass-through")
    assert_bitwise_equal(out_lse[:, ptwc:], s[:, ptwc:], name="merge.lse pass-through", layout="HT")
    _check(out, out_lse, bridge.to_numpy(a), bridge.to_numpy(p), bridge.to_numpy(b), bridge.to_numpy(s), ptwc=ptwc)


EMPTY_KINDS = ["-inf", "+inf", "nan", "fused"]


def _one_side_empty(empty_side, kind, dtype="float32"):
    """Merges a small batch whose `empty_side` is entirely empty (its output NaN garbage)."""
    T, H, D, R = 29, 4, 32, 3
    rng = np.random.default_rng(3)
    np_dt = cases.DTYPES[dtype]
    x = {side: rng.standard_normal((T, H, D)).astype(np.float32).astype(np_dt) for side in ("prefix", "suffix")}
    lse = {side: rng.normal(3.0, 4.0, (H, T)).astype(np.float32) for side in ("prefix", "suffix")}
    x[empty_side][:] = np.nan
    if kind != "fused":
        lse[empty_side][:] = {"-inf": -np.inf, "+inf": np.inf, "nan": np.nan}[kind]
    t = {k: {side: bridge.to_torch(v[side], DEVICE) for side in v} for k, v in (("x", x), ("lse", lse))}
    kw = {}
    if kind == "fused":  # every request empty in the prefix chunk; the prefix LSE is finite garbage
        kw = dict(query_start_loc=torch.tensor([0, 10, 10, 29], dtype=torch.int32, device=DEVICE),
                  prefix_cu_seq_lens=torch.zeros(R + 1, dtype=torch.int32, device=DEVICE))
    out = torch.empty_like(t["x"]["prefix"])
    out_lse = torch.empty_like(t["lse"]["prefix"])
    triton_impl.merge_attn_states(out, t["x"]["prefix"], t["lse"]["prefix"], t["x"]["suffix"], t["lse"]["suffix"],
                                  out_lse, **kw)
    other = "suffix" if empty_side == "prefix" else "prefix"
    return out, out_lse, t["x"][other], t["lse"][other]


@pytest.mark.parametrize("kind", EMPTY_KINDS)
def test_all_empty_prefix_returns_suffix_bits(kind):
    for dtype in ("float32", "bfloat16"):
        out, out_lse, b, s = _one_side_empty("prefix", kind, dtype)
        assert_bitwise_equal(out, b, name=f"merge.out {dtype} (empty prefix: {kind})")
        assert_bitwise_equal(out_lse, s, name=f"merge.lse (empty prefix: {kind})", layout="HT")


@pytest.mark.parametrize("kind", EMPTY_KINDS[:3])
def test_all_empty_suffix_returns_prefix_values(kind):
    # Weight exactly 1 on the prefix: equal values (a -0.0 may come back as +0.0, so values, not bits).
    out, out_lse, a, p = _one_side_empty("suffix", kind)
    assert torch.equal(out, a)
    assert torch.equal(out_lse, p)


def test_both_empty_rows_are_zero_and_neg_inf():
    # docs/spec.md 4.2 with NaN/inf garbage in both partials, every pairing of the three empty encodings.
    T, H, D = 9, 2, 16
    encodings = [-np.inf, np.inf, np.nan]
    p = np.array([[e for e in encodings for _ in encodings]] * H, np.float32)
    s = np.array([[e for _ in encodings for e in encodings]] * H, np.float32)
    garbage = torch.full((T, H, D), float("nan"), device=DEVICE)
    garbage[::2] = float("inf")
    out = torch.full((T, H, D), 5.0, device=DEVICE)
    out_lse = torch.zeros(H, T, device=DEVICE)
    triton_impl.merge_attn_states(out, garbage, bridge.to_torch(p, DEVICE), garbage.clone(),
                                  bridge.to_torch(s, DEVICE), out_lse)
    assert torch.equal(_bits(out), torch.zeros_like(_bits(out)))  # +0.0 everywhere
    assert bool(torch.isneginf(out_lse).all())


# --------------------------------------------------------------------------------------------------------
# No recompilation


def test_runtime_values_are_not_specialised():
    for layout in constants.LSE_LAYOUTS:
        names, constexprs, dns, _ = kernel_params(merge_mod._merge_attn_states_kernel[layout])
        runtime = {"prefill_tokens_with_context", "num_tokens", "num_requests"}
        assert runtime <= set(names)
        assert not runtime & constexprs
        assert runtime <= dns, f"{runtime - dns} would be specialised (a recompile when they hit 1 or 16k)"


def _recorded_keys(monkeypatch, lse_layout, batches, make_case, **merge_kw):
    """The specialisation keys of `lse_layout`'s kernel over `_merge_case` launches of `make_case(query_lens,
    padding)`, one per batch (query_lens, padding, ptwc): the kernel is replaced by a recorder, so this runs no
    interpreter and checks nothing."""
    recorder = Recorder(merge_mod._merge_attn_states_kernel)
    monkeypatch.setattr(merge_mod, "_merge_attn_states_kernel", recorder)
    monkeypatch.setattr(triton_backend, "interpreting", lambda: False)  # record the compiled launch arguments
    monkeypatch.setattr(triton_plans, "PLANS", {})  # launch plans made under that mode only
    for query_lens, padding, ptwc in batches:
        _merge_case(make_case(query_lens, padding), ptwc=ptwc, check=False, **merge_kw)
    other, = set(constants.LSE_LAYOUTS) - {lse_layout}
    assert len(recorder[lse_layout].launches) == len(batches) and not recorder[other].launches
    return recorder[lse_layout].keys()


# New token counts (T = 1 and multiples of 16 included), request counts and prefill_tokens_with_context values.
_BATCHES = [((40, 0, 21), 3, 30), ((40, 0, 21), 3, 0), ((40, 0, 21), 3, 1), ((40, 0, 21), 3, 64),
            ((13,), 3, 16), ((64, 61), 3, 125), ((1, 2, 3, 4, 5), 0, 7), ((1,), 0, 1), ((48,), 0, 32),
            (_tiny_lens(40, 70, 9), 1, 100)]


@pytest.mark.parametrize("lse_layout", ["HT", "TH"])
def test_one_compiled_variant_per_configuration(monkeypatch, lse_layout):
    # No recompilation, on any machine: the launches of one configuration (H=4, D=64, bf16, fused, output_lse) with
    # new token counts, request counts and prefill_tokens_with_context values must all have the same
    # specialisation key, i.e. reuse one compiled kernel.
    def make_case(query_lens, padding):
        return cases.Case("recompile", query_lens, tuple(range(0, len(query_lens), 2)), num_heads=4, head_dim=64,
                          lse_layout=lse_layout, padding=padding)

    keys = _recorded_keys(monkeypatch, lse_layout, _BATCHES, make_case)
    assert_one_variant(keys, "merge")
    # The layout's unit LSE stride is specialised (1: contiguous, vectorisable LSE accesses); in [T, H] layout
    # so is the other one (H), which never follows T.
    names = list(keys[0])
    unit, other = ("t", "h") if lse_layout == "HT" else ("h", "t")
    assert {n: keys[0][n] for n in lse_strides(names, unit)} == dict.fromkeys(lse_strides(names, unit),
                                                                              ("constexpr", 1))
    want = ("i32", None) if lse_layout == "HT" else ("i32", "")  # HT: runtime (= T); TH: H = 4, not 16k
    assert {n: keys[0][n] for n in lse_strides(names, other)} == dict.fromkeys(lse_strides(names, other), want)


@pytest.mark.parametrize("stored", ["HT", "TH"])
def test_transposed_lse_views_compile_a_bounded_number_of_variants(monkeypatch, stored):
    # LSE buffers stored in one layout, passed through .t() under the other layout's name (right results:
    # test_lse_buffers_via_transposed_views). [T, H] buffers given as "HT" have strides that do not follow T:
    # one variant, and one more for T = 1 (its token stride taken as 1). [H, T] buffers given as "TH" have a head
    # stride T, which the [T, H] kernel specialises: a variant per class of T (1, a multiple of 16, other).
    recorder = Recorder(merge_mod._merge_attn_states_kernel)
    monkeypatch.setattr(merge_mod, "_merge_attn_states_kernel", recorder)
    monkeypatch.setattr(triton_backend, "interpreting", lambda: False)  # record the compiled launch arguments
    monkeypatch.setattr(triton_plans, "PLANS", {})
    H, D = 4, 64
    given = "TH" if stored == "HT" else "HT"
    token_counts = (1, 5, 16, 37, 48, 64, 100)
    for T in token_counts:
        x = torch.zeros(T, H, D, dtype=torch.bfloat16, device=DEVICE)
        lses = [torch.zeros((H, T) if stored == "HT" else (T, H), device=DEVICE).t() for _ in range(3)]
        triton_impl.merge_attn_states(x, x.clone(), lses[0], x.clone(), lses[1], lses[2], lse_layout=given)
    assert len(recorder[given].launches) == len(token_counts)
    assert len(variants(recorder[given].keys())) == (3 if stored == "HT" else 2)


@pytest.mark.gpu
@pytest.mark.parametrize("lse_layout", ["HT", "TH"])
def test_no_recompilation_across_batches(lse_layout):
    # Several prefill_tokens_with_context values, token counts and request counts: one compiled kernel
    # per constexpr configuration (here one configuration: H=4, D=64, bf16, fused, output_lse).
    kernel = merge_mod._merge_attn_states_kernel[lse_layout]

    def launch(query_lens, ptwc):
        case = cases.Case("recompile", query_lens, tuple(range(0, len(query_lens), 2)), num_heads=4,
                          head_dim=64, padding=3, lse_layout=lse_layout)
        _merge_case(case, ptwc=ptwc)

    launch((40, 0, 21), 30)
    cache = kernel.device_caches[torch.cuda.current_device()][0]
    n = len(cache)
    assert n >= 1
    for query_lens, ptwc in [((40, 0, 21), 0), ((40, 0, 21), 1), ((40, 0, 21), 64), ((13,), 16),
                             ((64, 61), 125), ((1, 2, 3, 4, 5), 7), (_tiny_lens(40, 70, 9), 100)]:
        launch(query_lens, ptwc)
    assert len(cache) == n, f"the merge kernel compiled {len(cache) - n} more variants for new runtime values"


# --------------------------------------------------------------------------------------------------------
# Errors


def _valid(T=6, H=2, D=8, dtype=torch.bfloat16):
    """Valid arguments for the error tests."""
    x = lambda: torch.zeros(T, H, D, dtype=dtype, device=DEVICE)  # noqa: E731
    lse = lambda: torch.zeros(H, T, device=DEVICE)  # noqa: E731
    return dict(output=x(), prefix_output=x(), prefix_lse=lse(), suffix_output=x(), suffix_lse=lse(),
                output_lse=lse(), prefill_tokens_with_context=None, output_scale=None)


POSITIONAL = ("output", "prefix_output", "prefix_lse", "suffix_output", "suffix_lse", "output_lse",
              "prefill_tokens_with_context", "output_scale")


def _call(**changes):
    kw = _valid()
    kw.update(changes)
    args = [kw.pop(k) for k in POSITIONAL]
    triton_impl.merge_attn_states(*args, **kw)


I32 = dict(dtype=torch.int32, device=DEVICE)
QSL = torch.tensor([0, 2, 6], **I32)
CU = torch.tensor([0, 0, 3], **I32)
BF16 = dict(dtype=torch.bfloat16, device=DEVICE)
FP8_OUT = torch.zeros(6, 2, 8, device=DEVICE).to(FP8)
SCALE = torch.ones(1, device=DEVICE)

_BUF = torch.zeros(7, 2, 8, **BF16)
_SHIFTED = (_BUF[1:], _BUF[:6])  # two [6, 2, 8] views of one buffer, one token apart
_BUF_LSE = torch.zeros(13, device=DEVICE)
_SHIFTED_LSE = (_BUF_LSE[1:13].view(2, 6), _BUF_LSE[0:12].view(2, 6))  # [2, 6] views one element apart

ERRORS = [
    ("prefix_f64", dict(prefix_output=torch.zeros(6, 2, 8, dtype=torch.float64, device=DEVICE)), TypeError,
     "prefix_output.dtype"),
    ("prefix_int", dict(prefix_output=torch.zeros(6, 2, 8, **I32)), TypeError, "prefix_output.dtype"),
    ("suffix_dtype", dict(suffix_output=torch.zeros(6, 2, 8, dtype=torch.float16, device=DEVICE)), TypeError,
     "suffix_output.dtype"),
    ("output_dtype", dict(output=torch.zeros(6, 2, 8, dtype=torch.float64, device=DEVICE)), TypeError, "output.dtype"),
    ("prefix_lse_f16", dict(prefix_lse=torch.zeros(2, 6, **BF16)), TypeError, "prefix_lse.dtype"),
    ("suffix_lse_f64", dict(suffix_lse=torch.zeros(2, 6, dtype=torch.float64, device=DEVICE)), TypeError,
     "suffix_lse.dtype"),
    ("output_lse_f16", dict(output_lse=torch.zeros(2, 6, dtype=torch.float16, device=DEVICE)), TypeError,
     "output_lse.dtype"),
    ("output_numpy", dict(output=np.zeros((6, 2, 8), np.float32)), TypeError, "torch.Tensor"),
    ("prefix_rank2", dict(prefix_output=torch.zeros(6, 16, **BF16)), ValueError, "prefix_output must have 3 dims"),
    ("suffix_shape", dict(suffix_output=torch.zeros(6, 2, 16, **BF16)), ValueError, "suffix_output.shape"),
    ("suffix_tokens", dict(suffix_output=torch.zeros(7, 2, 8, **BF16)), ValueError, "suffix_output.shape"),
    ("output_shape", dict(output=torch.zeros(6, 3, 8, **BF16)), ValueError, "output.shape"),
    ("prefix_lse_shape", dict(prefix_lse=torch.zeros(2, 7, device=DEVICE)), ValueError, "prefix_lse.shape"),
    ("suffix_lse_th_in_ht", dict(suffix_lse=torch.zeros(6, 2, device=DEVICE)), ValueError, "suffix_lse.shape"),
    ("output_lse_shape", dict(output_lse=torch.zeros(2, 5, device=DEVICE)), ValueError, "output_lse.shape"),
    ("lse_rank1", dict(prefix_lse=torch.zeros(12, device=DEVICE)), ValueError, "prefix_lse must have 2 dims"),
    ("fp8_without_scale", dict(output=FP8_OUT), ValueError, "output_scale is required"),
    ("scale_without_fp8", dict(output_scale=SCALE), ValueError, "output_scale is required"),
    ("scale_f64", dict(output=FP8_OUT, output_scale=torch.ones(1, dtype=torch.float64, device=DEVICE)), TypeError,
     "output_scale.dtype"),
    ("scale_shape", dict(output=FP8_OUT, output_scale=torch.ones(2, device=DEVICE)), ValueError,
     "output_scale.shape"),
    ("only_query_start_loc", dict(query_start_loc=QSL), ValueError, "go together"),
    ("only_prefix_cu_seq_lens", dict(prefix_cu_seq_lens=CU), ValueError, "go together"),
    ("offsets_int64", dict(query_start_loc=QSL.long(), prefix_cu_seq_lens=CU), TypeError, "query_start_loc"),
    ("offset_lengths", dict(query_start_loc=QSL, prefix_cu_seq_lens=CU[:2]), ValueError,
     "prefix_cu_seq_lens.shape"),
    ("ptwc_tensor", dict(prefill_tokens_with_context=torch.tensor(3)), TypeError, "host int"),
    ("ptwc_float", dict(prefill_tokens_with_context=3.0), TypeError, "host int"),
    ("bad_layout", dict(lse_layout="th"), ValueError, "lse_layout"),
    ("bad_base", dict(lse_base=10), ValueError, "lse_base"),
    ("suffix_other_device", dict(suffix_output=torch.zeros(6, 2, 8, dtype=torch.bfloat16, device="meta")),
     ValueError, "meta"),
    ("lse_other_device", dict(suffix_lse=torch.zeros(2, 6, device="meta")), ValueError, "meta"),
    ("offsets_other_device", dict(query_start_loc=QSL.to("meta"), prefix_cu_seq_lens=CU), ValueError, "meta"),
    # In-place outputs whose elements share memory would race (torch's in-place ops refuse them too).
    ("output_expanded", dict(output=torch.zeros(1, 2, 8, **BF16).expand(6, 2, 8)), ValueError,
     "output has elements that share memory"),
    ("output_lse_expanded", dict(output_lse=torch.zeros(2, 1, device=DEVICE).expand(2, 6)), ValueError,
     "output_lse has elements that share memory"),
    ("output_overlaps_prefix", dict(zip(("output", "prefix_output"), _SHIFTED)), ValueError,
     "output partially overlaps prefix_output"),
    ("output_lse_overlaps_suffix_lse", dict(zip(("output_lse", "suffix_lse"), _SHIFTED_LSE)), ValueError,
     "output_lse partially overlaps suffix_lse"),
]


@pytest.mark.parametrize("changes,error,match", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_input_errors(changes, error, match):
    with pytest.raises(error, match=match):
        _call(**changes)


VALIDATE_ERRORS = [
    ("ptwc_past_T", dict(prefill_tokens_with_context=7), "prefill_tokens_with_context=7"),
    ("ptwc_negative", dict(prefill_tokens_with_context=-1), "prefill_tokens_with_context=-1"),
    ("qsl_not_from_0", dict(query_start_loc=torch.tensor([1, 2, 6], **I32), prefix_cu_seq_lens=CU),
     "query_start_loc\\[0\\] must be 0"),
    ("qsl_past_T", dict(query_start_loc=torch.tensor([0, 2, 9], **I32), prefix_cu_seq_lens=CU), "past the token"),
    ("cu_decreasing", dict(query_start_loc=QSL, prefix_cu_seq_lens=torch.tensor([0, 3, 1], **I32)),
     "non-decreasing"),
]


@pytest.mark.parametrize("changes,match", [e[1:] for e in VALIDATE_ERRORS], ids=[e[0] for e in VALIDATE_ERRORS])
def test_validate_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        _call(validate=True, **changes)


def test_validate_accepts_valid_inputs():
    for ptwc in (0, 6):
        _call(validate=True, prefill_tokens_with_context=ptwc, query_start_loc=QSL, prefix_cu_seq_lens=CU)


def test_prefill_tokens_with_context_accepts_numpy_integers():
    # A numpy integer is a host value like an int: same result; a bool is rejected like other non-ints.
    results = []
    kw = _valid()
    kw["prefix_output"].normal_()
    kw["suffix_output"].fill_(1.5)
    for ptwc in (3, np.int64(3), np.int32(3)):
        kw.update(prefill_tokens_with_context=ptwc, output=torch.full_like(kw["output"], float("nan")))
        triton_impl.merge_attn_states(*[kw[k] for k in POSITIONAL])
        results.append(kw["output"])
    assert all(torch.equal(_bits(r), _bits(results[0])) for r in results)
    assert torch.equal(results[0][3:], torch.full_like(results[0][3:], 1.5))  # pass-through rows from t = 3
    with pytest.raises(TypeError, match="prefill_tokens_with_context"):
        _call(prefill_tokens_with_context=True)


def test_zero_tokens_is_a_no_op():
    kw = _valid(T=0)
    triton_impl.merge_attn_states(*[kw[k] for k in POSITIONAL])


def test_output_may_be_the_prefix_itself():
    # The same tensor (start, shape, strides) is not a partial overlap: each program reads its tile before it
    # writes it. Merging into the prefix buffer gives the bits of merging into a separate one.
    case = cases.by_name("padded_v_ptwc")
    inp = cases.make_inputs(case)
    t = {k: bridge.to_torch(v, DEVICE) for k, v in inp.items()}
    D = case.head_dim
    args = (t["suffix_output"][..., :D], t["suffix_lse"])
    separate = torch.empty_like(t["prefix_output"][..., :D])
    triton_impl.merge_attn_states(separate, t["prefix_output"][..., :D], t["prefix_lse"], *args, None, 100)
    in_place = t["prefix_output"][..., :D]
    triton_impl.merge_attn_states(in_place, in_place, t["prefix_lse"], *args, None, 100)
    assert_bitwise_equal(in_place, separate, name="merge.out into the prefix buffer", case=case)


# --------------------------------------------------------------------------------------------------------
# Properties (Hypothesis, deterministic "ci" profile from conftest)


@st.composite
def merge_cases(draw):
    """A Case with zero-length requests, random empty flags, a NaN padding tail, H not a power of two,
    R crossing 32, specials, both layouts and bases, sometimes an fp8 output; plus a ptwc in [0, T]."""
    num_requests = draw(st.integers(0, 40))
    lens = draw(st.lists(st.integers(0, 12), min_size=num_requests, max_size=num_requests))
    flags = draw(st.lists(st.booleans(), min_size=num_requests, max_size=num_requests))
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    case = cases.Case(
        "hypothesis", tuple(lens), tuple(r for r, f in enumerate(flags) if f),
        num_heads=draw(st.sampled_from([1, 3, 5])), head_dim=draw(st.sampled_from([16, 64])), dtype=dtype,
        lse_layout=draw(st.sampled_from(["HT", "TH"])), lse_base=draw(st.sampled_from([math.e, 2])),
        padding=draw(st.integers(0, 7)), head_pad=draw(st.sampled_from([0, 8])), specials=draw(st.booleans()),
        out_dtype=draw(st.sampled_from([None, None, "float8_e4m3fn"])) if dtype == "bfloat16" else None)
    ptwc = draw(st.one_of(st.none(), st.integers(0, case.num_tokens)))
    return dataclasses.replace(case, prefill_tokens_with_context=ptwc)


@given(case=merge_cases(), fused=st.booleans())
@settings(max_examples=6)
def test_property_matches_reference(case, fused):
    _merge_case(case, fused=fused, ptwc=case.prefill_tokens_with_context)


@given(case=merge_cases(), side=st.sampled_from(["prefix", "suffix"]))
@settings(max_examples=4)
def test_property_all_empty_side_returns_the_other(case, side):
    # Natural-log LSEs, no pass-through: the other side comes back bit for bit (values for the prefix,
    # whose -0.0 may come back as +0.0), its LSE bit for bit.
    case = dataclasses.replace(case, lse_base=math.e, out_dtype=None, specials=False, padding=0)
    inp = cases.make_inputs(case)
    t = {k: bridge.to_torch(v, DEVICE) for k, v in inp.items()}
    D = case.head_dim
    empty_lse = t[f"{side}_lse"]
    empty_lse.fill_(float("-inf"))
    t[f"{side}_output"].fill_(float("nan"))
    out = torch.empty_like(t["prefix_output"][..., :D])
    out_lse = torch.empty_like(t["prefix_lse"])
    triton_impl.merge_attn_states(out, t["prefix_output"][..., :D], t["prefix_lse"], t["suffix_output"][..., :D],
                                  t["suffix_lse"], out_lse, lse_layout=case.lse_layout)
    other = "suffix" if side == "prefix" else "prefix"
    if other == "suffix":
        assert_bitwise_equal(out, t["suffix_output"][..., :D], name="merge.out (empty prefix)", case=case)
    else:
        assert torch.equal(out, t["prefix_output"][..., :D])
    assert_bitwise_equal(out_lse, t[f"{other}_lse"], name="merge.lse (one side empty)", case=case)
