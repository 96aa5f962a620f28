"""The embedded default's build pipeline, piece by piece on tiny inputs: the ChatML tokenizer (role
tokens, template, stop tokens), the instruction-shaped examples, packing the output for a size-limited
transfer, the device-sampled pretraining step, and the drafter2 stage: which training it runs (the DFlash
recipe with the DFlash2 overrides, started from the stage before's drafter), what it exports, and the
evaluation of both generations, with the training and the measurement stubbed (the real ones are the
pair's build)."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dflash_jax.training.data import read_jsonl
from dflash_jax.training import embedded_build as eb
from dflash_jax.training import stdlib_corpus as sc


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return sc.train_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=600, max_files=6)


def test_tokenizer_has_role_tokens_template_and_chat_stop(tokenizer_dir):
    from dflash_jax.io.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_dir)
    ids = {t: tok.token_to_id(t) for t in sc.SPECIAL_TOKENS}
    assert list(ids.values()) == [0, 1, 2, 3]
    assert tok.eos_token_id == 0 and tok.stop_token_ids == [0, 3]  # end of document, end of a chat turn
    messages = [{"role": "user", "content": "Write a function `f(x)`."}]
    text = tok.render_chat_template(messages, add_generation_prompt=True)
    assert text == "<|im_start|>user\nWrite a function `f(x)`.<|im_end|>\n<|im_start|>assistant\n"
    encoded = tok.apply_chat_template(messages, add_generation_prompt=True)
    assert encoded[0] == 2 and encoded.count(3) == 1 and encoded.count(2) == 2  # role markers: single ids
    assert tok.decode(encoded, skip_special_tokens=False) == text


def test_instruction_examples_are_chat_turns_of_real_functions(tokenizer_dir):
    from dflash_jax.io.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_dir)
    fns = sc.documented_functions("train", max_files=6)
    assert fns and all(fn["code"].startswith(("def ", "async def ")) and fn["doc"] for fn in fns)
    texts = sc.instruction_texts(tok, "train", max_files=6)
    assert texts and all(t.startswith("<|im_start|>user\n") and t.endswith("<|im_end|>\n") for t in texts)
    assert all("<|im_start|>assistant\ndef " in t or "<|im_start|>assistant\nasync def " in t for t in texts)
    code = ["x = 1\n" * 200] * 10
    mixed = sc.mix_documents(code, texts, share=0.15)
    chat_chars = sum(len(t) for t in mixed if t.startswith("<|im_start|>"))
    total = sum(map(len, mixed))
    assert len(mixed) > len(code) and 0.10 < chat_chars / total < 0.15 + max(map(len, texts)) / total
    assert sc.mix_documents(code, texts, 0.15) == mixed  # seeded


def test_prompt_kinds_interleave_two_code_one_chat():
    code = [{"kind": "code", "i": i} for i in range(5)]
    chat = [{"kind": "chat", "i": i} for i in range(1)]
    assert [r["kind"] for r in eb.interleave(code, chat, 6)] == ["code", "code", "chat", "code", "code", "code"]


def test_pack_and_unpack_round_trip(tmp_path):
    src = tmp_path / "embedded"
    (src / "target").mkdir(parents=True)
    blob = np.random.default_rng(0).bytes(2500)
    (src / "target" / "model.bin").write_bytes(blob)
    (src / "eval.json").write_text("{}")
    parts = eb.pack(src, tmp_path / "parts", part_bytes=1024)
    assert len(parts) >= 3 and all(p.stat().st_size <= 1024 for p in parts)
    again = eb.pack(src, tmp_path / "parts2", part_bytes=1024)
    assert [p.read_bytes() for p in parts] == [p.read_bytes() for p in again]  # deterministic
    out = eb.unpack(tmp_path / "parts", tmp_path / "restored" / "embedded")
    assert (out / "target" / "model.bin").read_bytes() == blob and (out / "eval.json").read_text() == "{}"
    with pytest.raises(FileNotFoundError, match="no embedded.tar.partNN"):
        eb.unpack(tmp_path / "restored", tmp_path / "x")


def test_best_eval_step_is_the_best_tau_with_a_checkpoint(tmp_path):
    for step in (5, 10):
        (tmp_path / "checkpoints" / str(step)).mkdir(parents=True)
    rows = [{"kind": "train", "step": 5, "loss": 1.0}, {"kind": "eval", "step": 5, "tau": 3.0},
            {"kind": "eval", "step": 7, "tau": 9.0}, {"kind": "eval", "step": 10, "tau": 4.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert eb.best_eval_step(tmp_path) == (10, 4.0)  # step 7 has no checkpoint left


@pytest.mark.slow
def test_pretrain_samples_on_device_keeps_best_and_stops_early(tokenizer_dir, tmp_path):
    from dflash_jax.io.checkpoint import load_target
    from dflash_jax.training.pretrain import load_pretrain_config, pretrain

    config = load_pretrain_config(eb.REPO / "configs" / "embedded_target.yaml", [
        f"tokenizer={tokenizer_dir}", f"output_dir={tmp_path / 'run'}", f"export_dir={tmp_path / 'hf'}",
        "data.max_files=6", "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=2",
        "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16", "data.seq_len=32", "data.batch_size=4",
        "data.eval_windows=8", "steps=40", "eval_every=4", "log_every=4", "optim.lr=0.5", "early_stop_patience=2",
        "export_shard_mb=0.02"])
    summary = pretrain(config)
    rows = [json.loads(l) for l in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
    assert summary["best_eval_loss"] == min(evals) and summary["exported_step"] == summary["best_step"]
    assert all(r["tokens_per_s"] > 0 for r in rows)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    assert load_target(tmp_path / "hf").config.eos_token_ids == (0, 3)


def test_build_stops_after_until_and_skips_finished_stages(tmp_path, capsys):
    settings = eb.BuildSettings(vocab_size=300, max_files=3)
    assert eb.build(tmp_path / "out", tmp_path / "work", settings=settings, until="tokenizer") == {}
    assert (tmp_path / "work" / "tokenizer" / "tokenizer.json").exists()
    assert not (tmp_path / "out" / "target").exists()
    eb.build(tmp_path / "out", tmp_path / "work", settings=settings, until="tokenizer")
    out = capsys.readouterr().out
    assert "== tokenizer: done already" in out and "== target: not run (--until tokenizer)" in out


def test_the_three_splits_partition_the_stdlib_files():
    splits = {name: set(sc.corpus_files(name)) for name in sc.SPLITS}
    assert all(splits.values())
    assert not (splits["train"] & splits["heldout"] or splits["train"] & splits["drafter"]
                or splits["heldout"] & splits["drafter"])
    total = sum(len(files) for files in splits.values())
    assert 0.04 < len(splits["heldout"]) / total < 0.2 and 0.08 < len(splits["drafter"]) / total < 0.25
    with pytest.raises(ValueError, match="split must be one of"):
        sc.corpus_files("validation")


def test_code_prompts_are_windows_of_the_split_they_are_cut_from(tokenizer_dir):
    from dflash_jax.io.tokenizer import Tokenizer

    tok = Tokenizer(tokenizer_dir)
    prompts = eb.code_prompts(tok, "drafter", 12, 16, max_files=4)
    assert len(prompts) == 12 and all(len(p) == 16 for p in prompts)
    assert len({tuple(p) for p in prompts}) == 12
    texts = [sc.read_text(p) for p in sc.corpus_files("drafter", max_files=4)]
    # a window decodes to text of one of the split's files (its last token may be cut mid-word)
    assert all(any(tok.decode(p[:-1]) in t for t in texts) for p in prompts)
    assert eb.code_prompts(tok, "drafter", 12, 16, max_files=4) == prompts  # seeded


@pytest.mark.slow
def test_answers_in_waves_are_the_rows_answers_alone(tmp_path):
    from dflash_jax.io.checkpoint import save_target
    from dflash_jax.runtime.engine import Engine, EngineConfig
    from dflash_jax.tiny import random_target, tiny_target_config

    target = random_target(tiny_target_config(num_layers=2))  # two layers: each one more compiles in every program
    save_target(target, tmp_path)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, target.config.vocab_size, int(n)).tolist() for n in (3, 9, 5, 12, 4)]
    rows = eb.generate_answers(tmp_path, prompts, 6, batch_size=2)
    assert [r["prompt_ids"] for r in rows] == prompts  # in the prompts' order, whatever the waves' order
    # each prompt alone in a one-row engine (one engine for all: ``generate`` would compile one per prompt)
    engine = Engine(target, None, EngineConfig(max_batch_size=1, max_length=max(map(len, prompts)) + 6))
    alone = [engine.generate([p], 6, stop_token_ids=list(target.config.eos_token_ids))[0] for p in prompts]
    assert [r["output_ids"] for r in rows] == [list(a.output_ids) for a in alone]


# ---------------------------------------------------------------------------------------------
# The drafter2 stage and the evaluation of both generations (training and measurement stubbed)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def built(tokenizer_dir, tmp_path, monkeypatch):
    """A build whose tokenizer, target, answers and DFlash drafter are done already (placeholders), with
    the trainings it runs, the exports and the evaluations recorded instead of done."""
    from dflash_jax.training import checkpointing, cli

    output, work = tmp_path / "out", tmp_path / "work"
    (output / "target").mkdir(parents=True)
    for name in sc.TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, output / "target" / name)
    (output / "target" / "config.json").write_text("{}")
    (output / "drafter").mkdir()
    (output / "drafter" / "model.safetensors").touch()
    (work / "tokenizer").mkdir(parents=True)
    (work / "tokenizer" / "tokenizer.json").touch()
    (work / "target_run").mkdir()
    (work / "target_run" / "summary.json").write_text(json.dumps({"params": 10, "best_eval_loss": 2.5}))
    (work / "answers.jsonl").touch()
    rows = [{"prompt_ids": [5, 6, 7 + i], "prompt": f"def f{i}():\n", "source": f"x.py:{i}",
             "kind": "chat" if i == 2 else "code", **({"request": "Write f2."} if i == 2 else {})} for i in range(4)]
    eb.write_jsonl(work / "eval_prompts.jsonl", rows)
    calls = {"train": [], "export": [], "evaluate": [], "sampled": []}

    def train(argv):  # a run with checkpoints at steps 4 and 8, the best held-out tau at step 4
        calls["train"].append(argv)
        run_dir = Path(next(a for a in argv if a.startswith("output_dir=")).split("=", 1)[1])
        for step in (4, 8):
            (run_dir / "checkpoints" / str(step)).mkdir(parents=True)
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"kind": "eval", "step": k, "tau": t}) + "\n"
                                                       for k, t in ((4, 3.5), (8, 3.0))))
        return 0

    monkeypatch.setattr(cli, "main", train)

    def export(run_dir, out, step=None, dtype="bfloat16"):
        calls["export"].append((run_dir, out, step, dtype))
        out.mkdir(parents=True)
        (out / "model.safetensors").touch()

    monkeypatch.setattr(checkpointing, "export_checkpoint", export)

    def evaluate(target_dir, drafter_dir, ids, new_tokens, block_size=None):
        calls["evaluate"].append((drafter_dir.name, block_size, len(ids)))
        return {"drafter": drafter_dir.name, "block_size": block_size or 16, "tau": 2.0, "identical": True,
                "tau_per_prompt": [1.0 + i for i in range(len(ids))]}

    monkeypatch.setattr(eb, "evaluate", evaluate)
    monkeypatch.setattr(eb, "greedy_samples", lambda target_dir, code, chat, n: [{"code": code, "chat": chat}])

    def sampled(target_dir, drafters, ids, new_tokens, temperatures):
        calls["sampled"].append(sorted(drafters))
        return [{"drafter": name, "temperature": 0.7, "verify": "exact", "tau": 1.5} for name in drafters]

    monkeypatch.setattr(eb, "sampled_taus", sampled)
    return output, work, calls


def test_drafter2_stage_trains_from_the_dflash_drafter_and_exports_its_best_step(built):
    output, work, calls = built
    (output / "eval.json").write_text("{}")  # the evaluation done already: only drafter2 is missing
    settings = eb.BuildSettings(drafter_overrides=("data.batch_size=4",),
                                drafter2_overrides=(*eb.DRAFTER2_OVERRIDES, "steps=7"))
    assert eb.build(output, work, settings=settings) == {}
    (argv,) = calls["train"]
    assert argv[:2] == ["--config", str(eb.REPO / "configs" / "embedded_drafter.yaml")]
    assert f"model.drafter={output / 'drafter'}" in argv and f"model.target={output / 'target'}" in argv
    assert f"data.train_files=[{work / 'answers.jsonl'}]" in argv
    assert f"output_dir={work / 'drafter2_run'}" in argv
    tail = argv[-len(eb.DRAFTER2_OVERRIDES) - 2:]
    assert tail == ["data.batch_size=4", *eb.DRAFTER2_OVERRIDES, "steps=7"]  # the DFlash2 overrides win, the caller's last
    assert "drafter.kind=dflash2" in tail
    # the best held-out tau's checkpoint, in the pair's dtype
    assert calls["export"] == [(work / "drafter2_run", output / "drafter2", 4, "bfloat16")]
    record = json.loads((work / "drafter2_training.json").read_text())
    assert record["overrides"][-1] == "steps=7" and record["initialised_from"] == "drafter"
    assert (record["step"], record["tau"]) == (4, 3.5)
    assert calls["evaluate"] == []  # eval.json exists and was not forced


def test_force_drafter2_redoes_it_and_evaluates_both_generations(built):
    output, work, calls = built
    (output / "drafter2").mkdir()
    (output / "drafter2" / "model.safetensors").touch()
    (output / "eval.json").write_text("{}")
    report = eb.build(output, work, force="drafter2", settings=eb.BuildSettings(eval_prompts=3))
    assert len(calls["train"]) == 1 and len(calls["export"]) == 1  # the drafter stage is not redone
    assert calls["evaluate"] == [("drafter", None, 3), ("drafter", 8, 3), ("drafter2", None, 3), ("drafter2", 8, 3)]
    assert calls["sampled"] == [["dflash", "dflash2"]]
    assert report["drafter"] == "drafter" and report["block_8"]["block_size"] == 8
    assert report["tau_by_kind"] == {"chat": 3.0, "code": 1.5}
    assert report["dflash2"]["drafter"] == "drafter2" and report["dflash2"]["block_8"]["block_size"] == 8
    assert report["dflash2"]["training"]["initialised_from"] == "drafter"
    assert report["target"]["params"] == 10 and report["samples"] == [{"code": "def f0():\n", "chat": "Write f2."}]
    assert json.loads((output / "eval.json").read_text())["dflash2"]["block_size"] == 16
    held = read_jsonl([output / "heldout_prompts.jsonl"])
    assert held == [{"prompt": f"def f{i}():\n", "source": f"x.py:{i}", "kind": "chat" if i == 2 else "code"}
                    for i in range(3)]


def test_until_drafter_leaves_the_dflash2_drafter_and_the_evaluation(built, capsys):
    output, work, calls = built
    assert eb.build(output, work, until="drafter") == {}
    assert calls["train"] == [] and calls["evaluate"] == [] and not (output / "drafter2").exists()
    out = capsys.readouterr().out
    assert "== drafter: done already" in out and "== drafter2: not run (--until drafter)" in out


def test_cli_drafter2_set_follows_the_dflash2_overrides(monkeypatch, tmp_path):
    seen = {}
    monkeypatch.setattr(eb, "build", lambda output, work, force, settings, until=None: seen.update(
        settings=settings, until=until, force=force))
    assert eb.main(["--output", str(tmp_path / "o"), "--work", str(tmp_path / "w"), "--drafter2-set", "steps=7",
                    "--force", "drafter2", "--until", "drafter2"]) == 0
    assert seen["settings"].drafter2_overrides == (*eb.DRAFTER2_OVERRIDES, "steps=7")
    assert (seen["force"], seen["until"]) == ("drafter2", "drafter2")


@pytest.mark.slow
def test_evaluation_of_both_generations_on_a_tiny_pair(tmp_path):
    """``evaluate`` and ``sampled_taus`` (the eval stage's measurements) on a tiny random target with a
    DFlash and a DFlash2 drafter: exact greedy output, the generation named, sampled rows per drafter."""
    from dflash_jax.io.checkpoint import save_drafter, save_target
    from dflash_jax.tiny import random_drafter, random_target, tiny_dflash2_config, tiny_drafter_config, tiny_target_config

    tcfg = tiny_target_config(num_layers=2)  # two layers, each tapped: each one more compiles in every program
    save_target(random_target(tcfg), tmp_path / "target")
    save_drafter(random_drafter(tiny_drafter_config(tcfg)), tmp_path / "drafter")
    save_drafter(random_drafter(tiny_dflash2_config(tcfg)), tmp_path / "drafter2")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, tcfg.vocab_size, int(n)).tolist() for n in (5, 9)]
    for name, want in (("drafter", "dflash"), ("drafter2", "dflash2")):
        r = eb.evaluate(tmp_path / "target", tmp_path / name, prompts, 12, block_size=4)
        assert r["drafter"] == want and r["block_size"] == 4 and r["identical"] is True and r["prompts"] == 2
        assert r["tau"] >= 1.0 and sum(r["histogram"].values()) > 0
    rows = eb.sampled_taus(tmp_path / "target", {"dflash": tmp_path / "drafter", "dflash2": tmp_path / "drafter2"},
                           prompts, 8, (1.0,), block_size=4)
    assert {row["drafter"] for row in rows} == {"dflash", "dflash2"} and all(row["tau"] >= 1.0 for row in rows)
