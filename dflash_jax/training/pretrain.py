"""Target pretraining: a small Qwen3-architecture LM trained with next-token cross-entropy.

    python -m dflash_jax.training.pretrain --config configs/embedded_target.yaml [key=value ...]

The embedded default's target (``dflash_jax.training.embedded_build``) is trained with this on the running
interpreter's standard-library sources (plus, with ``data.instruct_share``, chat-formatted "write a
function" examples made from the same files). The corpus is tokenized once into a single token stream
(documents joined by the tokenizer's EOS) that lives on the device; every step samples ``batch_size``
random windows of ``seq_len + 1`` tokens inside the jitted step (``jax.random``, seeded by ``seed`` and the
step), so the host never feeds the accelerator. The step: ``Target.forward(ids)`` in ``compute_dtype``
(float32 master weights and AdamW state, ``dflash_jax.training.optim``: warmup, cosine, clipping) ->
float32 logits -> mean CE. The held-out loss is measured every ``eval_every`` steps on fixed windows of
the held-out split; with ``keep_best`` the exported weights are those of the best held-out loss, and
``early_stop_patience`` evaluations without improvement end the run (the corpus is small: past a few
epochs the model memorises it). At the end the model is written in HF format with
``dflash_jax.io.checkpoint.save_target`` (plus the tokenizer files) to ``export_dir``; metrics (with
tokens/s) go to ``<output_dir>/metrics.jsonl`` and the resolved config to ``<output_dir>/config.yaml``.

There is no mid-run checkpoint / resume: the embedded target trains in minutes.
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
    corpus: str = "stdlib"  # "stdlib": the train split of dflash_jax.training.stdlib_corpus; else a directory of .py/.txt files
    seq_len: int = 256
    batch_size: int = 16
    eval_windows: int = 64  # fixed held-out windows for the eval loss ("stdlib" corpus only)
    # Share of the train tokens that are chat-formatted "write a function" examples ("stdlib" corpus and a
    # tokenizer with a chat template only; 0: none).
    instruct_share: float = 0.0
    max_files: int = 0  # "stdlib": only the first N files of each split (0: all; for quick checks)

    def validate(self) -> None:
        if self.seq_len < 1 or self.batch_size < 1 or self.eval_windows < 0:
            raise ValueError("data.seq_len and data.batch_size must be >= 1 and data.eval_windows >= 0")
        if not 0.0 <= self.instruct_share < 1.0:
            raise ValueError(f"data.instruct_share must be in [0, 1), got {self.instruct_share}")
        if self.max_files < 0:
            raise ValueError(f"data.max_files must be >= 0 (0: all), got {self.max_files}")
        if self.corpus != "stdlib":
            root = Path(self.corpus)
            if not root.is_dir():
                raise ValueError(f"data.corpus: {self.corpus}: no such directory (or \"stdlib\")")
            if not any(p.suffix in CORPUS_SUFFIXES and p.is_file() for p in root.rglob("*")):
                raise ValueError(f"data.corpus: {self.corpus}: holds no {' or '.join(CORPUS_SUFFIXES)} files")
            if self.instruct_share:
                raise ValueError(f"data.instruct_share={self.instruct_share} needs data.corpus: stdlib (the chat "
                                 f"examples are made from its functions); set data.instruct_share=0 for {self.corpus}")


@dataclasses.dataclass(frozen=True)
class PretrainConfig:
    tokenizer: str = ""  # directory with tokenizer.json (+ tokenizer_config.json)
    model: TargetShapeConfig = dataclasses.field(default_factory=TargetShapeConfig)
    data: PretrainDataConfig = dataclasses.field(default_factory=PretrainDataConfig)
    optim: OptimConfig = dataclasses.field(default_factory=lambda: OptimConfig(lr=3e-3, weight_decay=0.1))
    output_dir: str = "runs/pretrain"
    export_dir: str | None = None  # HF directory for the final model (default: <output_dir>/hf)
    export_dtype: str = "float32"
    export_shard_mb: float = 0.0  # > 0: the export split into safetensors shards of at most this many MiB
    compute_dtype: str = "float32"  # activations / matmul inputs ("bfloat16" on accelerators)
    steps: int = 2000
    seed: int = 0
    log_every: int = 50
    eval_every: int = 500  # 0: only at the end
    keep_best: bool = True  # export the weights of the lowest held-out loss (else the last)
    early_stop_patience: int = 0  # stop after this many evaluations without a better held-out loss (0: never)

    def validate(self) -> None:
        if not self.tokenizer:
            raise ValueError("tokenizer (a directory with tokenizer.json) is required")
        if self.steps < 1 or self.log_every < 1:
            raise ValueError("steps and log_every must be >= 1")
        if self.eval_every < 0:
            raise ValueError(f"eval_every must be >= 0 (0: only at the end), got {self.eval_every}")
        if self.early_stop_patience < 0:
            raise ValueError(f"early_stop_patience must be >= 0 (0: never), got {self.early_stop_patience}")
        if self.export_shard_mb < 0:
            raise ValueError(f"export_shard_mb must be >= 0 (0: one file), got {self.export_shard_mb}")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"compute_dtype must be float32 or bfloat16, got {self.compute_dtype!r}")
        if self.export_dtype not in EXPORT_DTYPES:  # checked now, not after the whole run has trained
            raise ValueError(f"export_dtype must be one of {list(EXPORT_DTYPES)}, got {self.export_dtype!r}")


def load_pretrain_config(path, overrides=()) -> PretrainConfig:
    return load_config(PretrainConfig, path, overrides)


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def token_stream(texts, tokenizer, eos_id: int) -> np.ndarray:
    """All texts tokenized (no special tokens; in parallel threads) and joined by ``eos_id`` (also after
    the last)."""
    ids = []
    for doc in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(doc)
        ids.append(eos_id)
    return np.asarray(ids, np.int32)


def corpus(config: PretrainConfig, split: str, tokenizer=None) -> list[str]:
    """The documents of ``split``: the stdlib files (interleaved, with ``data.instruct_share``, with
    chat-formatted instruction examples rendered by ``tokenizer``'s chat template), or the ``.py`` /
    ``.txt`` files of the ``data.corpus`` directory (train split only)."""
    if config.data.corpus == "stdlib":
        from dflash_jax.training.stdlib_corpus import corpus_texts, instruction_texts, mix_documents

        code = corpus_texts(split, config.data.max_files)
        if not config.data.instruct_share:
            return code
        chats = instruction_texts(tokenizer, split, config.data.max_files, seed=config.seed)
        return mix_documents(code, chats, config.data.instruct_share, seed=config.seed)
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


def make_steps(graphdef, optimizer, batch_size: int, window: int, compute_dtype: str = "float32"):
    """``train_step(params, rest, opt_state, stream, key)`` (samples ``batch_size`` windows of ``window``
    tokens from the device-resident ``stream`` itself) and ``eval_step(params, rest, windows)``."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from dflash_jax.training.optim import global_norm

    dt = jnp.dtype(compute_dtype)

    def loss_fn(params, rest, batch):
        # float32 master weights, cast once per step: the matmuls run in compute_dtype, the gradients
        # flow back to the float32 copies.
        cast = jax.tree.map(lambda x: x.astype(dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
        model = nnx.merge(graphdef, cast, rest)
        logits, _ = model.forward(batch[:, :-1])
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch[:, 1:])
        return ce.mean()

    @jax.jit
    def train_step(params, rest, opt_state, stream, key):
        starts = jax.random.randint(key, (batch_size,), 0, stream.shape[0] - window + 1)
        batch = stream[starts[:, None] + jnp.arange(window)[None, :]]
        loss, grads = jax.value_and_grad(loss_fn)(params, rest, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": global_norm(grads)}

    eval_step = jax.jit(loss_fn)
    return train_step, eval_step


def pretrain(config: PretrainConfig) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dflash_jax.io.checkpoint import save_target, shard_safetensors
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
    # The document separator is the tokenizer's own EOS (a chat model also stops on its end-of-turn token).
    separator = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else eos_ids[0]
    vocab = tokenizer.vocab_size

    t0 = time.time()
    train = token_stream(corpus(config, "train", tokenizer), tokenizer, separator)
    held = token_stream(corpus(config, "heldout", tokenizer), tokenizer, separator)
    h_uni = unigram_entropy(train, vocab)
    print(f"corpus: {len(train)} train tokens, {len(held)} held-out tokens "
          f"({time.time() - t0:.1f}s); unigram entropy {h_uni:.3f} nats", flush=True)

    L = config.data.seq_len + 1
    if len(train) <= L:
        raise ConfigError(f"data.corpus: {config.data.corpus}: {len(train)} tokens, too few for one window of "
                          f"data.seq_len + 1 = {L}")

    target = build_target(config, vocab, eos_ids)
    graphdef, params, rest = nnx.split(target, nnx.Param, ...)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    print(f"target: {n_params / 1e6:.2f}M parameters, {target.config}", flush=True)
    optimizer = make_optimizer(config.optim, config.steps)
    opt_state = optimizer.init(params)
    schedule = lr_schedule(config.optim, config.steps)
    train_step, eval_step = make_steps(graphdef, optimizer, config.data.batch_size, L, config.compute_dtype)
    stream = jnp.asarray(train)
    tokens_per_step = config.data.batch_size * config.data.seq_len
    epoch_tokens = max(len(train) - L, 1)

    eval_batches = []
    if len(held) > L and config.data.eval_windows:
        erng = np.random.default_rng(12345)
        w = sample_windows(held, config.data.eval_windows, L, erng)
        eval_batches = [jnp.asarray(w[i: i + config.data.batch_size]) for i in range(0, len(w), config.data.batch_size)]

    def evaluate():
        if not eval_batches:
            return None
        return float(np.mean([float(eval_step(params, rest, b)) for b in eval_batches]))

    metrics_path = out_dir / "metrics.jsonl"
    metrics_file = open(metrics_path, "w")
    base_key = jax.random.key(config.seed)
    losses, t_start, t_log, log_steps = [], time.time(), time.time(), 0
    eval_loss = best_loss = None
    best_params, best_step, stale, loss, step = params, 0, 0, float("nan"), 0
    for step in range(1, config.steps + 1):
        params, opt_state, m = train_step(params, rest, opt_state, stream, jax.random.fold_in(base_key, step))
        losses.append(m["loss"])
        log_steps += 1
        last = step == config.steps
        evaluating = (config.eval_every and step % config.eval_every == 0) or last
        if step % config.log_every == 0 or evaluating:
            loss = float(np.mean([float(x) for x in losses]))  # the host sync: the timing below is real
            losses = []
            now = time.time()
            row = {"step": step, "loss": loss, "grad_norm": float(m["grad_norm"]), "lr": float(schedule(step - 1)),
                   "epoch": step * tokens_per_step / epoch_tokens,
                   "tokens_per_s": log_steps * tokens_per_step / (now - t_log), "elapsed_s": now - t_start}
            if evaluating:
                eval_loss = evaluate()
                row["eval_loss"] = eval_loss
                if eval_loss is not None and (best_loss is None or eval_loss < best_loss):
                    best_loss, best_params, best_step, stale = eval_loss, params, step, 0
                else:
                    stale += 1
            print(json.dumps(row), flush=True)
            metrics_file.write(json.dumps(row) + "\n")
            metrics_file.flush()
            t_log, log_steps = time.time(), 0  # evaluation time is not training throughput
            if evaluating and config.early_stop_patience and stale >= config.early_stop_patience:
                print(f"early stop at step {step}: no better held-out loss for {stale} evaluations "
                      f"(best {best_loss:.4f} at step {best_step})", flush=True)
                break
    metrics_file.close()
    wall = time.time() - t_start

    chosen = best_params if (config.keep_best and best_loss is not None) else params
    trained = nnx.merge(graphdef, chosen, rest)
    save_target(trained, export_dir, dtype=None if config.export_dtype == "float32" else config.export_dtype)
    from dflash_jax.training.stdlib_corpus import copy_tokenizer

    if config.export_shard_mb:
        shard_safetensors(export_dir, int(config.export_shard_mb * 2**20))
    copy_tokenizer(config.tokenizer, export_dir)
    summary = {"params": n_params, "train_tokens": int(len(train)), "heldout_tokens": int(len(held)),
               "unigram_entropy": h_uni, "final_train_loss": loss, "final_eval_loss": eval_loss,
               "best_eval_loss": best_loss, "best_step": best_step,
               "exported_step": best_step if chosen is best_params else step, "steps": step,
               "epochs": step * tokens_per_step / epoch_tokens, "wall_s": wall,
               "tokens_per_s": step * tokens_per_step / wall, "export_dir": str(export_dir)}
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
