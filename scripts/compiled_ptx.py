"""The PTX the GPU actually runs for the fused merges: Triton's (its compile cache) beside the Pallas kernels' as
XLA's own Triton pipeline compiled them (XLA's dump), with the instruction counts of `scripts/ptx_fused.py`.

    python scripts/compiled_ptx.py OUT_DIR        # GPU; writes OUT_DIR/{triton,pallas}_*.ptx and prints the counts

`scripts/ptx_fused.py` compiles the Pallas kernels' Triton IR with the Triton installed beside torch, which need
not be the one inside XLA; this script reads what XLA built. Shapes as there: T = 32768, H = 64, D = 128 bf16,
R = 256, [H, T] LSEs; 2-way and N = 4, fused mask and output LSE, each framework's own tiles.
"""

from __future__ import annotations

import glob
import os
import sys
import tarfile
import tempfile

OUT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else "compiled_ptx")
os.makedirs(OUT, exist_ok=True)
XLA_DUMP = tempfile.mkdtemp()
TRITON_CACHE = tempfile.mkdtemp()
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={XLA_DUMP}"
os.environ["TRITON_CACHE_DIR"] = TRITON_CACHE
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import pallas_impl  # noqa: E402
import ptx_fused  # noqa: E402
import triton_impl  # noqa: E402

T, H, D, R, N = ptx_fused.T, ptx_fused.H, ptx_fused.D, ptx_fused.R, ptx_fused.N


def main() -> None:
    qsl = np.linspace(0, T, R + 1).astype(np.int32)
    cu = np.repeat(np.arange(R + 1, dtype=np.int32) // 2, 1) * 8
    cus = np.stack([cu] * N)
    dev = torch.device("cuda")
    x = torch.randn(N, T, H, D, device=dev, dtype=torch.bfloat16)
    lse = torch.randn(N, H, T, device=dev)
    q, c, cn = (torch.from_numpy(v).to(dev) for v in (qsl, cu, cus))
    out, olse = torch.empty(T, H, D, device=dev, dtype=torch.bfloat16), torch.empty(H, T, device=dev)
    triton_impl.merge_attn_states(out, x[0], lse[0], x[1], lse[1], olse, query_start_loc=q, prefix_cu_seq_lens=c)
    triton_impl.merge_attn_states_n(out, x, lse, olse, query_start_loc=q, cu_seq_lens=cn)
    torch.cuda.synchronize()
    jx, jl = jnp.asarray(x.float().cpu().numpy()).astype(jnp.bfloat16), jnp.asarray(lse.cpu().numpy())
    jq, jc, jcn = jnp.asarray(qsl), jnp.asarray(cu), jnp.asarray(cus)
    jax.block_until_ready(jax.jit(lambda a, p, b, s: pallas_impl.merge_attn_states(
        a, p, b, s, query_start_loc=jq, prefix_cu_seq_lens=jc))(jx[0], jl[0], jx[1], jl[1]))
    jax.block_until_ready(jax.jit(lambda o, l: pallas_impl.merge_attn_states_n(
        o, l, query_start_loc=jq, cu_seq_lens=jcn))(jx, jl))
    found = {}
    for path in glob.glob(os.path.join(TRITON_CACHE, "**", "*.ptx"), recursive=True):
        name = os.path.basename(path)[:-4]
        found[f"triton_{name}"] = open(path).read()
    for path in glob.glob(os.path.join(XLA_DUMP, "*.ptx")):
        text = open(path).read()
        for kernel in ("merge_attn_states_n", "merge_attn_states"):
            if f".entry {kernel}" in text or f".entry {kernel}_" in text:
                found[f"pallas_{kernel}"] = text
                break
    with tarfile.open(os.path.join(OUT, "xla_dump_ptx.tgz"), "w:gz") as tar:
        for path in glob.glob(os.path.join(XLA_DUMP, "*.ptx")):
            tar.add(path, arcname=os.path.basename(path))
    rows = {}
    for name, text in sorted(found.items()):
        with open(os.path.join(OUT, name + ".ptx"), "w") as f:
            f.write(text)
        rows[name] = ptx_fused.counts(ptx_fused.body(text))
    if not rows:
        print("no PTX found", file=sys.stderr)
        return
    keys = list(next(iter(rows.values())))
    print(f"{'':32s}" + "".join(f"{k:>14s}" for k in keys))
    for name, row in rows.items():
        print(f"{name:32s}" + "".join(f"{row[k]:14d}" for k in keys))


if __name__ == "__main__":
    main()
