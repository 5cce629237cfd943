"""JAX Pallas GPU kernels (functional, jit-friendly) for the empty-context LSE mask and the merges.

jax and numpy only. Semantics: docs/spec.md sections 3, 4, 8 and 9, defined executably by `parity.harness.reference`.
"""

from pallas_impl._checks import has_empty_context
from pallas_impl.cp_merge import cp_merge_attn_states
from pallas_impl.mask import mask_empty_context_lse
from pallas_impl.merge import merge_attn_states
from pallas_impl.merge_n import merge_attn_states_n

__all__ = ["cp_merge_attn_states", "has_empty_context", "mask_empty_context_lse", "merge_attn_states",
           "merge_attn_states_n"]
