"""The context-parallel reproduction (docs/spec.md 9): `python -m parity demo --cp N`.

A prefill batch's cached context is sharded over N context-parallel ranks the way vLLM's DCP places KV (token j
of a request on rank `(j // interleave) % N`, `chunked_prefill.planner.cp_shard`), so a short context leaves ranks with
no KV for its request. Each rank runs attention of all queries over its local KV with a backend's empty-row
behaviour (`EMPTY_BEHAVIORS`: FA2 +inf, FA3 -inf, a finite LSE with NaN output); the N partials are combined
across the ranks, then merged with the causal attention over the new tokens, and compared with monolithic
float64 attention. Paths:

- `no_mask`: upstream's combine (`cp_lse_ag_out_rs` trusts every rank's LSE): the N-way merge without offsets,
  and the final merge without the fused mask;
- `gather`, `reduce_scatter`: `cp_merge_attn_states` with each rank's local KV offsets (the fix), then the final
  merge with the fused mask over the whole-context offsets (requests without any context).

Ranks run on the frameworks' own engines: torch on `torch.distributed` (N spawned gloo processes on CPU, the
Triton interpreter; NCCL when N GPUs are visible), JAX inside `jax.shard_map` over N devices, or, with fewer
devices (one GPU), over N ranks simulated by `jax.vmap` with an axis name (the same collectives, one device).
"""

from __future__ import annotations


import numpy as np

from parity.tools.chunked_prefill.attention import EMPTY_BEHAVIORS, attention_jax, attention_torch, bucket_size
from parity.tools.chunked_prefill.planner import cp_shard
from parity.tools.chunked_prefill.reference import PrefillBatch, make_batch, reference_prefill
from parity.tools.demo.rows import CORRUPTING_BEHAVIOR, FRAMEWORKS, TOLERANCE, judge_row, verdict

CP_PATHS = ("no_mask", "gather", "reduce_scatter")
CP_FIXED = ("gather", "reduce_scatter")
SIZES = ("default", "large")


def cp_config(size: str = "default", seed: int = 0) -> dict:
    """The batch of the CP demo (`make_batch` keyword arguments). Requests with context come first (as upstream
    orders them), so the final merge has pass-through rows. default: 8 requests, contexts 0 to 41 tokens
    (several shorter than the group), H = 4 (a multiple of N = 2 or 4), Dqk = 64, Dv = 32. large (GPU-sized):
    64 requests, contexts 0 to 3000 with a fifth under 16 tokens, H = 16, Dqk = 192, Dv = 128."""
    if size == "default":
        return dict(context_lens=[41, 3, 1, 12, 2, 7, 25, 0], query_lens=[5, 4, 7, 3, 2, 6, 1, 8], num_heads=4,
                    qk_dim=64, v_dim=32)
    if size == "large":
        rng = np.random.default_rng(seed + 104729)
        ctx = rng.integers(1, 3001, size=64)
        short = rng.random(64) < 0.2
        ctx[short] = rng.integers(0, 16, size=int(short.sum()))
        ctx[-1] = 0  # a request without context
        ctx = np.concatenate([ctx[ctx > 0], ctx[ctx == 0]])
        qlen = rng.integers(1, 129, size=64)
        return dict(context_lens=ctx.tolist(), query_lens=qlen.tolist(), num_heads=16, qk_dim=192, v_dim=128)
    raise ValueError(f"size must be one of {SIZES}, got {size!r}")


def _offsets_for(path: str, qsl, cu):
    return {} if path == "no_mask" else dict(query_start_loc=qsl, cu_seq_lens=cu)


def _method(path: str) -> str:
    return "reduce_scatter" if path == "reduce_scatter" else "gather"


# --------------------------------------------------------------------------------------------------
# torch: N ranks on torch.distributed


def _torch_rank(rank: int, world: int, group, config: dict, behaviors: tuple, interleave: int, device: str) -> dict:
    """One rank, for each empty behaviour: its attention partial over its KV shard, then every path's combine.
    Returns {behaviour: {path: numpy (context out [T, H_own, Dv], context lse [H_own, T])}} (H_own: all heads, or
    this rank's for reduce_scatter)."""
    import torch

    from parity.library import bridge
    from parity.harness import impls

    rt = impls.Runtime(device, "gpu-bitwise" if device == "cuda" else "cpu-interpreters")  # torch only: no JAX here
    a = impls.adapter(rt, "triton")
    batch = make_batch(**config)
    idx, cu_host = cp_shard(batch.context_lens, batch.context_start_loc, world, interleave)[rank]

    def up(x):
        return torch.from_numpy(np.ascontiguousarray(x)).to(device)

    q, ctx_k, ctx_v = up(batch.q), up(batch.ctx_k), up(batch.ctx_v)
    qsl, cu = up(batch.query_start_loc), up(cu_host)
    results = {}
    for behavior in behaviors:
        out, lse = attention_torch(q, ctx_k[up(idx)], ctx_v[up(idx)], batch.query_start_loc, cu_host, causal=False,
                                   empty_behavior=behavior, scale=batch.scale)
        results[behavior] = {}
        for path in CP_PATHS:
            r = a.bind_cp_merge(out, lse, group, method=_method(path), **_offsets_for(path, qsl, cu))()
            results[behavior][path] = (bridge.to_numpy(r["out"]), bridge.to_numpy(r["lse"]))
    return results


def _cp_torch(batch_config: dict, world: int, behaviors: tuple, interleave: int) -> tuple[dict, str]:
    """Every behaviour's combined results ({behaviour: {path: (out, lse)}}) from one launch of `world` ranks, and
    where they ran."""
    import torch

    from parity.tools import ranks

    use_nccl = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device, backend = ("cuda", "nccl") if use_nccl else ("cpu", "gloo")
    # CPU ranks (also on a machine with fewer GPUs than ranks) run Triton's interpreter (ranks.run_ranks).
    got = ranks.run_ranks(_torch_rank, world, batch_config, tuple(behaviors), interleave, device, backend=backend)
    for r, res in enumerate(got):
        if res[0] != "ok":
            raise RuntimeError(f"CP rank {r} failed: {res[1]}\n{res[2]}")
    per_rank = [res[1] for res in got]
    results = {}
    for behavior in behaviors:
        results[behavior] = {}
        for path in CP_PATHS:
            if _method(path) == "gather":
                results[behavior][path] = per_rank[0][behavior][path]  # every rank holds the same result
            else:  # rank r holds heads [r * H / N, (r + 1) * H / N)
                results[behavior][path] = (
                    np.concatenate([p[behavior][path][0] for p in per_rank], axis=1),
                    np.concatenate([p[behavior][path][1] for p in per_rank], axis=0))
    return results, f"{world} {backend} ranks ({device})"


# --------------------------------------------------------------------------------------------------
# JAX: N devices of a mesh, or N ranks simulated by a named vmap


def _cp_jax(batch: PrefillBatch, world: int, behavior: str, interleave: int, implementation: str) -> tuple[dict, str]:
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from parity.harness import impls

    a = impls.adapter(impls.make_runtime(), implementation)
    q, ctx_k, ctx_v = jnp.asarray(batch.q), jnp.asarray(batch.ctx_k), jnp.asarray(batch.ctx_v)
    outs, lses, cus = [], [], []
    for idx, cu in cp_shard(batch.context_lens, batch.context_start_loc, world, interleave):
        idx = np.pad(idx.astype(np.int32), (0, bucket_size(idx.size) - idx.size))  # rows past cu[R] are never read
        o, l = attention_jax(q, ctx_k[idx], ctx_v[idx], batch.query_start_loc, cu, causal=False,
                             empty_behavior=behavior, scale=batch.scale)
        outs.append(o)
        lses.append(l)
        cus.append(cu)
    O, L, CU = jnp.stack(outs), jnp.stack(lses), jnp.asarray(np.stack(cus))
    qsl = jnp.asarray(batch.query_start_loc)
    on_mesh = len(jax.devices()) >= world
    results = {}
    for path in CP_PATHS:
        def rank_fn(o, l, cu, path=path):
            offs = _offsets_for(path, qsl, cu)
            r = a.cp_merge(o, l, axis_name="cp", method=_method(path), **offs)
            return r["out"], r["lse"]

        if on_mesh:
            mesh = jax.make_mesh((world,), ("cp",), axis_types=(jax.sharding.AxisType.Auto,),
                                 devices=jax.devices()[:world])

            def stacked(o, l, cu, rank_fn=rank_fn):  # each device returns its result on a leading axis
                out, lse = rank_fn(o[0], l[0], cu[0])
                return out[None], lse[None]

            out, lse = jax.jit(jax.shard_map(stacked, mesh=mesh, in_specs=(P("cp"),) * 3,
                                             out_specs=(P("cp"), P("cp"))))(O, L, CU)
        else:
            out, lse = jax.vmap(rank_fn, axis_name="cp")(O, L, CU)
        out, lse = np.asarray(out), np.asarray(lse)
        if _method(path) == "gather":
            results[path] = (out[0], lse[0])
        else:
            results[path] = (np.concatenate(list(out), axis=1), np.concatenate(list(lse), axis=0))
    where = f"{world}-device mesh" if on_mesh else f"{world} ranks simulated by jax.vmap on {jax.devices()[0].platform}"
    return results, f"{where}/{implementation}"


# --------------------------------------------------------------------------------------------------
# Entry point


def _final(framework: str, batch: PrefillBatch, path: str, ctx_out, ctx_lse, jax_impl: str):
    """The combined context merged with the causal attention over the new tokens (one process)."""
    from parity.harness import impls

    rt = impls.make_runtime()
    ptwc = batch.prefill_tokens_with_context()
    if framework == "torch":
        import torch

        dev = rt.device
        a = impls.adapter(rt, "triton")
        up = lambda x: torch.from_numpy(np.ascontiguousarray(x)).to(dev)  # noqa: E731
        q = up(batch.q)
        new_out, new_lse = attention_torch(q, up(batch.new_k), up(batch.new_v), batch.query_start_loc,
                                           batch.query_start_loc, causal=True, scale=batch.scale)
    else:
        import jax.numpy as jnp

        a = impls.adapter(rt, jax_impl)
        up = jnp.asarray
        new_out, new_lse = attention_jax(up(batch.q), up(batch.new_k), up(batch.new_v), batch.query_start_loc,
                                         batch.query_start_loc, causal=True, scale=batch.scale)
    fused = {} if path == "no_mask" else dict(query_start_loc=up(batch.query_start_loc),
                                              prefix_cu_seq_lens=up(batch.context_start_loc))
    r = a.merge(up(ctx_out), up(ctx_lse), new_out, new_lse, prefill_tokens_with_context=ptwc, return_lse=False,
                **fused)
    from parity.library import bridge

    return bridge.to_numpy(r["out"]), bridge.to_numpy(new_out)


def run_cp_demo(*, cp: int = 4, interleave: int = 1, framework: str = "both", size: str = "default",
                seed: int = 0, jax_implementation: str | None = None) -> tuple[list[dict], bool]:
    """Reproduces the context-parallel corruption and its fix (see the module docstring).

    Returns (rows, ok): one row per (framework, empty behaviour, path), as `parity.tools.demo.run_demo`'s. `ok` holds
    when both fixed paths are clean for every behaviour and the unfixed path is corrupted for the finite-LSE one.
    """
    if cp < 2:
        raise ValueError(f"--cp needs at least 2 ranks, got {cp}")
    if framework not in ("both", *FRAMEWORKS):
        raise ValueError(f"framework must be 'both', 'torch' or 'jax', got {framework!r}")
    config = dict(cp_config(size, seed), seed=seed)
    batch = make_batch(**config)
    if batch.num_heads % cp:
        raise ValueError(f"the demo batch has H={batch.num_heads} heads, not a multiple of --cp {cp} (reduce_scatter)")
    jax_impl = jax_implementation or "pallas"  # the kernels (interpret mode on CPU)
    want = reference_prefill(batch)
    shards = cp_shard(batch.context_lens, batch.context_start_loc, cp, interleave)
    empty_ranks = int(sum((np.diff(cu) == 0)[np.asarray(batch.context_lens) > 0].sum() for _, cu in shards))
    meta = dict(cp=cp, interleave=interleave, num_requests=batch.num_requests, num_tokens=batch.num_tokens,
                num_heads=batch.num_heads, empty_rank_requests=empty_ranks, tolerance=TOLERANCE,
                prefill_tokens_with_context=batch.prefill_tokens_with_context())
    rows = []
    for fw in (FRAMEWORKS if framework == "both" else (framework,)):
        if fw == "torch":  # one launch of the ranks for every behaviour
            with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
                torch_combined, torch_where = _cp_torch(config, cp, tuple(EMPTY_BEHAVIORS), interleave)
        for behavior in EMPTY_BEHAVIORS:
            with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
                if fw == "torch":
                    combined, where = torch_combined[behavior], torch_where
                else:
                    combined, where = _cp_jax(batch, cp, behavior, interleave, jax_impl)
                for path in CP_PATHS:
                    got, new_out = _final(fw, batch, path, *combined[path], jax_impl)
                    row = dict(framework=fw, device=where, empty_behavior=behavior, path=path, fixed=path in CP_FIXED)
                    expected = "clean" if path in CP_FIXED else ("corrupted" if behavior == CORRUPTING_BEHAVIOR else None)
                    judge_row(row, got, want, new_out, batch.query_start_loc, batch.prefill_tokens_with_context(),
                              expected)
                    row.update(meta)
                    rows.append(row)
    return rows, verdict(rows)
