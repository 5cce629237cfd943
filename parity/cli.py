"""Command line: `python -m parity check|bench|demo|export|verify|cross`.

Progress goes to stderr, tables to stdout, machine-readable output only to JSON files. Exit status: 0 success,
1 parity failure, 2 usage error (argparse).

The run mode is fixed here (`parity.harness.impls.configure`), before anything imports `triton_impl`: without CUDA,
Triton kernels run in its interpreter (`TRITON_INTERPRET=1` is read when the kernels are imported) and Pallas
kernels in interpret mode; `XLA_PYTHON_CLIENT_PREALLOCATE=false` lets torch and JAX share a GPU.
Each subcommand imports its module inside its handler, so the others work when one is missing.
"""

from __future__ import annotations

import argparse
import os
import sys

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
SUITES = ("ci", "default", "full", "seed")


def _check(args) -> int:
    from parity.harness import check

    return check.main(args)


def _export(args) -> int:
    from parity.harness import golden

    return golden.export_main(args)


def _verify(args) -> int:
    from parity.harness import golden

    return golden.verify_main(args)


def _cross(args) -> int:
    """`python -m parity cross`: 0 ok, 1 parity failure, 2 usage error."""
    from parity.library import loading
    from parity.library.crosscheck import cross_check

    try:
        torch_fn = loading.load_callable(args.torch, "--torch")
        jax_fn = loading.load_callable(args.jax, "--jax")
        reference = loading.load_callable(args.reference, "--reference") if args.reference else None
        inputs = loading.load_inputs(args.inputs, "--inputs")
        ragged = None
        if args.ragged:
            name, _, axis = args.ragged.partition(":")
            ragged = (name, axis or "token")
        report = cross_check(torch_fn, jax_fn, inputs, reference=reference,
                             outputs=loading.parse_outputs(args.outputs), ragged=ragged, bitwise=args.bitwise,
                             name=f"{args.torch} vs {args.jax}", cast_to_narrower=args.cast_to_narrower,
                             special_values=args.special_values)
    except (OSError, ValueError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(report)
    if args.json:
        report.to_json(args.json)
    return EXIT_OK if report.ok else EXIT_FAIL


def _bench(args) -> int:
    if getattr(args, "_bench_import_error", None) is not None:
        print(f"error: `bench` is unavailable: {args._bench_import_error}", file=sys.stderr)
        return EXIT_USAGE
    from parity.tools import bench

    return int(bench.run_bench(args))


def _demo(args) -> int:
    try:
        from parity.tools import demo
    except ImportError as e:
        print(f"error: `demo` is unavailable: {e}", file=sys.stderr)
        return EXIT_USAGE
    if args.cp:
        from parity.tools import demo_cp

        rows, ok = demo_cp.run_cp_demo(cp=args.cp, interleave=args.interleave, framework=args.framework,
                                       size=args.size, seed=args.seed)
    else:
        rows, ok = demo.run_demo(framework=args.framework, device=args.device, size=args.size, seed=args.seed,
                                 backend=args.backend)
    print(demo.format_demo_table(rows))
    return EXIT_OK if ok else EXIT_FAIL


def _shard_arg(text: str) -> tuple[int, int]:
    try:
        k, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--shard takes K/N, e.g. 0/3; got {text!r}") from None
    if not 0 <= k < n:
        raise argparse.ArgumentTypeError(f"--shard K/N needs 0 <= K < N; got {text!r}")
    return k, n


def _add_selection(p: argparse.ArgumentParser, default_suite: str) -> None:
    p.add_argument("--suite", choices=SUITES, default=default_suite,
                   help=f"tag of parity.harness.cases to run (default: {default_suite})")
    p.add_argument("-k", dest="name_filter", metavar="SUBSTR", default=None,
                   help="only cases whose name contains SUBSTR")
    p.add_argument("--seed", type=int, default=0, help="input seed of parity.harness.cases.make_inputs (default: 0)")


def _add_pallas_backend(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pallas-backend", choices=("triton", "mosaic_gpu"), default=None,
                   help="the Pallas GPU backend of the pallas implementation (pallas_impl's backend=; default: "
                        "pallas_impl's own, the Triton backend while jax has it)")


def _impl_arg(value: str) -> str:
    if value in ("triton", "pallas", "jnp", "reference") or ":" in value:
        return value
    raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (triton, pallas, jnp, reference, or "
                                     "MODULE:FUNCTION / PATH.py:FUNCTION)")


def _cp_ranks(argv: list[str]) -> int:
    """The N of `demo --cp N` (0 otherwise), read before JAX starts (it fixes its CPU device count then)."""
    if argv[:1] != ["demo"]:
        return 0
    for i, a in enumerate(argv):
        value = a.split("=", 1)[1] if a.startswith("--cp=") else (argv[i + 1] if a == "--cp" and i + 1 < len(argv) else None)
        if value is not None:
            return int(value) if value.isdigit() else 0
    return 0


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m parity",
        description="Parity harness for the empty-context LSE mask and the attention-state merge "
                    "(Triton vs Pallas vs the float64 reference).")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("check", help="run both implementations on a suite and compare them bit for bit "
                                     "and with the float64 reference")
    _add_selection(p, "default")
    p.add_argument("--shard", type=_shard_arg, metavar="K/N", default=None,
                   help="only every N-th selected case, starting at the K-th (0 <= K < N): N processes with "
                        "K = 0..N-1 run the suite between them")
    p.add_argument("--json", metavar="FILE", default=None, help="write the JSON report to FILE")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    _add_pallas_backend(p)
    p.set_defaults(func=_check)

    p = sub.add_parser("export", help="write golden vectors (inputs + float64-reference expectations)")
    p.add_argument("dir", metavar="DIR", help="output folder (created; existing files are overwritten)")
    _add_selection(p, "default")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=_export)

    p = sub.add_parser("verify", help="check an implementation (this project's or a port) against golden vectors")
    p.add_argument("dir", metavar="DIR", help="folder holding manifest.json and the .npz files")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--impl", type=_impl_arg, metavar="IMPL",
                       help="triton, pallas, jnp, reference, or a port's callable MODULE:FUNCTION / PATH.py:FUNCTION "
                            "(docs/porting.md)")
    which.add_argument("--outputs", metavar="OUTDIR",
                       help="a port's results, one OUTDIR/<case>.npz per case (format: docs/porting.md)")
    p.add_argument("-k", dest="name_filter", metavar="SUBSTR", default=None,
                   help="only cases whose name contains SUBSTR")
    p.add_argument("--json", metavar="FILE", default=None, help="write the JSON report to FILE")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    _add_pallas_backend(p)
    p.set_defaults(func=_verify)

    p = sub.add_parser("cross", help="cross-check any PyTorch <-> JAX kernel pair on inputs from a .npz "
                                     "(docs/parity-library.md)")
    p.add_argument("--torch", required=True, metavar="FN", help="the torch implementation: MODULE:FUNCTION or "
                                                                "PATH.py:FUNCTION")
    p.add_argument("--jax", required=True, metavar="FN", help="the JAX implementation, likewise")
    p.add_argument("--inputs", required=True, metavar="FILE.npz",
                   help="keyword inputs; a 0-d array is passed as a number, NAME:DTYPE holds the bits of a "
                        "bfloat16 / float8 array as unsigned integers")
    p.add_argument("--reference", metavar="FN", default=None, help="a float64 numpy reference, likewise")
    p.add_argument("--outputs", metavar="SPEC", default=None,
                   help="output names and axes, e.g. 'out=token,dim;rstd=token' (default: out0, out1, ...)")
    p.add_argument("--ragged", metavar="NAME[:AXIS]", default=None,
                   help="the input holding query_start_loc-style offsets, and the axis they index (default token)")
    p.add_argument("--no-bitwise", dest="bitwise", action="store_false",
                   help="report differing bits between torch and JAX without requiring none (the CPU interpreters)")
    p.add_argument("--cast-to-narrower", action="store_true",
                   help="compare an output whose dtype differs between the sides after rounding the wider to the "
                        "narrower")
    p.add_argument("--special-values", action="store_true",
                   help="also run the pair with NaN, +-inf, -0.0 and subnormals planted in the float inputs and "
                        "require both sides to agree on the value class of every output")
    p.add_argument("--json", metavar="FILE", default=None, help="write the JSON report to FILE")
    p.set_defaults(func=_cross)

    # bench defines its own options; import it only when it is the command being parsed.
    p = sub.add_parser("bench", help="benchmarks on the docs/spec.md 7 workloads (see parity/tools/bench/)")
    p.set_defaults(func=_bench, _bench_import_error=None)
    if argv is not None and argv[:1] == ["bench"]:
        try:
            from parity.tools import bench

            bench.add_bench_arguments(p)
            _add_pallas_backend(p)
        except ImportError as e:
            p.set_defaults(_bench_import_error=e)
            p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)

    p = sub.add_parser("demo", help="show the empty-context bug and the fix on a small batch")
    p.add_argument("--framework", choices=("both", "torch", "jax"), default="both",
                   help="torch (Triton kernels), jax (Pallas kernels) or both (default)")
    p.add_argument("--device", default=None,
                   help="torch device (default: cuda when available, else cpu with Triton's interpreter)")
    p.add_argument("--size", choices=("default", "large", "real"), default="default",
                   help="default (small, fine for the CPU interpreters), large (GPU-sized) or real (40 requests, one "
                        "without context among them: for --backend)")
    p.add_argument("--backend", choices=("modelled", "torch-flash", "jax-cudnn", "jax-xla"), default="modelled",
                   help="where the attention partials come from: modelled backends (every empty-row behaviour, "
                        "default), or a real kernel: torch-flash (PyTorch's FlashAttention-2, GPU), jax-cudnn "
                        "(cuDNN via jax.nn.dot_product_attention, GPU), jax-xla (its XLA implementation, any device)")
    p.add_argument("--seed", type=int, default=0, help="data seed (default: 0)")
    p.add_argument("--cp", type=int, default=0, metavar="N",
                   help="the context-parallel reproduction instead: KV sharded over N ranks (docs/spec.md 9)")
    p.add_argument("--interleave", type=int, default=1, metavar="I",
                   help="with --cp: KV token j on rank (j // I) %% N (default: 1)")
    _add_pallas_backend(p)
    p.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (argparse usage errors give 2)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    from parity.harness import impls

    cp = _cp_ranks(argv)
    if cp and "jax" not in sys.modules:  # the CP demo's JAX side wants N devices: N CPU devices without a GPU
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={cp}")
    impls.configure()
    parser = build_parser(argv)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: 2 for a usage error, 0 after --help
        return int(e.code or 0) if not isinstance(e.code, str) else EXIT_USAGE
    args.argv = argv
    impls.set_pallas_backend(getattr(args, "pallas_backend", None))
    return int(args.func(args))
