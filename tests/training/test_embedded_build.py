"""The embedded default's build pipeline, piece by piece on tiny inputs: the ChatML tokenizer (role
tokens, template, stop tokens), the instruction-shaped examples, bfloat16 sharded exports that load
into float32, packing the output for a size-limited transfer, and the device-sampled pretraining step."""

import json

import numpy as np
import pytest

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


def test_bfloat16_sharded_target_loads_as_float32(tmp_path):
    import jax
    from flax import nnx

    from dflash_jax.io.checkpoint import load_target, save_target
    from dflash_jax.tiny import random_target, tiny_target_config
    from dflash_jax.training.pretrain import shard_safetensors

    target = random_target(tiny_target_config())
    save_target(target, tmp_path, dtype="bfloat16")
    single = (tmp_path / "model.safetensors").stat().st_size
    files = shard_safetensors(tmp_path, max_shard_bytes=single // 3)
    assert len(files) >= 3 and not (tmp_path / "model.safetensors").exists()
    assert all(f.stat().st_size <= single // 3 + 4096 for f in files)  # + the header
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == [f.name for f in files]
    loaded = load_target(tmp_path, dtype="float32")
    for a, b in zip(jax.tree.leaves(nnx.state(target, nnx.Param)), jax.tree.leaves(nnx.state(loaded, nnx.Param))):
        assert b.dtype == np.float32
        np.testing.assert_array_equal(np.asarray(a.astype("bfloat16")).astype(np.float32), np.asarray(b))


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
    from dflash_jax.runtime.engine import generate
    from dflash_jax.tiny import random_target, tiny_target_config

    target = random_target(tiny_target_config())
    save_target(target, tmp_path)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, target.config.vocab_size, int(n)).tolist() for n in (3, 9, 5, 12, 4)]
    rows = eb.generate_answers(tmp_path, prompts, 6, batch_size=2)
    assert [r["prompt_ids"] for r in rows] == prompts  # in the prompts' order, whatever the waves' order
    alone = [generate(target, None, [p], max_new_tokens=6, stop_token_ids=list(target.config.eos_token_ids))[0]
             for p in prompts]
    assert [r["output_ids"] for r in rows] == [list(a.output_ids) for a in alone]
