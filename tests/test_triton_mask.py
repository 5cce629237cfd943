"""triton_impl.mask_empty_context_lse against parity.harness.reference, bit for bit (docs/spec.md 3).

Runs in the process's Triton mode (conftest): the interpreter on CPU, compiled on a GPU. The interpreter
runs the grid's T // 128 + R programs one by one (R = 1000 takes ~20 s of CPU), so larger R is `gpu` only.
"""

import dataclasses

import numpy as np
import pytest
from triton_keys import Recorder, assert_one_variant, kernel_params
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import triton_impl
from parity.library import bridge
from parity.harness import cases, reference
from parity.library.compare import assert_bitwise_equal
from mla_lse_common import constants, tiles
from triton_impl import _backend as triton_backend
from triton_impl import _plans as triton_plans
from triton_impl import mask as mask_mod

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tiny_lens(seed: int, num_requests: int, max_len: int = 3) -> tuple[int, ...]:
    """Request lengths in [0, max_len]: many zero-length requests, a short T for a large R."""
    rng = np.random.default_rng(seed)
    return tuple(int(x) for x in rng.integers(0, max_len + 1, size=num_requests))


def _every_other(num_requests: int, start: int = 0) -> tuple[int, ...]:
    return tuple(range(start, num_requests, 2))


CI_CASES = cases.select("ci")

# Hand-written edges, each named after what it exercises.
EDGE_CASES = [
    # R = 33: the ownership count crosses a 32-request chunk.
    cases.Case("r33_tiny", _tiny_lens(10, 33), _every_other(33, 1), num_heads=3, head_dim=32,
               dtype="float32", padding=4),
    # R = 65: three 32-request chunks, the last one partial.
    cases.Case("r65_tiny", _tiny_lens(11, 65), _every_other(65), num_heads=2, head_dim=16, padding=3),
    # Zero-length requests, empty and not, at the start, middle and end.
    cases.Case("zero_len", (0, 0, 5, 0, 3, 0), (0, 2, 3, 5), num_heads=4, head_dim=32, padding=2),
    # Block edges shifted by one token: requests start at 1, 128, 256, 385 and end past them.
    cases.Case("block_edges_shifted", (1, 127, 128, 129, 256), (1, 2, 3, 4), num_heads=2, head_dim=16,
               dtype="float32"),
    # H not a power of two: 5 (one masked head tile) and 20 (two LSE head tiles of 16).
    cases.Case("h5", (40, 0, 130), (0, 1), num_heads=5, head_dim=64, dtype="float16", padding=9),
    cases.Case("h20_th", (17, 140, 5), (1, 2), num_heads=20, head_dim=24, lse_layout="TH", padding=6),
]


def _offsets(case, seed=0):
    qsl, cu = cases.offsets(case, seed)
    return qsl, cu, bridge.to_torch(qsl, DEVICE), bridge.to_torch(cu, DEVICE)


def _check_mask_case(case, *, zero_output=True, seed=0):
    """Masks the case's prefix LSE (and zeroes the D-column view of its padded output buffer) and checks
    every bit against the reference; padding tokens and padding columns keep their NaN bits."""
    inp = cases.make_inputs(case, seed)
    qsl, cu, qsl_t, cu_t = _offsets(case, seed)
    D = case.head_dim
    lse = bridge.to_torch(inp["prefix_lse"], DEVICE)
    buf = bridge.to_torch(inp["prefix_output"], DEVICE)  # [T, H, D + head_pad]
    out = buf[..., :D] if zero_output else None
    triton_impl.mask_empty_context_lse(lse, qsl_t, cu_t, out, lse_layout=case.lse_layout)

    want_lse, want_out = reference.mask_empty_context_lse(
        inp["prefix_lse"], qsl, cu, inp["prefix_output"][..., :D] if zero_output else None,
        lse_layout=case.lse_layout)
    assert_bitwise_equal(lse, want_lse, name="mask.lse", case=case, seed=seed)
    want_buf = inp["prefix_output"].copy()
    if zero_output:
        want_buf[..., :D] = want_out
    assert_bitwise_equal(buf, want_buf, name="mask.output", case=case, seed=seed)
    return lse, buf


@pytest.mark.parametrize("case", CI_CASES, ids=lambda c: c.name)
def test_ci_cases_match_reference(case):
    _check_mask_case(case)


@pytest.mark.parametrize("case", EDGE_CASES, ids=lambda c: c.name)
def test_edge_cases_match_reference(case):
    _check_mask_case(case)


@pytest.fixture
def small_splits(monkeypatch):
    """Caps the mask's programs per block at 3 (LSE-only; at most 3 head tiles) and 5 (zeroing), whatever the grid
    size: the round-robin deal of a block's tiles, with programs left without a tile of one kind."""
    monkeypatch.setattr(tiles, "MASK_TARGET_PROGRAMS", 1 << 30)
    monkeypatch.setattr(tiles, "MASK_LSE_SPLIT", 3)
    monkeypatch.setattr(tiles, "MASK_ZERO_SPLIT", 5)
    monkeypatch.setattr(triton_plans, "PLANS", {})  # launch plans hold the grid
    tiles.mask_split.cache_clear()
    yield
    tiles.mask_split.cache_clear()


SPLIT_CASES = [
    # H = 40: three LSE head tiles of 16; D = 48 zeroed in 20 (2 heads x 64 dims) tiles.
    cases.Case("h40_split", (130, 7, 200, 0, 60), (0, 2, 3), num_heads=40, head_dim=48, dtype="float32", padding=5),
    cases.Case("h40_split_th", (3, 250, 1), (1,), num_heads=40, head_dim=48, lse_layout="TH", padding=2),
]


@pytest.mark.parametrize("zero_output", [False, True])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: c.name)
def test_block_split_over_programs(small_splits, case, zero_output):
    grid = tiles.mask_grid(case.num_tokens, case.num_requests, case.num_heads,
                          case.head_dim if zero_output else 1, zero_output)
    assert grid[1] == (5 if zero_output else 3)
    _check_mask_case(case, zero_output=zero_output)


@pytest.mark.gpu
def test_r1100_tiny_requests():
    # R = 1100 requests of 0-3 tokens: the ownership count crosses a 1024-request (32 x 32) coarse step.
    case = cases.Case("r1100_tiny", _tiny_lens(13, 1100), _every_other(1100, 1), num_heads=3, head_dim=16,
                      padding=7)
    _check_mask_case(case)


def test_upstream_vector():
    # vLLM's test vector: request 1 (tokens 2..132) has an empty chunk -> lse[:, 2:133] = -inf.
    qsl = torch.tensor([0, 2, 133, 134], dtype=torch.int32, device=DEVICE)
    cu = torch.tensor([0, 4, 4, 7], dtype=torch.int32, device=DEVICE)
    before = torch.randn(4, 134, device=DEVICE)
    lse = before.clone()
    triton_impl.mask_empty_context_lse(lse, qsl, cu)
    assert bool(torch.isneginf(lse[:, 2:133]).all())
    assert torch.equal(lse[:, :2].view(torch.int32), before[:, :2].view(torch.int32))
    assert torch.equal(lse[:, 133:].view(torch.int32), before[:, 133:].view(torch.int32))
    want, _ = reference.mask_empty_context_lse(before.cpu().numpy(), qsl.cpu().numpy(), cu.cpu().numpy())
    assert_bitwise_equal(lse, want, name="mask.lse", query_start_loc=qsl)


def test_lse_only_keeps_every_other_bit():
    # Without `output` only the LSE changes; NaN padding (payload included) keeps its bits.
    _check_mask_case(cases.by_name("r33_ragged_pad"), zero_output=False)


# --------------------------------------------------------------------------------------------------------
# Strides and layouts

_STRIDE_CASE = cases.Case("strides", (3, 0, 130, 7), (0, 2), num_heads=5, head_dim=16, dtype="float32",
                          padding=5)


def _strided_views():
    """(name, make(lse_ht numpy) -> (buffer, view, layout)): views of larger or transposed buffers."""
    def th_buffer_as_ht(x):  # a [T, H] buffer passed as [H, T] through .t()
        buf = bridge.to_torch(np.ascontiguousarray(x.T), DEVICE)
        return buf, buf.t(), "HT"

    def ht_buffer_as_th(x):  # an [H, T] buffer passed as [T, H] through .t()
        buf = bridge.to_torch(x, DEVICE)
        return buf, buf.t(), "TH"

    def sliced(x):  # a window of a larger NaN buffer
        H, T = x.shape
        big = np.full((H + 3, T + 50), np.nan, np.float32)
        big[1:H + 1, 7:T + 7] = x
        buf = bridge.to_torch(big, DEVICE)
        return buf, buf[1:H + 1, 7:T + 7], "HT"

    def stepped(x):  # every other row and every third column of a larger buffer
        H, T = x.shape
        big = np.full((2 * H, 3 * T), np.nan, np.float32)
        big[::2, ::3] = x
        buf = bridge.to_torch(big, DEVICE)
        return buf, buf[::2, ::3], "HT"

    return [th_buffer_as_ht, ht_buffer_as_th, sliced, stepped]


@pytest.mark.parametrize("make_view", _strided_views(), ids=lambda f: f.__name__)
def test_strided_lse(make_view):
    case = _STRIDE_CASE
    inp = cases.make_inputs(case)
    qsl, cu, qsl_t, cu_t = _offsets(case)
    lse_ht = inp["prefix_lse"]  # f32[H, T]
    buf, view, layout = make_view(lse_ht)
    before = bridge.to_numpy(buf).copy()
    triton_impl.mask_empty_context_lse(view, qsl_t, cu_t, lse_layout=layout)
    want_ht, _ = reference.mask_empty_context_lse(lse_ht, qsl, cu)
    got_ht = view if layout == "HT" else view.t()
    assert_bitwise_equal(got_ht, want_ht, name="mask.lse", case=case)
    # Nothing outside the view changed: the same buffer with only the view's elements replaced.
    want_buf = torch.from_numpy(before).to(DEVICE)
    want_view = want_buf.as_strided(view.shape, view.stride(), view.storage_offset())
    want_view.copy_(bridge.to_torch(want_ht if layout == "HT" else np.ascontiguousarray(want_ht.T), DEVICE))
    assert_bitwise_equal(buf, want_buf, name="mask.buffer", layout="flat")


def test_strided_output_zeroing():
    # The output is a [T, H, D] view of an [H, T, D + 8] buffer: token stride D + 8, head stride T*(D + 8).
    case = _STRIDE_CASE
    inp = cases.make_inputs(case)
    qsl, cu, qsl_t, cu_t = _offsets(case)
    T, H, D = case.num_tokens, case.num_heads, case.head_dim
    data = np.full((H, T, D + 8), np.nan, np.float32)
    data[..., :D] = inp["prefix_output"].transpose(1, 0, 2)
    buf = bridge.to_torch(data, DEVICE)
    out = buf.permute(1, 0, 2)[..., :D]
    lse = bridge.to_torch(inp["prefix_lse"], DEVICE)
    triton_impl.mask_empty_context_lse(lse, qsl_t, cu_t, out)
    want_lse, want_out = reference.mask_empty_context_lse(inp["prefix_lse"], qsl, cu, inp["prefix_output"])
    assert_bitwise_equal(lse, want_lse, name="mask.lse", case=case)
    want_buf = data.copy()
    want_buf[..., :D] = want_out.transpose(1, 0, 2)
    assert_bitwise_equal(buf, want_buf, name="mask.output_buffer", layout="flat")
    empty = reference.empty_token_mask(qsl, cu, T)
    assert bool((out[torch.from_numpy(empty).to(DEVICE)] == 0).all())


def test_th_layout_equals_ht_transposed():
    case = dataclasses.replace(_STRIDE_CASE, name="strides_th", lse_layout="TH")
    lse_th, _ = _check_mask_case(case, zero_output=False)
    lse_ht, _ = _check_mask_case(_STRIDE_CASE, zero_output=False)
    assert torch.equal(lse_th.t().contiguous().view(torch.int32), lse_ht.view(torch.int32))


# --------------------------------------------------------------------------------------------------------
# Guard, idempotence, small shapes


def test_has_empty_false_changes_nothing_and_launches_nothing(monkeypatch):
    case = cases.by_name("upstream_vector")
    inp = cases.make_inputs(case)
    _, _, qsl_t, cu_t = _offsets(case)
    lse = bridge.to_torch(inp["prefix_lse"], DEVICE)
    out = bridge.to_torch(inp["prefix_output"], DEVICE)

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError(f"kernel launched with grid {grid} although has_empty=False")

    monkeypatch.setattr(mask_mod, "_mask_empty_context_lse_kernel",
                        dict.fromkeys(constants.LSE_LAYOUTS, NoLaunch()))
    triton_impl.mask_empty_context_lse(lse, qsl_t, cu_t, out, has_empty=False)
    assert_bitwise_equal(lse, inp["prefix_lse"], name="mask.lse")
    assert_bitwise_equal(out, inp["prefix_output"], name="mask.output")
    with pytest.raises(AssertionError, match="has_empty=False"):  # the guard is what stopped it
        triton_impl.mask_empty_context_lse(lse, qsl_t, cu_t, out, has_empty=None)


def test_has_empty_true_is_a_plain_launch():
    case = cases.by_name("block_edges")
    inp = cases.make_inputs(case)
    qsl, cu, qsl_t, cu_t = _offsets(case)
    lse = bridge.to_torch(inp["prefix_lse"], DEVICE)
    triton_impl.mask_empty_context_lse(lse, qsl_t, cu_t, has_empty=True)
    want, _ = reference.mask_empty_context_lse(inp["prefix_lse"], qsl, cu)
    assert_bitwise_equal(lse, want, name="mask.lse", case=case)


def test_idempotent():
    case = cases.by_name("block_edges")
    lse, buf = _check_mask_case(case)
    once_lse, once_buf = lse.clone(), buf.clone()
    _, _, qsl_t, cu_t = _offsets(case)
    triton_impl.mask_empty_context_lse(lse, qsl_t, cu_t, buf[..., :case.head_dim])
    assert_bitwise_equal(lse, once_lse, name="mask.lse (twice)", case=case)
    assert_bitwise_equal(buf, once_buf, name="mask.output (twice)", case=case)


@pytest.mark.parametrize("num_tokens,qsl,cu", [
    (0, [0], [0]),  # R = 0, T = 0
    (5, [0], [0]),  # R = 0: every token is padding
    (0, [0, 0, 0], [0, 0, 3]),  # T = 0, two zero-length requests
], ids=["r0_t0", "r0_padding", "t0_r2"])
def test_nothing_to_mask(num_tokens, qsl, cu):
    lse = torch.full((3, num_tokens), float("nan"), device=DEVICE)
    before = lse.clone()
    triton_impl.mask_empty_context_lse(lse, torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
                                       torch.tensor(cu, dtype=torch.int32, device=DEVICE), validate=True)
    assert torch.equal(lse.view(torch.int32), before.view(torch.int32))


# --------------------------------------------------------------------------------------------------------
# has_empty_context


@pytest.mark.parametrize("lens,want", [
    ([3, 0, 2], True), ([1, 2], False), ([], False),
    (np.array([4, 5, 0], np.int32), True), (np.array([4, 5], np.int64), False),
    (torch.tensor([0, 1], dtype=torch.int32), True), (torch.tensor([7], dtype=torch.int32), False),
], ids=["list_empty", "list_full", "list_none", "numpy_empty", "numpy_full", "tensor_empty", "tensor_full"])
def test_has_empty_context(lens, want):
    got = triton_impl.has_empty_context(lens)
    assert type(got) is bool and got is want


def test_has_empty_context_refuses_device_tensors():
    with pytest.raises(ValueError, match="meta"):
        triton_impl.has_empty_context(torch.zeros(3, dtype=torch.int32, device="meta"))


# --------------------------------------------------------------------------------------------------------
# Errors


def _valid():
    """Valid arguments (T=6, H=2, R=2) for the error tests."""
    return dict(lse=torch.zeros(2, 6, device=DEVICE),
                query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32, device=DEVICE),
                cu_seq_lens=torch.tensor([0, 0, 4], dtype=torch.int32, device=DEVICE),
                output=torch.zeros(6, 2, 8, device=DEVICE))


def _call(**changes):
    kw = _valid()
    kw.update(changes)
    args = [kw.pop(k) for k in ("lse", "query_start_loc", "cu_seq_lens", "output")]
    triton_impl.mask_empty_context_lse(*args, **kw)


I32 = dict(dtype=torch.int32, device=DEVICE)
_FLAT = torch.zeros(104, device=DEVICE)
_OVERLAPPING = (_FLAT[:12].view(2, 6), _FLAT[8:].view(6, 2, 8))  # lse and output share 4 floats

ALWAYS_ERRORS = [
    ("lse_rank1", dict(lse=torch.zeros(6, device=DEVICE)), ValueError, "lse must have 2 dims"),
    ("lse_rank3", dict(lse=torch.zeros(2, 6, 1, device=DEVICE)), ValueError, "lse must have 2 dims"),
    ("lse_f16", dict(lse=torch.zeros(2, 6, dtype=torch.float16, device=DEVICE)), TypeError, "lse.dtype"),
    ("lse_f64", dict(lse=torch.zeros(2, 6, dtype=torch.float64, device=DEVICE)), TypeError, "lse.dtype"),
    ("lse_numpy", dict(lse=np.zeros((2, 6), np.float32)), TypeError, "torch.Tensor"),
    ("qsl_int64", dict(query_start_loc=torch.tensor([0, 2, 5], device=DEVICE)), TypeError, "query_start_loc"),
    ("cu_int64", dict(cu_seq_lens=torch.tensor([0, 0, 4], device=DEVICE)), TypeError, "cu_seq_lens"),
    ("qsl_rank2", dict(query_start_loc=torch.tensor([[0, 2, 5]], **I32)), ValueError, "query_start_loc"),
    ("qsl_no_entries", dict(query_start_loc=torch.zeros(0, **I32), cu_seq_lens=torch.zeros(0, **I32)),
     ValueError, "R\\+1"),
    ("offset_lengths", dict(cu_seq_lens=torch.tensor([0, 4], **I32)), ValueError, "cu_seq_lens.shape"),
    ("output_tokens", dict(output=torch.zeros(7, 2, 8, device=DEVICE)), ValueError, "output.shape"),
    ("output_heads", dict(output=torch.zeros(6, 3, 8, device=DEVICE)), ValueError, "output.shape"),
    ("output_rank2", dict(output=torch.zeros(6, 2, device=DEVICE)), ValueError, "output must have 3 dims"),
    ("output_int32", dict(output=torch.zeros(6, 2, 8, **I32)), TypeError, "output.dtype"),
    ("output_fp8", dict(output=torch.zeros(6, 2, 8, device=DEVICE).to(torch.float8_e4m3fn)), TypeError,
     "output.dtype"),
    ("bad_layout", dict(lse_layout="ht"), ValueError, "lse_layout"),
    # lse_layout="TH" reads lse as [T=2, H=6]: the [6, 2, 8] output no longer fits.
    ("th_with_ht_lse", dict(lse_layout="TH"), ValueError, "output.shape"),
    ("qsl_other_device", dict(query_start_loc=torch.tensor([0, 2, 5], dtype=torch.int32, device="meta")),
     ValueError, "meta"),
    ("cu_other_device", dict(cu_seq_lens=torch.tensor([0, 0, 4], dtype=torch.int32, device="meta")),
     ValueError, "meta"),
    ("output_other_device", dict(output=torch.zeros(6, 2, 8, device="meta")), ValueError, "meta"),
    # Written in place: no two elements may share memory (an expanded view would race).
    ("lse_expanded", dict(lse=torch.zeros(1, 6, device=DEVICE).expand(2, 6)), ValueError,
     "lse has elements that share memory"),
    ("output_expanded", dict(output=torch.zeros(6, 1, 8, device=DEVICE).expand(6, 2, 8)), ValueError,
     "output has elements that share memory"),
    ("output_overlaps_lse", dict(zip(("lse", "output"), _OVERLAPPING)), ValueError, "output partially overlaps lse"),
]


@pytest.mark.parametrize("changes,error,match", [e[1:] for e in ALWAYS_ERRORS], ids=[e[0] for e in ALWAYS_ERRORS])
def test_always_on_errors(changes, error, match):
    with pytest.raises(error, match=match):
        _call(**changes)


def test_always_on_errors_precede_the_guard():
    # The metadata checks run even when nothing is launched.
    with pytest.raises(TypeError, match="query_start_loc"):
        _call(query_start_loc=torch.tensor([0, 2, 5], device=DEVICE), has_empty=False)


VALIDATE_ERRORS = [
    ("qsl_not_from_0", dict(query_start_loc=torch.tensor([1, 2, 5], **I32)), "query_start_loc\\[0\\] must be 0"),
    ("cu_not_from_0", dict(cu_seq_lens=torch.tensor([2, 2, 4], **I32)), "cu_seq_lens\\[0\\] must be 0"),
    ("qsl_decreasing", dict(query_start_loc=torch.tensor([0, 3, 2], **I32)), "non-decreasing"),
    ("cu_decreasing", dict(cu_seq_lens=torch.tensor([0, 4, 1], **I32)), "non-decreasing"),
    ("qsl_past_T", dict(query_start_loc=torch.tensor([0, 2, 7], **I32)), "past the token count"),
]


@pytest.mark.parametrize("changes,match", [e[1:] for e in VALIDATE_ERRORS], ids=[e[0] for e in VALIDATE_ERRORS])
def test_validate_errors(changes, match):
    _call(**changes)  # the always-on tier does not read values: no error, no sync
    with pytest.raises(ValueError, match=match):
        _call(validate=True, **changes)


def test_validate_accepts_valid_offsets():
    kw = _valid()
    lse, out = kw["lse"], kw["output"]
    triton_impl.mask_empty_context_lse(lse, kw["query_start_loc"], kw["cu_seq_lens"], out, validate=True)
    assert bool(torch.isneginf(lse[:, :2]).all()) and bool((lse[:, 2:] == 0).all())


# --------------------------------------------------------------------------------------------------------
# Properties (Hypothesis, deterministic "ci" profile from conftest)


@st.composite
def mask_cases(draw):
    """A Case with zero-length requests, random empty flags, a NaN padding tail, H not a power of two and
    R crossing 32-request scan boundaries."""
    num_requests = draw(st.integers(0, 40))
    lens = draw(st.lists(st.one_of(st.just(0), st.integers(1, 6)), min_size=num_requests, max_size=num_requests))
    for r in draw(st.lists(st.integers(0, max(0, num_requests - 1)), max_size=2 if num_requests else 0)):
        lens[r] = draw(st.integers(120, 140))  # a few requests around the 128-token block
    flags = draw(st.lists(st.booleans(), min_size=num_requests, max_size=num_requests))
    return cases.Case(
        "hypothesis", tuple(lens), tuple(r for r, f in enumerate(flags) if f),
        num_heads=draw(st.sampled_from([1, 3, 5, 17])), head_dim=draw(st.sampled_from([8, 48])),
        dtype=draw(st.sampled_from(["float32", "bfloat16"])), lse_layout=draw(st.sampled_from(["HT", "TH"])),
        padding=draw(st.integers(0, 9)), head_pad=draw(st.sampled_from([0, 5])))


@given(case=mask_cases(), zero_output=st.booleans())
@settings(max_examples=8)  # ~1 s of interpreter time per example
def test_property_matches_reference_and_is_idempotent(case, zero_output):
    lse, buf = _check_mask_case(case, zero_output=zero_output)
    once_lse, once_buf = lse.clone(), buf.clone()
    _, _, qsl_t, cu_t = _offsets(case)
    triton_impl.mask_empty_context_lse(lse, qsl_t, cu_t, buf[..., :case.head_dim] if zero_output else None,
                                       lse_layout=case.lse_layout)
    assert_bitwise_equal(lse, once_lse, name="mask.lse (twice)", case=case)
    assert_bitwise_equal(buf, once_buf, name="mask.output (twice)", case=case)


@given(case=mask_cases())
@settings(max_examples=6)
def test_property_has_empty_false_changes_nothing(case):
    inp = cases.make_inputs(case)
    _, _, qsl_t, cu_t = _offsets(case)
    lse = bridge.to_torch(inp["prefix_lse"], DEVICE)
    buf = bridge.to_torch(inp["prefix_output"], DEVICE)
    triton_impl.mask_empty_context_lse(lse, qsl_t, cu_t, buf[..., :case.head_dim], has_empty=False,
                                       lse_layout=case.lse_layout)
    assert_bitwise_equal(lse, inp["prefix_lse"], name="mask.lse", case=case)
    assert_bitwise_equal(buf, inp["prefix_output"], name="mask.output", case=case)


# --------------------------------------------------------------------------------------------------------
# No recompilation


def test_runtime_values_are_not_specialised():
    for layout in constants.LSE_LAYOUTS:
        names, constexprs, dns, _ = kernel_params(mask_mod._mask_empty_context_lse_kernel[layout])
        assert "num_requests" in names and "num_requests" not in constexprs
        assert "num_requests" in dns, "R would be specialised (a recompile when it hits 1 or a multiple of 16)"


@pytest.mark.parametrize("lse_layout", ["HT", "TH"])
def test_one_compiled_variant_per_configuration(monkeypatch, lse_layout):
    # The launches of one configuration (H=4, D=16 output, bf16) with new token and request counts (T = 1,
    # R = 1 and multiples of 16 included) must have the same specialisation key: one compiled kernel. The
    # kernel is replaced by a recorder, so this runs no interpreter.
    recorder = Recorder(mask_mod._mask_empty_context_lse_kernel)
    monkeypatch.setattr(mask_mod, "_mask_empty_context_lse_kernel", recorder)
    monkeypatch.setattr(triton_backend, "interpreting", lambda: False)  # record the compiled launch arguments
    monkeypatch.setattr(triton_plans, "PLANS", {})  # launch plans made under that mode only
    batches = [(5, 0, 130), (64, 64, 1), (1,), (16,), _tiny_lens(20, 40, 9), _tiny_lens(21, 7, 50), (0, 48)]
    for query_lens in batches:
        case = cases.Case("recompile", query_lens, _every_other(len(query_lens)), num_heads=4, head_dim=16,
                          lse_layout=lse_layout)
        inp = cases.make_inputs(case)
        _, _, qsl_t, cu_t = _offsets(case)
        triton_impl.mask_empty_context_lse(bridge.to_torch(inp["prefix_lse"], DEVICE), qsl_t, cu_t,
                                           bridge.to_torch(inp["prefix_output"], DEVICE), lse_layout=lse_layout)
    assert len(recorder[lse_layout].launches) == len(batches)
    keys = recorder[lse_layout].keys()
    assert_one_variant(keys, "mask")
    # [H, T]: head stride T runtime, token stride 1 specialised; [T, H]: head stride 1, token stride H = 4.
    want = dict(stride_lse_h=("i32", None), stride_lse_t=("constexpr", 1)) if lse_layout == "HT" else \
        dict(stride_lse_h=("constexpr", 1), stride_lse_t=("i32", ""))
    assert {k: keys[0][k] for k in want} == want


@pytest.mark.gpu
@pytest.mark.parametrize("lse_layout", ["HT", "TH"])
def test_no_recompilation_across_batches(lse_layout):
    # R and T are runtime values: new request counts and token counts reuse the compiled kernel.
    kernel = mask_mod._mask_empty_context_lse_kernel[lse_layout]
    shapes = [(3, (5, 0, 130)), (3, (64, 64, 1)), (40, _tiny_lens(20, 40, 9)), (7, _tiny_lens(21, 7, 50))]

    def launch(query_lens):
        case = cases.Case("recompile", query_lens, _every_other(len(query_lens)), num_heads=4, head_dim=16,
                          lse_layout=lse_layout)
        _check_mask_case(case, zero_output=False)

    launch(shapes[0][1])
    cache = kernel.device_caches[torch.cuda.current_device()][0]
    n = len(cache)
    assert n >= 1
    for _, query_lens in shapes[1:]:
        launch(query_lens)
    assert len(cache) == n, f"the mask kernel compiled {len(cache) - n} more variants for new R / T values"
