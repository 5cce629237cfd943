"""Compile the fused merges (2-way and N-way, fused mask and output LSE) of both frameworks to sm_90 PTX offline
and count what differs: memory instructions by width, barriers, shared-memory traffic, branches, labels.

    python scripts/ptx_fused.py [OUT_DIR]        # on a CPU; no GPU needed

The experiment behind the Pallas fused merges' gap to Triton's fused time on the H200 (docs/results.md).
Same method and caveat as `scripts/ptx_offline.py` (its helpers): the Pallas kernel is its Triton IR through
*this* Triton, not XLA's bundled one, so it shows what the lowering asks for, not XLA's final code. Shape:
T = 32768, H = 64, D = 128 bf16, R = 256, [H, T] LSEs, N = 4 partials; each framework's own tiles.
"""

from __future__ import annotations

import collections
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ptx_offline as po  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from mla_lse_common import tiles  # noqa: E402
from pallas_impl import merge as pmerge  # noqa: E402
from pallas_impl import merge_n as pmerge_n  # noqa: E402
from triton_impl import merge as tmerge  # noqa: E402
from triton_impl import merge_n as tmerge_n  # noqa: E402
from triton_impl import _plans as tplans  # noqa: E402

T, H, D, R, N = 32768, 64, 128, 256, 4
BF16 = jnp.dtype(jnp.bfloat16)


def body(ptx: str) -> list[str]:
    """The instruction lines of the kernel (debug sections and comments dropped)."""
    out = []
    for line in ptx.split("\n"):
        s = line.strip()
        if s.startswith(".section"):
            break
        if s and not s.startswith(("//", ".loc", ".file")):
            out.append(s)
    return out


def counts(lines: list[str]) -> dict:
    ops = collections.Counter()
    for s in lines:
        if s.endswith(":") or s.startswith((".", "{", "}", ")", "(")):
            continue
        words = s.split()
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        ops[op.rstrip(";")] += 1
    want = {"ld.global": r"ld\.global", "ld.global.v4": r"ld\.global(\.\w+)*\.v4", "st.global": r"st\.global",
            "st.global.v4": r"st\.global(\.\w+)*\.v4", "ld/st.shared": r"(ld|st)\.shared", "bar.sync": r"bar\.sync",
            "redux/shfl": r"(redux|shfl)", "bra": r"bra", "ex2": r"ex2", "setp": r"setp", "selp": r"selp"}
    got = {k: sum(v for op, v in ops.items() if re.match(p, op)) for k, p in want.items()}
    got["labels"] = sum(1 for s in lines if s.endswith(":"))
    got["instructions"] = sum(ops.values())
    return got


def main() -> None:
    out_dir = sys.argv[1] if len(sys.argv) > 1 else None
    sds = jax.ShapeDtypeStruct
    i32 = sds((R + 1,), jnp.int32)
    ptx = {}
    bt, bh, bd = tiles.merge_tiles("triton", H, D, "fused")
    print(f"2-way fused tile (BLOCK_T, BLOCK_H, BLOCK_D): triton {(bt, bh, bd)}, pallas {tiles.merge_tiles('pallas', H, D, 'fused')}")
    ptx["triton merge fused"] = po.triton_ptx(
        tmerge._merge_attn_states_kernel["HT"],
        dict(out_ptr="*bf16", out_lse_ptr="*fp32", prefix_ptr="*bf16", prefix_lse_ptr="*fp32", suffix_ptr="*bf16",
             suffix_lse_ptr="*fp32", scale_ptr="*fp32", qsl_ptr="*i32", cu_ptr="*i32"),
        dict(NUM_HEADS=H, HEAD_DIM=D, BLOCK_T=bt, BLOCK_H=bh, BLOCK_D=bd, SCAN=tiles.SCAN, N_INTERPRET=0,
             LSE_BASE2=False, OUTPUT_LSE=True, FUSED_MASK=True, FP8_OUT=False, INTERPRET=False,
             stride_out_d=1, stride_p_d=1, stride_s_d=1, stride_olse_t=1, stride_plse_t=1, stride_slse_t=1),
        tiles.merge_num_warps("triton", "fused"))
    x, lse = sds((T, H, D), BF16), sds((H, T), jnp.float32)
    ptx["pallas merge fused"] = po.pallas_ptx(
        lambda a, p, b, s, q, cu: pmerge._merge_jit(a, p, b, s, None, q, cu, None, return_lse=True, out_dtype=BF16,
                                                   lse_layout="HT", lse_base2=False, interpret=False),
        (x, lse, x, lse, i32, i32), tiles.merge_num_warps("pallas", "fused"))
    bt, bh, bd = tiles.merge_tiles("triton", H, D, "fused", 2, N)
    print(f"N-way fused tile at N = {N}: triton {(bt, bh, bd)}, pallas {tiles.merge_tiles('pallas', H, D, 'fused', 2, N)}")
    ptx["triton merge_n fused"] = po.triton_ptx(
        tmerge_n._merge_attn_states_n_kernel["HT"],
        dict(out_ptr="*bf16", out_lse_ptr="*fp32", outs_ptr="*bf16", lses_ptr="*fp32", scale_ptr="*fp32",
             qsl_ptr="*i32", cu_ptr="*i32", wlse_ptr="*fp32"),
        dict(NUM_PARTIALS=N, NUM_HEADS=H, HEAD_DIM=D, BLOCK_T=bt, BLOCK_H=bh, BLOCK_D=bd, SCAN=tiles.SCAN,
             N_INTERPRET=0, LSE_BASE2=False, OUTPUT_LSE=True, FUSED_MASK=True, FP8_OUT=False, INTERPRET=False,
             **tplans.n_way_loops("fused", N), OUT_EVICT=tiles.outputs_evict("triton", N),
             GIVEN_MZ=False, GIVEN_W=False, EARLY_OUTPUTS=tiles.early_outputs("triton", "fused", N), stride_out_d=1,
             stride_o_d=1, stride_olse_t=1, stride_lse_t=1, stride_wlse_t=1),
        tiles.merge_num_warps("triton", "fused", N))
    ptx["pallas merge_n fused"] = po.pallas_ptx(
        lambda o, l, q, cu: pmerge_n._merge_n_jit(o, l, None, q, cu, None, return_lse=True, out_dtype=BF16,
                                                 lse_layout="HT", lse_base2=False, interpret=False),
        (sds((N, T, H, D), BF16), sds((N, H, T), jnp.float32), i32, sds((N, R + 1), jnp.int32)),
        tiles.merge_num_warps("pallas", "fused", N))
    rows = {name: counts(body(text)) for name, text in ptx.items()}
    keys = list(next(iter(rows.values())))
    print(f"{'':22s}" + "".join(f"{k:>14s}" for k in keys))
    for name, row in rows.items():
        print(f"{name:22s}" + "".join(f"{row[k]:14d}" for k in keys))
        if out_dir:
            with open(os.path.join(out_dir, name.replace(" ", "_") + ".ptx"), "w") as f:
                f.write(ptx[name])


if __name__ == "__main__":
    main()
