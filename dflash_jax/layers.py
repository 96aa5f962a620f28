"""Transformer building blocks shared by the targets and the drafter (Flax NNX).

Every parameter carries its logical axis names in the ``axes`` metadata; ``sharding.py`` maps them
to a mesh. Linear kernels are stored ``[in, out]`` (torch's ``[out, in]`` transposed on load), with
attention projections split per head so that head counts, not flattened widths, decide sharding.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dflash_jax.attention import AttentionImpl, block_attention
from dflash_jax.cache import CACHE_AXES, write_rows
from dflash_jax.sharding import local_shape, shard_kernel


def _init(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, std: float = 0.02) -> jax.Array:
    return (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF's RMSNorm numerics: normalise in float32, cast back, then scale by the weight."""
    return weight * (x.astype(jnp.float32) * row_scale(x, eps)).astype(x.dtype)


def row_scale(x: jax.Array, eps: float) -> jax.Array:
    """``x [..., dim]`` -> ``rsqrt(mean(x^2) + eps)`` float32 ``[..., 1]``: the factor ``rms_norm``
    normalises a row by."""
    xf = x.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, *, dtype, axis_name: str = "norm"):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), dtype), axes=(axis_name,))

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight[...], self.eps)

    def row_scale(self, x: jax.Array) -> jax.Array:
        """``row_scale`` of ``x [..., dim]`` (float32 ``[..., 1]``), for a norm whose weight is folded
        into the matmul after it (``DecoderLayer.fold_norms``)."""
        return row_scale(x, self.eps)


def add_rms_norm(h: jax.Array, delta: jax.Array | None, norm: RMSNorm, *, fused: bool) -> tuple[jax.Array, jax.Array]:
    """A residual add and the norm that reads it: ``s = h + delta`` (``delta`` None: ``s = h``) and
    ``norm(s)``, both ``[..., hidden]``.

    ``fused``: one Pallas kernel (``kernels_pallas.add_rms_norm``, forward only: inference) where
    the platform and width allow, instead of the three XLA kernels this is otherwise at batch 1.
    """
    weight = norm.weight[...]
    if fused and weight.dtype == h.dtype:
        import kernels_pallas

        if kernels_pallas.add_rms_norm_supported(h.shape[-1]):
            rows = ("batch",) + (None,) * (h.ndim - 1)  # per device: its rows, the whole width
            if delta is None:
                kernel = lambda h, w: kernels_pallas.add_rms_norm(h, None, w, eps=norm.eps)  # noqa: E731
                return shard_kernel(kernel, (rows, (None,)), (rows, rows))(h, weight)
            kernel = lambda h, d, w: kernels_pallas.add_rms_norm(h, d, w, eps=norm.eps)  # noqa: E731
            return shard_kernel(kernel, (rows, rows, (None,)), (rows, rows))(h, delta, weight)
    s = h if delta is None else h + delta
    return s, norm(s)


# XLA:GPU rewrites a dot with a one-row operand into a multiply and a reduction when its operands
# hold fewer than this many elements (``ShouldStrengthReduceDotToReduce``, gpu_algebraic_simplifier.cc).
GPU_STRENGTH_REDUCTION_LIMIT = 10_000_000
# On one GPU, a decode token's projections with their split-K written out (``single_row_partials``;
# docs/benchmarks.md, twenty-third session), 0: one dot, split by XLA. The fused QKV projection as
# this many float32 partials, which the cached-attention kernel sums (no reduction kernel after the
# GEMM); the output projection's partials summed by XLA (a faster GEMM than XLA's own split).
QKV_PARTIALS = 8
OUTPUT_PARTIALS = 8
# The engine's serving layout folds every target layer's norm weights into its matmuls
# (``DecoderLayer.fold_norms``): no norm kernel before a matmul at decode time.
FOLD_NORMS = True


def dense(x: jax.Array, w: nnx.Param, in_dims: int = 1) -> jax.Array:
    """``x [..., *in]`` times the weight ``w [*in, *out]`` (``in``: its first ``in_dims``
    dimensions) -> ``[..., *out]``: one dot over the ``in`` dimensions, with the ``out`` dimensions
    of the weight bitcast to one. A fused weight with several output dimensions (QKV ``[hidden,
    kv_heads, groups + 2, head_dim]``) then gets the GEMM XLA picks for a plain matrix; the output
    projection (``in_dims=2``) is the dot its einsum was. Every projection of the decode path goes
    through here, but a decode token's QKV and output projections on one GPU, which go through
    ``single_row_partials`` beside it: the two places that decide how a row meets XLA's GEMMs
    (docs/design.md).

    On GPUs a single row meets a weight whose shard (``w``'s logical axes under
    ``sharding.kernel_mesh``) is under ``GPU_STRENGTH_REDUCTION_LIMIT`` elements as two rows, the
    row repeated: XLA would otherwise run the dot as a multiply and a reduction, ~3x slower than its
    GEMM (the TP=2 output projection: 21 us instead of 7; docs/benchmarks.md, seventh session). A
    repeat fuses into the GEMM, where a zero row after a kernel XLA cannot fuse into is a pad kernel
    of its own (twenty-third and twenty-fourth sessions). Rows are independent: the real row gets the
    same product, up to the summation order of the GEMM XLA picks."""
    value = w[...]
    rows = x.shape[:x.ndim - in_dims]
    if math.prod(rows) == 1 and _strength_reduces_single_rows() and _shard_size(w) < GPU_STRENGTH_REDUCTION_LIMIT:
        row = x.reshape((1,) + x.shape[x.ndim - in_dims:])
        y = _dot(_two_rows(row), value, in_dims)[:1]
        return y.reshape(rows + value.shape[in_dims:])
    return _dot(x, value, in_dims)


def _two_rows(row: jax.Array) -> jax.Array:
    """``row [1, ...]`` as the two rows ``dense`` gives XLA's GEMM in its place: the row repeated."""
    return jnp.broadcast_to(row, (2,) + row.shape[1:])


def split_k_partials(x: jax.Array, w: jax.Array, parts: int) -> jax.Array:
    """``x [rows, K] @ w [K, N]`` with its split-K written out: one batched dot over ``parts``
    consecutive slices of K -> float32 partial products ``[parts, rows, N]`` (their sum in order is
    the product)."""
    rows, k = x.shape
    return jnp.einsum("rsk,skn->srn", x.reshape(rows, parts, k // parts), w.reshape(parts, k // parts, -1),
                      preferred_element_type=jnp.float32)


def single_row_partials(x: jax.Array, w: nnx.Param, parts: int, in_dims: int = 1) -> jax.Array | None:
    """``x [..., *in]`` holding one row, times ``w [*in, *out]``, on one GPU -> the product's split-K
    written out: ``parts`` float32 partial products ``[parts, 2, *out]`` over consecutive slices of
    the ``in`` dimensions, whose sum (in order) is the row's product in ``[:, 0]``; else None (not one
    row, ``parts < 2``, not on a GPU, ``w`` sharded, or ``in`` not divisible into ``parts``).

    The row is repeated to two (the copy's products are never read) so that no slice's weight is
    small enough for XLA:GPU to strength-reduce the dot (``dense``); a repeat, which XLA fuses into
    the GEMM, where a zero row was a pad kernel of its own (1.2 us per projection). XLA picks its own
    tiles for this batched dot, where for the plain one-row dot its cost model picks the split:
    written out, the 8B output projection streams 0.7 us faster (docs/benchmarks.md, twenty-third
    session)."""
    value = w[...]
    k = math.prod(value.shape[:in_dims])
    if parts < 2 or k % parts or not one_gpu_row(x, w, in_dims):
        return None
    partials = split_k_partials(jnp.broadcast_to(x.reshape(1, k), (2, k)), value.reshape(k, -1), parts)
    return partials.reshape((parts, 2) + value.shape[in_dims:])


def single_row_dot(x: jax.Array, w: nnx.Param, parts: int, in_dims: int = 1) -> jax.Array | None:
    """``dense(x, w, in_dims)`` of a single row as ``single_row_partials`` summed (in ``x``'s dtype,
    ``[..., *out]``), or None where those do not apply."""
    partials = single_row_partials(x, w, parts, in_dims)
    if partials is None:
        return None
    return jnp.sum(partials[:, :1], axis=0).astype(x.dtype).reshape(x.shape[:x.ndim - in_dims] + partials.shape[2:])


def one_gpu_row(x: jax.Array, w: nnx.Param, in_dims: int = 1) -> bool:
    """Whether ``x [..., *in]`` is a single row meeting a whole (unsharded) weight ``w`` on a GPU:
    a decode token on one GPU, where a matmul is weight streaming and every kernel before it is on
    the step's critical path."""
    return (math.prod(x.shape[:x.ndim - in_dims]) == 1 and _strength_reduces_single_rows()
            and _shard_size(w) == w.size)


def _strength_reduces_single_rows() -> bool:
    return jax.default_backend() == "gpu"


def _shard_size(w: nnx.Param) -> int:
    """Elements of this device's shard of ``w`` (all of them for a weight without logical axes)."""
    axes = w.get_metadata().get("axes")
    return math.prod(w.shape if axes is None else local_shape(axes, w.shape))


def _dot(x: jax.Array, w: jax.Array, in_dims: int) -> jax.Array:
    out = w.shape[in_dims:]
    contract = (tuple(range(x.ndim - in_dims, x.ndim)), tuple(range(in_dims)))
    y = jax.lax.dot_general(x, w.reshape(w.shape[:in_dims] + (math.prod(out),)), (contract, ((), ())))
    return y.reshape(x.shape[:x.ndim - in_dims] + out)


# ----------------------------------------------------------------------------------------------
# RoPE (neox half-split), with the rope types found in Qwen3 and Llama-3 checkpoints.
# ----------------------------------------------------------------------------------------------


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | tuple | None) -> np.ndarray:
    """``[head_dim // 2]`` float32 inverse frequencies, computed as transformers computes them."""
    scaling = dict(scaling) if scaling is not None else None
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return (inv_freq / np.float32(scaling["factor"])).astype(np.float32)
    if rope_type == "llama3":
        factor = np.float32(scaling["factor"])
        low = np.float32(scaling["low_freq_factor"])
        high = np.float32(scaling["high_freq_factor"])
        old_len = np.float32(scaling["original_max_position_embeddings"])
        low_wavelen = old_len / low
        high_wavelen = old_len / high
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise ValueError(f"rope type {rope_type!r} is not supported (supported: default, linear, llama3)")


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq) -> jax.Array:
    """Rotates ``x [..., seq, heads, head_dim]`` by ``positions [..., seq]`` (neox half-split)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)  # [..., seq, d/2]
    emb = jnp.concatenate([freqs, freqs], axis=-1)[..., None, :]  # [..., seq, 1, d]
    cos = jnp.cos(emb).astype(x.dtype)
    sin = jnp.sin(emb).astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


# ----------------------------------------------------------------------------------------------
# Attention projections, MLP, decoder layer.
# ----------------------------------------------------------------------------------------------


class Attention(nnx.Module):
    """Q/K/V/O projections (optional biases and per-head q/k RMSNorm) around ``block_attention``."""

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        eps: float,
        qk_norm: bool,
        bias: bool,
        inv_freq: np.ndarray,
        dtype,
        rngs: nnx.Rngs,
    ):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps = eps
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static: a tuple, not array state
        self.q_proj = nnx.Param(_init(rngs, (hidden, num_heads, head_dim), dtype), axes=("embed", "heads", "head_dim"))
        self.k_proj = nnx.Param(_init(rngs, (hidden, num_kv_heads, head_dim), dtype), axes=("embed", "kv_heads", "head_dim"))
        self.v_proj = nnx.Param(_init(rngs, (hidden, num_kv_heads, head_dim), dtype), axes=("embed", "kv_heads", "head_dim"))
        self.o_proj = nnx.Param(_init(rngs, (num_heads, head_dim, hidden), dtype), axes=("heads", "head_dim", "embed"))
        if bias:
            self.q_bias = nnx.Param(jnp.zeros((num_heads, head_dim), dtype), axes=("heads", "head_dim"))
            self.k_bias = nnx.Param(jnp.zeros((num_kv_heads, head_dim), dtype), axes=("kv_heads", "head_dim"))
            self.v_bias = nnx.Param(jnp.zeros((num_kv_heads, head_dim), dtype), axes=("kv_heads", "head_dim"))
            self.o_bias = nnx.Param(jnp.zeros((hidden,), dtype), axes=("embed",))
        else:
            self.q_bias = self.k_bias = self.v_bias = self.o_bias = None
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps, dtype=dtype)
            self.k_norm = RMSNorm(head_dim, eps, dtype=dtype)
        else:
            self.q_norm = self.k_norm = None
        self.qkv_proj = self.qkv_bias = None  # the fused serving layout (``fuse``)

    def fuse(self) -> None:
        """Switches (in place) to one QKV weight ``[in, kv_heads, groups + 2, head_dim]``: per KV
        head, its ``groups`` query heads, then its key, then its value.

        The serving layout: one matmul streams all three projections (at batch 1 a decode step is
        weight streaming, and one wide GEMV reaches more of the bandwidth than three narrow ones;
        docs/benchmarks.md). Grouping by KV head keeps a tensor-parallel shard's Q, K and V together.
        Checkpoints and training keep the separate layout.
        """
        if self.qkv_proj is not None or self.q_proj is None:  # fused already, or in the layer-tail layout
            return
        groups = self.num_heads // self.num_kv_heads
        hidden = self.q_proj.shape[0]
        q = self.q_proj[...].reshape(hidden, self.num_kv_heads, groups, self.head_dim)
        w = jnp.concatenate([q, self.k_proj[...][:, :, None], self.v_proj[...][:, :, None]], axis=2)
        self.qkv_proj = nnx.data(nnx.Param(w, axes=("embed", "kv_heads", None, "head_dim")))
        if self.q_bias is not None:
            qb = self.q_bias[...].reshape(self.num_kv_heads, groups, self.head_dim)
            b = jnp.concatenate([qb, self.k_bias[...][:, None], self.v_bias[...][:, None]], axis=1)
            self.qkv_bias = nnx.data(nnx.Param(b, axes=("kv_heads", None, "head_dim")))
        self.q_proj = self.k_proj = self.v_proj = None
        self.q_bias = self.k_bias = self.v_bias = None

    @staticmethod
    def _project(x, w, b):
        y = jnp.einsum("...h,hkd->...kd", x, w[...])
        return y if b is None else y + b[...]

    def _qkv(self, x: jax.Array) -> jax.Array:
        """``x [..., hidden]`` -> the raw fused projection ``[..., kv_heads, groups + 2, head_dim]``."""
        y = dense(x, self.qkv_proj)
        return y if self.qkv_bias is None else y + self.qkv_bias[...]

    def _qkv_partials(self, x: jax.Array) -> jax.Array | None:
        """``x [1, 1, hidden]``, a decode token, on one GPU -> the fused projection as
        ``QKV_PARTIALS`` float32 split-K partials ``[S, 2, 1, kv_heads, groups + 2, head_dim]``
        (``single_row_partials``), which ``cached_block_attention`` sums; else None (``_qkv``). Only
        a single row: as 8 partials, a 16-row verify block cost the DFlash step 5% (docs/benchmarks.md,
        twenty-third session), a batch-1 verify block alone as 2 or 4, 0.4-0.9% (thirty-third)."""
        if self.qkv_bias is not None:
            return None
        partials = single_row_partials(x, self.qkv_proj, QKV_PARTIALS)
        return None if partials is None else partials.reshape(partials.shape[:2] + x.shape[1:-1] + partials.shape[2:])

    def _split(self, qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The raw fused projection ``[..., kv_heads, groups + 2, head_dim]`` -> raw q
        ``[..., heads, head_dim]``, k and v ``[..., kv_heads, head_dim]``."""
        groups = qkv.shape[-2] - 2
        q = qkv[..., :groups, :].reshape(qkv.shape[:-3] + (self.num_heads, self.head_dim))
        return q, qkv[..., groups, :], qkv[..., groups + 1, :]

    def _fused(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Raw q ``[..., heads, head_dim]``, k and v ``[..., kv_heads, head_dim]`` in one matmul."""
        return self._split(self._qkv(x))

    def _finish_q(self, q: jax.Array, positions: jax.Array) -> jax.Array:
        if self.q_norm is not None:
            q = self.q_norm(q)
        return apply_rope(q, positions, self.inv_freq)

    def _finish_k(self, k: jax.Array, positions: jax.Array) -> jax.Array:
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rope(k, positions, self.inv_freq)

    def queries(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """``x [..., seq, hidden]``, ``positions [..., seq]`` -> ``[..., seq, heads, head_dim]``."""
        if self.qkv_proj is not None:
            return self._finish_q(self._fused(x)[0], positions)
        return self._finish_q(self._project(x, self.q_proj, self.q_bias), positions)

    def keys_values(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``x [..., seq, hidden]`` -> K (normed, RoPE'd) and V, each ``[..., seq, kv_heads, head_dim]``."""
        if self.qkv_proj is not None:
            _, k, v = self._fused(x)
        else:
            k = self._project(x, self.k_proj, self.k_bias)
            v = self._project(x, self.v_proj, self.v_bias)
        return self._finish_k(k, positions), v

    def project(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``x [..., seq, hidden]`` -> q ``[..., seq, heads, head_dim]`` and k, v
        ``[..., seq, kv_heads, head_dim]`` (q and k normed and RoPE'd)."""
        if self.qkv_proj is None:
            return (self.queries(x, positions),) + self.keys_values(x, positions)
        return self.finish_qkv(self._qkv(x), positions)

    def finish_qkv(self, qkv: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The raw fused projection ``qkv [..., seq, kv_heads, groups + 2, head_dim]`` at ``positions
        [..., seq]`` -> q ``[..., seq, heads, head_dim]`` and k, v ``[..., seq, kv_heads, head_dim]``
        (q and k normed and RoPE'd)."""
        q, k, v = self._split(qkv)
        return self._finish_q(q, positions), self._finish_k(k, positions), v

    def attend_cached(
        self, x: jax.Array, starts: jax.Array, k_cache: jax.Array, v_cache: jax.Array, blk_lens: jax.Array,
        *, impl: AttentionImpl, causal: bool = True, write: bool = True, row_scale: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """A block per row over its KV cache (the target's: causal, the block's K/V written into it;
        the drafter's: ``causal=False, write=False``).

        ``x [batch, 1, block, hidden]`` (normed) at positions ``starts [batch] + slot``; caches
        ``[batch, capacity, kv_heads, head_dim]``; ``blk_lens [batch]`` valid slots. Returns
        ``attn [batch, 1, block, heads, head_dim]`` and the caches, with ``write`` the block written
        at ``starts``. In the fused layout: ``attend_cached_qkv`` of the one projection; there ``x``
        may also be the raw residual stream, with ``row_scale [batch, 1, block, 1]`` float32 the input
        norm's row scale (its weight folded into the projection: ``DecoderLayer.fold_norms``).
        """
        if self.qkv_proj is not None:
            qkv = self._qkv_partials(x[:, 0]) if impl == "pallas" else None
            scale = None if row_scale is None else row_scale[:, 0, :, 0]
            return self.attend_cached_qkv(self._qkv(x[:, 0]) if qkv is None else qkv, starts, k_cache, v_cache,
                                          blk_lens, impl=impl, causal=causal, write=write, row_scale=scale)
        if row_scale is not None:
            raise ValueError("row_scale needs the fused serving layout (Attention.fuse)")
        positions = starts[:, None, None] + jnp.arange(x.shape[2], dtype=jnp.int32)
        return self._attend_and_write(*self.project(x, positions), starts, k_cache, v_cache, blk_lens, impl,
                                      causal, write)

    def attend_cached_qkv(
        self, qkv: jax.Array, starts: jax.Array, k_cache: jax.Array, v_cache: jax.Array, blk_lens: jax.Array,
        *, impl: AttentionImpl, causal: bool = True, write: bool = True, row_scale: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``attend_cached`` from the raw fused projection ``qkv [rows, block, kv_heads, groups + 2,
        head_dim]``: with ``impl="pallas"`` one kernel (``kernels_pallas.cached_block_attention``)
        where it takes the shapes, else ``attend_unfused``. ``rows`` may exceed the caches' batch
        (padding after the batch's rows, never read: ``tail_layout.padded_rows``). ``qkv`` may also
        be float32 split-K partials ``[parts, rows, ...]`` (``_qkv_partials``). ``row_scale [batch,
        block]`` float32: each slot's projection (its partials' float32 sum) times it, then rounded
        to the caches' dtype (a folded input norm)."""
        batch, block = k_cache.shape[0], qkv.shape[-4]
        if impl == "pallas":
            import kernels_pallas

            if kernels_pallas.cached_block_attention_supported(qkv.shape[-5:], k_cache.shape[1]):
                ones = jnp.ones((self.head_dim,), k_cache.dtype)

                def kernel(qkv, k_cache, v_cache, starts, blk_lens, q_norm, k_norm, inv_freq, *scale):
                    attn, k_cache, v_cache = kernels_pallas.cached_block_attention(
                        qkv, k_cache, v_cache, starts, blk_lens, q_norm, k_norm, inv_freq, eps=self.eps,
                        qk_norm=self.q_norm is not None, causal=causal, write=write,
                        row_scale=scale[0] if scale else None)
                    # [b, block, kv, groups, d] by this shard's KV heads (whole where replicated)
                    attn = attn.reshape(attn.shape[:2] + (qkv.shape[-3], -1, self.head_dim))
                    return (attn, k_cache, v_cache) if write else (attn,)

                # Per device under a kernel mesh: its rows and its KV heads (with their query heads).
                per_head = (None,) * (qkv.ndim - 5) + ("batch", None, "kv_heads", None, None)
                rows, vec = ("batch",), (None,)
                scale = () if row_scale is None else (row_scale,)
                outs = shard_kernel(kernel, (per_head, CACHE_AXES, CACHE_AXES, rows, rows, vec, vec, vec)
                                    + (("batch", None),) * len(scale),
                                    (per_head[-5:],) + ((CACHE_AXES, CACHE_AXES) if write else ()))(
                    qkv, k_cache, v_cache, starts, blk_lens,
                    self.q_norm.weight[...] if self.q_norm is not None else ones,
                    self.k_norm.weight[...] if self.k_norm is not None else ones,
                    jnp.asarray(self.inv_freq, jnp.float32), *scale)
                if write:
                    k_cache, v_cache = outs[1:]
                return outs[0].reshape(batch, 1, block, self.num_heads, self.head_dim), k_cache, v_cache
        if qkv.ndim == 6 or row_scale is not None:  # the kernel's sum (in order) and row scale, in float32
            x = qkv.astype(jnp.float32)
            x = (functools.reduce(jnp.add, list(x)) if qkv.ndim == 6 else x)[:batch]
            qkv = (x if row_scale is None else x * row_scale[:, :, None, None, None]).astype(k_cache.dtype)
        return self.attend_unfused(qkv[:batch], starts, k_cache, v_cache, blk_lens, impl=impl, causal=causal,
                                   write=write)

    def attend_unfused(
        self, qkv: jax.Array, starts: jax.Array, k_cache: jax.Array, v_cache: jax.Array, blk_lens: jax.Array,
        *, impl: AttentionImpl, causal: bool = True, write: bool = True,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``attend_cached_qkv`` as separate steps, the fused kernel's reference: the norms and RoPE
        of q and k, the attention primitive (``impl``), the cache writes."""
        positions = starts[:, None] + jnp.arange(qkv.shape[1], dtype=jnp.int32)
        q, k, v = self.finish_qkv(qkv, positions)
        return self._attend_and_write(q[:, None], k[:, None], v[:, None], starts, k_cache, v_cache, blk_lens, impl,
                                      causal, write)

    @staticmethod
    def _attend_and_write(q, k, v, starts, k_cache, v_cache, blk_lens, impl, causal, write):
        """Block attention of ``q [batch, 1, block, heads, head_dim]`` over the caches plus the block's
        own ``k, v [batch, 1, block, kv_heads, head_dim]``, which ``write`` then writes at ``starts``."""
        attn = block_attention(q, k_cache, v_cache, starts[:, None], k, v, blk_lens[:, None], causal=causal,
                               impl=impl)
        if not write:
            return attn, k_cache, v_cache
        return attn, write_rows(k_cache, k[:, 0], starts), write_rows(v_cache, v[:, 0], starts)

    def output(self, attn: jax.Array) -> jax.Array:
        """``[..., seq, heads, head_dim]`` -> ``[..., seq, hidden]`` (a decode token's on one GPU:
        ``OUTPUT_PARTIALS`` split-K partials, summed)."""
        y = single_row_dot(attn, self.o_proj, OUTPUT_PARTIALS, in_dims=2)
        if y is None:
            y = dense(attn, self.o_proj, in_dims=2)
        return y if self.o_bias is None else y + self.o_bias[...]


class MLP(nnx.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int, *, bias: bool, dtype, rngs: nnx.Rngs):
        self.gate_proj = nnx.Param(_init(rngs, (hidden, intermediate), dtype), axes=("embed", "mlp"))
        self.up_proj = nnx.Param(_init(rngs, (hidden, intermediate), dtype), axes=("embed", "mlp"))
        self.down_proj = nnx.Param(_init(rngs, (intermediate, hidden), dtype), axes=("mlp", "embed"))
        if bias:
            self.gate_bias = nnx.Param(jnp.zeros((intermediate,), dtype), axes=("mlp",))
            self.up_bias = nnx.Param(jnp.zeros((intermediate,), dtype), axes=("mlp",))
            self.down_bias = nnx.Param(jnp.zeros((hidden,), dtype), axes=("embed",))
        else:
            self.gate_bias = self.up_bias = self.down_bias = None
        self.gate_up_proj = self.gate_up_bias = None  # the fused serving layout (``fuse``)

    def fuse(self) -> None:
        """Switches (in place) to one gate-up weight ``[in, intermediate, 2]`` (gate, up per unit):
        one matmul instead of two, and a tensor-parallel shard of ``intermediate`` holds both."""
        if self.gate_up_proj is not None or self.gate_proj is None:  # fused already, or in the layer-tail layout
            return
        w = jnp.stack([self.gate_proj[...], self.up_proj[...]], axis=-1)
        self.gate_up_proj = nnx.data(nnx.Param(w, axes=("embed", "mlp", None)))
        if self.gate_bias is not None:
            b = jnp.stack([self.gate_bias[...], self.up_bias[...]], axis=-1)
            self.gate_up_bias = nnx.data(nnx.Param(b, axes=("mlp", None)))
        self.gate_proj = self.up_proj = self.gate_bias = self.up_bias = None

    def __call__(self, x: jax.Array, row_scale: jax.Array | None = None) -> jax.Array:
        """``x [..., hidden]`` -> ``[..., hidden]``. ``row_scale [..., 1]`` float32 (the fused layout
        only): gate and up times it (in float32, rounded again) before the SwiGLU, for a norm folded
        into gate-up."""
        def affine(v, w, b):
            y = dense(v, w)
            return y if b is None else y + b[...]

        if row_scale is not None and self.gate_up_proj is None:
            raise ValueError("row_scale needs the fused serving layout (MLP.fuse)")
        if self.gate_up_proj is not None:
            gu = dense(x, self.gate_up_proj)
            if self.gate_up_bias is not None:
                gu = gu + self.gate_up_bias[...]
            gate, up = gu[..., 0], gu[..., 1]
            if row_scale is not None:
                # On the halves, in the SwiGLU's kernel: on the product itself, XLA fuses the scale
                # into gate-up's GEMM, which then waits for the scale's reduction and streams 10%
                # slower (docs/benchmarks.md, twenty-sixth session).
                gate, up = ((v.astype(jnp.float32) * row_scale).astype(v.dtype) for v in (gate, up))
            h = jax.nn.silu(gate) * up
        else:
            h = jax.nn.silu(affine(x, self.gate_proj, self.gate_bias)) * affine(x, self.up_proj, self.up_bias)
        return affine(h, self.down_proj, self.down_bias)


class DecoderLayer(nnx.Module):
    """One pre-norm decoder layer over query blocks; serves the target and the drafter alike.

    The target passes its KV cache as the context and its own token embeddings as the block
    (``causal=True``); the drafter passes the projected target context and the noise block
    (``causal=False``). The block's K/V are returned so the target can write them to its cache.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        eps: float,
        qk_norm: bool,
        attention_bias: bool,
        mlp_bias: bool,
        inv_freq: np.ndarray,
        dtype,
        rngs: nnx.Rngs,
    ):
        self.input_layernorm = RMSNorm(hidden, eps, dtype=dtype)
        self.self_attn = Attention(
            hidden, num_heads, num_kv_heads, head_dim, eps=eps, qk_norm=qk_norm, bias=attention_bias,
            inv_freq=inv_freq, dtype=dtype, rngs=rngs,
        )
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype=dtype)
        self.mlp = MLP(hidden, intermediate, bias=mlp_bias, dtype=dtype, rngs=rngs)
        # Static: the norms' weights are folded into the fused QKV and gate-up weights (``fold_norms``)
        self.norms_folded = False
        # The layer-tail serving layout (``tail_layout.to_tail_layout``): its ``TailWeights`` replace
        # the norms' weights and the matmul weights above.
        self.tail = None

    def __call__(
        self,
        h: jax.Array,
        positions: jax.Array,
        k_ctx: jax.Array,
        v_ctx: jax.Array,
        ctx_lens: jax.Array,
        blk_lens: jax.Array,
        *,
        causal: bool,
        attention_impl: AttentionImpl = "xla",
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``h [batch, blocks, block, hidden]``, ``positions [batch, blocks, block]``; context
        ``[batch, ctx, kv_heads, head_dim]``; lengths ``[batch, blocks]``.

        Returns the new ``h`` and the block's ``k, v [batch, blocks, block, kv_heads, head_dim]``.
        """
        q, k_blk, v_blk = self.self_attn.project(self.input_layernorm(h), positions)
        attn = block_attention(
            q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, causal=causal, impl=attention_impl
        )
        h, mlp_out = self._residual_mlp(h, attn, False)
        return h + mlp_out, k_blk, v_blk

    def cached(
        self, h: jax.Array, delta: jax.Array | None, starts: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
        blk_lens: jax.Array, *, attention_impl: AttentionImpl = "xla", causal: bool = True, write: bool = True,
    ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """The layer over a KV cache, for decoding: the residual stream entering it is ``h + delta``
        (``delta`` None: ``h``), ``[batch, 1, block, hidden]``, at positions ``starts [batch] + slot``,
        ``blk_lens [batch]`` valid slots; caches ``[batch, capacity, kv_heads, head_dim]``. The
        target's layers run causal blocks and write them into their caches; the drafter's layers
        attend bidirectionally to their context caches without writing (``Attention.attend_cached``).

        Returns ``(h, delta)`` whose sum is the layer's output (the add is left to the next norm, so
        that with ``attention_impl="pallas"`` each add and its norm are one kernel) and the caches.

        With the norms folded (``fold_norms``), a decode token on one GPU runs no norm before a
        matmul: the QKV and gate-up matmuls take the residual stream itself and their products are
        scaled per row after the dot (in the attention kernel, and in the SwiGLU's kernel), so the
        row scale's reduction runs beside the matmul instead of before it. Blocks of several rows
        keep the norm kernels (their weights ones): beside a matmul of 16 rows the reductions
        slowed it by more than the norm kernel costs (docs/benchmarks.md, twenty-sixth session).
        """
        if self.norms_folded and one_gpu_row(h, self.self_attn.qkv_proj):
            s = h if delta is None else h + delta
            attn, k_cache, v_cache = self.self_attn.attend_cached(
                s, starts, k_cache, v_cache, blk_lens, impl=attention_impl, causal=causal, write=write,
                row_scale=self.input_layernorm.row_scale(s))
            s = s + self.self_attn.output(attn)
            return s, self.mlp(s, row_scale=self.post_attention_layernorm.row_scale(s)), k_cache, v_cache
        fused = attention_impl == "pallas"
        h, x = add_rms_norm(h, delta, self.input_layernorm, fused=fused)
        attn, k_cache, v_cache = self.self_attn.attend_cached(x, starts, k_cache, v_cache, blk_lens,
                                                              impl=attention_impl, causal=causal, write=write)
        h, mlp_out = self._residual_mlp(h, attn, fused)
        return h, mlp_out, k_cache, v_cache

    def fold_norms(self) -> None:
        """Switches the fused layout (``Attention.fuse``, ``MLP.fuse``), in place, to norms folded
        into the matmuls: the input norm's weight into the QKV weight's input rows and the
        post-attention norm's into gate-up's (``w [in, ...] * norm [in]``, rounded to the weight's
        dtype), the norm weights set to ones. Every path computes the same function: the uncached
        ones normalise as before (by a unit weight), ``cached`` scales the products per row instead.
        A layer with biases, not fused, or in the layer-tail layout is left as it is.

        Why: at batch 1 each RMSNorm before a matmul is a kernel on the critical path (its row scale
        needs the whole row); folded, the matmul starts on the raw row and the scale's reduction
        runs beside it (``cached``; docs/benchmarks.md, twenty-sixth session). Folding moves bf16
        products by a rounding, as a change of GEMM does. Only the decode path (``cached``) scales
        after the dot; prefill normalises before it, by a unit weight."""
        from kernels_pallas.layer_tail_gpu import fold_norm

        attn, mlp = self.self_attn, self.mlp
        if (self.norms_folded or attn.qkv_proj is None or mlp.gate_up_proj is None or attn.qkv_bias is not None
                or mlp.gate_up_bias is not None or self.tail is not None):
            return
        for norm, w in ((self.input_layernorm, attn.qkv_proj), (self.post_attention_layernorm, mlp.gate_up_proj)):
            w[...] = fold_norm(norm.weight[...], w[...].reshape(w.shape[0], -1)).reshape(w.shape)
            norm.weight[...] = jnp.ones_like(norm.weight[...])
        self.norms_folded = True

    def _residual_mlp(self, h: jax.Array, attn: jax.Array, fused: bool) -> tuple[jax.Array, jax.Array]:
        """``(h + output(attn), mlp(post_attention_layernorm(h + output(attn))))``: the MLP's residual
        add is the caller's."""
        h, x = add_rms_norm(h, self.self_attn.output(attn), self.post_attention_layernorm, fused=fused)
        return h, self.mlp(x)


def fold_norms(module: nnx.Module) -> nnx.Module:
    """Folds, in place, every fused decoder layer's norm weights into the matmuls after them
    (``DecoderLayer.fold_norms``); idempotent."""
    for node in [n for _, n in nnx.iter_graph(module) if isinstance(n, DecoderLayer)]:
        node.fold_norms()
    return module


def fuse_projections(module: nnx.Module) -> nnx.Module:
    """Puts every decoder layer of ``module`` in the fused serving layout (in place; idempotent)."""
    for node in [n for _, n in nnx.iter_graph(module) if isinstance(n, (Attention, MLP))]:
        node.fuse()
    return module
