"""Backward of block attention as two Pallas kernels (Triton lowering), FlashAttention-2 style.

The default backward where the forward kernel runs compiled on a GPU (``bwd="pallas"``); on TPUs
and in interpret mode it is the blockwise jnp recomputation of ``reference_bwd.py``. Both recompute the probabilities from the forward's
per-row log-sum-exp and never build the dense ``[queries x keys]`` mask.

- ``_dq_kernel``, grid ``(batch, blocks, kv_heads)``: one program per folded query block; it walks
  the context tiles below ``ctx_len`` (no work past it) and its own block's keys, accumulating
  ``dq`` in float32, and writes the block's ``dk_blk`` / ``dv_blk`` (they belong to this block only).
- ``_dkv_kernel``, grid ``(batch, ctx_tiles, kv_heads)``: one program per context tile of one KV
  head; it walks all blocks ``n`` and, under ``lax.cond``, only those with ``ctx_len[n] >`` the
  tile start (in training: the blocks whose anchor lies past the tile), accumulating ``dk_ctx`` and
  ``dv_ctx`` in float32. The grid's fastest axes keep the programs of one KV head together so the
  folded queries of that head stay in L2.

``ds = p * (dp - delta)`` with ``delta = rowsum(dout * out)``; matmul operands are in the input
dtype, accumulation in float32, as in the forward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas._common import fold_blk, fold_q, next_pow2, unfold_rows
from kernels_pallas._flash import nn_dot, nt_dot, triton_params
from kernels_pallas.block_attention.gpu import GpuConfig


def _tn_dot(a, b):
    """a.T @ b with float32 accumulation."""
    return lax.dot_general(a, b, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _dq_kernel(cl_ref, bl_ref, q_ref, do_ref, lse_ref, dl_ref, k_ref, v_ref, kb_ref, vb_ref,
               dq_ref, dkb_ref, dvb_ref, *, scale, causal, groups, block_k):
    ctx_len = cl_ref[()]
    blk_len = bl_ref[()]
    q = q_ref[...]
    do = do_ref[...]
    lse = lse_ref[...][:, None]
    delta = dl_ref[...][:, None]
    rows, head_dim = q.shape
    n_iter = (ctx_len + (block_k - 1)) // block_k

    def body(i, dq):
        k_start = pl.multiple_of(i * block_k, block_k)
        k = k_ref[pl.ds(k_start, block_k), :]
        v = v_ref[pl.ds(k_start, block_k), :]
        s = nt_dot(q, k) * scale
        valid = (k_start + jnp.arange(block_k, dtype=jnp.int32) < ctx_len)[None, :]
        p = jnp.where(valid, jnp.exp(s - lse), 0.0)
        ds = p * (nt_dot(do, v) - delta)
        return dq + nn_dot(ds.astype(k.dtype), k)

    dq = lax.fori_loop(0, n_iter, body, jnp.zeros((rows, head_dim), jnp.float32))

    kb = kb_ref[...]
    vb = vb_ref[...]
    col = jnp.arange(kb.shape[0], dtype=jnp.int32)[None, :]
    valid = col < blk_len
    if causal:
        valid = valid & (col * groups <= jnp.arange(rows, dtype=jnp.int32)[:, None])
    s = nt_dot(q, kb) * scale
    p = jnp.where(valid, jnp.exp(s - lse), 0.0)
    ds = p * (nt_dot(do, vb) - delta)
    dq = dq + nn_dot(ds.astype(kb.dtype), kb)
    dq_ref[...] = (dq * scale).astype(dq_ref.dtype)
    dkb_ref[...] = (_tn_dot(ds.astype(q.dtype), q) * scale).astype(dkb_ref.dtype)
    dvb_ref[...] = _tn_dot(p.astype(do.dtype), do).astype(dvb_ref.dtype)


def _dkv_kernel(cl_ref, q_ref, do_ref, lse_ref, dl_ref, k_ref, v_ref, dk_ref, dv_ref, *,
                scale, n_blocks, block_k):
    j = pl.program_id(1)
    k = k_ref[...]
    v = v_ref[...]
    tile_start = j * block_k
    kpos = tile_start + jnp.arange(block_k, dtype=jnp.int32)

    def body(n, carry):
        ctx_len = cl_ref[n]

        def compute(carry):
            dk, dv = carry
            q = q_ref[n]
            do = do_ref[n]
            lse = lse_ref[n][:, None]
            delta = dl_ref[n][:, None]
            s = nt_dot(q, k) * scale
            p = jnp.where((kpos < ctx_len)[None, :], jnp.exp(s - lse), 0.0)
            ds = p * (nt_dot(do, v) - delta)
            dv = dv + _tn_dot(p.astype(do.dtype), do)
            dk = dk + _tn_dot(ds.astype(q.dtype), q)
            return dk, dv

        return lax.cond(tile_start < ctx_len, compute, lambda c: c, carry)

    zeros = jnp.zeros(k.shape, jnp.float32)
    dk, dv = lax.fori_loop(0, n_blocks, body, (zeros, zeros))
    dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def block_attention_bwd_pallas(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, out, lse, dout,
                               *, causal, scale, interpret=False, config=None):
    """Gradients (dq, dk_ctx, dv_ctx, dk_blk, dv_blk); ``lse`` as returned by the forward."""
    cfg = config if isinstance(config, GpuConfig) else GpuConfig()
    b, n, s_len, hq, d = q.shape
    ctx, hkv = k_ctx.shape[1], k_ctx.shape[2]
    g = hq // hkv
    rows = s_len * g
    rows_p = max(16, next_pow2(rows))
    d_p = max(16, next_pow2(d))
    slots_p = max(16, next_pow2(s_len))
    bk = cfg.block_k
    while bk > 16 and ctx % bk:
        bk //= 2
    ctx_p = max(-(-max(ctx, 1) // bk) * bk, bk)

    def pad_rows(x):  # [B, N, Hkv, R, D] -> padded
        return jnp.pad(x, ((0, 0),) * 3 + ((0, rows_p - rows), (0, d_p - d)))

    qf = pad_rows(fold_q(q, hkv))
    dof = pad_rows(fold_q(dout, hkv))
    delta = jnp.sum(dout.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)  # [B,N,S,Hq]
    delta = delta.reshape(b, n, s_len, hkv, g).transpose(0, 1, 3, 2, 4).reshape(b, n, hkv, rows)
    pad_r = ((0, 0),) * 3 + ((0, rows_p - rows),)
    delta = jnp.pad(delta, pad_r)
    lse_p = jnp.pad(lse, pad_r)
    kb = jnp.pad(fold_blk(k_blk), ((0, 0),) * 3 + ((0, slots_p - s_len), (0, d_p - d)))
    vb = jnp.pad(fold_blk(v_blk), ((0, 0),) * 3 + ((0, slots_p - s_len), (0, d_p - d)))
    kc, vc = k_ctx, v_ctx
    if ctx_p != ctx or d_p != d:
        pad = ((0, 0), (0, ctx_p - ctx), (0, 0), (0, d_p - d))
        kc = jnp.pad(kc, pad)
        vc = jnp.pad(vc, pad)
    cl = jnp.clip(ctx_lens.astype(jnp.int32), 0, ctx)
    bl = jnp.clip(blk_lens.astype(jnp.int32), 0, s_len)

    blk4 = lambda i, nn, h: (i, nn, h, 0, 0)  # noqa: E731
    dq, dkb, dvb = pl.pallas_call(
        functools.partial(_dq_kernel, scale=scale, causal=causal, groups=g, block_k=bk),
        grid=(b, n, hkv),
        in_specs=[
            pl.BlockSpec((None, None), lambda i, nn, h: (i, nn)),
            pl.BlockSpec((None, None), lambda i, nn, h: (i, nn)),
            pl.BlockSpec((None, None, None, rows_p, d_p), blk4),
            pl.BlockSpec((None, None, None, rows_p, d_p), blk4),
            pl.BlockSpec((None, None, None, rows_p), lambda i, nn, h: (i, nn, h, 0)),
            pl.BlockSpec((None, None, None, rows_p), lambda i, nn, h: (i, nn, h, 0)),
            pl.BlockSpec((None, ctx_p, None, d_p), lambda i, nn, h: (i, 0, h, 0)),
            pl.BlockSpec((None, ctx_p, None, d_p), lambda i, nn, h: (i, 0, h, 0)),
            pl.BlockSpec((None, None, None, slots_p, d_p), blk4),
            pl.BlockSpec((None, None, None, slots_p, d_p), blk4),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, rows_p, d_p), blk4),
            pl.BlockSpec((None, None, None, slots_p, d_p), blk4),
            pl.BlockSpec((None, None, None, slots_p, d_p), blk4),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(qf.shape, q.dtype),
            jax.ShapeDtypeStruct(kb.shape, k_blk.dtype),
            jax.ShapeDtypeStruct(vb.shape, v_blk.dtype),
        ],
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="dflash_block_attention_bwd_dq",
    )(cl, bl, qf, dof, lse_p, delta, kc, vc, kb, vb)

    n_tiles = ctx_p // bk
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, scale=scale, n_blocks=n, block_k=bk),
        grid=(b, n_tiles, hkv),
        in_specs=[
            pl.BlockSpec((None, n), lambda i, j, h: (i, 0)),
            pl.BlockSpec((None, n, None, rows_p, d_p), lambda i, j, h: (i, 0, h, 0, 0)),
            pl.BlockSpec((None, n, None, rows_p, d_p), lambda i, j, h: (i, 0, h, 0, 0)),
            pl.BlockSpec((None, n, None, rows_p), lambda i, j, h: (i, 0, h, 0)),
            pl.BlockSpec((None, n, None, rows_p), lambda i, j, h: (i, 0, h, 0)),
            pl.BlockSpec((None, bk, None, d_p), lambda i, j, h: (i, j, h, 0)),
            pl.BlockSpec((None, bk, None, d_p), lambda i, j, h: (i, j, h, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, bk, None, d_p), lambda i, j, h: (i, j, h, 0)),
            pl.BlockSpec((None, bk, None, d_p), lambda i, j, h: (i, j, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct(kc.shape, k_ctx.dtype),
            jax.ShapeDtypeStruct(vc.shape, v_ctx.dtype),
        ],
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="dflash_block_attention_bwd_dkv",
    )(cl, qf, dof, lse_p, delta, kc, vc)

    dq = unfold_rows(dq, s_len, g, d)
    dkb = dkb[:, :, :, :s_len, :d].transpose(0, 1, 3, 2, 4)
    dvb = dvb[:, :, :, :s_len, :d].transpose(0, 1, 3, 2, 4)
    return dq, dk[:, :ctx, :, :d], dv[:, :ctx, :, :d], dkb, dvb
