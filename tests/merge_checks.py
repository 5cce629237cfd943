"""Test helper: a merge's results against the float64 reference of the same operands (shared by the Triton,
Pallas and Mosaic GPU merge tests)."""

import numpy as np

from parity.library import compare
from parity.harness import expected, impls


def assert_merge_matches_reference(case, op, arrays, out, lse=None, *, mode=None, name=None, scales=None):
    """`out` (and `lse` unless None) of merge op `op` ("merge", "merge_fused", "merge_n", "merge_n_fused") on
    `arrays`: exact elements bit for bit, the rest within `compare.TOLERANCES` of the terms' magnitude. A per-group
    FP8 case (docs/spec.md 4.7) takes its `scales` too, and its magnitude in each group's units, as `check`; an
    NVFP4 case (4.8) its block scales, its codes' values compared as `check` compares them."""
    name = name or op
    ref = impls.run(impls.HOST, "reference", op, case, arrays)
    w = expected.merge_weights(case, op, arrays)
    mag = expected.magnitude(case, op, arrays, w)
    out_exact, lse_exact = expected.exact_masks(case, w)
    loc = dict(case=case, mode=mode, query_start_loc=arrays["query_start_loc"])
    if case.group_size:
        assert scales is not None, f"{name}: a per-group FP8 case returns its scales"
        T, H, D = mag.shape
        mag = (mag.reshape(T, -1, case.group_size) / ref["scales"][..., None]).reshape(T, H, D)
        compare.assert_matches_reference(scales, ref["scales"], name=f"{name}.scales", tol="float32", **loc)
    tol = None
    if case.nvfp4:  # docs/spec.md 4.8: the codes' values in the reference's block units, the e4m3 block scales
        assert scales is not None, f"{name}: an NVFP4 case returns its block scales"
        mag = expected.nvfp4_units(mag, ref["scales"], arrays["output_scale"])
        out = expected.nvfp4_in_reference_units(out, scales, ref["scales"])
        compare.assert_matches_reference(scales, ref["scales"], name=f"{name}.scales", tol="nvfp4_block_scale",
                                         **loc)
        tol = "float4_e2m1fn"
    compare.assert_matches_reference(out, ref["out"], exact=np.broadcast_to(out_exact[..., None], mag.shape),
                                     mag=mag, name=f"{name}.out", tol=tol, **loc)
    if lse is not None:
        compare.assert_matches_reference(lse, ref["lse"], exact=lse_exact, name=f"{name}.lse",
                                         layout=case.lse_layout, **loc)
