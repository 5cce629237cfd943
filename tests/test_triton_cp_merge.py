"""triton_impl.cp_merge_attn_states on torch.distributed: what only the torch combine has (docs/spec.md 9).

The results every implementation shares (gather gives the N-way merge's bits, reduce_scatter its values within
tolerance) are tested in tests/test_op_cp_merge.py, from the same spawn of 4 gloo ranks (`cp_ranks.results()`).
Here: bad inputs raise before any collective, on every rank; with validate=True every rank raises when the ranks
disagree or one rank is bad.
"""

import cp_ranks
import pytest
from cp_ranks import WORLD


@pytest.fixture(scope="module")
def results():
    return cp_ranks.results()


@pytest.mark.parametrize("key,match", [
    ("err_method", "method must be one of"),
    ("err_heads", "H must be a multiple of N"),
    ("err_cu_2d", r"cu_seq_lens must be this rank's local KV offsets i32\[R\+1\]"),
    ("err_out_shape", r"output must be \[T, H/N, D\]"),
    ("err_group", "group must be a torch.distributed.ProcessGroup"),
    ("err_group_size", "group_size must be a power of two"),
    ("err_nvfp4_shape", r"output of NVFP4 \(two e2m1 codes a byte\) must be u8\[T, H, D / 2\]"),
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


def test_per_group_fp8_gather_gives_the_n_way_bits_and_reduce_scatter_its_values(results):
    """docs/spec.md 4.7 and 9: "gather" quantizes inside the N-way merge (the single-process merge's bits on every
    rank); "reduce_scatter" quantizes each rank's reduced heads after the sum (within one e4m3 rounding, its scales
    within a few f32 ulps: the sum's order differs)."""
    import numpy as np
    import torch

    import triton_impl
    from parity.harness import cases
    from parity.library import bridge

    case = cp_ranks.CASE_GROUP
    t = {k: bridge.to_torch(v) for k, v in cases.make_inputs_n(case).items()}
    T, H, D, G = case.num_tokens, case.num_heads, case.head_dim, case.group_size
    out = torch.empty((T, H, D), dtype=torch.float8_e4m3fn)
    scales = torch.empty((T, H * D // G))
    triton_impl.merge_attn_states_n(out, t["outputs"][..., :D], t["lses"], None, case.prefill_tokens_with_context,
                                    query_start_loc=t["query_start_loc"], cu_seq_lens=t["cu_seq_lens"],
                                    group_size=G, output_group_scale=scales, scale_ue8m0=case.scale_ue8m0)
    want_q, want_s = out.view(torch.uint8).numpy().reshape(T, -1), scales.numpy()
    for rank in range(WORLD):
        q, s = results[rank]["group_gather"]
        np.testing.assert_array_equal(q.reshape(T, -1), want_q)
        np.testing.assert_array_equal(s.view(np.int32), want_s.view(np.int32))
    q = np.concatenate([results[r]["group_reduce_scatter"][0].reshape(T, -1) for r in range(WORLD)], axis=1)
    s = np.concatenate([results[r]["group_reduce_scatter"][1] for r in range(WORLD)], axis=1)
    assert np.allclose(s, want_s, rtol=2**-18)  # UE8M0: a power of two, the same unless at a boundary
    got = q.view(np.dtype("uint8")).astype(np.int64)
    assert np.abs(got - want_q.astype(np.int64)).max() <= 1



def test_nvfp4_gather_gives_the_n_way_bits_and_reduce_scatter_its_values(results):
    """docs/spec.md 4.8 and 9: "gather" quantizes inside the N-way merge (the single-process merge's bits on every
    rank); "reduce_scatter" quantizes each rank's reduced heads after the sum with the merges' own store (block
    scales within one e4m3 step, codes within one e2m1 step: the sum's order differs); the swizzled layout holds
    the row-major scales at the FP4 GEMMs' offsets, its padding the caller's."""
    import numpy as np
    import torch

    import triton_impl
    from parity.harness import cases
    from parity.harness import reference as R
    from parity.library import bridge

    case = cp_ranks.CASE_NVFP4
    t = {k: bridge.to_torch(v) for k, v in cases.make_inputs_n(case).items()}
    T, H, D = case.num_tokens, case.num_heads, case.head_dim
    out = torch.empty((T, H, D // 2), dtype=torch.uint8)
    scales = torch.empty((T, H * D // 16), dtype=torch.float8_e4m3fn)
    triton_impl.merge_attn_states_n(out, t["outputs"][..., :D], t["lses"], None, case.prefill_tokens_with_context,
                                    t["output_scale"], query_start_loc=t["query_start_loc"],
                                    cu_seq_lens=t["cu_seq_lens"], output_block_scale=scales)
    want_q, want_s = out.numpy().reshape(T, -1), scales.view(torch.uint8).numpy()
    for rank in range(WORLD):
        q, s = results[rank]["nvfp4_gather_row"]
        np.testing.assert_array_equal(q.reshape(T, -1), want_q)
        np.testing.assert_array_equal(s, want_s)
    for method in ("gather", "reduce_scatter"):
        for rank in range(WORLD):
            row, swizzled = results[rank][f"nvfp4_{method}_row"][1], results[rank][f"nvfp4_{method}_swizzled"][1]
            real = R.swizzle_nvfp4_scales(np.ones_like(row)).astype(bool)
            np.testing.assert_array_equal(swizzled[real], R.swizzle_nvfp4_scales(row)[real])
            assert (swizzled[~real] == 0x38).all()  # the caller's padding, untouched
    q = np.concatenate([results[r]["nvfp4_reduce_scatter_row"][0].reshape(T, -1) for r in range(WORLD)], axis=1)
    s = np.concatenate([results[r]["nvfp4_reduce_scatter_row"][1] for r in range(WORLD)], axis=1)
    assert np.abs(s.astype(int) - want_s.astype(int)).max() <= 1
    step = np.abs((R.unpack_fp4(q) & 7).astype(int) - (R.unpack_fp4(want_q) & 7).astype(int))
    assert step.max() <= 1 and (step > 0).mean() < 0.02
