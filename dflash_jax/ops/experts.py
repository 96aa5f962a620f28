"""Routed experts of a mixture-of-experts MLP: routing, grouped matmuls, MXFP4 weights.

Every token picks ``top_k`` of ``E`` experts. ``routed_experts`` computes their weighted sum over
the ``T * top_k`` (token, expert) pairs in one of three ways, chosen by the static pair count:

- "gemv", for few pairs (a decode step, the verify block of a small batch): one matrix-vector
  product per pair, written as a multiply and a reduction so XLA fuses the gather of the pair's
  expert weights into it. Bandwidth is the cost of such a step, and this reads only the routed
  experts' bytes, once, with nothing gathered written back; MXFP4 weights (4-bit values in blocks of
  32 sharing a power-of-two scale, the gpt-oss checkpoints' format) are decoded inside the same
  reduction, so only the routed experts' 4-bit bytes are read.
- "ragged_dot", for many pairs (prefill, training, large batches): grouped matmuls
  (``jax.lax.ragged_dot``); the pairs are sorted by expert, each expert multiplies its contiguous run
  of rows, the rows are scattered back and summed per token. With fewer pairs than experts the
  touched experts' weights (at most ``T * top_k``) are gathered first; MXFP4 weights are dequantized
  after that gather.
- "capacity": batched GEMMs of ``T`` row slots per (touched) expert, for backends where
  ``ragged_dot`` lowers to a dense zero-padded product.

"auto" (the default) takes "gemv" for MXFP4 experts up to ``gemv_pair_limit`` pairs, else "ragged_dot"
(measured on the H200, ``gemv_pair_limit``). Shapes are
static everywhere: a run or slot may be empty.

With the kernels on (``OpsConfig.kernels``) on a Hopper or later GPU, "auto" steps of few pairs (up to 4 an
expert) run ``mosaic_routed_experts`` instead, whichever the lowering of the other kernels: the pairs grouped
by expert and two calls of the Mosaic GPU expert-products kernel (``kernels_pallas.experts``), which streams
only the touched experts' weight tiles (MXFP4 decoded inside) with TMA. MXFP4 steps of fewer pairs than
experts keep "gemv" (decoding one token's 4-bit codes in shared memory costs the kernel more than the bytes
it saves), and 16-bit steps of at least as many pairs as experts run tokamax's grouped matmul where it is
installed (below; on Qwen3-MoE faster from a batch-16 decode step and in every verify block,
``uses_mosaic_kernel``). Under ``OpsConfig.gpu_lowering == "mosaic"``, "gemv" steps run the kernel too. Where
"ragged_dot" runs with the kernels on, on one Hopper or later GPU with 16-bit activations, its grouped
matmuls are tokamax's Mosaic GPU ragged dot when tokamax (PyPI ``tokamax`` >= 0.0.17, the ``tokamax``
extra) is installed (``library_ragged_dot``): XLA:GPU's ``ragged_dot`` at a batch-16 verify block's
2,048 pairs cost a Qwen3-30B-A3B DFlash step 5x tokamax's (docs/performance.md).

``routed_experts_reference`` is the same function as a dense product over every expert, for tests.
Under ``sharding.kernel_mesh`` with the experts split over mesh axes (logical axis ``experts``),
each device computes its own experts' share of every token and a ``psum`` adds the shares (expert
parallelism; the token activations are small beside the weights in decode and verify steps).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp

from dflash_jax import sharding
from dflash_jax.ops.topk import short_top_k
from kernels_pallas.experts.reference import FP4_VALUES, MXFP4_BLOCK, mxfp4_dequantize

ACTIVATIONS = ("silu", "gpt_oss")
GPT_OSS_ALPHA = 1.702
GPT_OSS_LIMIT = 7.0


@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """One layer's experts. Float weights are ``gate_up [E, hidden, 2 * inter]`` and ``down [E,
    inter, hidden]`` (inputs first); MXFP4 ones are ``(blocks, scales)`` pairs in the checkpoint's
    outputs-first order (``gate_up``: ``[E, 2 * inter, hidden / 32, 16]`` and ``[E, 2 * inter,
    hidden / 32]``). ``interleaved``: gate-up's columns alternate gate, up (gpt-oss); else the gate
    columns come first, then the up ones (Qwen3-MoE)."""

    gate_up: jax.Array | tuple[jax.Array, jax.Array]
    down: jax.Array | tuple[jax.Array, jax.Array]
    gate_up_bias: jax.Array | None = None  # [E, 2 * inter]
    down_bias: jax.Array | None = None  # [E, hidden]
    interleaved: bool = False

    @property
    def num_experts(self) -> int:
        return _leading(self.gate_up)

    def take(self, experts: jax.Array) -> "ExpertWeights":
        """The weights of ``experts [G]`` only (a gather of their bytes; 4-bit ones stay 4-bit)."""
        def pick(w):
            if w is None:
                return None
            return tuple(jnp.take(p, experts, axis=0) for p in w) if isinstance(w, tuple) else jnp.take(w, experts, axis=0)

        return ExpertWeights(pick(self.gate_up), pick(self.down), pick(self.gate_up_bias), pick(self.down_bias),
                             self.interleaved)

    def dense(self, dtype) -> tuple[jax.Array, jax.Array]:
        """``(gate_up [G, hidden, 2 * inter], down [G, inter, hidden])`` as ``dtype`` arrays."""
        def expand(w):
            if isinstance(w, tuple):
                return jnp.swapaxes(mxfp4_dequantize(*w, dtype), -1, -2)
            return w.astype(dtype)

        return expand(self.gate_up), expand(self.down)


jax.tree_util.register_dataclass(ExpertWeights, data_fields=["gate_up", "down", "gate_up_bias", "down_bias"],
                                 meta_fields=["interleaved"])  # a pytree: a jit argument


def _leading(w) -> int:
    return (w[0] if isinstance(w, tuple) else w).shape[0]


def _activate(gate_up: jax.Array, activation: str, interleaved: bool) -> jax.Array:
    """``gate_up [..., 2 * inter]`` -> ``[..., inter]``: SwiGLU (``silu``), or gpt-oss's clamped one
    (gate clamped above at 7, up to [-7, 7], ``(up + 1) * gate * sigmoid(1.702 * gate)``)."""
    if interleaved:
        gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    else:
        gate, up = jnp.split(gate_up, 2, axis=-1)
    if activation == "silu":
        return jax.nn.silu(gate) * up
    if activation == "gpt_oss":
        gate = jnp.minimum(gate, GPT_OSS_LIMIT)
        up = jnp.clip(up, -GPT_OSS_LIMIT, GPT_OSS_LIMIT)
        return (up + 1) * (gate * jax.nn.sigmoid(gate * GPT_OSS_ALPHA))
    raise ValueError(f"expert activation {activation!r} is not supported ({', '.join(ACTIVATIONS)})")


def route(logits: jax.Array, top_k: int, *, softmax_first: bool, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Router ``logits [T, E]`` -> ``(weights [T, top_k], experts [T, top_k] int32)``.

    ``softmax_first`` (Qwen3-MoE): the ``top_k`` experts of the largest softmax probabilities (float32),
    renormalised to sum to 1 with ``normalize``; else (gpt-oss): the top ``top_k`` logits, softmax over
    them. Weights in ``logits.dtype``, as transformers rounds them.

    The experts are the top ``top_k`` of the float32 logits either way (``ops.topk.short_top_k``: a
    decode or verify step's routing in two fused reductions, no sort): the softmax keeps their order,
    so they are the most probable ones. With ``normalize`` the kept probabilities over their sum are the
    softmax of the kept logits, computed so; without it each is ``exp(logit - logsumexp(logits))``.
    """
    scores = logits.astype(jnp.float32)
    top, experts = short_top_k(scores, top_k)
    if softmax_first and not normalize:
        weights = jnp.exp(top - jax.nn.logsumexp(scores, axis=-1, keepdims=True))
    else:
        weights = jax.nn.softmax(top, axis=-1)
    return weights.astype(logits.dtype), experts


# "auto": "gemv" for MXFP4 experts and as few (token, expert) pairs as a decode or verify step has
# (``gemv_pair_limit``), else "ragged_dot".
IMPLEMENTATIONS = ("auto", "gemv", "ragged_dot", "capacity")


def gemv_pair_limit(w: ExpertWeights) -> int:
    """The most (token, expert) pairs "auto" runs as "gemv". MXFP4 experts: up to 4 pairs an expert,
    because a grouped matmul reads every expert's 4-bit bytes and writes and reads them again
    dequantized while "gemv" decodes only the routed experts' bytes inside its reduction (H200,
    gpt-oss-20b layer: 0.28 ms against 0.97 ms at one token, 1.23 against 4.77 at sixteen). Float
    experts: none, because XLA's ragged_dot beats the per-pair products there (Qwen3-30B-A3B layer:
    0.28 ms against 0.55 at one token, 0.58 against 3.27 at sixteen)."""
    return 4 * w.num_experts if isinstance(w.gate_up, tuple) else 0


def resolve_implementation(implementation: str, pairs: int, w: ExpertWeights) -> str:
    """The implementation ``routed_experts`` runs for ``pairs`` (token, expert) pairs (static)."""
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"expert implementation {implementation!r} is not one of {IMPLEMENTATIONS}")
    if implementation == "auto":
        return "gemv" if pairs <= gemv_pair_limit(w) else "ragged_dot"
    return implementation


def _mxfp4_scale(scales: jax.Array) -> jax.Array:
    """Scale bytes ``s`` -> ``2 ** (s - 127)`` float32 from the bits (an exponent field; byte 0 is the
    subnormal ``2 ** -127``): two integer operations an element inside a fused reduction."""
    s = scales.astype(jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.where(s == 0, 1 << 22, s << 23), jnp.float32)


def _pair_product(rows: jax.Array, weight, ids: jax.Array) -> jax.Array:
    """``rows [P, K]`` times expert ``ids[p]``'s ``K x N`` matrix, pair by pair -> float32 ``[P, N]``.

    ``ids`` in range. Written as a multiply and a reduction over ``K``, not a dot: XLA fuses the expert
    gather (and the MXFP4 decoding) into the reduction, so each pair's expert bytes are read once and no
    gathered copy is written; a dot would take the gathered weights as a materialised operand.

    Float ``weight [E, K, N]``. MXFP4 ``(blocks [E, N, K / 32, 16], scales [E, N, K / 32])``: a byte's
    low nibble multiplies the even input of its pair, the high nibble the odd one (as
    ``mxfp4_dequantize``), and the power-of-two scale multiplies the product (exact). The reduction
    runs over bytes, two values each: a byte is loaded and its scale computed once for both."""
    if isinstance(weight, tuple):
        blocks, scales = (t.at[ids].get(mode="promise_in_bounds") for t in weight)  # [P, N, G, 16], [P, N, G]
        lut = jnp.asarray(FP4_VALUES)
        low = lut.at[(blocks & 0x0F).astype(jnp.int32)].get(mode="promise_in_bounds")
        high = lut.at[(blocks >> 4).astype(jnp.int32)].get(mode="promise_in_bounds")
        inputs = rows.reshape(rows.shape[0], 1, *blocks.shape[2:], 2).astype(jnp.float32)  # [P, 1, G, 16, 2]
        pairs = low * inputs[..., 0] + high * inputs[..., 1]
        return jnp.sum(pairs * _mxfp4_scale(scales)[..., None], axis=(2, 3))
    gathered = weight.at[ids].get(mode="promise_in_bounds")  # [P, K, N], fused into the reduction
    return jnp.sum(rows.astype(jnp.float32)[:, :, None] * gathered.astype(jnp.float32), axis=1)


def _weighted(y: jax.Array, combine: jax.Array) -> jax.Array:
    """Each pair's product ``y [P, N]`` times its routing weight ``combine [P]``; a pair of weight 0 (routed
    to another device's experts, or a slot no pair fills) gives exact zeros even where its product was
    never computed and holds no finite number."""
    return jnp.where((combine != 0)[:, None], y * combine[:, None], 0)


def _gemv(x: jax.Array, experts: jax.Array, weights: jax.Array, w: ExpertWeights, activation: str,
          expert_offset: int | jax.Array = 0) -> jax.Array:
    """``_grouped`` as one matrix-vector product per (token, expert) pair: no grouping, no gathered
    weights written; the step reads ``T * top_k`` experts' bytes (each once for a decode token, whose
    ``top_k`` experts are distinct). With several tokens the pairs run sorted by expert, so pairs sharing
    an expert run side by side and its second read comes from the L2 cache. Pairs routed outside
    ``[expert_offset, expert_offset + w.num_experts)`` add nothing."""
    tokens, top_k = experts.shape
    local = experts.reshape(-1) - expert_offset
    combine = jnp.where((local >= 0) & (local < w.num_experts), weights.reshape(-1), 0)
    ids = jnp.clip(local, 0, w.num_experts - 1)
    pair = jnp.arange(tokens * top_k)
    if tokens > 1:
        pair = jnp.argsort(ids, stable=True)
        ids, combine = ids[pair], combine[pair]
    h = _pair_product(x[pair // top_k], w.gate_up, ids).astype(x.dtype)
    if w.gate_up_bias is not None:
        h = h + jnp.take(w.gate_up_bias, ids, axis=0)
    h = _activate(h, activation, w.interleaved)
    y = _pair_product(h, w.down, ids).astype(x.dtype)
    if w.down_bias is not None:
        y = y + jnp.take(w.down_bias, ids, axis=0)
    y = _weighted(y, combine)
    if tokens > 1:
        y = y[jnp.zeros_like(pair).at[pair].set(jnp.arange(pair.size))]  # back to pair order t * top_k + j
    return jnp.sum(y.reshape(tokens, top_k, -1), axis=1).astype(x.dtype)


def _sorted_pairs(experts: jax.Array, n: int, expert_offset):
    """The (token, expert) pairs sorted by expert: ``(order [T * k], counts [n])``; pairs routed outside
    ``[expert_offset, expert_offset + n)`` sort last and are in no count."""
    local = experts.reshape(-1) - expert_offset
    key = jnp.where((local >= 0) & (local < n), local, n)
    return jnp.argsort(key, stable=True), jnp.bincount(key, length=n + 1)[:n].astype(jnp.int32)


def _touched_ids(counts: jax.Array, pairs: int, n: int) -> tuple[jax.Array, jax.Array]:
    """With fewer pairs than the ``n`` experts, the touched experts only: ``(ids [G], counts [G])``,
    ascending (as the pairs are sorted), padded to the static ``G = pairs`` by repeating a touched
    expert with no pairs; else every expert."""
    if pairs >= n:
        return jnp.arange(n), counts
    ids = jnp.nonzero(counts > 0, size=pairs, fill_value=n)[0]
    present = ids < n
    ids = jnp.where(present, ids, jnp.max(jnp.where(present, ids, 0)))
    return ids, jnp.where(present, counts[ids], 0)


def _touched(counts: jax.Array, pairs: int, w: ExpertWeights) -> tuple[jax.Array, jax.Array, ExpertWeights]:
    """``_touched_ids`` and those experts' weights (all of them where every expert is touched)."""
    ids, counts = _touched_ids(counts, pairs, w.num_experts)
    return ids, counts, (w if pairs >= w.num_experts else w.take(ids))


def _capacity(x: jax.Array, experts: jax.Array, weights: jax.Array, w: ExpertWeights, activation: str,
              expert_offset: int | jax.Array = 0) -> jax.Array:
    """``_grouped`` as batched GEMMs: every (touched) expert multiplies ``T`` row slots (a token routes to
    an expert at most once), its own pairs' rows and zeros; no ragged product (a library's batched GEMM
    where ``ragged_dot`` lowers to a dense padded product), at ``G * T`` rows of work."""
    tokens, top_k = experts.shape
    order, counts = _sorted_pairs(experts, w.num_experts, expert_offset)
    first = jnp.cumsum(counts) - counts  # each expert's first position among the sorted pairs
    ids, counts, w = _touched(counts, order.size, w)
    slot = first[ids][:, None] + jnp.arange(tokens)[None]  # [G, T]
    valid = jnp.arange(tokens)[None] < counts[:, None]
    pair = order[jnp.minimum(slot, order.size - 1)]
    token = pair // top_k
    gate_up, down = w.dense(x.dtype)
    h = jnp.einsum("gth,ghi->gti", x[token], gate_up, preferred_element_type=jnp.float32).astype(x.dtype)
    if w.gate_up_bias is not None:
        h = h + w.gate_up_bias[:, None]
    h = _activate(h, activation, w.interleaved)
    y = jnp.einsum("gti,gih->gth", h, down, preferred_element_type=jnp.float32).astype(x.dtype)
    if w.down_bias is not None:
        y = y + w.down_bias[:, None]
    y = jnp.where(valid[..., None], y * weights.reshape(-1)[pair][..., None], 0)
    return jnp.zeros_like(x).at[token.reshape(-1)].add(y.reshape(-1, x.shape[-1]))


@functools.cache
def _tokamax_ragged_dot() -> Callable | None:
    """``tokamax.ragged_dot``, or None where tokamax is not installed or does not import here (a
    tokamax built for another JAX: said once in the log, since the grouped matmuls then run slower)."""
    try:
        import tokamax
    except ImportError:
        return None
    except Exception as e:  # noqa: BLE001  (an incompatible tokamax fails in its own imports)
        logging.getLogger(__name__).warning(
            "tokamax is installed but does not import (%s: %s); mixture-of-experts grouped matmuls use "
            "jax.lax.ragged_dot", type(e).__name__, e)
        return None
    return tokamax.ragged_dot


def library_ragged_dot(dtype, *, kernels: bool) -> bool:
    """Whether the "ragged_dot" implementation's grouped matmuls run tokamax's Mosaic GPU ragged dot:
    the kernels on (``OpsConfig.kernels``), 16-bit activations, a Hopper or later GPU, tokamax
    importable, one device. Elsewhere, and with the kernels off (the references), ``jax.lax.ragged_dot``;
    under a kernel mesh too, which XLA's SPMD partitioner splits without gathering a sharded expert
    weight (tokamax's kernel on a mesh has not been run here)."""
    from kernels_pallas._mosaic import hopper_or_later

    if not kernels or jax.default_backend() != "gpu" or sharding.under_kernel_mesh():
        return False
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return False
    return hopper_or_later() and _tokamax_ragged_dot() is not None


def grouped_products(rows: jax.Array, weight: jax.Array, counts: jax.Array, *, library: bool = False) -> jax.Array:
    """``rows [M, K]``, consecutive runs of ``counts [G]`` rows, each times its group's ``weight [G, K,
    N]`` -> float32 ``[M, N]`` (the runs' sum at most ``M``; the rows after them are unspecified, the
    caller masks them). ``library``: tokamax's Mosaic GPU kernel (``library_ragged_dot``), falling back
    to its XLA version for shapes the kernel does not take; else ``jax.lax.ragged_dot``."""
    if library:
        # The GPU was checked by ``library_ragged_dot``; tokamax's own device check would run only
        # because two implementations are named.
        return _tokamax_ragged_dot()(rows, weight, counts, preferred_element_type=jnp.float32,
                                     implementation=("mosaic", "xla"), bypass_device_check=True)
    return jax.lax.ragged_dot(rows, weight, counts, preferred_element_type=jnp.float32)


def _grouped(x: jax.Array, experts: jax.Array, weights: jax.Array, w: ExpertWeights, activation: str,
             expert_offset: int | jax.Array = 0, *, library: bool = False) -> jax.Array:
    """The routed experts' weighted sum over the experts ``w`` holds, numbers ``[expert_offset,
    expert_offset + w.num_experts)`` of the router's; pairs routed to other experts add nothing."""
    top_k = experts.shape[1]
    order, counts = _sorted_pairs(experts, w.num_experts, expert_offset)
    token = order // top_k
    rows = x[token]
    ids, counts, w = _touched(counts, order.size, w)
    group = jnp.repeat(jnp.arange(counts.shape[0]), counts, total_repeat_length=rows.shape[0])
    gate_up, down = w.dense(x.dtype)
    h = grouped_products(rows, gate_up, counts, library=library).astype(x.dtype)
    if w.gate_up_bias is not None:
        h = h + w.gate_up_bias[group]
    h = _activate(h, activation, w.interleaved)
    y = grouped_products(h, down, counts, library=library).astype(x.dtype)
    if w.down_bias is not None:
        y = y + w.down_bias[group]
    mine = jnp.arange(rows.shape[0]) < jnp.sum(counts)
    y = jnp.where(mine[:, None], y * weights.reshape(-1)[order][:, None], 0)
    return jnp.zeros_like(x).at[token].add(y)


def mosaic_kernel_fits(tokens: int, w: ExpertWeights, dtype) -> bool:
    """Whether the Mosaic GPU expert-products kernel (``kernels_pallas.experts``) takes a step of
    ``tokens`` tokens through experts ``w`` in ``dtype``: 16-bit floats, at most 64 tokens (a few rows
    per expert: decode and verify steps), widths of whole 64-column tiles."""
    from kernels_pallas.experts import mosaic_gpu

    if isinstance(w.gate_up, tuple):
        (gate_up, _), (down, _) = w.gate_up, w.down
        hidden, gate_up_out = gate_up.shape[2] * MXFP4_BLOCK, gate_up.shape[1]
        inter, down_out = down.shape[2] * MXFP4_BLOCK, down.shape[1]
        fits = mosaic_gpu.mxfp4_supports
    else:
        hidden, gate_up_out = w.gate_up.shape[1:]
        inter, down_out = w.down.shape[1:]
        fits = mosaic_gpu.supports
        if w.gate_up.dtype != dtype or w.down.dtype != dtype:
            return False
    return fits(hidden, gate_up_out, tokens, dtype) and fits(inter, down_out, tokens, dtype)


def _expert_groups(experts: jax.Array, n: int, expert_offset) -> tuple[jax.Array, ...]:
    """The (token, expert) pairs ``p = t * top_k + j`` as groups by expert, without a sort:
    ``(ids [G], counts [G], group [P], slot [P])``, ``G = min(P, n)``: group ``g`` is expert ``ids[g]``
    with ``counts[g]`` pairs (0: an unused group), pair ``p`` the row ``slot[p]`` of its ``group[p]``
    (``G``: routed outside ``[expert_offset, expert_offset + n)``). A decode token's distinct experts
    are its groups as they come; more tokens rank each pair among its expert's pairs (a cumulative
    sum over a one-hot ``[P, n]``) and each touched expert among the touched ones."""
    pairs = experts.size
    groups = min(pairs, n)
    local = experts.reshape(-1) - expert_offset
    inside = (local >= 0) & (local < n)
    expert = jnp.clip(local, 0, n - 1)
    if experts.shape[0] == 1 and pairs <= n:  # one token: top_k distinct experts, a group each
        if isinstance(expert_offset, int) and expert_offset == 0:
            # On one device ``route``'s ids are all in range: constants, no clip kernel before the products.
            inside, expert = jnp.ones_like(inside), local
        return expert, inside.astype(jnp.int32), jnp.where(inside, jnp.arange(pairs), groups), jnp.zeros_like(expert)
    onehot = (expert[:, None] == jnp.arange(n)[None]) & inside[:, None]  # [P, n]
    slot = jnp.take_along_axis(jnp.cumsum(onehot, axis=0, dtype=jnp.int32), expert[:, None], axis=1)[:, 0] - 1
    per_expert = jnp.sum(onehot, axis=0, dtype=jnp.int32)
    touched = per_expert > 0
    group_of = jnp.cumsum(touched, dtype=jnp.int32) - 1
    target = jnp.where(touched, group_of, groups)  # untouched experts write nowhere
    ids = jnp.zeros((groups,), jnp.int32).at[target].set(jnp.arange(n, dtype=jnp.int32), mode="drop")
    counts = jnp.zeros((groups,), jnp.int32).at[target].set(per_expert, mode="drop")
    return ids, counts, jnp.where(inside, group_of[expert], groups), slot


def mosaic_routed_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, w: ExpertWeights,
                          activation: str, expert_offset: int | jax.Array = 0, *,
                          interpret: bool | None = None) -> jax.Array:
    """``_grouped`` through the Mosaic GPU expert-products kernel (``kernels_pallas.experts``): each
    touched expert one group of ``S`` row slots (``S`` the tokens rounded up to 8: a token routes to
    an expert at most once; ``_expert_groups``), the gate-up and down products in the kernel (only the
    touched experts' bytes read, MXFP4 codes decoded inside), biases, the activation and the routing
    weights in XLA between and after. ``mosaic_kernel_fits`` must hold."""
    from kernels_pallas.experts import mosaic_gpu

    tokens, top_k = experts.shape
    ids, counts, group, slot = _expert_groups(experts, w.num_experts, expert_offset)
    slots = mosaic_gpu.slots_for(tokens)
    decode_token = tokens == 1 and ids.shape[0] == top_k
    if decode_token:  # the token's groups: its row in every slot of each (only slot 0's products are read)
        rows = jnp.broadcast_to(x[None], (top_k, slots, x.shape[-1]))
    else:
        token = jnp.arange(experts.size) // top_k
        rows = jnp.zeros((ids.shape[0], slots, x.shape[-1]), x.dtype).at[group, slot].set(x[token], mode="drop")

    def partials(rows, weight):  # float32 [splits, G, N, S]
        if isinstance(weight, tuple):
            return mosaic_gpu.mxfp4_expert_partials(rows, *weight, ids, counts, interpret=interpret)
        return mosaic_gpu.expert_partials(rows, weight, ids, counts, interpret=interpret)

    def biased(products, bias):  # products [G, ..., N] in x's dtype
        if bias is None:
            return products
        b = jnp.take(bias, ids, axis=0)
        return products + b.reshape(b.shape[:1] + (1,) * (products.ndim - 2) + b.shape[1:])

    if decode_token:
        # A decode token fills slot 0 of each group: the products are read there straight from the
        # partials (one fusion each for the activation and the combination, no transpose), and the
        # down rows are the activation broadcast over the slots, whose other products are never read.
        def first_slot(rows, weight):  # [G, N] in x's dtype
            return jnp.sum(partials(rows, weight)[..., 0], axis=0).astype(x.dtype)

        h = _activate(biased(first_slot(rows, w.gate_up), w.gate_up_bias), activation, w.interleaved)  # [G, I]
        y = biased(first_slot(jnp.broadcast_to(h[:, None], (top_k, slots, h.shape[-1])), w.down), w.down_bias)
        y = _weighted(y, jnp.where(counts > 0, weights.reshape(-1), 0))  # [G, hidden]
        return jnp.sum(y, axis=0, keepdims=True).astype(x.dtype)

    def products(rows, weight):  # [G, S, N] in x's dtype
        return jnp.swapaxes(jnp.sum(partials(rows, weight), axis=0), 1, 2).astype(x.dtype)

    h = biased(products(rows, w.gate_up), w.gate_up_bias)
    h = _activate(h, activation, w.interleaved)
    y = biased(products(h, w.down), w.down_bias)
    outside = group == ids.shape[0]
    y = y.at[jnp.where(outside, 0, group), slot].get(mode="promise_in_bounds")  # [P, hidden]: each pair's row
    y = _weighted(y, jnp.where(outside, 0, weights.reshape(-1)))
    return jnp.sum(y.reshape(tokens, top_k, -1), axis=1).astype(x.dtype)


def touched_experts(experts: jax.Array, num_experts: int) -> jax.Array:
    """How many distinct experts ``experts [..., top_k]`` route to (what a step's expert weights cost)."""
    return jnp.sum(jnp.bincount(experts.reshape(-1), length=num_experts) > 0)


def uses_mosaic_kernel(implementation: str, experts_shape: tuple[int, int], w: ExpertWeights, dtype, *,
                       kernels: bool, mosaic: bool = False) -> bool:
    """Whether ``routed_experts`` runs the Mosaic GPU kernel: the kernels on (``kernels``,
    ``OpsConfig.kernels``) on a Hopper or later GPU, at most four (token, expert) pairs an expert (a decode
    or verify step), ``mosaic_kernel_fits``, and ``implementation`` "auto" -- but for MXFP4 experts with
    fewer pairs than experts, where "gemv" is faster, and for 16-bit experts with at least as many pairs as
    experts where tokamax's grouped matmul runs (``library_ragged_dot``) -- or, under the Mosaic lowering
    (``mosaic``, ``OpsConfig.mosaic``), "gemv".

    Measured on an H100, engine steps of 8 layers (docs/performance.md): Qwen3-30B-A3B's bf16 experts
    decode at 0.78 ms a step on the kernel against 1.37 by ``ragged_dot`` at batch 1, 3.48 against 4.81 at
    batch 16; gpt-oss-20b's MXFP4 experts at 64 pairs of 32 experts (a batch-1 verify block of 16, a batch-16
    decode step) 6.49 against 9.30 ms a DFlash step and 5.97 against 8.74 a decode step, while at 4 and 16
    pairs "gemv" won (the whole Mosaic lowering: 1.67 / 3.56 against 1.39 / 3.00 ms). Against tokamax's
    grouped matmul, Qwen3-30B-A3B: the kernel won the decode steps of 8, 32 and 64 pairs (batch 1 / 4 / 8:
    0.83 / 1.54 / 2.24 ms against 1.46 / 3.32 / 5.51), tokamax every step of 128 pairs or more (a batch-16
    decode step 2.94 against 3.51 ms; the verify blocks of batch 1 / 2 / 4, 128 / 256 / 512 pairs, 2.87 /
    3.77 / 4.65 against 3.32 / 4.91 / 8.59 ms a DFlash step)."""
    from kernels_pallas._mosaic import hopper_or_later

    tokens, top_k = experts_shape
    pairs = tokens * top_k
    if not kernels or jax.default_backend() != "gpu" or pairs > 4 * w.num_experts:
        return False
    if implementation == "auto":
        mxfp4 = isinstance(w.gate_up, tuple)
        if mxfp4 and pairs < w.num_experts:
            return False
        if not mxfp4 and pairs >= w.num_experts and library_ragged_dot(dtype, kernels=kernels):
            return False
    elif implementation != "gemv" or not mosaic:
        return False
    return hopper_or_later() and mosaic_kernel_fits(tokens, w, dtype)


def routed_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, w: ExpertWeights, *,
                   activation: str, implementation: str = "auto", kernels: bool = False,
                   mosaic: bool = False) -> jax.Array:
    """``x [T, hidden]`` routed to ``experts [T, top_k]`` with ``weights [T, top_k]`` -> ``[T,
    hidden]``: ``sum_j weights[t, j] * expert_{experts[t, j]}(x[t])``. ``implementation``: "gemv"
    (a matrix-vector product per (token, expert) pair reading only the routed experts' bytes),
    "ragged_dot" (grouped matmuls), "capacity" (batched GEMMs of ``T`` row slots an expert), or
    "auto": "gemv" for MXFP4 experts up to ``gemv_pair_limit`` pairs, else "ragged_dot". ``kernels``
    (``OpsConfig.kernels``) and ``mosaic`` (``OpsConfig.mosaic``): on a Hopper or later GPU the steps
    ``uses_mosaic_kernel`` names run the Mosaic GPU kernel instead.

    Under ``sharding.kernel_mesh`` with the experts' leading axis split (logical axis ``experts``),
    each device runs its own experts and the shares are summed across the devices."""
    axes = ("experts", "embed", "mlp")
    across = sharding.kernel_mesh_axes(axes, (w.num_experts, 1, 1), 0)
    if uses_mosaic_kernel(implementation, experts.shape, w, x.dtype, kernels=kernels, mosaic=mosaic):
        run_experts = mosaic_routed_experts
    else:
        run_experts = {"gemv": _gemv, "ragged_dot": _grouped, "capacity": _capacity}[
            resolve_implementation(implementation, experts.size, w)]
        if run_experts is _grouped and library_ragged_dot(x.dtype, kernels=kernels):
            run_experts = functools.partial(_grouped, library=True)
    if not across:
        return run_experts(x, experts, weights, w, activation)

    def leaves(w: ExpertWeights):
        return [w.gate_up, w.down, w.gate_up_bias, w.down_bias]

    flat, tree = jax.tree.flatten(leaves(w))

    def shard(x, experts, weights, *flat_w):
        gate_up, down, gate_up_bias, down_bias = jax.tree.unflatten(tree, flat_w)
        local = ExpertWeights(gate_up, down, gate_up_bias, down_bias, w.interleaved)
        offset = jax.lax.axis_index(across) * local.num_experts
        return (jax.lax.psum(run_experts(x, experts, weights, local, activation, offset), across),)

    replicated = (None, None)
    expert_axes = [("experts",) + (None,) * (leaf.ndim - 1) for leaf in flat]
    run = sharding.shard_kernel(shard, [replicated, replicated, replicated] + expert_axes, [replicated],
                                out_shapes=lambda x, *_: (jax.ShapeDtypeStruct(x.shape, x.dtype),))
    return run(x, experts, weights, *flat)[0]


def routed_experts_reference(x: jax.Array, experts: jax.Array, weights: jax.Array, w: ExpertWeights, *,
                             activation: str) -> jax.Array:
    """``routed_experts`` as a dense product: every expert on every token, combined by the routing."""
    gate_up, down = w.dense(x.dtype)
    h = jnp.einsum("th,ehi->eti", x, gate_up, preferred_element_type=jnp.float32).astype(x.dtype)
    if w.gate_up_bias is not None:
        h = h + w.gate_up_bias[:, None]
    y = jnp.einsum("eti,eih->eth", _activate(h, activation, w.interleaved), down,
                   preferred_element_type=jnp.float32).astype(x.dtype)
    if w.down_bias is not None:
        y = y + w.down_bias[:, None]
    combine = jnp.sum(jax.nn.one_hot(experts, w.num_experts, dtype=x.dtype) * weights[..., None], axis=1)  # [T, E]
    return jnp.einsum("te,eth->th", combine, y)


