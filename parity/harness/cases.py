"""Named workloads (docs/spec.md sections 7-8 and edge cases) and the seeded input builders.

Workloads are data: tests, the CLI and the benchmarks select them by tag and never re-type shapes.
`make_inputs` builds numpy arrays once (framework-neutral); `parity.library.bridge` uploads them to torch and hands
them to JAX over DLPack.

Two kinds of case: 2-way cases (`partials == 0`: the mask and the 2-way merge of a prefix and a suffix) and
N-way cases (`partials == N`: N stacked partials, each holding the KV tokens a context-parallel rank would
hold). `select` returns one kind at a time.

Tags: "ci" (run by the test suite under the interpreters), "default" / "full" (the `check` suites),
"bench" (benchmarks), "seed" (section 7 workloads).
"""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np

DTYPES = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float4_e2m1fn": np.dtype(ml_dtypes.float4_e2m1fn),  # NVFP4 output only (docs/spec.md 4.8)
}

# Backend-like garbage in rows whose context is empty (docs/spec.md 1): a finite LSE and NaN output.
_GARBAGE_LSE = 3.0


@dataclasses.dataclass(frozen=True)
class Case:
    """One workload. `empty` lists the requests whose prefix (context) chunk holds no KV tokens."""

    name: str
    query_lens: tuple[int, ...]
    empty: tuple[int, ...]
    num_heads: int = 8
    head_dim: int = 128
    dtype: str = "bfloat16"
    lse_layout: str = "HT"
    lse_base: float = math.e
    padding: int = 0  # tokens past query_start_loc[R]: never touched by the mask
    head_pad: int = 0  # extra head-dim columns in every output buffer (a V-padded layout)
    suffix_head_pad: int | None = None  # the suffix buffer's own pad (None: head_pad): partials with different strides
    specials: bool = False  # inject +inf / NaN / -inf LSEs, including rows empty on both sides
    prefill_tokens_with_context: int | None = None
    out_dtype: str | None = None  # None: `dtype`; "float8_e4m3fn" (the fp8 output path), "float4_e2m1fn" (NVFP4)
    # or another float dtype
    group_size: int | None = None  # per-group FP8 scales (docs/spec.md 4.7; out_dtype fp8, no output_scale)
    scale_ue8m0: bool = False  # the per-group scales rounded up to powers of two
    # N-way cases only (docs/spec.md section 8). KV token j of request r lives on partial (j // interleave) % N,
    # as vLLM places KV over a context-parallel group; a request shorter than N * interleave leaves partials
    # with no KV for it. `empty` is unused: emptiness per partial follows from `context_lens`.
    partials: int = 0  # N; 0 for a 2-way case
    context_lens: tuple[int, ...] = ()  # KV length of each request (before the split over partials)
    interleave: int = 1
    strided: bool = False  # Triton reads the partials as views of a [T, N, H, D] gather and of the other LSE layout
    # NVFP4's block-scale layout: "row", or "swizzled" (`check` runs every NVFP4 case in both and compares them)
    scale_layout: str = "row"
    tags: frozenset[str] = frozenset()

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens) + self.padding

    @property
    def fp8_out(self) -> bool:
        return self.out_dtype == "float8_e4m3fn"

    @property
    def nvfp4(self) -> bool:
        """NVFP4 output (docs/spec.md 4.8): e2m1 codes, e4m3 block scales, `NVFP4_GLOBAL_SCALE` as the global one."""
        return self.out_dtype == "float4_e2m1fn"

    @property
    def n_way(self) -> bool:
        return self.partials > 0


def _every_even(n: int) -> tuple[int, ...]:
    return tuple(range(0, n, 2))


def _ragged(seed: int, num_requests: int, max_len: int, zero_frac: float = 0.2) -> tuple[int, ...]:
    rng = np.random.default_rng(seed)
    lens = rng.integers(1, max_len + 1, size=num_requests)
    lens[rng.random(num_requests) < zero_frac] = 0
    return tuple(int(x) for x in lens)


def _random_empty(seed: int, num_requests: int, frac: float = 0.4) -> tuple[int, ...]:
    rng = np.random.default_rng(seed + 1)
    return tuple(int(r) for r in np.nonzero(rng.random(num_requests) < frac)[0])


_CI = frozenset({"ci", "default", "full"})
_FULL = frozenset({"full"})
# Cases `check` runs on a GPU only (`select(gpu=False)` leaves them out): too large for the CPU interpreters and
# for golden vectors, there to catch what only compiled kernels do (long-T tiles, layout conversions).
GPU_ONLY = "gpu_only"
_FULL_GPU = frozenset({"full", GPU_ONLY})
# NVFP4's global scale g in the cases (docs/spec.md 4.8): vLLM's 448 * 6 / amax for |values| up to 12, so the
# block scales (amax / 6) * g stay in e4m3's normal range and small blocks reach its subnormals
NVFP4_GLOBAL_SCALE = 224.0
# The `check` suites only, not "ci": N > 64 and output dtypes other than the partials' (their CPU tests are
# tests/test_merge_limits.py's; on Mosaic GPU, tests/test_pallas_mosaic.py's).
_CHECK = frozenset({"default", "full"})
_SEED = frozenset({"seed", "bench", "full"})
_SEED_BENCH_ONLY = frozenset({"seed", "bench"})  # too large for a float64 host reference in `check`

CASES: tuple[Case, ...] = (
    # The upstream test vector: lse[:, 2:133] = -inf.
    Case("upstream_vector", (2, 131, 1), (1,), num_heads=4, head_dim=64, dtype="float32", tags=_CI),
    # Block edges: requests of 127/128/129/256 tokens around the 128-token query block.
    Case("block_edges", (127, 128, 129, 256, 1), (0, 2, 4), num_heads=3, head_dim=64, tags=_CI),
    # R = 33: the ownership scan crosses a 32-request boundary; zero-length requests; a padding tail.
    Case("r33_ragged_pad", _ragged(1, 33, 40), _random_empty(1, 33), num_heads=5, head_dim=80,
         dtype="float16", padding=37, tags=_CI),
    Case("r1000", _ragged(2, 1000, 6), _random_empty(2, 1000), num_heads=2, head_dim=64, dtype="float32",
         padding=5, tags=_CI),
    # R = 1100: the two-level request search takes a second coarse step (1024 requests per step).
    Case("r1100_fp16", _ragged(8, 1100, 4), _random_empty(8, 1100), num_heads=3, head_dim=64,
         dtype="float16", tags=_FULL),
    Case("all_empty", (64, 1, 190), (0, 1, 2), num_heads=4, head_dim=64, tags=_CI),
    Case("none_empty", (64, 1, 190), (), num_heads=4, head_dim=64, tags=_CI),
    Case("specials_th", (50, 0, 77, 130), (1, 2), num_heads=6, head_dim=128, dtype="float32",
         lse_layout="TH", specials=True, tags=_CI),
    Case("base2_specials", (50, 31, 77), (0,), num_heads=4, head_dim=96, dtype="bfloat16", lse_base=2,
         specials=True, tags=_CI),
    # Only the prefix is V-padded: the two partials have different strides (a port must not borrow them).
    Case("padded_prefix_only", (21, 0, 30), (0,), num_heads=3, head_dim=64, head_pad=64, suffix_head_pad=0,
         dtype="float16", tags=_CI),
    Case("padded_v_ptwc", (40, 9, 70, 33), (1,), num_heads=4, head_dim=128, head_pad=64,
         prefill_tokens_with_context=119, padding=3, tags=_CI),
    Case("fp8_out", (40, 20, 70), (0,), num_heads=4, head_dim=64, dtype="bfloat16",
         out_dtype="float8_e4m3fn", specials=True, tags=_CI),
    # Per-group FP8 (docs/spec.md 4.7): the 2-way merge with pass-through rows, then [T, H] base-2 LSEs with
    # 16-element groups and UE8M0 scales.
    Case("group_fp8_g64", (40, 20, 70), (0,), num_heads=4, head_dim=64, dtype="bfloat16",
         out_dtype="float8_e4m3fn", group_size=64, specials=True, prefill_tokens_with_context=100, tags=_FULL),
    Case("group_fp8_g16_ue8m0_th_base2", (33, 0, 12), (1,), num_heads=2, head_dim=128, dtype="float16",
         out_dtype="float8_e4m3fn", group_size=16, scale_ue8m0=True, lse_layout="TH", lse_base=2, specials=True,
         tags=_FULL),
    # NVFP4 (docs/spec.md 4.8) of the 2-way merge: pass-through rows quantized like the others, special LSEs.
    Case("nvfp4_ptwc_specials", (40, 20, 70), (0,), num_heads=4, head_dim=64, dtype="bfloat16",
         out_dtype="float4_e2m1fn", specials=True, prefill_tokens_with_context=100, tags=_FULL),
    # GPU only: NVFP4 with the fused mask and pass-through rows at T = 1001, H = 8, D = 128 (the swizzled block scales
    # moved the compiled Triton kernel's codes there until 2026-12-07), and every quantized output and an f32 one at
    # T = 32K (the long-T tiles: Mosaic GPU's failed to compile until 2026-12-07).
    Case("nvfp4_fused_t1001", (100, 300, 1, 549, 51), (1, 3), num_heads=8, head_dim=128, dtype="bfloat16",
         out_dtype="float4_e2m1fn", prefill_tokens_with_context=950, tags=_FULL_GPU),
    Case("t32k_static_fp8", (16384, 8192, 8191), (1,), num_heads=16, head_dim=128, out_dtype="float8_e4m3fn",
         specials=True, padding=1, tags=_FULL_GPU),
    Case("t32k_group_fp8_g128", (16384, 8192, 8192), (1,), num_heads=16, head_dim=128, out_dtype="float8_e4m3fn",
         group_size=128, specials=True, prefill_tokens_with_context=32000, tags=_FULL_GPU),
    Case("t32k_nvfp4", (16384, 8192, 8192), (1,), num_heads=16, head_dim=128, out_dtype="float4_e2m1fn",
         specials=True, prefill_tokens_with_context=32000, tags=_FULL_GPU),
    Case("t32k_bf16_to_f32", (16384, 8192, 8192), (1,), num_heads=16, head_dim=128, out_dtype="float32",
         tags=_FULL_GPU),
    Case("d512_h1", (9, 0, 23), (0,), num_heads=1, head_dim=512, dtype="float32", tags=_CI),
    # Another output dtype than the partials' (docs/spec.md 4.3): f32 partials into a bf16 output, base 2, with
    # pass-through rows (rounded once); fp16 partials into an f32 output.
    Case("fp32_to_bf16_base2_ptwc", (12, 0, 9), (0,), num_heads=2, head_dim=32, dtype="float32",
         out_dtype="bfloat16", lse_base=2, specials=True, prefill_tokens_with_context=15, tags=_CHECK),
    Case("fp16_to_fp32_th", _ragged(15, 30, 40), _random_empty(15, 30), num_heads=4, head_dim=64, dtype="float16",
         out_dtype="float32", lse_layout="TH", specials=True, tags=_FULL),
    Case("d192_fp16", (33, 17), (1,), num_heads=3, head_dim=192, dtype="float16", specials=True, tags=_CI),
    Case("d256_bf16_th", (65, 3), (0,), num_heads=2, head_dim=256, lse_layout="TH", tags=_CI),
    # T = 740, a multiple of 4, and empty requests owning whole 128-token blocks: the mask's unmasked
    # 16-byte-store path (block_edges, T = 641, takes the masked one); H = 20 leaves a partial head tile.
    Case("whole_blocks_aligned", (256, 100, 384), (0, 2), num_heads=20, head_dim=16, dtype="float32", tags=_CI),
    # Larger random batches for the `default` and `full` parity suites.
    Case("ragged_r200_bf16", _ragged(3, 200, 300), _random_empty(3, 200), num_heads=16, head_dim=128,
         padding=100, specials=True, tags=_FULL),
    Case("ragged_r64_fp32_th", _ragged(4, 64, 500), _random_empty(4, 64), num_heads=8, head_dim=80,
         dtype="float32", lse_layout="TH", tags=_FULL),
    Case("ragged_r500_fp16_base2", _ragged(5, 500, 200), _random_empty(5, 500), num_heads=16, head_dim=192,
         dtype="float16", lse_base=2, specials=True, tags=_FULL),
    Case("ragged_d512_bf16", _ragged(6, 40, 400), _random_empty(6, 40), num_heads=16, head_dim=512,
         padding=64, tags=_FULL),
    Case("padded_v_bf16_h128", _ragged(7, 100, 300), _random_empty(7, 100), num_heads=128, head_dim=128,
         head_pad=64, prefill_tokens_with_context=9000, tags=_FULL),
    # docs/spec.md 7 seed workloads (64 heads).
    Case("2k_balanced", (128,) * 16, _every_even(16), num_heads=64, head_dim=128, tags=_SEED),
    Case("32k_balanced", (128,) * 256, _every_even(256), num_heads=64, head_dim=128, tags=_SEED),
    Case("131k_skewed", (65536,) + (128,) * 510 + (256,), _every_even(512), num_heads=64, head_dim=128,
         tags=_SEED_BENCH_ONLY),
)


def _contexts(seed: int, num_requests: int, max_len: int) -> tuple[int, ...]:
    """Context lengths from 0 to max_len; a request shorter than N * interleave leaves partials without KV."""
    rng = np.random.default_rng(seed + 77)
    return tuple(int(x) for x in rng.integers(0, max_len + 1, size=num_requests))


_N_SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _n_way_matrix() -> tuple[Case, ...]:
    """The "full" N-way matrix: every N in (1, 2, 3, 4, 8) with every input dtype and fp8 output; head sizes
    64 / 80 / 128 / 512, both layouts and both bases rotate through it, so each pair (N, dtype) and each value
    of every other factor occurs. R = 40 crosses the 32-request scan step; specials everywhere."""
    out = []
    k = 0
    for n in (1, 2, 3, 4, 8):
        for dtype, out_dtype in (("float32", None), ("float16", None), ("bfloat16", None),
                                 ("bfloat16", "float8_e4m3fn")):
            d = (64, 80, 128, 512)[k % 4]
            layout = ("HT", "TH")[k % 2]
            base = (math.e, 2)[(k // 2) % 2]
            lens = _ragged(100 + k, 40, 24 if d == 512 else 60)
            name = (f"n{n}_{_N_SHORT[dtype]}" + ("_fp8" if out_dtype else "") + f"_d{d}_{layout.lower()}"
                    + ("_base2" if base == 2 else ""))
            out.append(Case(name, lens, (), num_heads=(4, 3, 8, 5)[k % 4], head_dim=d, dtype=dtype,
                            out_dtype=out_dtype, lse_layout=layout, lse_base=base, specials=True, partials=n,
                            context_lens=_contexts(100 + k, 40, 3 * n * 2), interleave=2, padding=k % 3,
                            strided=k % 3 == 0, tags=_FULL))
            k += 1
    return tuple(out)


CASES_N: tuple[Case, ...] = (
    # N = 1: the merge of one partial is that partial (empty rows 0 and -inf).
    Case("n1_bf16", (20, 0, 37), (), num_heads=3, head_dim=64, partials=1, context_lens=(5, 0, 0), tags=_CI),
    # N = 2 with no empty request in partial 1: the 2-way kernels must give the same bits (docs/spec.md 8).
    Case("n2_fp32_d80_ptwc", (33, 9, 50), (), num_heads=4, head_dim=80, dtype="float32", partials=2,
         context_lens=(0, 9, 3), interleave=1, prefill_tokens_with_context=80, padding=3, specials=True, tags=_CI),
    Case("n3_fp16_th_specials", (17, 40, 1, 12), (), num_heads=5, head_dim=128, dtype="float16", lse_layout="TH",
         partials=3, context_lens=(2, 7, 0, 30), interleave=2, specials=True, tags=_CI),
    # R = 40 crosses the 32-request scan step; N = 8 with contexts of at most 7 tokens: partial 7 is empty for
    # every request.
    Case("n8_bf16_r40_whole_partial_empty", _ragged(11, 40, 12), (), num_heads=2, head_dim=64, partials=8,
         context_lens=_contexts(11, 40, 7), interleave=1, padding=5, tags=_CI),
    Case("n4_bf16_d512_base2_strided", (9, 14), (), num_heads=2, head_dim=512, lse_base=2, partials=4,
         context_lens=(3, 40), interleave=4, head_pad=64, strided=True, specials=True, tags=_CI),
    Case("n4_bf16_fp8_out", (24, 16, 3), (), num_heads=4, head_dim=64, out_dtype="float8_e4m3fn", partials=4,
         context_lens=(1, 20, 6), interleave=2, specials=True, tags=_CI),
    Case("n16_fp32_d32", (10, 21), (), num_heads=3, head_dim=32, dtype="float32", partials=16,
         context_lens=(13, 60), interleave=2, specials=True, tags=_CI),
    # Pass-through tokens (t >= 30) of requests with no KV in the last partial (requests 1 and 2; request 4 has
    # none anywhere) and of one with KV there (request 3): the copied LSE is -inf from the offsets (docs/spec.md
    # 8.4), so the fused merge equals the mask then the merge; base 2.
    Case("n3_ptwc_last_partial_empty", (20, 30, 25, 10, 5), (), num_heads=4, head_dim=64, dtype="float16",
         lse_base=2, partials=3, context_lens=(9, 4, 1, 12, 0), interleave=2, prefill_tokens_with_context=30,
         padding=2, tags=_CI),
    # Past the Mosaic backend's 64 partials (docs/spec.md 8, "Any N"), base 2 with pass-through rows; most
    # partials hold no KV for a request. Then into another output dtype (4.3): f32 partials into a bf16 output.
    Case("n65_fp32_base2_ptwc", (3, 5), (), num_heads=2, head_dim=16, dtype="float32", lse_base=2, partials=65,
         context_lens=(70, 9), interleave=1, prefill_tokens_with_context=6, specials=True, tags=_CHECK),
    Case("n65_fp32_to_bf16_base2", (3, 5), (), num_heads=2, head_dim=16, dtype="float32", out_dtype="bfloat16",
         lse_base=2, partials=65, context_lens=(70, 9), interleave=1, prefill_tokens_with_context=6,
         specials=True, tags=_CHECK),
    Case("n130_bf16_to_fp32_th", _ragged(12, 6, 20), (), num_heads=4, head_dim=64, out_dtype="float32",
         lse_layout="TH", partials=130, context_lens=_contexts(12, 6, 300), interleave=1, specials=True,
         tags=_FULL),
    Case("n256_fp16_to_bf16_base2_strided", _ragged(13, 5, 24), (), num_heads=3, head_dim=128, dtype="float16",
         out_dtype="bfloat16", lse_base=2, partials=256, context_lens=_contexts(13, 5, 600), interleave=2,
         prefill_tokens_with_context=40, strided=True, specials=True, tags=_FULL),
    Case("n256_bf16_fp8", _ragged(14, 4, 16), (), num_heads=2, head_dim=64, out_dtype="float8_e4m3fn",
         partials=256, context_lens=_contexts(14, 4, 512), interleave=1, specials=True, tags=_FULL),
    # Per-group FP8 (docs/spec.md 4.7) of the N-way merge: 128-element groups with UE8M0 scales, and N = 256.
    Case("n4_bf16_group_fp8_g128_ue8m0", (24, 16, 3), (), num_heads=4, head_dim=128, out_dtype="float8_e4m3fn",
         group_size=128, scale_ue8m0=True, partials=4, context_lens=(1, 20, 6), interleave=2, specials=True,
         prefill_tokens_with_context=40, tags=_FULL),
    Case("n256_bf16_group_fp8_g64", _ragged(14, 4, 16), (), num_heads=2, head_dim=128, out_dtype="float8_e4m3fn",
         group_size=64, partials=256, context_lens=_contexts(14, 4, 512), interleave=1, specials=True,
         tags=_FULL),
    # NVFP4 (4.8) of the N-way merge: [T, H] base-2 LSEs, N = 4 with pass-through rows.
    Case("n4_fp16_nvfp4_th_base2", (24, 16, 3), (), num_heads=2, head_dim=128, dtype="float16",
         out_dtype="float4_e2m1fn", lse_layout="TH", lse_base=2, partials=4, context_lens=(1, 20, 6), interleave=2,
         specials=True, prefill_tokens_with_context=40, tags=_FULL),
) + _n_way_matrix()

KINDS = ("two_way", "n_way", "all")


def select(tag: str | None = None, name_filter: str | None = None, *, kind: str = "two_way",
           gpu: bool = False) -> list[Case]:
    """Cases of `kind` ("two_way", "n_way" or "all") carrying `tag` (all when None) whose name contains
    `name_filter`; the `GPU_ONLY` ones only with gpu=True."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    pool = {"two_way": CASES, "n_way": CASES_N, "all": CASES + CASES_N}[kind]
    return [c for c in pool if (tag is None or tag in c.tags) and (gpu or GPU_ONLY not in c.tags)
            and (name_filter is None or name_filter in c.name)]


def by_name(name: str) -> Case:
    for c in CASES + CASES_N:
        if c.name == name:
            return c
    raise KeyError(f"no case named {name!r}; known: {[c.name for c in CASES + CASES_N]}")


def offsets(case: Case, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(query_start_loc i32[R+1], cu_seq_lens i32[R+1]) of the case; empty requests get 0 KV tokens."""
    rng = np.random.default_rng(seed + 1000)
    qsl = np.zeros(case.num_requests + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(case.query_lens)
    kv = rng.integers(1, 64, size=case.num_requests)
    kv[list(case.empty)] = 0
    cu = np.zeros(case.num_requests + 1, dtype=np.int32)
    cu[1:] = np.cumsum(kv)
    return qsl, cu


def make_inputs(case: Case, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded numpy inputs of both operations.

    Keys: query_start_loc, cu_seq_lens (i32[R+1]); prefix_output, suffix_output (dtype[T, H, D + head_pad]
    and dtype[T, H, D + suffix_head_pad]; the first D columns are the data); prefix_lse, suffix_lse (f32, in the case's layout and base);
    output_scale (f32[1], only for fp8). Empty requests' prefix rows hold a finite garbage LSE and NaN
    output, as a real backend can leave them; padding tokens and padded columns hold NaN.
    """
    rng = np.random.default_rng(seed)
    T, H, D = case.num_tokens, case.num_heads, case.head_dim
    dt = DTYPES[case.dtype]
    qsl, cu = offsets(case, seed)
    n_real = int(qsl[-1])

    def outputs(pad):
        x = np.full((T, H, D + pad), np.nan, dtype=np.float32)
        x[:n_real, :, :D] = rng.standard_normal((n_real, H, D), dtype=np.float32)
        return x.astype(dt)

    def lse():  # natural-log magnitudes typical of attention (log of a sum of exps)
        x = rng.normal(4.0, 3.0, size=(H, T)).astype(np.float32)
        x[:, n_real:] = np.nan
        return x

    suffix_pad = case.head_pad if case.suffix_head_pad is None else case.suffix_head_pad
    prefix_output, suffix_output = outputs(case.head_pad), outputs(suffix_pad)
    prefix_lse, suffix_lse = lse(), lse()

    empty_t = np.zeros(T, dtype=bool)
    for r in case.empty:
        empty_t[qsl[r]:qsl[r + 1]] = True
    prefix_lse[:, empty_t] = _GARBAGE_LSE
    prefix_output[empty_t] = np.nan

    if case.specials and n_real:
        # Per token pick a pattern: 0 normal, 1 prefix +inf, 2 prefix NaN, 3 suffix -inf,
        # 4 suffix +inf, 5 both +inf (both empty), 6 both -inf, 7 suffix NaN and prefix -inf.
        kind = rng.integers(0, 8, size=(H, n_real))
        p, s = prefix_lse[:, :n_real], suffix_lse[:, :n_real]
        p[kind == 1] = np.inf
        p[kind == 2] = np.nan
        s[kind == 3] = -np.inf
        s[kind == 4] = np.inf
        p[kind == 5] = np.inf
        s[kind == 5] = np.inf
        p[kind == 6] = -np.inf
        s[kind == 6] = -np.inf
        s[kind == 7] = np.nan
        p[kind == 7] = -np.inf
        # An empty side's output is garbage: NaN where the suffix is empty too.
        sx = suffix_output[:n_real].astype(np.float32)
        sx[np.isin(kind, (3, 4, 5, 6, 7)).T] = np.nan
        suffix_output[:n_real] = sx.astype(dt)
        # Large but finite gaps: weights that underflow to exactly zero or to subnormals.
        gap = rng.random((H, n_real)) < 0.05
        p[gap & (kind == 0)] = s[gap & (kind == 0)] - rng.uniform(80.0, 110.0, size=int((gap & (kind == 0)).sum()))

    if case.lse_base == 2:
        prefix_lse = (prefix_lse / np.float32(math.log(2.0))).astype(np.float32)
        suffix_lse = (suffix_lse / np.float32(math.log(2.0))).astype(np.float32)
    if case.lse_layout == "TH":
        prefix_lse = np.ascontiguousarray(prefix_lse.T)
        suffix_lse = np.ascontiguousarray(suffix_lse.T)

    inputs = dict(query_start_loc=qsl, cu_seq_lens=cu, prefix_output=prefix_output,
                  prefix_lse=prefix_lse, suffix_output=suffix_output, suffix_lse=suffix_lse)
    return _with_output_scale(case, inputs)


def _with_output_scale(case: Case, inputs: dict) -> dict:
    """The static FP8 output's scale (docs/spec.md 4.6) or NVFP4's global scale (4.8) as `output_scale` f32[1]."""
    if case.fp8_out and not case.group_size:
        inputs["output_scale"] = np.array([0.05], dtype=np.float32)
    if case.nvfp4:
        inputs["output_scale"] = np.array([NVFP4_GLOBAL_SCALE], dtype=np.float32)
    return inputs


# ---------------------------------------------------------------------------------------------------------
# N-way cases


def partial_kv_lens(case: Case) -> np.ndarray:
    """i64[N, R]: the KV tokens of each request on each partial (token j on partial (j // interleave) % N)."""
    n, il = case.partials, case.interleave
    ctx = np.asarray(case.context_lens, dtype=np.int64)
    if ctx.shape != (case.num_requests,):
        raise ValueError(f"{case.name}: context_lens must give one length per request ({case.num_requests})")
    cycle = n * il
    full, rest = ctx // cycle, ctx % cycle
    i = np.arange(n, dtype=np.int64)[:, None]
    return full[None, :] * il + np.clip(rest[None, :] - i * il, 0, il)


def offsets_n(case: Case) -> tuple[np.ndarray, np.ndarray]:
    """(query_start_loc i32[R+1], cu_seq_lens i32[N, R+1]): each partial's local KV offsets."""
    qsl = np.zeros(case.num_requests + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(case.query_lens)
    kv = partial_kv_lens(case)
    cu = np.zeros((case.partials, case.num_requests + 1), dtype=np.int32)
    cu[:, 1:] = np.cumsum(kv, axis=1)
    return qsl, cu


def make_inputs_n(case: Case, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded numpy inputs of the N-way merge.

    Keys: query_start_loc i32[R+1], cu_seq_lens i32[N, R+1]; outputs dtype[N, T, H, D + head_pad] (the first D
    columns are the data); lses f32[N, H, T] ([N, T, H] for "TH"), in the case's base; output_scale (fp8 only).
    A partial with no KV for a request holds a finite garbage LSE and NaN output there, as a real backend can
    leave it; padding tokens and padded columns hold NaN. With `specials`, LSEs also hold +inf, NaN and -inf
    (with NaN output), tokens whose every partial is empty, and gaps that underflow a weight to 0.
    """
    rng = np.random.default_rng(seed)
    N, T, H, D = case.partials, case.num_tokens, case.num_heads, case.head_dim
    qsl, cu = offsets_n(case)
    n_real = int(qsl[-1])
    x = np.full((N, T, H, D + case.head_pad), np.nan, dtype=np.float32)
    x[:, :n_real, :, :D] = rng.standard_normal((N, n_real, H, D), dtype=np.float32)
    lse = rng.normal(4.0, 3.0, size=(N, H, T)).astype(np.float32)
    lse[:, :, n_real:] = np.nan

    req = np.searchsorted(qsl, np.arange(n_real), side="right") - 1  # request of each real token
    empty = (np.diff(cu, axis=1) == 0)[:, req]  # bool[N, n_real]
    lse[:, :, :n_real][np.broadcast_to(empty[:, None, :], (N, H, n_real))] = _GARBAGE_LSE
    x[:, :n_real][empty] = np.nan

    if case.specials and n_real:
        # Per (partial, head, token): 0 normal (most), 1 +inf, 2 NaN, 3 -inf; outputs of those are NaN.
        kind = rng.choice(4, size=(N, H, n_real), p=(0.85, 0.05, 0.05, 0.05))
        every = rng.random((H, n_real)) < 0.04  # tokens whose every partial is empty
        kind[:, every] = rng.integers(1, 4, size=(N, int(every.sum())))
        real = lse[:, :, :n_real]
        real[kind == 1] = np.inf
        real[kind == 2] = np.nan
        real[kind == 3] = -np.inf
        xr = x[:, :n_real, :, :D]
        xr[(kind != 0).transpose(0, 2, 1)] = np.nan
        if N > 1:  # large but finite gaps: weights that underflow to exactly 0 or to subnormals
            gap = (rng.random((N, H, n_real)) < 0.05) & (kind == 0)
            real[gap] = real[gap] - rng.uniform(80.0, 110.0, size=int(gap.sum())).astype(np.float32)

    if case.lse_base == 2:
        lse = (lse / np.float32(math.log(2.0))).astype(np.float32)
    if case.lse_layout == "TH":
        lse = np.ascontiguousarray(lse.transpose(0, 2, 1))
    inputs = dict(query_start_loc=qsl, cu_seq_lens=cu, outputs=x.astype(DTYPES[case.dtype]), lses=lse)
    return _with_output_scale(case, inputs)
