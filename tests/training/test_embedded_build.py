"""The embedded build's drafter2 stage: which training it runs (the DFlash recipe with the DFlash2
overrides, started from the stage before's drafter), what it exports, and the evaluation of both
generations, with the training and the measurement stubbed (the real ones are the shipped pair's build)."""

import json
import shutil

import pytest

from dflash_jax import embedded
from dflash_jax.training import checkpointing, embedded_build

pytestmark = pytest.mark.skipif(not embedded.available(), reason="models/embedded is not built")


@pytest.fixture
def built(tmp_path, monkeypatch):
    """A build whose tokenizer, target, answers and DFlash drafter are done already (placeholders), with
    the commands it runs, the exports and the evaluations recorded instead of done."""
    output, work = tmp_path / "out", tmp_path / "work"
    (output / "target").mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded.DEFAULT_TARGET / name, output / "target" / name)
    (output / "target" / "model.safetensors").touch()
    (output / "drafter").mkdir()
    (output / "drafter" / "model.safetensors").touch()
    (work / "tokenizer").mkdir(parents=True)
    (work / "tokenizer" / "tokenizer.json").touch()
    (work / "answers.jsonl").touch()
    rows = [{"prompt_ids": [5, 6, 7 + i], "prompt": f"def f{i}():\n", "source": f"x.py:{i}"} for i in range(3)]
    embedded_build.write_jsonl(work / "eval_prompts.jsonl", rows)
    calls = {"run": [], "export": [], "evaluate": []}
    monkeypatch.setattr(embedded_build, "_run", lambda cmd: calls["run"].append(cmd))

    def export(run_dir, out, dtype):
        calls["export"].append((run_dir, out, dtype))
        out.mkdir(parents=True)
        (out / "model.safetensors").touch()

    monkeypatch.setattr(checkpointing, "export_checkpoint", export)

    def evaluate(target_dir, drafter_dir, ids, new_tokens, block_size=None):
        calls["evaluate"].append((drafter_dir.name, block_size, len(ids)))
        return {"drafter": drafter_dir.name, "block_size": block_size or 16}

    monkeypatch.setattr(embedded_build, "evaluate", evaluate)
    return output, work, calls


def test_drafter2_stage_trains_from_the_dflash_drafter_and_exports_float32(built):
    output, work, calls = built
    (output / "eval.json").write_text("{}")  # the evaluation done already: only drafter2 is missing
    embedded_build.build(output, work, overrides={"drafter2": ["steps=7"]}, eval_prompts=2)
    (cmd,) = calls["run"]
    assert cmd[1:4] == ["train.py", "--config", "configs/embedded_drafter.yaml"]
    assert f"model.drafter={output / 'drafter'}" in cmd and f"model.target={output / 'target'}" in cmd
    assert f"data.train_files=[{work / 'answers.jsonl'}]" in cmd
    assert f"output_dir={work / 'drafter2_run'}" in cmd
    tail = cmd[-len(embedded_build.DRAFTER2_OVERRIDES) - 1:]
    assert tail == [*embedded_build.DRAFTER2_OVERRIDES, "steps=7"]  # the caller's overrides win
    assert "drafter.kind=dflash2" in tail
    assert calls["export"] == [(work / "drafter2_run", output / "drafter2", "float32")]
    assert json.loads((work / "drafter2_training.json").read_text())["overrides"][-1] == "steps=7"
    assert calls["evaluate"] == []  # eval.json exists and was not forced


def test_force_drafter2_redoes_it_and_evaluates_both_generations(built):
    output, work, calls = built
    (output / "drafter2").mkdir()
    (output / "drafter2" / "model.safetensors").touch()
    (output / "eval.json").write_text("{}")
    report = embedded_build.build(output, work, force="drafter2", eval_prompts=2)
    assert len(calls["run"]) == 1 and len(calls["export"]) == 1  # the drafter stage is not redone
    assert calls["evaluate"] == [("drafter", None, 2), ("drafter", 8, 2), ("drafter2", None, 2), ("drafter2", 8, 2)]
    assert report["drafter"] == "drafter" and report["block_8"]["block_size"] == 8
    assert report["dflash2"]["drafter"] == "drafter2" and report["dflash2"]["block_8"]["block_size"] == 8
    assert report["dflash2"]["training"]["initialised_from"] == "drafter"
    assert json.loads((output / "eval.json").read_text())["dflash2"]["block_size"] == 16
    held = [json.loads(line) for line in (output / "heldout_prompts.jsonl").read_text().splitlines()]
    assert held == [{"prompt": "def f0():\n", "source": "x.py:0"}, {"prompt": "def f1():\n", "source": "x.py:1"}]
