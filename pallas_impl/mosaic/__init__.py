"""Mosaic GPU versions of the Pallas kernels (`backend="mosaic_gpu"`, jax >= 0.11; experimental).

Selected through the public functions of `pallas_impl` (`backend=`), not imported directly.
"""
