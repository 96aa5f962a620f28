#!/usr/bin/env python
"""Layers of dependent decode matmuls: one persistent kernel (``persistent_chain.py``) against XLA's
one GEMM (and split-K reduction) per matmul, to measure the per-matmul fixed cost that kernel
boundaries add.

Chains of 36 layers (``--chains``), bf16, distinct weights (nothing stays in the 60 MB L2), 1 row (a
decode token) and 16 (a verify block):
- ``4096``, ``8192``: one square matmul per layer (33.6 MB, 64 column tiles; 134 MB, 128 tiles);
- ``layer``: the Qwen3-8B layer's four matmuls, QKV, output, gate-up and down (386 MB; 96, 64, 384 and
  64 column tiles), each reading the first K columns of the last.
Variants: ``xla`` (also with the engine's decode-jit options: the loop as one CUDA graph); the
persistent kernel, with 64-column tiles or (``x lhs``) tiles as narrow as each matmul needs for a tile
per program, K tiles per matmul (``k128/256/...``), grid-wide barriers or ready flags per group of
columns (``flags N``); ``independent``, every matmul on ``x0`` with no barrier, its streaming ceiling;
``early``, a diagnostic race (tiles counted before their stores complete), timed even if wrong.
Each persistent variant is first checked matmul by matmul against a float32 dot of its own input.

The wall column carries the harness's own cost per timed call (~100-220 us on the H200, the same
for both); ``--profile`` reads each chain's GPU kernel time off a trace, which is what the engine's
step is made of (its kernels run back to back), so compare those. XLA's layer chain also runs small
slice and copy kernels (``h[:, :k]``) that the engine does not; its listing names them.

``--skew DIR`` times every program of the SKEW variants from inside the kernel (Mosaic GPU's profiler):
per matmul, how long the programs spend in it and waiting for its input, and how far apart they finish.

    python bench/bench_persistent_chain.py --profile /tmp/prof --out $OUT/chain.json   # on an H100/H200
    python bench/bench_persistent_chain.py --chains "" --skew /tmp/skew
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench_engine import kernel_time  # noqa: E402
from bench_matvec import normal, timeit  # noqa: E402
from dflash_jax.engine import _decode_compiler_options  # noqa: E402
from matvec_mgpu import pad_rows  # noqa: E402
from persistent_chain import ChainConfig, persistent_chain, supports  # noqa: E402

# Per chain, the matmul shapes ``(K, N)`` of one layer (repeated 36 times): square ones, and the
# Qwen3-8B layer's four (QKV, output, gate-up, down; each reads the first K columns of the last).
CHAINS = {"4096": [(4096, 4096)], "8192": [(8192, 8192)],
          "layer": [(4096, 6144), (4096, 4096), (4096, 24576), (12288, 4096)]}
# (config, rows) per chain: the measured best tiles (docs/benchmarks.md, eleventh session), one row
# and a verify block, and the streaming ceiling (no barrier).
NARROW = (48, 32, 64, 32)  # QKV, output, gate-up, down: 128, 128, 384 and 128 tiles
FULL = (128, 256, 128, 256)  # their K tiles that fill a 64 x 128 slot (QKV's 48 columns: 3/4 of it)
NARROWER, DEEPER = (16, 16, 32, 16), (512, 512, 256, 512)  # 384, 256, 768 and 256 tiles, full 16 x 512 slots
SQUARE = [(ChainConfig(64, 256, 6), 1), (ChainConfig(64, 256, 5), 16), (ChainConfig(64, 256, 6, dependent=False), 1)]
CONFIGS = {"4096": SQUARE, "8192": SQUARE,
           # x as the left operand: tiles as narrow as the matmul needs for 128 of them (gate-up: 3 x 128).
           # Twelfth session: ready flags per group of 2048 columns, K tiles that fill every ring slot
           # (FULL), and tiles a half or a third as wide again (NARROWER: 2-6 per program), to tell
           # a per-program skew (it stays) from a per-tile one (more tiles average it out).
           "layer": [(ChainConfig(64, 256, 4, programs=128, x_lhs=True, tile_n=NARROW), 1),
                     (ChainConfig(64, 128, 8, programs=128, x_lhs=True, tile_n=NARROW, tile_k=FULL, flag_cols=2048), 1),
                     (ChainConfig(64, 128, 5, programs=128, x_lhs=True, tile_n=NARROWER, tile_k=DEEPER,
                                  flag_cols=2048), 1),
                     (ChainConfig(64, 256, 8, programs=128, x_lhs=True, tile_n=NARROWER, flag_cols=2048), 1),
                     (ChainConfig(64, 256, 8, programs=128, x_lhs=True, tile_n=NARROWER, dependent=False), 1),
                     (ChainConfig(64, 128, 8, programs=128, x_lhs=True, tile_n=NARROW, tile_k=FULL, dependent=False), 1)]}


# The variants whose programs ``--skew`` times from inside the kernel: the best flags and barriers.
SKEW = [ChainConfig(64, 128, 8, programs=128, x_lhs=True, tile_n=NARROW, tile_k=FULL, flag_cols=2048),
        ChainConfig(64, 256, 4, programs=128, x_lhs=True, tile_n=NARROW)]


def chain_data(layers: int, shapes, dtype, key) -> tuple[list[jax.Array], jax.Array]:
    """Random weights ``w_j [L, K_j, N_j]``, scaled so that the chain keeps unit-size activations over
    its layers, and 16 input rows ``[16, max K_j]``."""
    weights = [normal(jax.random.fold_in(key, 10 * j + k), (layers, k, n), dtype, scale=k ** -0.5)
               for j, (k, n) in enumerate(shapes)]
    return weights, normal(jax.random.fold_in(key, 1), (16, max(k for k, _ in shapes)), dtype, scale=1.0)


def k_tiles(cfg: ChainConfig) -> str:
    """The K tiles of a variant, for its label: ``k256`` or, per matmul, ``k128/256/...``."""
    return "k" + ("/".join(map(str, cfg.tile_k)) if cfg.tile_k else str(cfg.block_k))


def program_timelines(trace_path: Path, phases: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per matmul of a layer, per layer and program: the start and end of its ``m{j}`` range and
    the time inside its ``wait`` ranges, from a Mosaic GPU in-kernel profile ->
    ``start, end, wait [phases, layers, programs]``, in the trace's units: each program's SM clock
    cycles / 1000 from its own start (its start in us apart)."""
    events = json.loads(trace_path.read_text())["traceEvents"]
    by_program: dict[int, list[dict]] = {}
    for e in events:
        by_program.setdefault(e["tid"], []).append(e)
    programs = sorted(by_program)
    spans: dict[tuple[int, int], list[float]] = {}  # (program index, j) -> [start, end, wait, ...]
    for pi, tid in enumerate(programs):
        open_at: dict[str, float] = {}
        current = None
        for e in by_program[tid]:  # in time order within a program
            if e["ph"] == "B":
                open_at[e["name"]] = e["ts"]
                if e["name"].startswith("m"):
                    current = spans.setdefault((pi, int(e["name"][1:])), [])
                    current += [e["ts"], float("nan"), 0.0]
            elif e["name"] == "wait" and current is not None:
                current[-1] += e["ts"] - open_at.pop("wait")
            elif e["name"].startswith("m"):
                current[-2] = e["ts"]
    layers = min(len(v) // 3 for v in spans.values())
    out = np.full((3, phases, layers, len(programs)), np.nan)
    for (pi, j), v in spans.items():
        out[:, j, :, pi] = np.asarray(v[:3 * layers]).reshape(layers, 3).T
    return out[0], out[1], out[2]


def skew_report(trace_path: Path, phases: int) -> list[dict]:
    """Per matmul ``j`` of a layer (layers 1.. averaged): how long a program spends in it, how much
    of that waiting for its input, and how far apart the programs finish it (max - min, max -
    median): the cost of a full dependency is the last program's lateness."""
    start, end, wait = program_timelines(trace_path, phases)
    rows = []
    for j in range(phases):
        e = end[j, 1:]
        slowest = np.argmax(e, axis=1)
        rows.append({"matmul": j, "us_in_matmul": float(np.nanmean(e - start[j, 1:])),
                     "us_waiting": float(np.nanmean(wait[j, 1:])),
                     "end_spread_us": float(np.nanmean(np.nanmax(e, 1) - np.nanmin(e, 1))),
                     "last_after_median_us": float(np.nanmean(np.nanmax(e, 1) - np.nanmedian(e, 1))),
                     "slowest_program_share": float(np.max(np.bincount(slowest)) / len(slowest))})
    layer_end = np.nanmax(end[-1], axis=1)
    rows.append({"matmul": "layer", "us_in_matmul": float(np.mean(np.diff(layer_end)))})
    return rows


def chain_inputs(ys: list[jax.Array], x0: jax.Array, shapes, rows: int, dependent: bool) -> list[jax.Array]:
    """Per matmul ``j``, what the kernel should have multiplied in every layer, ``[L, rows, K_j]``:
    the previous matmul's output (``x0`` first), or ``x0`` throughout if not ``dependent``."""
    layers = ys[0].shape[0]
    out = []
    for j, (k, _) in enumerate(shapes):
        if not dependent:
            out.append(jnp.broadcast_to(x0[:rows, :k], (layers, rows, k)))
        elif j > 0:
            out.append(ys[j - 1][:, :rows, :k])
        else:
            out.append(jnp.concatenate([x0[None, :rows, :k], ys[-1][:-1, :rows, :k]]))
    return out


def link_errors(ys: list[jax.Array], x0: jax.Array, weights: list[jax.Array], shapes, rows: int, dependent: bool) -> float:
    """Largest error of every matmul's output over the layers and the real rows, each against a
    float32 dot of the kernel's own input to it, relative to the largest output entry."""
    worst = 0.0
    for y, x, w in zip(ys, chain_inputs(ys, x0, shapes, rows, dependent), weights):
        want = jax.lax.map(lambda xw: xw[0].astype(jnp.float32) @ xw[1].astype(jnp.float32), (x, w))  # one weight at a time
        worst = max(worst, float(jnp.max(jnp.abs(y[:, :rows].astype(jnp.float32) - want)) / jnp.max(jnp.abs(want))))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--chains", default="4096,8192,layer", help=f"of {','.join(CHAINS)}")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="also read each chain's GPU kernel time per layer off a trace (no launch gaps)")
    ap.add_argument("--skew", default=None, metavar="DIR",
                    help="also time every program from inside the kernel (Mosaic GPU's profiler) for the "
                         "SKEW variants of the layer chain, and print where a dependent matmul's time goes")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype, key, results = jnp.bfloat16, jax.random.key(0), {"device": jax.devices()[0].device_kind, "rows": []}
    print(f"device {results['device']}, {args.layers} layers of dependent matmuls per timing", flush=True)
    print(f"{'chain':>6} {'variant':<44} {'us/layer':>10} {'TB/s':>6} {'error':>8}", flush=True)
    for name in [v for v in args.chains.split(",") if v]:
        shapes = CHAINS[name]
        weights, x16 = chain_data(args.layers, shapes, dtype, key)
        bytes_per_layer = sum(k * n for k, n in shapes) * jnp.dtype(dtype).itemsize

        def report(label, seconds, error=float("nan"), profiled=None):
            row = {"chain": name, "variant": label, "us_per_layer": seconds * 1e6,
                   "tb_per_s": bytes_per_layer / seconds / 1e12, "error": error}
            results["rows"].append(row)
            print(f"{name:>6} {label:<44} {row['us_per_layer']:>10.2f} {row['tb_per_s']:>6.2f} {error:>8.1e}", flush=True)
            if args.profile and profiled is not None:
                fn, fn_args = profiled
                us, names = kernel_time(lambda f=jax.jit(fn): jax.block_until_ready(f(*fn_args)),
                                        f"{args.profile}/{name}_{len(results['rows'])}", args.layers)
                row["kernel_us_per_layer"], row["kernels"] = us, names
                print(f"{'':>6} {'  kernel time off the trace':<44} {us:>10.2f} "
                      f"{bytes_per_layer / us / 1e6:>6.2f}   {names}", flush=True)

        def xla_chain(wss, i, x):
            h = x + i.astype(dtype)
            for layer in range(args.layers):
                for (k, _), ws in zip(shapes, wss):
                    h = h[:, :k] @ ws[layer]
            return h

        # Separate arrays, as the engine's weights are: slices of the stacked w would be copied first.
        wss = [[w[layer] + 0 for layer in range(args.layers)] for w in weights]
        for rows in (1, 16):
            x = x16[:rows, :shapes[0][0]]
            report(f"xla rows {rows}", timeit(lambda ws_, i, x=x: xla_chain(ws_, i, x), wss, repeats=args.repeats,
                                              inner=args.inner) / args.layers,
                   profiled=(lambda ws_, x=x: xla_chain(ws_, jnp.zeros((), jnp.int32), x), (wss,)))
        # The engine's decode jit keeps its loop on the device as one CUDA graph (docs/design.md).
        report("xla rows 1, engine's graph options",
               timeit(lambda ws_, i: xla_chain(ws_, i, x16[:1, :shapes[0][0]]), wss, repeats=args.repeats,
                      inner=args.inner, compiler_options=_decode_compiler_options()) / args.layers)
        del wss
        weights_nk = None
        for cfg, rows in CONFIGS[name]:
            width = "n" + "/".join(map(str, cfg.tile_n)) if cfg.tile_n else f"n{cfg.block_n}"
            label = (f"persistent {'x' if cfg.x_lhs else 'w'} lhs {width} {k_tiles(cfg)} s{cfg.stages} "
                     f"p{cfg.resident(shapes)} rows {rows}" + ("" if cfg.dependent else " independent")
                     + (f" flags {cfg.flag_cols}" if cfg.flag_cols else "") + (" early" if cfg.early_signal else ""))
            if not supports(args.layers, shapes, rows, cfg):
                print(f"{name:>6} {label:<44} unsupported", flush=True)
                continue
            x0 = pad_rows(x16[:rows])
            if cfg.x_lhs and weights_nk is None:
                weights_nk = [jnp.swapaxes(w, 1, 2) + 0 for w in weights]  # [L, N, K]
            w_kernel = weights_nk if cfg.x_lhs else weights
            try:
                ys = jax.jit(lambda a, ws_, c=cfg: persistent_chain(a, ws_, c))(x0, w_kernel)
                error = link_errors(ys, x0, weights, shapes, rows, cfg.dependent)
                if not error < 2e-2:
                    print(f"{name:>6} {label:<44} WRONG (error {error:.1e})", flush=True)
                    if not cfg.early_signal:  # a diagnostic race is timed all the same
                        continue
                seconds = timeit(lambda ws_, i, c=cfg, a=x0: persistent_chain(a + i.astype(dtype), ws_, c)[-1][:, 0],
                                 w_kernel, repeats=args.repeats, inner=args.inner) / args.layers
                report(label, seconds, error, profiled=(lambda a, ws_, c=cfg: persistent_chain(a, ws_, c), (x0, w_kernel)))
            except Exception as e:  # one failing variant must not lose the others' numbers
                print(f"{name:>6} {label:<44} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        del weights, weights_nk
    if args.skew:
        results["skew"] = skew(args.layers, args.skew)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


def skew(layers: int, out_dir: str) -> dict:
    """Each SKEW variant: its GPU kernel time per layer off a trace, then one call under the in-kernel
    profile, after a plain one (weights touched, TLB warm). The profile counts SM clock cycles, so
    its figures are converted to us by the ratio of the two layer times."""
    shapes, dtype, key = CHAINS["layer"], jnp.bfloat16, jax.random.key(0)
    weights, x16 = chain_data(layers, shapes, dtype, key)
    weights = [jnp.swapaxes(w, 1, 2) + 0 for w in weights]  # [L, N, K]: the SKEW variants are x_lhs
    x0 = pad_rows(x16[:1])
    report = {}
    print(f"{'variant':<28} {'matmul':>6} {'us in it':>9} {'waiting':>8} {'end spread':>11} "
          f"{'last-median':>12} {'same slowest':>12}", flush=True)
    for i, cfg in enumerate(SKEW):
        label = f"flags {cfg.flag_cols}" if cfg.flag_cols else "barriers"
        label += f", {k_tiles(cfg)} s{cfg.stages}"
        plain = jax.jit(lambda a, ws_, c=cfg: persistent_chain(a, ws_, c))
        us, _ = kernel_time(lambda: jax.block_until_ready(plain(x0, weights)), f"{out_dir}/plain{i}", layers)
        trace_dir = Path(out_dir) / f"skew{i}"
        trace_dir.mkdir(parents=True, exist_ok=True)
        jax.block_until_ready(jax.jit(lambda a, ws_, c=cfg, d=str(trace_dir): persistent_chain(
            a, ws_, c, profile_dir=d, profile_ranges=640))(x0, weights))
        jax.effects_barrier()  # the profile is written by a host callback
        rows = skew_report(next(trace_dir.glob("*trace.json")), len(shapes))
        per_us = rows[-1]["us_in_matmul"] / us  # profile units (k-cycles) per us: the SM clock in GHz
        rows = [{k: v / per_us if k.startswith(("us_", "end_", "last_")) else v for k, v in r.items()} for r in rows]
        report[label] = {"kernel_us_per_layer": us, "sm_clock_ghz": per_us, "matmuls": rows}
        print(f"{label:<28} kernel {us:.2f} us per layer off the trace; the profile's clock {per_us:.2f} GHz",
              flush=True)
        for r in rows:
            print(f"{label:<28} {r['matmul']:>6} {r['us_in_matmul']:>9.2f} {r.get('us_waiting', float('nan')):>8.2f} "
                  f"{r.get('end_spread_us', float('nan')):>11.2f} {r.get('last_after_median_us', float('nan')):>12.2f} "
                  f"{r.get('slowest_program_share', float('nan')):>12.2f}", flush=True)
    return report


if __name__ == "__main__":
    main()
