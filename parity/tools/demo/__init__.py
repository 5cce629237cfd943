"""End-to-end demo: the MLA chunked-context prefill corruption (docs/spec.md 1) and its fix, in both frameworks.

A prefill batch with cached context is attended chunk by chunk (`parity.tools.chunked_prefill`), the chunks
are merged, then merged with the causal attention over the new tokens, and the result is compared
with monolithic float64 attention. Each framework runs three paths over the same attention partials:

- `no_mask`: upstream before the fix, merge only. Rows of a request whose context ran out in a chunk
  are merged as if they were data.
- `mask_then_merge`: `mask_empty_context_lse(..., output=...)` on every chunk that has an empty row
  (the host guard `has_empty`), then `merge_attn_states`.
- `fused`: `merge_attn_states(..., query_start_loc=, prefix_cu_seq_lens=)`, one launch per merge. The
  fused mask reads the *prefix* operand's offsets, and the operand that can be empty is the new chunk,
  so this path passes the new chunk as the prefix and the running state as the suffix (the merge is
  symmetric in its two partials, docs/spec.md 4.3). A request empty in chunk 0 has no context at all; its
  running state stays unmasked and the final merge neutralises it (fused mask over the whole-context
  offsets, plus `prefill_tokens_with_context`).

Each is run for every backend behaviour on empty rows (`EMPTY_BEHAVIORS`). Only a *finite* LSE
breaks the unfixed path: the merge reads -inf (FA3) as empty and normalises +inf (FA2) to -inf
(docs/spec.md 4.1), so those rows stay clean even without the mask. The table says so rather than hiding it.

Modules: `modelled` (the batch and the modelled backends), `real` (real attention kernels), `chain` (the paths'
masks and merges, through `parity.harness.impls`), `rows` (the comparison with the reference, the verdict, the
table). `run_demo` runs one; `format_demo_table` renders its rows; the command is parity/cli/'s.
"""

from __future__ import annotations

from parity.tools.chunked_prefill import REAL_BACKENDS, real_backend
from parity.tools.demo.chain import (FIXED_PATHS, NAIVE_PATHS, PATHS, combine, default_torch_device, host_f32,
                                     naive_merge)
from parity.tools.demo.modelled import SIZES, demo_batch, demo_config, run_batch
from parity.tools.demo.real import run_real_batch
from parity.tools.demo.rows import (CORRUPTING_BEHAVIOR, FRAMEWORKS, TOLERANCE, TOLERANCE_BF16, compare_rows,
                                    format_demo_table, judge_row, verdict)

BACKENDS = ("modelled", *REAL_BACKENDS)

__all__ = ["BACKENDS", "CORRUPTING_BEHAVIOR", "FIXED_PATHS", "FRAMEWORKS", "NAIVE_PATHS", "PATHS", "SIZES", "TOLERANCE",
           "TOLERANCE_BF16", "combine", "compare_rows", "default_torch_device", "demo_batch", "demo_config",
           "format_demo_table", "host_f32", "judge_row", "naive_merge", "run_batch", "run_demo", "run_real_batch",
           "verdict"]


def run_demo(*, framework: str = "both", device=None, size: str = "default", seed: int = 0,
             backend: str = "modelled") -> tuple[list[dict], bool]:
    """Reproduces the chunked-context prefill corruption and its fix.

    Args:
        framework: "both", "torch" (Triton kernels) or "jax" (Pallas kernels).
        device: torch device string; None picks "cuda" when available, else "cpu" (Triton then runs in
            its interpreter). The JAX side uses JAX's default device.
        size: "default" (small, for CPU interpreters), "large" (64 requests, thousands of tokens) or "real" (40
            requests, a request without context among them; `demo_config`).
        seed: data seed (and, for "large" and "real", the length draw).
        backend: "modelled" (every behaviour of `EMPTY_BEHAVIORS`) or a real attention kernel of
            `REAL_BACKENDS` ("torch-flash", "jax-cudnn": GPU; "jax-xla": any device), whose partials both
            frameworks merge (`run_real_batch`): the table adds the naive-merge paths and what the kernel left in
            empty rows.

    Returns:
        (rows, ok). One row per (framework, empty_behavior, path): rows_corrupted / rows_total,
        requests_corrupted, max_abs_err, any_nan, passthrough_exact (rows of requests without context
        are bit copies of the new-token partial; None if there are none), expected ("clean",
        "corrupted" or None for information only), ok, and the batch's shape. `ok` holds when every
        fixed path is clean for every behaviour and the unfixed path is corrupted for the finite-LSE
        behaviour.

    Raises:
        ValueError: unknown framework, size or backend.
        RuntimeError: a GPU-only backend without a GPU.
        ImportError: the chosen framework's kernels cannot be imported.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {SIZES}, got {size!r}")
    if backend != "modelled":
        real_backend(backend)  # an unknown name is refused before any work
        return run_real_batch(demo_batch(size, seed), backend, framework=framework, device=device)
    return run_batch(demo_batch(size, seed), framework=framework, device=device)
