"""Triton kernels (PyTorch, in place) for the empty-context LSE mask and the attention-state merges.

Semantics: docs/spec.md sections 3, 4, 8 and 9, defined executably by `parity.harness.reference`.
"""

from triton_impl._checks import has_empty_context
from triton_impl.cp_merge import cp_merge_attn_states
from triton_impl.mask import mask_empty_context_lse
from triton_impl.merge import merge_attn_states
from triton_impl.merge_n import merge_attn_states_n
from triton_impl import ops  # noqa: F401,E402 - registers torch.ops.mla_lse_merge.* (torch.compile, CUDA graphs)

__all__ = ["cp_merge_attn_states", "has_empty_context", "mask_empty_context_lse", "merge_attn_states",
           "merge_attn_states_n"]
