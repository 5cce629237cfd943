"""The torch path: the mask and the merges in torch operations, for devices where Triton has no driver (CPU, MPS,
XPU, a CUDA or ROCm build without Triton). `implementation="torch"` on every `triton_impl` entry point; None picks it
where Triton cannot run (`_backend.resolve_implementation`). The twin of `pallas_impl/jnp_fallback.py`.

An implementation, tested against `parity.harness.reference` like the kernels; not a second spec. The wrappers run
every check first and call these with checked tensors; they write only what the kernels write (the rows the mask
empties, the whole output of a merge, the real scales of a swizzled buffer: its padding stays the caller's), in
place through any strides. The float operations are the kernels' (docs/spec.md 4, 8), in the same order, in f32, one
torch operation at a time (eager PyTorch contracts nothing): sums over partials in index order (a Python loop over
N, each step over the whole batch), never a reduction whose order torch picks. Where the spec fixes the bits (the
mask, pass-through copies, the exact identities, NaN and the sign of zero) they are the kernels'; elsewhere exp and
log are the device library's (on CUDA libdevice's, as the kernels'), and the division is the kernels' on CUDA
(`div`: PTX's div.full.f32) and IEEE elsewhere, within the reference's tolerance. The token -> request lookup is one
`torch.searchsorted` over the offsets. The [T, H, D] work runs in chunks of `CHUNK_ELEMENTS` (tokens times heads
times the head size): each operation's temporaries stay in the CPU's caches and are reused, which halves to
quarters the time of whole-batch operations on a CPU; it changes no bit (every element's operations are its own).
"""

from __future__ import annotations

import functools

import torch

from mla_lse_common import constants

F32 = torch.float32
NEG_INF = float("-inf")
CHUNK_ELEMENTS = 1 << 19  # elements of a [C, H, D] chunk (2 MiB of f32): `python -m tools torch-path-speed`


# ---------------------------------------------------------------------------------------------------------
# Element math (pallas_impl/_math.py and triton_impl/_device.py, statement by statement)


_DIV_FULL = """
template <typename T> T div_full(T a, T b) {
  float q;
  asm("div.full.f32 %0, %1, %2;" : "=f"(q) : "f"((float)a), "f"((float)b));
  return q;
}
"""


@functools.cache
def _cuda_div_full():
    """PTX's `div.full.f32` as a torch elementwise function (a jiterator kernel, compiled by NVRTC at its first
    call), or None without one (no CUDA build, ROCm)."""
    if torch.version.cuda is None or torch.version.hip is not None:
        return None
    return torch.cuda.jiterator._create_jit_fn(_DIV_FULL)


def div(a, b):
    """`a / b` as the kernels divide (docs/spec.md 5): on a CUDA device PTX's `div.full.f32`, the division of Triton
    and of Pallas (2 ulp, not IEEE's `div.rn`, which torch's `/` is there); elsewhere IEEE division, as the
    interpreter's numpy. `b` may be a Python float (on CUDA filled into a device scalar, no host copy: torch
    multiplies by the reciprocal of a host scalar)."""
    t = a if torch.is_tensor(a) else b
    if t.device.type == "cuda" and (fn := _cuda_div_full()) is not None:
        a = a if torch.is_tensor(a) else t.new_full((), a, dtype=F32)
        b = b if torch.is_tensor(b) else t.new_full((), b, dtype=F32)
        return fn(a, b)
    return a / b


def clean_lse(x):
    """docs/spec.md 4.1: +inf (FA2's empty row) and NaN read as -inf; no base conversion."""
    return torch.where((x == float("inf")) | (x != x), NEG_INF, x)


def exp_base(x, lse_base2: bool):
    """exp(x), or for a difference x of base-2 LSEs 2^x = exp(x * ln2) (4.3: x = 0 gives exactly 1)."""
    return torch.exp(x * constants.LN2) if lse_base2 else torch.exp(x)


def merged_lse(z, m, empty, lse_base2: bool):
    """log(z) + m (base 2: log(z) * log2(e) + m), -inf where every partial is empty (m is 0 there) (4.2, 4.3)."""
    lz = torch.log(z)
    if lse_base2:
        lz = lz * constants.LOG2E
    return torch.where(empty, NEG_INF, lz) + m


def two_way_weights(p, s, lse_base2: bool):
    """(m, both_empty, z, wp, ws) of two LSE tiles whose empty rows are -inf (4.2, 4.3)."""
    m = torch.maximum(p, s)
    both_empty = m == NEG_INF
    m = torch.where(both_empty, 0.0, m)
    pe = exp_base(p - m, lse_base2)
    se = exp_base(s - m, lse_base2)
    z = pe + se
    return m, both_empty, z, div(pe, z), div(se, z)


def weighted(x, w):
    """w * x in f32 with a zero weight giving exactly 0, so NaN in an empty partial cannot leak (4.3); `w` [..., 1].
    A new f32 tensor with `torch.where(w > 0, x * w, 0)`'s bits, computed in place: the select is an AND of the
    product's bits with all ones (w > 0) or zero (+0.0), a broadcast integer op several times cheaper than a
    broadcast select on a CPU."""
    y = x.to(F32, copy=True)  # never the partial itself (an f32 partial's .to(F32) is the same tensor)
    y.mul_(w)
    y.view(torch.int32).bitwise_and_(-(w > 0.0).to(torch.int32))
    return y


def chunks(num_tokens: int, row_elements: int):
    """Token ranges (i0, i1) of about `CHUNK_ELEMENTS` elements each, rows of `row_elements` (H * D)."""
    step = max(1, CHUNK_ELEMENTS // max(row_elements, 1))
    return [(i, min(i + step, num_tokens)) for i in range(0, num_tokens, step)]


def empty_tokens(query_start_loc, cu_seq_lens, num_tokens: int):
    """bool[T] (bool[N, T] for cu_seq_lens [N, R+1]): tokens of requests with no KV in those offsets (3, 8.1);
    padding tokens (t >= qsl[R]) are not."""
    t = torch.arange(num_tokens, dtype=torch.int32, device=query_start_loc.device)
    req = torch.searchsorted(query_start_loc, t, right=True) - 1  # in [-1, R]
    num_requests = query_start_loc.shape[0] - 1
    safe = req.clamp(0, max(num_requests - 1, 0))
    empty = cu_seq_lens[..., safe + 1] == cu_seq_lens[..., safe]
    return (req >= 0) & (req < num_requests) & (t < query_start_loc[-1]) & empty


def as_th(lse, lse_layout: str):
    """An LSE (or stacked LSEs [N, ...]) as a [T, H] ([N, T, H]) view: writes through it land in `lse`."""
    return lse.transpose(-1, -2) if lse_layout == "HT" else lse


def rne_fp8(x):
    """f32 -> float8_e4m3fn, round to nearest even (torch's cast; values already clamped to +-448, NaN stays NaN,
    a quotient that rounds to -0 stores 0x80)."""
    return x.to(torch.float8_e4m3fn)


def group_quant(x, group_size: int, ue8m0: bool):
    """Per-group FP8 of f32 rows `x` [T, K] (4.7): (q f32 [T, K], the clamped quotients; scale f32 [T, K / G])."""
    g = x.reshape(x.shape[0], -1, group_size)
    amax = torch.where(g == g, g.abs(), 0.0).amax(-1)  # NaN left out of the maximum
    amax = torch.where(amax > constants.GROUP_EPS, amax, torch.full_like(amax, constants.GROUP_EPS))
    scale = div(amax, constants.FP8_E4M3_MAX)
    if ue8m0:  # rounded up to a power of two on the bits: exactly 2^ceil(log2(scale))
        scale = ((scale.view(torch.int32) + constants.UE8M0_ROUND_UP) & constants.UE8M0_EXPONENT).view(F32)
    q = div(g, scale[..., None])
    q = torch.where(q < -constants.FP8_E4M3_MAX, -constants.FP8_E4M3_MAX, q)  # comparisons: NaN stays NaN
    q = torch.where(q > constants.FP8_E4M3_MAX, constants.FP8_E4M3_MAX, q)
    return q.reshape(x.shape), scale


def e4m3_value(v):
    """f32 of float8_e4m3fn `v`, decoded from its bits (pallas_impl/_math.e4m3_value)."""
    bits = v.view(torch.uint8).to(torch.int32)
    e, m = (bits >> 3) & 0xF, bits & 7
    normal = (((e + 120) << 23) | (m << 20)).view(F32)
    mag = torch.where(e == 0, m.to(F32) * 2.0 ** -9, normal)
    mag = torch.where((bits & 0x7F) == 0x7F, float("nan"), mag)
    return torch.where(bits >= 0x80, -mag, mag)


def nvfp4_quant(x, global_scale):
    """NVFP4 of f32 rows `x` [T, K] (4.8): (codes i32 [T, K], bit 3 the sign; e4m3 block scales [T, K / 16])."""
    blocks = x.reshape(x.shape[0], -1, constants.NVFP4_BLOCK)
    g = global_scale.reshape(-1)[0].to(F32)
    amax = torch.where(blocks == blocks, blocks.abs(), 0.0).amax(-1)  # NaN left out of the maximum
    s = (amax * torch.tensor(1 / constants.FP4_E2M1_MAX, dtype=F32)) * g
    scales = rne_fp8(torch.where(s > constants.FP8_E4M3_MAX, constants.FP8_E4M3_MAX, s))
    sf = e4m3_value(scales)
    inv = torch.where(sf == 0.0, 0.0, div(1.0, torch.where(sf == 0.0, 1.0, sf * div(1.0, g))))
    y = blocks * inv[..., None]
    y = torch.where(y < -constants.FP4_E2M1_MAX, -constants.FP4_E2M1_MAX, y)  # comparisons: NaN stays NaN
    y = torch.where(y > constants.FP4_E2M1_MAX, constants.FP4_E2M1_MAX, y)
    a = y.abs()
    code = torch.zeros(y.shape, dtype=torch.int32, device=x.device)
    for value, inclusive in constants.FP4_E2M1_THRESHOLDS:
        code = code + ((a >= value) if inclusive else (a > value)).to(torch.int32)
    sign = (y.view(torch.int32) >> 31) & 1
    return (code | (sign << 3)).reshape(x.shape), scales


def swizzled_offsets(first_token: int, num_tokens: int, num_blocks: int, device):
    """i64[T', K]: where scale (t, k) of tokens first_token .. first_token + T' - 1 lands in the 128x4-swizzled
    buffer (4.8): ((t // 128) * (K_pad / 4) + k // 4) * 512 + (t % 32) * 16 + ((t % 128) // 32) * 4 + k % 4."""
    rows, cols = constants.NVFP4_SWIZZLE
    k_tiles = -(-num_blocks // cols)
    t = torch.arange(first_token, first_token + num_tokens, dtype=torch.int64, device=device)[:, None]
    k = torch.arange(num_blocks, dtype=torch.int64, device=device)[None, :]
    return ((t // rows) * k_tiles + k // cols) * (rows * cols) + (t % 32) * 16 + ((t % rows) // 32) * cols + k % cols


# ---------------------------------------------------------------------------------------------------------
# The stores of a merged f32 tile (triton_impl/_device.py: _store_output, _store_group_fp8, _store_nvfp4)


def store(output, out, last, copy_from: int, *, rows=None, output_scale=None, group_size=None, scale_ue8m0=False,
          output_group_scale=None, output_block_scale=None, scale_layout="row") -> None:
    """The merged f32 rows `out` [C, H, D] of tokens `rows` (a range; all T when None) into `output` (4.4, 4.6, 4.7,
    4.8): the pass-through tokens, rows `copy_from` on (t >= prefill_tokens_with_context: a tail), take `last` (their
    rows) bit for bit where the output has its dtype, else as f32 rounded once like a merged row. `out` is
    overwritten."""
    num_tokens = out.shape[0]
    first, rows = (0, slice(None)) if rows is None else (rows[0], slice(*rows))
    output = output[rows]
    if last.dtype == output.dtype and output_scale is None and group_size is None:  # 4.4: the bits themselves
        output[:copy_from].copy_(out[:copy_from])
        output[copy_from:].copy_(last[copy_from:])
        return
    out[copy_from:].copy_(last[copy_from:])  # 4.4: the copied rows as f32, then rounded like merged rows
    if output_block_scale is not None:  # 4.8
        codes, scales = nvfp4_quant(out.reshape(num_tokens, -1), output_scale)
        pairs = codes.reshape(num_tokens, -1, 2)
        output.copy_((pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8).view(output.shape))
        if scale_layout == "swizzled":
            flat = output_block_scale.view(torch.uint8).view(-1)  # bytes: fp8 indexing is not on every device
            flat[swizzled_offsets(first, num_tokens, scales.shape[1], out.device).reshape(-1)] = scales.view(
                torch.uint8).reshape(-1)
        else:
            output_block_scale[rows].copy_(scales)
    elif group_size:  # 4.7
        q, scales = group_quant(out.reshape(num_tokens, -1), group_size, scale_ue8m0)
        output.copy_(rne_fp8(q).view(output.shape))
        output_group_scale[rows].copy_(scales)
    elif output_scale is not None:  # 4.6: scale, clamp with comparisons (NaN stays NaN), cast
        x = div(out, output_scale.reshape(-1)[0])
        x = torch.where(x < -constants.FP8_E4M3_MAX, -constants.FP8_E4M3_MAX, x)
        output.copy_(rne_fp8(torch.where(x > constants.FP8_E4M3_MAX, constants.FP8_E4M3_MAX, x)))
    else:  # another output dtype: one rounding of the f32 rows
        output.copy_(out)


def _copy_from(prefill_tokens: int, first: int, last: int) -> int:
    """The first pass-through row (t >= prefill_tokens) of tokens first .. last - 1, as a row of that range."""
    return min(max(prefill_tokens - first, 0), last - first)


def store_options(options: dict, output_scale, scales) -> dict:
    """The keyword options of `store` for a merge's plan (`options`: its `plans.torch_launch` options) and the call's
    output scale and scales tensor (per-group FP8's or NVFP4's block scales: the wrappers' one slot)."""
    nvfp4 = options["nvfp4"]
    return dict(output_scale=output_scale, group_size=None if nvfp4 else options["group_size"],
                scale_ue8m0=options["scale_ue8m0"], output_group_scale=None if nvfp4 else scales,
                output_block_scale=scales if nvfp4 else None, scale_layout=options["scale_layout"])


def store_lse(output_lse, lse_th, lse_layout: str) -> None:
    """A merged `[T, H]` LSE into `output_lse` (in its layout, through its strides)."""
    as_th(output_lse, lse_layout).copy_(lse_th)


# ---------------------------------------------------------------------------------------------------------
# The operations


def mask_empty_context_lse(lse, query_start_loc, cu_seq_lens, output, lse_layout: str) -> None:
    """docs/spec.md 3, in place: the LSE rows of tokens of requests with an empty chunk -inf, their output rows 0."""
    view = as_th(lse, lse_layout)
    empty = empty_tokens(query_start_loc, cu_seq_lens, view.shape[0])
    view.masked_fill_(empty[:, None], NEG_INF)
    if output is not None:
        output.masked_fill_(empty[:, None, None], 0)


def merge_attn_states(output, prefix_output, prefix_lse, suffix_output, suffix_lse, output_lse, prefill_tokens: int,
                      query_start_loc, prefix_cu_seq_lens, *, lse_layout: str, lse_base2: bool, **stores) -> None:
    """The 2-way merge (docs/spec.md 4), in place (`stores`: the options of `store`)."""
    num_tokens = prefix_output.shape[0]
    p_raw, s_raw = as_th(prefix_lse, lse_layout), as_th(suffix_lse, lse_layout)
    p, s = clean_lse(p_raw), clean_lse(s_raw)  # 4.1; a base-2 LSE stays base 2
    if query_start_loc is not None:  # 4.5: a token of a request whose prefix chunk is empty has p = -inf
        p = torch.where(empty_tokens(query_start_loc, prefix_cu_seq_lens, num_tokens)[:, None], NEG_INF, p)
    m, both_empty, z, wp, ws = two_way_weights(p, s, lse_base2)
    copy_t = torch.arange(num_tokens, device=prefix_output.device) >= prefill_tokens  # 4.4
    if output_lse is not None:  # before the output, which may alias a partial (the merge in place)
        lse = torch.where(copy_t[:, None], s_raw, merged_lse(z, m, both_empty, lse_base2))
    wp, ws = wp[..., None], ws[..., None]
    for i, j in chunks(num_tokens, prefix_output.shape[1] * prefix_output.shape[2]):
        out = weighted(prefix_output[i:j], wp[i:j])
        out.add_(weighted(suffix_output[i:j], ws[i:j]))
        # 4.2: where both partials are empty out is already +0: both weights are 0 / 0 = NaN there, which `weighted`
        # turns into exactly 0 (the kernels' where(both_empty, 0, out) changes no bit of it)
        store(output, out, suffix_output[i:j], _copy_from(prefill_tokens, i, j), rows=(i, j), **stores)
    if output_lse is not None:
        store_lse(output_lse, lse, lse_layout)


def n_way_weights(lses, query_start_loc, cu_seq_lens, num_tokens: int, lse_layout: str, lse_base2: bool):
    """(raw [N, T, H] LSEs, e_i as a function of i, m, all_empty, z, empty bool[N, T] or None) of the N-way merge
    (8.1-8.3): the maximum (exact in any order) and z = e_0 + ... + e_{N-1} in index order."""
    l_raw = as_th(lses, lse_layout)
    lse = clean_lse(l_raw)  # 4.1; a base-2 LSE stays base 2
    empty = None
    if query_start_loc is not None:
        empty = empty_tokens(query_start_loc, cu_seq_lens, num_tokens)  # [N, T]
        lse = torch.where(empty[:, :, None], NEG_INF, lse)
    m = lse.amax(0)
    all_empty = m == NEG_INF
    m = torch.where(all_empty, 0.0, m)

    def e(i, first=0, last=None):
        """e_i of tokens first .. last - 1 (all by default)."""
        return exp_base(lse[i, first:last] - m[first:last], lse_base2)

    z = e(0)
    for i in range(1, lse.shape[0]):  # index order
        z = z + e(i)
    return l_raw, e, m, all_empty, z, empty


def copied_lse(last_raw, empty):
    """The pass-through LSE (8.4), [T, H]: the last partial's raw bits, -inf where the fused mask empties it."""
    return last_raw if empty is None else torch.where(empty[-1][:, None], NEG_INF, last_raw)


def merge_attn_states_n(output, outputs, lses, output_lse, prefill_tokens: int, query_start_loc, cu_seq_lens, *,
                        lse_layout: str, lse_base2: bool, **stores) -> None:
    """The N-way merge (docs/spec.md 8) of N >= 1 partials, in place (`stores`: the options of `store`)."""
    num_partials, num_tokens = outputs.shape[:2]
    l_raw, e, m, all_empty, z, empty = n_way_weights(lses, query_start_loc, cu_seq_lens, num_tokens, lse_layout,
                                                     lse_base2)
    copy_t = torch.arange(num_tokens, device=outputs.device) >= prefill_tokens
    if output_lse is not None:
        lse = torch.where(copy_t[:, None], copied_lse(l_raw[-1], empty), merged_lse(z, m, all_empty, lse_base2))
    for i, j in chunks(num_tokens, outputs.shape[2] * outputs.shape[3]):
        out = weighted(outputs[0, i:j], div(e(0, i, j), z[i:j])[..., None])
        for k in range(1, num_partials):  # index order
            out.add_(weighted(outputs[k, i:j], div(e(k, i, j), z[i:j])[..., None]))
        # 8.2: where every partial is empty out is already +0 (every weight 0 / 0 = NaN, turned into 0)
        store(output, out, outputs[-1, i:j], _copy_from(prefill_tokens, i, j), rows=(i, j), **stores)
    if output_lse is not None:
        store_lse(output_lse, lse, lse_layout)


def cp_rescale(scaled, merged, partial_output, lses, query_start_loc, cu_seq_lens, rank: int, prefill_tokens: int, *,
               lse_layout: str, lse_base2: bool) -> None:
    """The context-parallel rescale (triton_impl/cp_merge.py's kernel), in place: `scaled` [N, T, H / N, D] group j
    holds heads [j * H / N, (j + 1) * H / N) of this rank's weighted partial; `merged` (or None) the merged LSE."""
    num_partials, num_tokens = lses.shape[0], partial_output.shape[0]
    l_raw, e, m, all_empty, z, empty = n_way_weights(lses, query_start_loc, cu_seq_lens, num_tokens, lse_layout,
                                                     lse_base2)
    o = partial_output.to(F32)
    out = weighted(o, div(e(rank), z)[..., None])
    out = torch.where(all_empty[..., None], 0.0, out)
    copy_t = (torch.arange(num_tokens, device=o.device) >= prefill_tokens)[:, None, None]
    out = torch.where(copy_t, o, out) if rank == num_partials - 1 else torch.where(copy_t, -0.0, out)
    heads = scaled.shape[2]
    scaled.copy_(out.view(num_tokens, num_partials, heads, -1).transpose(0, 1))
    if merged is not None:
        lse = torch.where(copy_t[:, :, 0], copied_lse(l_raw[-1], empty), merged_lse(z, m, all_empty, lse_base2))
        store_lse(merged, lse, lse_layout)
