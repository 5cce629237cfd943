"""Porters verify their own ports: `python -m parity verify DIR --impl ...` / `--outputs ...` (docs/porting.md).

The worked example (parity/examples/numpy_port.py, plain numpy in f32) must pass; the same port with one rule
broken, one bug class upstream met each (docs/spec.md 1, 4, 8 and NOTES of the porting guide), must be rejected
on the case that exercises it, with the mismatch located to (request, head, token).
"""

import importlib.util
import re
from pathlib import Path

import numpy as np
import pytest

from parity import cli
from parity.harness import cases, golden

ROOT = Path(__file__).resolve().parents[1]
PORT = ROOT / "parity" / "examples" / "numpy_port.py"


@pytest.fixture(scope="module")
def golden_dir(tmp_path_factory):
    """Every case of the ci suite that `export` writes (a semantics change that leaves the example behind fails)."""
    d = tmp_path_factory.mktemp("golden_porting")
    golden.export(str(d), cases.select("ci", kind="all"), seed=1)
    return d


def _port_module():
    """A fresh copy of the example port, whose functions a test may replace."""
    spec = importlib.util.spec_from_file_location("numpy_port_under_test", PORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _failures(golden_dir, fn):
    rows, ok = golden.verify(str(golden_dir), fn)
    return ok, {(r["case"], r["op"]): r for r in rows if not r["ok"]}


def test_the_faithful_port_passes(golden_dir):
    ok, failed = _failures(golden_dir, _port_module().port)
    assert ok, {k: (v["error"], [x.format() for x in v["reports"].values() if not x.ok]) for k, v in failed.items()}


# Each bug class: (how the port breaks it, the case that must reject it).

def _base2_read_as_e(m):
    port = m.port
    m.port = lambda op, inputs, params: port(op, inputs, dict(params, lse_base="e"))


def _th_read_as_ht(m):
    # A [T, H] LSE buffer read as if it were [H, T] (its memory reinterpreted), results written back the same way.
    to_th, from_th = m.to_th, m.from_th
    m.to_th = lambda lse, layout: to_th(np.ascontiguousarray(lse).reshape(lse.shape[:-2] + lse.shape[-2:][::-1]), "HT")
    m.from_th = lambda x, layout: from_th(x, "HT").reshape(x.shape) if layout == "TH" else from_th(x, layout)


def _suffix_with_prefix_strides(m):
    # The suffix addressed with the prefix's (padded-V) strides: upstream's CUDA merge bug.
    port = m.port

    def buggy(op, inputs, params):
        if "suffix_output" in inputs and inputs["suffix_output"].shape != inputs["prefix_output"].shape:
            pre, suf = inputs["prefix_output"], inputs["suffix_output"]
            flat = np.full(pre.size, np.nan, dtype=suf.dtype)
            flat[:suf.size] = suf.ravel()
            inputs = dict(inputs, suffix_output=flat.reshape(pre.shape))
        return port(op, inputs, params)

    m.port = buggy


def _both_empty_gives_nan(m):
    def weights(l):
        mx = l.max(axis=0)
        with np.errstate(invalid="ignore", divide="ignore"):
            e = np.exp(l - mx)  # every partial -inf: -inf - -inf = NaN
            z = e.sum(axis=0)
            return e / z, mx, z, np.zeros(mx.shape, dtype=bool)

    m.weights = weights


def _nan_leaks_from_an_empty_partial(m):
    def combine(outputs, w):
        with np.errstate(invalid="ignore"):
            return sum(outputs[i].astype(np.float32) * w[i][..., None] for i in range(len(outputs)))  # NaN * 0 = NaN

    m.combine = combine


def _mask_skipped(m):
    m.empty_rows = lambda qsl, cu, num_tokens: np.zeros(num_tokens, dtype=bool)


def _passthrough_lse_ignores_the_mask(m):
    # Pass-through rows copy the last partial's raw LSE even where the fused mask empties that partial (8.4 wants
    # -inf there): the worked example's own bug until 2026-12-07.
    merge_partials = m.merge_partials

    def buggy(outputs, lses_th, empty, params):
        out, lse = merge_partials(outputs, lses_th, empty, params)
        if empty is not None:
            copy = m.passthrough_rows(out.shape[0], params["prefill_tokens_with_context"])
            lse = np.where((copy & empty[-1])[:, None], lses_th[-1], lse).astype(np.float32)
        return out, lse

    m.merge_partials = buggy


def _ptwc_off_by_one(m):
    m.passthrough_rows = lambda num_tokens, n: np.arange(num_tokens) > (num_tokens if n is None else n)


BUGS = [
    (_base2_read_as_e, "base2_specials", ("merge", "merge_fused")),
    (_th_read_as_ht, "specials_th", ("mask", "merge", "merge_fused")),
    (_th_read_as_ht, "n3_fp16_th_specials", ("merge_n", "merge_n_fused")),
    (_suffix_with_prefix_strides, "padded_prefix_only", ("merge", "merge_fused")),
    (_both_empty_gives_nan, "specials_th", ("merge", "merge_fused")),
    (_both_empty_gives_nan, "n3_fp16_th_specials", ("merge_n", "merge_n_fused")),
    (_nan_leaks_from_an_empty_partial, "upstream_vector", ("merge_fused",)),
    (_nan_leaks_from_an_empty_partial, "n3_fp16_th_specials", ("merge_n", "merge_n_fused")),
    (_mask_skipped, "upstream_vector", ("mask", "merge_fused")),
    (_mask_skipped, "n2_fp32_d80_ptwc", ("merge_n_fused",)),
    (_passthrough_lse_ignores_the_mask, "n3_ptwc_last_partial_empty", ("merge_n_fused",)),
    (_ptwc_off_by_one, "padded_v_ptwc", ("merge", "merge_fused")),
    (_ptwc_off_by_one, "n2_fp32_d80_ptwc", ("merge_n", "merge_n_fused")),
]


@pytest.mark.parametrize("bug,case,ops", BUGS, ids=[f"{b.__name__[1:]}-{c}" for b, c, _ in BUGS])
def test_each_bug_class_is_rejected_and_located(golden_dir, bug, case, ops):
    m = _port_module()
    bug(m)
    ok, failed = _failures(golden_dir, m.port)
    assert not ok
    for op in ops:
        assert (case, op) in failed, f"{bug.__name__} passed {case} {op}"
        row = failed[(case, op)]
        if row["error"] is None:  # a value mismatch: located to (request, head, token) through the offsets
            lines = [line for rep in row["reports"].values() if not rep.ok for line in rep.format().splitlines()]
            assert any(re.search(r"(req \d+|padding) head \d+ token \d+", line) for line in lines), lines[:5]


def test_cli_accepts_a_port_by_path(golden_dir, capsys):
    assert cli.main(["verify", str(golden_dir), "--impl", f"{PORT}:port", "--quiet"]) == 0
    assert f"golden verify --impl {PORT}:port" in capsys.readouterr().out


def test_cli_reads_a_ports_results_files(golden_dir, tmp_path, capsys):
    # A port in another runtime writes one npz per case: `<op>.<result>` arrays (here written by the numpy port).
    port = _port_module().port
    manifest = golden.load_manifest(str(golden_dir))
    for entry in manifest["cases"]:
        a = golden.load_case(str(golden_dir), entry)
        case = golden.case_from_params(entry["name"], entry["params"])
        golden.save_outputs(str(tmp_path), case.name, {op: port(op, golden.port_inputs(case, a, op), entry["params"])
                                                      for op in entry["ops"]})
    assert cli.main(["verify", str(golden_dir), "--outputs", str(tmp_path), "--quiet"]) == 0
    capsys.readouterr()
    # One wrong element in one file: rejected and located.
    path = tmp_path / "padded_v_ptwc.npz"
    with np.load(path) as z:
        arrays = {k: z[k].copy() for k in z.files}
    arrays["merge.out"][3, 1, 5] ^= 0x0400  # one exponent bit of token 3, head 1, dim 5 (request 0)
    np.savez(path, **arrays)
    assert cli.main(["verify", str(golden_dir), "--outputs", str(tmp_path), "--quiet", "-k", "padded_v"]) == 1
    out = capsys.readouterr().out
    assert "req 0 head 1 token 3 dim 5" in out
    # A missing result is an error, not a pass.
    del arrays["merge_fused.lse"]
    np.savez(path, **arrays)
    assert cli.main(["verify", str(golden_dir), "--outputs", str(tmp_path), "--quiet", "-k", "padded_v"]) == 1
    assert "lacks ['merge_fused.lse']" in capsys.readouterr().out


@pytest.mark.parametrize("argv,match", [
    (["--impl", "no_such_module:port"], "No module named"),
    (["--impl", "parity/examples/missing.py:port"], "no file"),
    (["--impl", f"{PORT}:nope"], "no callable 'nope'"),
])
def test_bad_port_specs_are_errors(golden_dir, capsys, argv, match):
    assert cli.main(["verify", str(golden_dir), *argv, "--quiet"]) == 1
    assert match in capsys.readouterr().err
