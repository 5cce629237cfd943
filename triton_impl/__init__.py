"""Triton kernels (PyTorch, in place) for the empty-context LSE mask and the attention-state merge.

Semantics: SPEC sections 3-4, defined executably by `parity.reference`.
"""

from triton_impl._common import has_empty_context
from triton_impl.mask import mask_empty_context_lse
from triton_impl.merge import merge_attn_states

__all__ = ["has_empty_context", "mask_empty_context_lse", "merge_attn_states"]
