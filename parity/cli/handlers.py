"""The handler of every `python -m parity` subcommand: its printing, JSON output and exit status."""

from __future__ import annotations

import json
import os
import sys

from parity.cli.codes import EXIT_FAIL, EXIT_OK, EXIT_USAGE


def _writable_file(path: str, flag: str) -> str | None:
    """Why `path` cannot take a file written at the end of the run (None: it can)."""
    if os.path.isdir(path):
        return f"{flag} {path!r} is a folder, not a file"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"{flag} {path!r}: the folder {folder!r} does not exist"
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        return f"{flag} {path!r} cannot be written"
    return None


def check_output_paths(args) -> str | None:
    """Checked before any work (a failure after the run would lose it): the files `--json` and `--plot` will write
    (`--json -` is stdout) and `export`'s folder (created here, or an existing folder). Returns the problem, or
    None."""
    for attr, flag in (("json", "--json"), ("plot", "--plot")):
        path = getattr(args, attr, None)
        if path and path != "-":
            problem = _writable_file(path, flag)
            if problem:
                return problem
    if args.command == "export":
        if os.path.exists(args.dir) and not os.path.isdir(args.dir):
            return f"export: {args.dir!r} exists and is not a folder"
        try:
            os.makedirs(args.dir, exist_ok=True)
        except OSError as e:
            return f"export: cannot create the folder {args.dir!r}: {e.strerror or e}"
        if not os.access(args.dir, os.W_OK):
            return f"export: the folder {args.dir!r} cannot be written"
    return None


def _write_json(path: str, report: dict) -> None:
    from parity.library.crosscheck import jsonable

    with open(path, "w") as f:
        json.dump(jsonable(report), f, indent=1)
        f.write("\n")


def check(args) -> int:
    """`python -m parity check`: 0 every record ok, 1 parity failure, 2 no case selected."""
    from parity.harness import check

    if not check.select(args.suite, args.name_filter, args.shard):
        print(f"error: no case in suite {args.suite!r} matches -k {args.name_filter!r}"
              + (f" in shard {args.shard[0]}/{args.shard[1]}" if args.shard else ""), file=sys.stderr)
        return EXIT_USAGE
    rt, records = check.run_check(suite=args.suite, name_filter=args.name_filter, seed=args.seed, shard=args.shard,
                                  progress=None if args.quiet else sys.stderr)
    print(check.format_table(records))
    ok = not any(r.failed for r in records)
    unsupported = sum(r.unsupported is not None for r in records)
    print(f"{rt.mode}: {sum(r.ok for r in records)}/{len(records)} ok"
          + (f", {unsupported} unsupported by the chosen Pallas backend" if unsupported else "")
          + ("" if ok else " -- PARITY FAILURE"))
    if args.json:
        _write_json(args.json, check.build_report(rt, records, suite=args.suite, name_filter=args.name_filter,
                                                  seed=args.seed, argv=args.argv, shard=args.shard))
    return EXIT_OK if ok else EXIT_FAIL


def export(args) -> int:
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


def verify(args) -> int:
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


def cross(args) -> int:
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


def bench(args) -> int:
    """`python -m parity bench`: 0 ok, 1 a point or check failed (errors in the JSON), 2 usage error."""
    error = getattr(args, "_bench_import_error", None)
    if isinstance(error, ModuleNotFoundError):
        raise error  # the CLI names the extra to install
    if error is not None:
        print(f"error: `bench` is unavailable: {error}", file=sys.stderr)
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


def demo(args) -> int:
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


def probe(args) -> int:
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


def loop(args) -> int:
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


def example(args) -> int:
    """`python -m parity example NAME`: print a worked example's source (parity/examples/); 2 no such example."""
    from importlib import resources

    folder = resources.files("parity.examples")
    names = sorted(f.name[:-3] for f in folder.iterdir() if f.name.endswith(".py") and not f.name.startswith("_"))
    if args.list or args.name is None:
        print("\n".join(names))
        return EXIT_OK
    if args.name not in names:
        print(f"error: no example {args.name!r}; the examples: {', '.join(names)}", file=sys.stderr)
        return EXIT_USAGE
    sys.stdout.write(folder.joinpath(f"{args.name}.py").read_text())
    return EXIT_OK
