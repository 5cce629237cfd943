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
