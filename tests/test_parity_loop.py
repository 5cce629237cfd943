"""Tests of `python -m parity loop`: batches at a capacity, the device-offset attention, the chained and fused steps
in both frameworks against float64, CUDA-graph replay = eager bits (GPU), one compile and no re-trace (JAX)."""

import dataclasses

import numpy as np
import pytest

from parity.tools.chunked_prefill.attention import attention_torch
from parity.tools.chunked_prefill.reference import make_batch, reference_prefill, rounded
from parity.tools.loop import CAPACITIES, run_jax, run_torch
from parity.tools.loop.capacity import Capacity, loop_batches, step_inputs

# workspace 8 over 2 requests with context -> budget 4 (pages of 2), chunk KV at most 8 // 2 = 4.
SMALL = Capacity(num_tokens=12, num_requests=4, num_chunks=3, workspace_rows=8, block_size=2, max_query_len=4,
                 min_context_requests=2, num_heads=1, qk_dim=4, v_dim=2)


def small_batch():
    return make_batch([5, 0, 2], [3, 1, 2], num_heads=1, qk_dim=4, v_dim=2, workspace_rows=8, block_size=2)


def test_step_inputs_hand_computed():
    # ctx [5, 0, 2], budget 4: chunk 0 takes [4, 0, 2], chunk 1 [1, 0, 0]; chunk 2 is past the plan (all empty);
    # request 3 is past the batch (no tokens, no KV); row C of cu_seq_lens is the new tokens' offsets.
    x = step_inputs(SMALL, small_batch())
    np.testing.assert_array_equal(x.query_start_loc, [0, 3, 4, 6, 6])
    np.testing.assert_array_equal(x.cu_seq_lens, [[0, 4, 4, 6, 6], [0, 1, 1, 1, 1], [0, 0, 0, 0, 0], [0, 3, 4, 6, 6]])
    np.testing.assert_array_equal(x.context_cu, [0, 5, 5, 7, 7])
    # Request 0's context is rows 0..4, request 2's rows 5..6; padding reads row 0.
    np.testing.assert_array_equal(x.gather, [[0, 1, 2, 3, 5, 6, 0, 0], [4, 0, 0, 0, 0, 0, 0, 0], [0] * 8])
    assert x.q.shape == (12, 1, 4) and x.ctx_v.shape == (SMALL.context_rows, 1, 2) and x.num_tokens == 6
    assert all(a.dtype == np.int32 for a in (x.query_start_loc, x.cu_seq_lens, x.context_cu, x.gather))
    np.testing.assert_array_equal(x.q[6:], 0)


@pytest.mark.parametrize("change, what", [
    (dict(num_chunks=1), "chunks"), (dict(num_requests=2), "requests"), (dict(num_tokens=5), "tokens"),
    (dict(max_query_len=2), "query tokens"), (dict(min_context_requests=3), "chunk budget")])
def test_step_inputs_rejects_a_batch_past_the_capacity(change, what):
    with pytest.raises(ValueError, match=what):
        step_inputs(dataclasses.replace(SMALL, **change), small_batch())


@pytest.mark.parametrize("num_chunks", [1, 3])
def test_loop_batches_fit_and_differ(num_chunks):
    cap = CAPACITIES["ci"].with_chunks(num_chunks)
    batches = loop_batches(cap, 4, seed=1)
    for b in batches:
        step_inputs(cap, b)  # fits, or raises
        assert 0 in b.context_lens and any(b.context_lens)  # requests without context among the others
    assert batches[0].plan().num_chunks == num_chunks
    assert len({(b.context_lens, b.query_lens) for b in batches}) == len(batches)


@pytest.mark.parametrize("causal", [False, True])
def test_dense_attention_matches_the_host_offset_attention(causal):
    # The device-offset attention of the CPU step against the modelled backend on host offsets (fp32): equal on
    # every row with KV; a row with no KV has LSE -inf (whatever its output holds).
    import torch

    from parity.tools.loop.torch_step import dense_attention

    rng = np.random.default_rng(0)
    qsl = np.array([0, 3, 3, 7, 9], np.int32)  # request 1 has no tokens; tokens 9.. are padding
    cu = qsl.copy() if causal else np.array([0, 2, 5, 5, 8], np.int32)  # non-causal: request 2 has no KV
    q, k, v = (torch.from_numpy(rng.standard_normal((n, 2, d), dtype=np.float32))
               for n, d in ((11, 8), (10, 8), (10, 4)))
    out, lse = dense_attention(q, k, v, torch.from_numpy(qsl), torch.from_numpy(cu), causal=causal, scale=0.3)
    want_out, want_lse = attention_torch(q, k, v, qsl, cu, causal=causal, empty_behavior="fa3", scale=0.3)
    has_kv = np.zeros(11, bool)
    for r in range(4):
        has_kv[qsl[r]:qsl[r + 1]] = cu[r + 1] > cu[r]
    np.testing.assert_allclose(out[has_kv].numpy(), want_out[has_kv].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lse[:, has_kv].numpy(), want_lse[:, has_kv].numpy(), rtol=1e-5, atol=1e-5)
    assert np.isneginf(lse[:, ~has_kv].numpy()).all()


def _ci_case(num_chunks, num_batches=3):
    cap = CAPACITIES["ci"].with_chunks(num_chunks)
    batches = loop_batches(cap, num_batches, seed=3)
    return cap, batches, [reference_prefill(b) for b in batches]


def _clean(row):
    assert row["rows_corrupted"] == 0 and row["rows_total"] > 0
    assert not any(b["any_nan"] for b in row["batches"])
    assert row["max_abs_err"] < 1e-4  # fp32 partials and merges


def test_torch_loop_on_cpu_chained_and_fused_match_float64():
    cap, batches, wants = _ci_case(2)
    assert {b.plan().num_chunks for b in batches} == {1, 2}  # a batch with an all-empty chunk at the capacity
    rows = run_torch(cap, batches, wants, device="cpu", on_gpu=False, tolerance=1e-3, measure=False)
    assert [r["method"] for r in rows] == ["chained", "fused"]
    for r in rows:
        _clean(r)
        assert r["replay_bits_equal"] is None  # no CUDA graphs on a CPU


def test_torch_loop_masks_from_the_offsets_written():
    # The step decides emptiness only from the offsets in its buffers: write whole-context offsets that say no
    # request has context and the chained step's final merge drops every context, so exactly the tokens of the
    # requests with context go wrong, while the fused step (which masks from the chunk offsets) stays clean.
    from parity.tools.demo import compare_rows
    from parity.tools.loop.torch_step import TorchLoop

    cap, batches, wants = _ci_case(2, num_batches=1)
    b, want = batches[0], wants[0]
    x = step_inputs(cap, b)
    loop = TorchLoop(cap, device="cpu", kernel="dense", dtype="float32")
    loop.write(dataclasses.replace(x, context_cu=np.zeros_like(x.context_cu)))
    with np.errstate(all="ignore"):
        chained = loop.step("chained")[:b.num_tokens].numpy()
        fused = loop.step("fused")[:b.num_tokens].numpy()
    with_context = sum(q for c, q in zip(b.context_lens, b.query_lens) if c)
    assert compare_rows(chained, want, b.query_start_loc)["rows_corrupted"] == with_context > 0
    assert compare_rows(fused, want, b.query_start_loc)["rows_corrupted"] == 0


@pytest.mark.parametrize("merge_impl", ["pallas", "jnp"])
def test_jax_loop_compiles_once_and_never_retraces(merge_impl):
    cap, batches, wants = _ci_case(2)
    assert len({b.num_tokens for b in batches} | {b.num_requests for b in batches}) > 1
    rows = run_jax(cap, batches, wants, on_gpu=False, tolerance=1e-3, measure=False, merge_impl=merge_impl)
    for r in rows:
        _clean(r)
        assert r["first_call_compiles"] == 1 and r["first_call_traces"] >= 1
        assert r["later_traces"] == 0 and r["later_compiles"] == 0  # 3 batches of different lengths
        assert r["repeat_bits_equal"]


def test_cli_loop_runs_and_writes_json(tmp_path, capsys):
    import json

    from parity import cli

    path = tmp_path / "loop.json"
    rc = cli.main(["loop", "--framework", "torch", "--size", "ci", "--no-measure", "--chunks", "1", "--batches", "2",
                   "--json", str(path)])
    assert rc == 0
    assert "replay / re-trace" in capsys.readouterr().out
    report = json.loads(path.read_text())
    assert report["ok"] and report["env"] and len(report["rows"]) == 2
    assert cli.main(["loop", "--chunks", "0"]) == 2  # a usage error


# --------------------------------------------------------------------------------------------------
# GPU: FlashAttention-2 / cuDNN partials, the CUDA graph replayed for every batch
# --------------------------------------------------------------------------------------------------

GPU_SMALL = Capacity(num_tokens=1024, num_requests=16, num_chunks=4, workspace_rows=2048, block_size=64,
                     max_query_len=128, min_context_requests=8, num_heads=8, qk_dim=192, v_dim=128)


def _gpu_case(num_chunks):
    cap = GPU_SMALL.with_chunks(num_chunks)
    batches = [rounded(b, "bfloat16") for b in loop_batches(cap, 3, seed=5)]
    return cap, batches, [reference_prefill(b) for b in batches]


@pytest.mark.gpu
@pytest.mark.parametrize("num_chunks", [1, 4])
def test_torch_loop_graph_replay_equals_eager_bits(num_chunks):
    cap, batches, wants = _gpu_case(num_chunks)
    rows = run_torch(cap, batches, wants, device="cuda", on_gpu=True, tolerance=5e-2, measure=False)
    for r in rows:
        assert r["rows_corrupted"] == 0 and not any(b["any_nan"] for b in r["batches"])
        assert r["replay_bits_equal"] is True


@pytest.mark.gpu
@pytest.mark.parametrize("num_chunks", [1, 4])
def test_jax_loop_on_gpu_compiles_once(num_chunks):
    cap, batches, wants = _gpu_case(num_chunks)
    rows = run_jax(cap, batches, wants, on_gpu=True, tolerance=5e-2, measure=False, merge_impl="pallas")
    for r in rows:
        assert r["rows_corrupted"] == 0 and not any(b["any_nan"] for b in r["batches"])
        assert r["later_traces"] == 0 and r["later_compiles"] == 0 and r["repeat_bits_equal"]
