"""Drafter training against a hybrid linear-attention target (Qwen3.5) on the CPU."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")  # hybrid_fixtures writes its checkpoints with transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybrid_fixtures import write_hf_hybrid  # noqa: E402

from dflash_jax.training.config import load_train_config  # noqa: E402


@pytest.mark.slow
@pytest.mark.parametrize("moe", [False, True])
def test_training_against_a_hybrid_target_lowers_the_loss_and_exports(tmp_path, moe):
    """The target's taps (linear and full-attention layers) feed a fresh drafter; self-generated
    data comes from the engine serving the hybrid target (dense, or MoE: routed experts and the
    gated shared expert); the loss falls and the export loads."""
    import yaml

    from dflash_jax.io.checkpoint import load_drafter
    from dflash_jax.training.checkpointing import export_checkpoint
    from dflash_jax.training.run import train

    from tokenizer_fixtures import write_qwen_tokenizer

    target_dir, _ = write_hf_hybrid(tmp_path / "target", nesting="vl", seed=7, moe=moe, vocab_size=520)
    write_qwen_tokenizer(target_dir, vocab_size=512)
    recipe = dict(
        model=dict(target=str(target_dir), compute_dtype="float32", target_dtype="float32"),
        drafter=dict(num_layers=1, block_size=4, mask_token_id=519, target_layer_ids=[1, 4]),
        data=dict(seq_len=32, batch_size=8,
                  self_generated=dict(num_examples=64, prompt_len=6, new_tokens=26, eval_prompts=0)),
        loss=dict(num_anchors=8), optim=dict(lr=2e-2), mesh=dict(data=1), eval=dict(num_prompts=0),
        steps=80, save_every=80, log_every=10, progress=False, tensorboard=False,
        output_dir=str(tmp_path / "run"),
    )
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(recipe))
    cfg = load_train_config(path)
    train(cfg)
    rows = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"]
    assert rows[-1]["loss"] < 0.97 * rows[0]["loss"], [r["loss"] for r in rows]
    out = export_checkpoint(tmp_path / "run", tmp_path / "export", dtype="float32")
    drafter = load_drafter(out)
    assert drafter.config.target_layer_ids == (1, 4) and drafter.config.num_target_layers == 5
