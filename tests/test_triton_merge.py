"""triton_impl.merge_attn_states: what only the Triton kernel has (docs/spec.md 4).

The behaviour every implementation shares (the reference on the workloads, bit copies, empty sides, properties,
shared errors) is tested once in tests/test_op_merge.py. Here: LSE buffers through transposed views, every tensor
with its own strides, merging into the prefix buffer, torch-only arguments (devices, overlaps, expanded views) and
the compile keys. Runs in the process's Triton mode (conftest): the interpreter on CPU, compiled on a GPU.
"""

import dataclasses

import numpy as np
import pytest
import torch
from merge_checks import assert_merge_matches_reference
from op_support import check_merge, run
from triton_keys import Recorder, assert_one_variant, kernel_params, lse_strides, variants

import triton_impl
from parity.library import bridge
from parity.harness import cases
from parity.library.compare import assert_bitwise_equal
from mla_lse_common import constants
from triton_impl import _backend as triton_backend
from triton_impl import _plans as triton_plans
from triton_impl import merge as merge_mod

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _tiny_lens(seed: int, num_requests: int, max_len: int = 3) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    return tuple(int(x) for x in rng.integers(0, max_len + 1, size=num_requests))


def _merge_case(case, *, ptwc, check=True):
    """The Triton merge (fused mask, NaN-poisoned output buffers, `op_support.run`) of a case with `ptwc`; checked
    against the reference unless `check` is False."""
    case = dataclasses.replace(case, prefill_tokens_with_context=ptwc)
    arrays = cases.make_inputs(case)
    res = run("triton", "merge_fused", case, arrays)
    if check:
        check_merge("triton", case, "merge_fused", arrays, res)
    return res


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
    assert_merge_matches_reference(dataclasses.replace(case, prefill_tokens_with_context=30), "merge_fused", inp,
                                   *results[stored], name="merge")


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
    case = cases.Case("own_strides", (_T,), (), num_heads=_H, head_dim=_D, dtype="float32",
                      prefill_tokens_with_context=30)
    assert_merge_matches_reference(case, "merge", dict(prefix_output=a, prefix_lse=p, suffix_output=b, suffix_lse=s,
                                                       query_start_loc=np.array([0, _T], np.int32)),
                                   t["output"], t["output_lse"], name="merge")


# --------------------------------------------------------------------------------------------------------
# No recompilation


def test_runtime_values_are_not_specialised():
    for layout in constants.LSE_LAYOUTS:
        names, constexprs, dns, _ = kernel_params(merge_mod._merge_attn_states_kernel[layout])
        runtime = {"prefill_tokens_with_context", "num_tokens", "num_requests"}
        assert runtime <= set(names)
        assert not runtime & constexprs
        assert runtime <= dns, f"{runtime - dns} would be specialised (a recompile when they hit 1 or 16k)"


def _recorded_keys(monkeypatch, lse_layout, batches, make_case):
    """The specialisation keys of `lse_layout`'s kernel over `_merge_case` launches of `make_case(query_lens,
    padding)`, one per batch (query_lens, padding, ptwc): the kernel is replaced by a recorder, so this runs no
    interpreter and checks nothing."""
    recorder = Recorder(merge_mod._merge_attn_states_kernel)
    monkeypatch.setattr(merge_mod, "_merge_attn_states_kernel", recorder)
    monkeypatch.setattr(triton_backend, "interpreting", lambda: False)  # record the compiled launch arguments
    monkeypatch.setattr(triton_backend, "triton_runs_on", lambda device: True)
    monkeypatch.setattr(triton_plans, "PLANS", {})  # launch plans made under that mode only
    for query_lens, padding, ptwc in batches:
        _merge_case(make_case(query_lens, padding), ptwc=ptwc, check=False)
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
    monkeypatch.setattr(triton_backend, "triton_runs_on", lambda device: True)
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

_BUF = torch.zeros(7, 2, 8, **BF16)
_SHIFTED = (_BUF[1:], _BUF[:6])  # two [6, 2, 8] views of one buffer, one token apart
_BUF_LSE = torch.zeros(13, device=DEVICE)
_SHIFTED_LSE = (_BUF_LSE[1:13].view(2, 6), _BUF_LSE[0:12].view(2, 6))  # [2, 6] views one element apart

# The errors every implementation shares (dtypes, shapes, scales, offsets, layouts, validate=True) are in
# test_op_merge.py; these are torch's: the output buffers, tensors, devices and memory shared between elements.
TORCH_ERRORS = [
    ("output_dtype", dict(output=torch.zeros(6, 2, 8, dtype=torch.float64, device=DEVICE)), TypeError, "output.dtype"),
    ("output_lse_f16", dict(output_lse=torch.zeros(2, 6, dtype=torch.float16, device=DEVICE)), TypeError,
     "output_lse.dtype"),
    ("output_numpy", dict(output=np.zeros((6, 2, 8), np.float32)), TypeError, "torch.Tensor"),
    ("output_shape", dict(output=torch.zeros(6, 3, 8, **BF16)), ValueError, "output.shape"),
    ("output_lse_shape", dict(output_lse=torch.zeros(2, 5, device=DEVICE)), ValueError, "output_lse.shape"),
    ("ptwc_tensor", dict(prefill_tokens_with_context=torch.tensor(3)), TypeError, "host int"),
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


@pytest.mark.parametrize("changes,error,match", [e[1:] for e in TORCH_ERRORS], ids=[e[0] for e in TORCH_ERRORS])
def test_torch_argument_errors(changes, error, match):
    with pytest.raises(error, match=match):
        _call(**changes)


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
