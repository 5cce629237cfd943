"""Run a function on N `torch.distributed` ranks (spawned processes) and collect what each returns.

The context-parallel combine (`triton_impl.cp_merge_attn_states`) needs a real process group: gloo with one
process per rank on CPU (the Triton interpreter runs each rank's kernels), NCCL with one process per GPU. Used
by the CP demo and the tests; nothing here transports tensors itself: the collectives are torch's.
"""

from __future__ import annotations

import datetime
import os
import pickle
import tempfile
import traceback


def _entry(rank: int, world_size: int, backend: str, init_file: str, out_dir: str, timeout_s: float, fn, args):
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        from parity.harness.impls.runtime import patch_triton_language_once_per_launch

        patch_triton_language_once_per_launch()
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    try:
        try:
            result = ("ok", fn(rank, world_size, dist.group.WORLD, *args))
        except Exception as e:  # noqa: BLE001 - reported to the parent, which raises
            result = ("error", f"{type(e).__name__}: {e}", traceback.format_exc())
        with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, backend: str = "gloo", timeout_s: float = 120.0) -> list:
    """`fn(rank, world_size, group, *args)` on `world_size` spawned ranks; returns each rank's result, rank order.

    `fn` must be importable by name (module level) and its results picklable (numpy arrays, not tensors).
    Exceptions inside `fn` come back as ("error", message, traceback) entries rather than failing the launch, so
    a test can assert that every rank raised the same error. NCCL needs one GPU per rank (NCCL refuses two ranks
    on one GPU). gloo ranks run Triton in its interpreter (TRITON_INTERPRET=1); other environment variables
    (NCCL_*) are inherited by the ranks.
    """
    import torch.multiprocessing as mp

    saved = os.environ.get("TRITON_INTERPRET")
    if backend == "gloo":  # CPU ranks hold CPU tensors, which Triton runs only in its interpreter
        os.environ["TRITON_INTERPRET"] = "1"  # read by the spawned ranks when they import the kernels
    try:
        with tempfile.TemporaryDirectory(prefix="parity_ranks_") as tmp:
            init_file = os.path.join(tmp, "pg")
            mp.spawn(_entry, args=(world_size, backend, init_file, tmp, timeout_s, fn, args), nprocs=world_size,
                     join=True)
            results = []
            for rank in range(world_size):
                with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                    results.append(pickle.load(f))
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return results
