"""triton_impl.merge_attn_states_n (docs/spec.md 8) against parity.harness.reference, and its properties.

Exact bits where the result is a copy or one partial alone has weight (`parity.harness.expected.exact_masks`);
elsewhere within `parity.library.compare.TOLERANCES` of the float64 reference, measured against the magnitude of the
terms. Runs in the process's Triton mode (conftest): the interpreter on CPU, compiled on a GPU.
"""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from merge_checks import assert_merge_matches_reference
from triton_keys import Recorder, assert_one_variant, kernel_params

import triton_impl
from parity.harness import expected
from parity.library import bridge, compare
from parity.harness import cases, impls, reference
from parity.library.compare import assert_bitwise_equal
from triton_impl import _backend as triton_backend
from triton_impl import _plans as triton_plans
from triton_impl import merge_n as merge_n_mod

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CI_N = cases.select("ci", kind="n_way")
FP8 = torch.float8_e4m3fn


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({4: torch.int32, 2: torch.int16, 1: torch.int8}[x.element_size()])


def _inputs(case, seed=0):
    inp = cases.make_inputs_n(case, seed)
    inp["masked_lses"] = impls.masked_lses(case, inp)
    return inp, {k: bridge.to_torch(v, DEVICE) for k, v in inp.items()}


def _run(case, t, *, fused=True, output_lse=True, ptwc=None, lses=None, outputs=None, out=None):
    """The public API on a case's torch inputs into NaN-poisoned buffers; returns (out, out_lse)."""
    T, H, D = case.num_tokens, case.num_heads, case.head_dim
    outputs = t["outputs"][..., :D] if outputs is None else outputs
    lses = t["lses"] if lses is None else lses
    dtype = FP8 if case.out_dtype else outputs.dtype
    if out is None:
        out = torch.full((T, H, D), float("nan"), device=DEVICE).to(dtype)
    out_lse = torch.full(tuple(lses.shape[1:]), float("nan"), device=DEVICE) if output_lse else None
    kw = dict(query_start_loc=t["query_start_loc"], cu_seq_lens=t["cu_seq_lens"]) if fused else {}
    triton_impl.merge_attn_states_n(out, outputs, lses, out_lse, ptwc, t.get("output_scale"),
                                    lse_layout=case.lse_layout, lse_base=case.lse_base, **kw)
    return out, out_lse


def _check(case, inp, out, out_lse, *, op="merge_n_fused", ptwc=None, lses=None):
    """Against the float64 reference of the same operands: exact rows bit for bit, the rest within tolerance."""
    case = dataclasses.replace(case, prefill_tokens_with_context=ptwc)
    arrays = dict(inp, lses=inp["lses"] if lses is None else lses)
    assert_merge_matches_reference(case, op, arrays, out, out_lse, name="merge_n")


# --------------------------------------------------------------------------------------------------------
# Workloads


def test_ci_cases_cover_the_n_way_matrix():
    """The "ci" N-way cases hold what the issue's matrix needs on CPU: N from 1 to 16, every dtype and fp8,
    both layouts, base 2, R > 32, strided partials, a padded V, pass-through rows, a wholly empty partial."""
    assert {c.partials for c in CI_N} >= {1, 2, 3, 4, 8, 16}
    assert {c.dtype for c in CI_N} == {"float32", "float16", "bfloat16"}
    assert any(c.out_dtype for c in CI_N) and any(c.lse_base == 2 for c in CI_N)
    assert {c.lse_layout for c in CI_N} == {"HT", "TH"}
    assert any(c.num_requests > 32 for c in CI_N) and any(c.strided and c.head_pad for c in CI_N)
    assert any(c.prefill_tokens_with_context is not None for c in CI_N)
    assert any((cases.partial_kv_lens(c) == 0).all(axis=1).any() for c in CI_N)
    assert any(_pass_through_without_last_kv(c) for c in CI_N)  # docs/spec.md 8.4: the copied LSE is -inf


def _pass_through_without_last_kv(case) -> bool:
    """Does a pass-through token belong to a request with no KV in the last partial?"""
    if case.prefill_tokens_with_context is None:
        return False
    qsl, _ = cases.offsets_n(case)
    no_last_kv = cases.partial_kv_lens(case)[-1] == 0
    return any(no_last_kv[r] and qsl[r + 1] > max(qsl[r], case.prefill_tokens_with_context)
               for r in range(case.num_requests))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "masked_lses"])
@pytest.mark.parametrize("case", CI_N, ids=lambda c: c.name)
def test_ci_cases_match_reference(case, fused):
    inp, t = _inputs(case)
    op = "merge_n_fused" if fused else "merge_n"
    lses = None if fused else t["masked_lses"]
    out, out_lse = _run(case, t, fused=fused, ptwc=case.prefill_tokens_with_context, lses=lses)
    _check(case, inp, out, out_lse, op=op, ptwc=case.prefill_tokens_with_context,
           lses=None if fused else inp["masked_lses"])
    if fused:  # docs/spec.md 8.1: NaN garbage of partials without KV never reaches a merged real token
        n_merged = min(sum(case.query_lens), case.prefill_tokens_with_context or case.num_tokens)  # 8.4: copies
        assert not bool(torch.isnan(out[:n_merged].float()).any()) or case.specials


@pytest.mark.parametrize("ptwc", [0, 17, 57])
def test_pass_through_rows_copy_the_last_partial(ptwc):
    case = cases.by_name("n1_bf16")
    case = dataclasses.replace(case, partials=3, context_lens=(5, 0, 9))
    inp, t = _inputs(case)
    out, out_lse = _run(case, t, ptwc=ptwc)
    _check(case, inp, out, out_lse, ptwc=ptwc)
    last = t["outputs"][-1, ptwc:, :, :case.head_dim]
    assert torch.equal(_bits(out[ptwc:]), _bits(last))
    assert torch.equal(_bits(out_lse[:, ptwc:]), _bits(t["lses"][-1][:, ptwc:]))


def test_output_lse_none_gives_the_same_out():
    case = cases.by_name("n3_fp16_th_specials")
    _, t = _inputs(case)
    with_lse, _ = _run(case, t)
    without, _ = _run(case, t, output_lse=False)
    assert_bitwise_equal(without, with_lse, name="merge_n.out without output_lse", case=case)


def test_strided_partials_equal_contiguous():
    # A [T, N, H, D] gather viewed as [N, T, H, D], a V-padded buffer and [N, T, H] LSEs viewed as [N, H, T]:
    # the same bits as contiguous inputs.
    case = dataclasses.replace(cases.by_name("n4_bf16_d512_base2_strided"), strided=False)
    _, t = _inputs(case)
    D = case.head_dim
    contiguous = _run(case, t, outputs=t["outputs"][..., :D].contiguous())
    outputs = t["outputs"].transpose(0, 1).contiguous().transpose(0, 1)[..., :D]
    lses = t["lses"].transpose(1, 2).contiguous().transpose(1, 2)
    assert outputs.stride() != t["outputs"][..., :D].contiguous().stride() and not lses.is_contiguous()
    strided = _run(case, t, outputs=outputs, lses=lses)
    for got, want, name in zip(strided, contiguous, ("out", "lse")):
        assert_bitwise_equal(got, want, name=f"merge_n.{name} strided vs contiguous", case=case)


def test_n2_gives_the_two_way_bits():
    # docs/spec.md 8: at N = 2 every operation is the 2-way merge's. The 2-way fused mask covers the prefix, so
    # partial 1 goes in with its LSE masked (exactly) by the reference.
    case = cases.by_name("n2_fp32_d80_ptwc")
    _, t = _inputs(case)
    D, ptwc = case.head_dim, case.prefill_tokens_with_context
    n_out, n_lse = _run(case, t, ptwc=ptwc)
    out = torch.full_like(n_out, float("nan"))
    out_lse = torch.full_like(n_lse, float("nan"))
    triton_impl.merge_attn_states(out, t["outputs"][0, ..., :D], t["lses"][0], t["outputs"][1, ..., :D],
                                  t["masked_lses"][1], out_lse, ptwc, query_start_loc=t["query_start_loc"],
                                  prefix_cu_seq_lens=t["cu_seq_lens"][0])
    assert_bitwise_equal(n_out, out, name="merge_n.out (N=2) vs merge.out", case=case)
    assert_bitwise_equal(n_lse, out_lse, name="merge_n.lse (N=2) vs merge.lse", case=case)


def test_zero_tokens_is_a_no_op():
    outputs = torch.zeros(3, 0, 2, 8, device=DEVICE)
    triton_impl.merge_attn_states_n(torch.zeros(0, 2, 8, device=DEVICE), outputs, torch.zeros(3, 2, 0, device=DEVICE))


# --------------------------------------------------------------------------------------------------------
# Properties (Hypothesis, deterministic "ci" profile from conftest)


def _partials(seed, n, T=23, H=3, D=32, dtype=torch.float32):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    o = torch.randn(n, T, H, D, generator=g, device=DEVICE).to(dtype)
    lse = torch.randn(n, H, T, generator=g, device=DEVICE) * 3.0 + 2.0
    return o, lse


def _merge(o, lse, **kw):
    out = torch.full(o.shape[1:], float("nan"), device=DEVICE).to(o.dtype)
    out_lse = torch.full(lse.shape[1:], float("nan"), device=DEVICE)
    triton_impl.merge_attn_states_n(out, o, lse, out_lse, **kw)
    return out, out_lse


@given(n=st.integers(1, 6), where=st.integers(0, 6), empty=st.sampled_from(["-inf", "+inf", "nan"]),
       seed=st.integers(0, 3))
@settings(max_examples=8)
def test_property_an_empty_partial_anywhere_changes_nothing(n, where, empty, seed):
    # An all-empty partial (its output NaN garbage) added at any index leaves the merge of the others bit for bit.
    o, lse = _partials(seed, n)
    base = _merge(o, lse)
    where = min(where, n)
    e_o = torch.full_like(o[:1], float("nan"))
    e_l = torch.full_like(lse[:1], {"-inf": -math.inf, "+inf": math.inf, "nan": math.nan}[empty])
    got = _merge(torch.cat([o[:where], e_o, o[where:]]), torch.cat([lse[:where], e_l, lse[where:]]))
    assert_bitwise_equal(got[0], base[0], name="merge_n.out with an empty partial")
    assert_bitwise_equal(got[1], base[1], name="merge_n.lse with an empty partial")


def _close(got, want, mag, tol):
    err = (got.double() - want.double()).abs()
    return bool((err <= tol.atol + tol.rtol * mag).all())


@given(n=st.integers(2, 6), seed=st.integers(0, 5))
@settings(max_examples=6)
def test_property_permuting_partials_stays_within_tolerance(n, seed):
    o, lse = _partials(seed, n)
    base = _merge(o, lse)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    got = _merge(o[perm], lse[perm])
    w = reference.merge_weights_n(bridge.to_numpy(lse))
    mag = torch.from_numpy(expected.merge_magnitude(bridge.to_numpy(o), w)).to(DEVICE)
    tol = compare.TOLERANCES["float32"]
    assert _close(got[0], base[0], 2 * mag, tol), "permuted partials: out off by more than two roundings"
    assert _close(got[1], base[1], 2 * base[1].abs().double(), compare.TOLERANCES["lse"])


@given(seed=st.integers(0, 5))
@settings(max_examples=4)
def test_property_merge_is_associative_within_tolerance(seed):
    # merge(a, b, c) vs merge(merge(a, b), c): the same value up to the intermediate's rounding.
    o, lse = _partials(seed, 3)
    three = _merge(o, lse)
    ab = _merge(o[:2], lse[:2])
    chained = _merge(torch.stack([ab[0], o[2]]), torch.stack([ab[1], lse[2]]))
    w = reference.merge_weights_n(bridge.to_numpy(lse))
    mag = torch.from_numpy(expected.merge_magnitude(bridge.to_numpy(o), w)).to(DEVICE)
    assert _close(chained[0], three[0], 3 * mag, compare.TOLERANCES["float32"])
    assert _close(chained[1], three[1], 3 * three[1].abs().double(), compare.TOLERANCES["lse"])


# --------------------------------------------------------------------------------------------------------
# No recompilation


@pytest.mark.parametrize("lse_layout", ["HT", "TH"])
def test_runtime_values_are_not_specialised(lse_layout):
    names, constexprs, dns, _ = kernel_params(merge_n_mod._merge_attn_states_n_kernel[lse_layout])
    runtime = {"prefill_tokens_with_context", "num_tokens", "num_requests", "stride_lse_n", "stride_cu_n"}
    if lse_layout == "HT":  # the head strides are T
        runtime |= {"stride_lse_h", "stride_olse_h"}
    assert runtime <= set(names) and not runtime & constexprs
    assert runtime <= dns, f"{runtime - dns} would be specialised (a recompile when they hit 1 or 16k)"
    assert "NUM_PARTIALS" in constexprs  # fixed by the deployment (the context-parallel group size)


@pytest.mark.parametrize("lse_layout", ["HT", "TH"])
def test_one_compiled_variant_across_token_counts(monkeypatch, lse_layout):
    # New token counts (T = 1 and multiples of 16 included) have the same specialisation key: one compiled
    # kernel. [H, T]: head strides (= T) and the partial stride (T * H) runtime; [T, H]: every LSE head and token
    # stride specialised (1 and H = 4), the partial stride runtime. The kernel is replaced by a recorder.
    recorder = Recorder(merge_n_mod._merge_attn_states_n_kernel)
    monkeypatch.setattr(merge_n_mod, "_merge_attn_states_n_kernel", recorder)
    monkeypatch.setattr(triton_backend, "interpreting", lambda: False)  # record the compiled launch arguments
    monkeypatch.setattr(triton_plans, "PLANS", {})
    N, H, D = 3, 4, 64
    token_counts = (1, 5, 16, 37, 48, 100)
    for T in token_counts:
        lse_shape = (H, T) if lse_layout == "HT" else (T, H)
        out, outs = torch.zeros(T, H, D, device=DEVICE), torch.zeros(N, T, H, D, device=DEVICE)
        lses, out_lse = torch.zeros(N, *lse_shape, device=DEVICE), torch.zeros(*lse_shape, device=DEVICE)
        triton_impl.merge_attn_states_n(out, outs, lses, out_lse, lse_layout=lse_layout)
    assert len(recorder[lse_layout].launches) == len(token_counts)
    keys = recorder[lse_layout].keys()
    assert_one_variant(keys, "merge_n")
    head, token = ("i32", None), ("constexpr", 1)
    if lse_layout == "TH":
        head, token = ("constexpr", 1), ("i32", "")
    want = dict(stride_lse_h=head, stride_olse_h=head, stride_lse_t=token, stride_olse_t=token,
                stride_lse_n=("i32", None))
    assert {k: keys[0][k] for k in want} == want


@pytest.mark.gpu
@pytest.mark.parametrize("lse_layout", ["HT", "TH"])
def test_no_recompilation_across_batches(lse_layout):
    kernel = merge_n_mod._merge_attn_states_n_kernel[lse_layout]
    base = dataclasses.replace(cases.by_name("n4_bf16_fp8_out"), lse_layout=lse_layout)

    def launch(query_lens, contexts, ptwc):
        case = dataclasses.replace(base, query_lens=query_lens, context_lens=contexts)
        _, t = _inputs(case)
        _run(case, t, ptwc=ptwc)

    launch((24, 16, 3), (1, 20, 6), 30)
    cache = kernel.device_caches[torch.cuda.current_device()][0]
    n = len(cache)
    for query_lens, contexts, ptwc in [((24, 16, 3), (0, 2, 6), 0), ((13,), (40,), 1), ((1, 2, 3, 4, 5),
                                       (0, 1, 2, 3, 4), 16), ((64, 61), (9, 9), 125), ((48,), (0,), None)]:
        launch(query_lens, contexts, ptwc)
    assert len(cache) == n, f"the N-way kernel compiled {len(cache) - n} more variants for new runtime values"


# --------------------------------------------------------------------------------------------------------
# Errors


def _valid(N=3, T=6, H=2, D=8, dtype=torch.bfloat16):
    return dict(output=torch.zeros(T, H, D, dtype=dtype, device=DEVICE),
                outputs=torch.zeros(N, T, H, D, dtype=dtype, device=DEVICE),
                lses=torch.zeros(N, H, T, device=DEVICE), output_lse=torch.zeros(H, T, device=DEVICE),
                prefill_tokens_with_context=None, output_scale=None)


POSITIONAL = ("output", "outputs", "lses", "output_lse", "prefill_tokens_with_context", "output_scale")
I32 = dict(dtype=torch.int32, device=DEVICE)
QSL = torch.tensor([0, 2, 6], **I32)
CU = torch.tensor([[0, 0, 3], [0, 1, 2], [0, 0, 0]], **I32)


def _call(**changes):
    kw = _valid()
    kw.update(changes)
    args = [kw.pop(k) for k in POSITIONAL]
    triton_impl.merge_attn_states_n(*args, **kw)


ERRORS = [
    ("outputs_rank3", dict(outputs=torch.zeros(6, 2, 8, device=DEVICE)), ValueError, "outputs must have 4 dims"),
    ("outputs_f64", dict(outputs=torch.zeros(3, 6, 2, 8, dtype=torch.float64, device=DEVICE)), TypeError,
     "outputs.dtype"),
    ("lses_disagree_on_n", dict(lses=torch.zeros(4, 2, 6, device=DEVICE)), ValueError, "disagree on N"),
    ("lses_th_in_ht", dict(lses=torch.zeros(3, 6, 2, device=DEVICE)), ValueError, r"lses must be f32\[3, 2, 6\]"),
    ("lses_f16", dict(lses=torch.zeros(3, 2, 6, dtype=torch.float16, device=DEVICE)), TypeError, "lses.dtype"),
    ("output_shape", dict(output=torch.zeros(6, 2, 16, dtype=torch.bfloat16, device=DEVICE)), ValueError,
     "output.shape"),
    ("output_dtype", dict(output=torch.zeros(6, 2, 8, dtype=torch.float64, device=DEVICE)), TypeError, "output.dtype"),
    ("output_lse_shape", dict(output_lse=torch.zeros(2, 5, device=DEVICE)), ValueError, "output_lse.shape"),
    ("output_expanded", dict(output=torch.zeros(1, 2, 8, dtype=torch.bfloat16, device=DEVICE).expand(6, 2, 8)),
     ValueError, "output has elements that share memory"),
    ("output_lse_expanded", dict(output_lse=torch.zeros(2, 1, device=DEVICE).expand(2, 6)), ValueError,
     "output_lse has elements that share memory"),
    ("only_qsl", dict(query_start_loc=QSL), ValueError, "go together"),
    ("only_cu", dict(cu_seq_lens=CU), ValueError, "go together"),
    ("cu_one_row", dict(query_start_loc=QSL, cu_seq_lens=CU[0]), ValueError, "cu_seq_lens must have 2 dims"),
    ("cu_wrong_n", dict(query_start_loc=QSL, cu_seq_lens=CU[:2]), ValueError, r"cu_seq_lens must be i32\[N, R\+1\]"),
    ("cu_wrong_r", dict(query_start_loc=QSL, cu_seq_lens=CU[:, :2]), ValueError, r"cu_seq_lens must be i32\[N, R\+1\]"),
    ("cu_int64", dict(query_start_loc=QSL, cu_seq_lens=CU.long()), TypeError, "cu_seq_lens.dtype"),
    ("fp8_without_scale", dict(output=torch.zeros(6, 2, 8, device=DEVICE).to(FP8)), ValueError,
     "output_scale is required"),
    ("ptwc_tensor", dict(prefill_tokens_with_context=torch.tensor(3)), TypeError, "host int"),
    ("bad_layout", dict(lse_layout="ht"), ValueError, "lse_layout"),
    ("bad_base", dict(lse_base=10), ValueError, "lse_base"),
    ("lses_other_device", dict(lses=torch.zeros(3, 2, 6, device="meta")), ValueError, "meta"),
]


@pytest.mark.parametrize("changes,error,match", [e[1:] for e in ERRORS], ids=[e[0] for e in ERRORS])
def test_input_errors(changes, error, match):
    with pytest.raises(error, match=match):
        _call(**changes)


@pytest.mark.parametrize("changes,match", [
    pytest.param(dict(prefill_tokens_with_context=7), "prefill_tokens_with_context=7", id="ptwc_past_T"),
    pytest.param(dict(query_start_loc=QSL, cu_seq_lens=torch.tensor([[0, 0, 3], [0, 2, 1], [0, 0, 0]], **I32)),
                 r"cu_seq_lens\[1\] must be non-decreasing", id="cu_row_decreasing"),
    pytest.param(dict(query_start_loc=QSL, cu_seq_lens=torch.tensor([[0, 0, 3], [1, 1, 2], [0, 0, 0]], **I32)),
                 r"cu_seq_lens\[1\]\[0\] must be 0", id="cu_row_not_from_0"),
    pytest.param(dict(query_start_loc=torch.tensor([0, 2, 9], **I32), cu_seq_lens=CU), "past the token",
                 id="qsl_past_T"),
])
def test_validate_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        _call(validate=True, **changes)


def test_validate_accepts_valid_inputs():
    _call(validate=True, prefill_tokens_with_context=6, query_start_loc=QSL, cu_seq_lens=CU)
