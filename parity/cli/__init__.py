"""Command line: `python -m parity check|bench|demo|export|verify|cross|probe|loop|example`.

Progress goes to stderr, tables to stdout, machine-readable output only to JSON files. Exit status: 0 success,
1 parity failure, 2 usage error (argparse, or an output path that cannot be written), 3 an optional dependency
missing (one line naming the extra that installs it).

The arguments are parsed first, importing no framework (`--help` is instant), and output paths are checked before
any work. Then, for a command that runs kernels, the run mode is fixed (`parity.harness.impls.configure`) before
anything imports `triton_impl`: without CUDA, Triton kernels run in its interpreter (`TRITON_INTERPRET=1` is read
when the kernels are imported) and Pallas kernels in interpret mode; `XLA_PYTHON_CLIENT_PREALLOCATE=false` lets
torch and JAX share a GPU. `export`, `verify` of a port or of the reference, and `example` need numpy and ml_dtypes
only (the `golden` extra).
Each subcommand is one handler `_<command>(args) -> exit status` (`parity/cli/handlers.py`) and one parser block
in `build_parser` (`parity/cli/parser.py`); the handler holds the command's printing and exit status and calls its module's library functions (run a check and
return records, export, verify, measure...), imported inside the handler, so the others work when one is missing.
"""

from __future__ import annotations

import sys

from parity.cli.codes import EXIT_FAIL, EXIT_MISSING, EXIT_OK, EXIT_USAGE, SUITES
from parity.cli.handlers import check_output_paths
from parity.cli.parser import add_bench_arguments, build_parser


def _cp_ranks(argv: list[str]) -> int:
    """The N of `demo --cp N` (0 otherwise), read before JAX starts (it fixes its CPU device count then)."""
    if argv[:1] != ["demo"]:
        return 0
    for i, a in enumerate(argv):
        value = a.split("=", 1)[1] if a.startswith("--cp=") else (argv[i + 1] if a == "--cp" and i + 1 < len(argv) else None)
        if value is not None:
            return int(value) if value.isdigit() else 0
    return 0


# Commands that run this project's kernels or the user's framework code: the run mode is configured first.
FRAMEWORK_COMMANDS = ("check", "bench", "demo", "probe", "loop", "cross")
# The extra that installs each optional dependency (pyproject.toml), for the one-line error of a missing one.
EXTRAS = {"torch": "parity", "triton": "parity", "jax": "parity", "jaxlib": "parity", "matplotlib": "parity",
          "ml_dtypes": "golden"}


def _needs_frameworks(args) -> bool:
    if args.command == "verify":  # a port or the reference needs no framework
        from parity.harness.impls import KERNEL_IMPLS

        return args.impl in KERNEL_IMPLS
    return args.command in FRAMEWORK_COMMANDS


def missing_extra(error: ModuleNotFoundError, command: str) -> str | None:
    """The one-line message for an optional dependency `command` could not import, or None for any other module."""
    name = (error.name or "").split(".")[0]
    if name not in EXTRAS:
        return None
    extra = EXTRAS[name] if command in ("export", "verify", "example") else "parity"
    return (f"error: `python -m parity {command}` needs {name}, which is not installed: "
            f'pip install "mla-lse-merge[{extra}]"')


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (argparse usage errors give 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: 2 for a usage error, 0 after --help
        return int(e.code or 0) if not isinstance(e.code, str) else EXIT_USAGE
    args.argv = argv
    problem = check_output_paths(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if _needs_frameworks(args):
            from parity.harness import impls
            from parity.harness.impls.runtime import add_xla_flags

            cp = _cp_ranks(argv)
            if cp and "jax" not in sys.modules:  # the CP demo's JAX side wants N devices: N CPU devices without a GPU
                add_xla_flags(f"--xla_force_host_platform_device_count={cp}")
            impls.configure()
            impls.set_pallas_backend(getattr(args, "pallas_backend", None))
        return int(args.func(args))
    except ModuleNotFoundError as e:
        message = missing_extra(e, args.command)
        if message is None:
            raise
        print(message, file=sys.stderr)
        return EXIT_MISSING


__all__ = ["EXIT_FAIL", "EXIT_MISSING", "EXIT_OK", "EXIT_USAGE", "SUITES", "add_bench_arguments", "build_parser", "main"]
