"""Test helper: a merge's results against the float64 reference of the same operands (shared by the Triton,
Pallas and Mosaic GPU merge tests)."""

import numpy as np

from parity.library import compare
from parity.harness import expected, impls


def assert_merge_matches_reference(case, op, arrays, out, lse=None, *, mode=None, name=None, scales=None):
    """`out` (and `lse` unless None) of merge op `op` ("merge", "merge_fused", "merge_n", "merge_n_fused") on
    `arrays`: exact elements bit for bit, the rest within `compare.TOLERANCES` of the terms' magnitude. A per-group
    FP8 case (docs/spec.md 4.7) takes its `scales` too, and its magnitude in each group's units, as `check`."""
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
    compare.assert_matches_reference(out, ref["out"], exact=np.broadcast_to(out_exact[..., None], mag.shape),
                                     mag=mag, name=f"{name}.out", **loc)
    if lse is not None:
        compare.assert_matches_reference(lse, ref["lse"], exact=lse_exact, name=f"{name}.lse",
                                         layout=case.lse_layout, **loc)
