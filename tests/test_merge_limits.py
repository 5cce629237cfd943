"""The merges at their limits (docs/spec.md 4.3, 8): N from 0 to 256 partials in every variant, output dtypes
independent of the partials', and the exact identities of base-2 LSEs, in each implementation (Triton, Pallas,
the jnp path) against the float64 reference or exact bits. Tiny T, H, D: the interpreters stay fast."""

import itertools
import math

import ml_dtypes
import numpy as np
import pytest
import torch

import pallas_impl
import triton_impl
from parity.harness import cases, expected, reference
from parity.library import compare

jax = pytest.importorskip("jax")
jnp = jax.numpy

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
IMPLS = ("triton", "pallas", "jnp")
NP = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "bfloat16": np.dtype(ml_dtypes.bfloat16),
      "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn)}
TORCH = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
         "float8_e4m3fn": torch.float8_e4m3fn}
BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32}
T, H, D = 3, 2, 8
QSL = np.array([0, 1, 3], np.int32)  # R = 2 requests over T = 3 tokens
SCALE = np.array([0.05], np.float32)


def _partials(n, dtype="float32", *, seed=0, num_tokens=T, num_heads=H, head_dim=D):
    """(outputs [N, T, H, D], lses f32[N, H, T], cu_seq_lens i32[N, R+1]): random rows, some partials empty by
    their LSE (-inf, +inf, NaN), one row empty in every partial, requests with no KV in some partials."""
    rng = np.random.default_rng(seed)
    outputs = rng.standard_normal((n, num_tokens, num_heads, head_dim)).astype(NP[dtype])
    lses = rng.normal(0.0, 4.0, (n, num_heads, num_tokens)).astype(np.float32)
    lses[0::3, 0, 0] = -np.inf
    lses[1::7, 1, :] = np.inf
    lses[2::11, :, -1] = np.nan
    lses[:, -1, 1 % num_tokens] = -np.inf  # empty everywhere
    kv = rng.integers(0, 3, (n, QSL.size - 1))
    cu = np.concatenate([np.zeros((n, 1), np.int64), np.cumsum(kv, axis=1)], axis=1).astype(np.int32)
    return outputs, lses, cu


def _to_torch(x: np.ndarray) -> torch.Tensor:
    """A numpy array (ml_dtypes' bf16 / fp8 too) as a torch tensor on DEVICE, bit for bit."""
    x = np.ascontiguousarray(x)
    if x.dtype.name in ("bfloat16", "float8_e4m3fn"):
        ints = {1: np.int8, 2: np.int16}[x.dtype.itemsize]
        return torch.from_numpy(x.view(ints)).to(DEVICE).view(TORCH[x.dtype.name])
    return torch.from_numpy(x).to(DEVICE)


def _from_torch(x: torch.Tensor, dtype: str) -> np.ndarray:
    bits = x.cpu().view({1: torch.int8, 2: torch.int16, 4: torch.int32}[x.element_size()]).numpy()
    return bits.view(NP[dtype])


def _merge_n(impl, outputs, lses, *, out_dtype=None, ptwc=None, cu=None, lse_layout="HT", base=math.e):
    """(out in out_dtype, lse f32) of the N-way merge in implementation `impl`; `lses` are given [N, H, T]."""
    dtype = out_dtype or outputs.dtype.name
    lses = lses if lse_layout == "HT" else np.ascontiguousarray(lses.transpose(0, 2, 1))
    fp8 = dtype == "float8_e4m3fn"
    if impl == "triton":
        out = torch.full((outputs.shape[1], outputs.shape[2], outputs.shape[3]), float("nan"), device=DEVICE)
        out = out.to(TORCH[dtype])
        lse = torch.full(lses.shape[1:], float("nan"), device=DEVICE)
        t = _to_torch
        kw = {} if cu is None else dict(query_start_loc=t(QSL), cu_seq_lens=t(cu))
        triton_impl.merge_attn_states_n(out, t(outputs), t(lses), lse, ptwc, t(SCALE) if fp8 else None,
                                        lse_layout=lse_layout, lse_base=base, **kw)
        return _from_torch(out, dtype), lse.cpu().numpy()
    kw = {} if cu is None else dict(query_start_loc=jnp.asarray(QSL), cu_seq_lens=jnp.asarray(cu))
    out, lse = pallas_impl.merge_attn_states_n(
        jnp.asarray(outputs), jnp.asarray(lses), prefill_tokens_with_context=ptwc, out_dtype=out_dtype,
        output_scale=jnp.asarray(SCALE) if fp8 else None, lse_layout=lse_layout, lse_base=base, implementation=impl,
        **kw)
    return np.asarray(out), np.asarray(lse)


def _merge(impl, a, la, b, lb, *, out_dtype=None, ptwc=None, cu=None, base=math.e):
    """(out, lse) of the 2-way merge of prefix (a, la) and suffix (b, lb) ([T, H, D], f32[H, T])."""
    dtype = out_dtype or a.dtype.name
    fp8 = dtype == "float8_e4m3fn"
    if impl == "triton":
        t = tt = _to_torch
        out = torch.full(a.shape, float("nan"), device=DEVICE).to(TORCH[dtype])
        lse = torch.full(la.shape, float("nan"), device=DEVICE)
        kw = {} if cu is None else dict(query_start_loc=t(QSL), prefix_cu_seq_lens=t(cu))
        triton_impl.merge_attn_states(out, tt(a), t(la), tt(b), t(lb), lse, ptwc, t(SCALE) if fp8 else None,
                                      lse_base=base, **kw)
        return _from_torch(out, dtype), lse.cpu().numpy()
    kw = {} if cu is None else dict(query_start_loc=jnp.asarray(QSL), prefix_cu_seq_lens=jnp.asarray(cu))
    out, lse = pallas_impl.merge_attn_states(
        jnp.asarray(a), jnp.asarray(la), jnp.asarray(b), jnp.asarray(lb), prefill_tokens_with_context=ptwc,
        out_dtype=out_dtype, output_scale=jnp.asarray(SCALE) if fp8 else None, lse_base=base, implementation=impl,
        **kw)
    return np.asarray(out), np.asarray(lse)


def _case(n, dtype, out_dtype, ptwc, base, lse_layout="HT"):
    """A Case of these options: `expected.exact_masks` reads it."""
    return cases.Case("limits", (T,), (), num_heads=H, head_dim=D, dtype=dtype, out_dtype=out_dtype,
                      lse_layout=lse_layout, lse_base=base, prefill_tokens_with_context=ptwc, partials=max(n, 1))


def _assert_n_way(got, outputs, lses, *, out_dtype=None, ptwc=None, cu=None, lse_layout="HT", base=math.e):
    """`got` (out, lse) against the float64 reference: exact elements bit for bit, the others within tolerance."""
    fp8 = out_dtype == "float8_e4m3fn"
    empty = None if cu is None else reference.empty_token_masks(QSL, cu, T)
    ref_out, ref_lse = reference.merge_attn_states_n(
        outputs, lses, prefill_tokens_with_context=ptwc, query_start_loc=None if cu is None else QSL, cu_seq_lens=cu,
        output_scale=SCALE if fp8 else None, lse_base=base)
    w = reference.merge_weights_n(lses, empty=empty, prefill_tokens_with_context=ptwc, lse_base=base)
    mag = expected.merge_magnitude(outputs, w, SCALE if fp8 else None) if len(outputs) else np.zeros(ref_out.shape)
    out_exact, lse_exact = expected.exact_masks(_case(len(outputs), outputs.dtype.name, out_dtype, ptwc, base), w)
    if ptwc is not None and not fp8 and len(outputs):  # 8.4: the last partial's row, rounded once (or its bits)
        ref_out[ptwc:] = outputs[-1, ptwc:].astype(NP[out_dtype or outputs.dtype.name]).astype(np.float64)
    if lse_layout == "TH":
        ref_lse, lse_exact = ref_lse.T, lse_exact.T
    qsl = np.array([0, T], np.int32)
    compare.assert_matches_reference(got[0], ref_out, exact=np.broadcast_to(out_exact[..., None], mag.shape), mag=mag,
                                     name="out", query_start_loc=qsl)
    compare.assert_matches_reference(got[1], ref_lse, exact=lse_exact, name="lse", query_start_loc=qsl,
                                     layout=lse_layout)


# -- N from 0 to 256 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 2, 65, 130, 256])
@pytest.mark.parametrize("impl", IMPLS)
def test_any_number_of_partials_matches_reference(impl, n):
    outputs, lses, _ = _partials(n, seed=n)
    _assert_n_way(_merge_n(impl, outputs, lses), outputs, lses)


VARIANTS = {  # the options of the N-way merge beyond the plain one with an output LSE: (keyword options, in dtype)
    "fused_pass_through_base2": (dict(cu=True, ptwc=2, base=2), "float32"),
    "th_pass_through": (dict(lse_layout="TH", ptwc=1), "float16"),
    "fp8": (dict(out_dtype="float8_e4m3fn"), "bfloat16"),
}


@pytest.mark.parametrize("n", [0, 65])
@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("impl", IMPLS)
def test_every_variant_at_zero_and_past_64_partials(impl, variant, n):
    kw, dtype = VARIANTS[variant]
    outputs, lses, cu = _partials(n, dtype, seed=n + 1)
    kw = dict(kw, cu=cu if kw.get("cu") else None)
    _assert_n_way(_merge_n(impl, outputs, lses, **kw), outputs, lses, **kw)


@pytest.mark.parametrize("impl", IMPLS)
def test_no_partials_gives_zero_and_minus_inf_everywhere(impl):
    """docs/spec.md 8.2: N = 0 is the empty merge, pass-through rows included (there is no last partial)."""
    outputs, lses, cu = _partials(0, "bfloat16")
    for kw in (dict(), dict(ptwc=0, cu=cu), dict(out_dtype="float8_e4m3fn", lse_layout="TH")):
        out, lse = _merge_n(impl, outputs, lses, **kw)
        assert (out.astype(np.float32) == 0).all() and not np.signbit(out.astype(np.float32)).any()
        assert (lse == -np.inf).all()


def test_reference_of_no_partials():
    out, lse = reference.merge_attn_states_n(np.zeros((0, T, H, D), np.float32), np.zeros((0, H, T), np.float32),
                                             prefill_tokens_with_context=1)
    assert out.shape == (T, H, D) and (out == 0).all()
    assert lse.shape == (H, T) and (lse == -np.inf).all()


@pytest.mark.parametrize("base", [math.e, 2])
@pytest.mark.parametrize("impl", IMPLS)
def test_n2_gives_the_two_way_bits_with_another_out_dtype(impl, base):
    outputs, lses, _ = _partials(2, "float32", seed=5)
    for kw in (dict(out_dtype="bfloat16", ptwc=2), dict(out_dtype="float16")):
        got_n = _merge_n(impl, outputs, lses, base=base, **kw)
        got_2 = _merge(impl, outputs[0], lses[0], outputs[1], lses[1], base=base, **kw)
        for x, y in zip(got_n, got_2):
            np.testing.assert_array_equal(x.view(BITS[x.dtype.itemsize]), y.view(BITS[y.dtype.itemsize]))


def _fresh_caches(monkeypatch):
    """Empty launch-plan and compile caches, so a changed launch table takes effect."""
    from pallas_impl import merge_n as pallas_merge_n
    from triton_impl import _plans as triton_plans

    monkeypatch.setattr(triton_plans, "PLANS", {})
    pallas_merge_n._PLANS.clear()
    jax.clear_caches()


@pytest.fixture
def runtime_loops(monkeypatch):
    """Every N-way loop over the partials a runtime loop (no unrolling; the maximum in loads of `max_chunk` LSE
    tiles, 0: one partial at a time), with fresh plan and compile caches."""
    from mla_lse_common import constants, tiles

    def runtime(max_chunk=None):
        monkeypatch.setattr(constants, "UNROLLED_PARTIALS", 0)
        if max_chunk is not None:
            monkeypatch.setattr(tiles, "N_LOOPS", {fw: {v: (max_chunk, *loops[1:]) for v, loops in per_fw.items()}
                                                   for fw, per_fw in tiles.N_LOOPS.items()})
        _fresh_caches(monkeypatch)

    yield runtime
    monkeypatch.undo()
    _fresh_caches(monkeypatch)


def test_loop_partition_of_both_frameworks():
    """One partition of the N-way loops for both frameworks (mla_lse_common.tiles, read at plan and trace time):
    every loop unrolled up to UNROLLED_PARTIALS; beyond, steps for the sums and loads of a chunk of LSE tiles for
    the maximum (`tiles.N_LOOPS`)."""
    from mla_lse_common import constants, tiles

    n = constants.UNROLLED_PARTIALS
    assert tiles.loop_steps(n - 1, n, 4) == 0 and tiles.max_chunks(n, 4) == 0
    assert tiles.loop_steps(n, n + 1, 4) == n // 4
    assert tiles.max_chunks(n + 1, 4) == -(-n // 4) and tiles.max_chunks(n + 1, 0) == 0
    assert tiles.loop_steps(-1, n + 1, 4) == 0
    for fw in tiles.FRAMEWORKS:  # the output loads' L2 policy: the default up to UNROLLED_PARTIALS, the table's beyond
        assert tiles.outputs_evict(fw, n) == "" and tiles.outputs_evict(fw, n + 1) == tiles.N_OUTPUTS_EVICT[fw]
    # Two kernels only where the loops run at runtime; a first-kernel program owns MAX_SUM_POSITIONS positions, one
    # head's run of tokens in [H, T] layout without the fused mask, and its grid covers every position once.
    assert not tiles.split_passes(n) and tiles.split_passes(n + 1)
    for fw, layout in itertools.product(tiles.FRAMEWORKS, ("HT", "TH")):  # the fused weighted sum given the weights
        given = "weighted" if tiles.split_weights(fw, "fused", layout) else "fused"
        assert tiles.tile_variant(fw, "fused", n, layout) == "fused"
        assert tiles.tile_variant(fw, "fused", n + 1, layout) == given
        # The split buffer: [T, H] with [T, H] LSEs, the table's layout with [H, T] LSEs and the weights stored, else
        # the LSEs'; the "weighted" tile follows the buffer it reads.
        buffer = tiles.N_SPLIT_WEIGHTS_LAYOUT[fw] if given == "weighted" and layout == "HT" else layout
        assert tiles.split_layout(fw, "fused", layout) == buffer
        assert tiles.merge_num_warps(fw, "fused", n + 1, layout) == tiles.MERGE_N_TILES[fw][given][
            buffer if given == "weighted" else layout][3]
        assert all(tiles.tile_variant(fw, v, n + 1, layout) == v and tiles.split_layout(fw, v, layout) == layout
                   for v in ("plain", "lse"))
    for fw, heads, layout, fused in itertools.product(tiles.FRAMEWORKS, (1, 3, 64, 512), ("HT", "TH"), (False, True)):
        block_t, block_h = tiles.max_sum_tiles(fw, heads, layout, fused)
        fused_ht = fused and layout == "HT"
        positions = tiles.MAX_SUM_FUSED_POSITIONS[fw] if fused_ht else tiles.MAX_SUM_POSITIONS
        assert block_t * block_h == positions and (block_h == 1 or layout == "TH" or fused)
        assert block_h == (min(tiles.next_pow2(heads), tiles.MAX_SUM_FUSED_HEADS[fw]) if fused_ht else
                           1 if layout == "HT" else min(tiles.next_pow2(heads), positions))
        assert tiles.max_sum_warps(fw, layout, fused) == (tiles.MAX_SUM_FUSED_WARPS[fw] if fused_ht else
                                                         tiles.MAX_SUM_WARPS)
        (programs,) = tiles.max_sum_grid(fw, 1000, heads, layout, fused)
        assert programs == -(-1000 // block_t) * -(-heads // block_h)


# XLA:CPU compiles an unrolled loop and a while loop into different float code (docs/spec.md 5): bit for bit on a
# CPU only Triton's interpreter, which evaluates each operation with numpy.
@pytest.mark.parametrize("max_chunk", [0, 4, 64])
@pytest.mark.parametrize("impl", ["triton"] + [pytest.param(i, marks=pytest.mark.gpu) for i in ("pallas", "jnp")])
def test_unrolled_and_runtime_loops_give_the_same_bits(impl, max_chunk, runtime_loops):
    """docs/spec.md 8, "Any N": the loops over the partials do the same operations in the same order unrolled
    (N <= UNROLLED_PARTIALS) and as runtime loops; the maximum, exact in any order, also in chunks of LSE tiles
    (4: three loads, the last with two partials past N; 64: one load). Zeros of both signs among the LSEs: the
    sign of a zero maximum never reaches a bit (docs/spec.md 8.2)."""
    # N = 11: partials 1 .. 10 in 2 steps of 4 and 2 unrolled; 1 .. 9 (the weighted sum) in 2 steps and 1.
    outputs, lses, cu = _partials(11, "bfloat16", seed=9)
    lses[:, :, 0] = np.where(np.arange(11)[:, None] % 2, -0.0, 0.0)  # token 0: every maximum a zero
    lses[3, 0, 2] = np.nan
    kw = dict(cu=cu, ptwc=2, base=2, out_dtype="float32")
    want = _merge_n(impl, outputs, lses, **kw)
    runtime_loops(max_chunk)
    got = _merge_n(impl, outputs, lses, **kw)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x.view(BITS[x.dtype.itemsize]), y.view(BITS[y.dtype.itemsize]))


@pytest.fixture
def one_kernel(monkeypatch):
    """`set(split, weights)`: the N-way merge beyond N_SPLIT_ABOVE partials in two kernels (the first storing m and
    z only, weights=None, or the weights too, in a buffer of layout `weights` with [H, T] LSEs) or, split=False, in
    one at every N; fresh plan and compile caches."""
    from mla_lse_common import tiles

    split_above = tiles.N_SPLIT_ABOVE

    def set_split(split, weights=None):
        monkeypatch.setattr(tiles, "N_SPLIT_ABOVE", split_above if split else 1 << 30)
        monkeypatch.setattr(tiles, "N_SPLIT_WEIGHTS", {
            fw: {v: dict.fromkeys(per_v, weights is not None) for v, per_v in per_fw.items()}
            for fw, per_fw in tiles.N_SPLIT_WEIGHTS.items()})
        monkeypatch.setattr(tiles, "N_SPLIT_WEIGHTS_LAYOUT", dict.fromkeys(tiles.FRAMEWORKS, weights or "HT"))
        _fresh_caches(monkeypatch)

    yield set_split
    monkeypatch.undo()
    _fresh_caches(monkeypatch)


@pytest.mark.parametrize("weights", [None, "HT", "TH"], ids=["m_z", "weights", "weights_th"])
@pytest.mark.parametrize("lse_layout,base,fused", [("HT", math.e, False), ("TH", 2, False), ("HT", 2, True),
                                                   ("TH", math.e, True)])
@pytest.mark.parametrize("impl", ["triton", pytest.param("pallas", marks=pytest.mark.gpu)])  # XLA:CPU: see above
def test_two_kernels_give_the_one_kernel_bits(impl, lse_layout, base, fused, weights, one_kernel):
    """docs/design.md, "Two kernels beyond 16 partials": the first kernel computes each position's m and z (and
    the weights, with [H, T] LSEs in either layout of its buffer) with the merge's own code and loops; the weighted
    sum that reads them gives the bits of the merge in one kernel, pass-through rows, empty partials and the fused
    mask included."""
    from mla_lse_common import tiles

    n = tiles.N_SPLIT_ABOVE + 5
    outputs, lses, cu = _partials(n, "bfloat16", seed=11, num_tokens=5)
    kw = dict(cu=cu if fused else None, ptwc=4, base=base, lse_layout=lse_layout, out_dtype="float32")
    one_kernel(False)
    want = _merge_n(impl, outputs, lses, **kw)
    one_kernel(True, weights)
    got = _merge_n(impl, outputs, lses, **kw)
    assert tiles.split_passes(n)
    assert tiles.split_layout(impl, "fused", lse_layout) == (weights if weights and lse_layout == "HT" else lse_layout)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x.view(BITS[x.dtype.itemsize]), y.view(BITS[y.dtype.itemsize]))


@pytest.fixture
def out_stages(monkeypatch):
    """`set(stages)`: the N-way weighted sum's runtime loop with `stages` stages in both frameworks
    (`tiles.N_OUT_STAGES`; in Pallas any value above 1 is one step ahead), in steps of 4 partials; fresh plan and
    compile caches."""
    from mla_lse_common import tiles

    def set_stages(stages):
        monkeypatch.setattr(tiles, "N_LOOPS", {fw: {v: (*loops[:2], 4) for v, loops in per_fw.items()}
                                               for fw, per_fw in tiles.N_LOOPS.items()})
        monkeypatch.setattr(tiles, "N_OUT_STAGES", {fw: dict.fromkeys(per_fw, stages)
                                                    for fw, per_fw in tiles.N_OUT_STAGES.items()})
        _fresh_caches(monkeypatch)

    yield set_stages
    monkeypatch.undo()
    _fresh_caches(monkeypatch)


@pytest.mark.parametrize("lse_layout,base,fused", [("HT", math.e, False), ("TH", 2, False), ("HT", 2, True)])
@pytest.mark.parametrize("impl", ["triton", "pallas"])
def test_pipelined_weighted_sum_gives_the_same_bits(impl, lse_layout, base, fused, out_stages):
    """docs/design.md, "The weighted sum's loads in flight": the weighted sum's loop with the next steps' loads
    issued ahead (Triton's pipelined loop; Pallas' tiles carried one step ahead) gives the bits of the loop without,
    pass-through rows, empty partials and the fused mask included. N = 21: partials 1 .. 19 in 4 runtime steps of 4
    and 3 unrolled (on a CPU the Triton interpreter runs the same loop either way; Pallas interprets each loop)."""
    from mla_lse_common import tiles

    n = tiles.N_SPLIT_ABOVE + 5
    outputs, lses, cu = _partials(n, "bfloat16", seed=12)
    lses[4, 0, 1] = np.inf
    kw = dict(cu=cu if fused else None, ptwc=2, base=base, lse_layout=lse_layout, out_dtype="float32")
    out_stages(1)
    want = _merge_n(impl, outputs, lses, **kw)
    out_stages(3)
    assert tiles.loop_steps(n - 2, n, 4) == 4 and tiles.out_stages(impl, tiles.merge_variant(True, fused), n) > 1
    got = _merge_n(impl, outputs, lses, **kw)
    for x, y in zip(got, want):
        np.testing.assert_array_equal(x.view(BITS[x.dtype.itemsize]), y.view(BITS[y.dtype.itemsize]))
    _assert_n_way(got, outputs, lses, **kw)


def test_early_output_counts(monkeypatch):
    """`tiles.early_outputs`: the entry of the largest N at or below the merge's, capped at N - 1 (never the last
    partial), none where the loops run at runtime; every committed count in range."""
    from mla_lse_common import constants, tiles

    n_max = constants.UNROLLED_PARTIALS
    for fw, variant, n in itertools.product(tiles.FRAMEWORKS, ("plain", "lse", "fused"), range(1, 2 * n_max + 1)):
        early = tiles.early_outputs(fw, variant, n)
        assert 0 <= early < max(n, 1) and (early == 0 or n <= n_max)
    monkeypatch.setitem(tiles.N_EARLY_OUTPUTS, "triton", {"plain": {}, "lse": {3: 2, 8: n_max}, "fused": {}})
    got = [tiles.early_outputs("triton", "lse", n) for n in (1, 2, 3, 7, 8, 9, n_max, n_max + 1)]
    assert got == [0, 0, 2, 2, 7, 8, n_max - 1, 0]
    assert tiles.early_outputs("triton", "plain", 8) == 0


@pytest.mark.parametrize("n,lse_layout,base,fused", [(2, "HT", math.e, False), (5, "TH", 2, True),
                                                     (5, "HT", math.e, True)])
@pytest.mark.parametrize("impl", ["triton", "pallas"])
def test_early_output_tiles_give_the_same_bits(impl, n, lse_layout, base, fused, monkeypatch):
    """`tiles.N_EARLY_OUTPUTS`: the first output tiles loaded before the LSE passes give the bits of the merge that
    loads each in its weighted-sum step, some or every tile but the last (at N = 2 only partial 0 can be early),
    pass-through rows, empty partials and the fused mask included."""
    from mla_lse_common import tiles

    outputs, lses, cu = _partials(n, "bfloat16", seed=13)
    kw = dict(cu=cu if fused else None, ptwc=2, base=base, lse_layout=lse_layout, out_dtype="float32")
    monkeypatch.setattr(tiles, "N_EARLY_OUTPUTS", {fw: {v: {} for v in per_fw}
                                                   for fw, per_fw in tiles.N_EARLY_OUTPUTS.items()})
    _fresh_caches(monkeypatch)
    want = _merge_n(impl, outputs, lses, **kw)
    for early in sorted({1, n - 1, n}):  # one, all but the last (the cap), past the cap
        monkeypatch.setattr(tiles, "N_EARLY_OUTPUTS", {fw: {v: {1: early} for v in per_fw}
                                                       for fw, per_fw in tiles.N_EARLY_OUTPUTS.items()})
        _fresh_caches(monkeypatch)
        assert tiles.early_outputs(impl, tiles.merge_variant(True, fused), n) == min(early, n - 1)
        got = _merge_n(impl, outputs, lses, **kw)
        for x, y in zip(got, want):
            np.testing.assert_array_equal(x.view(BITS[x.dtype.itemsize]), y.view(BITS[y.dtype.itemsize]))
    monkeypatch.undo()
    _fresh_caches(monkeypatch)


# -- output dtypes independent of the partials' ------------------------------------------------------------

IN_DTYPES = ("float32", "float16", "bfloat16")
OUT_DTYPES = ("float32", "float16", "bfloat16", "float8_e4m3fn")


# Every pair in Triton (its interpreter compiles nothing); in Pallas and jnp (each signature compiles, seconds on a
# CPU) every input and every output dtype once.
PAIRS = [(i, o) for i in IN_DTYPES for o in OUT_DTYPES]
FEW_PAIRS = [("float32", "bfloat16"), ("float16", "float32"), ("bfloat16", "float16"), ("float32", "float8_e4m3fn")]


@pytest.mark.parametrize("impl,in_dtype,out_dtype", [("triton", *p) for p in PAIRS]
                         + [(impl, *p) for impl in ("pallas", "jnp") for p in FEW_PAIRS])
def test_two_way_into_any_out_dtype(impl, in_dtype, out_dtype):
    outputs, lses, cu = _partials(2, in_dtype, seed=7)
    got = _merge(impl, outputs[0], lses[0], outputs[1], lses[1], out_dtype=out_dtype, ptwc=2)
    assert got[0].dtype == NP[out_dtype]
    _assert_n_way(got, outputs, lses, out_dtype=out_dtype, ptwc=2)


@pytest.mark.parametrize("impl,in_dtype,out_dtype", [(impl, *p) for impl in IMPLS for p in FEW_PAIRS[:2]]
                         + [("triton", *p) for p in FEW_PAIRS[2:]])
def test_n_way_into_another_out_dtype(impl, in_dtype, out_dtype):
    outputs, lses, cu = _partials(5, in_dtype, seed=8)
    got = _merge_n(impl, outputs, lses, out_dtype=out_dtype, ptwc=1, cu=cu)
    assert got[0].dtype == NP[out_dtype]
    _assert_n_way(got, outputs, lses, out_dtype=out_dtype, ptwc=1, cu=cu)


# -- exact identities in both bases --------------------------------------------------------------------------


def _identity_inputs(n, live, dtype="bfloat16", seed=3):
    """N partials over 64 tokens, all empty but partial `live`: its LSEs are random base-2 values (the ln2 /
    log2(e) round trip changed about 14% of them by 1 ulp), the others -inf, +inf or NaN."""
    outputs, _, _ = _partials(n, dtype, seed=seed, num_tokens=64, num_heads=4)
    rng = np.random.default_rng(seed)
    lses = np.stack([np.full((4, 64), (-np.inf, np.inf, np.nan)[i % 3], np.float32) for i in range(n)])
    lses[live] = rng.uniform(-20.0, 40.0, (4, 64)).astype(np.float32)
    return outputs, lses


def _assert_bits(got, want):
    np.testing.assert_array_equal(got.view(BITS[got.dtype.itemsize]), want.view(BITS[want.dtype.itemsize]))


@pytest.mark.parametrize("base", [math.e, 2])
@pytest.mark.parametrize("impl", IMPLS)
def test_empty_partials_leave_the_other_bits_unchanged(impl, base):
    """docs/spec.md 4.3: merged with empty partials, a partial's row and LSE come back bit for bit, in base 2
    as in base e: the 2-way merge either way round and the N-way merge with the live partial anywhere."""
    outputs, lses = _identity_inputs(5, 3)
    for a, b in ((0, 3), (3, 1), (3, 2)):
        out, lse = _merge(impl, outputs[a], lses[a], outputs[b], lses[b], base=base)
        _assert_bits(out, outputs[3])
        _assert_bits(lse, lses[3])
    out, lse = _merge_n(impl, outputs, lses, base=base)
    _assert_bits(out, outputs[3])
    _assert_bits(lse, lses[3])


@pytest.mark.parametrize("impl", IMPLS)
def test_base2_identity_through_the_fused_mask(impl):
    """Partials empty by their offsets (finite garbage LSEs) leave the live one's base-2 bits unchanged."""
    outputs, lses = _identity_inputs(3, 1, seed=4)
    lses[0] = 3.0  # garbage, masked by the offsets
    lses[2] = -np.inf
    qsl = np.array([0, 64], np.int32)
    cu = np.array([[0, 0], [0, 5], [0, 2]], np.int32)
    if impl == "triton":
        t = _to_torch
        o = t(outputs)
        out = torch.empty(outputs.shape[1:], dtype=torch.bfloat16, device=DEVICE)
        lse = torch.empty(lses.shape[1:], device=DEVICE)
        triton_impl.merge_attn_states_n(out, o, t(lses), lse, query_start_loc=t(qsl), cu_seq_lens=t(cu), lse_base=2)
        out2 = torch.empty_like(out)
        lse2 = torch.empty_like(lse)
        triton_impl.merge_attn_states(out2, o[0], t(lses[0]), o[1], t(lses[1]), lse2, query_start_loc=t(qsl),
                                      prefix_cu_seq_lens=t(cu[0]), lse_base=2)
        got = [(_from_torch(out, "bfloat16"), lse.cpu().numpy()), (_from_torch(out2, "bfloat16"), lse2.cpu().numpy())]
    else:
        got = [tuple(map(np.asarray, pallas_impl.merge_attn_states_n(
                   jnp.asarray(outputs), jnp.asarray(lses), query_start_loc=jnp.asarray(qsl),
                   cu_seq_lens=jnp.asarray(cu), lse_base=2, implementation=impl))),
               tuple(map(np.asarray, pallas_impl.merge_attn_states(
                   jnp.asarray(outputs[0]), jnp.asarray(lses[0]), jnp.asarray(outputs[1]), jnp.asarray(lses[1]),
                   query_start_loc=jnp.asarray(qsl), prefix_cu_seq_lens=jnp.asarray(cu[0]), lse_base=2,
                   implementation=impl)))]
    for out, lse in got:
        _assert_bits(out, outputs[1])
        _assert_bits(lse, lses[1])


def test_reference_base2_identity_is_exact():
    outputs, lses = _identity_inputs(4, 2)
    out, lse = reference.merge_attn_states_n(outputs, lses, lse_base=2)
    np.testing.assert_array_equal(lse.astype(np.float32).view(np.uint32), lses[2].view(np.uint32))
    np.testing.assert_array_equal(out, outputs[2].astype(np.float64))
