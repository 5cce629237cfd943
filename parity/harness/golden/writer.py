"""`export`: per case of a suite, `<case>.npz` with the inputs and the expected results, and one `manifest.json`
(docs/golden.md). Expected results come from the float64 reference (`parity.harness.reference`, through
`parity.harness.impls` and `parity.harness.expected`), never from the kernels."""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

from parity.harness import cases as cases_mod
from parity.harness import expected, impls, provenance, reference
from parity.harness.golden.store import (_DESCRIPTIONS, FORMAT, FORMAT_VERSION, MANIFEST, SEMANTICS_VERSION,
                                         SPEC_SECTIONS, _np_dtype, _role, _tolerances, case_params, sha256,
                                         to_stored)


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
    if case.nvfp4:  # docs/spec.md 4.8: the e2m1 values (f32) of the reference's codes; out holds the quotients
        out_bits = reference.e2m1_values(ref["out"])
    else:
        out_bits = ref["out"].astype(_np_dtype(case.out_dtype or case.dtype))
    lse_bits = ref["lse"].astype(np.float32)
    ptwc = case.prefill_tokens_with_context
    if ptwc is not None:  # docs/spec.md 4.4, 8.4: bit copies (float64 cannot carry NaN payloads)
        if case.out_dtype is None:
            out_bits[ptwc:] = last_output[ptwc:, :, :case.head_dim]
        impls.token_slice(lse_bits, case.lse_layout, ptwc, case.num_tokens)[...] = \
            impls.token_slice(last_lse, case.lse_layout, ptwc, case.num_tokens)
    scales = {"merge.scales": ref["scales"]} if case.group_size or case.nvfp4 else {}  # docs/spec.md 4.7, 4.8
    return {"merge.out": ref["out"], "merge.out_bits": out_bits, "merge.out_exact": out_exact,
            "merge.lse": ref["lse"], "merge.lse_bits": lse_bits, "merge.lse_exact": lse_exact, "merge.weights": w,
            **scales}


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



# ---------------------------------------------------------------------------------------------------------
# Export


def export(out_dir: str, selected: list[cases_mod.Case], *, seed: int = 0, argv: list[str] | None = None,
           progress=None) -> dict[str, Any]:
    """Write `<case>.npz` per case and `manifest.json`; returns the manifest."""
    os.makedirs(out_dir, exist_ok=True)
    manifest: dict[str, Any] = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "semantics_version": SEMANTICS_VERSION,
        "spec": SPEC_SECTIONS,
        "generator": {k: v for k, v in provenance.collect_env(argv, frameworks=False).items()
                      if k in ("versions", "git_commit", "source", "utc_time", "command")},
        "storage": ("numpy .npz (np.savez, uncompressed). Floats are stored as same-width unsigned integers "
                    "holding their bits (little-endian): reinterpret with .view(); bool as uint8; int32 as is."),
        "tolerance_rule": ("exact elements: identical bits (a NaN matches any NaN); other elements: the value "
                           "classes (finite, +inf, -inf, NaN) agree and |got - want| <= atol + rtol * mag in "
                           "float64, with want = merge.out / merge.lse, mag = sum_i |o_i| * w_i over the partials "
                           "with w = merge.weights (divided by output_scale for fp8, by each group's scale for "
                           "per-group FP8; for NVFP4 times output_scale / the block's scale, its codes compared as "
                           "values times their block scale / merge.scales, the scales within "
                           "tolerances['nvfp4_block_scale']) for the output and |merge.lse| for the LSE; rtol, atol "
                           "from tolerances[output dtype] and tolerances['lse']"),
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
