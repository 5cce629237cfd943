"""The JAX re-trace check of a benchmark run (`python -m parity bench`): a new batch of the same shapes traces and
compiles nothing."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from parity.tools.bench import points as P
from parity.tools.bench import timers

if TYPE_CHECKING:
    from parity.tools.bench.runner import Runner


def retrace_check(runner: Runner) -> None:
    """Each jitted public `pallas_impl` function on HOST_T tokens: a first batch, then a batch of the same
    shapes with other offsets and `prefill_tokens_with_context`; the second must trace and compile nothing
    (docs/design.md: batch-varying values are runtime values)."""
    import jax

    from parity.harness import impls

    jdev = jax.devices()[0]
    a = impls.adapter(runner.rt, "pallas")
    T, H, D = P.HOST_T, 2, 64
    rng = np.random.default_rng(0)
    o = [jax.device_put(rng.standard_normal((T, H, D)).astype(np.float32), jdev) for _ in range(2)]
    on = jax.device_put(rng.standard_normal((3, T, H, D)).astype(np.float32), jdev)
    lse = [jax.device_put(rng.standard_normal((H, T)).astype(np.float32), jdev) for _ in range(2)]
    lsen = jax.device_put(rng.standard_normal((3, H, T)).astype(np.float32), jdev)
    # Two batches of 3 requests each: other lengths, other empty requests, other prefill_tokens_with_context.
    batches = [(np.array([0, 4, 10, 16], np.int32), np.array([0, 0, 5, 9], np.int32), 12),
               (np.array([0, 7, 8, 16], np.int32), np.array([0, 3, 3, 3], np.int32), 16)]

    def put(x):
        return jax.device_put(x, jdev)

    def cu_n(cu):
        return np.stack([cu, cu * 2, np.zeros_like(cu)])

    ops = {
        "mask": lambda qsl, cu, p: a.mask(lse[0], put(qsl), put(cu), has_empty=True),
        "merge fused": lambda qsl, cu, p: a.merge(o[0], lse[0], o[1], lse[1], query_start_loc=put(qsl),
                                                  prefix_cu_seq_lens=put(cu), prefill_tokens_with_context=p),
        "merge_n fused": lambda qsl, cu, p: a.merge_n(on, lsen, query_start_loc=put(qsl),
                                                      cu_seq_lens=put(cu_n(cu)), prefill_tokens_with_context=p),
    }
    for name, fn in ops.items():
        try:
            counts = []
            for qsl, cu, p in batches:
                with timers.TraceCounter() as c:
                    r = fn(qsl, cu, p)
                    jax.block_until_ready(r)
                counts.append((c.traces, c.compiles))
            rec = {"op": name, "impl": "pallas", "T": T, "H": H, "D": D,
                   "first_batch": {"traces": counts[0][0], "compiles": counts[0][1]},
                   "new_batch": {"traces": counts[1][0], "compiles": counts[1][1]},
                   "ok": counts[1] == (0, 0),
                   "method": "jax.monitoring duration events (jaxpr traces, backend compiles) during one call "
                             "and its block_until_ready; new batch: other offsets and "
                             "prefill_tokens_with_context (a Python int), the same shapes"}
            runner.doc["retrace"].append(rec)
            runner.progress(f"  retrace {name}: first batch {counts[0][0]} traces / {counts[0][1]} compiles, "
                          f"new batch {counts[1][0]} / {counts[1][1]}")
            if not rec["ok"]:
                runner.error(f"retrace {name}", "pallas", RuntimeError(
                    f"a new batch of the same shapes traced {counts[1][0]} and compiled {counts[1][1]} times"))
        except Exception as e:  # noqa: BLE001
            runner.error(f"retrace {name}", "pallas", e)
    runner.save()
