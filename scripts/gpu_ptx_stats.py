"""Diagnostics for docs/results.md: memory instructions in the compiled merge kernels of both frameworks.

Run on a GPU from the repository root: `python scripts/gpu_ptx_stats.py [OUT_DIR]`. Compiles one merge
(T=8192, H=64, D=128, bf16, with output LSE) in each framework and counts the global loads and stores by
vector width in the PTX: Triton's from the kernel cache, Pallas's from XLA's dump (--xla_dump_to).
"""

import glob
import os
import re
import sys
import tempfile

dump = tempfile.mkdtemp(prefix="xla_dump_")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import pallas_impl  # noqa: E402
import triton_impl  # noqa: E402
from triton_impl import merge as tmerge  # noqa: E402

T, H, D = 8192, 64, 128


def stats(ptx: str) -> dict:
    out = {}
    for op in ("ld.global", "st.global"):
        for width in ("v4", "v2"):
            out[f"{op}.{width}"] = len(re.findall(rf"{op}(?:\.\w+)*\.{width}\.", ptx))
        out[f"{op}.all"] = len(re.findall(rf"{op}\b", ptx))
    return out


def main() -> None:
    a = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    lse = torch.randn(H, T, device="cuda")
    out = torch.empty_like(a)
    out_lse = torch.empty_like(lse)
    triton_impl.merge_attn_states(out, a, lse, a, lse, out_lse)
    torch.cuda.synchronize()
    ptx = ""
    for cache in tmerge._merge_attn_states_kernel.device_caches.values():
        for kernel in cache[0].values():
            ptx = kernel.asm["ptx"]
    print("triton", stats(ptx))

    ja = jnp.asarray(a.float().cpu().numpy()).astype(jnp.bfloat16)
    jl = jnp.asarray(lse.cpu().numpy())
    pallas_impl.merge_attn_states(ja, jl, ja, jl)[0].block_until_ready()
    ptx_files = sorted(glob.glob(os.path.join(dump, "**", "*.ptx"), recursive=True))
    for path in ptx_files:  # the kernel's symbol may not carry our name= in XLA's PTX: report every file
        text = open(path).read()
        print("pallas", os.path.basename(path), "merge_attn_states" in text, stats(text))
    if not ptx_files:
        print("pallas: no .ptx in the XLA dump;", len(os.listdir(dump)), "files, e.g.", sorted(os.listdir(dump))[-5:])
    if len(sys.argv) > 1:
        with open(os.path.join(sys.argv[1], "merge_triton.ptx"), "w") as f:
            f.write(ptx)


if __name__ == "__main__":
    main()
