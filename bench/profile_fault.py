"""Reproduces the open TP=2 profiling fault (docs/benchmarks.md, eighth to tenth sessions).

An 8B-shaped engine on a (data=1, tensor=2) mesh times its decode steps, traces decode steps under
``jax.profiler`` (``bench_engine.profile_decode``), then runs its first ``Engine.generate`` calls
(``bench_engine.profile_generate``: one untraced, one traced). On the 2x H200 those fail with
``CUDA_ERROR_LAUNCH_FAILED`` (reported by the decode executable; every later call of the process
fails too) with the fused cached-attention kernel and the decode jit's command buffers, also with
``--warmup``, ``--generate-first`` and at ``--layers 8``. ``--phases`` with ``CUDA_LAUNCH_BLOCKING=1``
located it: prefill, empty state and admission complete, the first decode call fails to launch its
CUDA graph. They complete with ``--unfused --unfused-norms``, with ``--decode-option
xla_gpu_enable_command_buffer=``, and with ``--no-trace`` (no decode trace before the phases).

    python3 bench/profile_fault.py [--unfused] [--unfused-norms] [--warmup] [--generate-first] \
        [--decode-option KEY=VALUE ...] [--phases] [--no-trace] [--layers 36] [--tensor 2] [--tiny]

Prints one line per engine: ``ok`` or ``FAULT`` with the error.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import bench_engine  # noqa: E402
from dflash_jax.engine import Engine, EngineConfig  # noqa: E402
from dflash_jax.sharding import MeshConfig  # noqa: E402
from dflash_jax.tiny import tiny_target_config  # noqa: E402


def generate_by_phase(engine: Engine, name: str, context: int, new_tokens: int) -> None:
    """The phases ``Engine.generate`` runs for one prompt (its decode calls here one step each),
    each synchronised before the next and reported, so that a fault surfaces at its phase."""
    def done(phase: str, x: jax.Array) -> None:
        jax.block_until_ready(x)
        print(f"{name}: {phase} ok", flush=True)

    prompt = np.random.RandomState(1).randint(0, engine.target.config.vocab_size - 1, context).tolist()
    rows, first = engine.prefill([prompt], [new_tokens], [()])
    done("prefill", first)
    state = engine.empty_state(engine.state_rows(1))
    done("empty state", state.starts)
    state = engine.admit(state, rows, [0])
    done("admit", state.starts)
    for call in range(new_tokens):
        state, snapshot = engine.decode(state, n_steps=1)
        done(f"decode call {call}", state.starts)
        print(f"{name}: tokens {np.asarray(snapshot.tokens)[0, context:context + new_tokens + 1].tolist()}, "
              f"done {bool(np.asarray(snapshot.done)[0])}", flush=True)
    done("release", engine.release(state, [0]).starts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--tensor", type=int, default=2)
    ap.add_argument("--context", type=int, default=512)
    bench_engine.add_variant_args(ap)
    ap.add_argument("--warmup", action="store_true", help="Engine.warmup() before the traces")
    ap.add_argument("--generate-first", action="store_true", help="one Engine.generate before any trace")
    ap.add_argument("--phases", action="store_true",
                    help="after the decode trace, the first generation phase by phase (prefill, admit, decode "
                         "calls, release), each synchronised and reported: with CUDA_LAUNCH_BLOCKING=1, the "
                         "phase whose kernel faults")
    ap.add_argument("--no-trace", action="store_true", help="skip the decode trace (the control: is a trace needed?)")
    ap.add_argument("--tiny", action="store_true", help="tiny float32 shapes, XLA attention: a CPU smoke test")
    args = ap.parse_args()
    bench_engine.use_variant(unfused=args.unfused, unfused_norms=args.unfused_norms, decode_options=args.decode_option)

    if args.tiny:
        tcfg, dtype, attention, context = tiny_target_config(num_layers=8), jnp.float32, "xla", 32
    else:
        tcfg, dtype, attention, context = bench_engine.qwen3_8b(args.layers), jnp.bfloat16, "pallas", args.context
    target, drafter = bench_engine.random_pair(tcfg, dtype)
    mesh = MeshConfig(data=1, fsdp=1, tensor=args.tensor) if args.tensor > 1 else None
    cfg = EngineConfig(max_batch_size=1, max_length=context + 512, prompt_buckets=(context,), steps_per_sync=8,
                       attention_impl=attention, mesh=mesh)
    engines = (("target-only", Engine(target, None, cfg)), ("dflash", Engine(target, drafter, cfg)))
    for name, engine in engines:
        step, _ = bench_engine.time_decode(engine, 1, context, 8, 2)
        print(f"{name}: decode step {step * 1e3:.2f} ms", flush=True)
        if args.warmup:
            print(f"{name}: warmup {engine.warmup([1]):.1f} s", flush=True)
        if args.generate_first:
            engine.generate([[1] * context], 8)
    out = Path(tempfile.mkdtemp(prefix="profile_fault_"))
    for name, engine in engines:
        try:
            if not args.no_trace:
                bench_engine.profile_decode(engine, 1, context, 8, str(out / name), listing=out / f"decode_{name}.txt")
            if args.phases:
                generate_by_phase(engine, name, context, new_tokens=8)
            bench_engine.profile_generate(engine, context, 8, str(out / f"generate_{name}"),
                                          out / f"generate_{name}.txt")
            print(f"{name}: ok", flush=True)
        except Exception as err:  # noqa: BLE001  (the fault is what this script reports)
            print(f"{name}: FAULT {err!r}"[:400], flush=True)


if __name__ == "__main__":
    main()
