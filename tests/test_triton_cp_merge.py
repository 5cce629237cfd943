"""triton_impl.cp_merge_attn_states (docs/spec.md 9) on torch.distributed: 4 gloo ranks (spawned processes).

Each rank holds one partial of an N-way case (its KV shard: partials empty for some requests, NaN garbage under
finite LSEs) and its own KV offsets. `gather` must give the single-process N-way merge's bits; `reduce_scatter`
the same values within the merge tolerance (and the N-way LSE bits: the LSE is computed, not reduced). Bad inputs
raise before any collective, and with validate=True on every rank. One spawn runs every scenario (`_worker`).
"""

import dataclasses

import numpy as np
import pytest
import torch

import triton_impl
from parity.library import bridge, compare
from parity.harness import cases, expected, impls
from parity.tools import ranks

WORLD = 4
CASE = cases.by_name("n4_bf16_fp8_out")  # N = 4, H = 4, R = 3, bf16, specials, partials without KV
CASE_BF16 = dataclasses.replace(CASE, out_dtype=None, prefill_tokens_with_context=30)
H, D, T = CASE.num_heads, CASE.head_dim, CASE.num_tokens


def _local(case, rank):
    inp = cases.make_inputs_n(case)
    t = {k: bridge.to_torch(v) for k, v in inp.items()}
    return t["outputs"][rank, ..., :D], t["lses"][rank], t["query_start_loc"], t["cu_seq_lens"][rank], t


def _combine(case, rank, world, group, method, **kw):
    part, lse, qsl, cu, t = _local(case, rank)
    heads = H if method == "gather" else H // world
    dtype = torch.float8_e4m3fn if case.out_dtype else part.dtype
    out = torch.full((T, heads, D), float("nan")).to(dtype)
    out_lse = torch.full((heads, T), float("nan"))
    triton_impl.cp_merge_attn_states(out, part, lse, group, out_lse, case.prefill_tokens_with_context,
                                     t.get("output_scale"), method=method, query_start_loc=qsl, cu_seq_lens=cu, **kw)
    return bridge.to_numpy(out), bridge.to_numpy(out_lse)


def _error(fn):
    try:
        fn()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return None


def _worker(rank, world, group):
    got = {}
    for name, case in (("bf16", CASE_BF16), ("fp8", CASE)):
        for method in ("gather", "reduce_scatter"):
            got[f"{name}_{method}"] = _combine(case, rank, world, group, method)
        # The single-process N-way merge, run like the ranks' kernels (Triton's interpreter on CPU tensors).
        got[f"{name}_single"] = _single_process(case) if rank == 0 else None
    got["bf16_reduce_scatter_bf16_reduce"] = _combine(CASE_BF16, rank, world, group, "reduce_scatter",
                                                      reduce_dtype=torch.bfloat16)
    part, lse, qsl, cu, _ = _local(CASE_BF16, rank)
    out = torch.empty(T, H, D, dtype=part.dtype)
    # Errors every rank finds alone, before any collective (all ranks raise: nobody waits in a collective).
    got["err_method"] = _error(lambda: triton_impl.cp_merge_attn_states(out, part, lse, group, method="allreduce"))
    got["err_heads"] = _error(lambda: triton_impl.cp_merge_attn_states(
        torch.empty(T, 1, D, dtype=part.dtype), part[:, :3], lse[:3], group, method="reduce_scatter"))
    got["err_cu_2d"] = _error(lambda: triton_impl.cp_merge_attn_states(
        out, part, lse, group, query_start_loc=qsl, cu_seq_lens=cu[None].expand(world, -1)))
    got["err_out_shape"] = _error(lambda: triton_impl.cp_merge_attn_states(out, part, lse, group, method="reduce_scatter"))
    got["err_group"] = _error(lambda: triton_impl.cp_merge_attn_states(out, part, lse, None))
    # validate=True: inputs that differ between ranks, or a bad input on one rank only: every rank raises.
    bad_part = part.half() if rank == 2 else part
    got["validate_dtype_differs"] = _error(lambda: triton_impl.cp_merge_attn_states(
        torch.empty(T, H, D, dtype=bad_part.dtype), bad_part, lse, group, validate=True))
    bad_cu = cu[:-1] if rank == 1 else cu
    got["validate_one_rank_bad"] = _error(lambda: triton_impl.cp_merge_attn_states(
        out, part, lse, group, query_start_loc=qsl, cu_seq_lens=bad_cu, validate=True))
    got["validate_ok"] = _error(lambda: triton_impl.cp_merge_attn_states(
        out, part, lse, group, query_start_loc=qsl, cu_seq_lens=cu, validate=True))
    return got


@pytest.fixture(scope="module")
def results():
    out = ranks.run_ranks(_worker, WORLD)
    for r, res in enumerate(out):
        assert res[0] == "ok", f"rank {r}: {res[1]}\n{res[2]}"
    return [res[1] for res in out]


def _single_process(case):
    """The single-process N-way merge of the same partials (Triton): the bits `gather` must give."""
    inp = cases.make_inputs_n(case)
    t = {k: bridge.to_torch(v) for k, v in inp.items()}
    r = impls.run(impls.make_runtime(), "triton", "merge_n_fused", case, t)
    return inp, bridge.to_numpy(r["out"]), bridge.to_numpy(r["lse"])


def _bits(x):
    return np.asarray(x).view({4: np.uint32, 2: np.uint16, 1: np.uint8}[np.asarray(x).dtype.itemsize])


@pytest.mark.parametrize("name,case", [("bf16", CASE_BF16), ("fp8", CASE)])
def test_gather_gives_the_single_process_bits_on_every_rank(results, name, case):
    _, want_out, want_lse = results[0][f"{name}_single"]
    for rank in range(WORLD):
        out, lse = results[rank][f"{name}_gather"]
        assert np.array_equal(_bits(out), _bits(want_out)), f"rank {rank}: out differs from the N-way merge"
        assert np.array_equal(_bits(lse), _bits(want_lse)), f"rank {rank}: lse differs from the N-way merge"


@pytest.mark.parametrize("name,case,variant", [("bf16", CASE_BF16, "reduce_scatter"), ("fp8", CASE, "reduce_scatter"),
                                               ("bf16", CASE_BF16, "reduce_scatter_bf16_reduce")])
def test_reduce_scatter_within_tolerance(results, name, case, variant):
    inp, _, want_lse = results[0][f"{name}_single"]
    out = np.concatenate([results[r][f"{name}_{variant}"][0] for r in range(WORLD)], axis=1)  # rank r: its heads
    lse = np.concatenate([results[r][f"{name}_{variant}"][1] for r in range(WORLD)], axis=0)
    # The LSE is computed from the gathered LSEs, not reduced: the N-way merge's bits.
    assert np.array_equal(_bits(lse), _bits(want_lse))
    ref = impls.run(impls.HOST, "reference", "merge_n_fused", case, inp)
    w = expected.merge_weights(case, "merge_n_fused", inp)
    mag = expected.magnitude(case, "merge_n_fused", inp, w)
    out_exact, _ = expected.exact_masks(case, w)
    # One rounding at the end (f32 sum), or one per rank with a bf16 reduction: N + 1 roundings of the output dtype.
    tol = compare.TOLERANCES[case.out_dtype or case.dtype]
    if variant.endswith("bf16_reduce"):
        tol = compare.Tolerance(rtol=(WORLD + 1) * tol.rtol, atol=(WORLD + 1) * tol.atol)
    compare.assert_matches_reference(out, ref["out"], exact=np.broadcast_to(out_exact[..., None], mag.shape), mag=mag,
                                     tol=tol, name=f"cp {variant}.out", case=case)
    if case.prefill_tokens_with_context is not None and case.out_dtype is None:
        # 8.4: the last rank's rows exactly (the reduction canonicalises NaN payloads: NaN stays NaN).
        ptwc = case.prefill_tokens_with_context
        got, want = out[ptwc:], inp["outputs"][-1, ptwc:, :, :D]
        nan = np.isnan(want.astype(np.float32))
        assert np.array_equal(np.isnan(got.astype(np.float32)), nan)
        assert np.array_equal(_bits(got)[~nan], _bits(want)[~nan])


@pytest.mark.parametrize("key,match", [
    ("err_method", "method must be one of"),
    ("err_heads", "H must be a multiple of N"),
    ("err_cu_2d", r"cu_seq_lens must be this rank's local KV offsets i32\[R\+1\]"),
    ("err_out_shape", r"output must be \[T, H/N, D\]"),
    ("err_group", "group must be a torch.distributed.ProcessGroup"),
])
def test_local_errors_raise_on_every_rank_before_any_collective(results, key, match):
    import re

    for rank in range(WORLD):
        assert results[rank][key] is not None and re.search(match, results[rank][key]), (rank, results[rank][key])


def test_validate_makes_every_rank_raise_when_ranks_disagree(results):
    msgs = [results[r]["validate_dtype_differs"] for r in range(WORLD)]
    assert all(m is not None for m in msgs), msgs  # nobody was left waiting: every rank returned
    for m in msgs:
        assert "disagree on partial_output.dtype" in m and "rank 2=" in m, m


def test_validate_makes_every_rank_raise_when_one_rank_is_bad(results):
    msgs = [results[r]["validate_one_rank_bad"] for r in range(WORLD)]
    assert "cu_seq_lens.shape" in msgs[1], msgs[1]  # the bad rank: its own error
    for r in (0, 2, 3):
        assert "rank(s) [1]" in msgs[r], msgs[r]
    assert all(results[r]["validate_ok"] is None for r in range(WORLD))
