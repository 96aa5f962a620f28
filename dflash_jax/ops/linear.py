"""Projections: where a row meets XLA's GEMMs.

Every projection of the decode path goes through ``dense``, except a decode token's QKV and output
projections on one GPU, which go through ``single_row_partials``: the two places that decide how a
single row is multiplied (docs/design.md, "Ops"). The LM head over a tied embedding table goes through
``dot_input_last``, as does ``dense`` for a weight stored input-last (``INPUT_LAST``); ``dense`` multiplies
float32 rows by a bfloat16 weight (a CPU's bfloat16 weights) exactly, in three bfloat16 terms.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from dflash_jax.sharding import local_shape

# XLA:GPU rewrites a dot with a one-row operand into a multiply and a reduction when its operands
# hold fewer than this many elements (``ShouldStrengthReduceDotToReduce``, gpu_algebraic_simplifier.cc),
# ~3x slower than its GEMM. A fact of XLA, not a setting.
GPU_STRENGTH_REDUCTION_LIMIT = 10_000_000

# ``nnx.Param`` metadata: the weight is stored input-last, ``[*out, *in]`` (torch's order), as the serving
# layout stores it where ``weight_major_gemms`` (``runtime.serving_params.store_input_last``).
INPUT_LAST = "input_last"


def dense(x: jax.Array, w: nnx.Param, in_dims: int = 1) -> jax.Array:
    """``x [..., *in]`` times the weight ``w [*in, *out]`` (``in``: its first ``in_dims``
    dimensions) -> ``[..., *out]``: one dot over the ``in`` dimensions, with the ``out`` dimensions
    of the weight bitcast to one. A fused weight with several output dimensions (QKV ``[hidden,
    kv_heads, groups + 2, head_dim]``) then gets the GEMM XLA picks for a plain matrix; the output
    projection (``in_dims=2``) is the dot its einsum was.

    On GPUs a single row meets a weight whose shard (``w``'s logical axes under
    ``sharding.kernel_mesh``) is under ``GPU_STRENGTH_REDUCTION_LIMIT`` elements as two rows, the
    row repeated: XLA would otherwise run the dot as a multiply and a reduction (the TP=2 output
    projection: 21 us instead of 7). A repeat fuses into the GEMM, where a zero row after a kernel
    XLA cannot fuse into is a pad kernel of its own. Rows are independent: the real row gets the
    same product, up to the summation order of the GEMM XLA picks."""
    value = w[...]
    if w.get_metadata().get(INPUT_LAST):
        return dot_input_last(x, value, in_dims)
    rows = x.shape[:x.ndim - in_dims]
    if math.prod(rows) == 1 and _strength_reduces_single_rows() and _shard_size(w) < GPU_STRENGTH_REDUCTION_LIMIT:
        row = x.reshape((1,) + x.shape[x.ndim - in_dims:])
        y = _dot(_two_rows(row), value, in_dims)[:1]
        return y.reshape(rows + value.shape[in_dims:])
    return _dot(x, value, in_dims)


def dot_input_last(x: jax.Array, w: jax.Array, in_dims: int = 1) -> jax.Array:
    """``x [..., *in]`` times a weight stored input-last, ``w [*out, *in]`` (its last ``in_dims``
    dimensions) -> ``[..., *out]``.

    Where ``weight_major_gemms``, rows multiply as ``w @ x^T``, transposed back: the weight is the
    GEMM's left operand. XLA:CPU's GEMMs (XNNPACK) of a few rows against weights past the last-level
    cache ran 1.2-1.6x faster so than as ``x @ w`` (16 rows, the embedded target's shapes; its
    block-16 DFlash step 12.6 -> 10.7 ms, docs/performance.md "The embedded pair"); one row as
    ``x @ w^T`` made XLA:CPU copy the transposed weight every step. Every other backend: ``x`` on the
    left, the dot of ``einsum("...k,nk->...n")``."""
    n_out = w.ndim - in_dims
    rows = x.shape[:x.ndim - in_dims]
    contract = tuple(range(x.ndim - in_dims, x.ndim)), tuple(range(n_out, w.ndim))
    if not weight_major_gemms():
        return jax.lax.dot_general(x, w, (contract, ((), ())))
    k = math.prod(w.shape[n_out:])
    y = jax.lax.dot_general(w.reshape(-1, k), x.reshape(-1, k), (((1,), (1,)), ((), ())))
    # The barrier keeps XLA's simplifier from folding the transpose back into the dot, as ``x @ w^T``.
    return jax.lax.optimization_barrier(y).T.reshape(rows + w.shape[:n_out])


def bfloat16_terms(x: jax.Array) -> jax.Array:
    """float32 ``x [...]`` -> bfloat16 ``[3, ...]``: the leading 8 significant bits of each value, the next 8 and
    the last 8, whose float32 sum is ``x`` exactly down to magnitudes of 2^-103 (below, a term can be
    subnormal, which XLA:CPU flushes to zero as its float32 GEMMs do). Each term is its float32 remainder cut
    to its top 16 bits (a bfloat16 value; the remainder after it exact in float32): bits, not XLA:CPU's
    rounding conversion to bfloat16, which ran ~2x slower."""
    top = jnp.uint32(0xFFFF0000)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    rest = x - jax.lax.bitcast_convert_type(bits & top, jnp.float32)
    rest_bits = jax.lax.bitcast_convert_type(rest, jnp.uint32)
    last = rest - jax.lax.bitcast_convert_type(rest_bits & top, jnp.float32)
    terms = jnp.stack([bits, rest_bits, jax.lax.bitcast_convert_type(last, jnp.uint32)]) >> 16
    return jax.lax.bitcast_convert_type(terms.astype(jnp.uint16), jnp.bfloat16)


def exactly_bfloat16(w: jax.Array) -> bool:
    """Whether every value of the float32 array ``w`` is a bfloat16 value (a bfloat16 checkpoint loaded in float32)."""
    return w.dtype == jnp.float32 and bool(jnp.array_equal(w, w.astype(jnp.bfloat16).astype(jnp.float32)))


def bfloat16_matrix_units() -> bool:
    """Whether this host's CPU multiplies bfloat16 matrices in hardware (AMX-BF16, Intel Xeon since Sapphire
    Rapids), where XLA:CPU's bfloat16 GEMMs ran at 4-6x its float32 GEMMs' rate (2 cores, 48-288 rows against
    384 x 2304: docs/design.md, "How a block meets XLA:CPU's GEMMs"). With AVX512-BF16 alone (an AMD EPYC) a
    bfloat16 model's steps ran slower than in float32. Linux's /proc/cpuinfo; elsewhere False."""
    return "amx_bf16" in cpu_flags()


@functools.cache
def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The feature flags of the first CPU in ``cpuinfo`` (Linux's format); none where it cannot be read."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def weight_major_gemms() -> bool:
    """Whether this backend's GEMMs of a few rows run faster with the weight as the left operand
    (``dot_input_last``): XLA:CPU's."""
    return jax.default_backend() == "cpu"


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
    small enough for XLA:GPU to strength-reduce the dot (``dense``). XLA picks its own tiles for this
    batched dot, where for the plain one-row dot its cost model picks the split: written out, the 8B
    output projection streams 0.7 us faster, and the QKV's partials are summed inside the
    cached-attention kernel instead of by a reduction kernel of their own."""
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
            and _shard_size(w) == w.size and not w.get_metadata().get(INPUT_LAST))


def _strength_reduces_single_rows() -> bool:
    return jax.default_backend() == "gpu"


def _shard_size(w: nnx.Param) -> int:
    """Elements of this device's shard of ``w`` (all of them for a weight without logical axes)."""
    axes = w.get_metadata().get("axes")
    return math.prod(w.shape if axes is None else local_shape(axes, w.shape))


def _dot(x: jax.Array, w: jax.Array, in_dims: int) -> jax.Array:
    out = w.shape[in_dims:]
    rows = x.shape[:x.ndim - in_dims]
    k = math.prod(w.shape[:in_dims])
    if w.dtype == jnp.bfloat16 and x.dtype == jnp.float32:
        return _float32_times_bfloat16(x.reshape(-1, k), w.reshape(k, -1)).reshape(rows + out)
    contract = (tuple(range(x.ndim - in_dims, x.ndim)), tuple(range(in_dims)))
    y = jax.lax.dot_general(x, w.reshape(w.shape[:in_dims] + (math.prod(out),)), (contract, ((), ())))
    return y.reshape(rows + out)


def _float32_times_bfloat16(x: jax.Array, w: jax.Array) -> jax.Array:
    """float32 ``x [rows, k]`` times a bfloat16 ``w [k, n]`` (``serving_params``' bfloat16 weights) -> float32
    ``[rows, n]``: the three bfloat16 terms of each row (``bfloat16_terms``) in one GEMM of ``3 * rows`` rows
    accumulating in float32, their products summed smallest first. A bfloat16 term times a bfloat16 weight is
    exact in float32, so this is the float32 product up to the summation order, as another GEMM's would be.
    The rows on the left: the products come out row-major, the layout of what reads them (XLA:CPU fuses
    the terms' split into its producer, and a producer read across its layout there ran ~4x slower)."""
    rows = x.shape[0]
    terms = bfloat16_terms(x).reshape(3 * rows, x.shape[1])
    y = jax.lax.dot_general(terms, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return (y[2 * rows:] + y[rows:2 * rows]) + y[:rows]
