"""The golden-vector format (docs/golden.md): raw-bit storage, the manifest, case parameters, and loading
with every array's sha256, dtype and shape checked.

`numpy_exact_mismatches` / `numpy_tolerance_failures` are the rule of docs/golden.md written with numpy alone,
for a reader without torch or ml_dtypes; `verify` applies the same rule through `parity.library`'s comparison
engine, and a test checks that the two agree.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import zipfile
from typing import Any

import numpy as np

from parity.harness import cases as cases_mod
from parity.harness import impls

FORMAT = "mla-lse-merge-golden"
FORMAT_VERSION = 2
SEMANTICS_VERSION = "3"
MANIFEST = "manifest.json"
OPS = impls.OPS

SPEC_SECTIONS = {
    "document": "docs/spec.md (in the repository)",
    "layouts": "docs/spec.md section 2",
    "mask": "docs/spec.md section 3",
    "merge": "docs/spec.md section 4",
    "empty_sentinels": "docs/spec.md section 4.1",
    "both_empty": "docs/spec.md section 4.2",
    "zero_weight": "docs/spec.md section 4.3",
    "pass_through": "docs/spec.md section 4.4",
    "fused_mask": "docs/spec.md section 4.5",
    "fp8_output": "docs/spec.md section 4.6",
    "per_group_fp8_output": "docs/spec.md section 4.7",
    "nvfp4_output": "docs/spec.md section 4.8",
    "parity": "docs/spec.md section 5",
    "merge_n": "docs/spec.md section 8",
}

# Storage dtype of each value dtype: same width, little-endian.
_STORED = {
    "float64": "<u8", "float32": "<u4", "float16": "<u2", "bfloat16": "<u2", "float8_e4m3fn": "u1",
    "int32": "<i4", "bool": "u1",
}


class GoldenError(Exception):
    """A golden folder that cannot be used: missing files, unknown version, or a failed hash check."""



# ---------------------------------------------------------------------------------------------------------
# Raw-bit storage


def _np_dtype(name: str) -> np.dtype:
    if name in cases_mod.DTYPES:
        return cases_mod.DTYPES[name]
    return np.dtype(name)


def to_stored(x: np.ndarray) -> tuple[np.ndarray, str]:
    """(array to store, value dtype name): floats as same-width unsigned bits, bool as uint8."""
    x = np.ascontiguousarray(x)
    name = "bool" if x.dtype == np.bool_ else x.dtype.name
    if name not in _STORED:
        raise TypeError(f"cannot store {x.dtype=}; supported: {sorted(_STORED)}")
    return np.ascontiguousarray(x.view(np.uint8) if name == "bool" else x.view(_STORED[name])), name


def from_stored(stored: np.ndarray, name: str) -> np.ndarray:
    """The value array of a stored array (a view; bool arrays are converted)."""
    if name == "bool":
        return stored.astype(np.bool_)
    return stored.view(_np_dtype(name))


def decode_float64(stored: np.ndarray, name: str) -> np.ndarray:
    """Numpy-only decoding of stored float bits to float64 (docs/golden.md, "Reading without ml_dtypes").

    bf16 is the top half of an f32; fp8 e4m3fn is sign, 4 exponent bits (bias 7), 3 mantissa bits, no
    infinities, S.1111.111 is NaN.
    """
    with np.errstate(invalid="ignore"):  # signalling NaN payloads are fine: NaN stays NaN
        if name == "float64":
            return stored.view("<f8").copy()
        if name == "float32":
            return stored.view("<f4").astype(np.float64)
        if name == "float16":
            return stored.view("<f2").astype(np.float64)
        if name == "bfloat16":
            return (stored.astype(np.uint32) << 16).view("<f4").astype(np.float64)
    if name == "float8_e4m3fn":
        b = stored.astype(np.int64)
        sign = np.where(b & 0x80, -1.0, 1.0)
        exp, man = (b >> 3) & 0xF, b & 0x7
        value = np.where(exp == 0, man / 8.0 * 2.0**-6, (1.0 + man / 8.0) * np.exp2(exp - 7.0))
        return np.where((exp == 0xF) & (man == 0x7), np.nan, sign * value)
    raise TypeError(f"not a float dtype name: {name!r}")


def _value_class(x: np.ndarray) -> np.ndarray:
    return np.select([np.isnan(x), x == np.inf, x == -np.inf], [3, 1, 2], 0)


def numpy_exact_mismatches(got_bits: np.ndarray, want_bits: np.ndarray, dtype: str, where) -> int:
    """docs/golden.md rule 1, numpy only: elements under `where` whose bits differ (a NaN matches any NaN)."""
    both_nan = np.isnan(decode_float64(got_bits, dtype)) & np.isnan(decode_float64(want_bits, dtype))
    return int(np.count_nonzero(((got_bits != want_bits) & ~both_nan) & where))


def numpy_tolerance_failures(got_bits: np.ndarray, want_bits: np.ndarray, want_f64: np.ndarray, mag: np.ndarray,
                             dtype: str, rtol: float, atol: float, skip) -> int:
    """docs/golden.md rule 2, numpy only: elements outside `skip` whose class differs from the expected bits'
    or, both finite, with |got - want| > atol + rtol * mag."""
    got, exp = decode_float64(got_bits, dtype), decode_float64(want_bits, dtype)
    bad_class = _value_class(got) != _value_class(exp)
    finite = np.isfinite(got) & np.isfinite(exp)
    with np.errstate(invalid="ignore"):
        bad_value = finite & ~(np.abs(got - want_f64) <= atol + rtol * mag)
    return int(np.count_nonzero((bad_class | bad_value) & ~skip))


def sha256(stored: np.ndarray) -> str:
    """sha256 of the stored array's bytes (C order, little-endian, as written in the .npz)."""
    return hashlib.sha256(np.ascontiguousarray(stored).tobytes()).hexdigest()


# ---------------------------------------------------------------------------------------------------------
# Case parameters <-> parity.harness.cases.Case


def case_params(case: cases_mod.Case, seed: int) -> dict[str, Any]:
    T, H, D = case.num_tokens, case.num_heads, case.head_dim
    lse_shape = [H, T] if case.lse_layout == "HT" else [T, H]
    if case.n_way:
        N = case.partials
        return {
            "partials": N, "query_lens": list(case.query_lens), "context_lens": list(case.context_lens),
            "interleave": case.interleave, "num_requests": case.num_requests, "num_tokens": T, "num_heads": H,
            "head_dim": D, "head_pad": case.head_pad, "padding_tokens": case.padding,
            "dtype": case.dtype, "out_dtype": case.out_dtype or case.dtype,
            "lse_layout": case.lse_layout, "lse_shape": [N] + lse_shape, "lse_base": "2" if case.lse_base == 2 else "e",
            "output_shape": [T, H, D], "buffer_shape": [N, T, H, D + case.head_pad],
            "prefill_tokens_with_context": case.prefill_tokens_with_context,
            "fp8_output_scale": case.fp8_out and not case.group_size, "specials": case.specials,
            "strided": case.strided, "seed": seed, **_group_params(case),
        }
    return {
        "query_lens": list(case.query_lens), "empty_requests": list(case.empty),
        "num_requests": case.num_requests, "num_tokens": T, "num_heads": H, "head_dim": D,
        "head_pad": case.head_pad, "suffix_head_pad": case.suffix_head_pad, "padding_tokens": case.padding,
        "dtype": case.dtype, "out_dtype": case.out_dtype or case.dtype,
        "lse_layout": case.lse_layout, "lse_shape": lse_shape, "lse_base": "2" if case.lse_base == 2 else "e",
        "output_shape": [T, H, D], "buffer_shape": [T, H, D + case.head_pad],
        "prefill_tokens_with_context": case.prefill_tokens_with_context,
        "fp8_output_scale": case.fp8_out and not case.group_size, "specials": case.specials, "seed": seed,
        **_group_params(case),
    }


def _group_params(case: cases_mod.Case) -> dict[str, Any]:
    """Per-group FP8 (docs/spec.md 4.7): the group size and UE8M0 flag, only for the cases that have them."""
    return dict(group_size=case.group_size, scale_ue8m0=case.scale_ue8m0) if case.group_size else {}


def case_from_params(name: str, p: dict[str, Any]) -> cases_mod.Case:
    if p.get("partials"):
        return cases_mod.Case(
            name, tuple(p["query_lens"]), (), num_heads=p["num_heads"], head_dim=p["head_dim"], dtype=p["dtype"],
            lse_layout=p["lse_layout"], lse_base=2 if p["lse_base"] == "2" else math.e, padding=p["padding_tokens"],
            head_pad=p["head_pad"], specials=p["specials"], prefill_tokens_with_context=p["prefill_tokens_with_context"],
            out_dtype=None if p["out_dtype"] == p["dtype"] else p["out_dtype"], partials=p["partials"],
            context_lens=tuple(p["context_lens"]), interleave=p["interleave"], strided=p["strided"],
            group_size=p.get("group_size"), scale_ue8m0=p.get("scale_ue8m0", False))
    return cases_mod.Case(
        name, tuple(p["query_lens"]), tuple(p["empty_requests"]), num_heads=p["num_heads"],
        head_dim=p["head_dim"], dtype=p["dtype"], lse_layout=p["lse_layout"],
        lse_base=2 if p["lse_base"] == "2" else math.e, padding=p["padding_tokens"], head_pad=p["head_pad"],
        suffix_head_pad=p.get("suffix_head_pad"),
        specials=p["specials"], prefill_tokens_with_context=p["prefill_tokens_with_context"],
        out_dtype=None if p["out_dtype"] == p["dtype"] else p["out_dtype"], group_size=p.get("group_size"),
        scale_ue8m0=p.get("scale_ue8m0", False))



_DESCRIPTIONS = {
    "query_start_loc": "i32[R+1] query offsets (docs/spec.md 2)",
    "cu_seq_lens": "i32[R+1] context-chunk offsets of the prefix (N-way: i32[N, R+1], each partial's KV offsets); "
                   "request r is empty iff cu[r+1] == cu[r]",
    "outputs": "dtype[N, T, H, D + head_pad] the N partials (N-way cases); columns >= D are padding (NaN)",
    "lses": "f32[N, H, T] or f32[N, T, H] the partials' LSEs (N-way cases), in lse_layout and lse_base",
    "masked_lses": "lses after the mask of each partial by its offsets (the input of merge_n; exact)",
    "prefix_output": "dtype[T, H, D + head_pad] prefix (context chunk) partial; columns >= D are padding (NaN)",
    "prefix_lse": "f32 prefix LSE in lse_layout and lse_base",
    "suffix_output": "dtype[T, H, D + suffix_head_pad] suffix partial (suffix_head_pad null: head_pad); columns >= D "
                     "are padding (NaN)",
    "suffix_lse": "f32 suffix LSE in lse_layout and lse_base",
    "output_scale": "f32[1] fp8 output scale (docs/spec.md 4.6)",
    "mask.lse": "expected prefix LSE after the mask (exact)",
    "mask.output": "expected prefix_output[..., :D] after the mask (exact)",
    "merge.out": "float64 reference output (fp8: the clamped, scaled value before the cast; NVFP4: the clamped "
                 "quotient y before the e2m1 code, a NaN as the +-0 it encodes to)",
    "merge.out_bits": "merge.out rounded to the output dtype (nearest even); pass-through rows are the last partial's "
                      "(the suffix's) bits; NVFP4: the f32 values of the reference's e2m1 codes",
    "merge.out_exact": "bool[T, H]: rows of the output that are bit copies (compared bit for bit)",
    "merge.scales": "f32[T, H * D / group_size]: the per-group FP8 scales (docs/spec.md 4.7; group_size cases), or "
                    "float8_e4m3fn[T, H * D / 16]: NVFP4's block scales, row-major (4.8; float4_e2m1fn cases)",
    "merge.lse": "float64 reference LSE (lse_layout, lse_base)",
    "merge.lse_bits": "merge.lse rounded to f32; pass-through rows are the raw LSE bits of the last partial",
    "merge.lse_exact": "bool in lse_layout: LSE elements that are bit copies (compared bit for bit)",
    "merge.weights": "f64[N, T, H]: the reference weight w_i of each partial (N = 2: prefix, suffix), giving "
                     "mag = sum_i |o_i| * w_i",
}


def _role(key: str) -> str:
    return "expected" if "." in key else "input"


def _tolerances() -> dict[str, dict[str, float]]:
    from parity.library.compare import TOLERANCES

    return {k: {"rtol": float(v.rtol), "atol": float(v.atol)} for k, v in TOLERANCES.items()}


# ---------------------------------------------------------------------------------------------------------
# Load


def load_manifest(golden_dir: str) -> dict[str, Any]:
    """The manifest of a golden folder; a `GoldenError` naming the file when it is missing, not JSON, not this
    format's version or lacks what `verify` reads."""
    path = os.path.join(golden_dir, MANIFEST)
    if not os.path.exists(path):
        raise GoldenError(f"no {MANIFEST} in {golden_dir!r}: not a folder written by `python -m parity export`")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError) as e:
        raise GoldenError(f"{path}: cannot be read: {e}") from None
    except json.JSONDecodeError as e:
        raise GoldenError(f"{path}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno}): file "
                          "truncated or corrupt") from None
    if not isinstance(manifest, dict):
        raise GoldenError(f"{path}: a JSON {type(manifest).__name__}, not the manifest object")
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise GoldenError(f"{path}: format {manifest.get('format')!r} version {manifest.get('format_version')!r}; "
                          f"this reader takes {FORMAT!r} version {FORMAT_VERSION}")
    if manifest.get("semantics_version") != SEMANTICS_VERSION:
        raise GoldenError(f"{path}: semantics version {manifest.get('semantics_version')!r}, this code implements "
                          f"{SEMANTICS_VERSION!r}")
    cases = manifest.get("cases")
    if not isinstance(manifest.get("tolerances"), dict) or not isinstance(cases, list) or not all(
            isinstance(e, dict) and {"name", "file", "params", "arrays"} <= set(e) for e in cases):
        raise GoldenError(f"{path}: lacks its tolerances or a case's name, file, params or arrays")
    return manifest


def load_case(golden_dir: str, entry: dict[str, Any]) -> dict[str, np.ndarray]:
    """The value arrays of one case, after checking every array's sha256, dtype and shape; a `GoldenError`
    naming the file when it is missing, not a readable .npz (truncated, not a zip) or differs from the
    manifest."""
    path = os.path.join(golden_dir, entry["file"])
    if not os.path.exists(path):
        raise GoldenError(f"{entry['name']}: missing file {path}")
    out = {}
    try:
        with np.load(path, allow_pickle=False) as z:
            missing = sorted(set(entry["arrays"]) - set(z.files))
            if missing:
                raise GoldenError(f"{entry['name']}: {path} lacks arrays {missing}")
            for key, meta in entry["arrays"].items():
                s = z[key]
                if s.dtype != np.dtype(_STORED[meta["dtype"]]) or list(s.shape) != meta["shape"]:
                    raise GoldenError(f"{entry['name']}: {key} is {s.dtype}{list(s.shape)}, the manifest says "
                                      f"{meta['stored_as']}{meta['shape']}")
                digest = sha256(s)
                if digest != meta["sha256"]:
                    raise GoldenError(f"{entry['name']}: sha256 mismatch for {key} in {path} (file modified or "
                                      f"corrupt): {digest} != {meta['sha256']}")
                out[key] = from_stored(s, meta["dtype"])
    except (zipfile.BadZipFile, EOFError, ValueError, OSError) as e:
        raise GoldenError(f"{entry['name']}: {path} is not a readable .npz (truncated or corrupt): "
                          f"{type(e).__name__}: {e}") from None
    return out
