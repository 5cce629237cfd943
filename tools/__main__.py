"""`python -m tools COMMAND [ARGS ...]`: one entry point for the maintainers' tools (run from the repository root).

Each command runs one module of this package (or one of its shell drivers) with ARGS; `python -m tools COMMAND
--help` prints the command's own options.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

# command: (module or shell script, what it does)
COMMANDS = {
    "gpu-run": ("gpu_run.sh", "one GPU run: PLAN=tests|bench|more|mosaic|mosaic_speed|mosaic_candidates|verify|fp8|"
                              "verify_tests|all"),
    "check-shards": ("check_shards.sh", "`parity check --suite full` in CHECK_SHARDS parallel processes"),
    "tune": ("tune", "the tile and launch sweeps of the merges and the mask (a GPU)"),
    "wide-n": ("wide_n", "the N-way merge's first call and bandwidth at large N (a GPU)"),
    "mosaic-cpu": ("mosaic_cpu.sh", "the Mosaic GPU tests on a CPU: jax 0.11 in a Debian trixie root (root, network)"),
    "mosaic-speed": ("mosaic_speed", "the Mosaic GPU kernels beside the Pallas Triton backend's (a GPU)"),
    "mosaic-profile": ("mosaic_profile", "Nsight Compute on one merge, Mosaic GPU beside the Triton backend (a GPU)"),
    "mask-floor": ("mask_floor", "the mask's candidates beside `fill_` and upstream's design (a GPU)"),
    "group-fp8-speed": ("group_fp8_speed", "the merges with per-group FP8 or NVFP4 fused, beside bf16 and unfused"),
    "host-cost": ("host_cost", "per-call host cost of every Triton entry point"),
    "torch-path-speed": ("torch_path_speed", "triton_impl's torch path on a CPU beside the interpreter and torch.add"),
    "host-cost-jax": ("host_cost_jax", "per-call host cost of the pallas_impl entry points"),
    "sanitize-triton": ("sanitize_triton", "every Triton entry point, for compute-sanitizer"),
    "sanitize-mosaic": ("sanitize_mosaic", "the Mosaic GPU kernels, for compute-sanitizer"),
    "results": ("results", "check or render the tables of README.md and docs/results.md from the records"),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [__doc__.strip(), "", "commands:"]
    lines += [f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, args = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    target = COMMANDS[name][0]
    if target.endswith(".sh"):
        return subprocess.call(["bash", os.path.join(HERE, target), *args])
    sys.argv = [f"python -m tools {name}", *args]
    try:
        runpy.run_module(f"tools.{target}", run_name="__main__", alter_sys=True)
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
