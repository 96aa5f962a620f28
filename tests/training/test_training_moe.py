"""Drafter training against mixture-of-experts targets (the frozen target's forward through the expert op)."""

import json
from pathlib import Path

import pytest

from dflash_jax.io.checkpoint import save_target
from dflash_jax.tiny import random_target, tiny_target_config
from dflash_jax.training.config import load_train_config


@pytest.mark.slow
@pytest.mark.parametrize("model_type,overrides", [
    ("qwen3_moe", dict(mlp_only_layers=())),  # every layer alike: stacked under lax.scan
    ("gpt_oss", dict()),  # sliding and full layers: unrolled
])
def test_drafter_loss_falls_against_moe_target(model_type, overrides, tmp_path):
    import yaml

    from dflash_jax.training.run import train

    from tokenizer_fixtures import write_qwen_tokenizer

    target_dir = tmp_path / "target"
    save_target(random_target(tiny_target_config(model_type, vocab_size=320, **overrides), seed=4), target_dir)
    write_qwen_tokenizer(target_dir, vocab_size=320)
    config = dict(
        model=dict(target=str(target_dir), compute_dtype="float32", target_dtype="float32"),
        drafter=dict(num_layers=1, block_size=4, mask_token_id=319),
        data=dict(seq_len=32, batch_size=4,
                  self_generated=dict(num_examples=32, prompt_len=4, new_tokens=28, eval_prompts=0)),
        loss=dict(num_anchors=8), optim=dict(lr=5e-3), mesh=dict(data=1), eval=dict(num_prompts=0),
        steps=24, save_every=1000, log_every=4, progress=False, output_dir=str(tmp_path / "run"),
    )
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(config))
    result = train(load_train_config(path))
    rows = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"]
    assert rows[-1]["loss"] < 0.85 * rows[0]["loss"], [r["loss"] for r in rows]
    assert result["train"]["tokens_per_s"] > 0
    assert Path(tmp_path / "run").exists()
