"""Tests of the chunked-context prefill demo: planner, backend-like attention, reference, paths, run_demo."""

import numpy as np
import pytest

from parity.tools import chunked_prefill as cp
from parity.tools import demo
from parity.harness import reference

# A tiny batch for the per-behaviour path tests: budget 24 // 3 = 8 (pages of 4), cdiv(20, 8) = 3 chunks;
# request 1 (3 tokens) runs out after chunk 0, request 2 (9) after chunk 1, request 3 has no context.
TINY = dict(context_lens=[20, 3, 9, 0], query_lens=[3, 2, 4, 2], num_heads=2, qk_dim=32, v_dim=16,
            workspace_rows=24, block_size=4)


def tiny_batch(seed=0):
    kw = dict(TINY)
    return cp.make_batch(kw.pop("context_lens"), kw.pop("query_lens"), seed=seed, **kw)


# --------------------------------------------------------------------------------------------------
# Planner
# --------------------------------------------------------------------------------------------------

# Each expectation worked out by hand from the rule: budget = (W // n_with_context) rounded down to
# the page, num_chunks = cdiv(max ctx, budget), chunk i covers [i*budget, (i+1)*budget).
PLAN_CASES = [
    # n = 2 -> 16 // 2 = 8 -> 8; cdiv(10, 8) = 2; request 1: 3 then 0; request 2: 8 then 2.
    dict(ctx=[0, 3, 10], W=16, block=2, budget=8, lens=[[0, 3, 8], [0, 0, 2]],
         cu=[[0, 0, 3, 11], [0, 0, 0, 2]], empty=[True, True]),
    # pages of 3: 8 -> 6; cdiv(10, 6) = 2; request 2: 6 then 4.
    dict(ctx=[0, 3, 10], W=16, block=3, budget=6, lens=[[0, 3, 6], [0, 0, 4]],
         cu=[[0, 0, 3, 9], [0, 0, 0, 4]], empty=[True, True]),
    # n = 2 -> 5 -> 4; cdiv(9, 4) = 3; chunk 0 has no empty row, so its guard is False.
    dict(ctx=[4, 9], W=10, block=4, budget=4, lens=[[4, 4], [0, 4], [0, 1]],
         cu=[[0, 4, 8], [0, 0, 4], [0, 0, 1]], empty=[False, True, True]),
    # Exactly one chunk, nothing empty.
    dict(ctx=[8, 8], W=16, block=8, budget=8, lens=[[8, 8]], cu=[[0, 8, 16]], empty=[False]),
    # The demo's default batch: n = 4 -> 32; cdiv(90, 32) = 3; 90 = 32 + 32 + 26, 40 = 32 + 8.
    dict(ctx=[90, 5, 40, 17, 0, 0], W=128, block=16, budget=32,
         lens=[[32, 5, 32, 17, 0, 0], [32, 0, 8, 0, 0, 0], [26, 0, 0, 0, 0, 0]],
         cu=[[0, 32, 37, 69, 86, 86, 86], [0, 32, 32, 40, 40, 40, 40], [0, 26, 26, 26, 26, 26, 26]],
         empty=[True, True, True]),
]


@pytest.mark.parametrize("c", PLAN_CASES, ids=lambda c: f"ctx{c['ctx']}-W{c['W']}-b{c['block']}")
def test_plan_chunks_hand_computed(c):
    plan = cp.plan_chunks(c["ctx"], c["W"], c["block"])
    assert plan.budget == c["budget"]
    assert plan.num_chunks == len(c["lens"])
    assert plan.chunk_seq_lens.dtype == np.int32 and plan.cu_seq_lens.dtype == np.int32
    np.testing.assert_array_equal(plan.chunk_seq_lens, np.array(c["lens"]))
    np.testing.assert_array_equal(plan.cu_seq_lens, np.array(c["cu"]))
    assert plan.has_empty == c["empty"]
    assert all(type(x) is bool for x in plan.has_empty)  # host bools, usable as a launch guard


@pytest.mark.parametrize("seed", range(5))
def test_plan_chunks_covers_every_context_once(seed):
    rng = np.random.default_rng(seed)
    ctx = rng.integers(0, 300, size=int(rng.integers(1, 40)))
    ctx[0] = max(ctx[0], 1)
    block = int(rng.choice([1, 4, 16]))
    n_ctx = int((ctx > 0).sum())
    workspace = n_ctx * block * int(rng.integers(1, 6)) + int(rng.integers(0, block))
    plan = cp.plan_chunks(ctx.tolist(), workspace, block)
    assert plan.budget % block == 0 and 0 < plan.budget * n_ctx <= workspace
    np.testing.assert_array_equal(plan.chunk_seq_lens.sum(axis=0), ctx)  # every position exactly once
    assert (plan.chunk_seq_lens <= plan.budget).all()
    assert plan.cu_seq_lens[:, -1].max() <= workspace  # a chunk fits the workspace
    for i in range(plan.num_chunks):
        idx = cp.chunk_gather_index(plan, i, np.concatenate([[0], np.cumsum(ctx)]))
        assert idx.size == plan.cu_seq_lens[i, -1]


def test_plan_chunks_without_context():
    plan = cp.plan_chunks([0, 0, 0], 64, 16)
    assert (plan.budget, plan.num_chunks, plan.has_empty) == (0, 0, [])
    assert plan.chunk_seq_lens.shape == (0, 3) and plan.cu_seq_lens.shape == (0, 4)


@pytest.mark.parametrize("ctx, workspace, block, exc", [
    ([1, 1, 1], 5, 2, ValueError),  # 5 // 3 = 1 row each: less than one page of 2
    ([3, -1], 16, 2, ValueError),
    ([3, 1], 16, 0, ValueError),
    ([3, 1], 0, 2, ValueError),
    ([1.5, 2.0], 16, 2, TypeError),
])
def test_plan_chunks_rejects(ctx, workspace, block, exc):
    with pytest.raises(exc):
        cp.plan_chunks(ctx, workspace, block)


@pytest.mark.parametrize("ctx, qsl, want", [
    ([5, 3, 0, 0], [0, 2, 5, 6, 9], 5),  # the two requests with context own tokens [0, 5)
    ([2, 2], [0, 1, 3], 3),  # all have context: nothing passes through
    ([0, 0], [0, 1, 3], 0),  # none has context: everything passes through
    ([0, 5], [0, 1, 3], None),  # a request without context comes first: no such count
    ([4, 0, 7], [0, 1, 2, 3], None),
])
def test_prefill_tokens_with_context(ctx, qsl, want):
    assert cp.prefill_tokens_with_context(ctx, np.array(qsl, np.int32)) == want


# --------------------------------------------------------------------------------------------------
# Attention stand-ins and the float64 reference
# --------------------------------------------------------------------------------------------------

def _np_attention(q, k, v, qsl, cu, causal, scale):
    """float64 varlen attention on the non-empty requests: {token: (out[H, Dv], lse[H])}."""
    res = {}
    for r in range(len(qsl) - 1):
        if cu[r + 1] == cu[r]:
            continue
        s = np.einsum("qhd,khd->hqk", q[qsl[r]:qsl[r + 1]].astype(np.float64),
                      k[cu[r]:cu[r + 1]].astype(np.float64)) * scale
        if causal:
            s = np.where(np.triu(np.ones(s.shape[1:], bool), 1), -np.inf, s)
        m = s.max(-1, keepdims=True)
        lse = np.log(np.exp(s - m).sum(-1)) + m[..., 0]
        out = np.einsum("hqk,khd->qhd", np.exp(s - lse[..., None]), v[cu[r]:cu[r + 1]].astype(np.float64))
        for j in range(out.shape[0]):
            res[qsl[r] + j] = (out[j], lse[:, j])
    return res


def _to_numpy(x):
    return x.cpu().numpy() if hasattr(x, "cpu") else np.asarray(x)


def _attention(framework):
    if framework == "torch":
        import torch

        def run(q, k, v, *a, **kw):
            return cp.attention_torch(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), *a, **kw)
    else:
        import jax.numpy as jnp

        def run(q, k, v, *a, **kw):
            return cp.attention_jax(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), *a, **kw)
    return run


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("behavior", list(cp.EMPTY_BEHAVIORS))
def test_attention_rows(framework, behavior):
    rng = np.random.default_rng(3)
    H, D, Dv = 3, 16, 8
    qsl = np.array([0, 3, 5, 5, 9], np.int32)  # request 2 has no query tokens
    cu = np.array([0, 4, 4, 6, 13], np.int32)  # request 1 has no KV tokens
    q = rng.standard_normal((10, H, D), dtype=np.float32)  # token 9 is padding
    k = rng.standard_normal((13, H, D), dtype=np.float32)
    v = rng.standard_normal((13, H, Dv), dtype=np.float32)
    out, lse = _attention(framework)(q, k, v, qsl, cu, causal=False, empty_behavior=behavior, scale=0.3)
    out, lse = _to_numpy(out), _to_numpy(lse)
    assert out.shape == (10, H, Dv) and lse.shape == (H, 10)
    beh = cp.EMPTY_BEHAVIORS[behavior]
    np.testing.assert_array_equal(lse[:, 3:5], np.full((H, 2), beh.lse, np.float32))
    np.testing.assert_array_equal(out[3:5], np.full((2, H, Dv), beh.output, np.float32))
    assert np.isnan(out[9]).all() and np.isnan(lse[:, 9]).all()  # padding stays poisoned
    want = _np_attention(q, k, v, qsl, cu, False, 0.3)
    assert sorted(want) == [0, 1, 2, 5, 6, 7, 8]
    for t, (o, l) in want.items():
        np.testing.assert_allclose(out[t], o, rtol=0, atol=1e-5)
        np.testing.assert_allclose(lse[:, t], l, rtol=0, atol=1e-5)


@pytest.mark.parametrize("framework", ["torch", "jax"])
def test_attention_causal(framework):
    rng = np.random.default_rng(4)
    qsl = np.array([0, 1, 5], np.int32)
    q, k = (rng.standard_normal((5, 2, 8), dtype=np.float32) for _ in range(2))
    v = rng.standard_normal((5, 2, 4), dtype=np.float32)
    out, lse = _attention(framework)(q, k, v, qsl, qsl, causal=True, scale=0.5)
    out, lse = _to_numpy(out), _to_numpy(lse)
    np.testing.assert_allclose(out[[0, 1]], v[[0, 1]], atol=1e-6)  # a first token sees only itself
    want = _np_attention(q, k, v, qsl, qsl, True, 0.5)
    for t, (o, l) in want.items():
        np.testing.assert_allclose(out[t], o, rtol=0, atol=1e-5)
        np.testing.assert_allclose(lse[:, t], l, rtol=0, atol=1e-5)
    with pytest.raises(ValueError):  # causal needs as many KV as query tokens per request
        _attention(framework)(q, k[:4], v[:4], qsl, np.array([0, 1, 4], np.int32), causal=True)


def test_reference_prefill_first_token_without_context():
    batch = tiny_batch()
    out = cp.reference_prefill(batch)
    t = int(batch.query_start_loc[3])  # request 3: no context, its first token sees only itself
    np.testing.assert_allclose(out[t], batch.new_v[t], rtol=0, atol=1e-12)


def test_float64_chunked_pipeline_matches_reference():
    """The chunk plan, masked and merged by `parity.harness.reference`, reproduces monolithic attention."""
    import torch

    batch = tiny_batch(seed=1)
    plan = batch.plan()
    q = torch.from_numpy(batch.q)
    qsl = batch.query_start_loc
    state = None
    for i in range(plan.num_chunks):
        idx = cp.chunk_gather_index(plan, i, batch.context_start_loc)
        out, lse = cp.attention_torch(q, torch.from_numpy(batch.ctx_k[idx]), torch.from_numpy(batch.ctx_v[idx]),
                                      qsl, plan.cu_seq_lens[i], causal=False, empty_behavior="finite_nan")
        lse, out = reference.mask_empty_context_lse(lse.numpy(), qsl, plan.cu_seq_lens[i], out.numpy())
        state = (out, lse) if state is None else reference.merge_attn_states(*state, out, lse)
    new_out, new_lse = cp.attention_torch(q, torch.from_numpy(batch.new_k), torch.from_numpy(batch.new_v),
                                          qsl, qsl, causal=True)
    got, _ = reference.merge_attn_states(*state, new_out.numpy(), new_lse.numpy(),
                                         prefill_tokens_with_context=batch.prefill_tokens_with_context())
    np.testing.assert_allclose(got, cp.reference_prefill(batch), rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# The three paths with the kernels, per framework and empty-row behaviour
# --------------------------------------------------------------------------------------------------

def _requests_hit_by_the_bug(batch):
    """Requests with context whose context is empty in some chunk: the ones an unmasked merge spoils."""
    plan = batch.plan()
    ctx = np.array(batch.context_lens)
    return [r for r in range(batch.num_requests) if ctx[r] > 0 and (plan.chunk_seq_lens[:, r] == 0).any()]


@pytest.fixture(scope="module")
def demo_run():
    """run_demo once for the module: the Pallas interpreter compiles per shape, so every path test and
    the ok-flag test share one run (both frameworks, every behaviour, every path)."""
    return demo.run_demo(framework="both")


@pytest.mark.parametrize("framework", ["torch", "jax"])
@pytest.mark.parametrize("behavior", list(cp.EMPTY_BEHAVIORS))
def test_paths(demo_run, framework, behavior):
    batch = demo.demo_batch()
    rows, _ = demo_run
    by_path = {r["path"]: r for r in rows if r["framework"] == framework and r["empty_behavior"] == behavior}
    assert sorted(by_path) == sorted(demo.PATHS)
    for path, r in by_path.items():
        assert r["rows_total"] == batch.num_tokens
        assert r["passthrough_exact"] is True, path  # requests 4 and 5 (no context) are bit copies
        if path == "no_mask" and behavior == "finite_nan":
            hit = _requests_hit_by_the_bug(batch)
            assert hit == [1, 2, 3]
            assert r["requests_corrupted"] == hit and r["any_nan"]
            assert r["rows_corrupted"] == sum(batch.query_lens[i] for i in hit)
            assert r["ok"] and r["expected"] == "corrupted"
        else:  # fixed paths always; unfixed too when the merge reads the sentinel as empty (docs/spec.md 4.1)
            assert r["rows_corrupted"] == 0 and not r["any_nan"], (path, r)
            assert r["max_abs_err"] <= demo.TOLERANCE
            assert r["ok"]


def test_run_demo_default_is_ok(demo_run):
    rows, ok = demo_run
    assert ok
    assert len(rows) == len(demo.FRAMEWORKS) * len(cp.EMPTY_BEHAVIORS) * len(demo.PATHS)
    plan = demo.demo_batch().plan()
    assert plan.num_chunks >= 3 and all(plan.has_empty[1:])
    table = demo.format_demo_table(rows)
    assert len(table.splitlines()) == len(rows) + 4  # caption, header, rule, rows, footnote
    assert "FAIL" not in table and "corrupted" in table


def test_demo_needs_the_corrupting_behaviour():
    rows, ok = demo.run_batch(tiny_batch(), framework="torch", behaviors=["fa3"])
    assert all(r["ok"] for r in rows) and not ok  # clean, but the bug was not shown


def test_run_demo_rejects():
    with pytest.raises(ValueError):
        demo.run_demo(framework="tf")
    with pytest.raises(ValueError):
        demo.run_demo(size="huge")
    with pytest.raises(ValueError):
        demo.run_batch(tiny_batch(), framework="torch", behaviors=["fa4"])


def test_large_config():
    cfg = demo.demo_config("large")
    ctx = np.array(cfg["context_lens"])
    plan = cp.plan_chunks(ctx, cfg["workspace_rows"], cfg["block_size"])
    k = int((ctx > 0).sum())
    assert len(ctx) == 64 and sum(cfg["query_lens"]) > 1000
    assert (ctx[:k] > 0).all() and (ctx[k:] == 0).all() and k < 64  # requests with context first
    assert plan.num_chunks >= 3 and all(plan.has_empty)
    qsl = np.concatenate([[0], np.cumsum(cfg["query_lens"])])
    assert cp.prefill_tokens_with_context(ctx, qsl) == qsl[k]


# --------------------------------------------------------------------------------------------------------
# The context-parallel reproduction (docs/spec.md 9)


@pytest.mark.parametrize("interleave", [1, 2, 8])
def test_cp_shard_places_every_kv_token_once(interleave):
    # DCP placement: token j of a request on rank (j // interleave) % N; the shards partition each context.
    ctx = [0, 1, 5, 17, 33]
    csl = np.concatenate([[0], np.cumsum(ctx)]).astype(np.int32)
    shards = cp.cp_shard(ctx, csl, 4, interleave)
    rows = np.sort(np.concatenate([idx for idx, _ in shards]))
    np.testing.assert_array_equal(rows, np.arange(sum(ctx)))
    for rank, (idx, cu) in enumerate(shards):
        assert cu[0] == 0 and cu[-1] == idx.size and (np.diff(cu) >= 0).all()
        for r in range(len(ctx)):
            j = idx[cu[r]:cu[r + 1]] - csl[r]  # positions within request r
            assert ((j // interleave) % 4 == rank).all()
    # A 1-token context lives on rank 0 only: ranks 1..3 hold no KV for it (the CP empty row).
    assert [int(np.diff(cu)[1]) for _, cu in shards] == [1, 0, 0, 0]


def test_cp_demo_cli_reproduces_and_fixes_in_both_frameworks():
    # `python -m parity demo --cp 2`: torch on 2 gloo ranks, JAX on a 2-device CPU mesh (the CLI forces them). Two
    # ranks keep the test short (each gloo rank imports torch and triton); 4 ranks' shards are
    # test_cp_shard_places_every_kv_token_once's, 4-rank combines tests/test_op_cp_merge.py's and
    # tests/test_pallas_sharding.py's.
    import subprocess
    import sys
    from pathlib import Path

    r = subprocess.run([sys.executable, "-m", "parity", "demo", "--cp", "2", "--interleave", "2"],
                       cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [line.split() for line in r.stdout.splitlines() if line.startswith(("torch ", "jax "))]
    assert {row[0] for row in rows} == {"torch", "jax"}
    assert any(line.startswith("torch ") and "2 gloo ranks" in line for line in r.stdout.splitlines()), r.stdout
    # JAX: a real 2-device mesh (on CPU the CLI forces 2 devices), or on a GPU of fewer than 2 devices, 2 ranks
    # simulated by a named vmap on it; never simulated ranks on a CPU.
    assert any(line.startswith("jax ") and ("2-device mesh" in line or "2 ranks simulated by jax.vmap on gpu" in line)
               for line in r.stdout.splitlines()), r.stdout
    for row in rows:
        line = " ".join(row)
        if "finite_nan" in line and "no_mask" in line:
            assert "corrupted ok" in line and not line.split("no_mask")[1].split()[0].startswith("0/"), line
        elif " gather " in f" {line} " or "reduce_scatter" in line:
            assert "clean ok" in line and " 0/" in f" {line}", line


def test_cp_demo_rejects():
    from parity.tools import demo_cp

    with pytest.raises(ValueError, match="at least 2 ranks"):
        demo_cp.run_cp_demo(cp=1)
    with pytest.raises(ValueError, match="not a multiple of --cp 3"):
        demo_cp.run_cp_demo(cp=3)


# --------------------------------------------------------------------------------------------------
# Real attention kernels (--backend): the partials come from a kernel, not a model
# --------------------------------------------------------------------------------------------------

def test_jax_dpa_attention_matches_float64():
    """`attention_jax_dpa` (jax.nn.dot_product_attention, XLA) repacks per-request rows correctly: every row with KV
    matches float64 attention, causal and not; rows without KV hold what the function leaves (finite here)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(5)
    qsl = np.array([0, 3, 5, 5, 9], np.int32)
    cu = np.array([0, 4, 4, 6, 13], np.int32)  # request 1 has no KV tokens
    q = rng.standard_normal((9, 2, 16), dtype=np.float32)
    k = rng.standard_normal((13, 2, 16), dtype=np.float32)
    v = rng.standard_normal((13, 2, 8), dtype=np.float32)  # Dv < Dqk: V padded, output sliced
    out, lse = cp.attention_jax_dpa(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), qsl, cu, causal=False,
                                    implementation="xla", scale=0.3)
    out, lse = _to_numpy(out), _to_numpy(lse)
    assert out.shape == (9, 2, 8) and lse.shape == (2, 9)
    for t, (o, l) in _np_attention(q, k, v, qsl, cu, False, 0.3).items():
        np.testing.assert_allclose(out[t], o, rtol=0, atol=1e-5)
        np.testing.assert_allclose(lse[:, t], l, rtol=0, atol=1e-5)
    seen = cp.empty_row_classes(out, lse, qsl, cu)
    assert sum(seen["lse"].values()) == 2 * 2 and sum(seen["out_rows"].values()) == 2
    out, lse = cp.attention_jax_dpa(jnp.asarray(q), jnp.asarray(q), jnp.asarray(q[..., :8]), qsl, qsl, causal=True,
                                    implementation="xla", scale=0.5)
    for t, (o, l) in _np_attention(q, q, q[..., :8], qsl, qsl, True, 0.5).items():
        np.testing.assert_allclose(_to_numpy(out)[t], o, rtol=0, atol=1e-5)
        np.testing.assert_allclose(_to_numpy(lse)[:, t], l, rtol=0, atol=1e-5)


def test_naive_merge_nan_on_both_empty_rows():
    """The naive merge (upstream's formula without the both-empty guard) gives NaN exactly where both LSEs are
    empty, and the float64 reference's result elsewhere."""
    rng = np.random.default_rng(6)
    a, b = (rng.standard_normal((4, 2, 3)).astype(np.float32) for _ in range(2))
    p = np.array([[1.0, np.inf, -np.inf, 0.5], [0.0, -np.inf, 2.0, np.inf]], np.float32)
    s = np.array([[0.0, 1.0, -np.inf, np.inf], [np.inf, -np.inf, 1.0, -np.inf]], np.float32)
    got = demo.naive_merge(a, p, b, s)["out"]
    both = np.isneginf(np.where(p == np.inf, -np.inf, p)) & np.isneginf(np.where(s == np.inf, -np.inf, s))
    assert both.sum() == 3
    assert np.isnan(got.transpose(1, 0, 2)[both]).all()
    want, _ = reference.merge_attn_states(a, p, b, s)
    np.testing.assert_allclose(got.transpose(1, 0, 2)[~both], want.transpose(1, 0, 2)[~both], rtol=0, atol=1e-6)


def test_demo_real_backend_xla_cpu():
    """A real JAX attention function's partials (jax-xla), merged by both frameworks: our paths are clean, and the
    naive merge behind the mask turns the request without any context into NaN (both partials empty)."""
    batch = cp.make_batch([20, 0, 9, 3], [3, 2, 4, 2], num_heads=2, qk_dim=32, v_dim=16, workspace_rows=24,
                          block_size=4)
    rows, ok = demo.run_real_batch(batch, "jax-xla")
    assert ok, demo.format_demo_table(rows)
    assert rows[0]["both_empty_tokens"] == 2 and rows[0]["prefill_tokens_with_context"] is None
    by = {(r["framework"], r["path"]): r for r in rows}
    for fw in demo.FRAMEWORKS:
        for path in demo.FIXED_PATHS:
            assert by[fw, path]["rows_corrupted"] == 0 and not by[fw, path]["any_nan"]
        assert by[fw, "naive_mask"]["rows_corrupted"] == 2 and by[fw, "naive_mask"]["requests_corrupted"] == [1]
    assert "jax-xla (lse finite" in demo.format_demo_table(rows)


def test_demo_gpu_backends_refuse_cpu():
    if demo.default_torch_device(None) == "cuda":
        pytest.skip("a CUDA GPU is present: the GPU test runs the backend")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        demo.run_demo(backend="torch-flash")
    with pytest.raises(ValueError, match="backend must be one of"):
        demo.run_demo(backend="flash3")


@pytest.mark.gpu
def test_demo_torch_flash_gpu():
    """PyTorch's FlashAttention-2 on the `real` batch: it reports empty rows as LSE +inf; our merges (with and
    without the mask, fused) leave 0 rows corrupted in both frameworks, and the naive merge turns the request
    without context into NaN rows, with or without the mask."""
    rows, ok = demo.run_demo(size="real", backend="torch-flash")
    table = demo.format_demo_table(rows)
    assert ok, table
    obs = rows[0]["observed"]
    assert obs["lse"]["+inf"] > 0 and obs["lse"]["finite"] == 0, table
    for r in rows:
        if r["path"] in ("no_mask",) + demo.FIXED_PATHS:
            assert r["rows_corrupted"] == 0 and not r["any_nan"], table
        else:
            assert r["rows_corrupted"] == rows[0]["both_empty_tokens"] > 0 and r["any_nan"], table


@pytest.mark.gpu
def test_demo_jax_cudnn_gpu():
    """cuDNN's flash attention from JAX: whatever it leaves in empty rows, our fixed paths are clean in both
    frameworks."""
    rows, ok = demo.run_demo(size="real", backend="jax-cudnn")
    assert ok, demo.format_demo_table(rows)
