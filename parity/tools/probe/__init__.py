"""`python -m parity probe`: what every attention kernel importable here leaves in the rows that attend to nothing,
and whether this project's merge is safe on it without the mask.

For each backend (`run.all_backends()`: PyTorch SDPA's paths and varlen kernels, the flash-attn and FlashInfer
packages, `jax.nn.dot_product_attention`, JAX's Pallas GPU ops) and each situation of `core.SITUATIONS` (a request
with no KV in a varlen batch, a fully masked row, causal rows with no visible key, padding rows), the probe
reports the LSE's class (+inf, -inf, NaN, finite and which value), base, layout and dtype, and the output rows'
class (zero, NaN, mean of V, unwritten, other), with the data rows checked against float64 attention; then, end
to end, the corrupted rows of a chunked-context prefill merged naively, with this project's merge, and with the
mask then the merge; and one recommendation per backend (safe / needs the mask). A backend that is absent,
refuses the shape or cannot express a situation is listed with the reason.

Modules: `core` (situations, reference, classes; numpy), `torch_backends`, `jax_backends`, `endtoend`, `run`.
"""

from parity.tools.probe.run import all_backends, format_table, recommend, run_isolated, run_probe, write_json

__all__ = ["all_backends", "format_table", "recommend", "run_isolated", "run_probe", "write_json"]
