"""The next matmul's weight pulled into L2 by a kernel of its own that runs beside the short kernels
before that matmul (a prototype for ``sweep_decode_options.py``'s ``l2:`` variants).

At batch 1 HBM idles while a layer's short kernels run (the attention and its merge before the
output projection, a norm before gate-up and before QKV, the SwiGLU before down: ~15 us per layer,
docs/benchmarks.md). The fourteenth session pulled the next weight into L2 from spare programs of
those kernels: the matmuls found their first tiles in L2 (-2.1 us output, -1.8 us QKV), but the
kernels that fetched them ended later by as much. Here the fetch is an XLA reduction of its own
that depends on nothing but the value the short kernels start from, so that it can run *beside*
them; whether it does depends on how XLA puts the decode step into its CUDA graph:

- ``mode="concurrent"``: ``xla_gpu_command_buffer_scheduling_mode=CONCURRENT``, where the graph's
  edges come from data flow (the engine's decode loop since the twenty-second session; XLA's
  default, ``LHS``, chains independent kernels one after another);
- ``mode="stream"``: each fetch under ``compute_on("gpu_stream:1")``, an async call on a second
  stream (``xla_gpu_experimental_stream_annotation``), in an ``LHS`` graph;
- ``mode="serial"``: neither (``LHS``), the fetch in line: what it costs on the critical path.

A fetch reads the first rows of each K segment of the weight (XLA's split-K GEMM starts every split
at its segment; gate-up is not split) and returns a float32 zero made from what it read, which the
layer adds to a value well after that matmul (QKV's to the output projection's, the others' to the
MLP's), so that XLA keeps the fetch, nothing on the way waits for it, and every output is unchanged. Its slice
starts at a row computed from the value it waits for (0 in practice), so that XLA cannot hoist it
out of the decode loop as loop-invariant.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from dflash_jax import layers

# XLA's split-K of each one-row projection of the 8B shapes (docs/benchmarks.md, twenty-first session).
SEGMENTS = {"qkv": 4, "o": 8, "gate_up": 1, "down": 8}
MODES = {"concurrent": {"xla_gpu_command_buffer_scheduling_mode": "CONCURRENT"},
         "stream": {"xla_gpu_experimental_stream_annotation": True,
                    "xla_gpu_command_buffer_scheduling_mode": "LHS"},
         "serial": {"xla_gpu_command_buffer_scheduling_mode": "LHS"}}


def fetch_zero(w: jax.Array, after: jax.Array, *, segments: int, mb: float, in_dims: int = 1) -> jax.Array:
    """A float32 scalar zero that reads ``mb`` MB of ``w [*in, *out]`` (``in``: its first
    ``in_dims`` dimensions, K in all; the first rows of each of its ``segments`` K segments) once
    ``after`` (any array) is ready."""
    k = math.prod(w.shape[:in_dims])
    w2 = w.reshape(segments, k // segments, math.prod(w.shape[in_dims:]))
    rows = max(1, min(k // segments - 1, int(mb * 2**20 / (segments * w2.shape[-1] * w2.dtype.itemsize))))
    # The barrier keeps XLA from recomputing that element inside the fetch from the producer's own
    # inputs (a split-K GEMM's partials), which would start the fetch early, beside that reduction.
    first = jax.lax.optimization_barrier(after).reshape(-1)[0].astype(jnp.float32)
    start = (jax.lax.bitcast_convert_type(first, jnp.int32) == 0x7FC00001).astype(jnp.int32)  # 0 (a NaN payload: 1)
    zero = jnp.int32(0)
    block = jax.lax.dynamic_slice(w2, (zero, start, zero), (segments, rows, w2.shape[-1]))
    bits = jax.lax.bitcast_convert_type(block, jnp.int16) if block.dtype.itemsize == 2 else block
    return jnp.max(bits).astype(jnp.float32) * 0.0


def prefetching_cached(mb: dict[str, float], mode: str):
    """``DecoderLayer.cached`` (the fused layout, no biases) with the weights named in ``mb``
    (``qkv``, ``o``, ``gate_up``, ``down``: MB each) fetched into L2 while the kernels before their
    matmuls run."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")

    def fetch(name, w, after):
        if not mb.get(name):
            return None
        f = jax.jit(lambda w, a: fetch_zero(w, a, segments=SEGMENTS[name], mb=mb[name], in_dims=2 if name == "o" else 1))
        if mode == "stream":  # JAX 0.10's compute_on2 is 0.11's compute_on
            from jax._src import compute_on as stream_api

            wrap = getattr(stream_api, "compute_on2", None) or stream_api.compute_on
            return wrap(f, compute_type="gpu_stream:1", out_memory_spaces=jax.memory.Space.Device)(w, after)
        return f(w, after)

    def plus(y, zero):
        return y if zero is None else y + zero.astype(y.dtype)

    def cached(self, h, delta, starts, k_cache, v_cache, blk_lens, *, attention_impl="xla", causal=True, write=True):
        attn, mlp = self.self_attn, self.mlp
        if attn.qkv_proj is None or mlp.gate_up_proj is None or attn.o_bias is not None or mlp.gate_up_bias is not None:
            raise ValueError("prefetching_cached takes the fused layout without biases")
        fused = attention_impl == "pallas"
        zero_qkv = fetch("qkv", attn.qkv_proj[...], h if delta is None else delta)  # beside the input norm
        h, x = layers.add_rms_norm(h, delta, self.input_layernorm, fused=fused)
        qkv = attn._qkv(x[:, 0])
        zero_o = fetch("o", attn.o_proj[...], qkv)  # beside the attention and its merge
        out, k_cache, v_cache = attn.attend_cached_qkv(qkv, starts, k_cache, v_cache, blk_lens, impl=attention_impl,
                                                       causal=causal, write=write)
        y = plus(attn.output(out), zero_qkv)
        zero_gate_up = fetch("gate_up", mlp.gate_up_proj[...], y)  # beside the post-attention norm
        h, x = layers.add_rms_norm(h, y, self.post_attention_layernorm, fused=fused)
        gu = layers.dense(x, mlp.gate_up_proj)
        zero_down = fetch("down", mlp.down_proj[...], gu)  # beside the SwiGLU
        mlp_out = layers.dense(jax.nn.silu(gu[..., 0]) * gu[..., 1], mlp.down_proj)
        for zero in (zero_o, zero_gate_up, zero_down):
            mlp_out = plus(mlp_out, zero)
        return h, mlp_out, k_cache, v_cache

    return cached
