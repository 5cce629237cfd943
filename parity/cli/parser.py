"""The argparse parser of `python -m parity`: one block per subcommand, each bound to its handler."""

from __future__ import annotations

import argparse

from parity.cli import handlers as h
from parity.cli.codes import SUITES


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
    if value in ("triton", "pallas", "jnp", "torch", "reference") or ":" in value:
        return value
    raise argparse.ArgumentTypeError(f"invalid choice: {value!r} (triton, pallas, jnp, torch, reference, or "
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
    p.set_defaults(func=h.check)

    p = sub.add_parser("export", help="write golden vectors (inputs + float64-reference expectations)")
    p.add_argument("dir", metavar="DIR", help="output folder (created; existing files are overwritten)")
    _add_selection(p, "default")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=h.export)

    p = sub.add_parser("verify", help="check an implementation (this project's or a port) against golden vectors")
    p.add_argument("dir", metavar="DIR", help="folder holding manifest.json and the .npz files")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--impl", type=_impl_arg, metavar="IMPL",
                       help="triton, pallas, jnp, torch, reference, or a port's callable MODULE:FUNCTION / PATH.py:FUNCTION "
                            "(docs/porting.md)")
    which.add_argument("--outputs", metavar="OUTDIR",
                       help="a port's results, one OUTDIR/<case>.npz per case (format: docs/porting.md)")
    p.add_argument("-k", dest="name_filter", metavar="SUBSTR", default=None,
                   help="only cases whose name contains SUBSTR")
    p.add_argument("--json", metavar="FILE", default=None, help="write the JSON report to FILE")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    _add_pallas_backend(p)
    p.set_defaults(func=h.verify)

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
    p.set_defaults(func=h.cross)

    # bench defines its own options; import it only when it is the command being parsed.
    p = sub.add_parser("bench", help="benchmarks on the docs/spec.md 7 workloads (see parity/tools/bench/)")
    p.set_defaults(func=h.bench, _bench_import_error=None)
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
    p.set_defaults(func=h.demo)

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
    p.set_defaults(func=h.probe)

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
    p.set_defaults(func=h.loop)

    p = sub.add_parser("example", help="print a worked example shipped with the package (parity/examples/): "
                                       "`example numpy_port > my_port.py` starts a port (docs/porting.md)")
    p.add_argument("name", nargs="?", metavar="NAME", default=None, help="the example (without .py)")
    p.add_argument("--list", action="store_true", help="list the examples")
    p.set_defaults(func=h.example)
    return parser
