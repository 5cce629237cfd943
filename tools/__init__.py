"""The maintainers' tools: the GPU run, the launch sweeps, the host-cost and sanitizer drivers, and the published
figures' records. Not part of the installed packages: run them from a checkout, `python -m tools COMMAND ...`
(`python -m tools --help` lists the commands; docs/results.md, "Recording a GPU run")."""
