"""JAX attention kernels that return (or let the caller derive) an LSE, each behind `run(spec, inputs) -> Raw`.

`jax.nn.dot_product_attention` (XLA and cuDNN) takes a padded batch, one batch row per request, with
`query_seq_lengths` / `key_value_seq_lengths`; the Pallas GPU ops take their own shapes (the flash `mha` a batch
with shared segment ids, the decode `gqa` one query per sequence with KV lengths) and run in interpret mode off
the GPU. Padding slots of a batch hold random values, so a kernel that averages them shows as "mean_v".
"""

from __future__ import annotations

import importlib
import inspect

import numpy as np

from parity.tools.probe.core import NUM_HEADS, Inputs, Raw, Spec, Unsupported


def _on_gpu() -> bool:
    import jax

    return jax.default_backend() == "gpu"


class JaxBackend:
    name = kernel = ""
    framework = "jax"
    module = "jax"
    gpu_only = False

    def unavailable(self) -> str | None:
        try:
            importlib.import_module(self.module)
        except ImportError as e:
            return f"not importable ({e})"
        if self.gpu_only and not _on_gpu():
            return "needs a GPU (JAX's default backend is not 'gpu')"
        return self._missing()

    def _missing(self) -> str | None:
        return None

    @property
    def dtype(self) -> str:
        return "bfloat16" if _on_gpu() else "float32"

    def version(self) -> dict:
        import jax
        import jaxlib

        v = {"jax": jax.__version__, "jaxlib": jaxlib.__version__, "jax_backend": jax.default_backend()}
        try:
            from jax._src.lib import cuda_versions

            if cuda_versions is not None:
                v["cudnn"] = cuda_versions.cudnn_get_version()
        except Exception:  # noqa: BLE001 - informational only
            pass
        return v

    def array(self, x):
        import jax.numpy as jnp

        return jnp.asarray(x, dtype=jnp.dtype(self.dtype))


def _batch(spec: Spec, inputs: Inputs, tq: int, tk: int, seed: int = 1):
    """Packed rows to one batch row per request, [R, tq|tk, H, D]; padding slots random. Returns the arrays and
    the (batch row, position) of each reported row: the requests' tokens, then (with `pad_rows`) every padding
    slot of the query axis."""
    rng = np.random.default_rng(seed)
    num_r = len(spec.q_lens)
    qsl, cu = spec.qsl, spec.cu

    def fill(x, offsets, lens, t):
        shape = (num_r, t) + x.shape[1:]
        out = rng.standard_normal(shape, dtype=np.float32).astype(np.float32)
        for r, n in enumerate(lens):
            out[r, :n] = x[offsets[r]:offsets[r] + n]
        return out

    q = fill(inputs.q, qsl, spec.q_lens, tq)
    k, v = fill(inputs.k, cu, spec.kv_lens, tk), fill(inputs.v, cu, spec.kv_lens, tk)
    where = [(r, t) for r, n in enumerate(spec.q_lens) for t in range(n)]
    if spec.pad_rows:
        where += [(r, t) for r, n in enumerate(spec.q_lens) for t in range(n, tq)]
    return q, k, v, np.array(where, dtype=np.int64).reshape(-1, 2)


class JaxDPA(JaxBackend):
    """jax.nn.dot_product_attention(implementation=...), with return_residual=True where this jax has it."""

    def __init__(self, implementation: str):
        self.implementation = implementation
        self.name = f"jax-dpa-{implementation}"
        self.gpu_only = implementation == "cudnn"
        self.kernel = (f"jax.nn.dot_product_attention(implementation={implementation!r}, return_residual=True), one "
                       "padded batch row per request with query/key_value_seq_lengths")

    @property
    def dtype(self) -> str:
        return "bfloat16" if self.implementation == "cudnn" else "float32"

    def run(self, spec: Spec, inputs: Inputs) -> Raw:
        import jax
        import jax.numpy as jnp

        has_residual = "return_residual" in inspect.signature(jax.nn.dot_product_attention).parameters
        if not has_residual and self.implementation == "cudnn":
            raise Unsupported(f"jax {jax.__version__}: dot_product_attention has no return_residual (no LSE)")
        round_up = 128 if self.implementation == "cudnn" else 1  # cuDNN's flash path wants whole 128-row tiles
        tq = -(-(max(spec.q_lens) + spec.pad_rows) // round_up) * round_up
        tk = -(-max(max(spec.kv_lens), 1) // round_up) * round_up
        q, k, v, where = _batch(spec, inputs, tq, tk)
        mask = None
        if spec.masked_rows:
            m = np.ones((len(spec.q_lens), 1, tq, tk), bool)
            row_of = {int(spec.qsl[r]) + t: (r, t) for r, n in enumerate(spec.q_lens) for t in range(n)}
            for i in spec.masked_rows:
                m[row_of[i][0], 0, row_of[i][1]] = False
            mask = jnp.asarray(m)
        kw = dict(mask=mask, scale=inputs.scale, is_causal=spec.causal,
                  query_seq_lengths=jnp.asarray(spec.q_lens, jnp.int32),
                  key_value_seq_lengths=jnp.asarray(spec.kv_lens, jnp.int32), implementation=self.implementation)
        qa, ka, va = self.array(q), self.array(k), self.array(v)
        if has_residual:
            out, lse = jax.nn.dot_product_attention(qa, ka, va, return_residual=True, **kw)
            layout, source = f"[B, T, H] (shape {list(lse.shape)})", "returned (return_residual=True)"
            lse = np.asarray(lse, np.float32)[where[:, 0], where[:, 1]].T
        else:
            out = jax.nn.dot_product_attention(qa, ka, va, **kw)
            lse = self._derived_lse(q, k, spec, mask, inputs.scale, tq, tk)[where[:, 0], where[:, 1]].T
            layout = "[B, T, H] (derived)"
            source = ("derived: jax.nn.logsumexp(scale * q.k + where(visible, 0, -inf)) with the same lengths, "
                      "causality and mask (this jax returns no residual)")
        out = np.asarray(out, np.float32)[where[:, 0], where[:, 1]]
        mean_v = v.mean(axis=1)[where[:, 0]]
        return Raw(out=out, lse=lse, lse_layout=layout, lse_dtype="float32", out_dtype=self.dtype, lse_source=source,
                   mean_v=mean_v, note=f"padded batch: {len(spec.q_lens)} rows of {tq} queries and {tk} keys")

    @staticmethod
    def _derived_lse(q, k, spec, mask, scale, tq, tk):
        import jax
        import jax.numpy as jnp

        s = jnp.einsum("bqhd,bkhd->bqhk", q, k) * scale
        vis = ((np.arange(tq)[None, :, None] < np.asarray(spec.q_lens)[:, None, None])
               & (np.arange(tk)[None, None, :] < np.asarray(spec.kv_lens)[:, None, None]))
        if spec.causal:
            vis = vis & (np.arange(tk)[None, None, :] <= np.arange(tq)[None, :, None])
        if mask is not None:
            vis = vis & np.asarray(mask)[:, 0]
        return np.asarray(jax.nn.logsumexp(jnp.where(jnp.asarray(vis)[:, :, None, :], s, -jnp.inf), axis=-1))


class JaxPallasMHA(JaxBackend):
    name = "jax-pallas-mha"
    kernel = ("jax.experimental.pallas.ops.gpu.attention.mha(return_residuals=True) (Pallas flash attention; "
              "interpret mode off the GPU)")
    module = "jax.experimental.pallas.ops.gpu.attention"

    def run(self, spec: Spec, inputs: Inputs) -> Raw:
        from jax.experimental.pallas.ops.gpu import attention

        if not spec.single_request or spec.masked_rows:
            raise Unsupported("q and kv share one segment_ids array and there are no lengths or mask: every row "
                              "sees at least its own position")
        params = inspect.signature(attention.mha).parameters
        if "return_residuals" not in params:
            raise Unsupported("this mha has no return_residuals (no LSE)")
        q, k, v = (self.array(x[None]) for x in (inputs.q, inputs.k, inputs.v))
        kw = {"interpret": True} if not _on_gpu() and "interpret" in params else {}
        out, lse = attention.mha(q, k, v, None, sm_scale=inputs.scale, causal=spec.causal, return_residuals=True, **kw)
        return Raw(out=np.asarray(out, np.float32)[0], lse=np.asarray(lse, np.float32)[0],
                   lse_layout=f"[B, H, T] (shape {list(lse.shape)})", lse_dtype=str(lse.dtype), out_dtype=self.dtype,
                   lse_source="returned (return_residuals=True)",
                   mean_v=np.broadcast_to(inputs.v.mean(axis=0), inputs.q.shape[:1] + inputs.v.shape[1:]))


class JaxPallasDecode(JaxBackend):
    name = "jax-pallas-decode"
    kernel = ("jax.experimental.pallas.ops.gpu.decode_attention.gqa(kv_seq_len=, return_residuals=True), one "
              "query per sequence; LSE derived as m + log(l)")
    module = "jax.experimental.pallas.ops.gpu.decode_attention"

    def run(self, spec: Spec, inputs: Inputs) -> Raw:
        import jax.numpy as jnp
        from jax.experimental.pallas.ops.gpu import decode_attention

        if spec.masked_rows or spec.pad_rows:
            raise Unsupported("one query row per sequence, no mask: a masked or padding row is a zero-length "
                              "sequence (zero_kv)")
        if spec.causal and spec.q_lens != spec.kv_lens:
            raise Unsupported("no causal mask: causal only as per-row KV lengths, when every request has as many "
                              "KV rows as queries")
        params = inspect.signature(decode_attention.gqa).parameters
        if "return_residuals" not in params:
            raise Unsupported("this gqa has no return_residuals (no LSE)")
        tk = max(16, 1 << (max(max(spec.kv_lens), 1) - 1).bit_length())
        _, k, v, where = _batch(spec, inputs, max(spec.q_lens), tk)
        req = where[:, 0]
        lens = np.asarray(spec.kv_lens)[req]
        if spec.causal:
            lens = where[:, 1] + 1
        kw = {"interpret": True} if not _on_gpu() and "interpret" in params else {}
        if "k_splits" in params:
            kw["k_splits"] = 1
        out, (l, m) = decode_attention.gqa(self.array(inputs.q[:spec.num_tokens]), self.array(k[req]),
                                           self.array(v[req]), kv_seq_len=jnp.asarray(lens, jnp.int32),
                                           sm_scale=inputs.scale, return_residuals=True, **kw)
        lse = jnp.asarray(m, jnp.float32) + jnp.log(jnp.asarray(l, jnp.float32))
        return Raw(out=np.asarray(out, np.float32), lse=np.asarray(lse).T, lse_layout=f"[B, H] (shape {list(l.shape)})",
                   lse_dtype="float32", out_dtype=self.dtype,
                   lse_source="derived: m + log(l) from return_residuals=(l, m)",
                   mean_v=v.mean(axis=1)[req], note=f"one query per sequence, {tk} KV slots each")


BACKENDS = (JaxDPA("xla"), JaxDPA("cudnn"), JaxPallasMHA(), JaxPallasDecode())
