"""Training-loss parity with the speculators trainers (DFlash2 and DFlash) on a fixed batch with
fixed anchors: loss and every gradient within float32 tolerance; and a short DFlash2 training run."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.io.checkpoint import _tensors
from dflash_jax.training.trainer import StepSpec, _Forward, anchored_loss, split_drafter
from dflash_jax.tiny import random_drafter, random_target, tiny_dflash2_config, tiny_drafter_config, tiny_target_config

SEQ, ANCHORS = 40, (2, 5, 12, 19, 30)


def _greedy_batch(target, seed=0, prompt=6, masked=(2, 3, 25)):
    """A row the target itself continues greedily after a random prompt (so the data's labels are the
    target's argmax, where hard-label CE is the same loss in both trainers), some positions unsupervised."""
    ids = np.zeros((1, SEQ), np.int64)
    ids[0, :prompt] = np.random.default_rng(seed).integers(0, target.config.vocab_size - 1, prompt)
    forward = jax.jit(lambda x: target.forward(x)[0])
    for pos in range(prompt, SEQ):
        ids[0, pos] = int(np.argmax(np.asarray(forward(jnp.asarray(ids)))[0, pos - 1]))
    mask = np.ones((1, SEQ), np.float32)
    mask[0, :prompt] = 0.0  # the prompt is not the target's output
    mask[0, list(masked)] = 0.0
    return ids, mask


def _ours(target, drafter, ids, mask, *, weighting, kind, gamma=4.0, alpha=0.7):
    # jitted, as the trainer runs it: op by op, the loss, its gradient and the target's forward compile
    # each primitive on its own, several times the compile time of one program
    logits, taps = jax.jit(lambda x: target.forward(x, tap_layers=drafter.config.target_layer_ids))(jnp.asarray(ids))
    fwd = _Forward(taps, logits)
    spec = StepSpec(block_size=drafter.config.block_size, mask_token_id=drafter.config.mask_token_id,
                    target_layer_ids=drafter.config.target_layer_ids, num_anchors=len(ANCHORS), kind=kind,
                    weighting=weighting, gamma=gamma, dpace_alpha=0.5, compute_dtype=jnp.float32,
                    normalizer="slots", selector_alpha=alpha)
    graphdef, params, rest = split_drafter(drafter)
    anchors = jnp.asarray([ANCHORS], jnp.int32)
    batch = {"input_ids": jnp.asarray(ids, jnp.int32), "loss_mask": jnp.asarray(mask)}
    (loss, metrics), grads = jax.jit(jax.value_and_grad(lambda p: anchored_loss(
        p, graphdef, rest, target, batch, fwd, anchors, jnp.ones_like(anchors, bool), spec), has_aux=True))(params)
    named = _tensors(nnx.merge(graphdef, grads, rest), "", None)
    return float(loss), {k: np.asarray(v) for k, v in named.items()}, metrics


def _theirs(model, target, drafter, ids, mask, *, weighting, kind, gamma=4.0, alpha=0.7):
    from dflash2_oracle import fixed_anchors, t
    from speculators.losses import eager

    torch = pytest.importorskip("torch")
    cfg = drafter.config
    _, taps = jax.jit(lambda x: target.forward(x, tap_layers=cfg.target_layer_ids))(jnp.asarray(ids))
    # The target's final-normed hidden state (our last tap); speculators' norm on it is then the identity.
    final = jax.jit(lambda x: target.forward(x, tap_layers=(target.config.num_layers - 1,))[1])(jnp.asarray(ids))
    model.verifier_norm = torch.nn.Identity()
    loss = {"kl": ("kl_div", eager.kl_div_loss), "ce": ("ce", eager.ce_loss)}[kind]
    kwargs = dict(loss_config={loss[0]: (loss[1], 1.0)}, gamma=gamma, max_anchors=len(ANCHORS),
                  per_position_loss_weight="dpace" if weighting == "dpace" else "fixed-exp-decay", dpace_alpha=0.5)
    if hasattr(cfg, "selector_rank"):
        kwargs.update(tv_loss_fn=eager.tv_loss, selector_loss_alpha=alpha)
    with fixed_anchors(np.asarray(ANCHORS), np.ones(len(ANCHORS), bool)):
        _, loss, _ = model(t(taps), torch.as_tensor(ids), t(mask), t(final), torch.zeros(1, SEQ, dtype=torch.long),
                           **kwargs)
    model.zero_grad()
    loss.backward()
    grads = {name: p.grad.numpy() for name, p in model.named_parameters() if p.grad is not None}
    return float(loss.detach()), grads


@pytest.mark.parametrize("generation,weighting,kind", [  # slow: ~30 s each on 2 cores
    pytest.param("dflash2", "decay", "kl", marks=pytest.mark.slow),
    pytest.param("dflash2", "dpace", "ce", marks=pytest.mark.slow),
    pytest.param("dflash", "decay", "kl", marks=pytest.mark.slow),
    pytest.param("dflash", "dpace", "ce", marks=pytest.mark.slow),
])
def test_training_loss_and_gradients_match_speculators(generation, weighting, kind, tmp_path):
    """Our loss with ``normalizer: slots`` (speculators divides by the supervised slots) on the same
    anchors. D-PACE with hard labels: its confidences are the label's probability here, while
    speculators takes ``exp(-loss)`` of whatever loss it trains (for KL not a probability)."""
    from dflash2_oracle import torch_model

    tcfg = tiny_target_config(num_layers=6)
    make = tiny_dflash2_config if generation == "dflash2" else tiny_drafter_config
    target, drafter = random_target(tcfg, seed=0), random_drafter(make(tcfg, block_size=8), seed=1, std=0.1)
    ids, mask = _greedy_batch(target)
    model = torch_model(drafter, target, tmp_path / "d").train()
    loss, grads, metrics = _ours(target, drafter, ids, mask, weighting=weighting, kind=kind)
    want, want_grads = _theirs(model, target, drafter, ids, mask, weighting=weighting, kind=kind)
    assert loss == pytest.approx(want, rel=1e-5)
    if generation == "dflash2":
        assert 0 < float(metrics["selector_loss"]) and float(metrics["candidate_recall"]) < 1  # targets injected
    assert set(grads) == set(want_grads)  # every weight of ours has a gradient there, and only those
    for name, g in grads.items():
        scale = max(float(np.abs(want_grads[name]).max()), 1e-6)
        np.testing.assert_allclose(g, want_grads[name], atol=2e-5 * scale, rtol=1e-3, err_msg=name)


@pytest.mark.slow
def test_short_dflash2_run_lowers_its_loss_and_raises_tau(tmp_path):
    """``drafter.kind: dflash2`` on the pattern target: the loss falls, the selector learns, tau rises
    over the untrained drafter's, and the exported checkpoint is the authors' DFlash2 layout."""
    import json

    from test_training import _config, _rows

    from dflash_jax.io.checkpoint import load_drafter
    from dflash_jax.models.dflash2 import DFlash2Drafter
    from dflash_jax.training.checkpointing import export_checkpoint
    from dflash_jax.training.run import train

    cfg = _config(tmp_path, "d2", **{"drafter.kind": "dflash2", "drafter.selector_rank": 16,
                                     "drafter.selector_top_k": 4, "steps": 60, "eval.at_start": True,
                                     "tensorboard": False})
    train(cfg)
    train_rows, eval_rows = _rows(cfg.output_dir, "train"), _rows(cfg.output_dir, "eval")
    assert train_rows[0]["loss"] > 3.0 * train_rows[-1]["loss"], (train_rows[0]["loss"], train_rows[-1]["loss"])
    assert train_rows[-1]["selector_acc"] > train_rows[0]["selector_acc"]
    assert eval_rows[-1]["tau"] > eval_rows[0]["tau"] + 0.5, (eval_rows[0]["tau"], eval_rows[-1]["tau"])
    out = export_checkpoint(cfg.output_dir, tmp_path / "export", dtype="float32")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    assert isinstance(load_drafter(out), DFlash2Drafter)


def test_dflash2_from_a_trained_dflash_drafter_starts_as_it(tmp_path):
    """Initialised from a DFlash drafter: every DFlash weight copied, identity convolutions, so the
    block's hidden states (and unary logits) are the DFlash drafter's."""
    from test_training import _config

    from dflash_jax.training.run import dflash2_from_dflash

    tcfg = tiny_target_config(num_layers=6)
    base = random_drafter(tiny_drafter_config(tcfg, block_size=8), seed=4)
    cfg = _config(tmp_path, "init", **{"drafter.kind": "dflash2", "drafter.selector_rank": 8,
                                       "drafter.selector_top_k": 4})
    d2 = dflash2_from_dflash(base, cfg)
    assert d2.config.selector_rank == 8 and d2.config.block_size == base.config.block_size
    rng = np.random.default_rng(0)
    taps = jnp.asarray(rng.standard_normal((1, 10, 2 * tcfg.hidden_size)), jnp.float32)
    k, v = base.context_kv(taps, jnp.arange(10)[None])
    emb = jnp.asarray(rng.standard_normal((1, 2, 8, tcfg.hidden_size)), jnp.float32)
    args = (emb, (10 + jnp.arange(8))[None, None].repeat(2, 1), k, v, jnp.asarray([[10, 6]]), jnp.asarray([[8, 8]]))
    np.testing.assert_allclose(np.asarray(d2(*args)), np.asarray(base(*args)), atol=1e-5)


def test_chunked_dflash2_loss_equals_unchunked():
    """``loss.loss_chunk`` scans the head, the unary and the selector sums over chunks of blocks."""
    import dataclasses

    tcfg = tiny_target_config(num_layers=6)
    target, drafter = random_target(tcfg, seed=0), random_drafter(tiny_dflash2_config(tcfg, block_size=8), seed=1)
    ids, mask = _greedy_batch(target)
    logits, taps = jax.jit(lambda x: target.forward(x, tap_layers=drafter.config.target_layer_ids))(jnp.asarray(ids))
    spec = StepSpec(block_size=8, mask_token_id=drafter.config.mask_token_id,
                    target_layer_ids=drafter.config.target_layer_ids, num_anchors=6, kind="kl", weighting="dpace",
                    compute_dtype=jnp.float32)
    graphdef, params, rest = split_drafter(drafter)
    anchors = jnp.asarray([[2, 5, 9, 12, 19, 30]], jnp.int32)
    batch = {"input_ids": jnp.asarray(ids, jnp.int32), "loss_mask": jnp.asarray(mask)}
    args = (params, graphdef, rest, target, batch, _Forward(taps, logits), anchors, jnp.ones_like(anchors, bool))
    whole, m1 = jax.jit(lambda: anchored_loss(*args, spec))()  # jitted: one program, not op by op
    chunked, m2 = jax.jit(lambda: anchored_loss(*args, dataclasses.replace(spec, loss_chunk=2)))()
    np.testing.assert_allclose(float(chunked), float(whole), rtol=1e-5)
    for key in ("selector_loss", "selector_acc", "candidate_recall", "unary_loss"):
        np.testing.assert_allclose(float(m2[key]), float(m1[key]), rtol=1e-5, err_msg=key)
