"""`torch.library` registrations of the Triton entry points: `torch.ops.mla_lse_merge.<name>`.

For `torch.compile` (the ops are opaque to it and declare the tensors they write, so functionalisation and
re-inplacing see the writes), CUDA-graph capture and vLLM-style call sites that dispatch through `torch.ops`.
Each op is the plain function of the same name (same arguments, same validation, same kernel); the plain
functions stay the documented API because they skip the dispatcher's per-call cost (docs/design.md,
"torch.library and in-place safety"). Registered with `Library.define` + `impl`, cheaper per call than a
`torch.library.custom_op` (same section), with fake implementations for tracing. The context-parallel
combine is not an op: its process-group argument has no schema type.
"""

from __future__ import annotations

import torch

from triton_impl.mask import mask_empty_context_lse
from triton_impl.merge import merge_attn_states
from triton_impl.merge_n import merge_attn_states_n

NAMESPACE = "mla_lse_merge"

_E = "2.718281828459045"  # math.e, exactly (repr)
SCHEMAS = {
    "mask_empty_context_lse": (
        mask_empty_context_lse,
        "(Tensor(a!) lse, Tensor query_start_loc, Tensor cu_seq_lens, Tensor(b!)? output=None, *, "
        "bool? has_empty=None, str lse_layout=\"HT\", str? implementation=None, bool validate=False) -> ()"),
    "merge_attn_states": (
        merge_attn_states,
        "(Tensor(a!) output, Tensor prefix_output, Tensor prefix_lse, Tensor suffix_output, Tensor suffix_lse, "
        "Tensor(b!)? output_lse=None, int? prefill_tokens_with_context=None, Tensor? output_scale=None, *, "
        f"Tensor? query_start_loc=None, Tensor? prefix_cu_seq_lens=None, str lse_layout=\"HT\", float lse_base={_E}, "
        "int? group_size=None, Tensor(c!)? output_group_scale=None, bool scale_ue8m0=False, "
        "Tensor(d!)? output_block_scale=None, str scale_layout=\"row\", str? implementation=None, "
        "bool validate=False) -> ()"),
    "merge_attn_states_n": (
        merge_attn_states_n,
        "(Tensor(a!) output, Tensor outputs, Tensor lses, Tensor(b!)? output_lse=None, "
        "int? prefill_tokens_with_context=None, Tensor? output_scale=None, *, Tensor? query_start_loc=None, "
        f"Tensor? cu_seq_lens=None, str lse_layout=\"HT\", float lse_base={_E}, int? group_size=None, "
        "Tensor(c!)? output_group_scale=None, bool scale_ue8m0=False, Tensor(d!)? output_block_scale=None, "
        "str scale_layout=\"row\", str? implementation=None, bool validate=False) -> ()"),
}

_LIB = torch.library.Library(NAMESPACE, "DEF")


def _fake(*args, **kwargs) -> None:
    """Under fake tensors and tracing: the ops return nothing (their writes are declared in the schema)."""
    return None


for _name, (_fn, _schema) in SCHEMAS.items():
    _LIB.define(_name + _schema)
    _LIB.impl(_name, _fn, "CompositeExplicitAutograd")
    torch.library.register_fake(f"{NAMESPACE}::{_name}", _fake, lib=_LIB)
