"""Training under bad input: data records checked as read (file and line named), non-finite losses
that stop a run before it saves, data that filters everything out, a full disk, a resume without
the run's config.yaml, and a fuzz of training records."""

import errno
import json
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.io.config import ConfigError
from dflash_jax.training.config import DataConfig, load_train_config
from dflash_jax.training.data import DataError, build_dataset

VOCAB = 96  # the pattern target's vocabulary

GOOD = {"input_ids": list(range(1, 25)), "loss_mask": [0] * 4 + [1] * 20}

TINY = dict(
    model=dict(target="pattern:3:0", compute_dtype="float32", target_dtype="float32"),
    drafter=dict(num_layers=1, block_size=4, mask_token_id=95),
    data=dict(seq_len=32, batch_size=2, shuffle=False, prefetch=0),
    loss=dict(num_anchors=4),
    mesh=dict(data=1),
    eval=dict(num_prompts=0),
    steps=4, save_every=1, log_every=10, progress=False, tensorboard=False,
)


def _jsonl(path: Path, lines) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def _config_file(tmp_path, files, **top):
    import yaml

    cfg = json.loads(json.dumps(TINY))
    cfg["data"]["train_files"] = [str(f) for f in files]
    cfg.update(output_dir=str(tmp_path / "run"), **top)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _cli(argv, capsys):
    """``train.py`` in-process: ``(exit status, stderr lines)``."""
    from dflash_jax.training import cli as train_cli

    rc = train_cli.main([str(a) for a in argv])
    return rc, capsys.readouterr().err.strip().splitlines()


def _data(files=("x",), **changes):
    return DataConfig(train_files=tuple(str(f) for f in files), seq_len=32, batch_size=1, shuffle=False,
                      prefetch=0, **changes)


@pytest.fixture
def fake_step(monkeypatch):
    """Replaces the compiled train step by a cheap one (nothing of the model is compiled): the
    weights move by one per micro-step; from micro-step ``nan_from`` (1-based) on, the loss and
    gradient norm (``metrics=True``) or only the weights (``metrics=False``) become NaN."""
    from dflash_jax.training import run
    from dflash_jax.training.trainer import TrainState

    settings = {"nan_from": 10**9, "metrics": True}

    def make_train_step(drafter_graphdef, drafter_rest, target_graph, tx, spec):
        nan_from = settings["nan_from"]
        with_metrics = settings["metrics"]

        def step(state, target_params, batch):
            bad = state.step + 1 >= nan_from
            params = jax.tree.map(lambda p: jnp.where(bad, jnp.nan, p + 1.0), state.params)
            value = jnp.where(bad & with_metrics, jnp.nan, 1.0).astype(jnp.float32)
            return TrainState(params, state.opt_state, state.step + 1), {"loss": value, "grad_norm": value}

        return step

    monkeypatch.setattr(run, "make_train_step", make_train_step)
    return settings


def _saved_params(run_dir, step):
    from dflash_jax.io.orbax import load_drafter_from_orbax
    from flax import nnx

    drafter = load_drafter_from_orbax(run_dir, step=step)
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(drafter, nnx.Param))]


# -- token ids outside the vocabulary ------------------------------------------------------------


def test_token_ids_outside_the_vocabulary_name_the_file_line_and_id(tmp_path, capsys):
    for bad, want in [(5000, "input_ids[3] = 5000 is outside the vocabulary [0, 96)"),
                      (-7, "input_ids[3] = -7 is outside the vocabulary [0, 96)"),
                      (96, "input_ids[3] = 96 is outside")]:
        ids = [1, 2, 3, bad] + list(range(4, 20))
        path = _jsonl(tmp_path / "data.jsonl", [GOOD, GOOD, {"input_ids": ids}])
        with pytest.raises(DataError, match=f"^{path}:3: " + want.replace("[", r"\[").replace(")", r"\)")):
            build_dataset(_data([path]), None, vocab_size=VOCAB)
    # output_ids / prompt_ids (serve.py generate lines) too, and records given in memory.
    path = _jsonl(tmp_path / "gen.jsonl", [GOOD, {"prompt_ids": [1, 2], "output_ids": [3, 4, 100]}])
    with pytest.raises(DataError, match=f"^{path}:2: output_ids\\[2\\] = 100 is outside"):
        build_dataset(_data([path]), None, vocab_size=VOCAB)
    with pytest.raises(DataError, match=r"^records\[1\]: prompt_ids\[0\] = -1 is outside"):
        build_dataset(_data(), None, vocab_size=VOCAB, records=[GOOD, {"prompt_ids": [-1], "output_ids": [3, 4]}])
    # The CLI: one line, before anything is written to output_dir.
    path = _jsonl(tmp_path / "cli.jsonl", [GOOD, {"input_ids": [1, 2, 3, 5000, 4, 5]}])
    rc, err = _cli(["--config", _config_file(tmp_path, [path])], capsys)
    assert rc == 2 and err[-1] == f"error: {path}:2: input_ids[3] = 5000 is outside the vocabulary [0, 96)", err
    assert not (tmp_path / "run").exists()


def test_a_misspelled_loss_mask_is_named_not_ignored(tmp_path):
    """An ignored mask would train on every token; a near miss of the key is an error naming it."""
    for key in ("loss_masks", "lossmask", "Loss_mask"):
        path = _jsonl(tmp_path / "data.jsonl", [GOOD, {"input_ids": [1, 2, 3, 4], key: [0, 0, 1, 1]}])
        with pytest.raises(DataError, match=f"^{path}:2: unknown key '{key}'; did you mean 'loss_mask'"):
            build_dataset(_data([path]), None, vocab_size=VOCAB)
    # Unrelated extra keys (serve.py generate lines carry several) are still fine.
    path = _jsonl(tmp_path / "ok.jsonl", [GOOD, {"input_ids": [1, 2, 3, 4], "source": "x", "id": 7}])
    next(iter(build_dataset(_data([path]), None, vocab_size=VOCAB)))


def test_tokenizer_ids_outside_the_vocabulary_are_named(tmp_path):
    """Ids a tokenizer makes that the target's embedding lacks (a mismatched tokenizer)."""

    class Tok:
        def encode(self, text, add_special_tokens=True):
            return [1, 2, 3, 500] if "bad" in text else [1, 2, 3, 4]

    path = _jsonl(tmp_path / "text.jsonl", [{"text": "bad"}])
    with pytest.raises(DataError, match=f"^{path}:1: the tokenized record has token id 500, outside"):
        build_dataset(_data([path]), Tok(), vocab_size=VOCAB)


# -- a non-finite loss stops the run before it saves ----------------------------------------------


@pytest.mark.parametrize("log_every", [1, 10])
def test_non_finite_loss_stops_before_a_checkpoint(tmp_path, fake_step, log_every):
    """NaN at step 3: the run stops naming step 3 whether the metrics are read for logging or only
    before the save; checkpoints 1 and 2 are kept, finite, and no NaN checkpoint is written."""
    from dflash_jax.io.orbax import step_dirs
    from dflash_jax.training.run import NonFiniteError, train

    fake_step["nan_from"] = 3
    cfg = load_train_config(_config_file(tmp_path, [], log_every=log_every),
                            ["data.self_generated.num_examples=16", "data.train_files=[]"])
    with pytest.raises(NonFiniteError, match=r"^step 3: the loss \(nan\) and the grad norm \(nan\) are not finite; "
                                             r"the run stops without saving \(kept checkpoints: 1, 2\)"):
        train(cfg)
    assert step_dirs(cfg.output_dir) == [1, 2]
    assert all(np.isfinite(p).all() for p in _saved_params(cfg.output_dir, 2))


def test_non_finite_weights_are_never_saved(tmp_path, fake_step, capsys):
    """Weights that went NaN while the metrics look finite: the save refuses; the CLI says so in one line."""
    from dflash_jax.io.orbax import step_dirs

    fake_step.update(nan_from=2, metrics=False)
    path = _config_file(tmp_path, [], steps=3)
    rc, err = _cli(["--config", path, "data.self_generated.num_examples=16", "data.train_files=[]"], capsys)
    assert rc == 2 and err[-1].startswith("error: step 2: the drafter's weights are not finite"), err
    assert not any("Traceback" in line for line in err), err
    assert step_dirs(tmp_path / "run") == [1]


# -- everything filtered out ----------------------------------------------------------------------


def _first_batch_or_error(config, records):
    """``next(iter(build_dataset(...)))`` in a thread: the error it raised, or "hangs"."""
    box = {}

    def work():
        try:
            box["batch"] = next(iter(build_dataset(config, None, vocab_size=VOCAB, records=records)))
        except Exception as err:  # noqa: BLE001 - reported to the test
            box["error"] = err

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    thread.join(30)
    return "hangs" if thread.is_alive() else box.get("error", box.get("batch"))


@pytest.mark.parametrize("records", [
    [{"input_ids": list(range(1, 20)), "loss_mask": [0] * 19}] * 3,  # all-zero loss masks
    [{"prompt_ids": list(range(1, 40)), "output_ids": [1, 2, 3]}] * 3,  # the answer is cut off by seq_len
    [{"input_ids": [5], "loss_mask": [1]}] * 3,  # fewer than data.min_supervised=2
])
def test_every_record_filtered_out_fails_fast(records):
    got = _first_batch_or_error(_data(), records)
    assert isinstance(got, DataError), got
    assert "none of the 3 records has data.min_supervised=2 supervised tokens within data.seq_len=32" in str(got)
    assert "nothing to train on" in str(got)
    # One usable record among them is enough.
    batch = _first_batch_or_error(_data(), records + [GOOD])
    assert isinstance(batch, dict) and batch["input_ids"].shape == (1, 32), batch


def test_every_record_filtered_out_through_the_cli(tmp_path, capsys):
    path = _jsonl(tmp_path / "zero.jsonl", [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 0, 0]}] * 2)
    rc, err = _cli(["--config", _config_file(tmp_path, [path])], capsys)
    assert rc == 2 and err[-1].startswith("error: data.train_files") and "nothing to train on" in err[-1], err


# -- malformed train_files ------------------------------------------------------------------------


def test_bad_train_files_name_the_file_and_field(tmp_path, capsys):
    (tmp_path / "a_dir").mkdir()
    cases = [
        ([tmp_path / "a_dir"], f"{tmp_path / 'a_dir'}: is a directory"),
        ([_jsonl(tmp_path / "keys.jsonl", [GOOD, {"inputs": [1, 2], "labels": [3]}])],
         f"{tmp_path / 'keys.jsonl'}:2: a record needs input_ids, output_ids, messages, prompt or text; "
         "keys ['inputs', 'labels']"),
        ([_jsonl(tmp_path / "str.jsonl", [{"input_ids": ["1", "2", "3"]}])],
         f"{tmp_path / 'str.jsonl'}:1: input_ids[0] is '1', not an integer token id"),
        ([_jsonl(tmp_path / "mask.jsonl", [{"input_ids": [1, 2, 3], "loss_mask": [1, 1]}])],
         f"{tmp_path / 'mask.jsonl'}:1: loss_mask must be a list of 0/1 of the length of input_ids (3)"),
        ([_jsonl(tmp_path / "big.jsonl", [GOOD, "{\"input_ids\": [1" + "0" * 5000 + "]}"])],
         f"{tmp_path / 'big.jsonl'}:2: "),
        ([_jsonl(tmp_path / "deep.jsonl", ["[" * 100000 + "]" * 100000])], f"{tmp_path / 'deep.jsonl'}:1: "),
    ]
    for files, want in cases:
        with pytest.raises(DataError) as info:
            build_dataset(_data(files), None, vocab_size=VOCAB)
        assert str(info.value).startswith(want), (want, str(info.value))
    # Through the CLI: one line, exit status 2.
    rc, err = _cli(["--config", _config_file(tmp_path, [tmp_path / "a_dir"])], capsys)
    assert rc == 2 and err[-1].startswith(f"error: {tmp_path / 'a_dir'}: is a directory"), err
    rc, err = _cli(["--config", _config_file(tmp_path, [tmp_path / "keys.jsonl"])], capsys)
    assert rc == 2 and err[-1].startswith(f"error: {tmp_path / 'keys.jsonl'}:2: a record needs"), err


def test_bad_eval_prompts_name_the_file_and_line(tmp_path):
    from dflash_jax.training.data import read_prompts

    path = _jsonl(tmp_path / "eval.jsonl", [{"prompt_ids": [1, 2]}, {"prompt_ids": ["x"]}])
    with pytest.raises(DataError, match=f"^{path}:2: prompt_ids\\[0\\] is 'x'"):
        read_prompts(path, None)
    path = _jsonl(tmp_path / "eval2.jsonl", [{"input_ids": [1, 200]}])
    with pytest.raises(DataError, match=f"^{path}:1: input_ids\\[1\\] = 200 is outside the vocabulary"):
        read_prompts(path, None, vocab_size=VOCAB)
    path = _jsonl(tmp_path / "eval3.jsonl", [{"question": "?"}])
    with pytest.raises(DataError, match=f"^{path}:1: a prompt record needs"):
        read_prompts(path, None)


# -- a full disk ----------------------------------------------------------------------------------


def test_disk_full_during_a_save_is_one_line_and_keeps_the_earlier_checkpoints(tmp_path, fake_step, monkeypatch,
                                                                                capsys):
    from dflash_jax.io.orbax import step_dirs
    from dflash_jax.training.checkpointing import Checkpointer

    original = Checkpointer.save

    def save(self, step, *args, **kwargs):
        if step >= 3:
            raise OSError(errno.ENOSPC, "No space left on device", str(self.directory / f"{step}.tmp"))
        return original(self, step, *args, **kwargs)

    monkeypatch.setattr(Checkpointer, "save", save)
    path = _config_file(tmp_path, [])
    rc, err = _cli(["--config", path, "data.self_generated.num_examples=16", "data.train_files=[]"], capsys)
    run = tmp_path / "run"
    assert rc == 2, err
    assert err[-1] == (f"error: {run.absolute() / 'checkpoints'}: cannot write the checkpoint of step 3: No space left "
                       "on device; the earlier checkpoints (1, 2) are intact: free space and rerun the command to "
                       "resume"), err
    assert not any("Traceback" in line for line in err), err
    assert step_dirs(run) == [1, 2]
    assert all(np.isfinite(p).all() for p in _saved_params(run, 2))


def test_disk_full_in_the_background_write_is_one_line(tmp_path, fake_step, monkeypatch, capsys):
    """The asynchronous part of the last save fails (reported when the run waits for it)."""
    from dflash_jax.training.checkpointing import Checkpointer

    original = Checkpointer.close

    def close(self):
        original(self)
        try:
            raise OSError(errno.ENOSPC, "No space left on device")
        except OSError as err:
            raise RuntimeError("async save failed") from err

    monkeypatch.setattr(Checkpointer, "close", close)
    rc, err = _cli(["--config", _config_file(tmp_path, [], steps=2), "data.self_generated.num_examples=16",
                    "data.train_files=[]"], capsys)
    assert rc == 2 and "cannot write the last checkpoint: No space left on device" in err[-1], err
    assert not any("Traceback" in line for line in err), err


# -- resume without config.yaml -------------------------------------------------------------------


def test_resume_without_config_yaml_is_refused(tmp_path, fake_step, capsys):
    from dflash_jax.training.run import check_resume

    path = _config_file(tmp_path, [], steps=2)
    args = ["--config", path, "data.self_generated.num_examples=16", "data.train_files=[]"]
    assert _cli(args, capsys)[0] == 0
    run = tmp_path / "run"
    saved = (run / "config.yaml").read_text()
    (run / "config.yaml").unlink()
    cfg = load_train_config(path, ["data.self_generated.num_examples=16", "data.train_files=[]", "steps=3"])
    with pytest.raises(ConfigError, match="holds checkpoints \\(latest step 2\\) but no config.yaml"):
        check_resume(cfg, run, None)
    rc, err = _cli(args + ["steps=3"], capsys)
    assert rc == 2 and err[-1].startswith(f"config error: output_dir {run} holds checkpoints"), err
    assert f"copy the config the run was started with to {run / 'config.yaml'}" in err[-1]
    assert not (run / "config.yaml").exists()
    (run / "config.yaml").write_text("")  # an empty file is no config either
    with pytest.raises(ConfigError, match="expected the run's config"):
        check_resume(cfg, run, None)
    # The documented way on: the run's config put back; then the usual comparison applies.
    (run / "config.yaml").write_text(saved)
    assert check_resume(cfg, run, None) == 2


# -- fuzz -----------------------------------------------------------------------------------------

JUNK = [None, "", "x", "1", 0, -1, 1.5, True, 10**30, [], {}, [None], ["1"], [1.5], [True], [[1]],
        [{"a": 1}], [10**30], [-1], [VOCAB], [1, None], {"nested": [1, {"x": None}]}, [[]], "\u00e9" * 3]

BASES = [
    {"input_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [0, 0, 1, 1, 1, 1]},
    {"prompt_ids": [1, 2], "output_ids": [3, 4, 5, 6]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}],
     "output_ids": [3, 4, 5]},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]},
    {"prompt": "hi", "response": "hello there"},
    {"prompt": [{"role": "user", "content": "hi"}], "answer": "hello there"},
    {"text": "some plain text"},
]


RAW_LINES = ["null", "[]", '"str"', "{}", "1", '{"": 1}', "[" * 5000 + "]" * 5000,
             '{"input_ids": [' + "9" * 5000 + "]}", '{"text": "\\ud800"}', "\x00", '{"input_ids": [1, 2], "input_ids": "x"}']


def _mutations():
    """(description, JSON line) of every base record with each key removed or set to each junk
    value, list elements and message fields set to junk, and junk whole lines."""
    for b, base in enumerate(BASES):
        for key in base:
            yield f"{b}:-{key}", json.dumps({k: v for k, v in base.items() if k != key})
            for j, value in enumerate(JUNK):
                yield f"{b}:{key}={j}", json.dumps({**base, key: value})
            value = base[key]
            if isinstance(value, list):
                for j, junk in enumerate(JUNK[:12]):
                    if value and isinstance(value[0], dict):
                        yield f"{b}:{key}[0]={j}", json.dumps({**base, key: [junk] + value[1:]})
                        for field in ("role", "content"):
                            msg = dict(value[-1], **{field: junk})
                            yield f"{b}:{key}[-1].{field}={j}", json.dumps({**base, key: value[:-1] + [msg]})
                    else:
                        yield f"{b}:{key}[-1]={j}", json.dumps({**base, key: value[:-1] + [junk]})
        yield f"{b}:+extra", json.dumps({**base, "extra": {"deep": [None, [1, "x"]]}})
    for j, line in enumerate(RAW_LINES):
        yield f"line{j}", line


@pytest.mark.parametrize("stride", [pytest.param(1, marks=pytest.mark.slow), 9])
def test_fuzz_training_records(tmp_path, stride):
    """Every mutated record (line 3 of a file of good records) either trains (batches come out) or
    fails with a DataError naming the file and line 3; never another exception type. The fast tier
    tries every ``stride``-th mutation, the slow tier all of them."""
    from tokenizer_fixtures import write_qwen_tokenizer

    from dflash_jax.io.tokenizer import Tokenizer

    tok = Tokenizer(write_qwen_tokenizer(tmp_path / "tok", vocab_size=320))
    vocab = len(tok)
    good = [json.dumps(BASES[0]), json.dumps(BASES[4])]
    config = DataConfig(train_files=(str(tmp_path / "f.jsonl"),), seq_len=64, batch_size=1, shuffle=False,
                        prefetch=0)
    outcomes = {"ok": 0, "error": 0}
    cases = list(_mutations())
    cases = cases[:-len(RAW_LINES)][::stride] + cases[-len(RAW_LINES):]  # the junk lines always
    for name, line in cases:
        path = tmp_path / "f.jsonl"
        path.write_text("\n".join(good + [line, good[0]]) + "\n")
        try:
            it = iter(build_dataset(config, tok, vocab_size=vocab))
            for _ in range(6):  # more than an epoch of the 4 records
                batch = next(it)
                assert batch["input_ids"].shape == (1, 64) and (batch["input_ids"] < vocab).all()
            outcomes["ok"] += 1
        except DataError as err:
            assert str(err).startswith(f"{path}:3: "), (name, line[:200], str(err)[:300])
            outcomes["error"] += 1
        except Exception as err:  # noqa: BLE001 - the assertion names it
            pytest.fail(f"{name}: {line[:200]!r} raised {type(err).__name__}: {str(err)[:300]}")
    assert outcomes["ok"] > 30 // stride and outcomes["error"] > 300 // stride, outcomes
