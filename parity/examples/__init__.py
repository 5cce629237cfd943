"""Worked examples, shipped with the package so that an install has them (docs/porting.md, docs/parity-library.md).

- `numpy_port`: the mask and the merges ported to plain numpy in f32 (numpy and ml_dtypes only), the porting guide's
  worked example: `python -m parity verify golden --impl parity.examples.numpy_port:port`;
- `rmsnorm_*`, `lse_*`, `wsum_*`: kernel pairs in Triton (PyTorch) and Pallas (JAX) with their float64 references,
  for `parity.cross_check`; `rmsnorm_cross_check` and `error_model_pairs` run them.

`python -m parity example NAME` prints one (`python -m parity example numpy_port > my_port.py` starts a port);
`python -m parity example --list` lists them. Importing this package imports no framework: each module imports
its own.
"""
