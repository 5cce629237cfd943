"""Golden vectors: `python -m parity export DIR` and `python -m parity verify DIR --impl ...`.

`export` writes, per case of a suite (2-way and N-way cases), `<case>.npz` with the inputs and the expected
results, and one `manifest.json` describing every case and array (format: docs/golden.md). Expected results
come from the float64 reference (`parity.harness.reference`, through `parity.harness.impls` and `parity.harness.expected`), never
from the kernels. Every float array is stored as the unsigned integer of its width holding its bits, so
numpy alone can read bf16 and fp8 (the manifest names the dtype).

`verify` loads the vectors, checks the sha256 of every array against the manifest, runs one implementation
(`triton`, `pallas`, `jnp` or `reference`, through `parity.harness.impls`) on the inputs and compares: the mask bit for
bit; the merges bit for bit where the result is a copy (`*_exact`) and elsewhere within the tolerance written
in the manifest (`|got - want| <= atol + rtol * mag`, `parity.library.compare.TOLERANCES`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np

from parity.harness import cases as cases_mod
from parity.harness import expected, impls
from parity.library.loading import LoadError, load_callable

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
            "fp8_output_scale": case.fp8_out, "specials": case.specials, "strided": case.strided,
            "seed": seed,
        }
    return {
        "query_lens": list(case.query_lens), "empty_requests": list(case.empty),
        "num_requests": case.num_requests, "num_tokens": T, "num_heads": H, "head_dim": D,
        "head_pad": case.head_pad, "suffix_head_pad": case.suffix_head_pad, "padding_tokens": case.padding,
        "dtype": case.dtype, "out_dtype": case.out_dtype or case.dtype,
        "lse_layout": case.lse_layout, "lse_shape": lse_shape, "lse_base": "2" if case.lse_base == 2 else "e",
        "output_shape": [T, H, D], "buffer_shape": [T, H, D + case.head_pad],
        "prefill_tokens_with_context": case.prefill_tokens_with_context,
        "fp8_output_scale": case.fp8_out, "specials": case.specials, "seed": seed,
    }


def case_from_params(name: str, p: dict[str, Any]) -> cases_mod.Case:
    if p.get("partials"):
        return cases_mod.Case(
            name, tuple(p["query_lens"]), (), num_heads=p["num_heads"], head_dim=p["head_dim"], dtype=p["dtype"],
            lse_layout=p["lse_layout"], lse_base=2 if p["lse_base"] == "2" else math.e, padding=p["padding_tokens"],
            head_pad=p["head_pad"], specials=p["specials"], prefill_tokens_with_context=p["prefill_tokens_with_context"],
            out_dtype=None if p["out_dtype"] == p["dtype"] else p["out_dtype"], partials=p["partials"],
            context_lens=tuple(p["context_lens"]), interleave=p["interleave"], strided=p["strided"])
    return cases_mod.Case(
        name, tuple(p["query_lens"]), tuple(p["empty_requests"]), num_heads=p["num_heads"],
        head_dim=p["head_dim"], dtype=p["dtype"], lse_layout=p["lse_layout"],
        lse_base=2 if p["lse_base"] == "2" else math.e, padding=p["padding_tokens"], head_pad=p["head_pad"],
        suffix_head_pad=p.get("suffix_head_pad"),
        specials=p["specials"], prefill_tokens_with_context=p["prefill_tokens_with_context"],
        out_dtype=None if p["out_dtype"] == p["dtype"] else p["out_dtype"])


# ---------------------------------------------------------------------------------------------------------
# Expected results (float64 reference only)


def _merge_expectations(case: cases_mod.Case, op: str, arrays: dict[str, np.ndarray],
                        last_output: np.ndarray, last_lse: np.ndarray) -> dict[str, np.ndarray]:
    """merge.* of docs/golden.md for a merge op on `arrays`: reference values, their bits, exact masks, weights.

    `last_output` / `last_lse` are the last partial's (the suffix's) output and LSE as the op reads them (N-way:
    after the mask, docs/spec.md 8.4): pass-through rows copy them.
    """
    ref = impls.run(impls.HOST, "reference", op, case, arrays)
    w = expected.merge_weights(case, op, arrays)
    out_exact, lse_exact = expected.exact_masks(case, w)
    out_bits = ref["out"].astype(_np_dtype(case.out_dtype or case.dtype))
    lse_bits = ref["lse"].astype(np.float32)
    ptwc = case.prefill_tokens_with_context
    if ptwc is not None:  # docs/spec.md 4.4, 8.4: bit copies (float64 cannot carry NaN payloads)
        if case.out_dtype is None:
            out_bits[ptwc:] = last_output[ptwc:, :, :case.head_dim]
        impls._token_slice(lse_bits, case.lse_layout, ptwc, case.num_tokens)[...] = \
            impls._token_slice(last_lse, case.lse_layout, ptwc, case.num_tokens)
    return {"merge.out": ref["out"], "merge.out_bits": out_bits, "merge.out_exact": out_exact,
            "merge.lse": ref["lse"], "merge.lse_bits": lse_bits, "merge.lse_exact": lse_exact, "merge.weights": w}


def expected_arrays(case: cases_mod.Case, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The expected results of the case's ops, from the float64 reference (docs/golden.md, "Arrays of a case").

    2-way cases: mask.lse, mask.output (exact) and merge.* of the merge of the masked prefix (the fused merge
    must give the same results). N-way cases: masked_lses (each partial's LSE after the mask: the input of
    `merge_n`) and merge.* of the N-way merge (`merge_n_fused` on the raw partials must give the same).
    """
    if case.n_way:
        masked = impls.masked_lses(case, inputs)
        arrays = dict(inputs, lses=masked)
        return {"masked_lses": masked,
                **_merge_expectations(case, "merge_n", arrays, inputs["outputs"][-1], masked[-1])}
    mask = impls.run(impls.HOST, "reference", "mask", case, inputs)
    arrays = dict(inputs, prefix_output=mask["output"], prefix_lse=mask["lse"])
    return {"mask.lse": mask["lse"], "mask.output": mask["output"],
            **_merge_expectations(case, "merge", arrays, inputs["suffix_output"], inputs["suffix_lse"])}


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
    "merge.out": "float64 reference output (fp8: the clamped, scaled value before the cast)",
    "merge.out_bits": "merge.out rounded to the output dtype (nearest even); pass-through rows are the last partial's "
                      "(the suffix's) bits",
    "merge.out_exact": "bool[T, H]: rows of the output that are bit copies (compared bit for bit)",
    "merge.lse": "float64 reference LSE (lse_layout, lse_base)",
    "merge.lse_bits": "merge.lse rounded to f32; pass-through rows are the raw LSE bits of the last partial",
    "merge.lse_exact": "bool in lse_layout: LSE elements that are bit copies (compared bit for bit)",
    "merge.weights": "f64[N, T, H]: the reference weight w_i of each partial (N = 2: prefix, suffix), giving "
                     "mag = sum_i |o_i| * w_i",
}


def _role(key: str) -> str:
    return "expected" if "." in key else "input"


# ---------------------------------------------------------------------------------------------------------
# Export


def _tolerances() -> dict[str, dict[str, float]]:
    from parity.library.compare import TOLERANCES

    return {k: {"rtol": float(v.rtol), "atol": float(v.atol)} for k, v in TOLERANCES.items()}


def export(out_dir: str, selected: list[cases_mod.Case], *, seed: int = 0, argv: list[str] | None = None,
           progress=None) -> dict[str, Any]:
    """Write `<case>.npz` per case and `manifest.json`; returns the manifest."""
    os.makedirs(out_dir, exist_ok=True)
    manifest: dict[str, Any] = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "semantics_version": SEMANTICS_VERSION,
        "spec": SPEC_SECTIONS,
        "generator": {k: v for k, v in impls.collect_env(argv).items()
                      if k in ("versions", "git_commit", "utc_time", "command")},
        "storage": ("numpy .npz (np.savez, uncompressed). Floats are stored as same-width unsigned integers "
                    "holding their bits (little-endian): reinterpret with .view(); bool as uint8; int32 as is."),
        "tolerance_rule": ("exact elements: identical bits (a NaN matches any NaN); other elements: the value "
                           "classes (finite, +inf, -inf, NaN) agree and |got - want| <= atol + rtol * mag in "
                           "float64, with want = merge.out / merge.lse, mag = sum_i |o_i| * w_i over the partials "
                           "with w = merge.weights (divided by output_scale for fp8) for the output and |merge.lse| "
                           "for the LSE; rtol, atol from "
                           "tolerances[output dtype] and tolerances['lse']"),
        "tolerances": _tolerances(),
        "ops": {
            "mask": "mask_empty_context_lse(prefix_lse, query_start_loc, cu_seq_lens, output=prefix_output[..., :D]) "
                    "-> compare with mask.lse, mask.output (exact)",
            "merge": "merge_attn_states(prefix_output=mask.output, prefix_lse=mask.lse, suffix_output[..., :D], "
                     "suffix_lse, options) -> compare with merge.* (mask then merge)",
            "merge_fused": "merge_attn_states(prefix_output[..., :D], prefix_lse, suffix_output[..., :D], suffix_lse, "
                           "query_start_loc=, prefix_cu_seq_lens=cu_seq_lens, options) -> compare with merge.* "
                           "(fused mask, docs/spec.md 4.5)",
            "merge_n": "merge_attn_states_n(outputs[..., :D], masked_lses, options) -> compare with merge.* "
                       "(N-way cases, docs/spec.md 8)",
            "merge_n_fused": "merge_attn_states_n(outputs[..., :D], lses, query_start_loc=, cu_seq_lens=, options) "
                             "-> compare with merge.* (N-way cases, fused mask, docs/spec.md 8.1)",
        },
        "cases": [],
    }
    for n, case in enumerate(selected, 1):
        t0 = time.perf_counter()
        inputs = (cases_mod.make_inputs_n if case.n_way else cases_mod.make_inputs)(case, seed)
        arrays = dict(inputs)
        arrays.update(expected_arrays(case, inputs))
        stored, entries = {}, {}
        for key, value in arrays.items():
            s, dtype_name = to_stored(np.asarray(value))
            stored[key] = s
            entries[key] = {"dtype": dtype_name, "stored_as": s.dtype.name, "shape": list(s.shape),
                            "sha256": sha256(s), "role": _role(key), "what": _DESCRIPTIONS[key]}
        file = f"{case.name}.npz"
        np.savez(os.path.join(out_dir, file), **stored)
        manifest["cases"].append({"name": case.name, "file": file, "params": case_params(case, seed),
                                  "ops": list(impls.ops_of(case)), "arrays": entries})
        if progress is not None:
            print(f"[{n}/{len(selected)}] {case.name} exported ({time.perf_counter() - t0:.1f}s)",
                  file=progress, flush=True)
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")
    return manifest


# ---------------------------------------------------------------------------------------------------------
# Load


def load_manifest(golden_dir: str) -> dict[str, Any]:
    path = os.path.join(golden_dir, MANIFEST)
    if not os.path.exists(path):
        raise GoldenError(f"no {MANIFEST} in {golden_dir!r}: not a folder written by `python -m parity export`")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise GoldenError(f"{path}: format {manifest.get('format')!r} version {manifest.get('format_version')!r}; "
                          f"this reader takes {FORMAT!r} version {FORMAT_VERSION}")
    if manifest.get("semantics_version") != SEMANTICS_VERSION:
        raise GoldenError(f"{path}: semantics version {manifest.get('semantics_version')!r}, this code implements "
                          f"{SEMANTICS_VERSION!r}")
    return manifest


def load_case(golden_dir: str, entry: dict[str, Any]) -> dict[str, np.ndarray]:
    """The value arrays of one case, after checking every array's sha256, dtype and shape."""
    path = os.path.join(golden_dir, entry["file"])
    if not os.path.exists(path):
        raise GoldenError(f"{entry['name']}: missing file {path}")
    out = {}
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
    return out


# ---------------------------------------------------------------------------------------------------------
# Verify


def _operands(case, a: dict[str, np.ndarray], op: str) -> dict[str, np.ndarray]:
    """The numpy arrays `op` runs on (`impls.op_call`): "merge" reads the masked prefix (in a buffer with the
    case's head pad), "merge_n" the masked LSEs."""
    inputs = {k: v for k, v in a.items() if "." not in k}
    if op == "merge":
        masked = np.array(a["prefix_output"], copy=True)
        masked[..., :case.head_dim] = a["mask.output"]
        inputs.update(prefix_output=masked, prefix_lse=a["mask.lse"])
    elif op == "merge_n":
        inputs["lses"] = a["masked_lses"]
    return inputs


PORT_INPUTS = {
    "mask": ("lse", "query_start_loc", "cu_seq_lens", "output"),
    "merge": ("prefix_output", "prefix_lse", "suffix_output", "suffix_lse", "query_start_loc", "output_scale"),
    "merge_fused": ("prefix_output", "prefix_lse", "suffix_output", "suffix_lse", "query_start_loc",
                    "prefix_cu_seq_lens", "output_scale"),
    "merge_n": ("outputs", "lses", "query_start_loc", "output_scale"),
    "merge_n_fused": ("outputs", "lses", "query_start_loc", "cu_seq_lens", "output_scale"),
}
"""The arrays a port's callable receives per op (docs/porting.md): output buffers may be wider than head_dim
(columns past D are padding), the 2-way "merge" gets the masked prefix, "merge_n" the masked LSEs."""


def port_inputs(case, a: dict[str, np.ndarray], op: str) -> dict[str, np.ndarray]:
    """The numpy inputs of `op` under the names of `PORT_INPUTS` (a copy: a port may write them)."""
    ops = _operands(case, a, op)
    named = dict(ops, lse=ops.get("prefix_lse"), output=ops.get("prefix_output"),
                 prefix_cu_seq_lens=ops.get("cu_seq_lens"))
    return {k: np.array(named[k], copy=True) for k in PORT_INPUTS[op] if named.get(k) is not None}


def _result_shapes(case, op: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    T, H, D = case.num_tokens, case.num_heads, case.head_dim
    lse_shape = (H, T) if case.lse_layout == "HT" else (T, H)
    if op == "mask":
        return {"lse": (lse_shape, np.dtype(np.float32)), "output": ((T, H, D), _np_dtype(case.dtype))}
    return {"out": ((T, H, D), _np_dtype(case.out_dtype or case.dtype)), "lse": (lse_shape, np.dtype(np.float32))}


def _as_result(case, op: str, key: str, x) -> np.ndarray:
    """A port's result as the typed array it must be: the right dtype, or the unsigned integers of its bits."""
    shape, dtype = _result_shapes(case, op)[key]
    x = np.asarray(x)
    if x.dtype.kind == "u" and x.dtype.itemsize == dtype.itemsize:
        x = x.view(dtype)
    if x.dtype != dtype or tuple(x.shape) != shape:
        raise GoldenError(f"{op}.{key} must be {dtype.name}{list(shape)} (or its bits as uint{8 * dtype.itemsize}); "
                          f"got {x.dtype.name}{list(x.shape)}")
    return x


class _Runner:
    """Runs one implementation: this project's through `parity.harness.impls` (as `python -m parity check`), a port's
    callable `fn(op, inputs, params) -> dict` (`impl="module:function"` or `"path/to/file.py:function"`), or a
    port's results read from files (`outputs_dir`)."""

    def __init__(self, impl: str | None = None, *, fn=None, outputs_dir: str | None = None):
        self.impl = impl or ("outputs" if outputs_dir else getattr(fn, "__name__", "port"))
        self.fn, self.outputs_dir, self._files = fn, outputs_dir, {}
        if fn is None and outputs_dir is None and impl is not None and ":" in impl:
            self.fn = load_callable(impl)
        self.rt = impls.HOST if impl == "reference" or self.fn or outputs_dir else impls.make_runtime()

    def run(self, case, a: dict, op: str, params: dict | None = None) -> dict[str, Any]:
        if self.fn is not None:
            got = self.fn(op, port_inputs(case, a, op), dict(params or case_params(case, 0)))
            return {k: _as_result(case, op, k, got[k]) for k in _result_shapes(case, op)}
        if self.outputs_dir is not None:
            return self._read(case, op)
        inputs = _operands(case, a, op)
        if self.impl == "reference":
            got = impls.run(self.rt, "reference", op, case, inputs)
            if op != "mask":  # the reference leaves the final rounding to the caller (docs/spec.md 4.6 for fp8)
                got = {"out": got["out"].astype(_np_dtype(case.out_dtype or case.dtype)),
                       "lse": got["lse"].astype(np.float32)}
            return got
        from parity.library import bridge

        t, j = bridge.share_inputs(inputs, self.rt.device)
        return impls.run(self.rt, self.impl, op, case, t if self.impl == "triton" else j)

    def _read(self, case, op: str) -> dict[str, np.ndarray]:
        path = os.path.join(self.outputs_dir, f"{case.name}.npz")
        if case.name not in self._files:
            if not os.path.exists(path):
                raise GoldenError(f"no results file {path} for case {case.name}")
            with np.load(path, allow_pickle=False) as z:
                self._files[case.name] = {k: z[k] for k in z.files}
        f = self._files[case.name]
        missing = [f"{op}.{k}" for k in _result_shapes(case, op) if f"{op}.{k}" not in f]
        if missing:
            raise GoldenError(f"{path} lacks {missing}")
        return {k: _as_result(case, op, k, f[f"{op}.{k}"]) for k in _result_shapes(case, op)}


def save_outputs(out_dir: str, case_name: str, results: dict[str, dict[str, np.ndarray]]) -> str:
    """Write a port's results of one case as `verify --outputs` reads them: `<out_dir>/<case>.npz`, one array
    `<op>.<result>` each, stored as the unsigned integers of its bits (docs/porting.md, "Results files")."""
    os.makedirs(out_dir, exist_ok=True)
    arrays = {f"{op}.{key}": to_stored(np.asarray(x))[0] for op, r in results.items() for key, x in r.items()}
    path = os.path.join(out_dir, f"{case_name}.npz")
    np.savez(path, **arrays)
    return path


def verify_case(entry: dict[str, Any], a: dict[str, np.ndarray], runner: _Runner, tolerances: dict[str, dict]):
    """Runs the ops of one case; returns [(op, {array: Report}, error or None)]."""
    from parity.library import compare

    case = case_from_params(entry["name"], entry["params"])
    out_dtype = case.out_dtype or case.dtype
    loc = dict(query_start_loc=a["query_start_loc"], lse_layout=case.lse_layout, case=case.name,
               seed=entry["params"]["seed"], mode=f"golden-{runner.impl}")
    results = []
    for op in entry.get("ops", OPS):
        reports: dict[str, Any] = {}
        try:
            got = runner.run(case, a, op, entry["params"])
            if op == "mask":
                for key in ("lse", "output"):
                    reports[f"mask.{key}"] = compare.compare_bits(got[key], a[f"mask.{key}"], name=f"mask.{key}",
                                                                  **loc)
            else:
                arrays = _operands(case, a, "merge_n" if case.n_way else "merge")
                mag = expected.magnitude(case, "merge_n" if case.n_way else "merge", arrays, a["merge.weights"])
                out_exact = np.broadcast_to(a["merge.out_exact"][:, :, None], mag.shape)
                for name, g, w, exact, kw in (
                        (f"{op}.out", got["out"], a["merge.out"], out_exact,
                         dict(mag=mag, tol=compare.Tolerance(**tolerances[out_dtype]))),
                        (f"{op}.lse", got["lse"], a["merge.lse"], a["merge.lse_exact"],
                         dict(tol=compare.Tolerance(**tolerances["lse"])))):
                    reports[name] = compare.compare_to_reference(g, w, name=name, exact_mask=exact, **kw, **loc)
            results.append((op, reports, None))
        except Exception as e:  # noqa: BLE001 - report and go on
            results.append((op, reports, f"{type(e).__name__}: {e}"))
    return results


def verify(golden_dir: str, impl=None, *, outputs_dir: str | None = None, name_filter: str | None = None,
           progress=None):
    """Returns (rows, ok): one row per (case, op) with the reports, or the error that stopped it.

    `impl`: "triton", "pallas", "jnp", "reference", "module:function" / "path.py:function", or a callable
    `fn(op, inputs, params) -> dict` (docs/porting.md); or `outputs_dir`: a port's results files.
    """
    manifest = load_manifest(golden_dir)
    entries = [e for e in manifest["cases"] if name_filter is None or name_filter in e["name"]]
    if not entries:
        raise GoldenError(f"no case in {golden_dir!r} matches -k {name_filter!r}")
    runner = _Runner(None, fn=impl, outputs_dir=outputs_dir) if callable(impl) or outputs_dir else _Runner(impl)
    impl = runner.impl
    rows = []
    total = sum(len(e.get("ops", OPS)) for e in entries)
    for entry in entries:
        try:
            a = load_case(golden_dir, entry)
        except GoldenError as e:
            for op in entry.get("ops", OPS):
                rows.append(dict(case=entry["name"], op=op, reports={}, error=str(e), params=entry["params"]))
            continue
        for op, reports, error in verify_case(entry, a, runner, manifest["tolerances"]):
            ok = error is None and bool(reports) and all(r.ok for r in reports.values())
            rows.append(dict(case=entry["name"], op=op, reports=reports, error=error, ok=ok, params=entry["params"]))
            if progress is not None:
                print(f"[{len(rows)}/{total}] {entry['name']} {op} {impl} {'ok' if ok else 'FAIL'}",
                      file=progress, flush=True)
    for r in rows:
        r.setdefault("ok", False)
    return rows, all(r["ok"] for r in rows)


def format_rows(rows, impl: str) -> str:
    head = ("case", "op", "dtype", "D", "exact mismatches", "tolerance failures", "max err/tol", "status")
    table = [head]
    details = []
    for r in rows:
        reps = list(r["reports"].values())
        p = r["params"]
        dt = p["dtype"] if p["out_dtype"] == p["dtype"] else f"{p['dtype']}->{p['out_dtype']}"
        exact = sum(x.n_exact_mismatch if x.kind == "reference" else x.n_diff for x in reps)
        tol = sum(x.n_tol_fail + x.n_class_mismatch for x in reps if x.kind == "reference")
        ratios = [x.max_err_ratio for x in reps if x.kind == "reference" and x.max_err_ratio is not None]
        status = "ok" if r["ok"] else ("ERROR" if r["error"] else "FAIL")
        table.append((r["case"], r["op"], dt, str(p["head_dim"]), str(exact) if reps else "-",
                       str(tol) if any(x.kind == "reference" for x in reps) else "-",
                       f"{max(ratios):.3g}" if ratios else "-", status))
        if r["error"]:
            details.append(f"{r['case']} {r['op']}: error: {r['error']}")
        for x in reps:
            if not x.ok:
                details.append(x.format())
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    lines = []
    for n, row in enumerate(table):
        lines.append("  ".join(c.rjust(w) if 3 <= i <= 6 else c.ljust(w)
                               for i, (c, w) in enumerate(zip(row, widths))).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    ok = all(r["ok"] for r in rows)
    lines.append(f"golden verify --impl {impl}: {sum(r['ok'] for r in rows)}/{len(rows)} ok"
                 + ("" if ok else " -- FAILURE"))
    return "\n".join(lines + details)


# ---------------------------------------------------------------------------------------------------------
# CLI handlers (parity.cli)


def export_main(args) -> int:
    selected = cases_mod.select(args.suite, args.name_filter, kind="all")
    if not selected:
        print(f"error: no case in suite {args.suite!r} matches -k {args.name_filter!r}", file=sys.stderr)
        return 2
    manifest = export(args.dir, selected, seed=args.seed, argv=getattr(args, "argv", None),
                      progress=None if args.quiet else sys.stderr)
    print(f"wrote {len(manifest['cases'])} cases and {MANIFEST} to {args.dir}")
    return 0


def verify_main(args) -> int:
    impl = args.impl or "outputs"
    try:
        rows, ok = verify(args.dir, args.impl, outputs_dir=args.outputs, name_filter=args.name_filter,
                          progress=None if args.quiet else sys.stderr)
    except (GoldenError, LoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_rows(rows, impl))
    if args.json:
        from parity.harness import check

        report = {"schema": "parity-golden-verify/1", "env": impls.collect_env(getattr(args, "argv", None)),
                  "golden_dir": os.path.abspath(args.dir), "impl": impl, "outputs": args.outputs, "ok": ok,
                  "records": [{"case": r["case"], "op": r["op"], "ok": r["ok"], "error": r["error"],
                               "reports": {k: v.to_dict() for k, v in r["reports"].items()}} for r in rows]}
        with open(args.json, "w") as f:
            json.dump(check.jsonable(report), f, indent=1)
            f.write("\n")
    return 0 if ok else 1
