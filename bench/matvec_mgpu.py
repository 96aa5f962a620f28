"""A weight-streaming decode matmul on Hopper's TMA and tensor cores (Pallas Mosaic GPU), the
candidate of ``bench_matvec_mgpu.py``. NOT used by the engine: on the H200 (docs/benchmarks.md, tenth
session) its kernels alone match XLA's GEMMs on QKV and the output projection (13.5 / 9.8 us at one
row) and lose on gate-up (49.3 vs 45.7 us), so it could only save the two split-K reduce kernels
(~2.75 us per layer) if the consumers summed its partials; its ``prefetch`` variant (weights streamed
before the PDL wait) gained nothing in a dependent chain, and neither did it with ``signal``
(``launch_dependents`` first) in 36 of these kernels back to back (eleventh session), nor after an
``add_rms_norm`` that signals its dependents (twenty-first session, ``--norm-chain``: it loses
0.2-2.4 us per link, and the kernel trails XLA's dot on QKV, output and gate-up). JAX 0.10.2's GPU interpret
mode does not take a transposed WGMMA operand, so it has no CPU test; the benchmark checks it on the
device.

Why it exists: at batch 1 the decode step is weight streaming, and the Triton-lowered Pallas
matmul (``decode_matmul.py``) streamed 5-20% slower than XLA's GEMMs, which the HLO tags
``is_tma_allowed``. Mosaic GPU issues TMA bulk copies into swizzled shared memory, several stages
deep, and feeds the tensor cores from there (WGMMA).

The shape of the computation: the rows are the small dimension, so the weight is the WGMMA's left
operand, read transposed from its ``[K, N]`` layout: each program computes
``out^T[block_n, rows] = w[:, block_n]^T @ x^T`` over its share of K, ``rows`` (8 or 16: a decode
token padded to 8, a verify block of 16) as the WGMMA's N. Programs are ``[N / block_n, splits]``;
with ``splits > 1`` each sums a K slice and the float32 partials ``[splits, N, rows]`` are summed by
the caller (in the engine that would be the next kernel's prologue).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from kernels_pallas._mosaic_gpu import SMEM_BUDGET, swizzled


@dataclasses.dataclass(frozen=True)
class MgpuConfig:
    """Tiles: ``block_n`` weight columns per program (the WGMMA's M, a multiple of 64), ``block_k``
    rows of K per pipeline stage, ``stages`` TMA copies in flight, ``splits`` K slices."""

    block_n: int = 64
    block_k: int = 128
    stages: int = 4
    splits: int = 1
    # Issue the first ``stages`` weight copies, then ``griddepcontrol.wait``, then copy the rows (the
    # only input that the previous kernel writes) whole into shared memory. Under programmatic
    # dependent launch the weight stream then starts while the previous kernel is still running.
    prefetch: bool = False
    # ``griddepcontrol.launch_dependents`` as the kernel's first instruction: under programmatic
    # dependent launch the next kernel may then be scheduled while this one still streams.
    signal: bool = False

    def smem_bytes(self, rows: int, k: int, itemsize: int = 2) -> int:
        x_bytes = rows * k // self.splits if self.prefetch else self.stages * rows * self.block_k
        return (self.stages * self.block_k * self.block_n + x_bytes) * itemsize + self.block_n * rows * 4


def supports(rows: int, k: int, n: int, config: MgpuConfig) -> bool:
    c = config
    return (rows % 8 == 0 and rows <= 256 and c.block_n % 64 == 0 and n % c.block_n == 0
            and k % (c.block_k * c.splits) == 0 and c.smem_bytes(rows, k) <= SMEM_BUDGET)


def matvec_partials(x: jax.Array, w: jax.Array, config: MgpuConfig = MgpuConfig(),
                    after: jax.Array | None = None) -> jax.Array:
    """``x [rows, K]`` (rows a multiple of 8), ``w [K, N]`` -> float32 partial sums
    ``[splits, N, rows]`` (their sum over splits is ``(x @ w)^T``). ``after``: an operand the kernel
    does not read, which orders it after its producer (two kernels back to back, nothing between)."""
    import jax.experimental.pallas as pl
    import jax.experimental.pallas.mosaic_gpu as plgpu

    rows, k = x.shape
    n = w.shape[1]
    c = config
    if not supports(rows, k, n, c) or w.shape[0] != k or x.dtype != w.dtype:
        raise ValueError(f"matvec_partials: x {x.shape} {x.dtype}, w {w.shape} {w.dtype} not supported by {c}")
    k_split = k // c.splits
    itemsize = jnp.dtype(w.dtype).itemsize

    def transforms(minor: int):
        return swizzled(minor, itemsize)

    delay = 1 if c.stages > 1 else 0

    def body(x_gmem, w_gmem, *refs):
        out_gmem, *scratch = refs[1:] if after is not None else refs
        if c.signal:
            plgpu.griddepcontrol_launch_dependents()
        n_idx = lax.axis_index("n")
        s_idx = lax.axis_index("s")
        k_slice = pl.ds(s_idx * k_split, k_split)
        w_spec = plgpu.BlockSpec((c.block_k, c.block_n), lambda kk: (kk, n_idx), transforms=transforms(c.block_n),
                                 delay_release=delay)

        def accumulate(acc_ref):
            if c.prefetch:
                x_smem, x_ready = scratch

                def step(idx, w_smem):
                    @pl.when(idx[0] == 0)  # the pipeline has issued its first weight copies by now
                    def _():
                        plgpu.griddepcontrol_wait()
                        plgpu.copy_gmem_to_smem(x_gmem.at[:, k_slice], x_smem, x_ready)
                        plgpu.barrier_wait(x_ready)

                    x_tile = x_smem.at[:, pl.ds(idx[0] * c.block_k, c.block_k)]
                    plgpu.wgmma(acc_ref, plgpu.transpose_ref(w_smem, (1, 0)), plgpu.transpose_ref(x_tile, (1, 0)))
                    plgpu.wgmma_wait(delay)

                plgpu.emit_pipeline(step, grid=(k_split // c.block_k,), in_specs=[w_spec],
                                    max_concurrent_steps=c.stages)(w_gmem.at[k_slice, :])
            else:
                def step(_, w_smem, x_smem):
                    plgpu.wgmma(acc_ref, plgpu.transpose_ref(w_smem, (1, 0)), plgpu.transpose_ref(x_smem, (1, 0)))
                    plgpu.wgmma_wait(delay)

                x_spec = plgpu.BlockSpec((rows, c.block_k), lambda kk: (0, kk), transforms=transforms(c.block_k),
                                         delay_release=delay)
                plgpu.emit_pipeline(step, grid=(k_split // c.block_k,), in_specs=[w_spec, x_spec],
                                    max_concurrent_steps=c.stages)(w_gmem.at[k_slice, :], x_gmem.at[:, k_slice])
            return acc_ref[...]

        acc = pl.run_scoped(accumulate, plgpu.ACC((c.block_n, rows)))

        @functools.partial(pl.run_scoped, out_smem=plgpu.SMEM((c.block_n, rows), jnp.float32))
        def _store(out_smem):
            out_smem[...] = acc
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(out_smem, out_gmem.at[s_idx, pl.ds(n_idx * c.block_n, c.block_n), :])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    scratch = ((plgpu.SMEM((rows, k_split), x.dtype, transforms=transforms(k_split)), plgpu.Barrier(num_arrivals=1))
               if c.prefetch else ())
    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((c.splits, n, rows), jnp.float32),
                          scratch_types=scratch, grid=(n // c.block_n, c.splits), grid_names=("n", "s"))
    return kernel(x, w) if after is None else kernel(x, w, after)


def padded_rows(rows: int) -> int:
    """``rows`` rounded up to a multiple of 8, the WGMMA's least N."""
    return -(-rows // 8) * 8


def pad_rows(x: jax.Array) -> jax.Array:
    """``x [rows, K]`` with zero rows appended up to ``padded_rows(rows)``."""
    padded = padded_rows(x.shape[0])
    return x if padded == x.shape[0] else jnp.pad(x, ((0, padded - x.shape[0]), (0, 0)))


def matvec(x: jax.Array, w: jax.Array, config: MgpuConfig = MgpuConfig()) -> jax.Array:
    """``x @ w`` for ``x [rows, K]`` of any row count up to 256: rows padded to a multiple of 8,
    partials summed and transposed by XLA (what a consumer kernel would fold in)."""
    return matvec_partials(pad_rows(x), w, config).sum(0).T[:x.shape[0]].astype(x.dtype)
