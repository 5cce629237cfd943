"""Test helper: what Triton keys a kernel's compile cache by (shared by the Triton kernels' tests).

Each kernel module holds its kernel as {lse_layout: @triton.jit kernel} (`_backend.jit_per_lse_layout`)."""

import inspect
import re


def kernel_params(kernel):
    """(parameter names, constexpr names, do_not_specialize, do_not_specialize_on_alignment) of a
    @triton.jit kernel, compiled or interpreted."""
    params = list(inspect.signature(kernel.fn).parameters.values())
    names = [prm.name for prm in params]
    constexprs = {prm.name for prm in params if "constexpr" in str(prm.annotation)}

    def listed(attr):
        x = getattr(kernel, attr, None)
        if x is None:  # the interpreter keeps the decorator's arguments
            x = getattr(kernel, "kwargs", {}).get(attr) or []
        return {names[i] if isinstance(i, int) else i for i in x}

    return names, constexprs, listed("do_not_specialize"), listed("do_not_specialize_on_alignment")


def lse_strides(names, dim):
    """The parameters among `names` that are an LSE's stride along `dim` ("h" or "t"), e.g. stride_plse_h."""
    return {n for n in names if re.fullmatch(rf"stride_\w*lse_{dim}", n)}


def specialisation_key(kernel, args, kwargs) -> dict:
    """What Triton keys its compile cache by for one launch of `kernel`: each runtime argument's specialisation
    (its type, and for integers and pointers whether it is 1 or a multiple of 16), every constexpr value and the
    launch options. Equal keys reuse one compiled kernel."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    names, constexprs, dns, dns_align = kernel_params(kernel)
    bound = dict(zip(names, args))
    bound.update((k, v) for k, v in kwargs.items() if k in names)
    key = {name: repr(bound[name]) if name in constexprs else tuple(
        native_specialize_impl(BaseBackend, bound[name], False, name not in dns, name not in dns_align))
        for name in names}
    key.update((k, repr(v)) for k, v in kwargs.items() if k not in names)
    return key


class _LayoutRecorder:
    """Stands in for one layout's @triton.jit kernel: records each launch's arguments instead of running it."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))

    def keys(self):
        return [specialisation_key(self.kernel, args, kwargs) for args, kwargs in self.launches]


class Recorder(dict):
    """Stands in for a module's {lse_layout: kernel}: `recorder[layout].launches`, `recorder[layout].keys()`."""

    def __init__(self, kernels):
        super().__init__({layout: _LayoutRecorder(kernel) for layout, kernel in kernels.items()})


def variants(keys) -> list[dict]:
    """The distinct keys (compiled variants) among `keys`, in order of first use."""
    out = []
    for key in keys:
        if key not in out:
            out.append(key)
    return out


def assert_one_variant(keys, what):
    first = keys[0]
    diffs = {}
    for i, key in enumerate(keys[1:], 1):
        diff = {k: (first.get(k), key.get(k)) for k in first.keys() | key.keys() if first.get(k) != key.get(k)}
        if diff:
            diffs[f"launch {i}"] = diff
    assert not diffs, f"{what}: these launches need other compiled variants than launch 0: {diffs}"
