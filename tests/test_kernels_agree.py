"""triton_impl and pallas_impl agree: the shared tiles and grids (mla_lse_common) fit and cover, and the results
agree bit for bit.

The mask is bit-exact on every runtime, so its agreement (Triton's interpreter vs Pallas interpret mode) also
runs on CPU. The merge is bit-exact Triton-vs-Pallas only when both are compiled on the GPU (docs/spec.md 5). Inputs
are uploaded once and shared between torch and JAX through parity.library.bridge (DLPack, no copy).
"""

import itertools
import math

import ml_dtypes
import numpy as np
import pytest
import torch

import jax

import pallas_impl
import triton_impl
from parity.harness import expected
from parity.library import bridge, compare
from parity.harness import cases, reference
from mla_lse_common import constants, tiles

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CI_CASES = cases.select("ci")
# Triton's interpreter is slow (r1000 takes minutes): on CPU the mask agreement runs on cases that still hold
# the edges (upstream vector; 127/128/129/256 blocks; R = 33 with zero lengths and padding; [T, H] LSE).
CPU_MASK_CASES = ("upstream_vector", "block_edges", "r33_ragged_pad", "specials_th")
MASK_CASES = [c if c.name in CPU_MASK_CASES else pytest.param(c, marks=pytest.mark.gpu) for c in CI_CASES]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """compare and the Triton interpreter run small torch CPU ops; two OpenMP threads spinning against XLA's
    threads on a shared 2-core machine make them much slower. Restored after the module."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------------------
# Constants, tiles and grids (one source, mla_lse_common, for both frameworks)


def test_constants_are_what_they_say():
    assert constants.LN2 == math.log(2.0)
    assert constants.LOG2E == math.log2(math.e)
    assert constants.FP8_E4M3_MAX == float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    assert constants.FP8_E4M3_MAX == reference.FP8_E4M3_MAX
    assert constants.LSE_LAYOUTS == reference.LSE_LAYOUTS


def _pow2(n):
    return n > 0 and n & (n - 1) == 0


def _merge_programs_cover(grid, num_tokens, num_heads, block_t, block_h):
    """Each program of a merge grid, as the kernels' `_program_tile` maps it (head blocks fastest), owns a
    [block_t, block_h] tile of (token, head) cells: every cell is owned once, and every program owns one."""
    programs = np.arange(grid[0])
    head_blocks = -(-num_heads // block_h)
    t0, h0 = programs // head_blocks * block_t, programs % head_blocks * block_h
    assert (t0 < num_tokens).all() and (h0 < num_heads).all()  # no program without a cell
    tt, hh = np.broadcast_arrays(t0[:, None, None] + np.arange(block_t)[None, :, None],
                                 h0[:, None, None] + np.arange(block_h)[None, None, :])
    inside = (tt < num_tokens) & (hh < num_heads)  # a tile's cells past T or H belong to no one (masked)
    owned = np.zeros((num_tokens, num_heads), np.int32)
    np.add.at(owned, (tt[inside], hh[inside]), 1)
    assert (owned == 1).all()


@pytest.mark.parametrize("framework", tiles.FRAMEWORKS)
@pytest.mark.parametrize("num_heads", [1, 3, 5, 8, 17, 64, 128])
def test_merge_tiles_fit_and_grids_cover(framework, num_heads):
    for head_dim, variant, itemsize in itertools.product((16, 64, 80, 128, 192, 512), ("plain", "lse", "fused"), (2, 4)):
        tile_bytes, min_block_t, num_warps = tiles.MERGE_TILES[framework][variant]
        elems = tile_bytes // itemsize
        block_t, block_h, block_d = tiles.merge_tiles(framework, num_heads, head_dim, variant, itemsize)
        assert all(_pow2(b) for b in (block_t, block_h, block_d, num_warps)), (num_heads, head_dim, variant)
        assert block_d >= head_dim and block_t * block_h * block_d <= max(elems, block_d)
        assert block_t >= min_block_t or block_t * block_h * block_d >= elems  # fewest tokens, or budget full
        for num_tokens in (1, 127, 128, 129, 1000):
            grid = tiles.merge_grid(framework, num_tokens, num_heads, head_dim, variant, itemsize)
            _merge_programs_cover(grid, num_tokens, num_heads, block_t, block_h)
        assert tiles.merge_grid(framework, 0, num_heads, head_dim, variant, itemsize) == (0,)


def _first_blocks(qsl):
    """The mask's request r starts at block qsl[r] // 128 + r (the kernels' key; docs/design.md)."""
    return qsl[:-1] // tiles.MASK_BLOCK_T + np.arange(len(qsl) - 1)


@pytest.mark.parametrize("num_heads", [1, 3, 16, 17, 64, 128])
def test_mask_grid_holds_every_request(num_heads):
    """The grid's blocks hold every block any offsets of T tokens and R requests reach (each request's first block
    and its tokens' blocks), and some offsets reach the last one: a zero-length request at T."""
    rng = np.random.default_rng(num_heads)
    for num_tokens, num_requests in itertools.product((1, 127, 128, 129, 1000, 131072), (1, 2, 32, 33, 1000)):
        blocks, _ = tiles.mask_grid(num_tokens, num_requests, num_heads, 128, False)
        for _ in range(8):
            qsl = np.sort(rng.integers(0, num_tokens + 1, num_requests + 1))
            qsl[0] = 0
            lens = np.diff(qsl)
            last = np.where(lens > 0, (qsl[1:] - 1) // tiles.MASK_BLOCK_T + np.arange(num_requests), 0)
            assert _first_blocks(qsl).max() < blocks and last.max() < blocks
        if num_requests > 1:
            at_end = np.array([0] * num_requests + [num_tokens])
            at_end[-2] = num_tokens  # the last request: zero tokens, at T
            assert _first_blocks(at_end).max() == blocks - 1


@pytest.mark.parametrize("num_heads", [1, 3, 16, 17, 40, 64, 128])
def test_mask_split_deals_every_tile_once(num_heads):
    """The second grid axis deals a block's tiles round-robin (program s takes s, s + S, ...): every program gets a
    tile, and the split never exceeds the variant's cap; a smaller grid splits more."""
    for num_tokens, num_requests, head_dim, zero in itertools.product(
            (1, 128, 1000, 131072), (1, 33, 1000), (64, 128, 512), (False, True)):
        blocks, split = tiles.mask_grid(num_tokens, num_requests, num_heads, head_dim, zero)
        block_h, block_ho, block_d = tiles.mask_tiles(num_heads, head_dim)
        heads = np.arange(0, num_heads, block_ho if zero else block_h)
        dims = np.arange(0, head_dim, block_d) if zero else np.arange(1)
        assert 1 <= split <= tiles.mask_split_cap(zero) and split <= len(heads) * len(dims)
        assert _pow2(split) or split == len(heads) * len(dims)
        more = tiles.mask_grid(num_tokens * 4, num_requests * 4, num_heads, head_dim, zero)
        assert more[1] <= split


# ---------------------------------------------------------------------------------------------------------
# Results, bit for bit


@pytest.mark.parametrize("case", MASK_CASES, ids=lambda c: c.name)
def test_mask_agrees_bitwise(case, mode):
    inp = cases.make_inputs(case)
    D = case.head_dim
    t, j = bridge.share_inputs({k: inp[k] for k in ("prefix_lse", "query_start_loc", "cu_seq_lens", "prefix_output")},
                               DEVICE)
    lse_p, out_p = pallas_impl.mask_empty_context_lse(
        j["prefix_lse"], j["query_start_loc"], j["cu_seq_lens"], j["prefix_output"][..., :D],
        lse_layout=case.lse_layout, implementation="pallas", interpret=mode == "interpret")
    jax.block_until_ready((lse_p, out_p))
    # Triton writes in place: work on clones, since the shared buffers also back the JAX inputs.
    lse_t = t["prefix_lse"].clone()
    out_t = t["prefix_output"].clone()[..., :D]  # a strided view of the V-padded buffer
    triton_impl.mask_empty_context_lse(lse_t, t["query_start_loc"], t["cu_seq_lens"], out_t,
                                       lse_layout=case.lse_layout)
    compare.assert_bitwise_equal(lse_t, lse_p, name="mask.lse", case=case, mode=mode)
    compare.assert_bitwise_equal(out_t, out_p, name="mask.output", case=case, mode=mode)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CI_CASES, ids=lambda c: c.name)
def test_merge_agrees_bitwise_gpu(case):
    """Compiled Triton vs compiled Pallas (docs/spec.md 5 recipe): every option the case exercises, identical bits."""
    inp = cases.make_inputs(case)
    D, T, H = case.head_dim, case.num_tokens, case.num_heads
    t, j = bridge.share_inputs(inp, DEVICE)
    fp8 = case.out_dtype is not None
    out_p, lse_p = pallas_impl.merge_attn_states(
        j["prefix_output"][..., :D], j["prefix_lse"], j["suffix_output"][..., :D], j["suffix_lse"],
        prefill_tokens_with_context=case.prefill_tokens_with_context, query_start_loc=j["query_start_loc"],
        prefix_cu_seq_lens=j["cu_seq_lens"], out_dtype=cases.DTYPES[case.out_dtype] if fp8 else None,
        output_scale=j["output_scale"] if fp8 else None, lse_layout=case.lse_layout, lse_base=case.lse_base,
        implementation="pallas", interpret=False)
    jax.block_until_ready((out_p, lse_p))
    out_dtype = torch.float8_e4m3fn if fp8 else t["prefix_output"].dtype
    out_t = torch.empty((T, H, D), dtype=out_dtype, device=DEVICE)
    lse_t = torch.empty_like(t["suffix_lse"])
    triton_impl.merge_attn_states(
        out_t, t["prefix_output"][..., :D], t["prefix_lse"], t["suffix_output"][..., :D], t["suffix_lse"], lse_t,
        case.prefill_tokens_with_context, t["output_scale"] if fp8 else None,
        query_start_loc=t["query_start_loc"], prefix_cu_seq_lens=t["cu_seq_lens"], lse_layout=case.lse_layout,
        lse_base=case.lse_base)
    torch.cuda.synchronize()
    compare.assert_bitwise_equal(out_t, out_p, name="merge.out", case=case, mode="compiled")
    compare.assert_bitwise_equal(lse_t, lse_p, name="merge.lse", case=case, mode="compiled")


@pytest.mark.parametrize("framework", tiles.FRAMEWORKS)
@pytest.mark.parametrize("num_heads", [1, 3, 5, 64])
def test_n_way_tiles_are_powers_of_two_within_budget(framework, num_heads):
    for variant, itemsize, layout in itertools.product(("plain", "lse", "fused", "weighted"), (2, 4), ("HT", "TH")):
        total, _, _, num_warps = tiles.MERGE_N_TILES[framework][variant][layout]
        for num_partials, head_dim in itertools.product((1, 2, 3, 4, 8, 16, 64), (32, 64, 80, 128, 512)):
            tile_bytes = tiles.partial_tile_bytes(total, num_partials)
            assert tiles.N_TILE_BYTES[0] <= tile_bytes <= tiles.N_TILE_BYTES[1]
            assert tile_bytes <= total // num_partials < 2 * tile_bytes or tile_bytes in tiles.N_TILE_BYTES
            block_t, block_h, block_d = tiles.merge_tiles(framework, num_heads, head_dim, variant, itemsize,
                                                          num_partials, layout)
            assert all(_pow2(b) for b in (block_t, block_h, block_d, num_warps))
            assert block_d >= head_dim and block_t * block_h * block_d <= max(tile_bytes // itemsize, block_d)
            grid = tiles.merge_grid(framework, 1000, num_heads, head_dim, variant, itemsize, num_partials, layout)
            _merge_programs_cover(grid, 1000, num_heads, block_t, block_h)


@pytest.mark.parametrize("framework", tiles.FRAMEWORKS)
def test_n_way_tiles_shrink_as_partials_grow(framework):
    """A program's N input tiles share one budget: 4 partials get half the bytes of 2, down to the floor."""
    for variant, layout in itertools.product(("plain", "lse", "fused", "weighted"), ("HT", "TH")):
        total = tiles.MERGE_N_TILES[framework][variant][layout][0]
        sizes = [tiles.partial_tile_bytes(total, n) for n in (1, 2, 4, 8, 16, 64)]
        assert sizes == sorted(sizes, reverse=True) and sizes[-1] == tiles.N_TILE_BYTES[0]


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "masked_lses"])
@pytest.mark.parametrize("case", cases.select("ci", kind="n_way"), ids=lambda c: c.name)
def test_merge_n_agrees_bitwise_gpu(case, fused):
    """Compiled Triton vs compiled Pallas vs jnp on XLA:GPU: the same bits on every output (docs/spec.md 5, 8)."""
    from parity.harness import impls

    rt = impls.make_runtime()
    inp = cases.make_inputs_n(case)
    inp["masked_lses"] = impls.masked_lses(case, inp)
    t, j = bridge.share_inputs(inp, DEVICE)
    op = "merge_n_fused" if fused else "merge_n"
    arrays = {"triton": t, "pallas": j, "jnp": j}
    if not fused:
        arrays = {k: dict(v, lses=v["masked_lses"]) for k, v in arrays.items()}
    got = {impl: impls.run(rt, impl, op, case, a) for impl, a in arrays.items()}
    for key in ("out", "lse"):
        compare.assert_bitwise_equal(got["triton"][key], got["pallas"][key], name=f"{op}.{key} triton vs pallas",
                                     case=case, mode="compiled")
        compare.assert_bitwise_equal(got["pallas"][key], got["jnp"][key], name=f"{op}.{key} pallas vs jnp",
                                     case=case, mode="compiled")


@pytest.mark.gpu
def test_merge_n_past_2_31_stacked_elements_gpu():
    """Stacked partials of N * T * H * D > 2^31 elements (each partial below it): the last partial's offsets need
    64 bits. Triton and Pallas agree bit for bit, and the last tokens match the float64 reference."""
    N, T, H, D = 3, 131072, 64, 128  # 3 x 2^30 bf16 elements: 6 GiB of partials
    g = torch.Generator(device="cuda").manual_seed(0)
    outs = torch.randn(N, T, H, D, generator=g, device="cuda", dtype=torch.bfloat16)
    lses = torch.randn(N, H, T, generator=g, device="cuda") * 3
    out_t, lse_t = torch.empty(T, H, D, dtype=torch.bfloat16, device="cuda"), torch.empty(H, T, device="cuda")
    triton_impl.merge_attn_states_n(out_t, outs, lses, lse_t)
    out_p, lse_p = pallas_impl.merge_attn_states_n(bridge.torch_to_jax(outs), bridge.torch_to_jax(lses),
                                                   implementation="pallas", interpret=False)
    jax.block_until_ready((out_p, lse_p))
    torch.cuda.synchronize()
    compare.assert_bitwise_equal(out_t, out_p, name="merge_n.out", case=None, mode="compiled")
    compare.assert_bitwise_equal(lse_t, lse_p, name="merge_n.lse", case=None, mode="compiled")
    tail = slice(T - 64, T)  # rows each partial reaches only past 2^31 elements into the stack
    outs_tail, lses_tail = bridge.to_numpy(outs[:, tail]), bridge.to_numpy(lses[:, :, tail])
    want_out, want_lse = reference.merge_attn_states_n(outs_tail, lses_tail)
    mag = expected.merge_magnitude(outs_tail, reference.merge_weights_n(lses_tail))
    compare.assert_matches_reference(out_t[tail], want_out, mag=mag, tol="bfloat16", name="merge_n.out[tail]")
    compare.assert_matches_reference(lse_t[:, tail], want_lse, tol="lse", name="merge_n.lse[tail]", layout="HT")
