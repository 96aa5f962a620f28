"""Host time to build the engine's decode programs: tracing (Python: the model's layers, each kernel's
body) and lowering for CUDA (StableHLO, each Pallas kernel's Triton IR), apart, without a GPU.

Qwen3-8B shapes (36 layers, ``--layers``) with a 5-layer block-16 drafter, the kernels on
(``attention_impl: pallas``, Triton lowering): the speculative engine's DFlash decode program and a
target-only engine's, at each ``--batches`` row count. No weights are allocated: the engine is built on
abstract modules (``nnx.eval_shape``) and the state is ``jax.eval_shape``'s. Off a GPU the kernels are
traced as they would be on one (``jax.default_backend`` reads "gpu" while tracing, an H200: Hopper's
launch signals) and lowered with ``lowering_platforms=("cuda",)``, as the kernel tests lower them; XLA
compiles nothing. ``--profile`` prints the cProfile of one speculative program's trace and lowering.

    JAX_PLATFORMS=cpu python3 bench/bench_lowering.py --json /tmp/lowering.json   # this CPU, ~1 min
    python3 bench/bench_lowering.py --json $OUT/lowering.json                     # on the H200, < 60 s
    JAX_PLATFORMS=cpu python3 bench/bench_lowering.py --tiny                      # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import time
from unittest import mock

import jax
from flax import nnx

import timing
from dflash_jax.models.drafter import Drafter
from dflash_jax.models.target import Target
from dflash_jax.runtime import engine as engine_module
from dflash_jax.runtime.engine import Engine, EngineConfig
from dflash_jax.tiny import tiny_drafter_config, tiny_target_config
from kernels_pallas import _pdl


def abstract_engine(tcfg, *, batch: int, max_length: int, speculative: bool, dtype,
                    gpu_lowering: str = "triton") -> Engine:
    """An ``Engine`` of the kernels on over abstract modules of ``tcfg`` (and a 5-layer block-16
    drafter): its serving layout is built by ``jax.eval_shape`` too, so no weight is allocated."""
    dcfg = tiny_drafter_config(tcfg, num_layers=5, block_size=16, mask_token_id=tcfg.vocab_size - 1)
    target = nnx.eval_shape(lambda: Target(tcfg, dtype=dtype, rngs=nnx.Rngs(0)))
    drafter = nnx.eval_shape(lambda: Drafter(dcfg, dtype=dtype, rngs=nnx.Rngs(1))) if speculative else None
    config = EngineConfig(max_batch_size=batch, max_length=max_length, attention_impl="pallas", decode_loop="until_done",
                          gpu_lowering=gpu_lowering)
    with mock.patch.object(engine_module, "serving_target", abstract_of(engine_module.serving_target)), \
            mock.patch.object(engine_module, "serving_drafter", abstract_of(engine_module.serving_drafter)):
        return Engine(target, drafter, config)


def abstract_of(convert):
    """``convert(module)`` on an abstract module, by ``nnx.eval_shape``."""
    return lambda module: nnx.eval_shape(convert, module)


@contextlib.contextmanager
def as_on_an_h200():
    """While tracing: the kernels' platform checks read a Hopper GPU (compiled kernels, not interpret mode)."""
    with mock.patch.object(jax, "default_backend", lambda: "gpu"), mock.patch.object(_pdl, "hopper_or_later",
                                                                                     lambda: True):
        yield


def trace_and_lower(engine: Engine, batch: int, context: int, steps: int):
    """``engine.decode_lowered`` of a state of ``batch`` rows at ``context``, for CUDA: (trace seconds,
    lower seconds, the lowered program)."""
    shapes = jax.eval_shape(lambda: timing.synthetic_state(engine, batch, context, seed=0))
    count, fixed = engine._step_count(steps)
    with as_on_an_h200():
        t0 = time.perf_counter()
        traced = engine._decode.trace(engine._target_state, engine._drafter_state, shapes, count,
                                      window=engine._window(None), fixed_steps=fixed, flags=engine_module.decoding.GREEDY_FLAGS)
        t1 = time.perf_counter()
        lowered = traced.lower(lowering_platforms=("cuda",))
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, lowered


def kernel_calls(lowered) -> dict[str, int]:
    """Custom calls of the lowered program by kernel name, and its private functions (shared lowerings)."""
    text = lowered.as_text()
    return {"triton_calls": text.count("custom_call @__gpu$xla.gpu.triton"),
            "mosaic_calls": text.count("custom_call @mosaic_gpu"),
            "functions": text.count("func.func private")}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=36, help="target layers (Qwen3-8B: 36)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=8, help="decode steps of a call (a dynamic count: no effect on the program)")
    ap.add_argument("--gpu-lowering", default="triton", choices=("triton", "mosaic"), help="EngineConfig.gpu_lowering")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a smoke test)")
    ap.add_argument("--profile", action="store_true", help="cProfile of the first speculative program")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import jax.numpy as jnp

    tcfg = tiny_target_config(num_layers=4) if args.tiny else timing.qwen3_8b(args.layers)
    batches = [int(b) for b in args.batches.split(",")]
    max_length = 2 * args.context
    print(timing.device_line(), flush=True)
    # Untimed: a program of another row count, so that the one-time imports and JAX's own first traces
    # are not charged to the first row (its kernels, of other shapes, share no trace with the rows').
    warm = abstract_engine(tcfg, batch=max(batches) + 1, max_length=max_length, speculative=True,
                           dtype=jnp.bfloat16, gpu_lowering=args.gpu_lowering)
    trace_and_lower(warm, max(batches) + 1, args.context, args.steps)
    rows = []
    for batch in batches:
        for speculative in (True, False):
            engine = abstract_engine(tcfg, batch=batch, max_length=max_length, speculative=speculative,
                                     dtype=jnp.bfloat16, gpu_lowering=args.gpu_lowering)
            profile = cProfile.Profile() if args.profile and speculative and not rows else None
            if profile is not None:
                profile.enable()
            trace_s, lower_s, lowered = trace_and_lower(engine, batch, args.context, args.steps)
            if profile is not None:
                profile.disable()
                pstats.Stats(profile).sort_stats("cumulative").print_stats(45)
                pstats.Stats(profile).sort_stats("tottime").print_stats(30)
            rows.append(dict(program="dflash" if speculative else "target", batch=batch, trace_s=trace_s,
                             lower_s=lower_s, **kernel_calls(lowered)))
            print(rows[-1], flush=True)
    print(f"\n{'program':8} {'batch':>5} {'trace s':>8} {'lower s':>8} {'total s':>8} {'triton':>7} {'mosaic':>7} {'funcs':>6}")
    for r in rows:
        print(f"{r['program']:8} {r['batch']:5d} {r['trace_s']:8.2f} {r['lower_s']:8.2f} "
              f"{r['trace_s'] + r['lower_s']:8.2f} {r['triton_calls']:7d} {r['mosaic_calls']:7d} {r['functions']:6d}")
    timing.write_json(args.json, dict(config=vars(args), device=timing.device_line(), results=rows))


if __name__ == "__main__":
    main()
