"""The two worked pairs of docs/parity-library.md written for the default error model, run end to end: the ragged
log-sum-exp (`lse_*.py`) and the softmax-weighted sum (`wsum_*.py`), faithful in every dtype with the default
bound and special values, then each planted variant; one line per run, then the JSON of every report.

    python -m parity.examples.error_model_pairs [--json OUT.json]

On a GPU the faithful pairs must be bit-identical (0 differing bits) and pass; the planted FMA and reordered sums
must show up as located bit differences within the reference bound; the off-by-one, wrong-base and NaN-leak
kernels must fail against the reference. Under the CPU interpreters the bits are reported, not required.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import parity  # noqa: E402
from parity.examples import lse_pallas  # noqa: E402
from parity.examples import lse_reference  # noqa: E402
from parity.examples import lse_triton  # noqa: E402
from parity.examples import wsum_pallas  # noqa: E402
from parity.examples import wsum_reference  # noqa: E402
from parity.examples import wsum_triton  # noqa: E402

LSE = dict(query_lens=(70, 0, 333, 1, 190, 64), padding=21, H=8)
WSUM = dict(T=203, N=40, D=128)


def runs(gpu: bool):
    for dtype in ("float32", "bfloat16", "float16"):
        yield (f"lse {dtype}", lse_triton.ragged_lse, lse_pallas.ragged_lse, lse_reference.ragged_lse,
               lse_reference.make_inputs(seed=3, dtype=dtype, **LSE), {"lse": ("req", "head")}, True)
        yield (f"wsum {dtype}", wsum_triton.softmax_wsum, wsum_pallas.softmax_wsum, wsum_reference.softmax_wsum,
               wsum_reference.make_inputs(seed=3, dtype=dtype, **WSUM), {"out": ("row", "dim")}, True)
    for bug in ("reverse", "off_by_one", "base2"):
        yield (f"lse float32 {bug}", functools.partial(lse_triton.ragged_lse, **{bug: True}), lse_pallas.ragged_lse,
               lse_reference.ragged_lse, lse_reference.make_inputs(seed=3, **LSE), {"lse": ("req", "head")}, False)
    for bug in ("fma", "reverse", "nan_leak") if gpu else ("reverse", "nan_leak"):
        yield (f"wsum float32 {bug}", functools.partial(wsum_triton.softmax_wsum, **{bug: True}),
               wsum_pallas.softmax_wsum, wsum_reference.softmax_wsum,
               wsum_reference.make_inputs(seed=3, poison=bug == "nan_leak", **WSUM), {"out": ("row", "dim")}, False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    reports = {}
    for name, torch_fn, jax_fn, ref, inputs, outputs, special in runs(gpu):
        report = parity.cross_check(torch_fn, jax_fn, inputs, reference=ref, outputs=outputs, bitwise=gpu,
                                    special_values=special, name=name)
        out = next(iter(outputs))
        kinds = report[out]
        print(f"{name}: {'ok' if report.ok else 'FAIL'}; torch-vs-jax {kinds['torch_vs_jax'].n_diff} differ "
              f"(max {kinds['torch_vs_jax'].max_ulp} ulp); vs reference: torch "
              f"{kinds['torch_vs_reference'].n_diff} fail (err/bound {kinds['torch_vs_reference'].max_err_ratio}), "
              f"jax {kinds['jax_vs_reference'].n_diff} fail (err/bound {kinds['jax_vs_reference'].max_err_ratio})"
              + (f"; special values: {kinds['special_torch_vs_jax'].n_diff} class mismatches" if special else ""),
              flush=True)
        reports[name] = json.loads(report.to_json())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
