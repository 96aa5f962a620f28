"""Layout helpers shared by the GPU and TPU block-attention kernels.

Both kernels work on "folded" queries: for every (batch row b, block n, KV head h) the
``groups = q_heads // kv_heads`` query heads that share KV head ``h`` and the ``block`` slots of the
block are stacked into one matrix of ``rows = block * groups`` query rows, row ``r = s * groups + g``
(slot ``s``, group member ``g``). With Qwen3-8B (32 q heads, 8 KV heads) and B = 16 that is 64 rows,
which feeds the tensor cores / MXU instead of 16 separate 4-row problems. The slot of a row is
``r // groups``, so the causal test ``key_slot <= slot(r)`` is ``key_slot * groups <= r``.

Folding moves only the queries, the outputs and the block's own K/V (all small: O(block) per row);
the context K/V, which is what costs HBM bandwidth, is read in place from the cache layout
``[batch, ctx, kv_heads, head_dim]``.
"""

from __future__ import annotations

import math

import jax

NEG = -1e30  # finite "minus infinity": exp(NEG - NEG) = 1, never NaN


def default_scale(head_dim: int, scale: float | None) -> float:
    return 1.0 / math.sqrt(head_dim) if scale is None else float(scale)


def next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def fold_q(q: jax.Array, kv_heads: int) -> jax.Array:
    """[B, N, S, Hq, D] -> [B, N, Hkv, S * G, D], row r = s * G + g."""
    b, n, s, hq, d = q.shape
    g = hq // kv_heads
    q = q.reshape(b, n, s, kv_heads, g, d).transpose(0, 1, 3, 2, 4, 5)
    return q.reshape(b, n, kv_heads, s * g, d)


def unfold_rows(o: jax.Array, block: int, groups: int, head_dim: int) -> jax.Array:
    """[B, N, Hkv, R_pad, D_pad] -> [B, N, S, Hq, D]."""
    b, n, hkv = o.shape[:3]
    o = o[:, :, :, : block * groups, :head_dim]
    o = o.reshape(b, n, hkv, block, groups, head_dim).transpose(0, 1, 3, 2, 4, 5)
    return o.reshape(b, n, block, hkv * groups, head_dim)


def fold_blk(kv_blk: jax.Array) -> jax.Array:
    """[B, N, S, Hkv, D] -> [B, N, Hkv, S, D]."""
    return kv_blk.transpose(0, 1, 3, 2, 4)


def check_shapes(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens):
    if q.ndim != 5:
        raise ValueError(f"q must be [batch, blocks, block, q_heads, head_dim], got {q.shape}")
    b, n, s, hq, d = q.shape
    if k_ctx.ndim != 4 or v_ctx.shape != k_ctx.shape:
        raise ValueError(f"k_ctx/v_ctx must be [batch, ctx, kv_heads, head_dim]: {k_ctx.shape} {v_ctx.shape}")
    hkv = k_ctx.shape[2]
    if k_ctx.shape[0] != b or k_ctx.shape[3] != d:
        raise ValueError(f"k_ctx {k_ctx.shape} does not match q {q.shape}")
    if hq % hkv:
        raise ValueError(f"q_heads={hq} is not a multiple of kv_heads={hkv}")
    if k_blk.shape != (b, n, s, hkv, d) or v_blk.shape != k_blk.shape:
        raise ValueError(f"k_blk/v_blk must be {(b, n, s, hkv, d)}: {k_blk.shape} {v_blk.shape}")
    if ctx_lens.shape != (b, n) or blk_lens.shape != (b, n):
        raise ValueError(f"ctx_lens/blk_lens must be {(b, n)}: {ctx_lens.shape} {blk_lens.shape}")
    return b, n, s, hq, hkv, d
