"""``train.py`` / ``dflash-train``: train a DFlash drafter, or export a training checkpoint to the z-lab format.

    python train.py --config configs/train_tiny.yaml [key=value ...] [--resume]
    python train.py export --checkpoint runs/tiny --output out/tiny-drafter [--step N] [--dtype bfloat16]
    python train.py pretrain --config configs/embedded_target.yaml [key=value ...]   # a small target LM

A run resumes automatically when its output_dir already has checkpoints; ``--resume`` makes that
a requirement. See docs/training.md.
"""

from __future__ import annotations

import argparse
import json
import sys


def _train(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="train.py", description="Train a DFlash drafter.")
    parser.add_argument("--config", required=True, help="YAML recipe (configs/*.yaml)")
    parser.add_argument("--resume", action="store_true", help="require resuming from output_dir's latest checkpoint")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many more optimizer steps")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. optim.lr=0.0003 steps=100")
    args = parser.parse_args(argv)
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
    summary = {"steps": result["steps"], "train": result["train"], "eval": result["eval"]}
    if config.compilation_cache_dir is not None:
        summary["compilation_cache"] = cache_report()
    print(json.dumps(summary, default=float))
    return 0


def _export(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="train.py export", description="Export a training checkpoint (z-lab format).")
    parser.add_argument("--checkpoint", required=True, help="run directory, its checkpoints/ or checkpoints/<step>")
    parser.add_argument("--output", required=True, help="directory for config.json + model.safetensors")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    args = parser.parse_args(argv)
    from pathlib import Path

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

