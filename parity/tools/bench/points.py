"""The benchmark's workload points and their byte formulas (`python -m parity bench`, parity/tools/bench/__init__.py)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from parity.harness import cases

L2_BYTES = 60e6  # H200 L2 rounded up: a working set below ~3x this is partly served from cache
MEMORY_CAP_BYTES = 60e9  # merge points needing more (inputs + output + LSEs) are skipped
CEILING_ELEMS = 1 << 30  # 2 GiB of bf16 per tensor
MAX_ROTATION = 16
HOST_T = 16  # tokens of the `host` metric's tiny inputs (per-call host cost, not bandwidth)

# docs/spec.md 7: upstream's kernels measured on an H200 (and the B300 mask numbers), for comparison only.
UPSTREAM = {
    "source": "docs/spec.md section 7 (upstream vLLM kernels, H200)",
    "mask_gpu_time_us": {"2k_balanced": 2.0, "32k_balanced": 4.2, "131k_skewed": 9.8},
    "mask_latency_us": {"2k_balanced": 5.6, "32k_balanced": 8.2, "131k_skewed": 14.9},
    "mask_latency_b300_us": {"2k_balanced": 12.51, "32k_balanced": 12.57, "131k_skewed": 13.18},
    "merge_tbps": 1.18,
    "merge_note": "T=32K..131K, H=64/128, D=128, bf16; one (token, head) per program",
    "add_2r1w_tbps": 4.41,
    "fill_w_tbps": 3.40,
}

FORMULAS = {
    "merge": "bytes = 2*T*H*D*in_bytes + T*H*D*out_bytes + 2*T*H*4 (+ T*H*4 with an output LSE)",
    "merge_n": "bytes = N*(T*H*D*in_bytes + T*H*4) + T*H*D*out_bytes (+ T*H*4 with an output LSE); variant chain "
               "(N - 1 chained 2-way merges) is charged the same bytes",
    "mask": "bytes = masked_tokens*H*4 (+ masked_tokens*H*D*out_bytes with variant lse+out)",
    "layout": "the LSE layout (HT = [H, T], TH = [T, H]), the LSE base (e or 2) and the N-way partials' view "
              "(contig = [N, T, H, D], gather = the [T, N, H, D] all-gather buffer read as [N, T, H, D]; Triton "
              "only: JAX arrays have no strides) change no byte count",
    "ceiling": "add: 3 * 2 GiB (two reads, one write); fill: 2 GiB (one write); floors: an empty Triton kernel "
               "(gpu_time, host, eager) and a jitted JAX identity (host, eager)",
    "tbps": "bytes / p50 time / 1e12; frac_ceiling = tbps / ceiling tbps of this run (gpu_time)",
}

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
SHORT = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}
MERGE_VARIANTS = ("plain", "lse", "fused")
N_WAY_VARIANTS = ("plain", "lse", "fused", "chain")
MASK_VARIANTS = ("lse", "lse+out")
LAYOUTS = ("HT/e", "HT/2", "TH/e", "TH/2")  # lse_layout / lse_base
VIEWS = ("contig", "gather")
HEAD_DIMS = (64, 128, 256, 512)  # 512: the MLA latent
FUSED_REQUEST_LEN = 128
LAYOUT_T, LAYOUT_H, LAYOUT_N = 32768, 64, 4  # the layout section's fixed axes (smoke: SMOKE_T, 2, 3)
SMOKE_T = 64  # the smoke grid's tokens: plumbing only, each interpreted program costs

# Grids per mode: (T values, H values, D values, dtypes, merge variants, mask variants).
GRIDS = {
    "full": ((2048, 32768, 131072), (16, 64, 128), (128, 512), ("bfloat16", "float32"), MERGE_VARIANTS,
             MASK_VARIANTS),
    "quick": ((2048, 32768, 131072), (64,), (128,), ("bfloat16",), MERGE_VARIANTS, MASK_VARIANTS),
    "smoke": ((SMOKE_T,), (2,), (64,), ("bfloat16",), MERGE_VARIANTS, ("lse",)),
}
# N-way points per mode: (N values, T values, variants); H = 64, D = 128, bf16.
N_GRIDS = {
    "full": ((2, 4, 8), (2048, 32768, 131072), N_WAY_VARIANTS),
    "quick": ((2, 4, 8), (32768, 131072), N_WAY_VARIANTS),
    "smoke": ((3,), (SMOKE_T,), N_WAY_VARIANTS),
}
# The layout section per mode: (layouts, head dims, N-way partials views, 2-way variants); 2-way points at every
# layout x D x variant, N-way points (N = LAYOUT_N, variant lse) at every layout x D x view; plus the mask in
# the TH layout. HT/e contig points of the main grid are not repeated.
LAYOUT_GRIDS = {
    "full": (LAYOUTS, HEAD_DIMS, VIEWS, ("lse", "fused")),
    "quick": (("HT/e", "TH/2"), (128, 512), VIEWS, ("lse",)),
    "smoke": (("HT/e", "TH/2"), (64,), VIEWS, ("lse",)),
}
SMOKE_MASK_CASES = ("upstream_vector",)  # tiny "ci" workload: the seed ones are too big for interpreters
LAYOUT_MASK_CASES = {"full": ("32k_balanced",), "quick": ("32k_balanced",), "smoke": SMOKE_MASK_CASES}


def parse_layout(s: str) -> tuple[str, str]:
    """"HT/e" -> ("HT", "e"); the LSE layout and base of a layout string."""
    layout, _, base = s.partition("/")
    if layout not in ("HT", "TH") or base not in ("e", "2"):
        raise ValueError(f"layout must be one of {LAYOUTS}, got {s!r}")
    return layout, base


def base_value(base: str) -> float:
    return math.e if base == "e" else 2.0


@dataclasses.dataclass(frozen=True)
class MergePoint:
    """One merge benchmark point: outputs dtype[T, H, D], LSEs f32[H, T] (`lse_layout` "TH": [T, H]) in base
    `lse_base` ("e" or "2"); `partials` N > 0 for the N-way merge of dtype[N, T, H, D] (docs/spec.md 8), 0 for
    the 2-way merge (4). `view` "gather": the N-way partials are the [T, N, H, D] all-gather buffer read as
    [N, T, H, D] (Triton only)."""

    T: int
    H: int
    D: int
    dtype: str
    variant: str  # "plain" | "lse" | "fused" | "chain" (N-way only: N - 1 chained 2-way merges)
    partials: int = 0
    lse_layout: str = "HT"
    lse_base: str = "e"
    view: str = "contig"

    @property
    def op(self) -> str:
        return "merge_n" if self.partials else "merge"

    @property
    def n_inputs(self) -> int:
        return self.partials or 2

    @property
    def elems(self) -> int:
        return self.T * self.H * self.D

    @property
    def output_lse(self) -> bool:
        return self.variant != "plain"

    @property
    def bytes(self) -> int:
        """Effective bytes of one call (`FORMULAS`); the output dtype is the input dtype."""
        in_b = ITEMSIZE[self.dtype]
        th = self.T * self.H
        return self.n_inputs * (self.elems * in_b + th * 4) + self.elems * in_b + (th * 4 if self.output_lse else 0)

    @property
    def memory(self) -> int:
        """Device bytes of one input/output set (both frameworks' outputs are not alive together)."""
        return (self.n_inputs + 1) * (self.elems * ITEMSIZE[self.dtype] + self.T * self.H * 4)

    @property
    def workload(self) -> str:
        return f"T={self.T} H={self.H} D={self.D}" + (f" N={self.partials}" if self.partials else "")

    @property
    def layout(self) -> str:
        """"HT/e", "TH/2", ...; with " gather" for the all-gather view."""
        return f"{self.lse_layout}/{self.lse_base}" + (" gather" if self.view == "gather" else "")

    @property
    def layout_fields(self) -> dict:
        return {"lse_layout": self.lse_layout, "lse_base": self.lse_base,
                "partials_view": self.view if self.partials else None}

    @property
    def label(self) -> str:
        return f"{self.op} {self.workload} {self.dtype} {self.variant} {self.layout}"

    def fused_case(self) -> cases.Case:
        """The fused variant's batch: 128-token requests (T / 2 below 256 tokens). 2-way: every even-indexed one
        empty in the prefix. N-way: contexts of 0 to 3 * N tokens spread one token per partial, so partials are
        empty for some."""
        q = min(FUSED_REQUEST_LEN, max(1, self.T // 2))
        n = self.T // q
        if self.partials:
            ctx = tuple(int(x) for x in np.random.default_rng(n).integers(0, 3 * self.partials + 1, size=n))
            return cases.Case(f"fused_n{self.partials}_T{self.T}", (q,) * n, (), num_heads=self.H,
                              head_dim=self.D, dtype=self.dtype, partials=self.partials, context_lens=ctx)
        return cases.Case(f"fused_T{self.T}", (q,) * n, tuple(range(0, n, 2)), num_heads=self.H,
                          head_dim=self.D, dtype=self.dtype)


def merge_points(mode: str) -> list[MergePoint]:
    """The merge grid of `mode` ("full", "quick", "smoke"), smallest working sets first, then the N-way points
    (the chained alternative only at N = 4, the issue's comparison point). All in the HT/e layout, contiguous."""
    t_vals, h_vals, d_vals, dtypes, variants, _ = GRIDS[mode]
    pts = [MergePoint(t, h, d, dt, v) for dt in dtypes for d in d_vals for h in h_vals for t in t_vals
           for v in variants]
    pts = sorted(pts, key=lambda p: (p.dtype != "bfloat16", p.elems, p.D, MERGE_VARIANTS.index(p.variant)))
    n_vals, t_vals, variants = N_GRIDS[mode]
    h, d = (2, 64) if mode == "smoke" else (64, 128)
    pts += [MergePoint(t, h, d, "bfloat16", v, n) for t in t_vals for n in n_vals for v in variants
            if v != "chain" or n == (3 if mode == "smoke" else 4)]
    return pts


def layout_points(mode: str, layouts=None, head_dims=None, views=None) -> list[MergePoint]:
    """The layout section of `mode` (`LAYOUT_GRIDS`; `layouts`, `head_dims`, `views` override its axes): bf16
    2-way points at every layout x D x variant and N-way lse points at every layout x D x view, at
    T = LAYOUT_T, H = LAYOUT_H, N = LAYOUT_N (smoke: SMOKE_T, 2, 3). Points already in `merge_points` are left out."""
    d_layouts, d_dims, d_views, variants = LAYOUT_GRIDS[mode]
    layouts = [parse_layout(s) for s in (layouts or d_layouts)]
    head_dims, views = tuple(head_dims or d_dims), tuple(views or d_views)
    T, H, N = (SMOKE_T, 2, 3) if mode == "smoke" else (LAYOUT_T, LAYOUT_H, LAYOUT_N)
    main = set(merge_points(mode))
    pts = [MergePoint(T, H, d, "bfloat16", v, 0, lay, base) for d in head_dims for lay, base in layouts
           for v in variants]
    pts += [MergePoint(T, H, d, "bfloat16", "lse", N, lay, base, view) for d in head_dims for lay, base in layouts
            for view in views]
    out = []
    for p in pts:
        if p not in main and p not in out:
            out.append(p)
    return out


def mask_cases(mode: str) -> list[cases.Case]:
    if mode == "smoke":
        return [cases.by_name(n) for n in SMOKE_MASK_CASES]
    return cases.select("seed")


def masked_tokens(case: cases.Case) -> int:
    """Query tokens of the requests whose context chunk is empty (decided from the offsets, docs/spec.md 3)."""
    qsl, cu = cases.offsets(case)
    lens, empty = np.diff(qsl), np.diff(cu) == 0
    return int(lens[empty].sum())


def mask_bytes(case: cases.Case, variant: str) -> int:
    """Bytes written by one mask call (`FORMULAS["mask"]`)."""
    n = masked_tokens(case)
    b = n * case.num_heads * 4
    if variant == "lse+out":
        b += n * case.num_heads * case.head_dim * ITEMSIZE[case.dtype]
    return b


def rotation(bytes_per_call: int, memory_per_set: int, on_gpu: bool) -> int:
    """Input/output sets to cycle through so one pass over them exceeds 3x L2 (1 when already large)."""
    if not on_gpu or bytes_per_call >= 3 * L2_BYTES:
        return 1
    k = math.ceil(3 * L2_BYTES / max(bytes_per_call, 1))
    return max(1, min(k, MAX_ROTATION, int(MEMORY_CAP_BYTES // max(memory_per_set, 1))))
