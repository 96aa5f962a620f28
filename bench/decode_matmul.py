"""The candidate decode matmul of ``bench_matvec.py``: a weight-streaming matmul with what XLA runs
around it as separate kernels folded in. Measured against XLA on the H200; NOT used by the engine,
because it lost there (docs/benchmarks.md, fifth session): per matmul it streams 5-20% slower than
XLA's split-K GEMMs at one row, and with 16 rows its norm prologue makes it 1.8x slower, so the
folded-in kernels (~10 us per layer) do not pay for it (engine: 4.64 vs 4.51 ms per batch-1 step).

What it does, for whoever takes it further:

- prologue ``delta`` + ``norm``: the rows entering the matmul are ``rms_norm(x + delta) * norm``
  (a decoder layer's deferred residual add and its norm), the sum ``x + delta`` a second output;
- epilogue ``swiglu``: the weight's columns are (gate, up) pairs (``layers.MLP.fuse``), the output
  ``silu(gate) * up``, half as wide (a ``tt.split`` of the accumulator);
- no split-K: each program owns ``block_n`` whole columns and streams its slice of the weight
  through Triton's software pipeline, so nothing is left to reduce;
- the norm in factored form: the program streams ``x * norm`` and scales its accumulator by the
  row's ``rsqrt(mean(x^2) + eps)`` at the end (one rounding fewer than ``layers.rms_norm``);
- one row is repeated in registers to the 16 rows ``tl.dot`` takes; otherwise multiples of 16.
- ``w_nk``: the weight as ``[N, K]`` (each output's weights contiguous): no faster on the H200.

The reference is ``decode_matmul_reference``; the benchmark checks every timed variant against it.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kernels_pallas._common import next_pow2
from kernels_pallas._flash import MMA_MIN, triton_params

MAX_ROWS = 64  # rows beyond this re-read the weights per row tile: XLA's GEMMs do that better


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """Tiles. ``block_n`` 0: the wider of 64 / 32 that still gives ``min_programs`` programs (the
    best of each Qwen3-8B shape swept on an H200: 64 columns for QKV and gate-up, 32 for the output
    and down projections; 128 columns of 256 rows over 4 stages overflow its shared memory).
    ``max_rows``: the most rows the compiled kernel takes."""

    block_n: int = 0
    block_k: int = 256
    min_programs: int = 96
    max_rows: int = 64
    num_warps: int = 4
    num_stages: int = 4


DEFAULT_CONFIG = MatmulConfig()


def plan(k: int, n: int, config: MatmulConfig) -> tuple[int, int]:
    """``(block_k, block_n)`` for a ``[K, N]`` weight."""
    block_k = min(config.block_k, k)
    if config.block_n:
        return block_k, min(config.block_n, n)
    for block_n in (64, 32):
        if n // block_n >= config.min_programs:
            return block_k, block_n
    return block_k, min(32, n)


def supports(rows: int, k: int, n: int, *, swiglu: bool = False, compiled: bool = True,
             config: MatmulConfig | None = None) -> bool:
    """Whether the kernel takes ``[rows, K] @ [K, N]``: whole tiles, and compiled for a GPU the
    row counts ``tl.dot`` takes (1, repeated in registers, or a multiple of 16 up to 64) and
    power-of-two tiles of at least 16 (32 columns with ``swiglu``, whose output is half as wide)."""
    block_k, block_n = plan(k, n, config or DEFAULT_CONFIG)
    if rows < 1 or k % block_k or n % block_n or (swiglu and block_n % 2):
        return False
    if not compiled:
        return True
    pow2 = lambda x: next_pow2(x) == x  # noqa: E731
    max_rows = min(MAX_ROWS, (config or DEFAULT_CONFIG).max_rows)
    rows_ok = rows == 1 or (rows % MMA_MIN == 0 and rows <= max_rows and pow2(rows))
    return (rows_ok and pow2(block_k) and pow2(block_n) and block_k >= MMA_MIN
            and block_n >= (2 * MMA_MIN if swiglu else MMA_MIN))


def _swiglu(y: jax.Array, dtype) -> jax.Array:
    """``y [rows, 2 * units]`` float32, columns (gate, up) per unit -> ``silu(gate) * up`` in
    ``dtype``, rounded as ``layers.MLP`` rounds: the projection, then the SiLU, then the product."""
    rows, cols = y.shape
    y = y.astype(dtype).astype(jnp.float32)
    gate, up = jnp.unstack(y.reshape(rows, cols // 2, 2), axis=-1)
    silu = (gate / (1.0 + jnp.exp(-gate))).astype(dtype).astype(jnp.float32)
    return (silu * up).astype(dtype)


def _kernel(*refs, has_delta: bool, has_norm: bool, swiglu: bool, eps: float, block_k: int, w_nk: bool):
    """One program per ``block_n`` columns. refs: x ``[M, K]``, (delta ``[M, K]``), (norm ``[K]``),
    w ``[K, block_n]`` (strided view), out ``[M, block_n]`` (``block_n / 2`` with swiglu),
    (sum ``[M, K]``, written by program 0)."""
    refs = list(refs)
    x_ref = refs.pop(0)
    d_ref = refs.pop(0) if has_delta else None
    n_ref = refs.pop(0) if has_norm else None
    w_ref, o_ref = refs.pop(0), refs.pop(0)
    s_ref = refs.pop(0) if has_delta else None
    first = pl.program_id(0) == 0
    rows, k = x_ref.shape
    dot_rows = MMA_MIN if rows == 1 else rows

    def body(i, carry):
        acc, sumsq = carry
        ks = pl.ds(pl.multiple_of(i * block_k, block_k), block_k)
        x = x_ref[:, ks]
        if has_delta:
            x = x + d_ref[:, ks]

            @pl.when(first)
            def _write_sum():
                s_ref[:, ks] = x

        if has_norm:  # squares summed across lanes once, after the loop: no reduction per tile
            xf = x.astype(jnp.float32)
            sumsq = sumsq + xf * xf
            x = (xf * n_ref[ks].astype(jnp.float32)[None, :]).astype(x.dtype)
        if rows < dot_rows:  # one row, repeated: identical rows give identical outputs
            x = jnp.broadcast_to(x, (dot_rows, block_k))
        if w_nk:
            acc = acc + lax.dot_general(x, w_ref[:, ks], (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        else:
            acc = acc + lax.dot_general(x, w_ref[ks, :], (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return acc, sumsq

    carry = (jnp.zeros((dot_rows, w_ref.shape[0 if w_nk else 1]), jnp.float32),
             jnp.zeros((rows, block_k) if has_norm else (1, 1), jnp.float32))
    acc, sumsq = lax.fori_loop(0, k // block_k, body, carry)
    if rows < dot_rows:
        acc = jnp.max(acc, axis=0, keepdims=True)
    if has_norm:
        acc = acc * lax.rsqrt(jnp.sum(sumsq, axis=1, keepdims=True) / k + eps)
    o_ref[...] = _swiglu(acc, o_ref.dtype) if swiglu else acc.astype(o_ref.dtype)


def decode_matmul(
    x: jax.Array,
    w: jax.Array,
    *,
    delta: jax.Array | None = None,
    norm: jax.Array | None = None,
    eps: float = 0.0,
    swiglu: bool = False,
    w_nk: bool = False,
    interpret: bool | None = None,
    config: MatmulConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``[rms_norm](x [+ delta]) @ w`` [then SwiGLU], one kernel, forward only.

    Args:
      x: ``[rows, K]``; delta: None or ``[rows, K]``, added to ``x`` first (in ``x.dtype``).
      w: ``[K, N]`` in ``x.dtype``; ``w_nk``: ``[N, K]`` (each output's weights contiguous).
      norm: None or ``[K]``: the rows are ``rms_norm(x + delta) * norm`` (``eps``) before the matmul.
      swiglu: ``w``'s columns are (gate, up) pairs; the output is ``silu(gate) * up``.
      interpret: Pallas interpret mode; default: off a GPU.
      config: tiles (``MatmulConfig``; None: defaults).

    Returns:
      ``(out, s)``: ``out [rows, N]`` (``[rows, N / 2]`` with swiglu) in ``x.dtype`` (float32
      accumulation) and ``s = x + delta`` (``x`` itself without ``delta``).
    """
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    cfg = config or DEFAULT_CONFIG
    rows, k = x.shape
    if w.ndim != 2 or w.shape[1 if w_nk else 0] != k or w.dtype != x.dtype:
        raise ValueError(f"decode_matmul: w {w.shape} {w.dtype} must be {'[N, ' + str(k) + ']' if w_nk else '[' + str(k) + ', N]'} "
                         f"in {x.dtype}")
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype):
        raise ValueError(f"decode_matmul: delta {delta.shape} {delta.dtype} must match x {x.shape} {x.dtype}")
    if norm is not None and norm.shape != (k,):
        raise ValueError(f"decode_matmul: norm must be [{k}], got {norm.shape}")
    n = w.shape[0 if w_nk else 1]
    if not supports(rows, k, n, swiglu=swiglu, compiled=not interpret, config=cfg):
        raise ValueError(f"decode_matmul does not take [{rows}, {k}] @ [{k}, {n}] (see decode_matmul.supports)")
    block_k, block_n = plan(k, n, cfg)
    out_n = block_n // 2 if swiglu else block_n
    whole = pl.BlockSpec((rows, k), lambda j: (0, 0))
    inputs, in_specs = [x], [whole]
    if delta is not None:
        inputs.append(delta)
        in_specs.append(whole)
    if norm is not None:
        inputs.append(norm)
        in_specs.append(pl.BlockSpec((k,), lambda j: (0,)))
    inputs.append(w)
    in_specs.append(pl.BlockSpec((block_n, k), lambda j: (j, 0)) if w_nk else pl.BlockSpec((k, block_n), lambda j: (0, j)))
    out_shape = [jax.ShapeDtypeStruct((rows, n // block_n * out_n), x.dtype)]
    out_specs = [pl.BlockSpec((rows, out_n), lambda j: (0, j))]
    if delta is not None:
        out_shape.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
        out_specs.append(whole)
    kernel = functools.partial(_kernel, has_delta=delta is not None, has_norm=norm is not None, swiglu=swiglu,
                               eps=float(eps), block_k=block_k, w_nk=w_nk)
    outs = pl.pallas_call(
        kernel,
        grid=(n // block_n,),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_params(cfg.num_warps, cfg.num_stages),
        interpret=interpret,
        name="dflash_decode_matmul",
    )(*inputs)
    return outs[0], (outs[1] if delta is not None else x)


def decode_matmul_reference(
    x: jax.Array, w: jax.Array, *, delta: jax.Array | None = None, norm: jax.Array | None = None,
    eps: float = 0.0, swiglu: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``decode_matmul`` in plain jnp with ``layers.rms_norm``'s and ``layers.MLP``'s numerics."""
    s = x if delta is None else x + delta
    rows = s
    if norm is not None:
        xf = s.astype(jnp.float32)
        rows = norm.astype(s.dtype) * (xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)).astype(s.dtype)
    y = jnp.dot(rows, w, preferred_element_type=jnp.float32).astype(x.dtype)
    if swiglu:
        y = y.reshape(y.shape[0], -1, 2)
        y = jax.nn.silu(y[..., 0]) * y[..., 1]
    return y, s
