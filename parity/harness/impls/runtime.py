"""The run mode and the device both frameworks share (layer 1 of `parity.harness.impls`)."""

from __future__ import annotations

import dataclasses
import os
import re
import sys

from parity.library import recipe


def cpu_compile_flags() -> tuple[str, ...]:
    """XLA:CPU settings of the CPU run mode, for the installed jaxlib (none without one). Without a GPU every
    interpreted Pallas kernel and jnp program is compiled once per shape and run once or a few times on small
    arrays, so compiling is most of its time: LLVM at -O0 and, in jaxlib < 0.11, the elemental emitters instead of
    the fusion emitters cut XLA's compile time by about 2/3 and the test suite's by about 1/4 (docs/results.md, "CI
    on a CPU machine"). They change how XLA:CPU builds the code, not the float math of any operation: the suite's
    bit-exact checks hold with them. jaxlib 0.11 removed `--xla_cpu_use_fusion_emitters` (an unknown flag aborts
    the process), so it is set only before."""
    from importlib import metadata

    try:
        version = tuple(int(x) for x in re.findall(r"\d+", metadata.version("jaxlib"))[:2])
    except metadata.PackageNotFoundError:
        return ()
    flags = ("--xla_backend_optimization_level=0",)
    return flags + (("--xla_cpu_use_fusion_emitters=false",) if version < (0, 11) else ())


def add_xla_flags(*flags: str) -> str:
    """Adds `flags` to $XLA_FLAGS, each unless a flag of the same name is set there already (the user's wins); returns
    the new value. XLA reads it when JAX starts its first backend: call this before the first JAX computation."""
    os.environ["XLA_FLAGS"] = recipe.merge_xla_flags(os.environ.get("XLA_FLAGS", ""), flags)
    return os.environ["XLA_FLAGS"]


def configure() -> bool:
    """Set the environment the kernels read at import; returns whether torch sees a CUDA GPU.

    Without CUDA, Triton kernels run in its interpreter and Pallas kernels in interpret mode, and XLA:CPU compiles
    with `cpu_compile_flags()` (when JAX has not started yet); `XLA_PYTHON_CLIENT_PREALLOCATE=false` lets torch and
    JAX share a GPU.
    """
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        if "triton_impl" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            raise RuntimeError("triton_impl was imported before TRITON_INTERPRET=1 was set: its kernels cannot "
                               "run on the CPU in this process")
        os.environ["TRITON_INTERPRET"] = "1"
        patch_triton_language_once_per_launch()
        if not recipe.jax_backend_started():
            add_xla_flags(*cpu_compile_flags())
    return has_cuda


_LAUNCH_PATCH = []  # set once the interpreter's per-launch patch is in place (one process, one patch)


def patch_triton_language_once_per_launch() -> None:
    """Speed up Triton's interpreter without changing what it computes.

    The interpreter swaps `triton.language`'s builtins for interpreted ones when a kernel launches and puts them
    back when it returns; it also redoes the swap at every call of a device function (`_patch_lang(fn)`, through
    `inspect.getmembers` of the language modules), which finds them swapped already and sets equivalent functions
    again. The kernels call device helpers per tile, so that repeat was most of the interpreter's overhead
    (docs/results.md, "CI on a CPU machine", has the check's and CI's times with and without this). Here a device
    function's call skips it once the running launch has swapped the language modules it sees (a helper of
    `triton.language.core` swaps that module once per launch); the launch's own swap and its restore are untouched.
    A Triton whose interpreter is laid out otherwise (this is triton 3.6-3.9's) is left as it is. Called by
    `configure()` on CPU, by the gloo ranks of `parity.tools.ranks` and by the tests' conftest.

    Also (`_np_dtype_table_once`): the interpreter's `_get_np_dtype`, called at every operation, builds its table
    of 19 numpy dtypes at each call (9.5 us, 5% of an interpreted merge's time); here the table is built once and
    checked, at patch time, to give what the original gives for every dtype in it.
    """
    if _LAUNCH_PATCH:
        return
    try:
        import inspect

        from triton.runtime import interpreter as ti
    except ImportError:
        return
    executor, patch = getattr(ti, "GridExecutor", None), getattr(ti, "_patch_lang", None)
    if executor is None or patch is None or not hasattr(ti, "tl"):
        return

    seen = {}  # function -> the language modules its globals hold (a module's globals keep their modules)

    def langs_of(fn):
        langs = seen.get(fn)
        if langs is None:
            langs = seen[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                         if inspect.ismodule(v) and v in (ti.tl, ti.tl.core))
        return langs

    class _Kept:
        def restore(self):
            pass

    launches = []  # per running launch: None until its own swap, then the ids of the modules swapped so far

    def patch_lang(fn):
        if launches and launches[-1] is not None and langs_of(fn) <= launches[-1]:
            return _Kept()
        scope = patch(fn)
        if launches:  # the launch's own swap, or a device function seeing another module (tl.core): once each
            launches[-1] = langs_of(fn) | (launches[-1] or frozenset())
        return scope

    run = executor.__call__

    def launch(self, *args, **kwargs):
        launches.append(None)
        try:
            return run(self, *args, **kwargs)
        finally:
            launches.pop()

    ti._patch_lang = patch_lang
    executor.__call__ = launch
    _np_dtype_table_once(ti)
    _LAUNCH_PATCH.append(True)


def _np_dtype_table_once(ti) -> None:
    """`ti._get_np_dtype` (`triton.runtime.interpreter`) with its table built once: the same results (checked here
    on every scalar dtype, a pointer and a block of each), else the original is left in place."""
    original, tl = getattr(ti, "_get_np_dtype", None), ti.tl
    if original is None or not all(hasattr(tl, n) for n in ("pointer_type", "block_type", "float32")):
        return
    scalars = [v for v in vars(tl).values() if isinstance(v, tl.dtype) and not isinstance(v, tl.pointer_type)]
    table = {}
    for t in scalars:
        try:
            table[t] = original(t)
        except KeyError:  # a dtype the interpreter does not store: the fast path raises KeyError too
            pass
    u64 = original(tl.pointer_type(tl.float32))

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return u64
        return table[tt_dtype]

    probes = list(table) + [tl.pointer_type(tl.float32)]
    probes += [tl.block_type(t, [4]) for t in probes]
    if any(get_np_dtype(t) != original(t) for t in probes):
        return
    ti._get_np_dtype = get_np_dtype


@dataclasses.dataclass
class Runtime:
    """The device both frameworks use and the mode of the comparison."""

    device: str  # torch device: "cuda" or "cpu"
    mode: str  # "gpu-bitwise" or "cpu-interpreters"

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    def sync(self) -> None:
        if self.on_gpu:
            import torch

            torch.cuda.synchronize()


# The reference needs no device: its adapter runs on the host whatever the machine.
HOST = Runtime("cpu", "reference")


def make_runtime() -> Runtime:
    has_cuda = configure()
    import jax

    device = "cuda" if has_cuda else "cpu"
    jax_backend = jax.default_backend()
    if has_cuda != (jax_backend == "gpu"):
        raise RuntimeError(f"torch uses {device!r} but JAX's default backend is {jax_backend!r}: "
                           "both frameworks must run on the same kind of device")
    return Runtime(device, "gpu-bitwise" if has_cuda else "cpu-interpreters")
