"""The order of a benchmark run (`python -m parity bench`): ceilings and floors first, then the JAX re-trace check,
then the mask and merge points, each skipped past the time budget or the memory cap."""

from __future__ import annotations

import time

from parity.tools.bench import floors, mask_runs, merge_runs, retrace
from parity.tools.bench import points as P
from parity.tools.bench.runner import BudgetSpent, Runner


def run(runner: Runner) -> None:
    """Ceilings and floors, the JAX re-trace check, then every point of `runner.work()` until the time budget."""
    work = runner.work()
    runner.progress(f"bench mode={runner.mode} device={runner.device} impls={','.join(runner.impls)}: "
                    f"{len(work)} points" + (f", budget {runner.budget_s:.0f} s" if runner.budget_s else ""))
    try:
        floors.ceilings(runner)
    except Exception as e:  # noqa: BLE001 - fractions become null; the points still run
        runner.error("ceilings", "torch", e)
        runner.cleanup()
    if "pallas" in runner.impls and not getattr(runner.args, "no_retrace", False):
        retrace.retrace_check(runner)
    for i, (kind, item, label) in enumerate(work, 1):
        idx = f"{i}/{len(work)}"
        try:
            runner.check_budget()
        except BudgetSpent:
            rest = [w[2] for w in work[i - 1:]]
            runner.doc["skipped"] += [{"point": r, "reason": "time budget"} for r in rest]
            runner.progress(f"[{idx}] time budget of {runner.budget_s:.0f} s spent: skipping {len(rest)} points")
            runner.save()
            break
        if kind == "merge" and item.memory > P.MEMORY_CAP_BYTES:
            runner.doc["skipped"].append({"point": label, "reason": f"needs {item.memory / 1e9:.1f} GB > "
                                                                     f"{P.MEMORY_CAP_BYTES / 1e9:.0f} GB"})
            runner.progress(f"[{idx}] {label}: skipped (needs {item.memory / 1e9:.1f} GB)")
            continue
        try:
            if kind == "mask":
                mask_runs.mask(runner, *item, idx)
            else:
                merge_runs.merge(runner, item, idx)
        except Exception as e:  # noqa: BLE001 - setup failure (e.g. out of memory): next point
            runner.error(label, "setup", e)
            runner.cleanup()
    runner.doc["elapsed_s"] = round(time.monotonic() - runner.t_start, 1)
    runner.save()
