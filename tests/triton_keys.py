"""Test helper: what Triton keys a kernel's compile cache by (shared by the Triton mask and merge tests)."""

import inspect


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
