"""parity/tools/bench/: the smoke run's plumbing (JSON schema, PNG, tables, layout fields, host and eager metrics, the
JAX re-trace check), byte formulas, grids, event grouping.

No timing is asserted: the smoke mode runs tiny shapes under the interpreters on CPU and claims nothing.
"""

import argparse
import itertools
import json
import math

import pytest
import torch

from parity import cli
from parity.harness import cases
from parity.tools import bench

RECORD_FIELDS = {"op": str, "impl": str, "workload": str, "variant": str, "metric": str, "unit": str,
                 "method": str, "bytes": int}
NUMERIC_FIELDS = ("p20", "p50", "p80", "tbps")
ENV_FIELDS = ("gpu", "driver", "cuda", "versions", "devices", "git_commit", "utc_time", "command")


def _parse(argv):
    parser = argparse.ArgumentParser()
    cli.add_bench_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = ["bench", *argv]
    return args


def _run_bench(argv):
    """`python -m parity bench ARGV` (parity/cli.py): its exit status."""
    return cli.main(["bench", *argv])


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    json_path, png_path = out / "bench.json", out / "bench.png"
    rc = _run_bench(["--smoke", "--quiet", "--json", str(json_path), "--plot", str(png_path)])
    return rc, json_path, png_path


def test_smoke_run_succeeds_and_writes_files(smoke_run, capsys):
    rc, json_path, png_path = smoke_run
    doc = json.loads(json_path.read_text())
    assert rc == 0, doc["errors"]
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smoke_json_schema(smoke_run):
    _, json_path, _ = smoke_run
    doc = json.loads(json_path.read_text())
    assert doc["schema"] == bench.SCHEMA == 2
    assert doc["mode"] == "smoke"
    for key in ENV_FIELDS:
        assert key in doc["env"], key
    assert doc["env"]["command"].startswith("python -m parity bench --smoke")
    assert doc["reference"]["merge_tbps"] == 1.18
    assert set(doc["ceilings"]) == {"add_2r1w", "fill_w", "noop_kernel_us", "noop_launch_us", "noop_eager_us",
                                   "jit_dispatch_us", "jit_eager_us"}
    assert doc["errors"] == []
    recs = doc["records"]
    for r in recs:
        for key, typ in RECORD_FIELDS.items():
            assert isinstance(r[key], typ), (key, r)
        for key in NUMERIC_FIELDS:
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] >= 0, (key, r)
        assert r["p20"] <= r["p50"] <= r["p80"], r
        assert r["unit"] == "us" and r["metric"] in ("gpu_time", "latency", "eager", "host")
        for key in ("T", "H", "D", "dtype", "frac_ceiling", "lse_layout", "lse_base", "partials_view"):
            assert key in r
    assert {"torch", "triton", "jax"} <= set(doc["env"]["versions"])
    got = {(r["op"], r["impl"], r["variant"], r["metric"], bench.report.layout_of(r)) for r in recs
           if r["op"] != "ceiling"}
    # Every point and implementation: gpu_time, latency and eager at the point's T, host at T = HOST_T.
    metrics = ("gpu_time", "latency", "eager", "host")
    want = {(op, impl, v, m, lay) for impl in ("triton", "pallas") for m in metrics
            for op, variants, lay in (("mask", ("lse",), "HT"), ("mask", ("lse",), "TH"),
                                      ("merge", bench.MERGE_VARIANTS, "HT/e"), ("merge", ("lse",), "TH/2"),
                                      ("merge_n", bench.N_WAY_VARIANTS, "HT/e"), ("merge_n", ("lse",), "TH/2"))
            for v in variants}
    # The all-gather view of the N-way partials: Triton only (JAX arrays have no strides).
    want |= {("merge_n", "triton", "lse", m, lay) for m in metrics for lay in ("HT/e gather", "TH/2 gather")}
    want |= {("mask", "torch", "lse floor", "gpu_time", lay) for lay in ("HT", "TH")}  # fill_ of the same bytes
    if torch.cuda.is_available():  # the launch-inclusive cost of the Triton mask's torch.library op
        want |= {("mask", "triton-op", "lse", m, lay) for m in ("eager", "latency") for lay in ("HT", "TH")}
    assert got == want
    assert {s["point"] for s in doc["skipped"] if s.get("impl") == "pallas"} == {
        f"merge_n T={bench.points.SMOKE_T} H=2 D=64 N=3 bfloat16 lse {lay} gather" for lay in ("HT/e", "TH/2")}
    assert {r["T"] for r in recs if r["metric"] == "host" and r["op"] != "ceiling"} == {bench.HOST_T}
    assert all(r["T"] != bench.HOST_T for r in recs if r["metric"] != "host" and r["op"] != "ceiling")
    # Effective bandwidth is the stated bytes over the p50 time.
    for r in recs:
        assert r["tbps"] == pytest.approx(r["bytes"] / (r["p50"] * 1e-6) / 1e12)
    merge = [r for r in recs if r["op"] in ("merge", "merge_n")]
    for r in merge:
        n = int(r["workload"].split("N=")[1]) if r["op"] == "merge_n" else 0
        pt = bench.MergePoint(r["T"], r["H"], r["D"], r["dtype"], r["variant"], n, r["lse_layout"], r["lse_base"],
                              r["partials_view"] or "contig")
        assert r["bytes"] == pt.bytes and r["lse_base"] in ("e", "2") and r["lse_layout"] in ("HT", "TH")
        assert (r["partials_view"] in ("contig", "gather")) == bool(n)
        if r["metric"] != "host":
            assert r["frac_ceiling"] == pytest.approx(r["tbps"] / doc["ceilings"]["add_2r1w"])
    assert all("pallas_over_triton" in r for r in recs if r["impl"] == "pallas" and r["metric"] != "host")
    # P/T: each Pallas record over the Triton record of the same point and metric.
    def key(r):
        return r["op"], r["workload"], r["variant"], r["metric"], bench.report.layout_of(r)

    triton = {key(r): r["p50"] for r in recs if r["impl"] == "triton"}
    for r in recs:
        if r["impl"] == "pallas" and r["metric"] != "host":
            assert r["pallas_over_triton"] == pytest.approx(r["p50"] / triton[key(r)])


def test_smoke_retrace_check(smoke_run):
    # A new batch of the same shapes (other offsets, prefill_tokens_with_context) traces and compiles nothing.
    _, json_path, _ = smoke_run
    retrace = json.loads(json_path.read_text())["retrace"]
    assert [r["op"] for r in retrace] == ["mask", "merge fused", "merge_n fused"]
    for r in retrace:
        assert r["first_batch"]["traces"] >= 1  # the counter sees the first trace of these shapes
        assert r["new_batch"] == {"traces": 0, "compiles": 0} and r["ok"]


def test_trace_counter_counts_retraces():
    import jax
    import jax.numpy as jnp

    f = jax.jit(lambda x, k: x * k, static_argnums=1)
    x, y = jnp.ones(3), jnp.arange(3.0)  # made outside the counters (creating them compiles too)
    with bench.TraceCounter() as first:
        f(x, 2).block_until_ready()
    with bench.TraceCounter() as same:
        f(y, 2).block_until_ready()
    with bench.TraceCounter() as static_changed:
        f(x, 3).block_until_ready()
    assert (first.traces, first.compiles) >= (1, 1)
    assert (same.traces, same.compiles) == (0, 0)
    assert static_changed.traces >= 1


def test_table_and_replot_from_json(smoke_run, tmp_path, capsys):
    _, json_path, _ = smoke_run
    png = tmp_path / "again.png"
    assert _run_bench(["--replot", str(json_path), "--plot", str(png)]) == 0
    table = capsys.readouterr().out
    assert "merge" in table and "two-read-one-write" in table and "p50 us" in table
    assert "what a serving step pays" in table and "eager/gpu" in table and "host/fl" in table
    assert "TH/2 gather" in table and "re-trace check" in table
    doc = json.loads(json_path.read_text())
    rows = bench.serving_rows(doc)
    assert len(rows) == len({(r["op"], r["impl"], r["workload"], r["variant"], bench.report.layout_of(r))
                             for r in doc["records"] if r["metric"] == "gpu_time" and r["impl"] != "torch"
                             and r["op"] != "ceiling"})
    assert all(row[6] != "-" and row[9] != "-" for row in rows)  # every point has its host and eager figure
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_merge_bytes_formula():
    # The spec's formula: 2 reads + 1 write of [T, H, D], two LSE reads, an optional LSE write.
    T, H, D = 2048, 64, 128
    assert bench.MergePoint(T, H, D, "bfloat16", "plain").bytes == 3 * T * H * D * 2 + 2 * T * H * 4
    assert bench.MergePoint(T, H, D, "bfloat16", "lse").bytes == 3 * T * H * D * 2 + 3 * T * H * 4
    assert bench.MergePoint(T, H, D, "float32", "fused").bytes == 3 * T * H * D * 4 + 3 * T * H * 4
    # N-way: N reads of [T, H, D] and of the LSE, one write (+ the LSE); the chain is charged the same bytes.
    for variant in ("lse", "chain"):
        assert bench.MergePoint(T, H, D, "bfloat16", variant, 4).bytes == 5 * T * H * D * 2 + 5 * T * H * 4
    assert bench.MergePoint(T, H, D, "bfloat16", "plain", 8).bytes == 9 * T * H * D * 2 + 8 * T * H * 4


def test_mask_bytes_on_seed_workloads():
    # docs/spec.md 7: 131k_skewed masks 98,176 tokens (25.1 MB of LSE at 64 heads).
    c = cases.by_name("131k_skewed")
    assert bench.masked_tokens(c) == 98176
    assert bench.mask_bytes(c, "lse") == 98176 * 64 * 4
    assert bench.mask_bytes(c, "lse+out") == 98176 * 64 * 4 + 98176 * 64 * 128 * 2
    assert bench.masked_tokens(cases.by_name("2k_balanced")) == 8 * 128
    assert [c.name for c in bench.mask_cases("full")] == ["2k_balanced", "32k_balanced", "131k_skewed"]


def test_grids():
    # Every point of the mode's axes once, nothing else: the 2-way T x H x D x dtype x variant, the N-way
    # N x T x variant (the chained alternative at N = 4 only).
    from parity.tools.bench import points

    full = bench.merge_points("full")
    assert len(set(full)) == len(full)
    two_way = [p for p in full if not p.partials]
    t_vals, h_vals, d_vals, dtypes, variants, _ = points.GRIDS["full"]
    assert {(p.T, p.H, p.D, p.dtype, p.variant) for p in two_way} == set(
        itertools.product(t_vals, h_vals, d_vals, dtypes, variants))
    n_vals, nt_vals, n_variants = points.N_GRIDS["full"]
    assert {(p.partials, p.T, p.variant) for p in full if p.partials} == {
        (n, t, v) for n, t, v in itertools.product(n_vals, nt_vals, n_variants) if v != "chain" or n == 4}
    assert {(p.H, p.D, p.dtype) for p in full if p.partials} == {(64, 128, "bfloat16")}
    too_big = [p for p in full if p.memory > bench.MEMORY_CAP_BYTES]
    assert {(p.T, p.H, p.D, p.dtype) for p in too_big} == {(131072, 128, 512, "float32")}
    quick = bench.merge_points("quick")
    assert {(p.H, p.D, p.dtype) for p in quick} == {(64, 128, "bfloat16")}
    assert {p.T for p in quick if not p.partials} == {2048, 32768, 131072}
    assert {p.T for p in quick if p.partials} == {32768, 131072}
    assert {p.partials for p in quick if p.variant == "chain"} == {4}
    fused = bench.MergePoint(2048, 64, 128, "bfloat16", "fused").fused_case()
    assert fused.num_tokens == 2048 and fused.empty == tuple(range(0, 16, 2))
    fused_n = bench.MergePoint(2048, 64, 128, "bfloat16", "fused", 4).fused_case()
    kv = cases.partial_kv_lens(fused_n)
    assert fused_n.num_tokens == 2048 and (kv == 0).any() and (kv > 0).any()


def test_rotation_exceeds_l2_for_small_points():
    small = bench.MergePoint(2048, 16, 128, "bfloat16", "lse")
    k = bench.rotation(small.bytes, small.memory, on_gpu=True)
    assert k > 1 and k * small.bytes >= 3 * bench.L2_BYTES
    big = bench.MergePoint(131072, 64, 128, "bfloat16", "lse")
    assert bench.rotation(big.bytes, big.memory, on_gpu=True) == 1


def test_per_call_grouping_of_profiler_events():
    # Two kernels per call, three calls: per-call sums (ns -> us).
    ev = [(0.0, 1000.0, "a"), (1000.0, 500.0, "b"), (2000.0, 3000.0, "a"), (5000.0, 500.0, "b"),
          (6000.0, 1000.0, "a"), (7000.0, 1500.0, "b")]
    q, note = bench.per_call_us(ev, 3)
    assert q[1] == pytest.approx(2.5) and q[0] <= q[1] <= q[2]
    assert "2 kernel" in note
    q, note = bench.per_call_us(ev[:5], 3)  # not a multiple: the mean only
    assert q == pytest.approx((6.0 / 3,) * 3) and "mean" in note  # 6 us over 3 calls
    assert bench.per_call_us([], 3) is None


def test_cli_wires_bench_options():
    argv = ["bench", "--quick", "--json", "x.json", "-k", "fused"]
    args = cli.build_parser(argv).parse_args(argv)
    assert args.quick and args.json == "x.json" and args.name_filter == "fused"
    assert args.func is not None


def test_full_mode_without_cuda_is_a_usage_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the full run is legitimate")
    assert _run_bench([]) == 2


def test_layout_points():
    quick = bench.layout_points("quick")
    main = set(bench.merge_points("quick"))
    assert not set(quick) & main
    # The representative subset: HT/e and TH/2 at D = 128 and 512, one contiguous and one all-gather N = 4 view.
    two = {(p.D, p.lse_layout, p.lse_base, p.variant) for p in quick if not p.partials}
    assert two == {(128, "TH", "2", "lse"), (512, "HT", "e", "lse"), (512, "TH", "2", "lse")}
    n_way = {(p.D, p.layout) for p in quick if p.partials}
    assert n_way == {(128, "HT/e gather"), (128, "TH/2"), (128, "TH/2 gather"), (512, "HT/e"),
                     (512, "HT/e gather"), (512, "TH/2"), (512, "TH/2 gather")}
    assert {(p.T, p.H, p.partials or 4) for p in quick} == {(32768, 64, 4)}
    full = bench.layout_points("full")
    assert {p.D for p in full} == set(bench.HEAD_DIMS)
    assert {p.layout for p in full if not p.partials} == set(bench.LAYOUTS)
    picked = bench.layout_points("quick", layouts=["TH/e"], head_dims=[256], views=["gather"])
    assert [p.label for p in picked] == ["merge T=32768 H=64 D=256 bfloat16 lse TH/e",
                                         "merge_n T=32768 H=64 D=256 N=4 bfloat16 lse TH/e gather"]
    with pytest.raises(ValueError, match="layout"):
        bench.parse_layout("HT/10")


def test_cli_layout_options():
    args = _parse(["--quick", "--layouts", "HT/e", "TH/2", "--head-dims", "64", "512", "--views", "gather",
                   "--only", "layouts"])
    assert args.layouts == ["HT/e", "TH/2"] and args.head_dims == [64, 512] and args.views == ["gather"]
    with pytest.raises(SystemExit):
        _parse(["--layouts", "XT/e"])
