"""Tools on top of the harness: benchmarks (`bench`), the demos, the chunked-prefill planner with its attention
backends, and spawned `torch.distributed` ranks. Never imports `parity.cli`, whose commands call them."""
