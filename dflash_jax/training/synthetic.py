"""Self-generated training data: the target's own greedy answers to random-token prompts.

This is the published data recipe (train on what the target itself says) in miniature, with no
tokenizer and no files: tiny demos and tests use it; real runs regenerate answers to real prompts
with ``serve.py generate --no-draft`` (see docs/training.md).
"""

from __future__ import annotations

import numpy as np

from dflash_jax.training.config import SelfGeneratedConfig


def random_prompts(n: int, length: int, vocab: int, seed: int, exclude: tuple[int, ...] = ()) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab), np.asarray(exclude, np.int64))
    return rng.choice(allowed, size=(n, length)).tolist()


def self_generated(target, cfg: SelfGeneratedConfig, *, exclude: tuple[int, ...] = (), batch: int = 64):
    """``(records, eval_prompts)``: ``{"input_ids", "loss_mask"}`` records (the prompt unsupervised,
    the target's greedy continuation supervised) and held-out prompts (token ids)."""
    from dflash_jax.runtime.engine import generate

    total = cfg.num_examples + cfg.eval_prompts
    prompts = random_prompts(total, cfg.prompt_len, target.config.vocab_size, cfg.seed, exclude)
    train_prompts, eval_prompts = prompts[: cfg.num_examples], prompts[cfg.num_examples:]
    records = []
    for i in range(0, len(train_prompts), batch):
        chunk = train_prompts[i:i + batch]
        for prompt, result in zip(chunk, generate(target, None, chunk, cfg.new_tokens)):
            out = [int(t) for t in result.output_ids]
            records.append({
                "input_ids": list(prompt) + out,
                "loss_mask": [0] * len(prompt) + [1] * len(out),
            })
    return records, eval_prompts


def cycle_permutation(vocab: int, period: int, seed: int, fixed: tuple[int, ...] = ()) -> np.ndarray:
    """A permutation of ``range(vocab)`` made of cycles of length ``period`` (``fixed`` ids, and the
    leftover when ``period`` does not divide the rest, map to themselves)."""
    rng = np.random.default_rng(seed)
    perm = np.arange(vocab)
    free = rng.permutation(np.setdiff1d(np.arange(vocab), np.asarray(fixed, np.int64)))
    usable = len(free) - len(free) % period
    for i in range(0, usable, period):
        cyc = free[i:i + period]
        perm[cyc] = np.roll(cyc, -1)
    return perm


def pattern_target(period: int = 3, *, seed: int = 0, model_type: str = "qwen3", dtype=None):
    """A tiny target whose greedy continuation follows a fixed permutation with cycles of ``period``.

    Its layers are random but scaled down, so that its hidden states still depend on the context
    while its greedy next token is ``perm[last token]`` (the LM head is the embedding table
    permuted). The last vocabulary id (the drafter's MASK) maps to itself. Returns
    ``(target, perm)``. A learnable task for tests and the tiny demo: a drafter can reach a high
    acceptance length only by learning the pattern from the target's taps and the anchor.
    """
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from dflash_jax.tiny import random_target, tiny_target_config

    cfg = tiny_target_config(model_type)
    target = random_target(cfg, seed=seed, dtype=jnp.float32 if dtype is None else dtype)
    perm = cycle_permutation(cfg.vocab_size, period, seed, fixed=(cfg.vocab_size - 1,))
    inverse = np.argsort(perm)
    state = nnx.state(target, nnx.Param)
    flat = []
    for path, var in nnx.to_flat_state(state):
        name = str(path[-1])
        value = var.get_value()
        if name in ("o_proj", "down_proj"):
            value = value * 0.003
        if name == "lm_head":
            emb = target.embed_tokens.get_value()
            value = jnp.asarray(emb[inverse].T / (jnp.std(emb) ** 2 * cfg.hidden_size) * 6.0, value.dtype)
        if path[0] == "norm":
            value = jnp.ones_like(value)
        flat.append((path, var.replace(value)))
    nnx.update(target, nnx.from_flat_state(flat))
    del jax
    return target, perm


def pattern_records(perm: np.ndarray, num: int, prompt_len: int, new_tokens: int, seed: int,
                    exclude: tuple[int, ...] = ()) -> tuple[list[dict], list[list[int]]]:
    """Records of random prompts continued by ``perm`` (what a ``pattern_target`` says greedily)."""
    prompts = random_prompts(num, prompt_len, len(perm), seed, exclude)
    records = []
    for p in prompts:
        seq = list(p)
        for _ in range(new_tokens):
            seq.append(int(perm[seq[-1]]))
        records.append({"input_ids": seq, "loss_mask": [0] * len(p) + [1] * new_tokens})
    return records, prompts
