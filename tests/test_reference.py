"""parity.harness.reference against numbers computed by hand in each test (docs/spec.md 3-4).

The reference is the one executable definition of the semantics, so it is checked here independently:
tiny arrays whose expected values are written out explicitly, not produced by another implementation.
"""

import math

import numpy as np
import pytest

from parity.harness import reference

LN2 = math.log(2.0)
INF = np.inf
NAN = np.nan


def _rows(*values):
    """f32[T, H=1, D=2] whose token t holds (values[t], -values[t])."""
    return np.array([[[v, -v]] for v in values], dtype=np.float32)


def _lse(*values):
    """f32[H=1, T]."""
    return np.array([values], dtype=np.float32)


def _merge(p_out, p_lse, s_out, s_lse, **kw):
    return reference.merge_attn_states(p_out, p_lse, s_out, s_lse, **kw)


# --------------------------------------------------------------------------------------------------------
# Mask (docs/spec.md 3)


def test_empty_token_mask_by_hand():
    # Requests of 2, 0, 3, 1 tokens; the second and third are empty in the chunk; 2 padding tokens.
    qsl = np.array([0, 2, 2, 5, 6], np.int32)
    cu = np.array([0, 4, 4, 4, 9], np.int32)
    got = reference.empty_token_mask(qsl, cu, 8)
    np.testing.assert_array_equal(got, [False, False, True, True, True, False, False, False])


def test_mask_upstream_vector():
    # The upstream test vector: request 1 (131 tokens) is empty -> lse[:, 2:133] = -inf.
    qsl = np.array([0, 2, 133, 134], np.int32)
    cu = np.array([0, 4, 4, 7], np.int32)
    lse = np.arange(4 * 134, dtype=np.float32).reshape(4, 134)
    got, out = reference.mask_empty_context_lse(lse, qsl, cu)
    assert out is None
    assert np.all(got[:, 2:133] == -INF)
    np.testing.assert_array_equal(got[:, :2], lse[:, :2])
    np.testing.assert_array_equal(got[:, 133:], lse[:, 133:])
    assert lse[0, 2] == 2.0  # the input is not modified


def test_mask_th_layout_output_and_padding_keep_bits():
    qsl = np.array([0, 1, 3], np.int32)
    cu = np.array([0, 0, 5], np.int32)  # request 0 (token 0) is empty
    lse_th = np.array([[1.0, 2.0], [3.0, NAN], [5.0, 6.0], [NAN, NAN]], np.float32)  # [T=4, H=2], 1 pad token
    out = np.full((4, 2, 3), 7.0, np.float32)
    out[3] = NAN
    got, got_out = reference.mask_empty_context_lse(lse_th, qsl, cu, out, lse_layout="TH")
    want = lse_th.copy()
    want[0] = -INF
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    want_out = out.copy()
    want_out[0] = 0.0
    np.testing.assert_array_equal(got_out.view(np.uint32), want_out.view(np.uint32))


def test_mask_bad_layout():
    with pytest.raises(ValueError, match="lse_layout"):
        reference.mask_empty_context_lse(np.zeros((1, 1), np.float32), [0, 1], [0, 0], lse_layout="HD")


# --------------------------------------------------------------------------------------------------------
# Merge (docs/spec.md 4)


def test_equal_lse_averages_and_adds_ln2():
    out, lse = _merge(_rows(2.0), _lse(1.5), _rows(4.0), _lse(1.5))
    np.testing.assert_allclose(out[0, 0], [3.0, -3.0], rtol=1e-15)
    np.testing.assert_allclose(lse, [[1.5 + LN2]], rtol=1e-15)


def test_weights_one_quarter_three_quarters():
    # p = 0, s = ln 3 -> exp weights 1 : 3, so wp = 1/4, ws = 3/4 and lse = ln 4.
    out, lse = _merge(_rows(8.0), _lse(0.0), _rows(4.0), _lse(math.log(3.0)))
    np.testing.assert_allclose(out[0, 0], [8.0 / 4 + 4.0 * 3 / 4, -(8.0 / 4 + 4.0 * 3 / 4)], rtol=1e-7)
    np.testing.assert_allclose(lse, [[math.log(4.0)]], rtol=1e-7)


def test_large_lse_is_stable():
    # Both LSEs near 1000: a naive exp would overflow; the max-subtraction keeps the weights 1/2.
    out, lse = _merge(_rows(1.0), _lse(1000.0), _rows(3.0), _lse(1000.0))
    np.testing.assert_allclose(out[0, 0], [2.0, -2.0], rtol=1e-15)
    np.testing.assert_allclose(lse, [[1000.0 + LN2]], rtol=1e-15)


@pytest.mark.parametrize("empty_lse", [-INF, INF, NAN], ids=["-inf", "+inf", "nan"])
def test_empty_prefix_returns_suffix_exactly(empty_lse):
    # docs/spec.md 4.1/4.3: an empty prefix (its output NaN garbage) contributes exactly nothing.
    out, lse = _merge(_rows(NAN), _lse(empty_lse), _rows(1.25), _lse(0.75))
    np.testing.assert_array_equal(out[0, 0], [1.25, -1.25])
    np.testing.assert_array_equal(lse, [[np.float32(0.75)]])


@pytest.mark.parametrize("empty_lse", [-INF, INF, NAN], ids=["-inf", "+inf", "nan"])
def test_empty_suffix_returns_prefix_exactly(empty_lse):
    out, lse = _merge(_rows(-3.5), _lse(-2.0), _rows(NAN), _lse(empty_lse))
    np.testing.assert_array_equal(out[0, 0], [-3.5, 3.5])
    np.testing.assert_array_equal(lse, [[-2.0]])


@pytest.mark.parametrize("p,s", [(-INF, -INF), (INF, INF), (NAN, NAN), (INF, -INF), (NAN, INF)],
                         ids=["-inf,-inf", "+inf,+inf", "nan,nan", "+inf,-inf", "nan,+inf"])
def test_both_empty_gives_zero_and_neg_inf(p, s):
    # docs/spec.md 4.2: the identity of the merge, never NaN, whatever garbage the outputs hold.
    out, lse = _merge(_rows(NAN), _lse(p), _rows(INF), _lse(s))
    np.testing.assert_array_equal(out[0, 0], [0.0, 0.0])
    assert lse[0, 0] == -INF


def test_underflowed_weight_does_not_leak_nan():
    # docs/spec.md 4.3: a gap of 1000 makes exp(p - m) exactly 0 even in float64; the NaN prefix must not leak.
    out, lse = _merge(_rows(NAN), _lse(-990.0), _rows(2.0), _lse(10.0))
    np.testing.assert_array_equal(out[0, 0], [2.0, -2.0])
    np.testing.assert_array_equal(lse, [[10.0]])


def test_base2():
    # Base 2: p = 0, s = log2(3) -> weights 1/4, 3/4 and lse = log2(4) = 2 (base 2 out too).
    out, lse = _merge(_rows(8.0), _lse(0.0), _rows(4.0), _lse(math.log2(3.0)), lse_base=2)
    np.testing.assert_allclose(out[0, 0], [5.0, -5.0], rtol=1e-7)
    np.testing.assert_allclose(lse, [[2.0]], rtol=1e-7)
    # Equal base-2 LSEs add exactly 1 (log2 of 2).
    out, lse = _merge(_rows(1.0), _lse(3.0), _rows(2.0), _lse(3.0), lse_base=2)
    np.testing.assert_allclose(out[0, 0], [1.5, -1.5], rtol=1e-15)
    np.testing.assert_allclose(lse, [[4.0]], rtol=1e-15)


def test_th_layout_is_the_transpose():
    # H=2, T=3: the same numbers given [H, T] and [T, H].
    rng = np.random.default_rng(0)
    a = rng.standard_normal((3, 2, 4)).astype(np.float32)
    b = rng.standard_normal((3, 2, 4)).astype(np.float32)
    p = np.array([[0.0, 1.0, -INF], [2.0, INF, 0.5]], np.float32)
    s = np.array([[1.0, -1.0, 3.0], [2.0, 0.0, NAN]], np.float32)
    out_ht, lse_ht = _merge(a, p, b, s)
    out_th, lse_th = _merge(a, p.T.copy(), b, s.T.copy(), lse_layout="TH")
    np.testing.assert_array_equal(out_ht, out_th)
    np.testing.assert_array_equal(lse_ht, lse_th.T)
    # Token 0 head 1: equal LSEs 2, 2 -> average, 2 + ln 2. Token 2 head 0: prefix empty -> suffix.
    np.testing.assert_allclose(out_ht[0, 1], (a[0, 1] + b[0, 1]) / 2, rtol=1e-7)
    np.testing.assert_allclose(lse_ht[1, 0], 2.0 + LN2, rtol=1e-15)
    np.testing.assert_array_equal(out_ht[2, 0], b[2, 0])
    assert lse_ht[0, 2] == 3.0


def test_pass_through_rows_copy_raw_suffix():
    # docs/spec.md 4.4: tokens >= prefill_tokens_with_context hold the suffix row and its raw LSE (+inf stays +inf).
    a, b = _rows(1.0, 2.0, 3.0), _rows(5.0, NAN, 7.0)
    out, lse = _merge(a, _lse(0.0, 0.0, 0.0), b, _lse(0.0, INF, 4.0), prefill_tokens_with_context=1)
    np.testing.assert_allclose(out[0, 0], [3.0, -3.0], rtol=1e-15)  # token 0 is merged (equal LSEs)
    np.testing.assert_allclose(lse[0, 0], LN2, rtol=1e-15)
    assert np.isnan(out[1]).all()
    np.testing.assert_array_equal(out[2, 0], [7.0, -7.0])
    assert lse[0, 1] == INF and lse[0, 2] == 4.0


def test_pass_through_lse_is_raw_in_base2():
    # No base conversion on copied rows: the stored base-2 value comes back unchanged.
    _, lse = _merge(_rows(1.0), _lse(0.0), _rows(1.0), _lse(0.1), prefill_tokens_with_context=0, lse_base=2)
    assert lse[0, 0] == np.float64(np.float32(0.1))


def test_fused_mask_equals_mask_then_merge():
    rng = np.random.default_rng(1)
    qsl = np.array([0, 3, 3, 7, 9], np.int32)  # 4 requests (one of 0 tokens), 1 padding token
    cu = np.array([0, 0, 2, 2, 5], np.int32)  # requests 0 and 2 are empty
    a = rng.standard_normal((10, 2, 3)).astype(np.float32)
    b = rng.standard_normal((10, 2, 3)).astype(np.float32)
    p = rng.normal(1.0, 2.0, (2, 10)).astype(np.float32)
    s = rng.normal(1.0, 2.0, (2, 10)).astype(np.float32)
    a[0:3] = NAN  # garbage under the finite prefix LSE of empty request 0
    fused = _merge(a, p, b, s, query_start_loc=qsl, prefix_cu_seq_lens=cu)
    masked_p, _ = reference.mask_empty_context_lse(p, qsl, cu)
    two_step = _merge(a, masked_p, b, s)
    np.testing.assert_array_equal(fused[0], two_step[0])
    np.testing.assert_array_equal(fused[1], two_step[1])
    # The empty requests' rows are the suffix exactly; the others are true merges.
    np.testing.assert_array_equal(fused[0][0:3], b[0:3])
    np.testing.assert_array_equal(fused[0][3:7], b[3:7])
    assert not np.isnan(fused[0][:9]).any()


def test_n_way_pass_through_lse_follows_the_fused_mask():
    # docs/spec.md 8.4: a pass-through token copies the last partial's row and raw LSE bits, and with the offsets
    # a request with no KV in the last partial copies LSE -inf (the mask, then the merge), whatever the partial
    # holds; the row is still the last partial's own.
    qsl = np.array([0, 2, 4], np.int32)  # request 0: tokens 0-1, request 1: tokens 2-3; tokens >= 1 pass through
    cu = np.array([[0, 3, 5], [0, 2, 2]], np.int32)  # partial 1 (the last) has no KV for request 1
    outputs = np.stack([_rows(1.0, 2.0, 3.0, 4.0), _rows(5.0, 6.0, NAN, 8.0)])
    lses = np.stack([_lse(0.0, 0.0, 0.0, 0.0), _lse(0.0, 1.5, 3.0, INF)])
    out, lse = reference.merge_attn_states_n(outputs, lses, prefill_tokens_with_context=1, query_start_loc=qsl,
                                             cu_seq_lens=cu)
    np.testing.assert_allclose(out[0, 0], [3.0, -3.0], rtol=1e-15)  # token 0 is merged (equal LSEs)
    np.testing.assert_array_equal(out[1, 0], [6.0, -6.0])
    assert np.isnan(out[2]).all()
    np.testing.assert_array_equal(out[3, 0], [8.0, -8.0])
    assert lse[0, 1] == 1.5 and lse[0, 2] == -INF and lse[0, 3] == -INF
    # Without the offsets the copy is raw; the masked LSEs then merged give the fused result.
    _, raw = reference.merge_attn_states_n(outputs, lses, prefill_tokens_with_context=1)
    assert raw[0, 2] == 3.0 and raw[0, 3] == INF
    masked = np.stack([reference.mask_empty_context_lse(lses[i], qsl, cu[i])[0] for i in range(2)])
    two_step = reference.merge_attn_states_n(outputs, masked, prefill_tokens_with_context=1)
    np.testing.assert_array_equal(two_step[0], out)
    np.testing.assert_array_equal(two_step[1], lse)


def test_fp8_scale_and_clamp():
    # docs/spec.md 4.6: out / scale, clamped to +-448 (the caller casts to e4m3).
    out, lse = _merge(_rows(10.0, 1.0), _lse(0.0, 0.0), _rows(30.0, 3.0), _lse(0.0, 0.0),
                      output_scale=np.array([0.01], np.float32))
    scale = float(np.float32(0.01))
    np.testing.assert_array_equal(out[0, 0], [448.0, -448.0])  # 20 / 0.01 = 2000 -> clamped
    np.testing.assert_allclose(out[1, 0], [2.0 / scale, -2.0 / scale], rtol=1e-15)  # 200: inside the range
    np.testing.assert_allclose(lse, [[LN2, LN2]], rtol=1e-15)  # the LSE is not scaled


def test_inputs_not_modified():
    a, b = _rows(1.0, 2.0), _rows(3.0, 4.0)
    p, s = _lse(INF, 0.0), _lse(NAN, 1.0)
    copies = [x.copy() for x in (a, b, p, s)]
    _merge(a, p, b, s, prefill_tokens_with_context=1, query_start_loc=np.array([0, 2], np.int32),
           prefix_cu_seq_lens=np.array([0, 0], np.int32))
    for x, y in zip((a, b, p, s), copies):
        np.testing.assert_array_equal(x.view(np.uint32), y.view(np.uint32))


@pytest.mark.parametrize("kw,match", [(dict(lse_layout="ht"), "lse_layout"), (dict(lse_base=10), "lse_base")])
def test_merge_bad_options(kw, match):
    with pytest.raises(ValueError, match=match):
        _merge(_rows(1.0), _lse(0.0), _rows(1.0), _lse(0.0), **kw)
