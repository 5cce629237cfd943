"""The parity library for anyone's PyTorch <-> JAX kernel pair (docs/parity-library.md): the zero-copy DLPack
bridge, the comparison engine, `cross_check` and the bit-parity recipe. It knows nothing of this project's ops:
nothing here imports `parity.harness` or `parity.tools`."""
