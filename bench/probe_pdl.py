#!/usr/bin/env python
"""Does XLA launch a Pallas kernel early, with programmatic dependent launch (PDL)?

Kernel A spins for ``--spin-us`` on one SM (optionally signalling its dependents first, with
``griddepcontrol.launch_dependents``); kernel B, which reads A's output, stamps the GPU's global
timer at its start, then waits on ``griddepcontrol.wait`` before it reads A's output. If XLA launches
B with PDL, B starts while A still spins (B's first stamp before A's last); otherwise B starts only
after A has finished. Printed in nanoseconds relative to A's end, median over repeats, for a plain
jit and for the decode loop's command buffers (a CUDA graph).

The second part (``--parts chain``) times what that is worth between a decode layer's matmuls: a chain
of ``--units`` pairs (a one-row XLA matmul ``[1, 4096] x [4096, 4096]``, distinct weights, then a
small kernel on its output), the small kernel an XLA fusion, a Pallas Triton kernel, a Pallas Mosaic
GPU kernel, or the same Mosaic kernel with ``griddepcontrol`` (which JAX marks ``uses_pdl``); and the
matmuls alone with their weights stacked in one array. Wall time per pair, median of repeated calls
of a jit that runs the chain ``--loops`` times in a ``while`` inside the decode loop's command
buffers.

The third part (``--parts loop``) times one iteration of such a ``while``: a loop of tiny kernels against
the same kernels unrolled, with XLA's default and with the smallest graph size.

    python3 bench/probe_pdl.py --parts launch,chain,loop     # on the GPU
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plt  # noqa: E402

from bench_engine import median_time  # noqa: E402
from kernels_pallas._flash import triton_params  # noqa: E402

SLOTS = 8


def _asm(asm: str, arg: jax.Array) -> jax.Array:
    """One int32 out of ``asm`` (``$0``), ordered after ``arg`` (``$1``, unused by the asm)."""
    # Triton takes no 0-d tensors: the asm runs on a 1-element vector.
    vec = jnp.full((1,), arg, jnp.int32)
    [out] = plt.elementwise_inline_asm(asm, args=[vec], constraints="=r,r", pack=1,
                                      result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])
    return jnp.max(out)


def _timer(after: jax.Array) -> jax.Array:
    return _asm("mov.u32 $0, %globaltimer_lo;", after)


def _launch_dependents(after: jax.Array) -> jax.Array:
    return _asm("griddepcontrol.launch_dependents;\n\tmov.u32 $0, 0;", after)


def _wait(after: jax.Array) -> jax.Array:
    return _asm("griddepcontrol.wait;\n\tmov.u32 $0, 0;", after)


def _pack(*values) -> jax.Array:
    idx = jax.lax.broadcasted_iota(jnp.int32, (SLOTS,), 0)
    out = jnp.zeros((SLOTS,), jnp.int32)
    for i, v in enumerate(values):
        out = jnp.where(idx == i, v, out)
    return out


def _element(v: jax.Array, i: int) -> jax.Array:
    """``v[i]`` (Pallas Triton lowers no slices)."""
    return jnp.sum(jnp.where(jax.lax.broadcasted_iota(jnp.int32, v.shape, 0) == i, v, 0))


def _spin_kernel(x_ref, o_ref, *, spin_ns: int, trigger: bool):
    t0 = _timer(_element(x_ref[...], 0))
    z = _launch_dependents(t0) if trigger else jnp.int32(0)

    def cond(c):
        return (c[1] - t0) < spin_ns

    def body(c):
        return c[0] + 1, _timer(c[0] + 1)

    _, t1 = jax.lax.while_loop(cond, body, (z + 1, t0))
    o_ref[...] = _pack(t0, t1)


def _probe_kernel(a_ref, o_ref, *, wait: bool):
    t_start = _timer(jnp.int32(0))
    z = _wait(t_start) if wait else jnp.int32(0)
    t_after = _timer(z)
    # The load's address depends on the wait's output, so it cannot move above the wait.
    a = plt.load(a_ref.at[pl.ds(z, SLOTS)])
    o_ref[...] = _pack(t_start, t_after, _element(a, 0), _element(a, 1))


def _call(kernel, x):
    spec = pl.BlockSpec((SLOTS,), lambda i: (0,))
    return pl.pallas_call(kernel, grid=(1,), in_specs=[spec], out_specs=spec,
                          out_shape=jax.ShapeDtypeStruct((SLOTS,), jnp.int32),
                          compiler_params=triton_params(1, 1))(x)


def chain(x, *, spin_ns: int, trigger: bool, wait: bool):
    a = _call(functools.partial(_spin_kernel, spin_ns=spin_ns, trigger=trigger), x)
    return _call(functools.partial(_probe_kernel, wait=wait), a)


def _mosaic_affine(x: jax.Array, *, pdl: bool) -> jax.Array:
    """``x * 0.5 + 1`` for ``x [16, 256]`` bf16 in one Mosaic GPU program (TMA in and out)."""
    import jax.experimental.pallas.mosaic_gpu as plgpu

    def body(x_gmem, o_gmem, smem, bar):
        if pdl:
            plgpu.griddepcontrol_wait()
            plgpu.griddepcontrol_launch_dependents()
        plgpu.copy_gmem_to_smem(x_gmem, smem, bar.at[0])
        plgpu.barrier_wait(bar.at[0])
        smem[...] = smem[...] * 0.5 + 1.0
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(smem, o_gmem)
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype),
                          scratch_types=(plgpu.SMEM(x.shape, x.dtype), plgpu.Barrier(num_arrivals=1, num_barriers=1)),
                          grid=(1,), grid_names=("p",))
    return kernel(x)


def _triton_affine_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] * 0.5 + 1.0


def _triton_affine(x: jax.Array) -> jax.Array:
    spec = pl.BlockSpec(x.shape, lambda i: (0, 0))
    return pl.pallas_call(_triton_affine_kernel, grid=(1,), in_specs=[spec], out_specs=spec,
                          out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), compiler_params=triton_params(4, 1))(x)


SMALL_KERNELS = {
    "none": None,
    "xla": lambda x: jax.lax.optimization_barrier(x * 0.5 + 1.0),
    "triton": _triton_affine,
    "mosaic": functools.partial(_mosaic_affine, pdl=False),
    "mosaic+pdl": functools.partial(_mosaic_affine, pdl=True),
}


def matmul_chain(x: jax.Array, ws, *, small, loops: int) -> jax.Array:
    """``loops`` times over the weights ``ws`` (a tuple of ``[4096, 4096]``, or one stacked
    ``[units, 4096, 4096]``): ``x = small(x @ ws[i])``, ``x [1, 4096]``."""
    def one_pass(_, x):
        for i in range(len(ws)):
            x = jnp.dot(x, ws[i], preferred_element_type=jnp.float32).astype(x.dtype)
            if small is not None:
                x = small(x.reshape(16, 256)).reshape(1, 4096)
        return x

    return jax.lax.fori_loop(0, loops, one_pass, x)


def probe_launch(spin_us: float, repeats: int, options: dict) -> None:
    """Part 1: when B starts relative to A's end, for every (A triggers, B waits) pair."""
    x = jnp.arange(SLOTS, dtype=jnp.int32)
    print("options | A triggers | B waits | B start - A end (ns) | B after wait - A end | A spin")
    for opts_name, opts in (("plain", None), ("command buffers", options)):
        for trigger in (False, True):
            for wait in (False, True):
                fn = jax.jit(functools.partial(chain, spin_ns=int(spin_us * 1000), trigger=trigger, wait=wait),
                             compiler_options=opts)
                try:
                    jax.block_until_ready(fn(x))
                    rows = [np.asarray(fn(x)) for _ in range(repeats)]
                except Exception as e:  # noqa: BLE001
                    print(f"{opts_name} | {trigger} | {wait} | failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue

                def since(r, i, j=3):  # stamp i - stamp j in ns, modulo the 32-bit timer's wrap
                    return int(np.int32(np.uint32(r[i]) - np.uint32(r[j])))

                start = statistics.median(since(r, 0) for r in rows)
                after = statistics.median(since(r, 1) for r in rows)
                spin = statistics.median(since(r, 3, 2) for r in rows)
                print(f"{opts_name} | {trigger} | {wait} | {start:8.0f} | {after:8.0f} | {spin:8.0f}", flush=True)


def time_chains(units: int, loops: int, repeats: int, options: dict) -> None:
    """Part 2: us per (matmul, small kernel) pair for every small kernel, and with stacked weights."""
    keys = jax.random.split(jax.random.key(0), units + 1)
    ws = tuple((jax.random.normal(k, (4096, 4096), jnp.float32) / 64).astype(jnp.bfloat16) for k in keys[:units])
    x = jax.random.normal(keys[-1], (1, 4096), jnp.bfloat16)
    print(f"chain of {units} matmul + small kernel pairs, {loops} loops; us per pair (median of {repeats})")
    # the last row: the same weights stacked in one array, each matmul reading a static slice of it
    variants = [(name, small, ws) for name, small in SMALL_KERNELS.items()] + [("none, stacked", None, jnp.stack(ws))]
    for name, small, w in variants:
        fn = jax.jit(functools.partial(matmul_chain, small=small, loops=loops), compiler_options=options)
        try:
            median, best = median_time(fn, x, w, repeats=repeats)
        except Exception as e:  # noqa: BLE001
            print(f"{name:12s} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        pairs = units * loops
        print(f"{name:12s} {median / pairs * 1e6:8.2f}  (min {best / pairs * 1e6:.2f})", flush=True)


def time_loop_overhead(repeats: int, options: dict) -> None:
    """Part 3: the cost of one iteration of a ``while`` in the CUDA graph (a conditional node): a
    loop of ``n`` iterations of ``k`` tiny XLA kernels against the same ``n * k`` kernels unrolled."""
    def kernels(x, k):
        for _ in range(k):
            x = jax.lax.optimization_barrier(x * 0.5 + 1.0)
        return x

    def looped(x, n, *, k):
        return jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, kernels(c[1], k)), (jnp.int32(0), x))[1]

    def unrolled(x, n, *, total):
        del n
        return kernels(x, total)

    x = jax.random.normal(jax.random.key(1), (1, 4096), jnp.bfloat16)
    print("while-loop iteration in the CUDA graph: us per iteration (looped - unrolled) / n")
    variants = {"decode options": options, "+ min graph size 1": {**options, "xla_gpu_graph_min_graph_size": 1}}
    for opts_name, opts in variants.items():
        for k in (1, 8, 64, 256):
            n = max(8, 512 // k)
            try:
                t_loop, _ = median_time(jax.jit(functools.partial(looped, k=k), compiler_options=opts), x,
                                         jnp.int32(n), repeats=repeats)
                t_flat, _ = median_time(jax.jit(functools.partial(unrolled, total=n * k), compiler_options=opts), x,
                                         jnp.int32(n), repeats=repeats)
            except Exception as e:  # noqa: BLE001
                print(f"{opts_name} k={k}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            print(f"{opts_name} k={k} n={n}: looped {t_loop / n * 1e6:.2f} us/iter, unrolled {t_flat / n * 1e6:.2f} "
                  f"us per {k} kernels, overhead {(t_loop - t_flat) / n * 1e6:.2f} us/iter", flush=True)


PARTS = ("launch", "chain", "loop")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="launch", help=f"comma-separated, of {','.join(PARTS)}")
    ap.add_argument("--spin-us", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=21)
    ap.add_argument("--units", type=int, default=36)
    ap.add_argument("--loops", type=int, default=8)
    args = ap.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    if unknown := sorted(set(parts) - set(PARTS)):
        ap.error(f"--parts: unknown {unknown}; choose from {PARTS}")
    from dflash_jax.engine import _GPU_DECODE_COMMAND_BUFFER

    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    options = {"xla_gpu_enable_command_buffer": _GPU_DECODE_COMMAND_BUFFER}
    if "launch" in parts:
        probe_launch(args.spin_us, args.repeats, options)
    if "chain" in parts:
        time_chains(args.units, args.loops, args.repeats, options)
    if "loop" in parts:
        time_loop_overhead(args.repeats, options)


if __name__ == "__main__":
    main()
