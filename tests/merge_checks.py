"""Test helper: a merge's results against the float64 reference of the same operands (shared by the Triton,
Pallas and Mosaic GPU merge tests)."""

import numpy as np

from parity.library import compare
from parity.harness import expected, impls


def assert_merge_matches_reference(case, op, arrays, out, lse=None, *, mode=None, name=None):
    """`out` (and `lse` unless None) of merge op `op` ("merge", "merge_fused", "merge_n", "merge_n_fused") on
    `arrays`: exact elements bit for bit, the rest within `compare.TOLERANCES` of the terms' magnitude."""
    name = name or op
    ref = impls.run(impls.HOST, "reference", op, case, arrays)
    w = expected.merge_weights(case, op, arrays)
    mag = expected.magnitude(case, op, arrays, w)
    out_exact, lse_exact = expected.exact_masks(case, w)
    loc = dict(case=case, mode=mode, query_start_loc=arrays["query_start_loc"])
    compare.assert_matches_reference(out, ref["out"], exact=np.broadcast_to(out_exact[..., None], mag.shape),
                                     mag=mag, name=f"{name}.out", **loc)
    if lse is not None:
        compare.assert_matches_reference(lse, ref["lse"], exact=lse_exact, name=f"{name}.lse",
                                         layout=case.lse_layout, **loc)
