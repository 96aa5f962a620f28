"""Block attention on NVIDIA GPUs: Pallas with the Triton lowering, split-K (flash-decoding).

One program per (batch row b, block n, KV head h, context split j). The program holds the folded
queries of its block and KV head (``rows = block * groups`` rows, padded to a power of two >= 16, in
registers/shared memory), streams its share of the row's ``ctx_len`` context keys (``ctx_len`` in
whole tiles over the splits: ``_flash.split_span``) in tiles of ``block_k`` keys straight from the
cache layout ``[batch, ctx, kv_heads, head_dim]`` with an online (flash) softmax in float32, and
split 0 also takes the block's own ``block`` keys (causal or not, only the first ``blk_len``). The
loop runs to the row's context only, so a short row in a long cache costs little.

With one split the program writes the normalised output in the query dtype. With several it
writes a float32 partial output plus its running max ``m`` and sum ``l``; a small jnp epilogue
merges the splits with log-sum-exp weights (XLA fuses it into one pass over the partials).

The number of splits is chosen from the static shapes by a wave model (``plan``): with ``slots``
programs resident at once (SMs x programs per SM), minimise ``waves * (keys per split + fixed
overheads)``, at least ``min_chunk`` keys per split so the partials stay small against the K/V they
summarise.

Why Triton and not Mosaic GPU: see kernels_pallas/README.md. In short, the Triton lowering still works in
JAX 0.11 (with a DeprecationWarning; it must be asked for explicitly with
``plgpu_triton.CompilerParams`` because Mosaic GPU became the default), it handles dynamic loop
bounds and masked tiles of any power-of-two shape, and it can be lowered to Triton IR on a CPU-only
machine, so the kernel is checked before the accelerator is ever touched.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas._common import (
    NEG,
    check_shapes,
    default_scale,
    fold_blk,
    fold_q,
    next_pow2,
    round_up,
    unfold_rows,
)
from kernels_pallas._flash import merge_splits, nt_dot, online_update, split_pages, split_span, tile_keys, triton_params


@dataclasses.dataclass(frozen=True)
class GpuConfig:
    block_k: int = 64  # context keys per tile (power of two >= 16)
    num_warps: int = 4
    num_stages: int = 3  # Triton software-pipelining depth of the K/V loads
    num_sms: int | None = None  # streaming multiprocessors (None: read off the device, else 132)
    ctas_per_sm: int = 2  # programs resident per SM (shared memory: ~112 KiB each at the defaults)
    min_chunk: int = 256  # fewest context keys per split
    max_splits: int = 128
    fixed_cost_keys: int = 128  # per-program overhead, in keys, for the wave model
    partial_cost_keys: int = 128  # writing + merging one partial output, in keys
    num_splits: int | None = None  # force a split count (tests, tuning)
    partial_dtype: str = "float32"  # dtype of the split-K partial outputs (m, l stay float32)
    # The split count is planned over the capacity, but each row's splits share its actual context in
    # whole tiles, rather than fixed chunks of the capacity: a prefix hit's suffix over a 4k-token
    # context in a 17k-token page table took three times as long on the first split alone.
    balanced_splits: bool = True
    # Cached kernel only, blocks of several slots: group members per program (a power of two
    # dividing the group; None: the fewest that fit the grid in one wave, ``members_per_program``).
    members_per_program: int | None = None
    # Cached kernel only, programs of several members: their queries as one [block * members, D]
    # matrix (one dot per tile, one online softmax) instead of one per member: the verify block's
    # kernel 15% faster at 16,384 tokens, the DFlash step 4-6% at long contexts or batch 16
    # (docs/performance.md). In bf16 it rounds differently from a single token.
    stacked_members: bool = True
    # Cached kernel only: fewer software-pipelining stages than ``num_stages`` where ``ctas_per_sm``
    # programs would not fit one SM's shared memory (``cached_attention_gpu.fitted_stages``): a
    # verify block's programs of 64 stacked query rows do not fit two per SM at three stages, and
    # with two the kernel took 7-23% less time (docs/performance.md).
    fit_stages: bool = True
    shared_memory_per_sm: int = 228 * 1024  # bytes; H100 / H200 (sm_90)
    # Cached kernel only: context keys per tile where the batch's (row, KV head) pairs alone number
    # at least a quarter of the SMs (0 or None: ``block_k`` everywhere; ``cached_attention_gpu.
    # batch_tiles``). Such grids are bound by throughput, not by one program's latency: smaller tiles
    # cut a program's shared memory and registers; the DFlash step 0.5-1.4% faster at batch 8-32
    # (docs/performance.md). With few rows 64-key tiles halve the loop's trips.
    wide_batch_block_k: int | None = 32
    # The most shared memory one program may take (sm_90: 227 KiB a block). Programs whose estimate
    # (``program_shared_bytes``) exceeds it are not compiled: their callers take another path.
    shared_memory_per_program: int = 227 * 1024


def resident_programs(cfg: GpuConfig) -> int:
    """Programs that run at once, one wave: ``ctas_per_sm`` per streaming multiprocessor."""
    return num_sms(cfg) * cfg.ctas_per_sm


def num_sms(cfg: GpuConfig) -> int:
    if cfg.num_sms is not None:
        return cfg.num_sms
    try:
        dev = jax.devices()[0]
        if dev.platform == "gpu" and getattr(dev, "core_count", None):
            return int(dev.core_count)
    except Exception:  # noqa: BLE001
        pass
    return 132  # H200 / H100 SXM


def program_shared_bytes(*, stages: int, block_k: int, head_dim: int, held_rows: int, dot_rows: int, slots: int,
                         itemsize: int) -> int:
    """An estimate of one program's shared memory as Triton lays out the flash loop of these kernels: per
    software-pipelining stage a K and a V tile ``[block_k, head_dim]``; the query operands of all the
    program's rows ``[held_rows, head_dim]``; the block's own K and V ``[slots, head_dim]``; and the
    widest score tile of one dot ``[dot_rows, max(block_k, slots)]``, its float32 scores (a layout
    conversion's scratch) and its probabilities in the inputs' dtype (the second dot's operand). Its
    terms grow with the block: a long block (a prefill suffix or chunk of hundreds of slots) held in one
    program exceeds an SM's shared memory, which Triton reports only when it compiles."""
    widest = max(block_k, slots)
    return (stages * 2 * block_k * head_dim * itemsize + held_rows * head_dim * itemsize
            + 2 * slots * head_dim * itemsize + dot_rows * widest * (4 + itemsize))


def forward_fits(q_shape: tuple[int, ...], kv_heads: int, itemsize: int, config: GpuConfig | None = None) -> bool:
    """Whether ``forward``'s program for queries ``q_shape [batch, blocks, block, q_heads, head_dim]``
    fits one SM's shared memory by ``program_shared_bytes``: a program holds all ``block * groups``
    query rows of its block, so long blocks do not (``ops.attention.block_attention`` then runs the
    reference)."""
    cfg = config or GpuConfig()
    _, _, block, heads, head_dim = q_shape
    rows = max(16, next_pow2(block * (heads // kv_heads)))
    slots, d = max(16, next_pow2(block)), max(16, next_pow2(head_dim))
    need = program_shared_bytes(stages=cfg.num_stages, block_k=cfg.block_k, head_dim=d, held_rows=rows,
                                dot_rows=rows, slots=slots, itemsize=itemsize)
    return need <= cfg.shared_memory_per_program


def _kernel(
    cl_ref,  # [] int32: ctx_len of (b, n)
    bl_ref,  # [] int32: blk_len of (b, n)
    q_ref,  # [R, D]
    k_ref,  # [T, D] (strided view of [B, T, Hkv, D])
    v_ref,  # [T, D]
    kb_ref,  # [Sp, D]
    vb_ref,  # [Sp, D]
    *refs,  # paged: the row's page table [max_pages] int32; then o [R, D], m [R], l [R]
    scale: float,
    causal: bool,
    groups: int,
    block_k: int,
    chunk: int,
    balanced: bool,
    page_size: int,
):
    """Paged (``page_size``): ``k_ref, v_ref`` are views of the page pools flattened to ``[pages *
    page_size, D]`` and context position ``p`` is pool row ``table[p // page_size] * page_size + p %
    page_size``: each tile's keys are loaded by their rows; the arithmetic is the contiguous kernel's."""
    table_ref = refs[0] if page_size else None
    o_ref, m_ref, l_ref = refs[-3:]
    j = pl.program_id(3)
    ctx_len = cl_ref[()]
    blk_len = bl_ref[()]
    q = q_ref[...]
    rows, head_dim = q.shape

    start, n_iter = split_span(j, pl.num_programs(3), ctx_len, chunk, block_k, balanced)
    pages = split_pages(table_ref, start, chunk, block_k, page_size)

    acc = jnp.zeros((rows, head_dim), jnp.float32)
    m = jnp.full((rows,), NEG, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)

    def body(i, carry):
        k_start = pl.multiple_of(start + i * block_k, block_k)
        keys = tile_keys(table_ref, pages, start, k_start, block_k, page_size)
        k = k_ref[keys, :]
        v = v_ref[keys, :]
        s = nt_dot(q, k)
        pos = k_start + jnp.arange(block_k, dtype=jnp.int32)
        valid = (pos < ctx_len)[None, :]
        return online_update(carry, s, valid, v, scale)

    acc, m, l = lax.fori_loop(0, n_iter, body, (acc, m, l))

    # The block's own keys: only split 0 takes them (the others see blk_len 0).
    kb = kb_ref[...]
    vb = vb_ref[...]
    n_slots = kb.shape[0]
    eff_blk = jnp.where(j == 0, blk_len, 0)
    col = jnp.arange(n_slots, dtype=jnp.int32)[None, :]
    valid = col < eff_blk
    if causal:
        row = jnp.arange(rows, dtype=jnp.int32)[:, None]
        valid = valid & (col * groups <= row)
    s = nt_dot(q, kb)
    acc, m, l = online_update((acc, m, l), s, valid, vb, scale)

    l_safe = jnp.where(l == 0.0, 1.0, l)
    o_ref[...] = (acc / l_safe[:, None]).astype(o_ref.dtype)
    m_ref[...] = m
    l_ref[...] = l


def plan(batch: int, blocks: int, kv_heads: int, ctx: int, cfg: GpuConfig):
    """Static tiling: (block_k, padded ctx, splits, chunk).

    Split-K by a wave model: ``slots = SMs * ctas_per_sm`` programs run at once, so the kernel
    takes about ``ceil(programs / slots)`` waves of ``chunk + overheads`` keys each; pick the split
    count that minimises that (ties: fewer splits). This avoids a nearly empty last wave (e.g. 576
    programs on 264 slots), which the H200 measurements showed costs ~15-25%.
    """
    bk = cfg.block_k
    while bk > 16 and ctx % bk:
        bk //= 2
    ctx_p = max(round_up(max(ctx, 1), bk), bk)
    base = batch * blocks * kv_heads
    if cfg.num_splits is not None:
        splits = max(1, min(cfg.num_splits, ctx_p // bk))
        chunk = round_up(-(-ctx_p // splits), bk)
        return bk, ctx_p, -(-ctx_p // chunk), chunk
    slots = resident_programs(cfg)
    best = None
    max_s = max(1, min(cfg.max_splits, ctx_p // max(cfg.min_chunk, bk)))
    for s in range(1, max_s + 1):
        chunk = round_up(-(-ctx_p // s), bk)
        s_eff = -(-ctx_p // chunk)
        waves = -(-(base * s_eff) // slots)
        cost = waves * (chunk + cfg.fixed_cost_keys + (cfg.partial_cost_keys if s_eff > 1 else 0))
        if best is None or cost < best[0]:
            best = (cost, s_eff, chunk)
    _, splits, chunk = best
    return bk, ctx_p, splits, chunk


def forward(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, *, causal: bool, scale: float | None = None,
    interpret: bool = False, config: GpuConfig | None = None):
    """Returns (out [B, N, S, Hq, D] in q.dtype, lse [B, N, Hkv, S * G] float32, NEG if no key)."""
    check_shapes(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens)
    return _forward(q, k_ctx, v_ctx, k_ctx.shape[1], ctx_lens, k_blk, v_blk, blk_lens, causal=causal, scale=scale,
                    interpret=interpret, config=config)


def paged_forward(q, k_pool, v_pool, page_table, ctx_lens, k_blk, v_blk, blk_lens, *, causal: bool,
                  scale: float | None = None, interpret: bool = False, config: GpuConfig | None = None):
    """``forward`` over paged contexts: ``k_pool, v_pool [pages, page_size, Hkv, D]`` (``D`` a power of
    two >= 16), ``page_table [B, n_pages]`` int32 (row b's position p at ``pool[page_table[b, p //
    page_size], p % page_size]``: the context is ``n_pages * page_size`` positions), the rest as
    ``forward``'s with one block per row (``N == 1``) -> ``(out, lse)``. The kernel loads each context
    tile's keys from the pool rows the table names; nothing is gathered."""
    b, n, t, hq, d = q.shape
    if (n != 1 or page_table.shape[0] != b or k_pool.shape != v_pool.shape or k_pool.shape[-1] != d
            or d != max(16, next_pow2(d))):
        raise ValueError(f"paged block attention takes q [batch, 1, block, heads, head_dim] (a power-of-two "
                         f"head_dim >= 16), pools [pages, page_size, kv_heads, {d}] and page_table [batch, "
                         f"n_pages]; got q {q.shape}, pools {k_pool.shape} / {v_pool.shape}, page_table "
                         f"{page_table.shape}")
    return _forward(q, k_pool, v_pool, page_table.shape[1] * k_pool.shape[1], ctx_lens[:, None], k_blk, v_blk,
                    blk_lens[:, None], causal=causal, scale=scale, interpret=interpret, config=config,
                    page_table=page_table)


def _forward(q, k_ctx, v_ctx, ctx, ctx_lens, k_blk, v_blk, blk_lens, *, causal, scale, interpret, config,
             page_table=None):
    """``forward`` and ``paged_forward``: a context of ``ctx`` positions a row."""
    return _jitted_forward(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, page_table, ctx=ctx, causal=bool(causal),
                           scale=scale, interpret=bool(interpret), config=config or GpuConfig())


@functools.partial(jax.jit, static_argnames=("ctx", "causal", "scale", "interpret", "config"))
def _jitted_forward(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens, page_table, *, ctx: int, causal: bool,
                    scale: float | None, interpret: bool, config: GpuConfig):
    """``_forward``, jitted: the layers' identical calls in a program share one trace and one lowering
    of the kernel (a call of one function, which XLA inlines: the same kernels run)."""
    cfg = config
    b, n, s_len, hq, d = q.shape
    hkv = k_blk.shape[3]
    g = hq // hkv
    scale = default_scale(d, scale)
    bk, ctx_p, splits, chunk = plan(b, n, hkv, ctx, cfg)

    rows = s_len * g
    rows_p = max(16, next_pow2(rows))
    d_p = max(16, next_pow2(d))
    slots_p = max(16, next_pow2(s_len))

    qf = fold_q(q, hkv)
    qf = jnp.pad(qf, ((0, 0),) * 3 + ((0, rows_p - rows), (0, d_p - d)))
    kb = jnp.pad(fold_blk(k_blk), ((0, 0),) * 3 + ((0, slots_p - s_len), (0, d_p - d)))
    vb = jnp.pad(fold_blk(v_blk), ((0, 0),) * 3 + ((0, slots_p - s_len), (0, d_p - d)))
    page_size = 0 if page_table is None else k_ctx.shape[1]
    if page_size:  # the pools as [pages * page_size] rows (a bitcast); tiles past ctx read clamped pages, masked
        k_ctx, v_ctx = (x.reshape((-1,) + x.shape[2:]) for x in (k_ctx, v_ctx))
        ctx_spec = pl.BlockSpec((k_ctx.shape[0], None, d_p), lambda i, nn, h, j: (0, h, 0))
        paging_args, paging_specs = [page_table], [pl.BlockSpec((None, page_table.shape[1]),
                                                                lambda i, nn, h, j: (i, 0))]
    else:
        if ctx_p != ctx or d_p != d:  # a copy of the context: only for odd shapes
            pad = ((0, 0), (0, ctx_p - ctx), (0, 0), (0, d_p - d))
            k_ctx = jnp.pad(k_ctx, pad)
            v_ctx = jnp.pad(v_ctx, pad)
        ctx_spec = pl.BlockSpec((None, ctx_p, None, d_p), lambda i, nn, h, j: (i, 0, h, 0))
        paging_args, paging_specs = [], []
    ctx_lens = jnp.clip(ctx_lens.astype(jnp.int32), 0, ctx)
    blk_lens = jnp.clip(blk_lens.astype(jnp.int32), 0, s_len)

    out_dtype = q.dtype if splits == 1 else jnp.dtype(cfg.partial_dtype)
    kernel = functools.partial(
        _kernel, scale=scale, causal=causal, groups=g, block_k=bk, chunk=chunk, balanced=bool(cfg.balanced_splits),
        page_size=page_size,
    )
    grid = (b, n, hkv, splits)
    o, m, l = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[
            pl.BlockSpec((None, None), lambda i, nn, h, j: (i, nn)),
            pl.BlockSpec((None, None), lambda i, nn, h, j: (i, nn)),
            pl.BlockSpec((None, None, None, rows_p, d_p), lambda i, nn, h, j: (i, nn, h, 0, 0)),
            ctx_spec,
            ctx_spec,
            pl.BlockSpec((None, None, None, slots_p, d_p), lambda i, nn, h, j: (i, nn, h, 0, 0)),
            pl.BlockSpec((None, None, None, slots_p, d_p), lambda i, nn, h, j: (i, nn, h, 0, 0)),
            *paging_specs,
        ],
        out_specs=[
            pl.BlockSpec(
                (None, None, None, None, rows_p, d_p), lambda i, nn, h, j: (i, nn, h, j, 0, 0)
            ),
            pl.BlockSpec((None, None, None, None, rows_p), lambda i, nn, h, j: (i, nn, h, j, 0)),
            pl.BlockSpec((None, None, None, None, rows_p), lambda i, nn, h, j: (i, nn, h, j, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((b, n, hkv, splits, rows_p, d_p), out_dtype),
            jax.ShapeDtypeStruct((b, n, hkv, splits, rows_p), jnp.float32),
            jax.ShapeDtypeStruct((b, n, hkv, splits, rows_p), jnp.float32),
        ],
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="dflash_block_attention",
    )(ctx_lens, blk_lens, qf, k_ctx, v_ctx, kb, vb, *paging_args)

    if splits == 1:
        o = o[:, :, :, 0]
        m = m[:, :, :, 0]
        l_tot = l[:, :, :, 0]
    else:
        o, m, l_tot = merge_splits(o, m, l, axis=3)
    lse = jnp.where(l_tot > 0.0, m + jnp.log(jnp.where(l_tot > 0.0, l_tot, 1.0)), NEG)
    out = unfold_rows(o.astype(q.dtype), s_len, g, d)
    return out, lse[..., :rows]
