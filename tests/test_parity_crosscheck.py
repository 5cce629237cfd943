"""`parity.cross_check` (parity/library/crosscheck.py) on small pairs written here and on the worked example of
docs/parity-library.md (parity/examples/rmsnorm_*.py): bit parity on the GPU, tolerance under the CPU interpreters,
planted divergences found and located; the recipe's XLA flags; `python -m parity cross`; the docs snippet."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import parity
from parity.library import crosscheck, recipe
from parity.library import loading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
from parity.examples import rmsnorm_pallas  # noqa: E402
from parity.examples import rmsnorm_reference  # noqa: E402
from parity.examples import rmsnorm_triton  # noqa: E402

GPU = torch.cuda.is_available()
OUTPUTS = {"out": ("token", "dim"), "rstd": ("token",)}


def _example(**kw):
    return functools.partial(parity.cross_check, rmsnorm_triton.rmsnorm, rmsnorm_pallas.rmsnorm,
                             reference=rmsnorm_reference.rmsnorm, outputs=OUTPUTS, ragged="query_start_loc",
                             name="rmsnorm", **kw)


# ---------------------------------------------------------------------------------------------------------
# The API on small pairs (exact float math on every device: a multiply by 2, a copy)


def test_identical_pair_is_ok_and_shares_the_inputs():
    seen = {}

    def torch_fn(x, scale):
        seen["torch"] = x.data_ptr()
        return x * scale

    def jax_fn(x, scale):
        seen["jax"] = x.unsafe_buffer_pointer()
        return x * scale

    x = np.arange(24, dtype=np.float32).reshape(4, 6).astype(ml_dtypes.bfloat16)
    report = parity.cross_check(torch_fn, jax_fn, {"x": x, "scale": 2}, outputs={"y": "token,dim"})
    assert report.ok and report.n_diff("y") == 0 and report.max_ulp("y") == 0
    assert seen["torch"] == seen["jax"]  # one buffer, zero-copy
    assert report.inputs == {"x": "copied", "scale": "value"}  # numpy is uploaded; a number passes through
    assert report["y"]["torch_vs_jax"].dtype == "bf16" and report.required == ("torch_vs_jax",)


def test_torch_and_jax_inputs_are_shared_as_they_are():
    t = torch.arange(8, dtype=torch.float32)  # all on the CPU, also on a GPU machine
    j = jax.device_put(jnp.arange(8, dtype=jnp.float16), jax.devices("cpu")[0])
    view = torch.arange(16, dtype=torch.float32)[::2]  # not contiguous: copied
    report = parity.cross_check(lambda a, b, c: (a, b, c), lambda a, b, c: (a, b, c), [t, j, view])
    assert report.ok and list(report.outputs) == ["out0", "out1", "out2"]
    assert report.inputs == {"0": "shared", "1": "shared", "2": "copied"}


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, np.float16])
def test_low_precision_dtypes_round_trip_bit_for_bit(dtype):
    x = np.arange(256, dtype=np.uint16 if np.dtype(dtype).itemsize == 2 else np.uint8).view(np.dtype(dtype))
    report = parity.cross_check(lambda x: x.clone(), lambda x: jnp.copy(x), {"x": x})
    assert report.ok, report  # NaN payloads included: the same bits


def test_jax_runs_first_so_an_in_place_torch_kernel_cannot_change_its_input():
    x = np.linspace(-3, 3, 40, dtype=np.float32)
    report = parity.cross_check(lambda x: x.mul_(2), lambda x: x * 2, {"x": x})
    assert report.ok, report


def test_a_difference_is_located_by_request_and_named_axes():
    qsl = np.array([0, 3, 3, 7, 10], dtype=np.int32)  # request 1 empty; tokens 10.. are padding
    x = np.random.default_rng(0).standard_normal((12, 2, 4)).astype(np.float32)

    def bad_jax(x, cu):
        return x.at[5, 1, 2].add(1e-3).at[11, 0, 0].add(1.0)

    report = parity.cross_check(lambda x, cu: x * 1, bad_jax, {"x": x, "cu": qsl},
                                outputs={"o": ("seq", "head", "dim")}, ragged=("cu", "seq"))
    assert not report.ok and report.n_diff("o") == 2
    shown = report.mismatches("o")
    assert shown[0].startswith("req 2 seq 5 head 1 dim 2: got ")
    assert shown[1].startswith("padding seq 11 head 0 dim 0: got ")
    assert "req 2 seq 5 head 1 dim 2" in str(report)
    with pytest.raises(AssertionError, match="req 2 seq 5 head 1 dim 2"):
        parity.assert_cross_check(lambda x, cu: x * 1, bad_jax, {"x": x, "cu": qsl},
                                  outputs={"o": ("seq", "head", "dim")}, ragged=("cu", "seq"))


def test_bitwise_false_reports_differences_without_requiring_them():
    x = np.ones(8, dtype=np.float32)
    report = parity.cross_check(lambda x: x * 3, lambda x: x * 3 + 1e-6, {"x": x}, bitwise=False,
                                reference=lambda x: x * 3.0)
    assert report.ok and report.n_diff("out") == 8
    assert report.required == ("torch_vs_reference", "jax_vs_reference")
    assert "differs*" in str(report)


def test_reference_tolerance_is_enforced_per_output():
    x = np.linspace(1, 2, 16, dtype=np.float32)
    ref = lambda x: (x * 3.0 + 1e-4, x * 3.0)  # noqa: E731 - the first output is off by 1e-4
    report = parity.cross_check(lambda x: (x * 3, x * 3), lambda x: (x * 3, x * 3), {"x": x}, reference=ref,
                                outputs=["a", "b"])
    assert not report.ok and not report["a"]["torch_vs_reference"].ok and report["b"]["jax_vs_reference"].ok
    loose = parity.cross_check(lambda x: (x * 3, x * 3), lambda x: (x * 3, x * 3), {"x": x}, reference=ref,
                               outputs=["a", "b"], tolerance={"a": (1e-4, 1e-3)})
    assert loose.ok


def test_json_report():
    x = np.ones((3, 2), dtype=np.float32)
    report = parity.cross_check(lambda x: {"y": x + 1}, lambda x: {"y": x + 1}, {"x": x}, name="plus",
                                reference=lambda x: {"y": x + 1.0}, outputs={"y": ("token", "dim")})
    d = json.loads(report.to_json())
    assert d["schema"] == crosscheck.SCHEMA and d["ok"] and d["name"] == "plus"
    assert d["outputs"]["y"]["axes"] == ["token", "dim"]
    assert set(d["outputs"]["y"]["comparisons"]) == {"torch_vs_jax", "torch_vs_reference", "jax_vs_reference"}
    assert d["outputs"]["y"]["comparisons"]["torch_vs_jax"]["ulp_hist"]["0"] == 6


@pytest.mark.parametrize("inputs, error, match", [
    ({"x": np.zeros(4, np.int64)}, TypeError, "input 'x'.*int64"),
    ({"x": np.zeros(4, np.float64)}, TypeError, "input 'x'.*float64"),
])
def test_inputs_jax_would_copy_are_refused(inputs, error, match):
    with pytest.raises(error, match=match):
        parity.cross_check(lambda x: x, lambda x: x, inputs)


def test_mismatched_outputs_are_a_usage_error():
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="torch_fn returned outputs"):
        parity.cross_check(lambda x: {"a": x}, lambda x: {"b": x}, {"x": x})
    with pytest.raises(ValueError, match="ragged"):
        parity.cross_check(lambda x: x, lambda x: x, {"x": x}, ragged="qsl")


def _ragged_pair():
    qsl = np.array([0, 3, 3, 7, 10], dtype=np.int32)
    x = np.random.default_rng(0).standard_normal((12, 4)).astype(np.float32)
    return qsl, x, (lambda x, cu: x * 1), (lambda x, cu: x.at[5, 2].add(1e-3))


@pytest.mark.parametrize("form", ["name", "array", "torch", "list", "name_axis", "array_axis"])
def test_ragged_takes_a_name_an_array_or_a_pair_with_an_axis(form):
    qsl, x, ok_fn, bad_fn = _ragged_pair()
    ragged = {"name": "cu", "array": qsl, "torch": torch.from_numpy(qsl), "list": qsl.tolist(),
              "name_axis": ("cu", "seq"), "array_axis": (qsl, "seq")}[form]
    axis = "seq" if form.endswith("_axis") else "token"
    report = parity.cross_check(ok_fn, bad_fn, {"x": x, "cu": qsl}, outputs={"o": (axis, "dim")}, ragged=ragged)
    assert report.mismatches("o")[0].startswith(f"req 2 {axis} 5 dim 2: got ")


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(ragged="nope"), ValueError, r"ragged='nope': no input named 'nope'"),
    (dict(ragged=np.zeros((2, 2), np.int32)), TypeError, r"ragged: offsets must be a 1-D integer array"),
    (dict(ragged=np.array([0.0, 1.0])), TypeError, r"ragged: offsets must be a 1-D integer array"),
    (dict(ragged=[0, 5, 3]), ValueError, r"ragged: offsets must start >= 0 and not decrease"),
    (dict(ragged=("cu", "")), ValueError, r"ragged: the axis name is empty"),
    (dict(ragged=object()), TypeError, r"ragged: expected an input name"),
    (dict(outputs="o"), TypeError, r"outputs must be a dict name -> axes or a sequence of names"),
    (dict(outputs={"o": 3}), TypeError, r"outputs\['o'\]: axes must be"),
    (dict(outputs={"o": ("a", "b", "c")}), ValueError, r"outputs\['o'\]: 3 axis names"),
    (dict(outputs=["o", "o"]), ValueError, r"outputs: names repeat"),
    (dict(tolerance="float31"), ValueError, r"tolerance: unknown key 'float31'"),
    (dict(tolerance=(1e-3,)), TypeError, r"tolerance: expected None, a parity.Tolerance, \(rtol, atol\)"),
    (dict(tolerance=(-1, 0)), ValueError, r"tolerance: rtol and atol must be >= 0"),
    (dict(tolerance={"p": (1e-3, 0)}), ValueError, r"tolerance: no outputs named \['p'\]"),
    (dict(bitwise="yes"), TypeError, r"bitwise must be True or False"),
    (dict(cast_to_narrower=1), TypeError, r"cast_to_narrower must be True or False"),
    (dict(special_values=-1), TypeError, r"special_values must be True, False or a count"),
    (dict(reference=3), TypeError, r"reference must be callable or None"),
    (dict(name=3), TypeError, r"name must be a string"),
])
def test_every_bad_argument_is_named(kwargs, error, match):
    qsl, x, ok_fn, _ = _ragged_pair()
    kwargs = {"outputs": {"o": ("token", "dim")}, **kwargs}
    with pytest.raises(error, match=match):
        parity.cross_check(ok_fn, ok_fn, {"x": x, "cu": qsl}, **kwargs)


def test_bad_functions_and_inputs_are_named():
    x = np.ones(4, np.float32)
    with pytest.raises(TypeError, match="torch_fn must be callable"):
        parity.cross_check("f", lambda x: x, {"x": x})
    with pytest.raises(TypeError, match="jax_fn must be callable"):
        parity.cross_check(lambda x: x, None, {"x": x})
    with pytest.raises(TypeError, match="inputs must be a dict"):
        parity.cross_check(lambda x: x, lambda x: x, x.tobytes())
    with pytest.raises(ValueError, match=r"device='gpu7': expected a torch device"):
        parity.cross_check(lambda x: x, lambda x: x, {"x": x}, device="gpu7")
    with pytest.raises(TypeError, match=r"output 'out' of torch_fn is a float; expected a torch tensor"):
        parity.cross_check(lambda x: 1.0, lambda x: x, {"x": x})
    with pytest.raises(ValueError, match=r"output 'out': the reference returned shape \(2, 2\), torch_fn \(4,\)"):
        parity.cross_check(lambda x: x, lambda x: x, {"x": x}, reference=lambda x: np.ones((2, 2)))
    with pytest.raises(TypeError, match=r"output 'out' of torch_fn is torch.int32; compared outputs are float"):
        parity.cross_check(lambda x: x.to(torch.int32), lambda x: x.astype(jnp.int32), {"x": x})


def test_outputs_of_different_dtypes_are_cast_to_the_narrower_on_request():
    x = (np.arange(16, dtype=np.float32) / 7).astype(ml_dtypes.bfloat16)
    torch_fn = lambda x: x * 3  # noqa: E731 - bf16
    jax_fn = lambda x: x.astype(jnp.float32) * 3  # noqa: E731 - f32 for bf16 inputs
    with pytest.raises(TypeError, match=r"output 'out': torch_fn returned torch.bfloat16, jax_fn torch.float32; "
                                        r"pass cast_to_narrower=True"):
        parity.cross_check(torch_fn, jax_fn, {"x": x})
    report = parity.cross_check(torch_fn, jax_fn, {"x": x}, cast_to_narrower=True,
                                reference=lambda x: np.asarray(x, np.float64) * 3)
    assert report.ok, report
    assert report.notes == ["output 'out': jax_fn fp32 -> bf16 before comparing (cast_to_narrower)"]
    assert report["out"]["torch_vs_jax"].dtype == "bf16" and "note: output 'out': jax_fn" in str(report)


def test_special_values_without_a_reference_compare_the_classes_of_the_two_sides():
    x = np.linspace(-2, 2, 24, dtype=np.float32).reshape(4, 6)
    report = parity.cross_check(lambda x: x * 2, lambda x: x * 2, {"x": x}, outputs={"y": "token,dim"},
                                special_values=True)
    assert report.ok and report.required == ("torch_vs_jax", "special_torch_vs_jax")
    assert [p.split(" = ")[1] for p in report.special] == ["nan", "+inf", "-inf", "-0.0", "subnormal"]
    scrub = parity.cross_check(lambda x: torch.nan_to_num(x * 2), lambda x: x * 2, {"x": x},
                               outputs={"y": "token,dim"}, special_values=True)
    rep = scrub["y"]["special_torch_vs_jax"]
    assert not scrub.ok and scrub["y"]["torch_vs_jax"].ok and rep.n_diff == 3  # nan, +inf, -inf scrubbed
    planted = {p.split(" = ")[0]: p.split(" = ")[1] for p in scrub.special}
    for m in rep.first_mismatches:
        t, d = re.match(r"token (\d+) dim (\d+): got ", m).groups()
        assert planted[f"x[{t}, {d}]"] in ("nan", "+inf", "-inf")


def test_the_audit_is_in_every_report_with_a_reference():
    x = np.linspace(1, 2, 16, dtype=np.float32)
    report = parity.cross_check(lambda x: x * 3, lambda x: x * 3, {"x": x}, reference=lambda x: np.float64(x) * 3)
    audit = report.audit["out"]
    assert not audit.imprecise and audit.native_vs_f64 == 0 and 0 < audit.eps_ulp < 4
    assert "audit out: reference float64" in str(report)
    assert json.loads(report.to_json())["outputs"]["out"]["audit"]["imprecise"] is False


# ---------------------------------------------------------------------------------------------------------
# The worked example


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_example_matches_the_reference_under_the_interpreters(dtype):
    # Triton's interpreter truncates f32 -> bf16 (docs/design.md, "Interpreter casts")
    tol = rmsnorm_reference.tolerance(96, dtype, truncating_cast=not GPU and dtype == "bfloat16")
    report = _example(bitwise=GPU, tolerance=tol)(rmsnorm_reference.make_inputs(seed=1, dtype=dtype))
    assert report.ok, report
    assert report["rstd"]["torch_vs_reference"].n == 35 and report["out"]["jax_vs_reference"].n == 35 * 96


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_example_matches_the_reference_with_the_default_error_model(dtype):
    """No tolerance given: the bound derived from the reference covers bf16 under the truncating interpreter."""
    report = _example(bitwise=GPU)(rmsnorm_reference.make_inputs(seed=1, dtype=dtype))
    assert report.ok, report


def test_example_planted_ragged_bug_is_located():
    """`off_by_one` takes the last real token (request 4, token 31) for padding: caught on any device."""
    inputs = rmsnorm_reference.make_inputs(seed=0, dtype="float32")
    fn = functools.partial(rmsnorm_triton.rmsnorm, off_by_one=True)
    report = parity.cross_check(fn, rmsnorm_pallas.rmsnorm, inputs, reference=rmsnorm_reference.rmsnorm,
                                outputs=OUTPUTS, ragged="query_start_loc", bitwise=GPU)
    assert not report.ok
    assert report["rstd"]["jax_vs_reference"].ok and report["out"]["jax_vs_reference"].ok
    assert report.n_diff("rstd", "torch_vs_reference") == 1
    assert report.mismatches("rstd", "torch_vs_reference")[0].startswith("req 4 token 31: [tol] got 0x00000000")
    assert report.n_diff("out", "torch_vs_reference") == 96
    assert all(re.match(r"(worst: )?req 4 token 31 dim ", m) for m in report.mismatches("out", "torch_vs_reference"))
    assert any("req 4 token 31: got 0x00000000" in m for m in report.mismatches("rstd"))  # the bit comparison too


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float8_e4m3fn"])
def test_example_is_bit_identical_on_gpu(dtype):
    dt = getattr(ml_dtypes, dtype) if dtype.startswith("float8") else dtype
    inputs = rmsnorm_reference.make_inputs(seed=2, query_lens=(70, 0, 333, 1, 190, 64), padding=21, D=128, dtype=dt)
    report = _example(bitwise=True, device="cuda", tolerance=rmsnorm_reference.tolerance(128, dt))(inputs)
    assert report.ok, report
    assert report.inputs["x"] == "copied" and report.device.startswith("cuda")


@pytest.mark.gpu
def test_example_planted_fma_is_found_on_gpu():
    """enable_fp_fusion=True turns the sum of squares into an FMA chain: within tolerance of the reference,
    so only the bit comparison catches it, and it names the tokens."""
    inputs = rmsnorm_reference.make_inputs(seed=2, query_lens=(70, 0, 333, 1, 190, 64), padding=21, D=128,
                                           dtype="float32")
    fn = functools.partial(rmsnorm_triton.rmsnorm, fma=True)
    report = parity.cross_check(fn, rmsnorm_pallas.rmsnorm, inputs, reference=rmsnorm_reference.rmsnorm,
                                outputs=OUTPUTS, ragged="query_start_loc", device="cuda",
                                tolerance=rmsnorm_reference.tolerance(128, "float32"))
    assert not report.ok
    assert report["rstd"]["torch_vs_reference"].ok and report["rstd"]["jax_vs_reference"].ok
    assert report.n_diff("rstd") > 0 and report.max_ulp("rstd") <= 8
    assert all(re.match(r"(worst: )?req [0-5] token \d+: got 0x", m) for m in report.mismatches("rstd"))


# ---------------------------------------------------------------------------------------------------------
# The recipe


def _jax_starts(flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"],
                          env=env, capture_output=True, text=True, timeout=120)


def test_recipe_xla_flags_exist():
    """An unknown flag in XLA_FLAGS aborts jax; every recipe flag is accepted (the control: one that is not)."""
    assert _jax_starts(recipe.xla_flags("")).stdout.strip() == "3.0"
    assert _jax_starts("--xla_gpu_no_such_flag=true").returncode != 0


def test_recipe_merges_flags_and_launch_options():
    merged = recipe.xla_flags("--xla_force_host_platform_device_count=2 --xla_gpu_ftz=true")
    assert merged.split()[:2] == ["--xla_force_host_platform_device_count=2", "--xla_gpu_ftz=true"]
    assert "--xla_gpu_ftz=false" not in merged and "--xla_allow_excess_precision=false" in merged
    assert recipe.xla_flag_conflicts("--xla_gpu_ftz=true --xla_cpu_ftz=true") == ["--xla_gpu_ftz=true"]
    assert recipe.triton_launch(num_warps=4) == {"num_warps": 4, **recipe.TRITON_LAUNCH}
    assert rmsnorm_triton.PARITY_LAUNCH == recipe.TRITON_LAUNCH
    with pytest.raises(ValueError, match="enable_fp_fusion"):
        recipe.triton_launch(enable_fp_fusion=True)


# ---------------------------------------------------------------------------------------------------------
# `python -m parity cross` and the docs snippet


def _save_example(path, dtype="bfloat16"):
    inputs = rmsnorm_reference.make_inputs(seed=3, dtype=dtype)
    stored = {}
    for k, v in inputs.items():
        v = np.asarray(v)
        if v.dtype == np.dtype(ml_dtypes.bfloat16):
            stored[f"{k}:bfloat16"] = v.view(np.uint16)
        else:
            stored[k] = v
    np.savez(path, **stored)
    return inputs


def _times3(x):
    return x * 3


def _times3_plus(x):
    return x * 3 + 0.5


def _cross(argv):
    env = dict(os.environ, PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "parity", "cross", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_inputs_and_outputs_options(tmp_path):
    npz = tmp_path / "in.npz"
    inputs = _save_example(npz)
    loaded = loading.load_inputs(str(npz))
    assert loaded["x"].dtype == np.dtype(ml_dtypes.bfloat16) and np.array_equal(
        loaded["x"].view(np.uint16), inputs["x"].view(np.uint16)) and loaded["eps"] == 1e-6
    assert loading.parse_outputs("out=token,dim; rstd=token;aux") == {
        "out": ("token", "dim"), "rstd": ("token",), "aux": None}


def test_cli_cross_checks_a_pair_from_files(tmp_path):
    """Bit for bit on the GPU, within the default tolerance under the CPU interpreters (f32: Triton's
    interpreter truncates to bf16, docs/design.md "Interpreter casts")."""
    npz = tmp_path / "in.npz"
    _save_example(npz, "float32")
    ex = "parity.examples"
    argv = ["--torch", f"{ex}.rmsnorm_triton:rmsnorm", "--jax", f"{ex}.rmsnorm_pallas:rmsnorm",
            "--reference", f"{ex}.rmsnorm_reference:rmsnorm", "--inputs", str(npz),
            "--outputs", "out=token,dim;rstd=token", "--ragged", "query_start_loc", "--json", str(tmp_path / "r.json"),
            "--special-values"]
    if not GPU:
        argv.append("--no-bitwise")
    res = _cross(argv)
    d = json.loads((tmp_path / "r.json").read_text())
    assert d["outputs"]["out"]["axes"] == ["token", "dim"]
    assert res.returncode == 0 and d["ok"], res.stdout + res.stderr
    assert d["required"] == (["torch_vs_jax"] if GPU else []) + ["torch_vs_reference", "jax_vs_reference",
                                                                 "special_torch_vs_jax"]
    assert len(d["special"]) == 10 and d["outputs"]["rstd"]["audit"]["imprecise"] is False
    assert "cross_check parity.examples.rmsnorm_triton:rmsnorm vs" in res.stdout


def test_cli_cross_exits_1_on_a_parity_failure(tmp_path):
    npz = tmp_path / "in.npz"
    np.savez(npz, x=np.linspace(1, 2, 8, dtype=np.float32))
    res = _cross(["--torch", "tests/test_parity_crosscheck.py:_times3", "--jax",
                  "tests/test_parity_crosscheck.py:_times3_plus", "--inputs", str(npz), "--outputs", "y=i"])
    assert res.returncode == 1 and "i 0: got 0x" in res.stdout


def test_cli_cross_usage_errors_name_the_flag(tmp_path, capsys, monkeypatch):
    """Each bad flag: exit status 2 and one line naming it on stderr, no traceback (in process: `cli.main`, what
    `python -m parity` runs; the shell path is the tests above)."""
    from parity import cli

    good = "parity.examples.rmsnorm_pallas:rmsnorm"
    npz = tmp_path / "in.npz"
    np.savez(npz, x=np.ones(4, np.float32))
    truncated = tmp_path / "cut.npz"
    truncated.write_bytes(npz.read_bytes()[:40])
    cases = [
        (["--torch", "nosuch:fn", "--jax", good, "--inputs", str(npz)], "error: --torch 'nosuch:fn': cannot import"),
        (["--torch", good, "--jax", "tests/none.py:f", "--inputs", str(npz)], "error: --jax 'tests/none.py:f': no file"),
        (["--torch", good, "--jax", good, "--reference", "nocolon", "--inputs", str(npz)],
         "error: --reference 'nocolon': expected MODULE:FUNCTION"),
        (["--torch", good, "--jax", good, "--inputs", str(tmp_path / "missing.npz")], "error: --inputs "),
        (["--torch", good, "--jax", good, "--inputs", str(truncated)], "not a readable .npz"),
    ]
    monkeypatch.chdir(ROOT)  # the MODULE:FUNCTION paths are the repository's, as from its root
    for argv, message in cases:
        rc = cli.main(["cross", *argv])
        err = capsys.readouterr().err
        assert rc == 2 and message in err, (argv, err)
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("block, expect", [(0, ("cross_check rmsnorm", "req 4 token 31", "audit out: reference")),
                                           (1, ("audit lse: reference float64", "special values planted at: x["))])
def test_docs_snippets_run(block, expect):
    """The ```python blocks of docs/parity-library.md (the quick start, the error model), as a reader would run
    them (from the repo root)."""
    with open(os.path.join(ROOT, "docs", "parity-library.md")) as f:
        text = f.read()
    code = re.findall(r"```python\n(.*?)```", text, re.S)[block]
    env = dict(os.environ, PYTHONPATH=ROOT)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert all(e in res.stdout for e in expect), res.stdout
