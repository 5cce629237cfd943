"""Golden vectors (docs/golden.md): this project's cases with their float64-reference expectations, for ports.

Modules: `store` (the format: raw-bit storage, the manifest, case parameters, loading with hash checks, and
the docs' numpy-only rule), `writer` (`export`: the `.npz` files and `manifest.json`), `verifier` (`verify`:
one implementation, a port's callable or a port's results files, judged by `parity.library`'s comparison
engine). `python -m parity export` / `verify` are parity/cli/'s.
"""

from parity.harness.golden.store import (FORMAT, FORMAT_VERSION, MANIFEST, OPS, SEMANTICS_VERSION, SPEC_SECTIONS,
                                         GoldenError, case_from_params, case_params, decode_float64, from_stored,
                                         load_case, load_manifest, numpy_exact_mismatches, numpy_tolerance_failures,
                                         sha256, to_stored)
from parity.harness.golden.verifier import (PORT_INPUTS, Runner, build_report, format_rows, port_inputs,
                                            save_outputs, verify, verify_case)
from parity.harness.golden.writer import expected_arrays, export

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "OPS", "PORT_INPUTS", "SEMANTICS_VERSION", "SPEC_SECTIONS",
           "GoldenError", "Runner", "build_report", "case_from_params", "case_params", "decode_float64",
           "expected_arrays", "export", "format_rows", "from_stored", "load_case", "load_manifest",
           "numpy_exact_mismatches", "numpy_tolerance_failures", "port_inputs", "save_outputs", "sha256",
           "to_stored", "verify", "verify_case"]
