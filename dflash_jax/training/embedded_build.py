"""Builds the embedded default pair: a small Qwen3 code model and its DFlash and DFlash2 drafters,
trained here on the running interpreter's own standard-library sources (text every machine has).

    python -m dflash_jax.training.embedded_build --output models/embedded [--work runs/embedded_build]

Stages (each skipped when its output already exists, ``--force STAGE`` redoes it and what follows):

1. ``tokenizer``: a byte-level BPE (``tokenizers``) trained on the train split, with ``<|endoftext|>``
   (EOS, also the separator between files) and ``<|mask|>`` (the drafter's mask token).
2. ``target``: ``python -m dflash_jax.training.pretrain --config configs/embedded_target.yaml``
   (next-token cross-entropy on the train split) -> ``<output>/target`` (HF format + tokenizer files).
3. ``answers``: 4096 prompts cut from the train split (half the first 32 tokens of random function
   definitions, half function signatures + docstrings), answered greedily (96 tokens) by the target
   itself (``serve.py generate --no-draft``).
4. ``drafter``: ``python train.py --config configs/embedded_drafter.yaml`` on those answers ->
   ``<output>/drafter`` (z-lab format) and ``<output>/drafter_orbax`` (the final Orbax checkpoint).
5. ``drafter2``: the same recipe on the same answers with ``drafter.kind=dflash2``
   (``DRAFTER2_OVERRIDES``), started from the trained DFlash drafter (``model.drafter``) ->
   ``<output>/drafter2`` (the authors' DFlash2 format, float32).
6. ``eval``: for each drafter, tau, the acceptance-length histogram and the speedup over target-only
   greedy on held-out prompts (function signatures + docstrings of held-out files) at block sizes 16
   and 8 -> ``<output>/eval.json``.

The split is deterministic by file path: a file is held out when the first byte of the MD5 of its
path relative to the stdlib root is < 26 (about 10%).
"""

from __future__ import annotations

import argparse
import ast
import collections
import dataclasses
import hashlib
import json
import random
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository root (configs/, serve.py, train.py, models/)

EOS = "<|endoftext|>"
MASK = "<|mask|>"
SKIP_DIRS = {"test", "tests", "idlesave", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo",
             "__pycache__", "ensurepip", "config-3.11-x86_64-linux-gnu", "tkinter"}
HELDOUT_BYTE = 26  # md5(relpath)[0] < 26 of 256: ~10% held out
MAX_FILE_BYTES = 200_000  # skip generated giants (e.g. pydoc_data/topics.py)


# ---------------------------------------------------------------------------------------------
# Corpus
# ---------------------------------------------------------------------------------------------


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    return hashlib.md5(relpath.encode()).digest()[0] < HELDOUT_BYTE


def corpus_files(split: str, root: Path | None = None) -> list[Path]:
    """The stdlib ``.py`` files of ``split`` ("train" | "heldout"), sorted by relative path."""
    root = root or stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS or part.startswith("test") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("test_"):
            continue
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
        except OSError:
            continue
        if is_heldout(rel.as_posix()) == (split == "heldout"):
            out.append(path)
    return out


def read_text(path: Path) -> str | None:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text.replace("\r\n", "\n")


def corpus_texts(split: str) -> list[str]:
    return [t for t in (read_text(p) for p in corpus_files(split)) if t and t.strip()]


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def train_tokenizer(out_dir: str | Path, vocab_size: int = 4096) -> Path:
    """Byte-level BPE on the train split -> ``tokenizer.json`` + ``tokenizer_config.json``.

    Ids 0 and 1 are ``<|endoftext|>`` (EOS) and ``<|mask|>`` (the drafter's mask token).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS, MASK], min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus_texts("train"), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": EOS,
        "mask_token": MASK,
        "bos_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 2048,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                      "normalized": False, "single_word": False}
            for t in (EOS, MASK)
        },
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out


def copy_tokenizer(src: str | Path, dst: str | Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(src) / name, Path(dst) / name)


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


def _def_starts(text: str) -> list[int]:
    """Character offsets of lines that start a ``def`` (any indentation)."""
    offs, pos = [], 0
    for line in text.splitlines(keepends=True):
        if line.lstrip().startswith(("def ", "async def ")):
            offs.append(pos)
        pos += len(line)
    return offs


def train_prompts(tokenizer, num: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """``num`` prompts of ``prompt_tokens`` tokens, each starting at a random ``def`` line of a random
    train-split file (through the def line and into its body)."""
    rng = random.Random(seed)
    starts = []
    for path in corpus_files("train"):
        text = read_text(path)
        if text:
            starts.extend((path, off) for off in _def_starts(text))
    rng.shuffle(starts)
    prompts, cache = [], {}
    for path, off in starts:
        if len(prompts) >= num:
            break
        text = cache.get(path) or read_text(path)
        cache = {path: text}
        ids = tokenizer.encode(text[off: off + 8 * prompt_tokens], add_special_tokens=False)
        if len(ids) >= prompt_tokens:
            prompts.append(ids[:prompt_tokens])
    return prompts


def heldout_prompts(tokenizer, num: int, max_tokens: int = 96, seed: int = 0) -> list[dict]:
    """Function signatures + docstrings of held-out files (the evaluation prompts)."""
    return signature_prompts(tokenizer, "heldout", num, max_tokens, seed)


def signature_prompts(tokenizer, split: str, num: int, max_tokens: int = 96, seed: int = 0) -> list[dict]:
    """Function signatures + docstrings of ``split`` files (``def`` line through the docstring's end,
    dedented), at most ``max_tokens`` tokens; a deterministic sample of ``num``."""
    found = []
    for path in corpus_files(split):
        text = read_text(path)
        if not text:
            continue
        try:
            tree = ast.parse(text)
        except SyntaxError:
            continue
        lines = text.splitlines(keepends=True)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.decorator_list:
                continue
            if not (node.body and isinstance(node.body[0], ast.Expr) and isinstance(getattr(node.body[0], "value", None), ast.Constant)
                    and isinstance(node.body[0].value.value, str)):
                continue
            doc = node.body[0]
            src = "".join(lines[node.lineno - 1: doc.end_lineno])
            indent = len(src) - len(src.lstrip(" "))
            src = "\n".join(l[indent:] if l[:indent].strip() == "" else l for l in src.split("\n"))
            if not src.endswith("\n"):
                src += "\n"
            ids = tokenizer.encode(src, add_special_tokens=False)
            if 8 <= len(ids) <= max_tokens:
                found.append({"prompt_ids": ids, "source": f"{path.name}:{node.lineno}", "prompt": src})
    rng = random.Random(seed)
    rng.shuffle(found)
    return found[:num]


def write_jsonl(path: Path, rows) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


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


# ---------------------------------------------------------------------------------------------
# Pipeline
# ---------------------------------------------------------------------------------------------

STAGES = ("tokenizer", "target", "answers", "drafter", "drafter2", "eval")

# The DFlash2 drafter: configs/embedded_drafter.yaml (the DFlash recipe: data, anchors, loss weights,
# schedule) with these overrides and model.drafter = the trained DFlash drafter, whose every weight
# starts it (identity convolutions: the same drafter at step 0; a fresh selector). The selector is
# sized for a vocab-4096, hidden-128 model: rank 32 (= hidden / 4) keeps its two [vocab, rank]
# codebooks at 262k parameters (the default rank 256 would give 2.1M, more than the 1.84M-parameter
# target); top-8 candidates per slot hold the target's token at ~87% of the training slots, where
# the drafter's top-1 is right at ~60%. A quarter of the DFlash learning rate, for fewer steps: the
# unary part starts trained (at 2e-3 its loss rises over the first 50 steps), and only the
# convolutions and the selector start from scratch.
DRAFTER2_OVERRIDES = ("drafter.kind=dflash2", "drafter.selector_rank=32", "drafter.selector_top_k=8",
                      "optim.lr=5e-4", "steps=300")


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=REPO)


def build(output: Path, work: Path, force: str | None = None, overrides: dict | None = None,
          num_prompts: int = 4096, prompt_tokens: int = 32, signature_tokens: int = 64, new_tokens: int = 96,
          eval_prompts: int = 24, eval_new_tokens: int = 128) -> dict:
    output, work = output.resolve(), work.resolve()
    output.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    overrides = overrides or {}
    redo = set(STAGES[STAGES.index(force):]) if force else set()
    py = sys.executable
    tok_dir, target_dir = work / "tokenizer", output / "target"
    drafter_dir, orbax_dir = output / "drafter", output / "drafter_orbax"
    drafter2_dir = output / "drafter2"
    times = {}

    t0 = time.time()
    if "tokenizer" in redo or not (tok_dir / "tokenizer.json").exists():
        train_tokenizer(tok_dir)
    times["tokenizer_s"] = time.time() - t0

    t0 = time.time()
    if "target" in redo or not (target_dir / "model.safetensors").exists():
        _run([py, "-m", "dflash_jax.training.pretrain", "--config", "configs/embedded_target.yaml",
              f"tokenizer={tok_dir}", f"output_dir={work / 'target_run'}", f"export_dir={target_dir}",
              *overrides.get("target", [])])
    times["target_s"] = time.time() - t0

    from dflash_jax.io.tokenizer import Tokenizer

    tokenizer = Tokenizer(target_dir)
    t0 = time.time()
    prompts_path, answers_path = work / "prompts.jsonl", work / "answers.jsonl"
    eval_path = work / "eval_prompts.jsonl"
    if "answers" in redo or not answers_path.exists():
        # Half: the first tokens of random function definitions (code in the body); half: signatures +
        # docstrings (the shape of the evaluation prompts), both from the train split only.
        prompts = train_prompts(tokenizer, num_prompts - num_prompts // 2, prompt_tokens)
        prompts += [r["prompt_ids"] for r in signature_prompts(tokenizer, "train", num_prompts // 2, signature_tokens)]
        write_jsonl(prompts_path, ({"prompt_ids": p, "max_new_tokens": new_tokens} for p in prompts))
        write_jsonl(eval_path, heldout_prompts(tokenizer, 256))
        _run([py, "serve.py", "generate", "--no-draft", "--target", str(target_dir), "--input", str(prompts_path),
              "--output", str(answers_path), "--batch-size", "64", "--max-length",
              str(max(prompt_tokens, signature_tokens) + new_tokens + 8), "--no-progress"])
    times["answers_s"] = time.time() - t0

    t0 = time.time()
    run_dir = work / "drafter_run"
    if "drafter" in redo or not (drafter_dir / "model.safetensors").exists():
        if run_dir.exists() and "drafter" in redo:
            shutil.rmtree(run_dir)
        _run([py, "train.py", "--config", "configs/embedded_drafter.yaml", f"model.target={target_dir}",
              f"data.train_files=[{answers_path}]", f"data.eval_prompts={eval_path}", f"output_dir={run_dir}",
              *overrides.get("drafter", [])])
        from dflash_jax.training.checkpointing import export_checkpoint

        export_checkpoint(run_dir, drafter_dir, dtype="float32")
        ship_orbax(run_dir, orbax_dir)
    times["drafter_s"] = time.time() - t0

    t0 = time.time()
    run2_dir = work / "drafter2_run"
    if "drafter2" in redo or not (drafter2_dir / "model.safetensors").exists():
        if run2_dir.exists():  # a fresh run: resuming would mix two starting drafters or answer sets
            shutil.rmtree(run2_dir)
        _run([py, "train.py", "--config", "configs/embedded_drafter.yaml", f"model.target={target_dir}",
              f"model.drafter={drafter_dir}", f"data.train_files=[{answers_path}]", f"data.eval_prompts={eval_path}",
              f"output_dir={run2_dir}", *DRAFTER2_OVERRIDES, *overrides.get("drafter2", [])])
        from dflash_jax.training.checkpointing import export_checkpoint

        if drafter2_dir.exists():
            shutil.rmtree(drafter2_dir)
        export_checkpoint(run2_dir, drafter2_dir, dtype="float32")
        (work / "drafter2_training.json").write_text(json.dumps({
            "overrides": [*DRAFTER2_OVERRIDES, *overrides.get("drafter2", [])], "initialised_from": "drafter",
            "wall_s": time.time() - t0}))
    times["drafter2_s"] = time.time() - t0

    t0 = time.time()
    report = {}
    if "eval" in redo or not (output / "eval.json").exists():
        rows = [json.loads(l) for l in eval_path.read_text().splitlines()][:eval_prompts]
        ids = [r["prompt_ids"] for r in rows]
        report = evaluate(target_dir, drafter_dir, ids, eval_new_tokens)
        report["prompts_kind"] = "held-out function signatures + docstrings"
        # On a CPU the verify pass is compute-bound (16 tokens cost ~16x one), so a shorter block is
        # the better trade there; same drafter, block cut to 8.
        report["block_8"] = evaluate(target_dir, drafter_dir, ids, eval_new_tokens, block_size=8)
        if (drafter2_dir / "model.safetensors").exists():  # the same measurement of the DFlash2 drafter
            report["dflash2"] = evaluate(target_dir, drafter2_dir, ids, eval_new_tokens)
            report["dflash2"]["block_8"] = evaluate(target_dir, drafter2_dir, ids, eval_new_tokens, block_size=8)
            training = work / "drafter2_training.json"
            if training.exists():
                report["dflash2"]["training"] = json.loads(training.read_text())
        report["device"] = _device()
        (output / "eval.json").write_text(json.dumps(report, indent=2))
        write_jsonl(output / "heldout_prompts.jsonl",
                    ({"prompt": r["prompt"], "source": r["source"]} for r in rows))
    times["eval_s"] = time.time() - t0
    print(json.dumps({"times": times, "eval": report}, indent=2, default=float))
    return report


def _device() -> str:
    import platform

    import jax

    d = jax.devices()[0]
    return f"{d.platform} ({d.device_kind}), {platform.processor() or platform.machine()}"


def ship_orbax(run_dir: Path, dst: Path) -> None:
    """Copies the run's latest finished Orbax checkpoint (params, optimizer state, data iterator, step)
    plus the run's config files into ``dst``: a run directory with one checkpoint, which
    ``dflash_jax.load_drafter`` / ``load_drafter_from_orbax`` read and ``train.py`` could resume from."""
    run_dir = Path(run_dir)
    ckpts = run_dir / "checkpoints"
    steps = sorted(int(p.name) for p in ckpts.iterdir() if p.name.isdigit())
    if not steps:
        raise FileNotFoundError(f"{ckpts}: no finished checkpoint")
    last = ckpts / str(steps[-1])
    if dst.exists():
        shutil.rmtree(dst)
    (dst / "checkpoints").mkdir(parents=True)
    for item in run_dir.iterdir():
        if item.is_file() and item.suffix in (".json", ".yaml"):
            shutil.copy(item, dst / item.name)
    shutil.copytree(last, dst / "checkpoints" / last.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dflash_jax.training.embedded_build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default=str(REPO / "models" / "embedded"))
    parser.add_argument("--work", default=str(REPO / "runs" / "embedded_build"))
    parser.add_argument("--force", choices=STAGES, default=None, help="redo this stage and the ones after it")
    parser.add_argument("--target-set", action="append", default=[], help="override for the target pretraining")
    parser.add_argument("--drafter-set", action="append", default=[], help="override for the drafter training")
    parser.add_argument("--drafter2-set", action="append", default=[],
                        help="override for the DFlash2 drafter training (after DRAFTER2_OVERRIDES)")
    parser.add_argument("--num-prompts", type=int, default=4096)
    parser.add_argument("--eval-prompts", type=int, default=24)
    args = parser.parse_args(argv)
    build(Path(args.output), Path(args.work), args.force,
          {"target": args.target_set, "drafter": args.drafter_set, "drafter2": args.drafter2_set},
          num_prompts=args.num_prompts,
          eval_prompts=args.eval_prompts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
