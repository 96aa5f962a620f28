"""Builds the embedded default pair: a Qwen3 code model that also chats, and its DFlash and DFlash2
drafters, trained here on the running interpreter's own standard-library sources (text every machine has).

    python -m dflash_jax.training.embedded_build --output models/embedded [--work runs/embedded_build]
        [--tiny] [--until STAGE] [--pack DIR]

Everything runs in this one process (one JAX client, so an accelerator's memory is not claimed twice).
Stages (each skipped when its output already exists, ``--force STAGE`` redoes it and what follows):

1. ``tokenizer``: a byte-level BPE (``tokenizers``) trained on the train split, with ``<|endoftext|>``
   (EOS, also the separator between documents), ``<|mask|>`` (the drafter's mask token) and the ChatML
   role markers ``<|im_start|>`` / ``<|im_end|>``; ``tokenizer_config.json`` carries a ChatML
   ``chat_template`` and ``generation_config.json`` lists both ``<|endoftext|>`` and ``<|im_end|>`` as
   stop tokens.
2. ``target``: ``dflash_jax.training.pretrain`` with ``configs/embedded_target.yaml`` (next-token CE on the
   train split, a share of it chat-formatted "write a function" examples; the weights of the best
   held-out loss) -> ``<output>/target`` (HF format, bfloat16, sharded, + tokenizer files).
3. ``answers``: prompts cut from the drafter split, text the target never trained on (windows from random
   lines, signatures + docstrings, and chat requests), answered greedily by the shipped target itself
   with the batched ``Engine``.
4. ``drafter``: the project's trainer (``train.py --config configs/embedded_drafter.yaml``, in-process)
   on those answers; the checkpoint of the best held-out tau -> ``<output>/drafter`` (z-lab format).
5. ``drafter2``: the same recipe on the same answers with ``drafter.kind=dflash2``
   (``DRAFTER2_OVERRIDES``), started from the trained DFlash drafter (``model.drafter``); the checkpoint
   of the best held-out tau -> ``<output>/drafter2`` (the authors' DFlash2 format).
6. ``eval``: held-out loss of the target, greedy samples (a code prompt and a chat prompt), and for each
   drafter tau, the acceptance-length histogram and the speedup over target-only greedy at blocks 16 and 8
   on held-out prompts with the ``Engine`` on the build's device, and tau of sampled decoding ->
   ``<output>/eval.json``.

``--pack DIR`` then writes ``<output>`` as a tar split into parts of at most 15 MiB
(``DIR/embedded.tar.partNN``); ``--unpack DIR --output models/embedded`` restores it.

The split is deterministic by file path: a file is held out when the first byte of the MD5 of its
path relative to the stdlib root is < 26 (about 10%).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import platform
import random
import shutil
import sys
import time
from pathlib import Path

from dflash_jax.training.stdlib_corpus import (
    chat_request,
    corpus_files,
    documented_functions,
    read_text,
    stdlib_root,
    train_tokenizer,
)

REPO = Path(__file__).resolve().parents[2]  # the repository root (configs/, models/)

# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


def _line_starts(text: str) -> list[int]:
    """Character offsets of the non-blank lines of ``text``."""
    offs, pos = [], 0
    for line in text.splitlines(keepends=True):
        if line.strip():
            offs.append(pos)
        pos += len(line)
    return offs


def code_prompts(tokenizer, split: str, num: int, prompt_tokens: int, seed: int = 0,
                 max_files: int = 0) -> list[list[int]]:
    """``num`` prompts of ``prompt_tokens`` tokens, each starting at a random non-blank line of a random
    ``split`` file (a line is used once)."""
    rng = random.Random(seed)
    starts = []
    for path in corpus_files(split, max_files=max_files):
        text = read_text(path)
        if text:
            starts.extend((path, off) for off in _line_starts(text))
    rng.shuffle(starts)
    starts.sort(key=lambda s: str(s[0]))  # one file read at a time; the sample stays random per file
    chosen, texts = [], {}
    for path, off in starts:
        text = texts.get(path)
        if text is None:
            texts = {path: read_text(path)}
            text = texts[path]
        ids = tokenizer.encode(text[off: off + 8 * prompt_tokens], add_special_tokens=False)
        if len(ids) >= prompt_tokens:
            chosen.append(ids[:prompt_tokens])
    rng.shuffle(chosen)
    return chosen[:num]


def heldout_prompts(tokenizer, num: int, max_tokens: int = 96, seed: int = 0) -> list[dict]:
    """Function signatures + docstrings of held-out files (the evaluation's code prompts)."""
    return signature_prompts(tokenizer, "heldout", num, max_tokens, seed)


def signature_prompts(tokenizer, split: str, num: int, max_tokens: int = 96, seed: int = 0,
                      max_files: int = 0) -> list[dict]:
    """Function signatures + docstrings of ``split`` files (``def`` line through the docstring's end,
    dedented), at most ``max_tokens`` tokens; a deterministic sample of ``num``."""
    found = []
    for fn in documented_functions(split, max_files):
        ids = tokenizer.encode(fn["header"], add_special_tokens=False)
        if 8 <= len(ids) <= max_tokens:
            found.append({"prompt_ids": ids, "source": fn["source"], "prompt": fn["header"], "kind": "code"})
    rng = random.Random(seed)
    rng.shuffle(found)
    return found[:num]


def chat_prompts(tokenizer, split: str, num: int, max_tokens: int = 96, seed: int = 0,
                 max_files: int = 0) -> list[dict]:
    """Chat requests for ``split``'s documented functions ("write a function ..."), rendered with the
    chat template up to the assistant's turn; a deterministic sample of ``num``."""
    rng = random.Random(seed + 1)
    found = []
    for fn in documented_functions(split, max_files):
        request = chat_request(fn, rng)
        text = tokenizer.render_chat_template([{"role": "user", "content": request}], add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) <= max_tokens:
            found.append({"prompt_ids": ids, "source": fn["source"], "prompt": text, "request": request, "kind": "chat"})
    rng.shuffle(found)
    return found[:num]


def interleave(code: list[dict], chat: list[dict], num: int) -> list[dict]:
    """``num`` rows: two code prompts, then one chat prompt, and so on (while both last)."""
    out, c, h = [], iter(code), iter(chat)
    while len(out) < num:
        row = next(h, None) if len(out) % 3 == 2 else next(c, None)
        if row is None:
            row = next(c, None) or next(h, None)
            if row is None:
                break
        out.append(row)
    return out


def write_jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def generate_answers(target_dir: Path, prompts: list[list[int]], new_tokens: int, batch_size: int) -> list[dict]:
    """The shipped target's greedy answers (its own stop tokens end them) through the ``Engine``:
    ``{"prompt_ids", "output_ids"}`` per prompt, the format ``train.py`` reads.

    The prompts go in waves of ``batch_size`` of similar length: each wave is admitted by one prefill of
    one shape, where a continuous stream would admit a few rows at every sync, each admission a prefill
    of its own."""
    from dflash_jax.io.checkpoint import load_target
    from dflash_jax.runtime.engine import Engine, EngineConfig

    target = load_target(target_dir, dtype="float32")  # as served: the bfloat16 file, float32 compute
    max_len = max(map(len, prompts)) + new_tokens + 8
    engine = Engine(target, None, EngineConfig(max_batch_size=batch_size, max_length=max_len, steps_per_sync=16))
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    results = [None] * len(prompts)
    t0 = time.time()
    for start in range(0, len(order), batch_size):
        wave = order[start: start + batch_size]
        done = engine.generate([prompts[i] for i in wave], new_tokens,
                               stop_token_ids=list(target.config.eos_token_ids))
        for i, r in zip(wave, done):
            results[i] = r
    dt = time.time() - t0
    tokens = sum(r.num_output_tokens for r in results)
    print(f"answers: {len(prompts)} prompts, {tokens} tokens in {dt:.1f}s ({tokens / dt:.0f} tokens/s, "
          f"batch {batch_size})", flush=True)
    return [{"prompt_ids": list(p), "output_ids": list(r.output_ids)} for p, r in zip(prompts, results)]


# ---------------------------------------------------------------------------------------------
# Evaluation
# ---------------------------------------------------------------------------------------------


def evaluate(target_dir, drafter_dir, prompts: list[list[int]], max_new_tokens: int = 128, block_size=None,
             repeats: int = 1) -> dict:
    """tau, the acceptance-length histogram and the speedup over target-only greedy, batch 1, in one
    engine configuration, on ``prompts``; also whether the greedy outputs are identical."""
    import numpy as np

    from dflash_jax.io.checkpoint import load_drafter, load_target
    from dflash_jax.models.dflash2 import DFlash2Drafter
    from dflash_jax.runtime.engine import Engine, EngineConfig

    target = load_target(target_dir)
    drafter = load_drafter(drafter_dir)
    eos = list(target.config.eos_token_ids)
    max_len = max(len(p) for p in prompts) + max_new_tokens + 8
    cfg = EngineConfig(max_batch_size=1, max_length=max_len, steps_per_sync=8, block_size=block_size)
    spec = Engine(target, drafter, cfg)
    plain = spec.derive(dataclasses.replace(cfg, block_size=None), drafter=None)
    for engine in (spec, plain):  # every prompt bucket and decode window compiled outside the timed runs
        engine.warmup([1])

    def run(engine):
        outs, t = [], 0.0
        for p in prompts:
            best = None
            for _ in range(repeats):
                t0 = time.perf_counter()
                r = engine.generate([p], max_new_tokens, stop_token_ids=eos)[0]
                dt = time.perf_counter() - t0
                best = dt if best is None else min(best, dt)
            outs.append(r)
            t += best
        return outs, t

    fast, t_spec = run(spec)
    slow, t_plain = run(plain)
    lengths = [int(n) for r in fast for n in r.acceptance_lengths]
    tok_fast = sum(r.num_output_tokens for r in fast)
    tok_slow = sum(r.num_output_tokens for r in slow)
    return {
        "drafter": "dflash2" if isinstance(drafter, DFlash2Drafter) else "dflash",
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "block_size": spec.block_size,
        "identical": all(a.output_ids == b.output_ids for a, b in zip(fast, slow)),
        "tau": float(np.mean(lengths)),
        "tau_per_prompt": [float(r.tau) for r in fast],
        "histogram": {int(k): v for k, v in sorted(collections.Counter(lengths).items())},
        "output_tokens": tok_fast,
        "dflash_s": t_spec,
        "target_only_s": t_plain,
        "dflash_tok_per_s": tok_fast / t_spec,
        "target_only_tok_per_s": tok_slow / t_plain,
        "speedup": (t_plain / tok_slow) / (t_spec / tok_fast),
    }


def tau_by_kind(report: dict, kinds: list[str]) -> dict[str, float]:
    """Mean per-prompt tau of each prompt kind ("code", "chat") of an ``evaluate`` report."""
    out = {}
    for kind in sorted(set(kinds)):
        taus = [t for t, k in zip(report["tau_per_prompt"], kinds) if k == kind]
        out[kind] = sum(taus) / len(taus)
    return out


def sampled_taus(target_dir, drafters: dict, prompts: list[list[int]], max_new_tokens: int,
                 temperatures, block_size: int = 16) -> list[dict]:
    """``runtime.acceptance.sampled_tau`` of each drafter (name -> directory), rows tagged ``"drafter"``;
    every prompt in one batch (rows decode as they would alone)."""
    from dflash_jax.io.checkpoint import load_drafter, load_target
    from dflash_jax.runtime.acceptance import sampled_tau
    from dflash_jax.runtime.engine import Engine, EngineConfig

    target = load_target(target_dir)
    cfg = EngineConfig(max_batch_size=len(prompts), max_length=max(map(len, prompts)) + max_new_tokens + 8,
                       steps_per_sync=8, block_size=block_size)
    plain = Engine(target, None, dataclasses.replace(cfg, block_size=None))
    rows = []
    for name, directory in drafters.items():
        spec = plain.derive(cfg, drafter=load_drafter(directory))
        rows += [dict(row, drafter=name) for row in sampled_tau(spec, plain, prompts, max_new_tokens, temperatures,
                                                                list(target.config.eos_token_ids))]
    return rows


SAMPLE_CHAT = "Write a function `is_palindrome(text)` that returns True when text reads the same backwards."


def greedy_samples(target_dir, code_prompt: str, chat_request_text: str, max_new_tokens: int) -> list[dict]:
    """The target's greedy continuation of a code prompt, and its answer to chat requests (a held-out one
    and ``SAMPLE_CHAT``), as text."""
    from dflash_jax.io.checkpoint import load_target
    from dflash_jax.io.tokenizer import Tokenizer
    from dflash_jax.runtime.engine import generate

    target = load_target(target_dir)
    tok = Tokenizer(target_dir)
    cases = [("code", code_prompt, code_prompt)]
    for request in (chat_request_text, SAMPLE_CHAT):
        text = tok.render_chat_template([{"role": "user", "content": request}], add_generation_prompt=True)
        cases.append(("chat", request, text))
    ids = [tok.encode(text, add_special_tokens=False) for _, _, text in cases]
    results = generate(target, None, ids, max_new_tokens=max_new_tokens, stop_token_ids=list(tok.stop_token_ids))
    return [{"kind": kind, "prompt": shown, "completion": tok.decode(r.output_ids, skip_special_tokens=True)}
            for (kind, shown, _), r in zip(cases, results)]


# ---------------------------------------------------------------------------------------------
# Pipeline
# ---------------------------------------------------------------------------------------------

STAGES = ("tokenizer", "target", "answers", "drafter", "drafter2", "eval")

# The DFlash2 drafter: configs/embedded_drafter.yaml (the DFlash recipe: data, anchors, loss weights,
# schedule, held-out tau every 500 steps) with these overrides and model.drafter = the trained DFlash
# drafter, whose every weight starts it (identity convolutions: the same drafter at step 0; a fresh
# selector). Selector rank 128 (a third of the target's hidden 384): its two [vocab, rank] codebooks are
# then 2.1M parameters at vocab 8192, where the default rank 256 would give 4.2M beside a 13.5M-parameter
# target. A quarter of the DFlash learning rate (configs/embedded_drafter.yaml: 1.5e-3), for fewer steps:
# the unary part starts trained (at the full rate its loss rises over the first tens of steps), and only the
# convolutions and the selector start from scratch.
DRAFTER2_OVERRIDES = ("drafter.kind=dflash2", "drafter.selector_rank=128", "optim.lr=3.75e-4", "steps=700")


@dataclasses.dataclass(frozen=True)
class BuildSettings:
    """Sizes of a build; the defaults are the accelerator-sized build's."""

    vocab_size: int = 8192
    max_files: int = 0  # only the first N stdlib files of each split (0: all)
    target_config: str = "configs/embedded_target.yaml"
    drafter_config: str = "configs/embedded_drafter.yaml"
    target_overrides: tuple[str, ...] = ()
    drafter_overrides: tuple[str, ...] = ()  # the DFlash drafter's; the DFlash2 drafter's training starts with them
    drafter2_overrides: tuple[str, ...] = DRAFTER2_OVERRIDES  # after drafter_overrides: these win
    num_prompts: int = 32768  # answered by the target for the drafter's training (drafter split)
    prompt_tokens: int = 32  # code prompts
    max_prompt_tokens: int = 96  # signature and chat prompts
    answer_tokens: int = 128
    answer_batch: int = 1024
    eval_prompts: int = 24
    eval_new_tokens: int = 128
    sample_tokens: int = 160
    sampled_temperatures: tuple[float, ...] = (0.7, 1.0)  # tau of sampled decoding, both verification modes


# A whole build in a few CPU minutes: a toy model on a few files, a few steps per stage, the default
# configs otherwise (bfloat16 compute included). Checks the pipeline, not the quality.
TINY = BuildSettings(
    vocab_size=1024, max_files=40,
    target_overrides=("model.hidden_size=64", "model.intermediate_size=128", "model.num_layers=4",
                      "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=32", "data.seq_len=64",
                      "data.batch_size=8", "data.eval_windows=16", "steps=30", "eval_every=10", "log_every=10",
                      "export_shard_mb=0.1"),
    drafter_overrides=("steps=12", "data.batch_size=4", "data.seq_len=96", "loss.num_anchors=8",
                       "eval.every=6", "save_every=6", "eval.num_prompts=2", "eval.max_new_tokens=16",
                       "drafter.target_layer_ids=[1,3]"),
    drafter2_overrides=("drafter.kind=dflash2", "drafter.selector_rank=16", "drafter.selector_top_k=4"),
    num_prompts=48, answer_tokens=24, answer_batch=16, eval_prompts=3, eval_new_tokens=24, sample_tokens=24,
)


def best_eval_step(run_dir: Path) -> tuple[int | None, float | None]:
    """The step of the highest held-out tau among the run's eval rows that still have a checkpoint."""
    ckpts = run_dir / "checkpoints"
    kept = {int(p.name) for p in ckpts.iterdir() if p.name.isdigit()} if ckpts.is_dir() else set()
    best = (None, None)
    from dflash_jax.training.data import read_jsonl

    path = run_dir / "metrics.jsonl"
    for row in read_jsonl([path]) if path.exists() else []:
        if row.get("kind") == "eval" and "tau" in row and row["step"] in kept:
            if best[1] is None or row["tau"] > best[1]:
                best = (row["step"], row["tau"])
    return best


def _drafter_exported(drafter_dir: Path) -> bool:
    return (drafter_dir / "model.safetensors").exists() or (drafter_dir / "model.safetensors.index.json").exists()


def train_drafter(run_dir: Path, export_dir: Path, overrides: list[str], config: Path) -> dict:
    """``train.py --config config overrides`` in this process, then the checkpoint of the best held-out tau
    exported to ``export_dir`` (z-lab format for DFlash, the authors' DFlash2 format for DFlash2; bfloat16,
    like the target). Returns the choice: ``{"step", "tau"}`` (step None: no evaluated checkpoint, the
    last one exported)."""
    from dflash_jax.training.checkpointing import export_checkpoint
    from dflash_jax.training.cli import main as train_main

    if run_dir.exists():  # a fresh run: a resumed one would mix two starting drafters or answer sets
        shutil.rmtree(run_dir)
    argv = ["--config", str(config), f"output_dir={run_dir}", *overrides]
    print("+ train.py " + " ".join(argv), flush=True)
    if train_main(argv) != 0:
        raise SystemExit(f"drafter training failed (train.py {' '.join(argv)})")
    step, tau = best_eval_step(run_dir)
    print(f"{export_dir.name}: exporting step {step} (held-out tau {tau})" if step is not None
          else f"{export_dir.name}: no evaluated checkpoint, exporting the last", flush=True)
    if export_dir.exists():
        shutil.rmtree(export_dir)
    export_checkpoint(run_dir, export_dir, step=step, dtype="bfloat16")
    return {"step": step, "tau": tau}


def _read_json(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def build(output: Path, work: Path, force: str | None = None, settings: BuildSettings = BuildSettings(),
          until: str | None = None) -> dict:
    """Runs the stages (those done already skipped, ``force`` and the ones after it redone), stopping after
    ``until`` when given; returns the evaluation report (empty when the eval stage did not run)."""
    output, work = output.resolve(), work.resolve()
    output.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    redo = set(STAGES[STAGES.index(force):]) if force else set()
    last = STAGES.index(until) if until else len(STAGES) - 1
    s = settings
    tok_dir, target_dir, drafter_dir = work / "tokenizer", output / "target", output / "drafter"
    drafter2_dir = output / "drafter2"
    times = {}
    print(f"embedded build: Python {platform.python_version()} stdlib at {stdlib_root()}, output {output}, "
          f"work files {work}", flush=True)

    def stage(name: str, done: bool) -> bool:
        if STAGES.index(name) > last:
            print(f"== {name}: not run (--until {until})", flush=True)
            return False
        run = name in redo or not done
        print(f"== {name}: {'running' if run else 'done already (--force ' + name + ' redoes it)'}", flush=True)
        times[f"{name}_s"] = 0.0
        return run

    t0 = time.time()
    if stage("tokenizer", (tok_dir / "tokenizer.json").exists()):
        train_tokenizer(tok_dir, s.vocab_size, s.max_files)
        times["tokenizer_s"] = time.time() - t0

    t0 = time.time()
    target_done = (target_dir / "config.json").exists() and (work / "target_run" / "summary.json").exists()
    if stage("target", target_done):
        from dflash_jax.training.pretrain import load_pretrain_config, pretrain

        if target_dir.exists():
            shutil.rmtree(target_dir)
        config = load_pretrain_config(REPO / s.target_config, [
            f"tokenizer={tok_dir}", f"output_dir={work / 'target_run'}", f"export_dir={target_dir}",
            f"data.max_files={s.max_files}", *s.target_overrides])
        pretrain(config)
        times["target_s"] = time.time() - t0

    if last < STAGES.index("answers"):
        return {}
    from dflash_jax.io.tokenizer import Tokenizer

    tokenizer = Tokenizer(target_dir)
    t0 = time.time()
    answers_path, eval_path = work / "answers.jsonl", work / "eval_prompts.jsonl"
    if stage("answers", answers_path.exists() and eval_path.exists()):
        # From the drafter split (text the target never trained on): up to 1/4 signatures + docstrings
        # (the shape of the code evaluation prompts), up to 1/4 chat requests, the rest windows starting at
        # random lines.
        prompts = [r["prompt_ids"] for r in signature_prompts(tokenizer, "drafter", s.num_prompts // 4,
                                                              s.max_prompt_tokens, max_files=s.max_files)]
        prompts += [r["prompt_ids"] for r in chat_prompts(tokenizer, "drafter", s.num_prompts // 4,
                                                          s.max_prompt_tokens, max_files=s.max_files)]
        prompts += code_prompts(tokenizer, "drafter", s.num_prompts - len(prompts), s.prompt_tokens,
                                max_files=s.max_files)
        held = interleave(heldout_prompts(tokenizer, 256, s.max_prompt_tokens),
                          chat_prompts(tokenizer, "heldout", 128, s.max_prompt_tokens), 256)
        write_jsonl(eval_path, held)
        write_jsonl(answers_path, generate_answers(target_dir, prompts, s.answer_tokens, s.answer_batch))
        times["answers_s"] = time.time() - t0

    t0 = time.time()
    common = [f"model.target={target_dir}", f"data.train_files=[{answers_path}]", f"data.eval_prompts={eval_path}"]
    if stage("drafter", _drafter_exported(drafter_dir)):
        choice = train_drafter(work / "drafter_run", drafter_dir, [*common, *s.drafter_overrides],
                               REPO / s.drafter_config)
        (work / "drafter_training.json").write_text(json.dumps({
            **choice, "overrides": list(s.drafter_overrides), "wall_s": time.time() - t0}))
        times["drafter_s"] = time.time() - t0

    t0 = time.time()
    if stage("drafter2", _drafter_exported(drafter2_dir)):
        # The DFlash recipe and its overrides, then the DFlash2 ones (which win), from the DFlash drafter.
        choice = train_drafter(work / "drafter2_run", drafter2_dir,
                               [*common, f"model.drafter={drafter_dir}", *s.drafter_overrides, *s.drafter2_overrides],
                               REPO / s.drafter_config)
        (work / "drafter2_training.json").write_text(json.dumps({
            **choice, "overrides": [*s.drafter_overrides, *s.drafter2_overrides], "initialised_from": "drafter",
            "wall_s": time.time() - t0}))
        times["drafter2_s"] = time.time() - t0

    t0 = time.time()
    report = {}
    if stage("eval", (output / "eval.json").exists()):
        from dflash_jax.training.data import read_jsonl

        rows = read_jsonl([eval_path])[: s.eval_prompts]
        ids, kinds = [r["prompt_ids"] for r in rows], [r.get("kind", "code") for r in rows]

        def measured(directory: Path, block_size: int | None = None) -> dict:
            r = evaluate(target_dir, directory, ids, s.eval_new_tokens, block_size=block_size)
            r["tau_by_kind"] = tau_by_kind(r, kinds)
            return r

        # Timings are of this device only (the CPU speedup is measured by serve.py demo / bench).
        # The DFlash drafter at its own block size (16) at the top level, then cut to 8 (on a CPU the verify
        # pass is compute-bound, so a shorter block is the better trade there).
        report = measured(drafter_dir)
        report["prompts_kind"] = "held-out function signatures + docstrings (code) and chat requests (chat), 2:1"
        report["block_8"] = measured(drafter_dir, 8)
        report["training"] = _read_json(work / "drafter_training.json")
        generations = {"dflash": drafter_dir}
        if _drafter_exported(drafter2_dir):  # the same measurement of the DFlash2 drafter
            report["dflash2"] = measured(drafter2_dir)
            report["dflash2"]["block_8"] = measured(drafter2_dir, 8)
            report["dflash2"]["training"] = _read_json(work / "drafter2_training.json")
            generations["dflash2"] = drafter2_dir
        summary = _read_json(work / "target_run" / "summary.json")
        if summary is not None:
            report["target"] = {k: summary.get(k) for k in (
                "params", "train_tokens", "heldout_tokens", "unigram_entropy", "best_eval_loss", "best_step",
                "exported_step", "steps", "epochs", "tokens_per_s", "wall_s")}
            report["target"]["heldout_loss_nats_per_token"] = summary.get("best_eval_loss")
        code_row = next((r for r, k in zip(rows, kinds) if k == "code"), rows[0])
        chat_row = next((r for r, k in zip(rows, kinds) if k == "chat"), None)
        report["samples"] = greedy_samples(target_dir, code_row["prompt"],
                                           chat_row["request"] if chat_row else SAMPLE_CHAT, s.sample_tokens)
        report["sampled"] = sampled_taus(target_dir, generations, ids, s.eval_new_tokens, s.sampled_temperatures)
        report["device"] = _device()
        report["python"] = platform.python_version()
        report["build_times_s"] = times
        (output / "eval.json").write_text(json.dumps(report, indent=2))
        write_jsonl(output / "heldout_prompts.jsonl",
                    ({"prompt": r["prompt"], "source": r["source"], "kind": k} for r, k in zip(rows, kinds)))
        times["eval_s"] = time.time() - t0
    print(json.dumps({"times": times, "eval": _headline(report)}, indent=2, default=float), flush=True)
    return report


def _headline(report: dict) -> dict:
    if not report:
        return {}
    out = {}
    if "target" in report:
        out.update(target_heldout_loss=report["target"]["best_eval_loss"], target_params=report["target"]["params"])
    for name, row in (("dflash", report), ("dflash2", report.get("dflash2"))):
        if row:
            for block, r in ((16, row), (8, row.get("block_8") or {})):
                if "tau" in r:
                    out[f"{name}_tau_block_{r.get('block_size', block)}"] = r["tau"]
                    out[f"{name}_identical_block_{r.get('block_size', block)}"] = r.get("identical")
    out["sampled_tau"] = {f"{row['drafter']} T={row['temperature']} {row['verify']}": row["tau"]
                          for row in report.get("sampled", [])}
    return out


def _device() -> str:
    import jax

    d = jax.devices()[0]
    return f"{d.platform} ({d.device_kind}), {platform.processor() or platform.machine()}"


# ---------------------------------------------------------------------------------------------
# Packing (for a transfer limited in file size)
# ---------------------------------------------------------------------------------------------

PART_BYTES = 15 * 2**20
PACK_NAME = "embedded.tar"


def pack(directory: Path, dest: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """``directory`` as an uncompressed tar (members sorted, named ``<directory name>/...``, no owners
    or times) split into ``dest/embedded.tar.partNN`` files of at most ``part_bytes`` each.
    Equivalent shell: ``tar -C PARENT -cf - NAME | split -b 15M -d - DEST/embedded.tar.part``."""
    import io
    import tarfile

    directory, dest = Path(directory).resolve(), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in [directory, *sorted(directory.rglob("*"))]:
            info = tar.gettarinfo(str(path), arcname=str(Path(directory.name) / path.relative_to(directory)))
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            if info.isfile():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    data = buf.getvalue()
    for old in dest.glob(PACK_NAME + ".part*"):
        old.unlink()
    parts = []
    for k, start in enumerate(range(0, len(data), part_bytes)):
        part = dest / f"{PACK_NAME}.part{k:02d}"
        part.write_bytes(data[start: start + part_bytes])
        parts.append(part)
    return parts


def unpack(source: Path, output: Path) -> Path:
    """Restores ``pack``'s parts in ``source`` as ``output`` (replacing it). Equivalent shell:
    ``rm -rf OUTPUT && cat SOURCE/embedded.tar.part* | tar -x -C PARENT`` (then rename)."""
    import io
    import tarfile

    parts = sorted(Path(source).glob(PACK_NAME + ".part*"))
    if not parts:
        raise FileNotFoundError(f"{source}: no {PACK_NAME}.partNN files")
    data = b"".join(p.read_bytes() for p in parts)
    output = Path(output).resolve()
    staging = output.parent / (output.name + ".unpacking")
    if staging.exists():
        shutil.rmtree(staging)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tar:
        members = tar.getmembers()
        top = {Path(m.name).parts[0] for m in members}
        if len(top) != 1 or any(m.issym() or m.islnk() or ".." in Path(m.name).parts or Path(m.name).is_absolute()
                                for m in members):
            raise ValueError(f"{source}: not a pack of one directory (members {sorted(top)[:4]})")
        tar.extractall(staging)
    if output.exists():
        shutil.rmtree(output)
    (staging / top.pop()).rename(output)
    staging.rmdir()
    return output


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_jax.training.embedded_build",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(REPO / "models" / "embedded"))
    parser.add_argument("--work", default=str(REPO / "runs" / "embedded_build"))
    parser.add_argument("--force", choices=STAGES, default=None, help="redo this stage and the ones after it")
    parser.add_argument("--until", choices=STAGES, default=None,
                        help="stop after this stage (a later run continues from the next one)")
    parser.add_argument("--tiny", action="store_true", help="a toy build in a few CPU minutes (checks the pipeline)")
    parser.add_argument("--target-set", action="append", default=[], help="override for the target pretraining")
    parser.add_argument("--drafter-set", action="append", default=[],
                        help="override for the drafter training (the DFlash2 drafter's starts with them too)")
    parser.add_argument("--drafter2-set", action="append", default=[],
                        help="override for the DFlash2 drafter training (after DRAFTER2_OVERRIDES)")
    parser.add_argument("--num-prompts", type=int, default=None, help="prompts answered for the drafter's training")
    parser.add_argument("--eval-prompts", type=int, default=None)
    parser.add_argument("--pack", metavar="DIR", default=None,
                        help="after the build, write --output as DIR/embedded.tar.partNN (<= 15 MiB each)")
    parser.add_argument("--unpack", metavar="DIR", default=None,
                        help="only restore --output from DIR/embedded.tar.partNN (no build)")
    args = parser.parse_args(argv)
    if args.unpack:
        print(f"unpacked into {unpack(Path(args.unpack), Path(args.output))}")
        return 0
    settings = TINY if args.tiny else BuildSettings()
    settings = dataclasses.replace(
        settings,
        target_overrides=(*settings.target_overrides, *args.target_set),
        drafter_overrides=(*settings.drafter_overrides, *args.drafter_set),
        drafter2_overrides=(*settings.drafter2_overrides, *args.drafter2_set),
        num_prompts=args.num_prompts or settings.num_prompts,
        eval_prompts=args.eval_prompts or settings.eval_prompts,
    )
    t0 = time.time()
    build(Path(args.output), Path(args.work), args.force, settings, until=args.until)
    print(f"embedded build: {time.time() - t0:.0f}s in all", flush=True)
    if args.pack and args.until not in (None, STAGES[-1]):
        print("--pack skipped: the build stopped early (--until)", flush=True)
    elif args.pack:
        parts = pack(Path(args.output), Path(args.pack))
        print(f"packed {args.output} into {len(parts)} parts under {args.pack}: "
              + ", ".join(f"{p.name} ({p.stat().st_size / 2**20:.1f} MiB)" for p in parts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
