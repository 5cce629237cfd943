"""Compile both frameworks' kernels to sm_90 PTX on a machine without a GPU and count memory instructions.

    python scripts/ptx_offline.py [OUT_DIR]

Triton kernels are compiled from source, in both LSE layouts, with the runtime specialisation a contiguous
launch gets (unit LSE/dim strides, other specialisable strides and pointers multiples of 16). Pallas kernels
are lowered for CUDA with `jax.export`; the Triton IR inside XLA's custom call is decoded with jaxlib's Triton
dialect and compiled with the installed Triton. That is the Pallas kernel's IR through *this* Triton, not
through XLA's own Triton pipeline, so it shows what the lowering asks for (loads, stores, vector widths), not
the final GPU code.
"""

from __future__ import annotations

import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import triton  # noqa: E402
from jax import export  # noqa: E402
from jax._src.interpreters import mlir  # noqa: E402
from jax._src.lib.mlir import ir  # noqa: E402
from jaxlib.triton import dialect as tt_dialect  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from mla_lse_common import constants, tiles  # noqa: E402
from pallas_impl import mask as pmask  # noqa: E402
from pallas_impl import merge as pmerge  # noqa: E402
from triton_impl import _backend as tbackend  # noqa: E402
from triton_impl import mask as tmask  # noqa: E402
from triton_impl import merge as tmerge  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
T, H, D, R = 32768, 64, 128, 256


def stats(ptx: str) -> dict:
    out = {}
    for op in ("ld.global", "st.global"):
        out[op] = len(re.findall(rf"{op}\b", ptx))
        out[op + ".v4"] = len(re.findall(rf"{op}(?:\.\w+)*\.v4\.", ptx))
    out["lines"] = ptx.count("\n")
    return out


def triton_ptx(kernel, pointer_types: dict, constexprs: dict, num_warps: int) -> str:
    names = kernel.arg_names
    sig = {n: pointer_types.get(n, "i32") for n in names}
    sig.update({k: "constexpr" for k in constexprs})
    # Pointers and the strides Triton may specialise are multiples of 16 in a contiguous launch.
    free = {names[i] if isinstance(i, int) else i for i in (kernel.do_not_specialize or ())}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in constexprs and n not in free and (n.endswith("_ptr") or n.startswith("stride_"))}
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=TARGET, options=dict(num_warps=num_warps, **tbackend.PARITY_LAUNCH)).asm["ptx"]


def pallas_ptx(fn, args, num_warps: int) -> str:
    lowered = export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=[
        export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    ctx = mlir.make_ir_context()
    tt_dialect.register_dialect(ctx)
    with ctx:
        module = ir.Module.parse(lowered.mlir_module())
        calls = []

        def walk(op):
            for region in op.regions:
                for block in region.blocks:
                    for o in block.operations:
                        if o.operation.name == "stablehlo.custom_call":
                            calls.append(o)
                        walk(o.operation)

        walk(module.operation)
        config = ir.DictAttr(calls[0].attributes["mhlo.backend_config"])
        ttir = str(ir.Module.parse(bytes(ir.StringAttr(config["ir"]).value_bytes)))
    # jaxlib's Triton dialect prints a load's eviction policy in an older syntax than this Triton parses.
    ttir = re.sub(r" evictionPolicy = (\w+) :", r" {cachePolicy = #tt.cache_policy<cache_modifier = none, "
                  r"eviction_policy = \1>} :", ttir)
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "pallas_kernel.ttir")
    with open(path, "w") as f:
        f.write(ttir)
    return triton.compile(path, target=TARGET, options=dict(num_warps=num_warps)).asm["ptx"]


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else None
    sds = jax.ShapeDtypeStruct
    i32 = sds((R + 1,), jnp.int32)
    block_h, _, _ = tiles.mask_tiles(H, 1)
    # The unit LSE stride of each layout, as a contiguous launch specialises it (token stride in [H, T], head
    # stride in [T, H]); the other (T or H) is a multiple of 16 unless listed in do_not_specialize.
    unit = {"HT": "stride_{}_t", "TH": "stride_{}_h"}
    ptx = {}
    for layout in constants.LSE_LAYOUTS:
        ptx[f"triton mask {layout}"] = triton_ptx(
            tmask._mask_empty_context_lse_kernel[layout], dict(lse_ptr="*fp32", out_ptr="*fp32", qsl_ptr="*i32",
                                                               cu_ptr="*i32"),
            dict(NUM_HEADS=H, HEAD_DIM=1, BLOCK_T=tiles.MASK_BLOCK_T, SCAN=tiles.SCAN, N_INTERPRET=0, BLOCK_H=block_h,
                 BLOCK_HO=1, BLOCK_D=1, ZERO_OUTPUT=False, SPLIT_BLOCKS=False, stride_out_t=0, stride_out_h=0, stride_out_d=0,
                 **{unit[layout].format("lse"): 1}), tiles.MASK_NUM_WARPS["triton"])
    ptx["pallas mask HT"] = pallas_ptx(
        lambda lse, q, c: pmask._mask_jit(lse, q, c, None, lse_layout="HT", interpret=False),
        (sds((H, T), jnp.float32), i32, i32), tiles.MASK_NUM_WARPS["pallas"])
    block_t, block_h, block_d = tiles.merge_tiles("triton", H, D, "lse")
    for layout in constants.LSE_LAYOUTS:
        ptx[f"triton merge {layout}"] = triton_ptx(
            tmerge._merge_attn_states_kernel[layout],
            dict(out_ptr="*bf16", out_lse_ptr="*fp32", prefix_ptr="*bf16", prefix_lse_ptr="*fp32",
                 suffix_ptr="*bf16", suffix_lse_ptr="*fp32", scale_ptr="*fp32", qsl_ptr="*i32", cu_ptr="*i32"),
            dict(NUM_HEADS=H, HEAD_DIM=D, BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, SCAN=tiles.SCAN,
                 N_INTERPRET=0, LSE_BASE2=False, OUTPUT_LSE=True, FUSED_MASK=False, FP8_OUT=False, INTERPRET=False,
                 stride_out_d=1, stride_p_d=1, stride_s_d=1,
                 **{unit[layout].format(x): 1 for x in ("olse", "plse", "slse")}),
            tiles.merge_num_warps("triton", "lse"))
    x, lse = sds((T, H, D), jnp.bfloat16), sds((H, T), jnp.float32)
    ptx["pallas merge HT"] = pallas_ptx(
        lambda a, p, b, s: pmerge._merge_jit(a, p, b, s, None, None, None, None, return_lse=True,
                                             out_dtype=jnp.dtype(jnp.bfloat16), lse_layout="HT", lse_base2=False,
                                             interpret=False),
        (x, lse, x, lse), tiles.merge_num_warps("pallas", "lse"))
    for name, text in ptx.items():
        print(f"{name:16s}", stats(text))
        if out_dir:
            with open(os.path.join(out_dir, name.replace(" ", "_") + ".ptx"), "w") as f:
                f.write(text)


if __name__ == "__main__":
    main()
