"""Every Triton entry point on a few ci cases, for `compute-sanitizer` (memcheck): the mask (LSE only and with its
split output zeroing, both LSE layouts), the merges (plain, output LSE, fused, fp8, [T, H] base 2, V-padded
strides), the N-way merge (fused, fp8, the pass-through corner). Each call runs twice, so the second takes the
direct launch of a cached plan (`triton_impl._launch.launch`). No JAX.

    JAX_PLATFORMS=cpu compute-sanitizer --tool memcheck --error-exitcode 1 python -m tools sanitize-triton
"""

from __future__ import annotations



from parity.library import bridge
from parity.harness import cases, impls  # noqa: E402

HAS_CUDA = impls.configure()  # without CUDA: Triton's interpreter (a dry run of this script)


CASES = ("r33_ragged_pad", "specials_th", "base2_specials", "padded_v_ptwc", "fp8_out", "whole_blocks_aligned",
         "n3_fp16_th_specials", "n4_bf16_fp8_out", "n3_ptwc_last_partial_empty", "n2_fp32_d80_ptwc")


def main() -> int:
    rt = impls.Runtime("cuda", "gpu-bitwise") if HAS_CUDA else impls.Runtime("cpu", "cpu-interpreters")
    calls = 0
    for case in cases.select(None, kind="all"):
        if case.name not in CASES:
            continue
        inputs = cases.make_inputs_n(case) if case.n_way else cases.make_inputs(case)
        if case.n_way:
            inputs["masked_lses"] = impls.masked_lses(case, inputs)
        arrays = {k: bridge.to_torch(v, rt.device) if hasattr(v, "dtype") else v for k, v in inputs.items()}
        for op in impls.ops_of(case):
            ops = dict(arrays, lses=arrays["masked_lses"]) if op == "merge_n" else arrays
            for _ in range(2):
                impls.run(rt, "triton", op, case, ops)
                calls += 1
        rt.sync()
        print(f"{case.name}: {', '.join(impls.ops_of(case))}", flush=True)
    print(f"{calls} calls, synchronised")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
