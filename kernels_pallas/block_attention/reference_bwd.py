"""Backward pass of block attention: blockwise jnp recomputation from the forward's log-sum-exp.

Not a Pallas kernel. The blocks are processed in chunks of ``chunk_blocks`` blocks (``lax.scan``);
for one chunk the scores against the whole context ``[batch, chunk_blocks, kv_heads, groups, block,
ctx]`` are recomputed in float32, turned into probabilities with the saved log-sum-exp (no second
softmax), and the gradients of q, the block K/V (local to the chunk) and the context K/V (summed
over chunks in float32) are formed. Peak memory is a few of those chunk-sized score tensors; the
dense ``[queries x keys]`` mask or score matrix of the whole problem is never materialised.
``chunk_blocks`` is the largest divisor of ``blocks`` whose score tensor fits in ``budget_bytes``.

Masked entries get probability exactly 0 (``where``), so rows that see no key at all contribute
nothing, as in the reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def _chunk_blocks(batch, blocks, q_heads, block, ctx, budget_bytes):
    per_block = max(1, batch * q_heads * block * (ctx + block) * 4)
    best = 1
    for c in range(1, blocks + 1):
        if blocks % c == 0 and c * per_block <= budget_bytes:
            best = c
    return best


def block_attention_bwd(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, out, lse, dout, *, causal: bool,
    scale: float, budget_bytes: int = 1 << 27):
    """Gradients (dq, dk_ctx, dv_ctx, dk_blk, dv_blk) of sum(out * dout).

    ``lse``: ``[batch, blocks, kv_heads, block * groups]`` float32 (row ``s * groups + g``), as
    returned by the forward kernels.
    """
    b, n, s_len, hq, d = q.shape
    ctx = k_ctx.shape[1]
    hkv = k_ctx.shape[2]
    g = hq // hkv
    f32 = jnp.float32

    qg = q.reshape(b, n, s_len, hkv, g, d)
    dog = dout.reshape(b, n, s_len, hkv, g, d)
    # delta_r = sum_d dout * out (the softmax-Jacobian term), laid out like the scores: b n k g s
    delta = jnp.sum(dout.astype(f32) * out.astype(f32), axis=-1)
    delta = delta.reshape(b, n, s_len, hkv, g).transpose(0, 1, 3, 4, 2)
    lse_g = lse.reshape(b, n, hkv, s_len, g).transpose(0, 1, 2, 4, 3)

    nb = _chunk_blocks(b, n, hq, s_len, ctx, budget_bytes)
    n_chunks = n // nb

    def split(x):  # [b, n, ...] -> [chunks, b, nb, ...]
        x = x.reshape(b, n_chunks, nb, *x.shape[2:])
        return jnp.moveaxis(x, 1, 0)

    xs = tuple(
        split(x) for x in (qg, dog, delta, lse_g, ctx_lens, blk_lens, k_blk, v_blk)
    )
    ctx_pos = jnp.arange(ctx)
    slot = jnp.arange(s_len)

    def step(carry, x):
        dk_ctx, dv_ctx = carry
        qc, doc, dc, lc, cl, bl, kbc, vbc = x
        ctx_vis = (ctx_pos[None, None, :] < cl[:, :, None])[:, :, None, None, None, :]
        blk_vis = slot[None, None, None, :] < bl[:, :, None, None]
        if causal:
            blk_vis = blk_vis & (slot[None, None, None, :] <= slot[None, None, :, None])
        blk_vis = blk_vis[:, :, None, None, :, :]

        s_ctx = jnp.einsum("bnskgd,btkd->bnkgst", qc, k_ctx, preferred_element_type=f32)
        s_blk = jnp.einsum("bnskgd,bntkd->bnkgst", qc, kbc, preferred_element_type=f32)
        p_ctx = jnp.where(ctx_vis, jnp.exp(s_ctx * scale - lc[..., None]), 0.0)
        p_blk = jnp.where(blk_vis, jnp.exp(s_blk * scale - lc[..., None]), 0.0)

        dp_ctx = jnp.einsum("bnskgd,btkd->bnkgst", doc, v_ctx, preferred_element_type=f32)
        dp_blk = jnp.einsum("bnskgd,bntkd->bnkgst", doc, vbc, preferred_element_type=f32)
        ds_ctx = p_ctx * (dp_ctx - dc[..., None]) * scale
        ds_blk = p_blk * (dp_blk - dc[..., None]) * scale

        cdt = q.dtype  # matmul operand dtype, float32 accumulation (as the reference)
        dq = jnp.einsum(
            "bnkgst,btkd->bnskgd", ds_ctx.astype(cdt), k_ctx, preferred_element_type=f32
        ) + jnp.einsum("bnkgst,bntkd->bnskgd", ds_blk.astype(cdt), kbc, preferred_element_type=f32)
        dk_ctx = dk_ctx + jnp.einsum(
            "bnkgst,bnskgd->btkd", ds_ctx.astype(cdt), qc, preferred_element_type=f32
        )
        dv_ctx = dv_ctx + jnp.einsum(
            "bnkgst,bnskgd->btkd", p_ctx.astype(cdt), doc, preferred_element_type=f32
        )
        dkb = jnp.einsum("bnkgst,bnskgd->bntkd", ds_blk.astype(cdt), qc, preferred_element_type=f32)
        dvb = jnp.einsum("bnkgst,bnskgd->bntkd", p_blk.astype(cdt), doc, preferred_element_type=f32)
        return (dk_ctx, dv_ctx), (dq, dkb, dvb)

    init = (jnp.zeros(k_ctx.shape, f32), jnp.zeros(v_ctx.shape, f32))
    (dk_ctx, dv_ctx), (dq, dkb, dvb) = lax.scan(step, init, xs)

    def merge(x):  # [chunks, b, nb, ...] -> [b, n, ...]
        x = jnp.moveaxis(x, 0, 1)
        return x.reshape(b, n, *x.shape[3:])

    dq = merge(dq).reshape(q.shape).astype(q.dtype)
    dkb = merge(dkb).astype(k_blk.dtype)
    dvb = merge(dvb).astype(v_blk.dtype)
    return dq, dk_ctx.astype(k_ctx.dtype), dv_ctx.astype(v_ctx.dtype), dkb, dvb


def zero_cotangent(x):
    """The cotangent of an integer input (lengths): float0 zeros."""
    import numpy as np

    return np.zeros(x.shape, dtype=jax.dtypes.float0)
