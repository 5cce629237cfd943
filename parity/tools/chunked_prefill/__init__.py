"""MLA chunked-context prefill, modelled end to end (docs/spec.md 1; docs/design.md, "The demo on real attention
kernels").

A batch of prefill requests, each with `context_lens[r]` cached KV tokens and `query_lens[r]` new tokens, is
attended in two parts: the cached context in workspace-sized chunks, then the new tokens causally; the partial
results are merged with `merge_attn_states`. Four modules, one job each:

- `planner`: the chunk plan (`plan_chunks`, `ChunkPlan`), `prefill_tokens_with_context`, the chunk gather and the
  context-parallel placement (`cp_shard`); numpy only.
- `attention`: the modelled backends (`attention_torch`, `attention_jax`), whose rows with no KV hold what
  `EMPTY_BEHAVIORS` says.
- `kernels`: real attention kernels (`REAL_BACKENDS`: FlashAttention-2 varlen through torch, cuDNN and XLA through
  `jax.nn.dot_product_attention`) and `empty_row_classes`, what they leave in empty rows.
- `reference`: batches (`PrefillBatch`, `make_batch`) and `reference_prefill`, monolithic float64 attention.

The names below are re-exported, so `from parity.tools.chunked_prefill import plan_chunks` keeps working.
"""

from parity.tools.chunked_prefill.attention import (EMPTY_BEHAVIORS, EmptyBehavior, attention_jax, attention_torch,
                                                    bucket_size)
from parity.tools.chunked_prefill.kernels import (REAL_BACKENDS, RealBackend, attention_jax_dpa, attention_real,
                                                  attention_torch_flash, empty_row_classes, real_backend)
from parity.tools.chunked_prefill.planner import (ChunkPlan, chunk_gather_index, cp_shard, plan_chunks,
                                                  prefill_tokens_with_context)
from parity.tools.chunked_prefill.reference import PrefillBatch, make_batch, reference_prefill, rounded

__all__ = ["rounded", "EMPTY_BEHAVIORS", "REAL_BACKENDS", "ChunkPlan", "EmptyBehavior", "PrefillBatch", "RealBackend",
           "attention_jax", "attention_jax_dpa", "attention_real", "attention_torch", "attention_torch_flash",
           "bucket_size", "chunk_gather_index", "cp_shard", "empty_row_classes", "make_batch", "plan_chunks",
           "prefill_tokens_with_context", "real_backend", "reference_prefill"]
