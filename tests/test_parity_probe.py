"""Tests of `python -m parity probe`: the classes each backend's empty rows are found in, as measured.

The CPU tests probe the kernels that run here (SDPA's math and CPU flash paths, jax.nn's XLA path); the GPU tests
assert the contracts measured on the H200 (FlashAttention-2 varlen: LSE +inf and output 0; cuDNN through jax.nn:
a finite LSE), so a backend that changes its contract after an upgrade fails here instead of corrupting a merge.
"""

import json
import math

import numpy as np
import pytest

from parity.tools import probe
from parity.tools.probe import core, run

SITUATION_STATUSES = {"ok", "no_empty_rows", "cannot_express", "refused", "bad_data"}


def situations(entry):
    return {s["situation"]: s for s in entry["situations"]}


def backend(name):
    return next(b for b in probe.all_backends() if b.name == name)


# --------------------------------------------------------------------------------------------------
# The judge on hand-made results
# --------------------------------------------------------------------------------------------------

def test_judge_reads_a_base_2_lse_and_the_fa2_contract():
    spec = core.SITUATIONS["zero_kv"].spec
    inputs = core.make_inputs(spec, "float32")
    vis = core.visibility(spec, "top-left")
    out, lse = core.reference(inputs, vis)
    empty = ~vis.any(axis=1)
    assert empty.tolist() == [False] * 3 + [True] * 2 + [False] * 3  # request 1 has no KV
    out, lse = out.astype(np.float32), (lse / math.log(2)).astype(np.float32)
    out[empty], lse[:, empty] = 0.0, np.inf
    r = core.judge(spec, inputs, core.Raw(out, lse, "[H, T]", "float32", "float32"), "float32")
    assert r["status"] == "ok" and r["data_ok"] and r["lse_base"] == "2"
    assert r["empty_rows"] == 2 and r["empty_lse"]["+inf"] == 2 * core.NUM_HEADS
    assert r["empty_out"]["zero"] == 2


def test_judge_finds_the_alignment_the_unwritten_rows_and_bad_data():
    spec = core.SITUATIONS["causal_no_key"].spec
    inputs = core.make_inputs(spec, "float32")
    vis = core.visibility(spec, "bottom-right")
    assert (~vis.any(axis=1)).tolist() == [True, True, False, False, False]
    out, lse = (x.astype(np.float32) for x in core.reference(inputs, vis))
    out[:2], lse[:, :2] = -4096.0, -4096.0
    raw = core.Raw(out, lse, "[H, T]", "float32", "float32", poison={"out": -4096.0, "lse": -4096.0})
    r = core.judge(spec, inputs, raw, "float32")
    assert r["alignment"] == "bottom-right" and r["empty_out"]["unwritten"] == 2
    assert r["empty_lse"] == {"+inf": 0, "-inf": 0, "nan": 0, "finite": 0, "unwritten": 4}
    raw.out[2:] += 1.0  # the rows that see keys are wrong: no class is trusted
    assert core.judge(spec, inputs, raw, "float32")["status"] == "bad_data"


@pytest.mark.parametrize("zero, merged, want", [
    ({"status": "ok", "empty_lse": {"+inf": 4, "-inf": 0, "nan": 0, "finite": 0}}, 0, "safe"),
    ({"status": "ok", "empty_lse": {"+inf": 0, "-inf": 0, "nan": 0, "finite": 4}, "empty_lse_finite": [0.0],
      "empty_lse_finite_range": [0.0, 0.0]}, 0, "needs the mask"),
    ({"status": "ok", "empty_lse": {"+inf": 0, "-inf": 0, "nan": 0, "finite": 4}, "empty_lse_finite": [-2e38],
      "empty_lse_finite_range": [-2e38, -2e38]}, 0, "safe"),
    ({"status": "ok", "empty_lse": {"+inf": 0, "-inf": 4, "nan": 0, "finite": 0}}, 3, "needs the mask"),
    ({"status": "cannot_express", "reason": "no lengths"}, None, "unknown"),
])
def test_recommend(zero, merged, want):
    e2e = None if merged is None else {"paths": {"merge": {"rows_corrupted": merged}}}
    word, why = run.recommend([dict(zero, situation="zero_kv")], e2e)
    assert word == want and why


# --------------------------------------------------------------------------------------------------
# CPU kernels
# --------------------------------------------------------------------------------------------------

def test_every_backend_is_probed_or_listed_with_its_reason():
    names = [b.name for b in probe.all_backends() if b.framework == "torch"] + ["jax-dpa-cudnn"]
    report = probe.run_probe(backends=names, end_to_end=False)
    assert [b["backend"] for b in report["backends"]] == names
    for b in report["backends"]:
        if b["status"] == "absent":
            assert b["reason"] and b["recommendation"] == "unknown"
            continue
        assert b["status"] == "probed" and b["versions"]["torch"]
        assert [s["situation"] for s in b["situations"]] == list(core.SITUATIONS)
        for s in b["situations"]:
            assert s["status"] in SITUATION_STATUSES
            assert s["status"] in ("ok", "no_empty_rows") or s["reason"]
    probed = {b["backend"] for b in report["backends"] if b["status"] == "probed"}
    assert {"torch-sdpa-math", "torch-sdpa-flash-cpu"} <= probed


def test_sdpa_math_path_empty_rows_are_minus_inf_and_zero():
    entry = run.probe_backend(backend("torch-sdpa-math"), merge_impl="jnp", end_to_end=False)
    s = situations(entry)
    for name in ("zero_kv", "fully_masked"):
        assert s[name]["status"] == "ok" and s[name]["data_ok"] and s[name]["lse_base"] == "e"
        n = s[name]["empty_rows"] * core.NUM_HEADS
        assert s[name]["empty_lse"]["-inf"] == n  # derived with torch.logsumexp: the op returns no LSE
        assert s[name]["empty_out"]["zero"] == s[name]["empty_rows"]  # SDPA's math path: a safe softmax
    assert s["causal_no_key"]["status"] == "no_empty_rows" and s["causal_no_key"]["alignment"] == "top-left"
    assert s["padding"]["padding_lse"]["-inf"] == 3 * core.NUM_HEADS
    assert entry["recommendation"] == "safe"


def test_sdpa_cpu_flash_leaves_a_finite_zero_lse_and_needs_the_mask():
    entry = run.probe_backend(backend("torch-sdpa-flash-cpu"), merge_impl="jnp")
    s = situations(entry)
    assert s["plain"]["lse_base"] == "e" and s["plain"]["lse_layout"].startswith("[B, H, T]")
    z = s["zero_kv"]
    assert z["status"] == "ok" and z["data_ok"]
    assert z["empty_lse"]["finite"] == z["empty_rows"] * core.NUM_HEADS and z["empty_lse_finite"] == [0.0]
    assert z["empty_out"]["zero"] == z["empty_rows"]
    paths = entry["end_to_end"]["paths"]
    assert paths["merge"]["rows_corrupted"] > 0  # the finite LSE weighs the zero output in
    assert paths["mask_then_merge"]["rows_corrupted"] == 0 and not paths["mask_then_merge"]["any_nan"]
    assert entry["recommendation"] == "needs the mask"


def test_jax_xla_leaves_its_mask_value_and_the_mean_of_v():
    s = run.probe_situation(backend("jax-dpa-xla"), core.SITUATIONS["zero_kv"], seed=0)
    assert s["status"] == "ok" and s["data_ok"] and s["lse_base"] == "e"
    assert s["empty_lse"]["finite"] == s["empty_rows"] * core.NUM_HEADS
    mask_value = -0.7 * float(np.finfo(np.float32).max)  # jax.nn's masking constant
    assert s["empty_lse_finite"] == [pytest.approx(mask_value, rel=1e-6)]
    assert s["empty_out"]["mean_v"] == s["empty_rows"]


def test_cli_probe_writes_strict_json(tmp_path):
    from parity import cli

    path = tmp_path / "probe.json"
    assert cli.main(["probe", "--backend", "torch-sdpa-math", "--backend", "torch-flash-varlen", "--no-end-to-end",
                     "--json", str(path), "--quiet"]) == 0
    report = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert report["env"]["versions"]["torch"] and [b["backend"] for b in report["backends"]] == [
        "torch-sdpa-math", "torch-flash-varlen"]
    assert cli.main(["probe", "--backend", "no-such-kernel", "--quiet"]) == 2


def test_isolated_probe_runs_each_backend_in_its_own_process():
    report = probe.run_isolated(backends=["torch-sdpa-math"], end_to_end=False)
    (entry,) = report["backends"]
    assert report["isolated"] and entry["status"] == "probed"
    assert situations(entry)["zero_kv"]["empty_lse"]["-inf"] == 2 * core.NUM_HEADS


# --------------------------------------------------------------------------------------------------
# GPU kernels: the contracts measured on the H200
# --------------------------------------------------------------------------------------------------

@pytest.mark.gpu
def test_fa2_varlen_leaves_plus_inf_and_zero():
    entry = run.probe_backend(backend("torch-flash-varlen"), merge_impl="triton")
    z = situations(entry)["zero_kv"]
    assert z["status"] == "ok" and z["data_ok"] and z["lse_base"] == "e" and z["lse_layout"].startswith("[H, T]")
    assert z["empty_lse"]["+inf"] == z["empty_rows"] * core.NUM_HEADS
    assert z["empty_out"]["zero"] == z["empty_rows"]
    assert entry["end_to_end"]["paths"]["merge"]["rows_corrupted"] == 0
    assert entry["recommendation"] == "safe"


@pytest.mark.gpu
def test_cudnn_through_jax_leaves_a_finite_lse():
    entry = run.probe_backend(backend("jax-dpa-cudnn"), merge_impl="pallas")
    z = situations(entry)["zero_kv"]
    assert z["status"] == "ok" and z["data_ok"]
    assert z["empty_lse"]["finite"] == z["empty_rows"] * core.NUM_HEADS
    assert entry["end_to_end"]["paths"]["mask_then_merge"]["rows_corrupted"] == 0
    assert entry["recommendation"] == "needs the mask"


@pytest.mark.gpu
def test_every_backend_on_the_gpu_is_probed_or_listed_and_the_mask_fixes_each():
    report = probe.run_probe()
    assert [b["backend"] for b in report["backends"]] == [b.name for b in probe.all_backends()]
    for b in report["backends"]:
        assert b["status"] == "probed" or b["reason"]
        e2e = b.get("end_to_end") or {}
        if "paths" in e2e:  # with the mask, this project's merge is clean on every kernel
            assert e2e["paths"]["mask_then_merge"]["rows_corrupted"] == 0, b["backend"]
        else:
            assert b["status"] == "absent" or e2e.get("reason"), b["backend"]
