"""Target pretraining: a small Qwen3-architecture LM trained with next-token cross-entropy.

    python -m dflash_jax.training.pretrain --config configs/embedded_target.yaml [key=value ...]

The embedded default's target (``dflash_jax.training.embedded_build``) is trained with this on the running
interpreter's standard-library sources. The corpus is tokenized once into a single token stream
(files joined by the tokenizer's EOS); every step samples ``batch_size`` random windows of
``seq_len + 1`` tokens (numpy, seeded by ``seed`` and the step). The step is one jitted function:
``Target.forward(ids)`` -> logits -> mean CE -> AdamW (``dflash_jax.training.optim``: warmup, cosine,
clipping), float32 throughout. At the end the model is written in HF format with
``dflash_jax.io.checkpoint.save_target`` (plus the tokenizer files) to ``export_dir``; metrics go to
``<output_dir>/metrics.jsonl`` and the resolved config to ``<output_dir>/config.yaml``.

There is no mid-run checkpoint / resume: the embedded target trains in about ten CPU minutes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

from dflash_jax.io.config import ConfigError, load_config, save_config
from dflash_jax.training.config import OptimConfig


CORPUS_SUFFIXES = (".py", ".txt")
EXPORT_DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class TargetShapeConfig:
    vocab_size: int = 0  # 0: the tokenizer's vocabulary size
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    init_seed: int = 0


@dataclasses.dataclass(frozen=True)
class PretrainDataConfig:
    corpus: str = "stdlib"  # "stdlib": the train split of dflash_jax.training.embedded_build; else a directory of .py/.txt files
    seq_len: int = 256
    batch_size: int = 16
    eval_windows: int = 64  # fixed held-out windows for the eval loss ("stdlib" corpus only)

    def validate(self) -> None:
        if self.seq_len < 1 or self.batch_size < 1 or self.eval_windows < 0:
            raise ValueError("data.seq_len and data.batch_size must be >= 1 and data.eval_windows >= 0")
        if self.corpus != "stdlib":
            root = Path(self.corpus)
            if not root.is_dir():
                raise ValueError(f"data.corpus: {self.corpus}: no such directory (or \"stdlib\")")
            if not any(p.suffix in CORPUS_SUFFIXES and p.is_file() for p in root.rglob("*")):
                raise ValueError(f"data.corpus: {self.corpus}: holds no {' or '.join(CORPUS_SUFFIXES)} files")


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    tokenizer: str = ""  # directory with tokenizer.json (+ tokenizer_config.json)
    model: TargetShapeConfig = dataclasses.field(default_factory=TargetShapeConfig)
    data: PretrainDataConfig = dataclasses.field(default_factory=PretrainDataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=3e-3, weight_decay=0.1))
    output_dir: str = "runs/pretrain"
    export_dir: str | None = None  # HF directory for the final model (default: <output_dir>/hf)
    export_dtype: str = "float32"
    steps: int = 2000
    seed: int = 0
    log_every: int = 50
    eval_every: int = 500  # 0: only at the end

    def validate(self) -> None:
        if not self.tokenizer:
            raise ValueError("tokenizer (a directory with tokenizer.json) is required")
        if self.steps < 1 or self.log_every < 1:
            raise ValueError("steps and log_every must be >= 1")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0 (0: only at the end), got {self.eval_every}")
        if self.export_dtype not in EXPORT_DTYPES:  # checked now, not after the whole run has trained
            raise ValueError(f"export_dtype must be one of {list(EXPORT_DTYPES)}, got {self.export_dtype!r}")


def load_pretrain_config(path, overrides=()) -> PretrainConfig:
    return load_config(PretrainConfig, path, overrides)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def token_stream(texts, tokenizer, eos_id: int) -> np.ndarray:
    """All texts tokenized (no special tokens) and joined by ``eos_id`` (also after the last)."""
    ids = []
    for text in texts:
        ids.extend(tokenizer.encode(text, add_special_tokens=False))
        ids.append(eos_id)
    return np.asarray(ids, np.int32)


def corpus(config: PretrainConfig, split: str) -> list[str]:
    if config.data.corpus == "stdlib":
        from dflash_jax.training.embedded_build import corpus_texts

        return corpus_texts(split)
    if split != "train":
        return []
    root = Path(config.data.corpus)
    return [p.read_text(encoding="utf-8", errors="replace") for p in sorted(root.rglob("*"))
            if p.suffix in CORPUS_SUFFIXES and p.is_file()]


def sample_windows(stream: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    starts = rng.integers(0, len(stream) - length, size=batch)
    return np.stack([stream[s: s + length] for s in starts])


def unigram_entropy(stream: np.ndarray, vocab: int) -> float:
    counts = np.bincount(stream, minlength=vocab).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


# ---------------------------------------------------------------------------------------------
# Model and step
# ---------------------------------------------------------------------------------------------


def build_target(config: PretrainConfig, vocab_size: int, eos_ids: tuple[int, ...]):
    import jax.numpy as jnp
    from flax import nnx

    from dflash_jax.models.config import TargetConfig
    from dflash_jax.models.target import Target

    m = config.model
    tcfg = TargetConfig(
        vocab_size=m.vocab_size or vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
        rms_norm_eps=m.rms_norm_eps, rope_theta=m.rope_theta, qk_norm=True, model_type="qwen3",
        tie_word_embeddings=m.tie_word_embeddings, max_position_embeddings=m.max_position_embeddings,
        eos_token_ids=tuple(eos_ids),
    )
    tcfg.validate("pretrain model")
    return Target(tcfg, dtype=jnp.float32, rngs=nnx.Rngs(m.init_seed))


def make_steps(graphdef, optimizer):
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    def loss_fn(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        logits, _ = model.forward(batch[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch[:, 1:])
        return ce.mean()

    @jax.jit
    def train_step(params, rest, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, rest, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": optax.global_norm(grads)}

    eval_step = jax.jit(loss_fn)
    return train_step, eval_step


def pretrain(config: PretrainConfig) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dflash_jax.io.checkpoint import save_target
    from dflash_jax.io.tokenizer import Tokenizer
    from dflash_jax.training.optim import lr_schedule, make_optimizer

    out_dir = Path(config.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_config(config, out_dir / "config.yaml")
    export_dir = Path(config.export_dir) if config.export_dir else out_dir / "hf"

    tokenizer = Tokenizer(config.tokenizer)
    eos_ids = tuple(tokenizer.stop_token_ids)
    if not eos_ids:
        raise ValueError(f"{config.tokenizer}: the tokenizer has no eos_token")
    vocab = tokenizer.vocab_size

    t0 = time.time()
    train = token_stream(corpus(config, "train"), tokenizer, eos_ids[0])
    held = token_stream(corpus(config, "heldout"), tokenizer, eos_ids[0])
    h_uni = unigram_entropy(train, vocab)
    print(f"corpus: {len(train)} train tokens, {len(held)} held-out tokens "
          f"({time.time() - t0:.1f}s); unigram entropy {h_uni:.3f} nats", flush=True)

    if len(train) <= config.data.seq_len + 1:
        raise ConfigError(f"data.corpus: {config.data.corpus}: {len(train)} tokens, too few for one window of "
                          f"data.seq_len + 1 = {config.data.seq_len + 1}")

    target = build_target(config, vocab, eos_ids)
    graphdef, params, rest = nnx.split(target, nnx.Param, ...)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    print(f"target: {n_params / 1e6:.2f}M parameters, {target.config}", flush=True)
    optimizer = make_optimizer(config.optim, config.steps)
    opt_state = optimizer.init(params)
    schedule = lr_schedule(config.optim, config.steps)
    train_step, eval_step = make_steps(graphdef, optimizer)

    L = config.data.seq_len + 1
    eval_batches = []
    if len(held) > L and config.data.eval_windows:
        erng = np.random.default_rng(12345)
        w = sample_windows(held, config.data.eval_windows, L, erng)
        eval_batches = [w[i: i + config.data.batch_size] for i in range(0, len(w), config.data.batch_size)]

    def evaluate():
        if not eval_batches:
            return None
        return float(np.mean([float(eval_step(params, rest, jnp.asarray(b))) for b in eval_batches]))

    metrics_path = out_dir / "metrics.jsonl"
    metrics_file = open(metrics_path, "w")
    rng = np.random.default_rng(config.seed)
    losses, t_start, t_log = [], time.time(), time.time()
    eval_loss = None
    for step in range(1, config.steps + 1):
        batch = jnp.asarray(sample_windows(train, config.data.batch_size, L, rng))
        params, opt_state, m = train_step(params, rest, opt_state, batch)
        losses.append(m["loss"])
        if step % config.log_every == 0 or step == config.steps:
            loss = float(np.mean([float(x) for x in losses]))
            losses = []
            now = time.time()
            row = {"step": step, "loss": loss, "grad_norm": float(m["grad_norm"]), "lr": float(schedule(step - 1)),
                   "tokens_per_s": config.log_every * config.data.batch_size * (L - 1) / (now - t_log),
                   "elapsed_s": now - t_start}
            t_log = now
            if (config.eval_every and step % config.eval_every == 0) or step == config.steps:
                eval_loss = evaluate()
                row["eval_loss"] = eval_loss
            print(json.dumps(row), flush=True)
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()
    metrics_file.close()

    trained = nnx.merge(graphdef, params, rest)
    save_target(trained, export_dir, dtype=None if config.export_dtype == "float32" else config.export_dtype)
    from dflash_jax.training.embedded_build import copy_tokenizer

    copy_tokenizer(config.tokenizer, export_dir)
    summary = {"params": n_params, "train_tokens": int(len(train)), "unigram_entropy": h_uni,
               "final_train_loss": loss, "final_eval_loss": eval_loss, "steps": config.steps,
               "wall_s": time.time() - t_start, "export_dir": str(export_dir)}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary), flush=True)
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pretrain", description="Pretrain a small Qwen3 target (next-token CE).")
    parser.add_argument("--config", required=True, help="YAML recipe (configs/embedded_target.yaml)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. steps=100 optim.lr=1e-3")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = load_pretrain_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    from dflash_jax.io.tokenizer import TokenizerError

    try:
        pretrain(config)
    except ConfigError as err:  # a corpus too small for data.seq_len
        print(f"config error: {err}", file=sys.stderr)
        return 2
    except TokenizerError as err:  # a missing or malformed tokenizer directory
        print(f"error: tokenizer: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
