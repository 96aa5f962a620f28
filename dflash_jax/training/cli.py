"""``train.py`` / ``dflash-train``: train a DFlash drafter, or export a training checkpoint to the z-lab format.

    python train.py --config configs/train_tiny.yaml [key=value ...] [--resume]
    python train.py export --checkpoint runs/tiny --output out/tiny-drafter [--step N] [--dtype bfloat16]
    python train.py pretrain --config configs/embedded_target.yaml [key=value ...]   # a small target LM

A run resumes automatically when its output_dir already has checkpoints; ``--resume`` makes that
a requirement. See docs/training.md.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="train.py", description="Train a DFlash drafter.")
    parser.add_argument("--config", required=True, help="YAML recipe (configs/*.yaml)")
    parser.add_argument("--resume", action="store_true", help="require resuming from output_dir's latest checkpoint")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many more optimizer steps")
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also print the frameworks' INFO and WARNING lines (JAX, XLA, absl, Orbax)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. optim.lr=0.0003 steps=100")
    args = parser.parse_args(argv)
    from dflash_jax.verbosity import configure_logging

    configure_logging(verbose=args.verbose)
    if args.max_steps is not None and args.max_steps < 1:
        print(f"error: --max-steps must be >= 1, got {args.max_steps}", file=sys.stderr)
        return 2

    from dflash_jax.training.config import ConfigError, load_train_config

    try:
        config = load_train_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    from dflash_jax.runtime.compile_cache import cache_report, use_compilation_cache
    from dflash_jax.models.config import ModelConfigError
    from dflash_jax.io.tokenizer import TokenizerError
    from dflash_jax.io.orbax import CheckpointError
    from dflash_jax.training.data import DataError
    from dflash_jax.training.run import NonFiniteError, train

    if config.compilation_cache_dir is not None:  # checked before the target loads
        try:
            use_compilation_cache(config.compilation_cache_dir)
        except ValueError as err:
            print(f"config error: {err}", file=sys.stderr)
            return 2
    print_destinations(config)
    t0 = time.perf_counter()
    try:
        result = train(config, resume=True if args.resume else None, max_steps=args.max_steps)
    except ConfigError as err:  # a setting that conflicts with the target, the drafter or the run's saved config
        print(f"config error: {err}", file=sys.stderr)
        return 2
    # --resume without a checkpoint, missing files, bad model/tokenizer/data files, a damaged checkpoint
    except (FileNotFoundError, FileExistsError, ModelConfigError, TokenizerError, DataError, CheckpointError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except NonFiniteError as err:  # the run diverged; the kept checkpoints are finite
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # train() has waited for a checkpoint being written: the kept ones are whole
        print_interrupted(config)
        return 130
    print_summary(config, result, time.perf_counter() - t0,
                  cache_report() if config.compilation_cache_dir is not None else None)
    return 0


def print_destinations(config) -> None:
    """Where the run writes, before it starts."""
    run = Path(config.output_dir)
    print(f"train.py: run directory {run}")
    print(f"  checkpoints  {run / 'checkpoints'}  (every {config.save_every} steps and at the end; the last "
          f"{config.keep} kept)")
    print(f"  metrics      {run / 'metrics.jsonl'}  (one JSON line per log_every={config.log_every} steps and per eval)")
    if config.tensorboard:
        print(f"  TensorBoard  {run / 'tb'}  (tensorboard --logdir {run / 'tb'})")
    print(f"  config       {run / 'config.yaml'}, {run / 'drafter_config.json'}", flush=True)


def print_interrupted(config) -> None:
    """What a run stopped by Ctrl-C kept, and how to go on from it."""
    from dflash_jax.io.orbax import step_dirs

    run = Path(config.output_dir)
    kept = step_dirs(run)
    if kept:
        print(f"train.py: interrupted; checkpoints kept in {run / 'checkpoints'}: steps {', '.join(map(str, kept))}; "
              f"run the same command again to resume from step {kept[-1]}", file=sys.stderr)
    else:
        print(f"train.py: interrupted before the first checkpoint (every save_every={config.save_every} steps); "
              "running the same command again starts from step 0", file=sys.stderr)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h {minutes:02d}m {secs:02d}s" if hours else f"{minutes}m {secs:02d}s" if minutes else f"{seconds:.1f}s"


def print_summary(config, result: dict, seconds: float, cache: dict | None) -> None:
    """The run's outcome, a few lines a person reads: steps, losses, tau, time, checkpoints, export."""
    from dflash_jax.io.orbax import step_dirs
    from dflash_jax.training.monitor import read_metrics

    run = Path(config.output_dir)
    steps, start = result["steps"], result.get("resumed_from") or 0
    history = read_metrics(run)
    if result.get("already_complete"):
        print(f"train.py: run already complete at step {steps} (raise `steps` to continue); nothing was trained "
              "or evaluated again")
    else:
        which = f"steps {start + 1}-{steps} of {config.steps} (resumed from step {start})" if start else \
            f"{steps} steps of {config.steps}"
        print(f"train.py: done: {which} in {_duration(seconds)}")
    train, evaluation = result["train"] or history["train"], result["eval"] or history["eval"]
    if "loss" in train:
        best = history["best_loss"]
        best_text = f", best {best:.4f} (step {history['best_loss_step']})" if best is not None else ""
        print(f"  loss         final {train['loss']:.4f} (step {train.get('step', steps)}){best_text}")
    if "tau" in evaluation:
        print(f"  eval tau     {evaluation['tau']:.3f} (step {evaluation.get('step', steps)}; tokens committed per "
              "DFlash step with the serving engine)")
    kept = step_dirs(run)
    if kept:
        print(f"  checkpoint   {run / 'checkpoints' / str(kept[-1])}  (last; kept: {', '.join(map(str, kept))})")
        print(f"  export       python train.py export --checkpoint {run} --output DIR   (z-lab format, for serve.py "
              "--draft DIR)")
    print(f"  metrics      {run / 'metrics.jsonl'}")
    if cache is not None:
        print(f"  compilation cache {cache['dir']}: {cache['loaded']} programs loaded, {cache['compiled']} compiled")


def _export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="train.py export", description="Export a training checkpoint (z-lab format).")
    parser.add_argument("--checkpoint", required=True, help="run directory, its checkpoints/ or checkpoints/<step>")
    parser.add_argument("--output", required=True, help="directory for config.json + model.safetensors")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    args = parser.parse_args(argv)
    from dflash_jax.models.config import ModelConfigError
    from dflash_jax.io.orbax import CheckpointError
    from dflash_jax.training.checkpointing import export_checkpoint

    if Path(args.output).exists() and not Path(args.output).is_dir():
        print(f"error: --output {args.output}: exists and is not a directory", file=sys.stderr)
        return 2
    try:
        out = export_checkpoint(args.checkpoint, args.output, step=args.step, dtype=args.dtype)
    except (FileNotFoundError, CheckpointError, ModelConfigError) as err:  # ModelConfigError: a bad drafter_config.json
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out}/config.json and {out}/model.safetensors")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "export":
        return _export(argv[1:])
    if argv and argv[0] == "pretrain":  # next-token pretraining of a small target (the embedded default)
        from dflash_jax.training.pretrain import main as pretrain_main

        return pretrain_main(argv[1:])
    if argv and argv[0] == "train":
        argv = argv[1:]
    return _train(argv)

