"""triton_impl.mask_empty_context_lse: what only the Triton kernel has (docs/spec.md 3).

The behaviour every implementation shares (the reference's bits on the workloads, idempotence, the has_empty
guard, shared errors) is tested once in tests/test_op_mask.py. Here: the split of a block over programs, strided
and transposed views, the launch guard, torch-only arguments (devices, tensors, overlaps) and the compile keys.
Runs in the process's Triton mode (conftest): the interpreter on CPU, compiled on a GPU.
"""

import numpy as np
import pytest
import torch
from op_support import check_mask, run
from triton_keys import Recorder, assert_one_variant, kernel_params

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


def _offsets(case, seed=0):
    qsl, cu = cases.offsets(case, seed)
    return qsl, cu, bridge.to_torch(qsl, DEVICE), bridge.to_torch(cu, DEVICE)


def _check_mask_case(case, *, zero_output=True, seed=0):
    """The Triton mask on a case (`op_support.run`) against the reference, every bit."""
    arrays = cases.make_inputs(case, seed)
    if not zero_output:
        arrays["prefix_output"] = None
    check_mask("triton", case, arrays, run("triton", "mask", case, arrays), with_output=zero_output)


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


# --------------------------------------------------------------------------------------------------------
# The launch guard


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


# --------------------------------------------------------------------------------------------------------
# has_empty_context


@pytest.mark.parametrize("lens,want", [
    (torch.tensor([0, 1], dtype=torch.int32), True), (torch.tensor([7], dtype=torch.int32), False),
], ids=["tensor_empty", "tensor_full"])
def test_has_empty_context_takes_cpu_tensors(lens, want):
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


_FLAT = torch.zeros(104, device=DEVICE)
_OVERLAPPING = (_FLAT[:12].view(2, 6), _FLAT[8:].view(6, 2, 8))  # lse and output share 4 floats

# The errors every implementation shares (ranks, dtypes, shapes, layouts, validate=True) are in test_op_mask.py;
# these are torch's: tensors, devices, and memory shared between elements written in place.
TORCH_ERRORS = [
    ("lse_numpy", dict(lse=np.zeros((2, 6), np.float32)), TypeError, "torch.Tensor"),
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


@pytest.mark.parametrize("changes,error,match", [e[1:] for e in TORCH_ERRORS], ids=[e[0] for e in TORCH_ERRORS])
def test_torch_argument_errors(changes, error, match):
    with pytest.raises(error, match=match):
        _call(**changes)


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
    monkeypatch.setattr(triton_backend, "triton_runs_on", lambda device: True)
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
