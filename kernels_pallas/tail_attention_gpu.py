"""The layer tail's optional fifth phase (``layer_tail_gpu.layer_tail`` with ``k_cache``): the next
layer's attention for a decode token, inside the persistent kernel that just computed that layer's
QKV, and its jnp reference.

Why: per layer the fused and the layer-tail layouts run the attention as kernels of their own (the
cached-attention kernel, ~7.2 us at context 512, and its split merge, ~1.3 us), and each kernel
boundary drains and refills the weight stream. Here the attention's key and value tiles stream into
the weight ring behind QKV's last tiles, 32 programs (8 KV heads x ``ATTN_SPLITS``) attend once their
KV head's QKV columns are stored (the QKV phase's ready counters), split 0 of each head merges the
other splits' partials (a counter per head) and writes the head's rows of the next layer's ``a``.

How: the WGMMA's operands are ``[64, 128]`` tiles. A decode token's 8 rows are copies of it, so a TMA
of 8 rows fills 8 of the 64: row ``8 b + i`` holds query head ``b % groups``, and one WGMMA scores the
KV head's query heads against a 64-key tile; the same ``[64, 128]`` layout carries the q / k norms and
RoPE (``cached_attention_gpu._finish``'s roundings) and the online softmax.

Measured on the H200 (docs/benchmarks.md, twenty-fourth session): correct on its first run (the
attention's output within 3.4e-3 of ``next_attention_reference``, deterministic), but the phase takes
~24 us where the two kernels it replaces take ~8.5: its elementwise work on 64-row tiles (16 copies of
4 distinct rows) and split 0's merge dominate (in-kernel profile). Off by default
(``dflash_jax.tail_layout.ATTENTION_IN_TAIL``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas._mosaic_gpu import WGMMA_M, fence_proxy_async

ATTN_SPLITS = 4  # programs per KV head, each over its share of the context
ATTN_KEYS = 64  # cache keys per tile (one ring slot of [64, 128])
META = 32  # int32 entries of the phase's ``meta`` (the token's position first): a TMA moves multiples of 128 bytes


def attention_phase(c, *, rows, dtype, groups, per_head, scale, eps, head, split, first_tile, my_tiles,
                    position, first_step, steps, arrived, fetch_weights, w_ready, kv_rings, part_rings, own_smem,
                    own_ready, ml_smem, ml_in, part_ready, qkv_gmem, attn_gmem, k_new_gmem, v_new_gmem, o_part_gmem,
                    ml_part_gmem, await_qkv):
    """The attention phase of one program of ``layer_tail_gpu.layer_tail`` (``LayerConfig`` ``c``):
    KV head ``head``, context split ``split`` (its key tiles ``first_tile ..`` ``+ my_tiles``,
    already in the weight ring behind the matmuls' steps; ``steps`` the ring's last, ``fetch_weights``
    its refill). The refs are the kernel's (``layer_tail``'s scratch and outputs).

    Rows of the ``[64, 128]`` operands: row ``8 b + i`` holds query head ``b % groups`` of the KV
    head (the token's 8 rows are copies, so a TMA of 8 rows fills 8 of them), so one WGMMA scores
    the group's heads against a key tile. Split 0 also attends to the token's own key (and hands the
    normed, RoPE'd key and the value out for the cache write), waits for the other splits'
    unnormalised partials (a counter per KV head) and merges them in split order."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    wgmma_layout = plgpu.Layout.WGMMA
    half = 64
    f32 = jnp.float32
    rnd = lambda x: x.astype(dtype).astype(f32)  # noqa: E731  (a bf16 op's rounding, computed in float32)
    col0 = head * per_head

    # The token's q heads (and, in split 0, its key and value) once QKV has stored this KV head's columns.
    with jax.named_scope("a_qkv_wait"):
        for col in (col0, col0 + per_head - 1):  # the column groups of the head's first and last column
            await_qkv(col // c.flag_cols)
    for part in range(3):
        def copy(part=part):
            for b in range(WGMMA_M // rows):
                col = col0 + (b % groups if part == 0 else groups + part - 1) * 128
                plgpu.copy_gmem_to_smem(qkv_gmem.at[:, pl.ds(col, 128)],
                                        own_smem.at[part, pl.ds(b * rows, rows)], own_ready.at[part])
        if part == 0:
            copy()
        else:
            pl.when(split == 0)(copy)

    def take(step):
        """Waits for ``step``'s ring slot; its ref."""
        slot = step % c.stages
        plgpu.barrier_wait(w_ready.at[slot])
        return kv_rings.at[slot]

    def load_halves(ref):
        return (plgpu.load(ref.at[:, pl.ds(0, half)], (), layout=wgmma_layout).astype(f32),
                plgpu.load(ref.at[:, pl.ds(half, half)], (), layout=wgmma_layout).astype(f32))

    # The tables stay in their slots while the q (and split 0's k) are finished, one half-width
    # array at a time: few [64, 128] float32 arrays (64 registers each) are live at once, and only the
    # accumulator across the key tiles.
    with jax.named_scope("a_tables"):
        tables = [take(first_step + s) for s in range(3)]

    def finish(part, w_slot):
        """Per-head RMSNorm then RoPE of own_smem[part], written back in place
        (``cached_attention_gpu._finish``'s numerics)."""
        plgpu.barrier_wait(own_ready.at[part])
        lo, hi = load_halves(own_smem.at[part])
        r = lax.rsqrt((jnp.sum(lo * lo, axis=1) + jnp.sum(hi * hi, axis=1)) * (1.0 / 128) + eps)
        r = lax.broadcast_in_dim(r, lo.shape, (0,))
        w_lo, w_hi = load_halves(w_slot)
        lo, hi = rnd(w_lo * rnd(lo * r)), rnd(w_hi * rnd(hi * r))
        cos, sin = load_halves(tables[2])
        own_smem[part, :, pl.ds(0, half)] = (rnd(lo * cos) - rnd(hi * sin)).astype(dtype)
        own_smem[part, :, pl.ds(half, half)] = (rnd(hi * cos) + rnd(lo * sin)).astype(dtype)

    with jax.named_scope("a_finish"):
        finish(0, tables[0])
        pl.when(split == 0)(lambda: finish(1, tables[1]))
    plgpu.commit_smem()  # q (and k) written for the WGMMAs; every thread is done with the tables' slots
    for s in range(3):
        pl.when(first_step + s + c.stages - 1 < steps)(lambda s=s: fetch_weights(first_step + s + c.stages - 1))

    neg = -1e30
    m = plgpu.layout_cast(jnp.full((WGMMA_M,), neg, f32), wgmma_layout.reduce(1))
    l = plgpu.layout_cast(jnp.full((WGMMA_M,), 0.0, f32), wgmma_layout.reduce(1))
    acc = plgpu.layout_cast(jnp.full((WGMMA_M, 128), 0.0, f32), wgmma_layout)

    def tile(t, carry):
        acc, m, l = carry
        step = first_step + 3 + 2 * t
        k_slot = take(step)
        s = pl.run_scoped(lambda ref: (plgpu.wgmma(ref, own_smem.at[0], plgpu.transpose_ref(k_slot, (1, 0))),
                                       plgpu.wgmma_wait(0), ref[...])[-1], plgpu.ACC((WGMMA_M, ATTN_KEYS)))
        keys = (first_tile + t) * ATTN_KEYS + plgpu.broadcasted_iota(jnp.int32, s.shape, 1, layout=wgmma_layout)
        valid = keys < position
        s = jnp.where(valid, s * scale, neg)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        alpha = jnp.exp(m - m_new)
        p = jnp.where(valid, jnp.exp(s - lax.broadcast_in_dim(m_new, s.shape, (0,))), 0.0)
        l = l * alpha + jnp.sum(p, axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, (0,))
        v_slot = take(step + 1)

        def mma(ref):
            plgpu.wgmma(ref, p.astype(dtype), v_slot)

        acc = pl.run_state(mma)(plgpu.ACC.init(acc))
        plgpu.wgmma_wait(0)
        for s_ in (step, step + 1):
            pl.when(s_ + c.stages - 1 < steps)(lambda s_=s_: fetch_weights(s_ + c.stages - 1))
        return acc, m_new, l

    with jax.named_scope("a_tiles"):
        acc, m, l = lax.fori_loop(0, my_tiles, tile, (acc, m, l))

    def store_partial():
        part_rings.at[0][...] = acc
        ml_smem[0] = m
        ml_smem[1] = l
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(part_rings.at[0], o_part_gmem.at[split, head])
        plgpu.copy_smem_to_gmem(ml_smem, ml_part_gmem.at[split, head])
        plgpu.wait_smem_to_gmem(0)
        fence_proxy_async()
        plgpu.semaphore_signal(arrived.at[head], 1, memory_scope="gpu")

    def merge():
        """Split 0: the token's own key and value (handed out for the cache write), then the other
        splits' partials, in split order."""
        plgpu.copy_smem_to_gmem(own_smem.at[1, pl.ds(0, rows)], k_new_gmem.at[:, pl.ds(head * 128, 128)])
        plgpu.barrier_wait(own_ready.at[2])
        plgpu.copy_smem_to_gmem(own_smem.at[2, pl.ds(0, rows)], v_new_gmem.at[:, pl.ds(head * 128, 128)])
        q_lo, q_hi = load_halves(own_smem.at[0])
        k_lo, k_hi = load_halves(own_smem.at[1])
        s_own = (jnp.sum(q_lo * k_lo, axis=1) + jnp.sum(q_hi * k_hi, axis=1)) * scale
        with jax.named_scope("a_merge_wait"):
            plgpu.semaphore_wait(arrived.at[head], ATTN_SPLITS - 1, decrement=True, memory_scope="gpu")
            fence_proxy_async()
        with jax.named_scope("a_merge_load"):
            for i in range(ATTN_SPLITS - 1):
                plgpu.copy_gmem_to_smem(o_part_gmem.at[i + 1, head], part_rings.at[i], part_ready.at[0])
                plgpu.copy_gmem_to_smem(ml_part_gmem.at[i + 1, head], ml_in.at[i], part_ready.at[0])
            plgpu.barrier_wait(part_ready.at[0])
        ms = [plgpu.load(ml_in.at[i, 0], (), layout=wgmma_layout.reduce(1)) for i in range(ATTN_SPLITS - 1)]
        ls = [plgpu.load(ml_in.at[i, 1], (), layout=wgmma_layout.reduce(1)) for i in range(ATTN_SPLITS - 1)]
        m0 = jnp.maximum(m, s_own)  # split 0 with its own key
        alpha, p_own = jnp.exp(m - m0), jnp.exp(s_own - m0)
        m_max = m0
        for m_j in ms:
            m_max = jnp.maximum(m_max, m_j)
        w0 = jnp.exp(m0 - m_max)
        bcast = lambda x: lax.broadcast_in_dim(x, (WGMMA_M, 128), (0,))  # noqa: E731
        v = plgpu.load(own_smem.at[2], (), layout=wgmma_layout).astype(f32)
        weighted = (acc * bcast(alpha) + bcast(p_own) * v) * bcast(w0)
        total = (l * alpha + p_own) * w0
        for i in range(ATTN_SPLITS - 1):  # in split order
            w_j = jnp.exp(ms[i] - m_max)
            weighted = weighted + plgpu.load(part_rings.at[i], (), layout=wgmma_layout) * bcast(w_j)
            total = total + ls[i] * w_j
        out = weighted / bcast(total)
        plgpu.wait_smem_to_gmem(0)  # the key's and value's stores have left own_smem
        own_smem[0] = out.astype(dtype)
        plgpu.commit_smem()
        for g in range(groups):
            plgpu.copy_smem_to_gmem(own_smem.at[0, pl.ds(g * rows, rows)],
                                    attn_gmem.at[:, pl.ds((head * groups + g) * 128, 128)])
        plgpu.wait_smem_to_gmem(0)

    with jax.named_scope("a_partial"):
        pl.when(split != 0)(store_partial)
    with jax.named_scope("a_merge"):
        pl.when(split == 0)(merge)


def next_attention_reference(qkv: jax.Array, k_cache: jax.Array, v_cache: jax.Array, meta: jax.Array,
                             norm_tables: jax.Array, rope_table: jax.Array, *, groups: int, scale: float,
                             eps: float) -> list[jax.Array]:
    """``layer_tail``'s attention phase in jnp, for any rows: each row of ``qkv [R, Q]`` a token at
    position ``meta[0]`` (``Q = kv_heads * (groups + 2) * head_dim``: per KV head its query heads,
    key, value), over ``k_cache, v_cache [capacity, kv_heads, head_dim]`` at positions ``< meta[0]``
    and its own key -> ``attn [R, kv_heads * groups * head_dim]``, ``k_new, v_new [R, kv_heads *
    head_dim]``. The q and k get their RMSNorm (weights in ``norm_tables[:, 0]``) and RoPE (cos |
    sin in ``rope_table[0]``) with ``cached_attention_gpu._finish``'s roundings."""
    rows = qkv.shape[0]
    capacity, kv_heads, head_dim = k_cache.shape
    half = head_dim // 2
    dtype = k_cache.dtype
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    rnd = lambda x: f32(x.astype(dtype))  # noqa: E731
    x = qkv.reshape(rows, kv_heads, groups + 2, head_dim)
    cos, sin = f32(rope_table[0, :half]), f32(rope_table[0, half:])

    def finish(t, w):
        f = f32(t)
        r = lax.rsqrt(jnp.mean(f * f, axis=-1, keepdims=True) + eps)
        n = rnd(f32(w) * rnd(f * r))
        lo, hi = n[..., :half], n[..., half:]
        return jnp.concatenate([rnd(rnd(lo * cos) - rnd(hi * sin)), rnd(rnd(hi * cos) + rnd(lo * sin))], axis=-1)

    q = finish(x[:, :, :groups], norm_tables[0, 0])  # [R, Hkv, G, D]
    k = finish(x[:, :, groups], norm_tables[1, 0])  # [R, Hkv, D]
    v = f32(x[:, :, groups + 1])
    position = meta[0]
    s = jnp.einsum("rhgd,chd->rhgc", q, f32(k_cache)) * scale
    s = jnp.where(jnp.arange(capacity) < position, s, -jnp.inf)
    s_own = jnp.sum(q * k[:, :, None], axis=-1) * scale  # [R, Hkv, G]
    m = jnp.maximum(jnp.max(s, axis=-1), s_own)
    p, p_own = jnp.exp(s - m[..., None]), jnp.exp(s_own - m)
    out = (jnp.einsum("rhgc,chd->rhgd", p, f32(v_cache)) + p_own[..., None] * v[:, :, None]) / (
        jnp.sum(p, axis=-1) + p_own)[..., None]
    return [out.astype(dtype).reshape(rows, -1), k.astype(dtype).reshape(rows, -1), v.astype(dtype).reshape(rows, -1)]
