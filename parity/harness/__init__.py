"""The harness of this project's ops: the float64 reference (docs/spec.md), the workloads, the one table of how
to run each implementation of each op (`impls`), expected values, the environment record (`provenance`), the
parity check and the golden vectors: library functions that return records; the commands are parity/cli/'s. It
builds on `parity.library` and never imports `parity.tools` or `parity.cli`."""
