"""Command line: `python -m parity check|bench|demo|export|verify|cross|probe|loop`.

Progress goes to stderr, tables to stdout, machine-readable output only to JSON files. Exit status: 0 success,
1 parity failure, 2 usage error (argparse).

The run mode is fixed here (`parity.harness.impls.configure`), before anything imports `triton_impl`: without CUDA,
Triton kernels run in its interpreter (`TRITON_INTERPRET=1` is read when the kernels are imported) and Pallas
kernels in interpret mode; `XLA_PYTHON_CLIENT_PREALLOCATE=false` lets torch and JAX share a GPU.
Each subcommand is one handler `_<command>(args) -> exit status` and one parser block in `build_parser`; the
handler holds the command's printing and exit status and calls its module's library functions (run a check and
return records, export, verify, measure...), imported inside the handler, so the others work when one is missing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2
SUITES = ("ci", "default", "full", "seed")


def _write_json(path: str, report: dict) -> None:
    from parity.library.crosscheck import jsonable

    with open(path, "w") as f:
        json.dump(jsonable(report), f, indent=1)
        f.write("\n")


def _check(args) -> int:
    """`python -m parity check`: 0 every record ok, 1 parity failure, 2 no case selected."""
    from parity.harness import check

    if not check.select(args.suite, args.name_filter, args.shard):
        print(f"error: no case in suite {args.suite!r} matches -k {args.name_filter!r}"
              + (f" in shard {args.shard[0]}/{args.shard[1]}" if args.shard else ""), file=sys.stderr)
        return EXIT_USAGE
    rt, records = check.run_check(suite=args.suite, name_filter=args.name_filter, seed=args.seed, shard=args.shard,
                                  progress=None if args.quiet else sys.stderr)
    print(check.format_table(records))
    ok = all(r.ok for r in records)
    print(f"{rt.mode}: {sum(r.ok for r in records)}/{len(records)} ok" + ("" if ok else " -- PARITY FAILURE"))
    if args.json:
        _write_json(args.json, check.build_report(rt, records, suite=args.suite, name_filter=args.name_filter,
                                                  seed=args.seed, argv=args.argv, shard=args.shard))
    return EXIT_OK if ok else EXIT_FAIL


def _export(args) -> int:
    """`python -m parity export`: 0 written, 2 no case selected."""
    from parity.harness import cases, golden

    selected = cases.select(args.suite, args.name_filter, kind="all")
    if not selected:
        print(f"error: no case in suite {args.suite!r} matches -k {args.name_filter!r}", file=sys.stderr)
        return EXIT_USAGE
    manifest = golden.export(args.dir, selected, seed=args.seed, argv=args.argv,
                             progress=None if args.quiet else sys.stderr)
    print(f"wrote {len(manifest['cases'])} cases and {golden.MANIFEST} to {args.dir}")
    return EXIT_OK


def _verify(args) -> int:
    """`python -m parity verify`: 0 every case ok; 1 a failure, or a folder, file or callable that cannot be used
    (one line naming it)."""
    from parity.harness import golden
    from parity.library.loading import LoadError

    impl = args.impl or "outputs"
    try:
        rows, ok = golden.verify(args.dir, args.impl, outputs_dir=args.outputs, name_filter=args.name_filter,
                                 progress=None if args.quiet else sys.stderr)
    except (golden.GoldenError, LoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAIL
    print(golden.format_rows(rows, impl))
    if args.json:
        _write_json(args.json, golden.build_report(rows, ok, golden_dir=args.dir, impl=impl, outputs_dir=args.outputs,
                                                   argv=args.argv))
    return EXIT_OK if ok else EXIT_FAIL


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
    """`python -m parity bench`: 0 ok, 1 a point or check failed (errors in the JSON), 2 usage error."""
    if getattr(args, "_bench_import_error", None) is not None:
        print(f"error: `bench` is unavailable: {args._bench_import_error}", file=sys.stderr)
        return EXIT_USAGE
    from parity.tools import bench

    if args.replot:
        with open(args.replot) as f:
            print(bench.format_table(json.load(f)))
        if args.plot:
            bench.plot_from_json(args.replot, args.plot)
        return EXIT_OK
    mode = "smoke" if args.smoke else "quick" if args.quick else "full"
    try:
        import torch
    except ImportError as e:
        print(f"error: bench needs torch: {e}", file=sys.stderr)
        return EXIT_USAGE
    has_cuda = torch.cuda.is_available()
    if mode != "smoke" and not has_cuda:
        print("error: `bench` measures on a CUDA GPU and none is visible; use --smoke to check the plumbing",
              file=sys.stderr)
        return EXIT_USAGE
    doc = bench.measure(args, mode, "cuda" if has_cuda else "cpu", argv=args.argv)
    print(bench.format_table(doc), flush=True)
    if args.plot:  # the PNG is drawn from the JSON only: a temporary one without --json
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = args.json or os.path.join(tmp, "bench.json")
            if not args.json:
                bench.write_json(doc, path)
            bench.plot_from_json(path, args.plot)
        if not args.quiet:
            print(f"plot written to {args.plot}", file=sys.stderr)
    return EXIT_FAIL if doc["errors"] else EXIT_OK


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


def _probe(args) -> int:
    """`python -m parity probe`: 0 when every backend was probed or listed with its reason, 2 on a usage error."""
    from parity.tools import probe

    try:
        report = (probe.run_isolated if args.isolate else probe.run_probe)(
            backends=args.backend, merge_impl=args.merge_impl, seed=args.seed, end_to_end=not args.no_end_to_end,
            argv=args.argv, progress=None if args.quiet else (lambda m: print(m, file=sys.stderr)))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(probe.format_table(report))
    if args.json:
        probe.write_json(report, args.json)
    return EXIT_OK


def _loop(args) -> int:
    """`python -m parity loop`: 0 every row clean (replay / repeat bits equal, no re-trace), 1 otherwise."""
    try:
        from parity.tools import loop
    except ImportError as e:
        print(f"error: `loop` is unavailable: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        chunks = tuple(int(c) for c in args.chunks.split(","))
        report, ok = loop.run_loop(framework=args.framework, chunks=chunks, size=args.size,
                                   num_batches=args.batches, seed=args.seed, measure=args.measure,
                                   merge_impl=args.merge_impl)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(loop.format_loop_table(report))
    if args.json:
        loop.write_json(report, args.json, args.argv)
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


def _layout_arg(value: str) -> str:
    from parity.tools.bench import points

    try:
        points.parse_layout(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def add_bench_arguments(p: argparse.ArgumentParser) -> None:
    """The options of `bench` (parity/tools/bench/; imported only when `bench` is the command)."""
    from parity.tools.bench import points

    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help="subset: merge T in {2K, 32K, 131K}, H=64, D=128, bf16 (all variants); mask as full; "
                           "layouts HT/e and TH/2 at D=128 and 512 (2-way lse; N-way lse, contiguous and gather)")
    size.add_argument("--smoke", action="store_true",
                      help="tiny shapes, 1-2 reps, runs on CPU (interpreters): checks the plumbing, no claims")
    p.add_argument("--json", metavar="FILE", default=None,
                   help="write the records to FILE (rewritten after every point)")
    p.add_argument("--plot", metavar="FILE", default=None, help="draw a PNG from the JSON to FILE")
    p.add_argument("--replot", metavar="JSON", default=None,
                   help="measure nothing: print the table of an existing JSON (and --plot it)")
    p.add_argument("--impl", choices=("both", "triton", "pallas"), default="both")
    p.add_argument("--only", choices=("mask", "merge", "layouts"), default=None,
                   help="one op only, or the layout section only (ceilings always run)")
    p.add_argument("--tokens", type=int, nargs="+", default=None, metavar="T", help="merge points with these T only")
    p.add_argument("--layouts", type=_layout_arg, nargs="+", default=None, metavar="L",
                   help=f"layout section: LSE layout/base of {', '.join(points.LAYOUTS)} (default per mode)")
    p.add_argument("--head-dims", type=int, nargs="+", default=None, metavar="D",
                   help=f"layout section: head sizes (full: {' '.join(map(str, points.HEAD_DIMS))})")
    p.add_argument("--views", choices=points.VIEWS, nargs="+", default=None,
                   help="layout section: N-way partials contiguous [N, T, H, D] and/or the [T, N, H, D] "
                        "all-gather view (Triton only)")
    p.add_argument("-k", dest="name_filter", metavar="SUBSTR", default=None,
                   help="only points whose label contains SUBSTR (e.g. 'merge T=32768', 'bfloat16 fused', "
                        "'TH/2', 'gather')")
    p.add_argument("--budget-s", type=float, default=None, metavar="S",
                   help="stop starting new points after S seconds (the JSON and plot are still written)")
    p.add_argument("--jax-timer", choices=("profiler", "dispatch"), default="profiler",
                   help="JAX gpu_time: profiler kernel time (default) or the labelled dispatch loop")
    p.add_argument("--no-retrace", action="store_true", help="skip the JAX re-trace check")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


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
            add_bench_arguments(p)
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

    p = sub.add_parser("probe", help="what every attention kernel here leaves in rows that attend to nothing, and "
                                     "whether the merge is safe on it without the mask (docs/porting.md)")
    p.add_argument("--backend", action="append", metavar="NAME", default=None,
                   help="probe only NAME (repeatable; default: every backend the probe knows, absent ones listed)")
    p.add_argument("--merge-impl", choices=("triton", "pallas", "jnp", "reference"), default=None,
                   help="this project's mask and merge end to end (default: triton on a GPU, jnp otherwise)")
    p.add_argument("--no-end-to-end", action="store_true", help="skip the chunked-prefill merge of each backend")
    p.add_argument("--isolate", action="store_true",
                   help="each backend in its own process: a kernel that crashes or breaks the CUDA context is "
                        "listed as crashed, the others still run")
    p.add_argument("--seed", type=int, default=0, help="data seed (default: 0)")
    p.add_argument("--json", metavar="FILE", default=None, help="write the JSON report to FILE ('-': stdout)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    _add_pallas_backend(p)
    p.set_defaults(func=_probe)

    p = sub.add_parser("loop", help="the chunked-context prefill as one captured step: chained in-place merges vs one "
                                    "fused N-way merge, CUDA graph / one jit, vs float64")
    p.add_argument("--framework", choices=("both", "torch", "jax"), default="both",
                   help="torch (Triton merges, CUDA graph), jax (pallas_impl merges, one jit) or both (default)")
    p.add_argument("--chunks", default="1,2,4,8", metavar="C,C,...",
                   help="context chunk counts of the capacity (default: 1,2,4,8)")
    p.add_argument("--size", choices=("ci", "gpu"), default=None,
                   help="capacity: ci (tiny, for the CPU interpreters) or gpu; default gpu on a GPU, else ci")
    p.add_argument("--batches", type=int, default=3, help="batches of different lengths per capacity (default: 3)")
    p.add_argument("--seed", type=int, default=0, help="data seed (default: 0)")
    p.add_argument("--merge-impl", choices=("pallas", "jnp"), default="pallas",
                   help="pallas_impl implementation of the JAX merges (default: pallas; interpreted on a CPU)")
    p.add_argument("--no-measure", dest="measure", action="store_false",
                   help="on a GPU, skip the timings (merges, step, host time per step)")
    p.add_argument("--json", metavar="FILE", default=None, help="write the report (and the environment) to FILE")
    _add_pallas_backend(p)
    p.set_defaults(func=_loop)
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
