"""Golden vectors: export + verify round-trip for every implementation, tamper detection, numpy-only reading."""

import json
import math
import shutil

import numpy as np
import pytest

from parity import cli
from parity.harness import cases, golden, reference

# padded_v_ptwc: bf16, V-padded buffers (head_pad 64), pass-through rows, padding tokens.
# fp8_out: bf16 -> fp8 with a scale, +inf/NaN/-inf LSE specials, rows empty on both sides.
# n3_fp16_th_specials: an N-way case (3 partials, [N, T, H] LSEs, partials without KV for some requests).
# n3_ptwc_last_partial_empty: N-way pass-through tokens of requests without KV in the last partial (8.4).
CASES = ("padded_v_ptwc", "fp8_out", "n3_fp16_th_specials", "n3_ptwc_last_partial_empty")


def _inputs(case, seed):
    return (cases.make_inputs_n if case.n_way else cases.make_inputs)(case, seed)


@pytest.fixture(scope="module")
def golden_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("golden")
    golden.export(str(d), [cases.by_name(n) for n in CASES], seed=3)
    return d


def _load(golden_dir):
    manifest = golden.load_manifest(str(golden_dir))
    return manifest, {e["name"]: (e, golden.load_case(str(golden_dir), e)) for e in manifest["cases"]}


@pytest.mark.parametrize("impl", ["reference", "pallas", "jnp", "triton"])
def test_export_verify_round_trip(golden_dir, impl, capsys):
    rc = cli.main(["verify", str(golden_dir), "--impl", impl, "--quiet"])
    out = capsys.readouterr().out
    assert rc == 0, out
    for name in CASES:
        ops = ("merge_n", "merge_n_fused") if cases.by_name(name).n_way else ("mask", "merge", "merge_fused")
        for op in ops:
            assert any(line.startswith(name) and f" {op} " in line and line.rstrip().endswith("ok")
                       for line in out.splitlines()), (name, op, out)


def test_manifest_describes_every_array(golden_dir):
    manifest, loaded = _load(golden_dir)
    assert manifest["semantics_version"] == "3" and manifest["format_version"] == golden.FORMAT_VERSION == 2
    assert "section 3" in manifest["spec"]["mask"] and "section 4" in manifest["spec"]["merge"]
    assert "section 8" in manifest["spec"]["merge_n"]
    assert {"bfloat16", "float8_e4m3fn", "lse"} <= set(manifest["tolerances"])
    assert [e["name"] for e in manifest["cases"]] == list(CASES)
    for name, (entry, arrays) in loaded.items():
        case = cases.by_name(name)
        p = entry["params"]
        assert (p["num_tokens"], p["num_heads"], p["head_dim"], p["head_pad"]) == (
            case.num_tokens, case.num_heads, case.head_dim, case.head_pad)
        assert p["seed"] == 3 and p["lse_layout"] == case.lse_layout
        assert golden.case_from_params(name, p) == dataclass_without_tags(case)
        with np.load(golden_dir / entry["file"]) as z:
            assert sorted(z.files) == sorted(entry["arrays"])
            for key, meta in entry["arrays"].items():
                stored = z[key]
                assert stored.dtype.kind in "uib" and stored.dtype.name == meta["stored_as"]
                assert golden.sha256(stored) == meta["sha256"]
        # Inputs are the seeded case inputs, bit for bit.
        inputs = _inputs(case, 3)
        for key, value in inputs.items():
            assert arrays[key].dtype == value.dtype
            assert np.array_equal(arrays[key].view(np.uint8), value.view(np.uint8)), key


def dataclass_without_tags(case):
    import dataclasses

    return dataclasses.replace(case, tags=frozenset())


def test_expected_values_come_from_the_reference(golden_dir):
    _, loaded = _load(golden_dir)
    for name, (entry, a) in loaded.items():
        case = cases.by_name(name)
        D = case.head_dim
        if case.n_way:
            masked = np.stack([reference.mask_empty_context_lse(a["lses"][i], a["query_start_loc"], a["cu_seq_lens"][i],
                                                                lse_layout=case.lse_layout)[0]
                               for i in range(case.partials)])
            assert np.array_equal(a["masked_lses"].view(np.uint32), masked.view(np.uint32))
            want_out, want_lse = reference.merge_attn_states_n(
                a["outputs"][..., :D], a["lses"], query_start_loc=a["query_start_loc"], cu_seq_lens=a["cu_seq_lens"],
                prefill_tokens_with_context=case.prefill_tokens_with_context, output_scale=a.get("output_scale"),
                lse_layout=case.lse_layout, lse_base=case.lse_base)
            last = a["outputs"][-1]
        else:
            lse, out = reference.mask_empty_context_lse(a["prefix_lse"], a["query_start_loc"], a["cu_seq_lens"],
                                                        a["prefix_output"][..., :D], lse_layout=case.lse_layout)
            assert np.array_equal(a["mask.lse"].view(np.uint32), lse.view(np.uint32))
            assert np.array_equal(a["mask.output"].view(np.uint16), out.view(np.uint16))
            want_out, want_lse = reference.merge_attn_states(
                a["prefix_output"][..., :D], a["prefix_lse"], a["suffix_output"][..., :D], a["suffix_lse"],
                prefill_tokens_with_context=case.prefill_tokens_with_context, query_start_loc=a["query_start_loc"],
                prefix_cu_seq_lens=a["cu_seq_lens"], output_scale=a.get("output_scale"),
                lse_layout=case.lse_layout, lse_base=case.lse_base)
            last = a["suffix_output"]
        np.testing.assert_array_equal(a["merge.out"], want_out)
        np.testing.assert_array_equal(a["merge.lse"], want_lse)
        # Exact rows: where at most one partial has weight (by the stored weights), and pass-through rows.
        w = a["merge.weights"]
        assert w.shape == (case.partials or 2, case.num_tokens, case.num_heads)
        assert np.all(w >= 0) and np.all(w.sum(axis=0) <= 1 + 1e-12)
        live = (w > 0).sum(axis=0)
        passthrough = _passthrough(case, live.shape)
        want_exact = (live == 0) if case.out_dtype else (live <= 1) | passthrough
        assert np.array_equal(a["merge.out_exact"] & ~passthrough, want_exact & ~passthrough)
        if case.out_dtype is None and case.prefill_tokens_with_context is not None:
            ptwc = case.prefill_tokens_with_context
            assert np.array_equal(a["merge.out_bits"][ptwc:].view(np.uint16), last[ptwc:, :, :D].view(np.uint16))


def _passthrough(case, shape):
    m = np.zeros(shape, dtype=bool)
    if case.prefill_tokens_with_context is not None:
        m[case.prefill_tokens_with_context:] = True
    return m


def test_tampered_file_is_detected(golden_dir, tmp_path, capsys):
    bad = tmp_path / "tampered"
    shutil.copytree(golden_dir, bad)
    manifest = json.loads((bad / golden.MANIFEST).read_text())
    entry = manifest["cases"][0]
    path = bad / entry["file"]
    with np.load(path) as z:
        arrays = {k: z[k].copy() for k in z.files}
    arrays["merge.out"].reshape(-1)[7] ^= 1  # one bit of one expected value
    np.savez(path, **arrays)
    assert cli.main(["verify", str(bad), "--impl", "reference", "--quiet"]) == 1
    out, err = capsys.readouterr()
    assert "sha256 mismatch for merge.out" in out + err
    # The untouched case still verifies.
    assert cli.main(["verify", str(bad), "--impl", "reference", "--quiet", "-k", CASES[1]]) == 0


def test_missing_manifest_is_an_error(tmp_path, capsys):
    assert cli.main(["verify", str(tmp_path), "--impl", "reference"]) == 1
    assert "manifest.json" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float16", "float32"])
def test_numpy_only_decoding_matches_ml_dtypes(name):
    dt = cases.DTYPES[name]
    width = dt.itemsize * 8
    bits = np.arange(2**width, dtype=np.uint64).astype(f"<u{dt.itemsize}") if width <= 16 else \
        np.random.default_rng(0).integers(0, 2**32, size=1 << 16, dtype=np.uint64).astype("<u4")
    got = golden.decode_float64(bits, name)
    with np.errstate(invalid="ignore"):  # signalling-NaN bit patterns
        want = bits.view(dt).astype(np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    fin = ~np.isnan(want)
    assert np.array_equal(got[fin], want[fin])


def test_export_cli(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path / "g"), "-k", "upstream_vector", "--quiet"]) == 0
    manifest = golden.load_manifest(str(tmp_path / "g"))
    assert [e["name"] for e in manifest["cases"]] == ["upstream_vector"]
    assert manifest["cases"][0]["params"]["lse_base"] == ("e" if cases.by_name("upstream_vector").lse_base
                                                          == math.e else "2")


def _numpy_only_failures(entry, a, got_out, got_lse, tolerances):
    """docs/golden.md's rule with numpy alone (parity.harness.golden.numpy_*), on typed results."""
    p = entry["params"]
    D, dt = p["head_dim"], p["out_dtype"]
    bits = lambda x: golden.to_stored(np.asarray(x))[0]  # noqa: E731
    raw = lambda key: golden.to_stored(a[key])[0]  # noqa: E731
    decode = lambda key: golden.decode_float64(raw(key), entry["arrays"][key]["dtype"])  # noqa: E731
    w = a["merge.weights"]
    if p.get("partials"):
        parts = [decode("outputs")[i, ..., :D] for i in range(p["partials"])]
    else:
        parts = [decode("mask.output"), decode("suffix_output")[..., :D]]
    with np.errstate(invalid="ignore"):
        mag = sum(np.where(wi[..., None] > 0, np.abs(o) * wi[..., None], 0.0) for o, wi in zip(parts, w))
    if p["fp8_output_scale"]:
        mag = mag / float(a["output_scale"][0])
    exact = np.broadcast_to(a["merge.out_exact"][:, :, None], mag.shape)
    lse_exact = a["merge.lse_exact"]
    out_t, lse_t = tolerances[dt], tolerances["lse"]
    return (golden.numpy_exact_mismatches(bits(got_out), raw("merge.out_bits"), dt, exact)
            + golden.numpy_tolerance_failures(bits(got_out), raw("merge.out_bits"), a["merge.out"], mag, dt,
                                              out_t["rtol"], out_t["atol"], exact)
            + golden.numpy_exact_mismatches(bits(got_lse), raw("merge.lse_bits"), "float32", lse_exact)
            + golden.numpy_tolerance_failures(bits(got_lse), raw("merge.lse_bits"), a["merge.lse"],
                                              np.abs(a["merge.lse"]), "float32", lse_t["rtol"], lse_t["atol"],
                                              lse_exact))


def test_numpy_only_rule_of_the_docs(golden_dir):
    manifest, loaded = _load(golden_dir)
    for name, (entry, a) in loaded.items():
        case = cases.by_name(name)
        for op in entry["ops"]:
            if op == "mask":
                continue
            got = golden.Runner("reference").run(case, a, op)
            out, lse = got["out"], got["lse"]
            assert _numpy_only_failures(entry, a, out, lse, manifest["tolerances"]) == 0
        # Planted errors: one tolerance element 50% off, one exact element (an LSE copy or -inf) changed.
        bad_out = np.array(out, copy=True)
        tol_idx = np.argwhere(~a["merge.out_exact"] & (np.abs(a["merge.out"][..., 0]) > 0.5))[0]
        bad_out[tuple(tol_idx) + (0,)] = (bad_out[tuple(tol_idx) + (0,)].astype(np.float32) * 1.5).astype(out.dtype)
        bad_lse = np.array(lse, copy=True)
        bad_lse[np.argwhere(a["merge.lse_exact"])[0][0], np.argwhere(a["merge.lse_exact"])[0][1]] = 0.5
        assert _numpy_only_failures(entry, a, bad_out, bad_lse, manifest["tolerances"]) == 2


def _verify_one_line_error(golden_dir, capsys):
    """`verify` on a broken folder: exit 1 and the problem in one line, no traceback."""
    rc = cli.main(["verify", str(golden_dir), "--impl", "reference", "--quiet"])
    out, err = capsys.readouterr()
    return rc, out, err


def test_corrupt_manifest_is_one_line_error(golden_dir, tmp_path, capsys):
    bad = tmp_path / "corrupt_manifest"
    shutil.copytree(golden_dir, bad)
    text = (bad / golden.MANIFEST).read_text()
    (bad / golden.MANIFEST).write_text(text[: len(text) // 2])  # truncated JSON
    rc, out, err = _verify_one_line_error(bad, capsys)
    assert rc == 1 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err
    assert str(bad / golden.MANIFEST) in lines[0] and "not valid JSON" in lines[0]


def test_truncated_npz_is_one_line_error(golden_dir, tmp_path, capsys):
    bad = tmp_path / "truncated_npz"
    shutil.copytree(golden_dir, bad)
    entry = json.loads((bad / golden.MANIFEST).read_text())["cases"][0]
    path = bad / entry["file"]
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])  # the zip's central directory is gone
    rc, out, err = _verify_one_line_error(bad, capsys)
    assert rc == 1 and "Traceback" not in out + err
    named = [line for line in (out + err).splitlines() if str(path) in line]
    assert len(named) == 1 and "not a readable .npz" in named[0], out + err
    # No false pass: every op of the truncated case fails, the other cases still verify.
    rows = [line for line in out.splitlines() if line.startswith(entry["name"] + " ")]
    assert rows and all(line.rstrip().endswith("ERROR") for line in rows)
    assert cli.main(["verify", str(bad), "--impl", "reference", "--quiet", "-k", CASES[1]]) == 0
