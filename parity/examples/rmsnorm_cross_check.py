"""The worked example of docs/parity-library.md, run end to end: the ragged RMSNorm pair (`rmsnorm_triton.py`,
`rmsnorm_pallas.py`) cross-checked against its float64 reference in every dtype, then the same pair with an
FMA-contracted Triton launch (`fma=True`): its reports, printed.

    python -m parity.examples.rmsnorm_cross_check [--json OUT.json]

On a GPU the pair must be bit-identical in every dtype and the planted FMA must show up as located bit differences
within the reference tolerance; under the CPU interpreters the two frameworks differ by a few ULP (docs/spec.md 5),
so there the reports are compared with the reference only, and fp8 is left out (Triton's interpreter truncates
f32 -> fp8 instead of rounding it: docs/design.md, "Interpreter casts").
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ml_dtypes  # noqa: E402

import parity  # noqa: E402
from parity.examples import rmsnorm_pallas  # noqa: E402
from parity.examples import rmsnorm_reference  # noqa: E402
from parity.examples import rmsnorm_triton  # noqa: E402

OUTPUTS = {"out": ("token", "dim"), "rstd": ("token",)}
DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gpu = torch.cuda.is_available()
    reports = {}
    dtypes = DTYPES if gpu else tuple(d for d in DTYPES if not d.startswith("float8"))
    for name, dtype, fma in [(d, d, False) for d in dtypes] + [("float32, FMA planted", "float32", True)]:
        dt = getattr(ml_dtypes, dtype) if dtype.startswith("float8") else dtype
        inputs = rmsnorm_reference.make_inputs(seed=2, query_lens=(70, 0, 333, 1, 190, 64), padding=21, D=128,
                                               dtype=dt)
        report = parity.cross_check(functools.partial(rmsnorm_triton.rmsnorm, fma=fma), rmsnorm_pallas.rmsnorm,
                                    inputs, reference=rmsnorm_reference.rmsnorm, outputs=OUTPUTS,
                                    ragged="query_start_loc", bitwise=gpu,
                                    tolerance=rmsnorm_reference.tolerance(128, dt), name=f"rmsnorm {name}")
        print(report, "\n", flush=True)
        reports[name] = json.loads(report.to_json())
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
