"""How to run each implementation of each operation: the one place the harness commands go through.

`check`, `golden`, `bench` and `demo` never call `triton_impl` or `pallas_impl` themselves; they ask this
module. Implementations (`IMPLS`):

- "reference": `parity.harness.reference`, float64 numpy, in token chunks (every token is independent);
- "triton": `triton_impl` on torch tensors, in place into buffers allocated here (poisoned with NaN, so an
  element a kernel fails to write shows up);
- "pallas": `pallas_impl` with `implementation="pallas"` (interpret mode on CPU) and the Pallas backend of
  `set_pallas_backend` (the CLI's `--pallas-backend`; None: `pallas_impl`'s default);
- "jnp": `pallas_impl` with `implementation="jnp"` (its plain-XLA path);
- "mosaic" (not in `IMPLS`: GPU and jax >= 0.11 only, run by its own tests): `pallas_impl` with
  `backend="mosaic_gpu"`, the experimental Mosaic GPU kernels.

Three layers:

1. `configure()` / `make_runtime()`: the run mode, fixed before anything imports `triton_impl` (Triton reads
   `TRITON_INTERPRET` when its kernels are defined), and the device both frameworks share.
2. `adapter(rt, impl)`: an implementation behind one calling convention. `bind_mask`, `bind_merge` and
   `bind_merge_n` prepare one call of the public API (buffers allocated, options resolved) and return a
   `Bound`: `call()` is exactly one public call (what the benchmarks time, what a CUDA graph captures) and
   `results()` its outputs as a dict; `mask`, `merge` and `merge_n` do both. Arrays are the
   implementation's own type (numpy, torch tensors, JAX arrays); dtypes are named by string.
3. `run(rt, impl, op, case, arrays)`: one operation of `OPS` on a `parity.harness.cases` case's arrays.

`collect_env()` is the environment record every command writes (devices, versions, commit, time, command).
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import math
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from parity.harness import cases as cases_mod
from parity.harness import reference

IMPLS = ("reference", "triton", "pallas", "jnp")
EXPERIMENTAL_IMPLS = ("mosaic",)
KERNEL_IMPLS = ("triton", "pallas", "jnp")
# Operations on a case's arrays. "merge" takes the masked prefix (mask then merge), "merge_fused" the raw
# prefix with the fused mask; "merge_n" the reference-masked partials, "merge_n_fused" the raw partials with
# their offsets (docs/spec.md section 8).
OPS = ("mask", "merge", "merge_fused", "merge_n", "merge_n_fused")
_PALLAS_BACKEND: list[str | None] = [None]  # the "pallas" implementation's `backend=` (set_pallas_backend)
REF_CHUNK_ELEMS = 1 << 23  # T*H*D elements per token chunk of the float64 reference: bounds its temporaries


# ---------------------------------------------------------------------------------------------------------
# Run mode and runtime


def configure() -> bool:
    """Set the environment the kernels read at import; returns whether torch sees a CUDA GPU.

    Without CUDA, Triton kernels run in its interpreter and Pallas kernels in interpret mode;
    `XLA_PYTHON_CLIENT_PREALLOCATE=false` lets torch and JAX share a GPU.
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
    return has_cuda


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


# ---------------------------------------------------------------------------------------------------------
# Environment record


def git_commit() -> str | None:
    """$GIT_COMMIT (a copied tree, as on the device machine, may carry a stale .git), else the checkout's HEAD."""
    if os.environ.get("GIT_COMMIT"):
        return os.environ["GIT_COMMIT"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        r = subprocess.run(["git", "-C", root, "rev-parse", "--verify", "-q", "HEAD"], capture_output=True,
                           text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() or None


def _run_text(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def collect_env(argv: list[str] | None = None) -> dict[str, Any]:
    """Devices, versions, driver, git commit, UTC time and command line of this run.

    `argv` is the argument list of `python -m parity` (the command is recorded as that); None records
    `sys.argv`.
    """
    import importlib.metadata as md

    versions: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("numpy", "torch", "triton", "jax", "jaxlib", "ml_dtypes"):
        try:
            versions[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            versions[pkg] = None
    env: dict[str, Any] = {"versions": versions, "platform": platform.platform(), "devices": {},
                           "gpu": None, "driver": None, "cuda": None}
    try:
        import torch

        env["cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            env["devices"]["torch"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            env["gpu"] = env["devices"]["torch"][0]
            env["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        else:
            env["devices"]["torch"] = ["cpu"]
    except ImportError:
        env["devices"]["torch"] = None
    smi = _run_text(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if smi:
        name, _, driver = smi.splitlines()[0].partition(",")
        env["driver"] = driver.strip() or None
        env["gpu"] = env["gpu"] or name.strip()
    try:
        import jax

        env["jax_backend"] = jax.default_backend()
        env["devices"]["jax"] = [f"{d.platform}:{getattr(d, 'device_kind', '')}" for d in jax.devices()]
    except Exception as e:  # noqa: BLE001 - informational only
        env["jax_backend"] = f"unavailable: {type(e).__name__}: {e}"
    try:
        from pallas_impl import _backend as pallas_impl_backend

        env["pallas_backend"] = pallas_impl_backend.resolve_backend(pallas_backend())
    except Exception as e:  # noqa: BLE001 - informational only
        env["pallas_backend"] = f"unavailable: {type(e).__name__}: {e}"
    env["git_commit"] = git_commit()
    env["utc_time"] = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    env["command"] = ("python -m parity " + shlex.join(argv)) if argv is not None else shlex.join(sys.argv)
    env["environment_variables"] = {k: os.environ.get(k) for k in ("TRITON_INTERPRET", "XLA_PYTHON_CLIENT_PREALLOCATE",
                                                                   "XLA_FLAGS")}
    return env


# ---------------------------------------------------------------------------------------------------------
# Adapters


@dataclasses.dataclass
class Bound:
    """One prepared call: `call()` runs the public API once; `results()` returns its outputs."""

    call: Callable[[], Any]
    results: Callable[[], dict[str, Any]]

    def __call__(self) -> dict[str, Any]:
        self.call()
        return self.results()


def _merge_options(case: cases_mod.Case) -> dict[str, Any]:
    return dict(prefill_tokens_with_context=case.prefill_tokens_with_context, out_dtype=case.out_dtype,
                lse_layout=case.lse_layout, lse_base=case.lse_base)


class _Adapter:
    """The calling convention (the same keyword options in every implementation):

    - `bind_mask(lse, query_start_loc, cu_seq_lens, output=None, *, head_dim=None, lse_layout, has_empty,
      donate)` -> results {"lse", "output"} (+ "output_buffer" for Triton: the whole, possibly padded buffer);
    - `bind_merge(prefix_output, prefix_lse, suffix_output, suffix_lse, *, head_dim=None,
      prefill_tokens_with_context, query_start_loc, prefix_cu_seq_lens, out_dtype, output_scale, return_lse,
      lse_layout, lse_base, head_pad, out, out_lse)` -> {"out", "lse"} (+ "out_buffer" for Triton);
    - `bind_merge_n(outputs, lses, *, head_dim=None, prefill_tokens_with_context, query_start_loc, cu_seq_lens,
      out_dtype, output_scale, return_lse, lse_layout, lse_base, head_pad, strided, out, out_lse)`.

    Output buffers may be wider than `head_dim` (a V-padded layout): Triton reads and writes views of them,
    JAX slices them (its arrays have no strides), the reference slices. `head_pad` widens the output buffer
    Triton writes (its columns past D must keep their poison); `out`/`out_lse` hand Triton buffers to write
    (the benchmarks). `strided` makes Triton read the partials through views of a `[T, N, H, D]` gather and
    of the other LSE layout. Options an implementation has no use for are ignored.
    """

    name: str

    def mask(self, *args, **kwargs) -> dict[str, Any]:
        return self.bind_mask(*args, **kwargs)()

    def merge(self, *args, **kwargs) -> dict[str, Any]:
        return self.bind_merge(*args, **kwargs)()

    def merge_n(self, *args, **kwargs) -> dict[str, Any]:
        return self.bind_merge_n(*args, **kwargs)()


class ReferenceAdapter(_Adapter):
    """`parity.harness.reference` on numpy arrays. Merge results are float64 (fp8: the clamped, scaled value)."""

    name = "reference"

    def bind_mask(self, lse, query_start_loc, cu_seq_lens, output=None, *, head_dim=None, lse_layout="HT",
                  has_empty=None, donate=False):
        out = None if output is None else np.asarray(output)[..., :head_dim]

        def results():
            got_lse, got_out = reference.mask_empty_context_lse(lse, query_start_loc, cu_seq_lens, out,
                                                                 lse_layout=lse_layout)
            return {"lse": got_lse, "output": got_out}

        return Bound(lambda: None, results)

    def bind_merge(self, prefix_output, prefix_lse, suffix_output, suffix_lse, *, head_dim=None,
                   prefill_tokens_with_context=None, query_start_loc=None, prefix_cu_seq_lens=None, out_dtype=None,
                   output_scale=None, return_lse=True, lse_layout="HT", lse_base=math.e, **_):
        a = np.asarray(prefix_output)[..., :head_dim]
        b = np.asarray(suffix_output)[..., :head_dim]

        def one(t0, t1, ptwc, qsl):
            kw = {} if qsl is None else dict(query_start_loc=qsl, prefix_cu_seq_lens=prefix_cu_seq_lens)
            return reference.merge_attn_states(a[t0:t1], _token_slice(prefix_lse, lse_layout, t0, t1), b[t0:t1],
                                               _token_slice(suffix_lse, lse_layout, t0, t1),
                                               prefill_tokens_with_context=ptwc, output_scale=output_scale,
                                               lse_layout=lse_layout, lse_base=lse_base, **kw)

        return Bound(lambda: None, lambda: _chunked(one, a.shape, lse_layout, prefill_tokens_with_context,
                                                    query_start_loc))

    def bind_merge_n(self, outputs, lses, *, head_dim=None, prefill_tokens_with_context=None, query_start_loc=None,
                     cu_seq_lens=None, out_dtype=None, output_scale=None, return_lse=True, lse_layout="HT",
                     lse_base=math.e, **_):
        o = np.asarray(outputs)[..., :head_dim]
        lses = np.asarray(lses)

        def one(t0, t1, ptwc, qsl):
            kw = {} if qsl is None else dict(query_start_loc=qsl, cu_seq_lens=cu_seq_lens)
            sl = lses[:, :, t0:t1] if lse_layout == "HT" else lses[:, t0:t1]
            return reference.merge_attn_states_n(o[:, t0:t1], sl, prefill_tokens_with_context=ptwc,
                                                 output_scale=output_scale, lse_layout=lse_layout,
                                                 lse_base=lse_base, **kw)

        return Bound(lambda: None, lambda: _chunked(one, o.shape[1:], lse_layout, prefill_tokens_with_context,
                                                    query_start_loc))


def _token_slice(lse, lse_layout: str, t0: int, t1: int):
    return lse[:, t0:t1] if lse_layout == "HT" else lse[t0:t1]


def _chunked(one, out_shape, lse_layout: str, ptwc, query_start_loc) -> dict[str, np.ndarray]:
    """Run `one(t0, t1, ptwc, qsl)` over token chunks: offsets are rebased and clipped to the chunk
    (`clip(qsl - t0, 0, t1 - t0)` selects exactly the same tokens), as is `prefill_tokens_with_context`."""
    T, H, D = out_shape
    step = max(1, REF_CHUNK_ELEMS // max(1, H * D))
    out = np.empty((T, H, D), dtype=np.float64)
    lse = np.empty((H, T) if lse_layout == "HT" else (T, H), dtype=np.float64)
    for t0 in range(0, T, step):
        t1 = min(T, t0 + step)
        p = None if ptwc is None else int(np.clip(ptwc - t0, 0, t1 - t0))
        q = None if query_start_loc is None else np.clip(np.asarray(query_start_loc, np.int64) - t0, 0, t1 - t0)
        o, l = one(t0, t1, p, q)
        out[t0:t1] = o
        _token_slice(lse, lse_layout, t0, t1)[...] = l
    return {"out": out, "lse": lse}


def poisoned(shape, dtype: str, device):
    """A NaN-filled torch tensor: an element a kernel fails to write shows up as a NaN mismatch (its bits are
    torch's f32 NaN cast to `dtype`)."""
    import torch

    return torch.full(tuple(shape), float("nan"), dtype=torch.float32, device=device).to(getattr(torch, dtype))


class TritonAdapter(_Adapter):
    """`triton_impl` on torch tensors. The mask runs in place on clones (the inputs are never written)."""

    name = "triton"

    def __init__(self, rt: Runtime):
        import torch

        import triton_impl

        self.rt, self.torch, self.ti = rt, torch, triton_impl

    def bind_mask(self, lse, query_start_loc, cu_seq_lens, output=None, *, head_dim=None, lse_layout="HT",
                  has_empty=None, donate=False, in_place=False):
        if not in_place:
            lse = lse.clone()
            output = None if output is None else output.clone()
        view = None if output is None else output[..., :head_dim]

        def call():
            with np.errstate(all="ignore"):  # the interpreter evaluates with numpy: inf/NaN inputs are expected
                self.ti.mask_empty_context_lse(lse, query_start_loc, cu_seq_lens, view, has_empty=has_empty,
                                               lse_layout=lse_layout)

        def results():
            self.rt.sync()
            return {"lse": lse, "output": view, "output_buffer": output}

        return Bound(call, results)

    def _out_buffers(self, shape, dtype, lse_shape, device, head_pad, out, out_lse, return_lse):
        T, H, D = shape
        if out is None:
            out = poisoned((T, H, D + head_pad), dtype, device)
        if out_lse is None and return_lse:
            out_lse = poisoned(lse_shape, "float32", device)
        return out, out_lse

    def bind_merge(self, prefix_output, prefix_lse, suffix_output, suffix_lse, *, head_dim=None,
                   prefill_tokens_with_context=None, query_start_loc=None, prefix_cu_seq_lens=None, out_dtype=None,
                   output_scale=None, return_lse=True, lse_layout="HT", lse_base=math.e, head_pad=0, out=None,
                   out_lse=None, **_):
        a, b = prefix_output[..., :head_dim], suffix_output[..., :head_dim]
        dtype = out_dtype or str(a.dtype).replace("torch.", "")
        buf, olse = self._out_buffers(a.shape, dtype, suffix_lse.shape, a.device, head_pad, out, out_lse, return_lse)
        view = buf[..., :a.shape[2]]
        kw = {}
        if query_start_loc is not None:
            kw = dict(query_start_loc=query_start_loc, prefix_cu_seq_lens=prefix_cu_seq_lens)
        call = functools.partial(self.ti.merge_attn_states, view, a, prefix_lse, b, suffix_lse, olse,
                                 prefill_tokens_with_context, output_scale, lse_layout=lse_layout, lse_base=lse_base,
                                 **kw)

        def results():
            self.rt.sync()
            return {"out": view, "lse": olse, "out_buffer": buf}

        return Bound(_quiet(call), results)

    def bind_merge_n(self, outputs, lses, *, head_dim=None, prefill_tokens_with_context=None, query_start_loc=None,
                     cu_seq_lens=None, out_dtype=None, output_scale=None, return_lse=True, lse_layout="HT",
                     lse_base=math.e, head_pad=0, strided=False, out=None, out_lse=None, **_):
        if strided:  # the same values, read through views of a [T, N, H, D] gather and of the other LSE layout
            outputs = outputs.transpose(0, 1).contiguous().transpose(0, 1)
            lses = lses.transpose(1, 2).contiguous().transpose(1, 2)
        o = outputs[..., :head_dim]
        dtype = out_dtype or str(o.dtype).replace("torch.", "")
        buf, olse = self._out_buffers(o.shape[1:], dtype, lses.shape[1:], o.device, head_pad, out, out_lse,
                                      return_lse)
        view = buf[..., :o.shape[3]]
        call = functools.partial(self.ti.merge_attn_states_n, view, o, lses, olse, prefill_tokens_with_context,
                                 output_scale, query_start_loc=query_start_loc, cu_seq_lens=cu_seq_lens,
                                 lse_layout=lse_layout, lse_base=lse_base)

        def results():
            self.rt.sync()
            return {"out": view, "lse": olse, "out_buffer": buf}

        return Bound(_quiet(call), results)

    def bind_cp_merge(self, partial_output, partial_lse, group, *, method="gather", query_start_loc=None,
                      cu_seq_lens=None, prefill_tokens_with_context=None, out_dtype=None, output_scale=None,
                      return_lse=True, lse_layout="HT", lse_base=math.e, reduce_dtype=None, validate=False, **_):
        """The context-parallel combine on `group` (call on every rank): this rank's result, all heads for
        "gather", its H / N heads for "reduce_scatter"."""
        T, H, D = partial_output.shape
        heads = H if method == "gather" else H // group.size()
        dtype = out_dtype or str(partial_output.dtype).replace("torch.", "")
        out = poisoned((T, heads, D), dtype, partial_output.device)
        lse_shape = (heads, T) if lse_layout == "HT" else (T, heads)
        out_lse = poisoned(lse_shape, "float32", partial_output.device) if return_lse else None
        call = functools.partial(self.ti.cp_merge_attn_states, out, partial_output, partial_lse, group, out_lse,
                                 prefill_tokens_with_context, output_scale, method=method,
                                 query_start_loc=query_start_loc, cu_seq_lens=cu_seq_lens, lse_layout=lse_layout,
                                 lse_base=lse_base, reduce_dtype=reduce_dtype, validate=validate)

        def results():
            self.rt.sync()
            return {"out": out, "lse": out_lse}

        return Bound(_quiet(call), results)


def _quiet(call):
    def run():
        with np.errstate(all="ignore"):  # the interpreter evaluates with numpy: inf/NaN inputs are expected
            call()

    return run


class JaxAdapter(_Adapter):
    """`pallas_impl` with one `implementation` ("pallas" or "jnp") and Pallas `backend`, functional."""

    def __init__(self, rt: Runtime, implementation: str, backend: str | None = None, interpret: bool | None = None):
        import jax
        import jax.numpy as jnp

        import pallas_impl

        self.rt, self.jax, self.jnp, self.pi = rt, jax, jnp, pallas_impl
        self.name = "mosaic" if backend == "mosaic_gpu" else implementation
        self.kernel = dict(implementation=implementation, backend=backend)
        if interpret is not None:
            self.kernel["interpret"] = interpret

    def _dtype(self, name):
        return None if name is None else self.jnp.dtype(cases_mod.DTYPES[name])

    def _holder(self, fn):
        last: dict[str, Any] = {}

        def call():
            last["r"] = fn()

        def results():
            self.jax.block_until_ready(last["r"])
            return last["r"]

        return Bound(call, results)

    def bind_mask(self, lse, query_start_loc, cu_seq_lens, output=None, *, head_dim=None, lse_layout="HT",
                  has_empty=None, donate=False):
        out = None if output is None else output[..., :head_dim]
        api = functools.partial(self.pi.mask_empty_context_lse, has_empty=has_empty, lse_layout=lse_layout,
                                **self.kernel)
        if not donate:
            def fn():
                r = api(lse, query_start_loc, cu_seq_lens, out)
                return {"lse": r, "output": None} if out is None else {"lse": r[0], "output": r[1]}

            return self._holder(fn)
        # The documented in-place form: jit with the buffers donated, each result fed back as the next input
        # (the mask is idempotent). JAX-owned copies: a donated buffer must not be one torch still owns.
        jnp = self.jnp
        state = [jnp.copy(lse)] + ([] if out is None else [jnp.copy(out)])
        step = self.jax.jit(api, donate_argnums=(0,) if out is None else (0, 3))

        def call():
            if out is None:
                state[0] = step(state[0], query_start_loc, cu_seq_lens)
            else:
                state[0], state[1] = step(state[0], query_start_loc, cu_seq_lens, state[1])

        def results():
            self.jax.block_until_ready(state)
            return {"lse": state[0], "output": state[1] if out is not None else None}

        return Bound(call, results)

    def bind_merge(self, prefix_output, prefix_lse, suffix_output, suffix_lse, *, head_dim=None,
                   prefill_tokens_with_context=None, query_start_loc=None, prefix_cu_seq_lens=None, out_dtype=None,
                   output_scale=None, return_lse=True, lse_layout="HT", lse_base=math.e, **_):
        a, b = prefix_output[..., :head_dim], suffix_output[..., :head_dim]
        api = functools.partial(
            self.pi.merge_attn_states, prefill_tokens_with_context=prefill_tokens_with_context,
            query_start_loc=query_start_loc, prefix_cu_seq_lens=prefix_cu_seq_lens, return_lse=return_lse,
            out_dtype=self._dtype(out_dtype), output_scale=output_scale, lse_layout=lse_layout, lse_base=lse_base,
            **self.kernel)
        return self._holder(lambda: _as_results(api(a, prefix_lse, b, suffix_lse), return_lse))

    def bind_merge_n(self, outputs, lses, *, head_dim=None, prefill_tokens_with_context=None, query_start_loc=None,
                     cu_seq_lens=None, out_dtype=None, output_scale=None, return_lse=True, lse_layout="HT",
                     lse_base=math.e, **_):
        o = outputs[..., :head_dim]
        api = functools.partial(
            self.pi.merge_attn_states_n, prefill_tokens_with_context=prefill_tokens_with_context,
            query_start_loc=query_start_loc, cu_seq_lens=cu_seq_lens, return_lse=return_lse,
            out_dtype=self._dtype(out_dtype), output_scale=output_scale, lse_layout=lse_layout, lse_base=lse_base,
            **self.kernel)
        return self._holder(lambda: _as_results(api(o, lses), return_lse))


    def cp_merge(self, out, lse, *, axis_name, method="gather", query_start_loc=None, cu_seq_lens=None,
                 prefill_tokens_with_context=None, out_dtype=None, output_scale=None, return_lse=True,
                 lse_layout="HT", lse_base=math.e, reduce_dtype=None, **_) -> dict[str, Any]:
        """The context-parallel combine over `axis_name` (inside `jax.shard_map` or a named `jax.vmap`)."""
        r = self.pi.cp_merge_attn_states(
            out, lse, axis_name=axis_name, method=method, query_start_loc=query_start_loc, cu_seq_lens=cu_seq_lens,
            prefill_tokens_with_context=prefill_tokens_with_context, return_lse=return_lse,
            out_dtype=self._dtype(out_dtype), output_scale=output_scale, lse_layout=lse_layout, lse_base=lse_base,
            reduce_dtype=reduce_dtype, **self.kernel)
        return _as_results(r, return_lse)


def _as_results(r, return_lse: bool) -> dict[str, Any]:
    return {"out": r[0], "lse": r[1]} if return_lse else {"out": r, "lse": None}


def set_pallas_backend(backend: str | None) -> None:
    """The `backend=` of every later "pallas" run: None (pallas_impl's default), "triton" or "mosaic_gpu"."""
    _PALLAS_BACKEND[0] = backend


def pallas_backend() -> str | None:
    return _PALLAS_BACKEND[0]


@functools.cache
def _adapter(rt_key: tuple, impl: str, backend: str | None) -> _Adapter:
    rt = Runtime(*rt_key)
    if impl == "reference":
        return ReferenceAdapter()
    if impl == "triton":
        return TritonAdapter(rt)
    if impl == "pallas":
        return JaxAdapter(rt, impl, backend=backend)
    if impl == "jnp":
        return JaxAdapter(rt, impl)
    if impl == "mosaic":
        return JaxAdapter(rt, "pallas", backend="mosaic_gpu")
    if impl == "mosaic-lowered":  # compiled kernels even on a CPU: for jax.export(platforms=["cuda"]) only
        return JaxAdapter(rt, "pallas", backend="mosaic_gpu", interpret=False)
    raise ValueError(f"impl must be one of {IMPLS + EXPERIMENTAL_IMPLS}, got {impl!r}")


def adapter(rt: Runtime, impl: str) -> _Adapter:
    """The adapter of `impl` ("reference", "triton", "pallas", "jnp", "mosaic"), imported once."""
    return _adapter((rt.device, rt.mode), impl, _PALLAS_BACKEND[0] if impl == "pallas" else None)


# ---------------------------------------------------------------------------------------------------------
# Operations on a case's arrays


def op_call(op: str, case: cases_mod.Case, arrays: dict[str, Any]) -> tuple[str, tuple, dict[str, Any]]:
    """(adapter method, positional arrays, options) of `op` on `arrays` (the keys of `cases.make_inputs` /
    `make_inputs_n`, in one implementation's array type), with the case's options.

    "merge" reads `prefix_output` / `prefix_lse` as given: the caller passes the masked prefix there.
    "merge_n" reads `lses` as given: the caller passes the masked LSEs there.
    """
    D = case.head_dim
    if op == "mask":
        return "mask", (arrays["prefix_lse"], arrays["query_start_loc"], arrays["cu_seq_lens"],
                        arrays["prefix_output"]), dict(head_dim=D, lse_layout=case.lse_layout)
    opts = dict(_merge_options(case), head_dim=D, head_pad=case.head_pad, output_scale=arrays.get("output_scale"))
    if op in ("merge", "merge_fused"):
        if op == "merge_fused":
            opts.update(query_start_loc=arrays["query_start_loc"], prefix_cu_seq_lens=arrays["cu_seq_lens"])
        return "merge", (arrays["prefix_output"], arrays["prefix_lse"], arrays["suffix_output"],
                         arrays["suffix_lse"]), opts
    if op in ("merge_n", "merge_n_fused"):
        if op == "merge_n_fused":
            opts.update(query_start_loc=arrays["query_start_loc"], cu_seq_lens=arrays["cu_seq_lens"])
        return "merge_n", (arrays["outputs"], arrays["lses"]), dict(opts, strided=case.strided)
    raise ValueError(f"op must be one of {OPS}, got {op!r}")


def bind(rt: Runtime, impl: str, op: str, case: cases_mod.Case, arrays: dict[str, Any]) -> Bound:
    method, args, opts = op_call(op, case, arrays)
    return getattr(adapter(rt, impl), "bind_" + method)(*args, **opts)


def run(rt: Runtime, impl: str, op: str, case: cases_mod.Case, arrays: dict[str, Any]) -> dict[str, Any]:
    """Run `op` of `impl` on a case's arrays; returns the results dict of the adapter."""
    return bind(rt, impl, op, case, arrays)()


def ops_of(case: cases_mod.Case) -> tuple[str, ...]:
    """The operations `check` and the golden vectors run on `case`."""
    if case.n_way:
        return ("merge_n", "merge_n_fused")
    return ("mask", "merge", "merge_fused") if case.empty else ("mask", "merge")


def masked_lses(case: cases_mod.Case, inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The N-way case's LSEs after the reference mask of each partial: the "merge_n" operand (exact)."""
    lses = inputs["lses"]
    out = np.empty_like(lses)
    for i in range(case.partials):
        out[i] = reference.mask_empty_context_lse(lses[i], inputs["query_start_loc"], inputs["cu_seq_lens"][i],
                                                  lse_layout=case.lse_layout)[0]
    return out
