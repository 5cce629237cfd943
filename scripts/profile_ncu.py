r"""Hardware counters of the kernels that miss their targets, beside the ones that meet them: one call of each,
captured by Nsight Compute (the experiment behind the fused-merge and mask limits, docs/design.md).

    ncu --profile-from-start off --clock-control none --csv --page details \
        --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis \
        --metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio \
        python scripts/profile_ncu.py [--only SUBSTR ...] > ncu.csv
    python scripts/profile_ncu.py --summarize ncu.csv [--only SUBSTR ...]   # the table of docs/results.md

Every point is compiled and run once first (outside the capture); then, between cudaProfilerStart and
cudaProfilerStop, each point runs once, in the order of `POINTS`, with a synchronisation after it, so the
n-th captured kernel is the n-th point (the summary sets XLA's fusions around a call apart and prints the kernel
names, so a mismatch shows). docs/results.md has a captured run.
bf16, H = 64, D = 128, LSE [H, T] natural log; fused batches as the bench's (`MergePoint.fused_case`).
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

H, D = 64, 128
# (label, framework/backend, op, T, N (0: 2-way), variant or mask seed case)
POINTS = [
    ("triton 2-way plain 32K", "triton", "merge", 32768, 0, "plain"),
    ("triton 2-way lse 32K", "triton", "merge", 32768, 0, "lse"),
    ("triton 2-way fused 32K", "triton", "merge", 32768, 0, "fused"),
    ("triton 2-way lse 2K", "triton", "merge", 2048, 0, "lse"),
    ("triton 2-way fused 2K", "triton", "merge", 2048, 0, "fused"),
    ("triton N=4 lse 32K", "triton", "merge_n", 32768, 4, "lse"),
    ("triton N=4 fused 32K", "triton", "merge_n", 32768, 4, "fused"),
    ("triton N=8 lse 32K", "triton", "merge_n", 32768, 8, "lse"),
    ("triton N=8 fused 32K", "triton", "merge_n", 32768, 8, "fused"),
    ("pallas 2-way lse 32K", "pallas", "merge", 32768, 0, "lse"),
    ("pallas 2-way fused 32K", "pallas", "merge", 32768, 0, "fused"),
    ("pallas N=4 lse 32K", "pallas", "merge_n", 32768, 4, "lse"),
    ("pallas N=4 fused 32K", "pallas", "merge_n", 32768, 4, "fused"),
    ("pallas N=8 fused 32K", "pallas", "merge_n", 32768, 8, "fused"),
    ("mosaic 2-way lse 32K", "mosaic_gpu", "merge", 32768, 0, "lse"),
    ("mosaic 2-way lse 2K", "mosaic_gpu", "merge", 2048, 0, "lse"),
    ("mosaic N=2 lse 32K", "mosaic_gpu", "merge_n", 32768, 2, "lse"),
    ("mosaic N=4 lse 32K", "mosaic_gpu", "merge_n", 32768, 4, "lse"),
    ("mosaic N=8 lse 32K", "mosaic_gpu", "merge_n", 32768, 8, "lse"),
    ("triton mask lse 131k", "triton", "mask", 0, 0, "131k_skewed"),
    ("pallas mask lse 131k", "pallas", "mask", 0, 0, "131k_skewed"),
    ("mosaic mask lse 131k", "mosaic_gpu", "mask", 0, 0, "131k_skewed"),
    ("triton mask lse 2k", "triton", "mask", 0, 0, "2k_balanced"),
    ("mosaic mask lse 2k", "mosaic_gpu", "mask", 0, 0, "2k_balanced"),
    ("triton mask+out 2k", "triton", "mask+out", 0, 0, "2k_balanced"),
    ("pallas mask+out 2k", "pallas", "mask+out", 0, 0, "2k_balanced"),
]
METRICS = {  # column: (section metric name, unit wanted)
    "us": "Duration",
    "dram %": "DRAM Throughput",
    "mem %": "Memory Throughput",
    "regs": "Registers Per Thread",
    "grid": "Grid Size",
    "block": "Block Size",
    "occ th %": "Theoretical Occupancy",
    "occ %": "Achieved Occupancy",
    "warp cyc/issue": "Warp Cycles Per Issued Instruction",
    "L2 hit %": "L2 Hit Rate",
    "L1 hit %": "L1/TEX Hit Rate",
}


def _wanted(label: str, only: list[str] | None) -> bool:
    return not only or any(o in label for o in only)


def _calls(only: list[str] | None):
    import jax
    import jax.numpy as jnp
    import torch

    import pallas_impl
    import triton_impl
    from parity.harness import cases
    from parity.tools.bench.points import MergePoint

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    calls = []
    for label, fw, op, T, N, what in POINTS:
        if not _wanted(label, only):
            continue
        if op.startswith("mask"):
            case = cases.by_name(what)
            T = case.num_tokens
            qsl_np, cu_np = cases.offsets(case)
            lse = torch.randn(H, T, generator=gen, device=dev)
            out = torch.randn(T, H, D, generator=gen, device=dev, dtype=torch.bfloat16) if op == "mask+out" else None
            if fw == "triton":
                qsl, cu = (torch.from_numpy(v).to(dev) for v in (qsl_np, cu_np))
                calls.append((label, lambda lse=lse, qsl=qsl, cu=cu, out=out: triton_impl.mask_empty_context_lse(
                    lse, qsl, cu, out, has_empty=True)))
            else:
                jl, jq, jc = jnp.asarray(lse.cpu().numpy()), jnp.asarray(qsl_np), jnp.asarray(cu_np)
                jo = None if out is None else jnp.asarray(out.float().cpu().numpy()).astype(jnp.bfloat16)
                fn = jax.jit(lambda lse, q, c, o, fw=fw: pallas_impl.mask_empty_context_lse(
                    lse, q, c, o, has_empty=True, implementation="pallas", backend="triton" if fw == "pallas" else fw))
                calls.append((label, lambda fn=fn, a=(jl, jq, jc, jo): jax.block_until_ready(fn(*a))))
            continue
        pt = MergePoint(T, H, D, "bfloat16", what, N)
        n_in = N or 2
        outs = torch.randn(n_in, T, H, D, generator=gen, device=dev, dtype=torch.bfloat16)
        lses = torch.randn(n_in, H, T, generator=gen, device=dev).mul_(3.0)
        offs = None
        if what == "fused":
            c = pt.fused_case()
            offs = cases.offsets_n(c) if N else cases.offsets(c)
        if fw == "triton":
            out = torch.empty(T, H, D, device=dev, dtype=torch.bfloat16)
            olse = torch.empty(H, T, device=dev) if what != "plain" else None
            kw = {}
            if offs is not None:
                q, cu = (torch.from_numpy(v).to(dev) for v in offs)
                kw = dict(query_start_loc=q, **({"cu_seq_lens": cu} if N else {"prefix_cu_seq_lens": cu}))
            if N:
                calls.append((label, lambda out=out, olse=olse, kw=kw, o=outs, l=lses: triton_impl.merge_attn_states_n(
                    out, o, l, olse, **kw)))
            else:
                calls.append((label, lambda out=out, olse=olse, kw=kw, o=outs, l=lses: triton_impl.merge_attn_states(
                    out, o[0], l[0], o[1], l[1], olse, **kw)))
            continue
        jo = jnp.asarray(outs.float().cpu().numpy()).astype(jnp.bfloat16)
        jl = jnp.asarray(lses.cpu().numpy())
        kw = {}
        if offs is not None:
            q, cu = (jnp.asarray(v) for v in offs)
            kw = dict(query_start_loc=q, **({"cu_seq_lens": cu} if N else {"prefix_cu_seq_lens": cu}))
        opts = dict(return_lse=what != "plain", implementation="pallas", backend="triton" if fw == "pallas" else fw)
        if N:
            fn = jax.jit(lambda o, l, kw, opts=opts: pallas_impl.merge_attn_states_n(o, l, **kw, **opts))
            calls.append((label, lambda fn=fn, o=jo, l=jl, kw=kw: jax.block_until_ready(fn(o, l, kw))))
        else:
            fn = jax.jit(lambda o, l, kw, opts=opts: pallas_impl.merge_attn_states(o[0], l[0], o[1], l[1], **kw,
                                                                                   **opts))
            calls.append((label, lambda fn=fn, o=jo, l=jl, kw=kw: jax.block_until_ready(fn(o, l, kw))))
    return calls


def run(only: list[str] | None) -> None:
    import torch

    calls = _calls(only)
    for _, call in calls:  # compile and warm up outside the capture
        call()
        call()
    torch.cuda.synchronize()
    cudart = torch.cuda.cudart()
    cudart.cudaProfilerStart()
    for label, call in calls:
        call()
        torch.cuda.synchronize()
        print(f"# point: {label}", file=sys.stderr, flush=True)
    cudart.cudaProfilerStop()


def summarize(path: str, only: list[str] | None) -> None:
    text = Path(path).read_text()
    start = text.find('"ID"')
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    kernels: dict[str, dict] = {}
    order: list[str] = []
    for r in rows:
        kid = r["ID"]
        if kid not in kernels:
            kernels[kid] = {"name": r["Kernel Name"]}
            order.append(kid)
        kernels[kid][r["Metric Name"]] = (r["Metric Value"], r["Metric Unit"])
    labels = [p[0] for p in POINTS if _wanted(p[0], only)]
    # XLA's own fusions around a Mosaic GPU call (layout and sentinel work, docs/design.md) are not points.
    extra = [kid for kid in order if "fusion" in kernels[kid]["name"]]
    order = [kid for kid in order if kid not in extra]
    if len(order) != len(labels):
        print(f"warning: {len(order)} kernels captured for {len(labels)} points; names show the mapping")
    head = ["point", "kernel"] + list(METRICS)
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for label, kid in zip(labels, order):
        k = kernels[kid]
        cells = [label, k["name"][:28]]
        for name in METRICS.values():
            v, unit = k.get(name, ("-", ""))
            if name == "Duration" and unit in ("nsecond", "ns"):
                v = f"{float(v.replace(',', '')) / 1000:.1f}"
            elif name == "Duration" and unit in ("msecond", "ms"):
                v = f"{float(v.replace(',', '')) * 1000:.1f}"
            cells.append(v)
        print("| " + " | ".join(cells) + " |")
    if extra:
        print("\nXLA fusions captured between the points (ID: name, us): " + ", ".join(
            f"{kid}: {kernels[kid]['name']} {float(kernels[kid]['Duration'][0].replace(',', '')) / 1000:.1f}"
            for kid in extra))
    print("\nTop stall reasons (warp cycles per issued instruction, smsp__average_warps_issue_stalled_*):")
    for label, kid in zip(labels, order):
        st = []
        for m, v in kernels[kid].items():
            v = v[0] if isinstance(v, tuple) else v
            if m.startswith("smsp__average_warps_issue_stalled_") and m.endswith("_per_issue_active.ratio"):
                try:
                    st.append((float(v.replace(",", "")), m[len("smsp__average_warps_issue_stalled_"):-len(
                        "_per_issue_active.ratio")]))
                except ValueError:
                    pass
        st.sort(reverse=True)
        print(f"- {label}: " + ", ".join(f"{n} {v:.1f}" for v, n in st[:5]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="+", help="points whose label contains one of these")
    ap.add_argument("--summarize", metavar="NCU_CSV", help="print the table of a captured run")
    a = ap.parse_args()
    if a.summarize:
        summarize(a.summarize, a.only)
    else:
        run(a.only)


if __name__ == "__main__":
    main()
