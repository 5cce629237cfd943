"""N-way merge tile sweep (GPU): python scripts/tune_n.py OUT.json. Sets MERGE_N_TILES of both frameworks to
each tile (bytes of one input tile, fewest tokens, warps), times the lse and fused variants at T = 32K, H = 64,
D = 128, bf16, N in (4, 8); Triton by CUDA-graph replay, JAX by profiler kernel time; % of a torch.add 2R1W."""
import functools
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import torch  # noqa: E402

import pallas_impl  # noqa: E402
import triton_impl  # noqa: E402
from pallas_impl import _common as pc  # noqa: E402
from parity import bench, bridge, cases  # noqa: E402
from triton_impl import _common as tc  # noqa: E402

TILES = [(8192, 1, 4), (4096, 1, 4), (8192, 2, 4), (8192, 4, 4), (4096, 4, 4), (8192, 1, 8), (16384, 1, 8)]
n = bench.CEILING_ELEMS
a, b, c = (torch.ones(n, dtype=torch.bfloat16, device="cuda") for _ in range(3))
ceiling = 6 * n / bench.time_cudagraph(lambda: torch.add(a, b, out=c), 20)[0][1] / 1e6
a = b = c = None
rows = []
T, H, D = 32768, 64, 128
for N in (4, 8):
    g = torch.Generator(device="cuda").manual_seed(0)
    o = torch.randn(N, T, H, D, generator=g, device="cuda", dtype=torch.bfloat16)
    l = torch.randn(N, H, T, generator=g, device="cuda") * 3 + 4
    out, olse = torch.empty(T, H, D, dtype=torch.bfloat16, device="cuda"), torch.empty(H, T, device="cuda")
    fc = bench.MergePoint(T, H, D, "bfloat16", "fused", N).fused_case()
    q_np, cu_np = cases.offsets_n(fc)
    q, cu = torch.from_numpy(q_np).cuda(), torch.from_numpy(cu_np).cuda()
    jo, jl, jq, jcu = bridge.torch_to_jax(o), bridge.torch_to_jax(l), jax.device_put(q_np), jax.device_put(cu_np)
    for tile in TILES:
        for common in (tc, pc):
            common.MERGE_N_TILES = {v: tuple(tile) for v in common.MERGE_N_TILES}
            common.merge_tiles.cache_clear()
        jax.clear_caches()
        row = dict(N=N, tile=list(tile))
        for variant in ("lse", "fused"):
            kw = dict(query_start_loc=q, cu_seq_lens=cu) if variant == "fused" else {}
            us = bench.time_cudagraph(functools.partial(triton_impl.merge_attn_states_n, out, o, l, olse, **kw), 20)[0][1]
            jkw = dict(query_start_loc=jq, cu_seq_lens=jcu) if variant == "fused" else {}
            last = [None]
            def call(jkw=jkw):
                last[0] = pallas_impl.merge_attn_states_n(jo, jl, **jkw)
            got = bench.time_jax_profiler(call, lambda: jax.block_until_ready(last[0]), 10)
            pus = got[0][1] if got else float("nan")
            nbytes = bench.MergePoint(T, H, D, "bfloat16", variant, N).bytes
            row[f"triton_{variant}_pct"] = round(100 * nbytes / us / 1e6 / ceiling, 1)
            row[f"pallas_{variant}_pct"] = round(100 * nbytes / pus / 1e6 / ceiling, 1)
        print(json.dumps(row), flush=True)
        rows.append(row)
    o = l = jo = jl = None
    torch.cuda.empty_cache()
json.dump({"ceiling_tbps": ceiling, "rows": rows}, open(sys.argv[1], "w"), indent=1)
