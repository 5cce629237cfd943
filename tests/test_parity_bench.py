"""parity/bench.py: the smoke run's plumbing (JSON schema, PNG, table), byte formulas, grids, event grouping.

No timing is asserted: the smoke mode runs tiny shapes under the interpreters on CPU and claims nothing.
"""

import argparse
import json
import math

import pytest
import torch

from parity import bench, cases

RECORD_FIELDS = {"op": str, "impl": str, "workload": str, "variant": str, "metric": str, "unit": str,
                 "method": str, "bytes": int}
NUMERIC_FIELDS = ("p20", "p50", "p80", "tbps")
ENV_FIELDS = ("gpu", "driver", "cuda", "versions", "devices", "git_commit", "utc_time", "command")


def _parse(argv):
    parser = argparse.ArgumentParser()
    bench.add_bench_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = ["bench", *argv]
    return args


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    json_path, png_path = out / "bench.json", out / "bench.png"
    args = _parse(["--smoke", "--quiet", "--json", str(json_path), "--plot", str(png_path)])
    rc = bench.run_bench(args)
    return rc, json_path, png_path


def test_smoke_run_succeeds_and_writes_files(smoke_run, capsys):
    rc, json_path, png_path = smoke_run
    doc = json.loads(json_path.read_text())
    assert rc == 0, doc["errors"]
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_smoke_json_schema(smoke_run):
    _, json_path, _ = smoke_run
    doc = json.loads(json_path.read_text())
    assert doc["schema"] == bench.SCHEMA == 1
    assert doc["mode"] == "smoke"
    for key in ENV_FIELDS:
        assert key in doc["env"], key
    assert doc["env"]["command"].startswith("python -m parity bench --smoke")
    assert doc["reference"]["merge_tbps"] == 1.18
    assert set(doc["ceilings"]) == {"add_2r1w", "fill_w", "noop_kernel_us", "noop_launch_us", "jit_dispatch_us"}
    assert doc["errors"] == []
    recs = doc["records"]
    for r in recs:
        for key, typ in RECORD_FIELDS.items():
            assert isinstance(r[key], typ), (key, r)
        for key in NUMERIC_FIELDS:
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] >= 0, (key, r)
        assert r["p20"] <= r["p50"] <= r["p80"], r
        assert r["unit"] == "us" and r["metric"] in ("gpu_time", "latency", "launch")
        for key in ("T", "H", "D", "dtype", "frac_ceiling"):
            assert key in r
    assert {"torch", "triton", "jax"} <= set(doc["env"]["versions"])
    got = {(r["op"], r["impl"], r["variant"], r["metric"]) for r in recs if r["op"] != "ceiling"}
    want = {(op, impl, v, m) for impl in ("triton", "pallas") for m in ("gpu_time", "latency")
            for op, variants in (("mask", ("lse",)), ("merge", bench.MERGE_VARIANTS),
                                 ("merge_n", bench.N_WAY_VARIANTS)) for v in variants}
    want.add(("mask", "torch", "lse floor", "gpu_time"))  # the same bytes written by fill_
    if torch.cuda.is_available():  # the launch-inclusive cost of the Triton mask, as a function and as its op
        want |= {("mask", "triton", "lse", "launch"), ("mask", "triton-op", "lse", "latency"),
                 ("mask", "triton-op", "lse", "launch")}
    assert got == want
    # Effective bandwidth is the stated bytes over the p50 time.
    for r in recs:
        assert r["tbps"] == pytest.approx(r["bytes"] / (r["p50"] * 1e-6) / 1e12)
    merge = [r for r in recs if r["op"] in ("merge", "merge_n")]
    for r in merge:
        n = int(r["workload"].split("N=")[1]) if r["op"] == "merge_n" else 0
        pt = bench.MergePoint(r["T"], r["H"], r["D"], r["dtype"], r["variant"], n)
        assert r["bytes"] == pt.bytes
        assert r["frac_ceiling"] == pytest.approx(r["tbps"] / doc["ceilings"]["add_2r1w"])
    assert all("pallas_over_triton" in r for r in recs if r["impl"] == "pallas")


def test_table_and_replot_from_json(smoke_run, tmp_path, capsys):
    _, json_path, _ = smoke_run
    png = tmp_path / "again.png"
    assert bench.run_bench(_parse(["--replot", str(json_path), "--plot", str(png)])) == 0
    table = capsys.readouterr().out
    assert "merge" in table and "two-read-one-write" in table and "p50 us" in table
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
    full = bench.merge_points("full")
    two_way = [p for p in full if not p.partials]
    assert len(two_way) == 3 * 3 * 2 * 2 * 3
    # N-way: N in (2, 4, 8) x T x (plain, lse, fused), plus the chain at N = 4.
    assert len(full) - len(two_way) == 3 * 3 * 3 + 3
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
    k = bench._rotation(small.bytes, small.memory, on_gpu=True)
    assert k > 1 and k * small.bytes >= 3 * bench.L2_BYTES
    big = bench.MergePoint(131072, 64, 128, "bfloat16", "lse")
    assert bench._rotation(big.bytes, big.memory, on_gpu=True) == 1


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
    from parity import cli

    argv = ["bench", "--quick", "--json", "x.json", "-k", "fused"]
    args = cli.build_parser(argv).parse_args(argv)
    assert args.quick and args.json == "x.json" and args.name_filter == "fused"
    assert args.func is not None


def test_full_mode_without_cuda_is_a_usage_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the full run is legitimate")
    assert bench.run_bench(_parse([])) == 2
