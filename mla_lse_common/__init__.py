"""What the two kernel packages share that needs no tensor library: constants, the launch tables with the tile
and grid arithmetic over them, and the checks of shapes, options and host values.

numpy only (no torch, jax or triton): `triton_impl` (torch) and `pallas_impl` (jax) both import it, and it ships
in the same distribution, so a JAX user installs `pallas_impl` without torch and a torch user `triton_impl`
without jax.

- `constants`: the numbers of the semantics (ln 2, log2 e, the fp8 limit, LSE layouts, the N-way loops' unrolling).
- `tiles`: the launch tables (the tuning knobs, one place: `tiles.set_knobs`), tiles and grids.
- `checks`: option, shape and host-value checks with the messages both packages raise.
"""
