"""A block's attention over its KV cache in one kernel: q/k norm, RoPE, cache write, attention.

The target's decode/verify blocks use all of it; the drafter's blocks (``Drafter.draft``) use it
with ``causal=False, write=False``: bidirectional within the block, over its context cache, which
it only reads.

The decode and verify steps of the target run, per layer, one matmul into the fused QKV layout
``[batch, block, kv_heads, groups + 2, head_dim]`` (``layers.Attention.fuse``) and then this kernel,
which does everything up to the output projection:

- the query heads and the key of the block get their per-head RMSNorm (Qwen3) and RoPE at positions
  ``start .. start + block - 1``, with the transformers numerics of ``layers.rms_norm`` /
  ``layers.apply_rope`` (the cos / sin tables of those positions come in from XLA, one per step);
- the last split writes the block's K and V into the cache at ``start`` (the cache buffers are
  aliased in and out, so the write is in place and nothing else of the cache moves; no split reads
  those positions). Split 0 takes the block's own keys, and a row's last split holds the fewest of
  its context tiles;
- every program runs block attention (``attention.block_attention_reference`` with ``causal=True``,
  ``ctx_lens = start``) for its KV head and its split of the context: an online softmax over the
  cache tiles it owns, then (split 0) the block's own keys.

Without it the same work is about a dozen small XLA kernels per layer around the block-attention
kernel (norms, RoPE, pads to its 16-row tiles, two cache writes, the unfold of the output), each
1-2 us at batch 1 (docs/performance.md). Nothing is padded in HBM: a verify block runs one
``[block, head_dim]`` query matrix per group member, and a single decode token's ``groups`` query
rows (4 for Qwen3-8B) are repeated in registers to the 16 rows ``tl.dot`` takes.

RoPE rotates the two halves of a head; the kernel keeps q and k as their two halves throughout
(``q . k = q_lo . k_lo + q_hi . k_hi``), so it never concatenates in registers.

Grid ``(batch, kv_heads, group members / members per program, splits)`` (one program of the whole
group for a single token; ``members_per_program`` for a block). The split count
comes from the wave model of the block-attention kernel (``block_attention_gpu.plan``) over the
cache capacity, a static shape; each row's context (``starts``, dynamic) is then dealt to its splits
in whole tiles (``GpuConfig.balanced_splits``), so a short context is not left to the first splits.
Tiles hold 64 context keys, 32 where the batch alone fills a quarter of the SMs (``batch_tiles``).
Split-K partials are merged by ``_flash.merge_splits``. Forward only (inference). Design notes and
measurements: kernels_pallas/README.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas._common import NEG, default_scale, next_pow2
from kernels_pallas._flash import (MMA_MIN, merge_splits, nt_dot, online_update, split_pages, split_span, tile_keys,
                                   triton_params)
from kernels_pallas._pdl import signal_after, signals
from kernels_pallas.block_attention.gpu import GpuConfig, num_sms, plan, program_shared_bytes, resident_programs


DEFAULT_CONFIG = GpuConfig()  # tiles and split planning when no config is given


def supports(qkv_shape: tuple[int, ...], capacity: int, *, compiled: bool = True, itemsize: int = 2,
             config: GpuConfig | None = None) -> bool:
    """Whether the kernel takes these shapes (``qkv_shape [rows, block, kv_heads, groups + 2,
    head_dim]``, caches of ``capacity`` positions, ``itemsize`` bytes an element). Compiled for a GPU,
    Triton's tiles need a power-of-two head_dim >= 32, block and groups (<= 16), and the program
    ``cached_block_attention`` would run must fit one SM's shared memory by
    ``block_attention_gpu.program_shared_bytes``: decode tokens and draft / verify blocks do, a long
    block (a prefill suffix or chunk over a cached prefix) does not and takes the unfused path. The
    aliased cache is never padded, so its capacity must be whole tiles of 16 keys. Interpret mode
    takes any block."""
    if not tiles_supported(qkv_shape, capacity, compiled=compiled):
        return False
    if not compiled:
        return True
    _, block, kv_heads, groups_2, head_dim = qkv_shape
    cfg = config or DEFAULT_CONFIG
    layout = program_layout(qkv_shape[0], block, kv_heads, groups_2 - 2, head_dim, capacity, itemsize, cfg)
    return layout.shared_bytes <= cfg.shared_memory_per_program


def tiles_supported(qkv_shape: tuple[int, ...], capacity: int, *, compiled: bool) -> bool:
    """``supports``' rules of Triton's tiles, without the shared-memory estimate."""
    _, block, _, groups_2, head_dim = qkv_shape
    groups = groups_2 - 2
    pow2 = lambda n: n >= 1 and next_pow2(n) == n  # noqa: E731
    if not (pow2(groups) and pow2(head_dim) and head_dim >= 2 and capacity % MMA_MIN == 0):
        return False
    return not compiled or (head_dim >= 2 * MMA_MIN and groups <= MMA_MIN and pow2(block))


@dataclasses.dataclass(frozen=True)
class ProgramLayout:
    """How ``cached_block_attention`` lays out its programs for one set of static shapes."""

    config: GpuConfig  # the tiles (with ``batch_tiles``' key tile)
    block_k: int
    splits: int
    chunk: int
    per_program: int  # group members per program (0: a single token's program of its whole group)
    stacked: bool
    grid: tuple[int, int, int, int]
    stages: int
    shared_bytes: int  # ``program_shared_bytes`` of one program


def program_layout(batch: int, block: int, kv_heads: int, groups: int, head_dim: int, capacity: int, itemsize: int,
                   cfg: GpuConfig) -> ProgramLayout:
    """The kernel's tiles, splits, grid and pipelining stages for these shapes.

    A single token gets one program per KV head (its G rows); a verify block one per ``per_program``
    group members (a [T, D] query matrix each, or with ``stacked_members`` one [T * per_program, D]
    matrix). The context splits do not depend on the block: a 1-token and a 16-token pass then sum
    every query's context in the same tiles and splits, so greedy speculative decoding reproduces
    target-only decoding exactly in float32 (stacked, the dots round at their own shape: float32
    tokens unchanged on the H200, docs/performance.md)."""
    cfg = batch_tiles(cfg, batch=batch, kv_heads=kv_heads)
    block_k, _, splits, chunk = plan(batch, 1, kv_heads, capacity, cfg)
    per_program = 0 if block == 1 else members_per_program(batch, kv_heads, groups, splits, cfg)
    stacked = bool(cfg.stacked_members) and per_program > 1
    # A dot's query rows, repeated to the 16 an MMA takes (as ``_kernel`` does): a single token's
    # group, a member's [T, D] queries or the stacked [T * M, D]; unstacked, a program holds M of them.
    dot_rows = max(MMA_MIN, groups if block == 1 else block * (per_program if stacked else 1))
    held_rows = dot_rows if block == 1 or stacked else dot_rows * per_program
    grid = (batch, kv_heads, 1 if block == 1 else groups // per_program, splits)
    stages = fitted_stages(cfg, programs=math.prod(grid), block_k=block_k, head_dim=head_dim, held_rows=held_rows,
                           dot_rows=dot_rows, itemsize=itemsize)
    shared = program_shared_bytes(stages=stages, block_k=block_k, head_dim=head_dim, held_rows=held_rows,
                                  dot_rows=dot_rows, slots=block, itemsize=itemsize)
    return ProgramLayout(cfg, block_k, splits, chunk, per_program, stacked, grid, stages, shared)


def _finish(x_lo, x_hi, w_ref, cos, sin, *, qk_norm: bool, eps: float):
    """Per-head RMSNorm (optional) then RoPE of heads given as their two halves ``[rows, D/2]``."""
    dtype = x_lo.dtype
    half = x_lo.shape[-1]
    if qk_norm:
        f_lo, f_hi = x_lo.astype(jnp.float32), x_hi.astype(jnp.float32)
        sumsq = jnp.sum(f_lo * f_lo, axis=1, keepdims=True) + jnp.sum(f_hi * f_hi, axis=1, keepdims=True)
        r = lax.rsqrt(sumsq / (2 * half) + eps)
        x_lo = w_ref[pl.ds(0, half)][None, :] * (f_lo * r).astype(dtype)
        x_hi = w_ref[pl.ds(half, half)][None, :] * (f_hi * r).astype(dtype)
    return x_lo * cos - x_hi * sin, x_hi * cos + x_lo * sin


def _kernel(
    start_ref,  # [] int32: tokens already in the cache (= the block's first position)
    blk_len_ref,  # [] int32: valid slots of the block
    *refs,
    # then, each ``parts`` times (the projection's float32 split-K partials, or once its value):
    #   q [T, M, D] raw queries of the program's M group members (a single token: [G, D], all of
    #   them), k [T, D] raw key, v [T, D] value;
    # then q_norm [D], k_norm [D], rope [2, T, D / 2] float32 (RoPE's cos and sin at the block's
    # positions), with ``scaled`` the row scale [T] float32, the caches k, v [C, D] (strided views of
    # [B, C, Hkv, D]; paged, of the pools [P * S, Hkv, D]); paged, the row's page table [max_pages]
    # int32 and with a write the pool rows [T] int32 its block goes to; the outputs o (like q), m [T, M]
    # ([G]), l [T, M] ([G]); and with a write, the caches k, v aliasing the inputs.
    members: int,
    stacked: bool,
    parts: int,
    scaled: bool,
    dtype: jnp.dtype,
    scale: float,
    eps: float,
    qk_norm: bool,
    causal: bool,
    block_k: int,
    chunk: int,
    balanced: bool,
    page_size: int,
    signal: bool,
):
    """One program per (row, KV head, ``members`` group members, split); a single token's program
    takes all its group's rows (``members`` 0: no member axis). A program of several members loads
    each context tile once for all of them and runs one online softmax per member, each exactly as
    a program of one member would. With ``stacked`` the members' queries are instead one
    ``[T * M, D]`` matrix (row ``t * M + m``): one dot per tile and one online softmax over all
    rows (each row's arithmetic unchanged), at the price of a 3-D load and reshape in the prologue.
    Otherwise tensors stay two-dimensional: Triton lowers 3-D register tensors (and reshapes
    between them) through shared memory, which cost more than the attention itself in the first
    version of this kernel. Fewer than 16 query rows (a single token's ``G``, a short block's
    ``T``) are repeated to the 16 rows ``tl.dot`` needs: identical copies with identical outputs,
    so their maximum is the output.

    Partials are summed in split order in float32 and rounded to ``dtype`` (what XLA's split-K
    reduction after a GEMM does), so the kernel reads the projection without that reduction kernel.
    With ``scaled``, the sum (or the value) is multiplied by its slot's row scale in float32 before
    that rounding: an RMSNorm folded into the projection (``dflash_jax.runtime.serving_params``).

    Paged (``page_size``): the caches are a layer's page pools, flattened to ``[pages * page_size]``
    rows; context position ``p`` of the row is pool row ``table[p // page_size] * page_size + p %
    page_size`` (each tile's keys gathered by their rows, so a tile may span pages), and the block's
    K/V go to the pool rows the caller resolved (its pages, or the null page). Everything else is the
    contiguous kernel's arithmetic, tile for tile."""
    q_parts, k_parts, v_parts = refs[:parts], refs[parts:2 * parts], refs[2 * parts:3 * parts]
    q_norm_ref, k_norm_ref, rope_ref, *refs = refs[3 * parts:]
    scale_ref = refs.pop(0) if scaled else None
    k_cache_ref, v_cache_ref, *refs = refs
    table_ref = refs.pop(0) if page_size else None
    # with a write, the block's pool rows come before the outputs o, m, l and the two caches
    write_rows_ref = refs.pop(0) if page_size and len(refs) == 6 else None
    o_ref, m_ref, l_ref, *cache_out = refs
    j = pl.program_id(3)
    start = start_ref[()]
    blk_len = blk_len_ref[()]
    slots, head_dim = k_parts[0].shape
    half = head_dim // 2
    lo, hi = pl.ds(0, half), pl.ds(half, half)

    # [T, 1]: a slot's scale for its rows of k and v, and for its query rows (a single token's G
    # rows are all slot 0)
    row_scale = scale_ref[...][:, None] if scaled else None

    def read(part_refs, cols=slice(None), member=None):
        """The block's projection (columns ``cols``; of group member ``member`` of the program, or
        ``"all"``: its members stacked, ``[T * M, cols]``) in ``dtype``: its value, or its partials'
        sum, times the row scale."""
        index = ((slice(None), cols) if member is None else
                 (slice(None), slice(None), cols) if member == "all" else (slice(None), member, cols))
        scale_rows = row_scale if member != "all" or row_scale is None else row_scale[:, :, None]
        if parts == 1 and row_scale is None:
            x = part_refs[0][index].astype(dtype)
        else:
            x = functools.reduce(jnp.add, [r[index].astype(jnp.float32) for r in part_refs])
            x = (x if scale_rows is None else x * scale_rows).astype(dtype)
        return x.reshape(-1, x.shape[-1]) if member == "all" else x

    cos, sin = rope_ref[0].astype(dtype), rope_ref[1].astype(dtype)
    finish = functools.partial(_finish, cos=cos, sin=sin, qk_norm=qk_norm, eps=eps)

    k_lo, k_hi = finish(read(k_parts, lo), read(k_parts, hi), k_norm_ref)
    v_blk = read(v_parts)

    if cache_out:
        k_cache_out, v_cache_out = cache_out

        @pl.when((j == pl.num_programs(3) - 1) & (pl.program_id(2) == 0))
        def _write_block():
            block = write_rows_ref[...] if page_size else pl.ds(start, slots)
            k_cache_out[block, lo] = k_lo
            k_cache_out[block, hi] = k_hi
            v_cache_out[block, :] = v_blk

    member_ids = ["all"] if stacked else list(range(members)) if members else [None]
    per_slot = members if stacked else 1  # query rows per slot in a program's query matrix
    if stacked:  # each slot's cos / sin for its M stacked rows
        cos, sin = (jnp.broadcast_to(x[:, None, :], (slots, members, half)).reshape(slots * members, half)
                    for x in (cos, sin))
        finish_q = functools.partial(_finish, cos=cos, sin=sin, qk_norm=qk_norm, eps=eps)
    else:
        finish_q = finish
    queries = []  # per member (or once, stacked): q's halves, normed, rotated and repeated to >= 16 rows
    for g in member_ids:
        q_lo, q_hi = finish_q(read(q_parts, lo, g), read(q_parts, hi, g), q_norm_ref)
        distinct = q_lo.shape[0]  # G rows of one slot, T slots of one group member, or T * M stacked
        copies = max(1, MMA_MIN // distinct)
        if copies > 1:
            q_lo, q_hi = (jnp.broadcast_to(x[None], (copies,) + x.shape).reshape(copies * distinct, half)
                          for x in (q_lo, q_hi))
        queries.append((q_lo, q_hi))
    rows = queries[0][0].shape[0]

    # The context before the block: this split's tiles of the keys before ``start``.
    first, n_tiles = split_span(j, pl.num_programs(3), start, chunk, block_k, balanced)
    pages = split_pages(table_ref, first, chunk, block_k, page_size)
    carries = tuple((jnp.zeros((rows, head_dim), jnp.float32), jnp.full((rows,), NEG, jnp.float32),
                     jnp.zeros((rows,), jnp.float32)) for _ in queries)

    def body(i, carries):
        k0 = pl.multiple_of(first + i * block_k, block_k)
        keys = tile_keys(table_ref, pages, first, k0, block_k, page_size)
        k_tile_lo, k_tile_hi, v_tile = k_cache_ref[keys, lo], k_cache_ref[keys, hi], v_cache_ref[keys, :]
        valid = ((k0 + jnp.arange(block_k, dtype=jnp.int32)) < start)[None, :]
        return tuple(online_update(carry, nt_dot(q_lo, k_tile_lo) + nt_dot(q_hi, k_tile_hi), valid, v_tile, scale)
                     for carry, (q_lo, q_hi) in zip(carries, queries))

    carries = lax.fori_loop(0, n_tiles, body, carries)

    # The block's own keys, causal or not (a row's slot is its row modulo the copies; a single token
    # sees itself): split 0 only, the others see a block of length 0.
    col = jnp.arange(slots, dtype=jnp.int32)[None, :]
    valid = col < jnp.where(j == 0, blk_len, 0)
    if causal and slots > 1:
        valid = valid & (col <= (jnp.arange(rows, dtype=jnp.int32)[:, None] % distinct) // per_slot)
    for n, (g, carry, (q_lo, q_hi)) in enumerate(zip(member_ids, carries, queries)):
        acc, m, l = online_update(carry, nt_dot(q_lo, k_lo) + nt_dot(q_hi, k_hi), valid, v_blk, scale)
        out = acc / jnp.where(l == 0.0, 1.0, l)[:, None]
        if rows > distinct:  # the copies' maximum
            out = jnp.max(out.reshape(rows // distinct, distinct, head_dim), axis=0)
            m = jnp.max(m.reshape(rows // distinct, distinct), axis=0)
            l = jnp.max(l.reshape(rows // distinct, distinct), axis=0)
        out = out.astype(o_ref.dtype)
        if n == len(member_ids) - 1:
            # the last output needs every tile's load: the split merge after this kernel may
            # launch from here on (the members' query loads came first, in program order)
            out = signal_after(out, signal=signal)
        if g is None:
            m_ref[...], l_ref[...], o_ref[...] = m, l, out
        elif g == "all":
            m_ref[...], l_ref[...] = m.reshape(slots, members), l.reshape(slots, members)
            o_ref[...] = out.reshape(slots, members, head_dim)
        else:
            m_ref[:, g], l_ref[:, g], o_ref[:, g, :] = m, l, out


def members_per_program(batch: int, kv_heads: int, groups: int, splits: int, cfg: GpuConfig) -> int:
    """Group members per program for a block of several slots: ``cfg.members_per_program``, or the
    fewest (a power of two dividing ``groups``) with which the grid fits one wave of resident
    programs. The splits are planned as for a single token (one program per KV head), so at long
    contexts a program per member would make the verify block's grid ``groups`` times larger: more
    waves, each re-reading the same context tiles. A program of several members reads them once."""
    if cfg.members_per_program is not None:
        m = cfg.members_per_program
        if m < 1 or groups % m or next_pow2(m) != m:
            raise ValueError(f"members_per_program must be a power of two dividing groups ({groups}), got {m}")
        return m
    slots, m = resident_programs(cfg), 1
    while m < groups and batch * kv_heads * (groups // m) * splits > slots:
        m *= 2
    return m


def batch_tiles(cfg: GpuConfig, *, batch: int, kv_heads: int) -> GpuConfig:
    """``cfg`` with ``cfg.wide_batch_block_k`` keys per context tile where ``batch * kv_heads`` (a
    decode token's programs before any split) reach a quarter of the SMs, else ``cfg`` itself. A
    rule of the batch alone, so a decode token and a verify block of the same batch sum the context
    in the same tiles (float32 speculative decoding reproduces target-only decoding); batch 1 keeps
    64-key tiles, with which its latency-bound token kernel runs fewer loop trips."""
    if not cfg.wide_batch_block_k or 4 * batch * kv_heads < num_sms(cfg):
        return cfg
    return dataclasses.replace(cfg, block_k=cfg.wide_batch_block_k)


def fitted_stages(cfg: GpuConfig, *, programs: int, block_k: int, head_dim: int, held_rows: int, dot_rows: int,
                  itemsize: int) -> int:
    """The most software-pipelining stages, at most ``cfg.num_stages``, with which ``cfg.ctas_per_sm``
    programs fit one SM's shared memory (``cfg.shared_memory_per_sm``), as Triton lays a program
    out: per stage a K and a V tile ``[block_k, head_dim]``; once the query operands of all its
    rows ``[held_rows, head_dim]`` and the probabilities of one dot ``[dot_rows, block_k]``. Stages
    only pipeline the loads, so the arithmetic does not change with them. ``cfg.num_stages`` when
    the grid's ``programs`` need no more than one SM each, or ``cfg.fit_stages`` is off."""
    stages = cfg.num_stages
    if not cfg.fit_stages or programs <= num_sms(cfg):
        return stages
    fixed = (held_rows * head_dim + dot_rows * block_k) * itemsize
    per_stage = 2 * block_k * head_dim * itemsize
    while stages > 1 and cfg.ctas_per_sm * (fixed + stages * per_stage) > cfg.shared_memory_per_sm:
        stages -= 1
    return stages


def cached_block_attention_supported(qkv_shape: tuple[int, ...], capacity: int, dtype,
                                     config: GpuConfig | None = None) -> bool:
    """Whether ``cached_block_attention`` runs for these shapes on this platform (GPUs, and the CPU
    in interpret mode; TPUs take the unfused path) with caches of ``dtype``."""
    platform = jax.default_backend()
    return platform != "tpu" and supports(tuple(qkv_shape), capacity, compiled=platform == "gpu",
                                          itemsize=jnp.dtype(dtype).itemsize, config=config)


def cached_block_attention(
    qkv: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    starts: jax.Array,
    blk_lens: jax.Array,
    q_norm: jax.Array,
    k_norm: jax.Array,
    inv_freq: jax.Array,
    *,
    eps: float,
    qk_norm: bool,
    causal: bool = True,
    write: bool = True,
    scale: float | None = None,
    row_scale: jax.Array | None = None,
    interpret: bool | None = None,
    config: GpuConfig | None = None,
    page_table: jax.Array | None = None,
    read_pages: int | None = None,
    write_rows: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A block per row over its KV cache, fused with what precedes it (forward only).

    Args:
      qkv: ``[rows, block, kv_heads, groups + 2, head_dim]`` the raw fused projection of the block
        (``layers.Attention.fuse`` layout: per KV head its query heads, its key, its value); rows
        past the caches' ``batch`` are padding, never read (a decode token padded to the rows of
        the kernel that wrote it, ``kernels_pallas.layer_tail``). Or ``[parts, rows, ...]``: the
        projection as float32 split-K partial products, which the kernel sums in order and rounds
        to the caches' dtype (a split-K GEMM without its reduction kernel).
      k_cache, v_cache: ``[batch, capacity, kv_heads, head_dim]``; with ``write``, donate them: they
        are updated in place.
      starts: ``[batch]`` int32, tokens already in the cache; the block sits at positions
        ``starts .. starts + block - 1`` and sees cache positions ``< starts`` plus itself
        (causally with ``causal``, else every valid slot: the drafter's bidirectional block).
      blk_lens: ``[batch]`` int32, valid slots of the block (later slots are not keys).
      q_norm, k_norm: ``[head_dim]`` per-head RMSNorm weights (ignored unless ``qk_norm``).
      inv_freq: ``[head_dim // 2]`` RoPE inverse frequencies.
      eps: the RMSNorm epsilon; qk_norm: whether q and k are normed (Qwen3) or not (Llama).
      write: write the block's K/V into the caches (the target's); False: the caches are only read
        (the drafter's, whose context K/V come from the target's hidden states instead).
      row_scale: ``[batch, block]`` float32 or None: each slot's projection (its value, or its
        partials' float32 sum) is multiplied by it before it is rounded to the caches' dtype: the
        row scale ``rsqrt(mean(x^2) + eps)`` of an RMSNorm whose weight is folded into the projection
        (``dflash_jax.runtime.serving_params``).
      interpret: Pallas interpret mode; default: off a GPU.
      config: tile sizes (``GpuConfig``; None: defaults).
      page_table: ``[batch, max_pages]`` int32, or None (contiguous caches). Given, the caches are
        one layer's page pools ``[pages, page_size, kv_heads, head_dim]`` and row ``b``'s position
        ``p`` is at ``pool[page_table[b, p // page_size], p % page_size]``: the kernel reads the
        context through the table, as the contiguous kernel reads a cache of ``read_pages *
        page_size`` positions (its capacity: the split plan's), tile for tile.
      read_pages: the static number of table entries covering every row's context (default: all).
      write_rows: with a page table and ``write``, ``[batch, block]`` int32: the pool row
        (``page * page_size + offset``) each slot's K/V go to (``ops.paged_cache.page_slots``: the
        row's page, or the null page for a row that must not write).

    Returns:
      ``out [batch, block, q_heads, head_dim]`` (as ``block_attention`` of the normed, RoPE'd
      q / k) and the caches, with ``write`` the block's K (normed, RoPE'd) and V written at
      ``starts`` (paged: at ``write_rows`` of the pools).
    """
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    return _cached_block_attention(
        qkv, k_cache, v_cache, starts, blk_lens, q_norm, k_norm, inv_freq, row_scale, page_table, write_rows,
        eps=float(eps), qk_norm=bool(qk_norm), causal=bool(causal), write=bool(write), scale=scale,
        interpret=bool(interpret), config=config or DEFAULT_CONFIG, read_pages=read_pages,
        signal=signals(interpret=interpret))


@functools.partial(jax.jit, static_argnames=("eps", "qk_norm", "causal", "write", "scale", "interpret", "config",
                                             "read_pages", "signal"))
def _cached_block_attention(qkv, k_cache, v_cache, starts, blk_lens, q_norm, k_norm, inv_freq, row_scale, page_table,
                            write_rows, *, eps: float, qk_norm: bool, causal: bool, write: bool, scale: float | None,
                            interpret: bool, config: GpuConfig, read_pages: int | None, signal: bool):
    """``cached_block_attention``, jitted: the layers' identical calls in a program share one trace and
    one lowering of the kernel (a call of one function, which XLA inlines: the same kernels run)."""
    cfg = config
    parts = qkv.shape[0] if qkv.ndim == 6 else 1
    if qkv.ndim == 6 and qkv.dtype != jnp.float32:
        raise ValueError(f"qkv partials [parts, rows, block, kv_heads, groups + 2, head_dim] must be float32, "
                         f"got {qkv.dtype}")
    dtype = k_cache.dtype if qkv.ndim == 6 else qkv.dtype
    rows, block, kv_heads, groups_2, head_dim = qkv.shape[-5:]
    groups = groups_2 - 2
    pool_shape = k_cache.shape
    if page_table is None:
        page_size = 0
        batch, capacity = k_cache.shape[:2]
        cache_shape = (batch, capacity, kv_heads, head_dim)
    else:
        page_size = k_cache.shape[1]
        batch, max_pages = page_table.shape
        read_pages = max_pages if read_pages is None else read_pages
        capacity = read_pages * page_size
        cache_shape = (k_cache.shape[0], page_size, kv_heads, head_dim)
        if page_table.dtype != jnp.int32 or not 0 < read_pages <= max_pages:
            raise ValueError(f"page_table must be int32 [batch, max_pages] with read_pages in 1..max_pages: "
                             f"{page_table.dtype} {page_table.shape}, read_pages {read_pages}")
        if write and (write_rows is None or write_rows.shape != (batch, block)):
            raise ValueError(f"a paged write needs write_rows [batch, block] = {(batch, block)}, got "
                             f"{None if write_rows is None else write_rows.shape}")
    if rows < batch:
        raise ValueError(f"qkv has {rows} rows for caches of batch {batch}")
    if k_cache.shape != cache_shape or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache/v_cache must be {cache_shape}: {k_cache.shape} {v_cache.shape}")
    if row_scale is not None and (row_scale.shape != (batch, block) or row_scale.dtype != jnp.float32):
        raise ValueError(f"row_scale must be float32 {(batch, block)}: {row_scale.dtype} {row_scale.shape}")
    layout = program_layout(batch, block, kv_heads, groups, head_dim, capacity, jnp.dtype(dtype).itemsize, cfg)
    if not tiles_supported(qkv.shape[-5:], capacity, compiled=not interpret) or (
            not interpret and layout.shared_bytes > cfg.shared_memory_per_program):
        raise ValueError(f"cached_block_attention does not take qkv {qkv.shape} with a cache of {capacity} "
                         f"positions (see cached_attention_gpu.supports)")
    scale = default_scale(head_dim, scale)
    cfg, block_k, splits, chunk = layout.config, layout.block_k, layout.splits, layout.chunk
    per_program, stacked, grid, stages = layout.per_program, layout.stacked, layout.grid, layout.stages
    starts = starts.astype(jnp.int32)
    blk_lens = jnp.clip(blk_lens.astype(jnp.int32), 0, block)

    out_dtype = dtype if splits == 1 else jnp.dtype(cfg.partial_dtype)
    if block == 1:  # [G, D] blocks: the squeezed slot and the whole group
        q_block, q_index = (None, None, None, groups, head_dim), lambda b, h, g, j: (b, 0, h, 0, 0)
        o_spec = pl.BlockSpec((None, None, None, None, groups, head_dim), lambda b, h, g, j: (b, j, 0, h, 0, 0))
        ml_spec = pl.BlockSpec((None, None, None, None, groups), lambda b, h, g, j: (b, j, 0, h, 0))
    else:  # [T, M, D] blocks: the M group members of program g
        q_block, q_index = (None, block, None, per_program, head_dim), lambda b, h, g, j: (b, 0, h, g, 0)
        o_spec = pl.BlockSpec((None, None, block, None, per_program, head_dim),
                              lambda b, h, g, j: (b, j, 0, h, g, 0))
        ml_spec = pl.BlockSpec((None, None, block, None, per_program), lambda b, h, g, j: (b, j, 0, h, g))
    per_row = pl.BlockSpec((None,), lambda b, h, g, j: (b,))
    whole = lambda n: pl.BlockSpec((n,), lambda b, h, g, j: (0,))  # noqa: E731
    if page_size:  # the pools as [pages * page_size] rows (a bitcast), read and written through the table
        k_cache, v_cache = (x.reshape((-1,) + x.shape[2:]) for x in (k_cache, v_cache))
        cache_spec = pl.BlockSpec((k_cache.shape[0], None, head_dim), lambda b, h, g, j: (0, h, 0))
        paging_args = [page_table] + ([write_rows.astype(jnp.int32)] if write else [])
        paging_specs = [pl.BlockSpec((None, max_pages), lambda b, h, g, j: (b, 0))] + (
            [pl.BlockSpec((None, block), lambda b, h, g, j: (b, 0))] if write else [])
    else:
        cache_spec = pl.BlockSpec((None, capacity, None, head_dim), lambda b, h, g, j: (b, 0, h, 0))
        paging_args, paging_specs = [], []
    member_block = (None, block, None, None, head_dim)  # the key or the value of the block

    def projection(block_shape, index_map, p: int) -> pl.BlockSpec:
        """A block of the projection (of its partial ``p``, behind the leading partials axis)."""
        if qkv.ndim == 5:
            return pl.BlockSpec(block_shape, index_map)
        return pl.BlockSpec((None,) + block_shape, lambda *ids: (p,) + index_map(*ids))

    member = lambda index: lambda b, h, g, j: (b, 0, h, index, 0)  # noqa: E731
    projection_specs = ([projection(q_block, q_index, p) for p in range(parts)]
                        + [projection(member_block, member(groups), p) for p in range(parts)]
                        + [projection(member_block, member(groups + 1), p) for p in range(parts)])
    kernel = functools.partial(_kernel, members=per_program, stacked=stacked,
                               parts=parts, scaled=row_scale is not None, dtype=dtype,
                               scale=scale, eps=eps, qk_norm=qk_norm, causal=causal, block_k=block_k,
                               chunk=chunk, balanced=bool(cfg.balanced_splits), page_size=page_size,
                               signal=signal)
    # RoPE's cos / sin at the block's positions, by XLA: the same for every layer of a step, so XLA
    # computes them once (CSE). Computed per program in the kernel (libdevice's full-range sin and
    # cos), they cost a verify block ~3.8 us per layer (docs/performance.md).
    positions = (starts[:, None] + jnp.arange(block, dtype=jnp.int32)).astype(jnp.float32)
    freqs = positions[..., None] * inv_freq.astype(jnp.float32)  # [B, T, D/2]
    rope = jnp.stack([jnp.cos(freqs), jnp.sin(freqs)], axis=1)  # [B, 2, T, D/2]
    rope_spec = pl.BlockSpec((None, 2, block, head_dim // 2), lambda b, h, g, j: (b, 0, 0, 0))
    scale_args, scale_specs = [], []
    if row_scale is not None:
        scale_args, scale_specs = [row_scale], [pl.BlockSpec((None, block), lambda b, h, g, j: (b, 0))]
    caches = [jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype)]
    cache_arg = 3 * parts + 5 + len(scale_args)  # k_cache's position among the inputs (v_cache's next)
    outs = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[per_row, per_row, *projection_specs, whole(head_dim), whole(head_dim), rope_spec, *scale_specs,
                  cache_spec, cache_spec, *paging_specs],
        out_specs=[o_spec, ml_spec, ml_spec] + ([cache_spec, cache_spec] if write else []),
        out_shape=[
            jax.ShapeDtypeStruct((batch, splits, block, kv_heads, groups, head_dim), out_dtype),
            jax.ShapeDtypeStruct((batch, splits, block, kv_heads, groups), jnp.float32),
            jax.ShapeDtypeStruct((batch, splits, block, kv_heads, groups), jnp.float32),
        ] + (caches if write else []),
        input_output_aliases={cache_arg: 3, cache_arg + 1: 4} if write else {},
        compiler_params=triton_params(cfg.num_warps, stages),
        interpret=interpret,
        name="dflash_cached_attention",
    )(starts, blk_lens, *[qkv] * (3 * parts), q_norm.astype(dtype), k_norm.astype(dtype), rope, *scale_args, k_cache,
      v_cache, *paging_args)
    o, m, l = outs[:3]
    if write:
        k_cache, v_cache = outs[3:]
    k_cache, v_cache = k_cache.reshape(pool_shape), v_cache.reshape(pool_shape)

    o = o[:, 0] if splits == 1 else merge_splits(o, m, l, axis=1)[0]
    return o.astype(dtype).reshape(batch, block, kv_heads * groups, head_dim), k_cache, v_cache
