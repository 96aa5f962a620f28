"""What ``train.py`` tells a person: where the run writes, a readable summary at the end, "resumed from
step N", and a finished run left alone ("run already complete"), with nothing trained or evaluated again."""

from __future__ import annotations

import json

import pytest
import yaml

CONFIG = dict(
    model=dict(target="pattern:3:0", compute_dtype="float32", target_dtype="float32"),
    drafter=dict(num_layers=1, block_size=4, mask_token_id=95),
    data=dict(seq_len=32, batch_size=2, self_generated=dict(num_examples=16, prompt_len=4, new_tokens=28,
                                                            eval_prompts=1)),
    loss=dict(num_anchors=4),
    mesh=dict(data=1),
    eval=dict(num_prompts=1, max_new_tokens=8),
    steps=2, save_every=1, keep=2, log_every=1, progress=False, tensorboard=True,
)


@pytest.mark.slow
def test_train_py_says_where_it_writes_sums_up_resumes_and_leaves_a_finished_run_alone(tmp_path, capsys):
    from dflash_jax.training import cli as train_cli

    run = tmp_path / "run"
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, "output_dir": str(run)}))

    def train(*overrides: str) -> str:
        assert train_cli.main(["--config", str(path), *overrides]) == 0
        return capsys.readouterr().out

    out = train()
    assert f"train.py: run directory {run}\n" in out
    for where in (f"checkpoints  {run / 'checkpoints'}", f"metrics      {run / 'metrics.jsonl'}",
                  f"TensorBoard  {run / 'tb'}"):
        assert where in out, out
    assert "train.py: done: 2 steps of 2 in " in out
    assert "  loss         final " in out and ", best " in out and "  eval tau     " in out, out
    assert f"  checkpoint   {run / 'checkpoints' / '2'}  (last; kept: 1, 2)" in out, out
    assert f"python train.py export --checkpoint {run} --output DIR" in out
    assert not any(line.startswith("{") for line in out.splitlines())  # no JSON dump
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [row for row in evals if row["kind"] == "eval"]
    assert len(evals) == 1

    again = train()
    assert "train.py: run already complete at step 2 (raise `steps` to continue)" in again, again
    assert f"  checkpoint   {run / 'checkpoints' / '2'}" in again
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len([row for row in rows if row["kind"] == "eval"]) == 1  # not evaluated again

    more = train("steps=3")
    assert "resumed from step 2 of 3" in more and "train.py: done: steps 3-3 of 3 (resumed from step 2) in " in more
    assert f"  checkpoint   {run / 'checkpoints' / '3'}  (last; kept: 2, 3)" in more, more


@pytest.mark.parametrize("kept", [[], [5, 10]])
def test_ctrl_c_says_which_checkpoints_are_kept_and_how_to_resume(tmp_path, capsys, monkeypatch, kept):
    from dflash_jax.training import cli as train_cli
    from dflash_jax.training import run as train_run

    run = tmp_path / "run"
    for step in kept:
        (run / "checkpoints" / str(step)).mkdir(parents=True)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump({**CONFIG, "output_dir": str(run), "save_every": 5}))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_run, "train", interrupted)
    assert train_cli.main(["--config", str(path)]) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err
    if kept:
        assert f"train.py: interrupted; checkpoints kept in {run / 'checkpoints'}: steps 5, 10; run the same " \
               "command again to resume from step 10" in err, err
    else:
        assert "train.py: interrupted before the first checkpoint (every save_every=5 steps)" in err, err
