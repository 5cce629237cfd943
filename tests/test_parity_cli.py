"""`python -m parity check` end to end on one tiny case: exit codes, JSON schema, a planted failure."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from parity import cli

ROOT = Path(__file__).resolve().parents[1]
# The upstream test vector: T = 134, H = 4, D = 64, fp32; three records (mask, merge, merge_fused).
CASE = "upstream_vector"
CHECK = ["check", "--suite", "default", "-k", CASE]


def _run_check(tmp_path, *extra):
    out = tmp_path / "report.json"
    rc = cli.main([*CHECK, "--json", str(out), *extra])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_check_passes_and_writes_the_report(tmp_path, capsys):
    rc, report = _run_check(tmp_path)
    captured = capsys.readouterr()
    assert rc == 0, captured.out
    assert report["schema"] == "parity-check/2"
    env = report["env"]
    for key in ("devices", "versions", "git_commit", "utc_time", "command"):
        assert key in env
    assert env["command"].startswith("python -m parity check")
    assert {"torch", "triton", "jax", "numpy"} <= set(env["versions"])
    from parity.harness import check

    assert report["mode"] in check.RULES and report["rule"] == check.RULES[report["mode"]]
    assert report["summary"] == {"records": 3, "failed": 0, "ok": True, "unsupported": 0, "cases": 1}
    assert [(r["case"], r["op"]) for r in report["records"]] == [
        (CASE, "mask"), (CASE, "merge"), (CASE, "merge_fused")]
    for rec in report["records"]:
        assert rec["ok"] and rec["status"] == "ok" and rec["error"] is None
        assert set(rec["comparisons"]) == set(check.KINDS)
        for kind in rec["required"]:
            for rep in rec["comparisons"][kind].values():
                assert rep["ok"] and rep["n_diff"] == 0
                assert {"name", "n", "max_ulp", "ulp_hist", "first_mismatches", "tolerance"} <= set(rep)
    mask = report["records"][0]["comparisons"]["triton_vs_pallas"]
    assert set(mask) == {"mask.lse", "mask.output"}
    assert all(r["n_diff"] == 0 for r in mask.values())  # the mask is bit-exact on every runtime
    # Table on stdout, progress on stderr.
    assert CASE in captured.out and "merge_fused" in captured.out
    assert f"[1/3] {CASE} mask fp32 D=64 ok" in captured.err


@pytest.mark.parametrize("argv", [
    ["check", "--suite", "nope"],
    ["check", "--bogus"],
    ["check", "--seed", "x"],
    ["verify", "somewhere"],  # --impl is required
    [],
])
def test_usage_errors_exit_2(argv, capsys):
    assert cli.main(argv) == 2
    assert "usage:" in capsys.readouterr().err


def test_no_matching_case_exits_2(capsys):
    assert cli.main(["check", "-k", "no-such-case", "--quiet"]) == 2
    assert "no case" in capsys.readouterr().err


def test_module_entry_point_exit_status():
    r = subprocess.run([sys.executable, "-m", "parity", "check", "--suite", "nope"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "invalid choice" in r.stderr


def _plant_triton_mask(monkeypatch):
    import triton_impl

    original = triton_impl.mask_empty_context_lse

    def corrupted(lse, *args, **kwargs):
        original(lse, *args, **kwargs)
        lse.view(-1)[0] = 1.0  # token 0 (request 0, not empty): must be caught bit for bit

    monkeypatch.setattr(triton_impl, "mask_empty_context_lse", corrupted)
    return "mask"


def _plant_pallas_merge(monkeypatch):
    import pallas_impl

    original = pallas_impl.merge_attn_states

    def corrupted(*args, **kwargs):
        out, lse = original(*args, **kwargs)
        return out.at[0, 0, 0].add(np.float32(0.5)), lse

    monkeypatch.setattr(pallas_impl, "merge_attn_states", corrupted)
    return "merge"


@pytest.mark.parametrize("plant", [_plant_triton_mask, _plant_pallas_merge],
                         ids=["triton-mask", "pallas-merge"])
def test_planted_failure_exits_1(plant, monkeypatch, tmp_path, capsys):
    op = plant(monkeypatch)
    rc, report = _run_check(tmp_path, "--quiet")
    out = capsys.readouterr().out
    assert rc == 1
    assert "PARITY FAILURE" in out
    assert report["summary"]["ok"] is False
    failed = {r["op"] for r in report["records"] if not r["ok"]}
    assert op in failed
    bad = [rep for r in report["records"] if r["op"] == op for kind in r["required"]
           for rep in r["comparisons"][kind].values() if not rep["ok"]]
    assert bad and all(rep["n_diff"] >= 1 for rep in bad)
    assert any("req 0" in line for rep in bad for line in rep["first_mismatches"])  # located via the offsets


def test_check_runs_the_pallas_implementation_on_the_chosen_backend(tmp_path, capsys):
    # --pallas-backend mosaic_gpu: with jax >= 0.11 the Mosaic GPU kernels (the interpreter on CPU) pass the
    # check; with an older jax every Pallas record says why it cannot run, and the check fails.
    import re

    import jax

    from parity.harness import impls

    try:
        rc, report = _run_check(tmp_path, "--pallas-backend", "mosaic_gpu")
    finally:
        impls.set_pallas_backend(None)
    captured = capsys.readouterr()
    assert report["env"]["pallas_backend"] == "mosaic_gpu"
    if tuple(int(x) for x in re.findall(r"\d+", jax.__version__)[:2]) >= (0, 11):
        assert rc == 0 and report["summary"]["ok"], captured.out
    else:
        assert rc == 1 and all(r["status"] == "error" for r in report["records"])
        assert "needs jax >= 0.11" in report["records"][0]["error"]  # the mask (mask-then-merge has no input)
        assert "needs jax >= 0.11" in report["records"][2]["error"]  # the fused merge


def test_check_shards_split_the_suite_between_them():
    """--shard K/N: N runs with K = 0..N-1 cover the selected cases once each, in suite order."""
    from parity.harness import check

    every = [c.name for c in check.select("full", None)]
    shards = [[c.name for c in check.select("full", None, (k, 3))] for k in range(3)]
    assert sorted(sum(shards, [])) == sorted(every) and len(sum(shards, [])) == len(every)
    assert all(s == [n for n in every if n in s] for s in shards)


@pytest.mark.parametrize("bad", ["3/3", "-1/2", "1", "a/b"])
def test_check_refuses_a_bad_shard(bad, capsys):
    assert cli.main(["check", "--shard", bad]) == 2  # argparse's usage error
    assert "--shard" in capsys.readouterr().err


def test_check_runs_one_shard(tmp_path):
    rc, report = _run_check(tmp_path, "--shard", "0/1")
    assert rc == 0 and report["shard"] == "0/1" and report["summary"]["cases"] == 1


def test_a_case_the_chosen_backend_refuses_is_unsupported_not_failed(monkeypatch):
    # An available experimental backend's NotImplementedError for a case it documents it cannot run is listed
    # apart (status "unsupported", not ok, not failed); any other exception, or that backend missing from this
    # jax, stays an error that fails the check.
    import pallas_impl._backend

    from parity.harness import cases, check, impls

    case = cases.select("ci")[0]
    monkeypatch.setattr(impls, "pallas_backend", lambda: "mosaic_gpu")
    for available, exc, status in ((True, NotImplementedError("merges 1 to 64 partials"), "UNSUPPORTED"),
                                   (True, ValueError("bad"), "ERROR"),
                                   (False, NotImplementedError("needs jax >= 0.11"), "ERROR")):
        monkeypatch.setattr(pallas_impl._backend, "has_mosaic_gpu", lambda available=available: available)
        rec = check.OpRecord(case, "merge", "cpu-interpreters")
        check._record_error(rec, exc)
        assert rec.status == status and not rec.ok
        assert rec.failed is (status == "ERROR")
        summary = check.build_report(impls.make_runtime(), [rec], suite="ci", name_filter=None, seed=0, argv=[])["summary"]
        assert summary["failed"] == (status == "ERROR") and summary["ok"] is (status != "ERROR")
        assert summary["unsupported"] == (status == "UNSUPPORTED")


# ---------------------------------------------------------------------------------------------------------
# The CPU run mode's XLA flags (parity.harness.impls.runtime.cpu_compile_flags)


def test_add_xla_flags_keeps_a_flag_already_set(monkeypatch):
    from parity.harness.impls.runtime import add_xla_flags

    monkeypatch.setenv("XLA_FLAGS", "--xla_backend_optimization_level=2 --xla_force_host_platform_device_count=2")
    assert add_xla_flags("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false").split() == [
        "--xla_backend_optimization_level=2", "--xla_force_host_platform_device_count=2",
        "--xla_cpu_use_fusion_emitters=false"]
    monkeypatch.delenv("XLA_FLAGS")
    assert add_xla_flags("--xla_cpu_use_fusion_emitters=false") == "--xla_cpu_use_fusion_emitters=false"


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU run mode only")
def test_cpu_run_mode_compiles_with_its_flags_and_jax_accepts_them():
    """The session's XLA_FLAGS carry the CPU run mode's flags (conftest.py calls `configure()`), and a JAX process
    starts with them (an unknown flag aborts it; the control: one that is not a flag)."""
    from parity.harness.impls.runtime import cpu_compile_flags

    flags = cpu_compile_flags()
    assert "--xla_backend_optimization_level=0" in flags and set(flags) <= set(os.environ["XLA_FLAGS"].split())

    def starts(flags):
        env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
        return subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"],
                              env=env, capture_output=True, text=True, timeout=120)

    assert starts(" ".join(flags)).stdout.strip() == "3.0"
    assert starts("--xla_cpu_no_such_flag=true").returncode != 0
