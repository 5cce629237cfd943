"""Named workloads (SPEC 7 and edge cases) and the seeded input builder.

Workloads are data: tests, the CLI and the benchmarks select them by tag and never re-type shapes.
`make_inputs` builds numpy arrays once (framework-neutral); `parity.bridge` uploads them to torch and hands
them to JAX over DLPack.

Tags: "ci" (run by the test suite under the interpreters), "default" / "full" (the `check` suites),
"bench" (benchmarks), "seed" (SPEC 7 workloads).
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
}

# Backend-like garbage in rows whose context is empty (SPEC 1): a finite LSE and NaN output.
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
    specials: bool = False  # inject +inf / NaN / -inf LSEs, including rows empty on both sides
    prefill_tokens_with_context: int | None = None
    out_dtype: str | None = None  # "float8_e4m3fn" for the fp8 output path
    tags: frozenset[str] = frozenset()

    @property
    def num_requests(self) -> int:
        return len(self.query_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens) + self.padding


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
    Case("padded_v_ptwc", (40, 9, 70, 33), (1,), num_heads=4, head_dim=128, head_pad=64,
         prefill_tokens_with_context=119, padding=3, tags=_CI),
    Case("fp8_out", (40, 20, 70), (0,), num_heads=4, head_dim=64, dtype="bfloat16",
         out_dtype="float8_e4m3fn", specials=True, tags=_CI),
    Case("d512_h1", (9, 0, 23), (0,), num_heads=1, head_dim=512, dtype="float32", tags=_CI),
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
    # SPEC 7 seed workloads (64 heads).
    Case("2k_balanced", (128,) * 16, _every_even(16), num_heads=64, head_dim=128, tags=_SEED),
    Case("32k_balanced", (128,) * 256, _every_even(256), num_heads=64, head_dim=128, tags=_SEED),
    Case("131k_skewed", (65536,) + (128,) * 510 + (256,), _every_even(512), num_heads=64, head_dim=128,
         tags=_SEED_BENCH_ONLY),
)


def select(tag: str | None = None, name_filter: str | None = None) -> list[Case]:
    """Cases carrying `tag` (all when None) whose name contains `name_filter`."""
    out = [c for c in CASES if (tag is None or tag in c.tags)
           and (name_filter is None or name_filter in c.name)]
    return out


def by_name(name: str) -> Case:
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(f"no case named {name!r}; known: {[c.name for c in CASES]}")


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

    Keys: query_start_loc, cu_seq_lens (i32[R+1]); prefix_output, suffix_output (dtype[T, H, D + head_pad],
    the first D columns are the data); prefix_lse, suffix_lse (f32, in the case's layout and base);
    output_scale (f32[1], only for fp8). Empty requests' prefix rows hold a finite garbage LSE and NaN
    output, as a real backend can leave them; padding tokens and padded columns hold NaN.
    """
    rng = np.random.default_rng(seed)
    T, H, D = case.num_tokens, case.num_heads, case.head_dim
    dt = DTYPES[case.dtype]
    qsl, cu = offsets(case, seed)
    n_real = int(qsl[-1])

    def outputs():
        x = np.full((T, H, D + case.head_pad), np.nan, dtype=np.float32)
        x[:n_real, :, :D] = rng.standard_normal((n_real, H, D), dtype=np.float32)
        return x.astype(dt)

    def lse():  # natural-log magnitudes typical of attention (log of a sum of exps)
        x = rng.normal(4.0, 3.0, size=(H, T)).astype(np.float32)
        x[:, n_real:] = np.nan
        return x

    prefix_output, suffix_output = outputs(), outputs()
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
    if case.out_dtype is not None:
        inputs["output_scale"] = np.array([0.05], dtype=np.float32)
    return inputs
