"""The part of a decoder layer between two attentions as one persistent kernel (Pallas Mosaic GPU):
the output projection and its residual add, the post-attention RMSNorm, gate-up with the SwiGLU, the
down projection and its residual add, the next layer's input RMSNorm and its QKV projection. With
``EngineConfig(tail_layout="on")`` the engine's decode and verify steps run it on a GPU for blocks of
up to 16 rows (``dflash_jax/tail_layout.py``: the target's weights held once in its layout);
``layer_tail_reference`` is its math in jnp, the same layout, which runs for every other shape and
platform. In the engine it is not faster than the fused layout's kernels (docs/kernels.md).

Why: at batch 1 this stretch of a layer is nine kernels in the engine (four GEMMs, three split-K
reductions, two ``add_rms_norm``, the SwiGLU: ~107 us, docs/benchmarks.md). The persistent chain
(``bench/persistent_chain.py``) streams the same four matmuls with ready flags in 94-96 us, but without
the norms, the SwiGLU and the residual adds between them. Here they ride along:
- a residual add is the epilogue of the output and down projections' tiles (the residual tile is
  copied in while the tile's weights stream);
- an RMSNorm is folded: its weight into the next matmul's weight (``fold_norm``, at load), its
  ``rsqrt(mean(h^2) + eps)`` per row applied to the accumulator in the epilogue. The mean square
  comes from one more small WGMMA per step, ``x @ x^T`` over the x tiles the matmul streams anyway,
  whose diagonal is each row's sum of squares: no reduction of its own, no extra pass;
- the SwiGLU is the epilogue of a gate-up tile: its 32 gate and 32 up weight rows side by side
  (``interleave_gate_up``), two accumulators.
So every phase streams its x straight from the previous phase's output, as the chain does.

Numerics: the norm weight is rounded into the bf16 weight, and the row scale is applied after the
dot rather than before it; both move the result by bf16 rounding, like a change of GEMM
(``bench/bench_persistent_layer.py`` checks the kernel against a float32 reference of the layer).

The phases, with ``R`` rows (a decode token padded to 8): 0 ``h1 = h + a @ w_o``; 1 ``s =
swiglu(norm(h1) @ w_gu)``; 2 ``h2 = h1 + s @ w_d``; 3 ``qkv = norm(h2) @ w_qkv`` (left out for a
model's last layer). Weights are stored ``[N, K]`` (x is the WGMMA's left operand, rows padded to 64,
so tiles may be any multiple of 8 columns wide: 128 tiles for every phase but gate-up's 384). Program
``p`` takes tiles ``p, p + P, ...`` of each phase. A phase waits for the previous one through ready
counters per 2048 output columns (the chain's best): a program counts each tile it stores, a reader
waits before its first x copy of each group.

Measured on the H200 (docs/benchmarks.md, eighteenth session), GPU kernel time per layer: 100.7-101.0
us at one row against ~104.6-104.9 for the engine's nine kernels, 103.3 (6 stages) against ~108.6 at
16 rows; 6 to 9 stages within ~1.5 us of each other, flags per 1024 columns 2 us slower. No interpret
mode (it has neither global semaphores nor transposed WGMMA operands): off a GPU the reference stands
in (``kernels_pallas.layer_tail``), and ``bench/bench_persistent_layer.py`` checks the kernel against
a float32 reference of the model's math on the device.

With the next layer's caches the kernel runs a fifth phase, that layer's attention for a decode
token (``tail_attention_gpu``: its design, measurements and reference); the QKV phase then counts
its tiles into ready counters too.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas._mosaic_gpu import (SMEM_BUDGET, WGMMA_M, count_into_groups, fence_proxy_async, group_tiles,
                                        reset_ready_counters, swizzled)
from kernels_pallas.tail_attention_gpu import ATTN_KEYS, ATTN_SPLITS, META, attention_phase

O, GU, D, QKV = range(4)  # the phases
GATE_UP_TILE = 64  # weight rows of a gate-up tile: half gate, half the same units' up
ROW_MULTIPLE = 8  # the kernel takes rows in multiples of this (a decode token is padded to it)
MAX_ROWS = 16  # and at most this many (a verify block of 16)


@dataclasses.dataclass(frozen=True)
class LayerConfig:
    """Per phase (output, gate-up, down, QKV): ``tile_n`` weight rows per tile (gate-up: 32 gate and
    32 up) and ``tile_k`` K rows per weight tile (the ring's slot holds the largest product);
    ``stages`` tiles in flight; ``programs`` resident programs (one per SM); ``flag_cols`` output
    columns per ready counter."""

    tile_n: tuple[int, ...] = (32, 64, 32, 48)
    tile_k: tuple[int, ...] = (256, 128, 256, 128)
    stages: int = 8
    programs: int = 128
    flag_cols: int = 2048

    def out_cols(self, j: int) -> int:
        """Output columns per tile of phase ``j``."""
        return self.tile_n[j] // 2 if j == GU else self.tile_n[j]

    def slot(self) -> int:
        return max(n * k for n, k in zip(self.tile_n, self.tile_k))

    def smem_bytes(self, rows: int, phases: int) -> int:
        x_ring = (self.stages * rows + WGMMA_M - rows) * max(self.tile_k)
        out = WGMMA_M * max(self.out_cols(j) for j in range(phases))
        return (self.stages * self.slot() + x_ring + out + WGMMA_M * self.out_cols(O)) * 2


def interleave_gate_up(w_gate: jax.Array, w_up: jax.Array, tile: int = GATE_UP_TILE) -> jax.Array:
    """``w_gate, w_up [K, I]`` -> ``[2 I, K]``: per gate-up tile of ``tile`` rows, its ``tile / 2``
    gate rows then the same units' up rows."""
    k, i = w_gate.shape
    half = tile // 2
    pairs = jnp.stack([w_gate.T.reshape(i // half, half, k), w_up.T.reshape(i // half, half, k)], axis=1)
    return pairs.reshape(2 * i, k)


def fold_norm(norm_weight: jax.Array, w: jax.Array) -> jax.Array:
    """``w [K, N]`` with the RMSNorm weight ``[K]`` before it folded in (still ``[K, N]``)."""
    return (norm_weight.astype(jnp.float32)[:, None] * w.astype(jnp.float32)).astype(w.dtype)


def supports(rows: int, hidden: int, intermediate: int, qkv: int | None, config: LayerConfig, *,
             attention: int | None = None) -> bool:
    """Whether the kernel takes ``rows`` rows and these widths: ``attention`` the output projection's
    input (heads x head_dim; None: ``hidden``), ``qkv`` the next QKV's output (None: no next layer)."""
    c = config
    phases = 3 if qkv is None else 4
    outs = [hidden, intermediate, hidden, qkv or 0][:phases]
    ks = [attention or hidden, hidden, intermediate, hidden][:phases]
    return (rows % ROW_MULTIPLE == 0 and rows <= MAX_ROWS and c.out_cols(O) == c.out_cols(D) and c.tile_n[GU] == GATE_UP_TILE
            and all(n % c.out_cols(j) == 0 and n // c.out_cols(j) >= c.programs for j, n in enumerate(outs))
            and all(k % c.tile_k[j] == 0 and c.flag_cols % c.tile_k[j] == 0 and c.slot() % c.tile_k[j] == 0
                    for j, k in enumerate(ks))
            and all(n % c.flag_cols == 0 for n in outs[:phases - 1])
            and sum(n // c.flag_cols for n in outs[:phases - 1]) <= c.programs <= 132
            and c.smem_bytes(rows, phases) <= SMEM_BUDGET)


# The ring depths measured fastest (docs/benchmarks.md, eighteenth session): 8 stages at one row
# (padded to 8), 6 for a verify block of 16 rows, where 8 do not fit in shared memory.
MEASURED_STAGES = (8, 6)


def config_for(rows: int, hidden: int, intermediate: int, qkv: int | None, *,
               attention: int | None = None) -> LayerConfig | None:
    """The fastest measured configuration that takes these shapes (None: none does)."""
    for stages in MEASURED_STAGES:
        config = LayerConfig(stages=stages)
        if supports(rows, hidden, intermediate, qkv, config, attention=attention):
            return config
    return None


def attention_supported(rows: int, qkv: int, kv_heads: int, groups: int, head_dim: int, capacity: int,
                        config: LayerConfig) -> bool:
    """Whether the kernel can also run the next layer's attention (``layer_tail``'s ``k_cache``...):
    a decode token (8 rows, all copies of it), 128-wide heads in ring slots of ``[64, 128]``, whole
    tiles of cache keys, enough programs."""
    return (rows == ROW_MULTIPLE and head_dim == 128 and qkv == kv_heads * (groups + 2) * head_dim
            and ROW_MULTIPLE % groups == 0 and capacity % ATTN_KEYS == 0 and kv_heads * ATTN_SPLITS <= config.programs
            and 128 in config.tile_k and config.slot() == ATTN_KEYS * head_dim
            and config.stages // 2 >= ATTN_SPLITS - 1  # the other splits' float32 partials, in the ring
            and (config.stages * rows + WGMMA_M - rows) * max(config.tile_k) >= 3 * WGMMA_M * head_dim)


def layer_tail(a: jax.Array, h: jax.Array, w_o: jax.Array, w_gu: jax.Array, w_d: jax.Array,
               w_qkv: jax.Array | None, k_cache: jax.Array | None = None, v_cache: jax.Array | None = None,
               meta: jax.Array | None = None, norm_tables: jax.Array | None = None,
               rope_table: jax.Array | None = None, *, eps: float, groups: int = 0, scale: float = 0.0,
               config: LayerConfig = LayerConfig(), profile_dir: str | None = None,
               profile_ranges: int = 0, approx_math: bool = False) -> list[jax.Array]:
    """``a [R, >= A]`` (the attention's output in its first ``A`` columns), ``h [R, H]`` (the
    residual), weights ``[N, K]``: ``w_o [H, A]``, ``w_gu [2 I, H]`` (``interleave_gate_up`` of the
    norm-folded gate and up), ``w_d [H, I]``, ``w_qkv [Q, H]`` (norm-folded; None: no next layer)
    -> ``h1 [R, H]``, ``s [R, I]``, ``h2 [R, H]`` and ``qkv [R, Q]`` (if ``w_qkv``).

    With ``k_cache`` (a decode token, its 8 rows all copies of it), a fifth phase runs the next
    layer's attention on that ``qkv`` (``attention_supported``): ``k_cache, v_cache [capacity,
    kv_heads, 128]`` are read at positions ``< meta[0]`` (the token's position; ``meta [META]``
    int32), ``norm_tables [2, 64, 128]`` hold the q and k RMSNorm weights and ``rope_table [64, 128]``
    the token's cos | sin (every row the same), ``groups`` query heads per KV head, ``scale`` the
    softmax scale, ``eps`` also the q / k norms'. It adds ``attn [R, kv_heads * groups * 128]`` (the
    next layer's ``a``), ``k_new, v_new [R, kv_heads * 128]`` (the token's normed, RoPE'd key and its
    value, for the caller to write at ``meta[0]``) and two float32 scratch outputs of the split merge.

    ``profile_dir``: Mosaic GPU's in-kernel profile of up to ``profile_ranges`` named ranges per
    program (``m0``-``m3``, ``wait``, ``attention`` and its steps), for bench/ diagnostics;
    ``approx_math``: Mosaic GPU's approximate exp, rsqrt and division (a bench/ variant)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    c = config
    weights = [w_o, w_gu, w_d] + ([] if w_qkv is None else [w_qkv])
    phases = len(weights)
    rows, hidden = h.shape
    intermediate = w_d.shape[1]
    if not supports(rows, hidden, intermediate, None if w_qkv is None else w_qkv.shape[0], c,
                    attention=w_o.shape[1]):
        raise ValueError(f"layer_tail: rows {rows}, weights {[w.shape for w in weights]} not supported by {c}")
    attend = k_cache is not None
    if attend:
        capacity, kv_heads, head_dim = k_cache.shape
        if w_qkv is None or not attention_supported(rows, w_qkv.shape[0], kv_heads, groups, head_dim, capacity, c):
            raise ValueError(f"layer_tail: no attention phase for rows {rows}, caches {k_cache.shape}, {c}")
        per_head = (groups + 2) * head_dim  # a KV head's columns of the fused QKV: its queries, key, value
    outs = [w.shape[0] // (2 if j == GU else 1) for j, w in enumerate(weights)]
    ks = [w.shape[1] for w in weights]
    programs = c.programs
    tiles = [n // c.out_cols(j) for j, n in enumerate(outs)]
    k_steps = [k // c.tile_k[j] for j, k in enumerate(ks)]
    waves = [-(-t // programs) for t in tiles]
    read_phases = phases if attend else phases - 1  # phases whose output a later phase reads here
    groups_per = [n // c.flag_cols for n in outs[:read_phases]]
    base = [sum(groups_per[:j]) for j in range(read_phases)]
    bks = sorted(set(c.tile_k))
    views = {bk: i for i, bk in enumerate(bks)}

    def body(a_gmem, h_gmem, *refs):
        w_gmem = refs[:phases]
        extra = 5 if attend else 0
        k_gmem, v_gmem, meta_gmem, norm_gmem, rope_gmem = refs[phases:phases + extra] if attend else (None,) * 5
        refs = refs[phases + extra:]
        y_gmem = refs[:phases]
        if attend:
            attn_gmem, k_new_gmem, v_new_gmem, o_part_gmem, ml_part_gmem = refs[phases:phases + 5]
            refs = refs[phases + 5:]
        else:
            refs = refs[phases:]
        w_smem, x_smem, out_smem, res_smem, w_ready, x_ready, res_ready = refs[:7]
        w_rings = [w_smem[views[c.tile_k[j]]] for j in range(phases)]
        x_rings = [x_smem[views[c.tile_k[j]]] for j in range(phases)]
        out_tiles = [out_smem[j] for j in range(phases)]
        x_src = [a_gmem] + list(y_gmem[:phases - 1])
        p = lax.axis_index("p")
        ready = pl.get_global(plgpu.SemaphoreType.REGULAR((sum(groups_per),)))
        exited = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
        drained = pl.get_global(plgpu.SemaphoreType.REGULAR(()))
        mine = [jnp.maximum(0, (t - p + programs - 1) // programs) for t in tiles]
        start = [0]
        for j in range(phases):
            start.append(start[-1] + mine[j] * k_steps[j])
        pre_steps = start[-1]  # the matmul phases' steps: known before the kernel reads anything
        attn = {}  # the attention phase's schedule, known once the kernel has read the token's position
        if attend:
            meta_smem, ml_smem, ml_in, own_ready, meta_ready, part_ready = refs[7:]
            kv_rings = w_smem[views[128]]  # [stages, 64, 128]: a slot holds a key tile
            part_rings = w_smem[len(bks)]  # [stages // 2, 64, 128] float32: the merge's partials
            own_smem = x_smem[len(bks)]  # [3, 64, 128]: the token's q, k, v heads (the x ring is idle by then)
            head, split = p // ATTN_SPLITS, p % ATTN_SPLITS
            attending = p < kv_heads * ATTN_SPLITS
            arrived = pl.get_global(plgpu.SemaphoreType.REGULAR((kv_heads,)))

        def fetch_weights(step, with_attention: bool = True):
            slot = step % c.stages
            for j in range(phases):
                @pl.when((start[j] <= step) & (step < start[j + 1]))
                def _(j=j):
                    i, kk = (step - start[j]) // k_steps[j], (step - start[j]) % k_steps[j]
                    cols = pl.ds((p + i * programs) * c.tile_n[j], c.tile_n[j])
                    plgpu.copy_gmem_to_smem(w_gmem[j].at[cols, pl.ds(kk * c.tile_k[j], c.tile_k[j])],
                                            w_rings[j].at[slot, pl.ds(0, c.tile_n[j])], w_ready.at[slot])
            if attend and with_attention:
                @pl.when((attn["first_step"] <= step) & (step < attn["steps"]))
                def _():
                    i = step - attn["first_step"]
                    pl.when(i < 2)(lambda: plgpu.copy_gmem_to_smem(norm_gmem.at[jnp.minimum(i, 1)], kv_rings.at[slot],
                                                                   w_ready.at[slot]))
                    pl.when(i == 2)(lambda: plgpu.copy_gmem_to_smem(rope_gmem, kv_rings.at[slot], w_ready.at[slot]))
                    t, is_v = (i - 3) // 2, (i - 3) % 2
                    keys = pl.ds((attn["first_tile"] + t) * ATTN_KEYS, ATTN_KEYS)
                    pl.when((i >= 3) & (is_v == 0))(lambda: plgpu.copy_gmem_to_smem(
                        k_gmem.at[keys, head], kv_rings.at[slot], w_ready.at[slot]))
                    pl.when((i >= 3) & (is_v == 1))(lambda: plgpu.copy_gmem_to_smem(
                        v_gmem.at[keys, head], kv_rings.at[slot], w_ready.at[slot]))

        def tiles_in_group(j: int, g):
            return group_tiles(c.flag_cols, c.out_cols(j), g)

        def await_group(j: int, g):
            """Waits until phase ``j`` has stored its column group ``g``."""
            with jax.named_scope("wait"):
                plgpu.semaphore_wait(ready.at[base[j] + g], tiles_in_group(j, g), decrement=False,
                                     memory_scope="gpu")
                fence_proxy_async()

        def fetch_x(step, j: int):
            first = start[j]
            slot, kk = step % c.stages, (step - first) % k_steps[j]
            if j > 0:
                first_read = (step - first < k_steps[j]) & ((kk * c.tile_k[j]) % c.flag_cols == 0)
                pl.when(first_read)(lambda: await_group(j - 1, (kk * c.tile_k[j]) // c.flag_cols))
            plgpu.copy_gmem_to_smem(x_src[j].at[:, pl.ds(kk * c.tile_k[j], c.tile_k[j])],
                                    x_rings[j].at[pl.ds(slot * rows, rows)], x_ready.at[slot])

        for step in range(c.stages - 1):
            pl.when(step < pre_steps)(lambda step=step: fetch_weights(step, with_attention=False))
        # Nothing above reads what the kernel before wrote: launched early (programmatic dependent
        # launch, which JAX asks for when a kernel waits), the weight ring fills while that kernel
        # finishes, and the wait holds every read of the attention output and the residual.
        plgpu.griddepcontrol_wait()
        if attend:
            plgpu.copy_gmem_to_smem(meta_gmem, meta_smem, meta_ready.at[0])

        def schedule_attention():
            """The attention's steps (two norm tables, the RoPE table, then each of its key tiles' K
            and V) join the ring after the matmuls', so that they stream in behind QKV's."""
            plgpu.barrier_wait(meta_ready.at[0])
            position = meta_smem[0]
            context_tiles = (position + ATTN_KEYS - 1) // ATTN_KEYS
            per_split = (context_tiles + ATTN_SPLITS - 1) // ATTN_SPLITS
            first_tile = split * per_split
            my_tiles = jnp.where(attending, jnp.clip(context_tiles - first_tile, 0, per_split), 0)
            attn.update(position=position, first_tile=first_tile, my_tiles=my_tiles, first_step=pre_steps,
                        steps=pre_steps + jnp.where(attending, 3 + 2 * my_tiles, 0))

        def run_phase(j: int):
            if attend and j == QKV:
                schedule_attention()
            steps = attn["steps"] if attn else pre_steps
            first, end = start[j], start[j + 1]
            for q in range(c.stages - 1):
                pl.when(first + q < end)(lambda q=q: fetch_x(first + q, j))
            normed = j in (GU, QKV)
            accs = ([plgpu.ACC((WGMMA_M, c.out_cols(j)))] * (2 if j == GU else 1)
                    + ([plgpu.ACC((WGMMA_M, rows))] if normed else []))
            for i in range(waves[j]):
                @pl.when(i < mine[j])
                def _(i=i):
                    t = p + i * programs
                    out_cols = pl.ds(t * c.out_cols(j), c.out_cols(j))
                    if j in (O, D):  # the residual tile, copied in while the weights stream
                        residual = h_gmem if j == O else y_gmem[O]
                        plgpu.copy_gmem_to_smem(residual.at[:, out_cols], res_smem.at[pl.ds(0, rows)],
                                                res_ready.at[0])

                    def accumulate(*acc_refs):
                        def k_step(kk, carry):
                            step = first + i * k_steps[j] + kk
                            slot = step % c.stages
                            plgpu.barrier_wait(x_ready.at[slot])
                            plgpu.barrier_wait(w_ready.at[slot])
                            x_tile = x_rings[j].at[pl.ds(slot * rows, WGMMA_M)]
                            w_slot = w_rings[j].at[slot]
                            if j == GU:
                                half = c.out_cols(GU)
                                plgpu.wgmma(acc_refs[0], x_tile, plgpu.transpose_ref(w_slot.at[pl.ds(0, half)], (1, 0)))
                                plgpu.wgmma(acc_refs[1], x_tile, plgpu.transpose_ref(w_slot.at[pl.ds(half, half)], (1, 0)))
                            else:
                                plgpu.wgmma(acc_refs[0], x_tile,
                                            plgpu.transpose_ref(w_slot.at[pl.ds(0, c.tile_n[j])], (1, 0)))
                            if normed:  # the diagonal of x x^T: each row's sum of squares
                                plgpu.wgmma(acc_refs[-1], x_tile,
                                            plgpu.transpose_ref(x_rings[j].at[pl.ds(slot * rows, rows)], (1, 0)))
                            plgpu.wgmma_wait(len(acc_refs))  # the previous step's are done: its slot is free
                            pl.when(step + c.stages - 1 < steps)(
                                lambda: fetch_weights(step + c.stages - 1, with_attention=bool(attn)))
                            pl.when(step + c.stages - 1 < end)(lambda: fetch_x(step + c.stages - 1, j))
                            return carry

                        lax.fori_loop(0, k_steps[j], k_step, None)
                        plgpu.wgmma_wait(0)
                        return tuple(ref[...] for ref in acc_refs)

                    accs_out = pl.run_scoped(accumulate, *accs)
                    if normed:
                        sq = accs_out[-1]
                        diag = (plgpu.broadcasted_iota(jnp.int32, sq.shape, 0, layout=plgpu.Layout.WGMMA)
                                == plgpu.broadcasted_iota(jnp.int32, sq.shape, 1, layout=plgpu.Layout.WGMMA))
                        mean_sq = jnp.sum(jnp.where(diag, sq, 0.0), axis=1) * (1.0 / ks[j])
                        # (a [64] row vector broadcasts by broadcast_in_dim, not by a new axis, in Mosaic GPU)
                        row_scale = lax.broadcast_in_dim(lax.rsqrt(mean_sq + eps), accs_out[0].shape, (0,))
                    if j in (O, D):
                        plgpu.barrier_wait(res_ready.at[0])
                        res = plgpu.load(res_smem, (), layout=plgpu.Layout.WGMMA).astype(jnp.float32)
                        y = res + accs_out[0].astype(h.dtype).astype(jnp.float32)
                    elif j == GU:
                        gate = (accs_out[0] * row_scale).astype(h.dtype).astype(jnp.float32)
                        up = (accs_out[1] * row_scale).astype(h.dtype).astype(jnp.float32)
                        silu = (gate / (1.0 + jnp.exp(-gate))).astype(h.dtype).astype(jnp.float32)
                        y = silu * up
                    else:
                        y = accs_out[0] * row_scale
                    out_tiles[j][...] = y.astype(h.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_tiles[j].at[pl.ds(0, rows)], y_gmem[j].at[:, out_cols])
                    plgpu.wait_smem_to_gmem(0)
                    if j < read_phases:
                        fence_proxy_async()
                        count_into_groups(ready, base[j], c.flag_cols, c.out_cols(j), t)

        def run_attention():
            attention_phase(
                c, rows=rows, dtype=h.dtype, groups=groups, per_head=per_head, scale=scale,
                eps=eps, head=head, split=split, first_tile=attn["first_tile"], my_tiles=attn["my_tiles"],
                position=attn["position"], first_step=attn["first_step"], steps=attn["steps"], arrived=arrived,
                fetch_weights=fetch_weights, w_ready=w_ready,
                kv_rings=kv_rings, part_rings=part_rings, own_smem=own_smem, own_ready=own_ready, ml_smem=ml_smem,
                ml_in=ml_in, part_ready=part_ready, qkv_gmem=y_gmem[QKV], attn_gmem=attn_gmem,
                k_new_gmem=k_new_gmem, v_new_gmem=v_new_gmem, o_part_gmem=o_part_gmem, ml_part_gmem=ml_part_gmem,
                await_qkv=lambda g: await_group(QKV, g))

        for j in range(phases):
            with jax.named_scope(f"m{j}"):
                run_phase(j)
        if attend:
            with jax.named_scope("attention"):
                pl.when(attending)(run_attention)
        reset_ready_counters(ready, exited, drained, p, programs,
                             [tiles_in_group(j, g) for j in range(read_phases) for g in range(groups_per[j])])

    def ring(shape, minor, dtype=h.dtype):
        return plgpu.SMEM(shape, dtype, transforms=swizzled(minor, jnp.dtype(dtype).itemsize))

    w_views = [ring((c.stages, c.slot() // bk, bk), bk) for bk in bks]
    x_views = [ring((c.stages * rows + WGMMA_M - rows, bk), bk) for bk in bks]
    if attend:
        w_views.append(ring((c.stages // 2, WGMMA_M, head_dim), head_dim, jnp.float32))
        x_views.append(ring((3, WGMMA_M, head_dim), head_dim))  # the token's q, k, v heads, rows repeated
    scratch = [plgpu.RefUnion(*w_views),
               plgpu.RefUnion(*x_views),
               plgpu.RefUnion(*(ring((WGMMA_M, c.out_cols(j)), c.out_cols(j)) for j in range(phases))),
               ring((WGMMA_M, c.out_cols(O)), c.out_cols(O)),
               plgpu.Barrier(num_arrivals=1, num_barriers=c.stages),
               plgpu.Barrier(num_arrivals=1, num_barriers=c.stages),
               plgpu.Barrier(num_arrivals=1, num_barriers=1)]
    out_types = [jax.ShapeDtypeStruct((rows, n), h.dtype) for n in outs]
    inputs = [a, h, *weights]
    if attend:
        scratch += [plgpu.SMEM((META,), jnp.int32),
                    plgpu.SMEM((2, WGMMA_M), jnp.float32),
                    plgpu.SMEM((ATTN_SPLITS - 1, 2, WGMMA_M), jnp.float32),
                    plgpu.Barrier(num_arrivals=ROW_MULTIPLE, num_barriers=3),
                    plgpu.Barrier(num_arrivals=1, num_barriers=1),
                    plgpu.Barrier(num_arrivals=2 * (ATTN_SPLITS - 1), num_barriers=1)]
        out_types += [jax.ShapeDtypeStruct((rows, kv_heads * groups * head_dim), h.dtype),
                      jax.ShapeDtypeStruct((rows, kv_heads * head_dim), h.dtype),
                      jax.ShapeDtypeStruct((rows, kv_heads * head_dim), h.dtype),
                      jax.ShapeDtypeStruct((ATTN_SPLITS, kv_heads, WGMMA_M, head_dim), jnp.float32),
                      jax.ShapeDtypeStruct((ATTN_SPLITS, kv_heads, 2, WGMMA_M), jnp.float32)]
        inputs += [k_cache, v_cache, meta, norm_tables, rope_table]
    params = plgpu.CompilerParams(profile_space=profile_ranges, profile_dir=profile_dir or "", approx_math=approx_math)
    kernel = plgpu.kernel(body, out_type=out_types, scratch_types=tuple(scratch), grid=(programs,), grid_names=("p",),
                          compiler_params=params)
    return list(kernel(*inputs))


def _dot_nk(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [R, K] @ w [N, K]^T`` with a float32 result."""
    return lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def normed_matmul(x: jax.Array, w: jax.Array, *, eps: float) -> jax.Array:
    """``rms_norm(x) @ w^T`` as the kernel computes it for a norm folded into ``w [N, K]``: the dot
    of the raw rows ``x [R, K]``, scaled per row by ``rsqrt(mean(x^2) + eps)`` -> float32 ``[R, N]``."""
    xf = x.astype(jnp.float32)
    return lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps) * _dot_nk(x, w)


def layer_tail_reference(a: jax.Array, h: jax.Array, w_o: jax.Array, w_gu: jax.Array, w_d: jax.Array,
                         w_qkv: jax.Array | None, *, eps: float) -> list[jax.Array]:
    """``layer_tail``'s math in jnp, the same arguments, layout and roundings (the products rounded
    to ``h``'s dtype where the kernel stores or rounds them), for any number of rows.

    Each dot's float32 result is rounded (or scaled, then rounded) at once, before any reshape: an
    order meant to let XLA round in its GEMM's epilogue rather than write and read the float32
    gate-up product (25 MB per layer at 256 rows). On the H200 it did not change a 256-row verify
    pass's time (docs/benchmarks.md, nineteenth session)."""
    rows = h.shape[0]
    f32 = lambda v: v.astype(jnp.float32)  # noqa: E731
    h1 = (f32(h) + f32(_dot_nk(a[:, :w_o.shape[1]], w_o).astype(h.dtype))).astype(h.dtype)
    half = GATE_UP_TILE // 2
    gate_up = normed_matmul(h1, w_gu, eps=eps).astype(h.dtype).reshape(rows, -1, 2, half)
    gate, up = f32(gate_up[:, :, 0].reshape(rows, -1)), f32(gate_up[:, :, 1].reshape(rows, -1))
    s = (f32((gate / (1.0 + jnp.exp(-gate))).astype(h.dtype)) * up).astype(h.dtype)
    h2 = (f32(h1) + f32(_dot_nk(s, w_d).astype(h.dtype))).astype(h.dtype)
    if w_qkv is None:
        return [h1, s, h2]
    return [h1, s, h2, normed_matmul(h2, w_qkv, eps=eps).astype(h.dtype)]
