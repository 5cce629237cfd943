"""JAX Pallas GPU kernels (functional, jit-friendly) for the empty-context LSE mask and the merge.

jax and numpy only. Semantics: SPEC sections 3-4, defined executably by `parity.reference`.
"""

from pallas_impl._common import has_empty_context
from pallas_impl.mask import mask_empty_context_lse
from pallas_impl.merge import merge_attn_states

__all__ = ["has_empty_context", "mask_empty_context_lse", "merge_attn_states"]
