"""Training masks, labels and slot weights against direct transcriptions of the published rule.

The rule (DESIGN.md, "Training recipe"): a block anchored at ``a`` sees context positions STRICTLY
before ``a`` plus its own block (bidirectional), never other blocks; slot ``k >= 1`` is labelled with
the token at ``a + k``; slot 0 is not in the loss; labels outside the loss mask are excluded.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.ops.attention import block_attention
from dflash_jax.training import anchors as anc
from dflash_jax.training.losses import decay_weights, dpace_weights, expected_acceptance, finalize, loss_sums


def published_mask(anchors, valid, S, B):
    """Direct transcription: queries = all block slots, keys = [context (S) | all blocks]."""
    N = len(anchors)
    m = np.zeros((N * B, S + N * B), bool)
    for q in range(N * B):
        n = q // B
        if not valid[n]:
            continue
        for j in range(S + N * B):
            if j < S:
                m[q, j] = j < anchors[n]
            else:
                m[q, j] = (j - S) // B == n
    return m


def published_labels(ids, loss_mask, anchors, valid, B):
    N = len(anchors)
    labels = np.zeros((N, B), np.int64)
    weight = np.zeros((N, B), np.float32)
    for n, a in enumerate(anchors):
        for k in range(B):
            if a + k < len(ids):
                labels[n, k] = ids[a + k]
            if valid[n] and k >= 1 and a + k < len(ids) and loss_mask[a + k]:
                weight[n, k] = 1.0
    return labels, weight


# Hand-checked cases: (S, B, anchors, loss_mask)
CASES = [
    (12, 4, [0, 8], [1] * 12),  # an anchor at 0 (no context at all) and one at S - B
    (12, 4, [3, 5, 6], [1] * 12),  # blocks sharing positions 5..9
    (10, 3, [2, 7], [0, 0, 1, 1, 1, 0, 1, 1, 1, 0]),  # labels beyond the loss mask are dropped
]


@pytest.mark.parametrize("S,B,anchors,loss_mask", CASES)
def test_mask_and_labels_match_published_rule(S, B, anchors, loss_mask):
    ids = np.arange(100, 100 + S)
    a = jnp.asarray([anchors], jnp.int32)
    valid = jnp.ones_like(a, bool)
    ctx_lens, blk_lens = anc.attention_lengths(a, valid, B)
    dense = np.asarray(anc.dense_training_mask(ctx_lens, blk_lens, S, B))[0]
    np.testing.assert_array_equal(dense, published_mask(anchors, [True] * len(anchors), S, B))

    labels, weight = anc.block_labels(jnp.asarray([ids]), jnp.asarray([loss_mask]), None, a, valid, B)
    ref_labels, ref_weight = published_labels(ids, loss_mask, anchors, [True] * len(anchors), B)
    np.testing.assert_array_equal(np.asarray(weight)[0], ref_weight)
    np.testing.assert_array_equal(np.asarray(labels)[0] * (ref_weight > 0), ref_labels * (ref_weight > 0))

    block = np.asarray(anc.block_token_ids(jnp.asarray([ids]), a, valid, B, 7))[0]
    np.testing.assert_array_equal(block[:, 0], ids[anchors])
    assert (block[:, 1:] == 7).all()
    np.testing.assert_array_equal(np.asarray(anc.block_positions(a, B))[0], np.asarray(anchors)[:, None] + np.arange(B))


def test_hand_checked_anchor_at_zero_and_at_end():
    """Spelled out by hand for S = 6, B = 3, anchors 0 and 3 (= S - B)."""
    a = jnp.asarray([[0, 3]], jnp.int32)
    ctx, blk = anc.attention_lengths(a, jnp.ones_like(a, bool), 3)
    m = np.asarray(anc.dense_training_mask(ctx, blk, 6, 3))[0].astype(int)
    expected = np.array(
        # ctx 0..5        block 0   block 1
        [[0, 0, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0]] * 3
        + [[1, 1, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1]] * 3
    )
    np.testing.assert_array_equal(m, expected)
    ids = jnp.asarray([[10, 11, 12, 13, 14, 15]])
    labels, w = anc.block_labels(ids, jnp.ones_like(ids), None, a, jnp.ones_like(a, bool), 3)
    np.testing.assert_array_equal(np.asarray(labels)[0], [[10, 11, 12], [13, 14, 15]])
    np.testing.assert_array_equal(np.asarray(w)[0], [[0, 1, 1], [0, 1, 1]])


@jax.jit
def _dense_attention(q, k_ctx, v_ctx, k_blk, v_blk, mask):
    """Plain masked softmax attention over [context | all blocks] (one row, GQA folded)."""
    b, n, B, hq, d = q.shape
    hk = k_ctx.shape[2]
    g = hq // hk
    keys = jnp.concatenate([k_ctx[0], k_blk[0].reshape(n * B, hk, d)], 0)
    vals = jnp.concatenate([v_ctx[0], v_blk[0].reshape(n * B, hk, d)], 0)
    qs = q[0].reshape(n * B, hq, d)
    keys = jnp.repeat(keys, g, axis=1)
    vals = jnp.repeat(vals, g, axis=1)
    s = jnp.einsum("qhd,khd->hqk", qs, keys) / math.sqrt(d)
    s = jnp.where(mask[None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("hqk,khd->qhd", p, vals).reshape(1, n, B, hq, d)


@pytest.mark.parametrize("S,B,anchors,loss_mask", CASES)
def test_block_attention_with_anchor_lengths_is_the_published_mask(S, B, anchors, loss_mask):
    """The primitive the drafter trains with, fed anchor lengths, equals dense attention under the
    transcribed mask (this is where `<` vs `<=` at the anchor would show)."""
    n, hq, hk, d = len(anchors), 4, 2, 8
    rng = np.random.default_rng(0)
    q, k_ctx, v_ctx, k_blk, v_blk = (
        jnp.asarray(rng.normal(size=shape), jnp.float32)
        for shape in [(1, n, B, hq, d), (1, S, hk, d), (1, S, hk, d), (1, n, B, hk, d), (1, n, B, hk, d)]
    )
    a = jnp.asarray([anchors], jnp.int32)
    ctx_lens, blk_lens = anc.attention_lengths(a, jnp.ones_like(a, bool), B)
    got = jax.jit(lambda *a: block_attention(*a, causal=False))(q, k_ctx, v_ctx, ctx_lens, k_blk, v_blk, blk_lens)
    mask = jnp.asarray(published_mask(anchors, [True] * n, S, B))
    want = _dense_attention(q, k_ctx, v_ctx, k_blk, v_blk, mask)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    # The off-by-one variant (context up to and including the anchor) must differ.
    wrong = _dense_attention(q, k_ctx, v_ctx, k_blk, v_blk, jnp.asarray(published_mask(
        [min(x + 1, S) for x in anchors], [True] * n, S, B)))
    assert not np.allclose(np.asarray(got), np.asarray(wrong), atol=1e-3)


def test_anchor_sampling():
    S, B, N = 40, 8, 12
    lm = np.zeros((3, S), np.int32)
    lm[0, :] = 1  # every position supervised
    lm[1, 5:9] = 1  # only 4 valid anchors: the rest are padding
    lm[2, 30:] = 1  # supervised tokens only beyond S - B = 32 partly: valid anchors 30..32
    anchors, valid = anc.sample_anchors(jax.random.key(1), jnp.asarray(lm), B, N)
    anchors, valid = np.asarray(anchors), np.asarray(valid)
    for row in range(3):
        chosen = anchors[row][valid[row]]
        assert len(set(chosen.tolist())) == len(chosen)  # without replacement
        assert (chosen <= S - B).all() and (chosen >= 0).all()
        assert lm[row, chosen].all()
        assert (np.diff(chosen) > 0).all()  # sorted
    assert valid[0].sum() == N
    assert sorted(anchors[1][valid[1]].tolist()) == [5, 6, 7, 8] and valid[1].sum() == 4
    assert sorted(anchors[2][valid[2]].tolist()) == [30, 31, 32]
    # Invalid anchors carry zero loss weight.
    ids = jnp.arange(S)[None].repeat(3, 0)
    _, w = anc.block_labels(ids, jnp.asarray(lm), None, jnp.asarray(anchors), jnp.asarray(valid), B)
    assert float(jnp.sum(jnp.asarray(w)[~valid])) == 0.0
    # Re-sampled with the step's key; uniform over the valid positions.
    other, _ = anc.sample_anchors(jax.random.key(2), jnp.asarray(lm), B, N)
    assert not np.array_equal(np.asarray(other)[0], anchors[0])
    counts = np.zeros(S - B + 1)
    for i in range(200):
        a, v = anc.sample_anchors(jax.random.key(100 + i), jnp.asarray(lm[:1]), B, N)
        counts[np.asarray(a)[0][np.asarray(v)[0]]] += 1
    expected = 200 * N / (S - B + 1)
    assert np.abs(counts - expected).max() < 0.45 * expected


def test_packed_segments_never_label_across_examples():
    ids = jnp.arange(12)[None]
    seg = jnp.asarray([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 0]])
    a = jnp.asarray([[2, 6]], jnp.int32)
    _, w = anc.block_labels(ids, jnp.ones_like(ids), seg, a, jnp.ones_like(a, bool), 4)
    np.testing.assert_array_equal(np.asarray(w)[0], [[0, 1, 1, 0], [0, 1, 1, 1]])


def test_decay_weights_equal_loop():
    for B, gamma in [(16, 7.0), (10, 5.0), (8, 4.0)]:
        w = np.asarray(decay_weights(B, gamma))
        ref = [0.0] + [math.exp(-(k - 1) / gamma) for k in range(1, B)]
        np.testing.assert_allclose(w, ref, rtol=1e-6)


def _dpace_loop(q, mask, alpha):
    B = len(q)
    qt = [(1 - alpha) * q[i] + alpha if mask[i] else 1.0 for i in range(B)]
    w = np.zeros(B)
    for j in range(B):
        if not mask[j]:
            continue
        total = 0.0
        for m in range(j, B):
            if not mask[m]:
                continue
            prod = 1.0
            for i in range(m + 1):
                prod *= qt[i]
            total += prod
        w[j] = total
    return w


def test_dpace_weights_equal_loop():
    rng = np.random.default_rng(0)
    for alpha in (0.5, 0.2, 1.0):
        q = rng.uniform(size=(5, 8))
        mask = (rng.uniform(size=(5, 8)) > 0.2).astype(np.float32)
        mask[:, 0] = 0  # slot 0 never supervised
        got = np.asarray(dpace_weights(jnp.asarray(q), jnp.asarray(mask), alpha))
        for r in range(5):
            np.testing.assert_allclose(got[r], _dpace_loop(q[r], mask[r], alpha), rtol=1e-5)
    # Weights are detached: no gradient flows through them.
    g = jax.grad(lambda q: jnp.sum(dpace_weights(q, jnp.ones((4,)), 0.5)))(jnp.full((4,), 0.3))
    assert float(jnp.abs(g).sum()) == 0.0


def test_loss_value_and_metrics_by_hand():
    """Decay-weighted CE and the acceptance metrics on a 1-block case computed by hand."""
    logits = jnp.log(jnp.asarray([[[0.2] * 5, [0.6, 0.1, 0.1, 0.1, 0.1], [0.1, 0.7, 0.1, 0.05, 0.05],
                                   [0.1, 0.1, 0.1, 0.1, 0.6]]]))
    labels = jnp.asarray([[3, 0, 2, 4]])
    mask = jnp.asarray([[0.0, 1.0, 1.0, 1.0]])
    sums = loss_sums(logits, labels, mask, weighting="decay", gamma=2.0)
    loss, m = finalize(sums)
    w = [math.exp(0), math.exp(-0.5), math.exp(-1.0)]
    ce = [-math.log(0.6), -math.log(0.1), -math.log(0.6)]
    np.testing.assert_allclose(float(loss), sum(a * b for a, b in zip(w, ce)) / sum(w), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(m["slot_acc"]), [0, 1, 0, 1])
    assert float(m["tau_blocks"]) == 2.0  # slot 1 right, slot 2 wrong
    np.testing.assert_allclose(float(expected_acceptance(jnp.asarray([0.0, 0.9, 0.5, 0.5]))),
                               1 + 0.9 + 0.45 + 0.225, rtol=1e-6)


@pytest.mark.slow
def test_training_blocks_equal_inference_draft_per_anchor():
    """All anchor blocks drafted at once in training give the same logits as the inference path
    (``api.draft_logits``: context = the tokens before the anchor, block at the anchor) per anchor."""
    from dflash_jax.models.api import draft_logits
    from dflash_jax.tiny import random_drafter, random_target, tiny_drafter_config, tiny_target_config
    from dflash_jax.training.trainer import StepSpec, anchor_block_hidden

    tcfg = tiny_target_config(num_layers=4)
    dcfg = tiny_drafter_config(tcfg, block_size=4, num_layers=2, target_layer_ids=(1, 2))
    target, drafter = random_target(tcfg, seed=3), random_drafter(dcfg, seed=4)
    S, B = 20, 4
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 90, (1, S)), jnp.int32)
    anchors_list = [0, 1, 7, 8, S - B]  # includes anchor 0, adjacent and overlapping blocks, S - B
    a = jnp.asarray([anchors_list], jnp.int32)
    valid = jnp.ones_like(a, bool)
    spec = StepSpec(block_size=B, mask_token_id=dcfg.mask_token_id, target_layer_ids=dcfg.target_layer_ids,
                    num_anchors=len(anchors_list), compute_dtype=jnp.float32)

    @jax.jit
    def train_logits(ids, a):
        _, taps = target.forward(ids, tap_layers=dcfg.target_layer_ids)
        ctx, blk = anc.attention_lengths(a, valid, B)
        hidden = anchor_block_hidden(drafter, target, anc.block_token_ids(ids, a, valid, B, dcfg.mask_token_id),
                                     anc.block_positions(a, B), ctx, blk, taps, spec)
        return drafter.logits(target, hidden)

    got = np.asarray(train_logits(ids, a))[0]
    seq = np.asarray(ids)[0].tolist()
    for n, p in enumerate(anchors_list):
        if p == 0:
            continue  # the inference path needs at least one context token
        want = np.asarray(draft_logits(drafter, target, seq[:p], seq[p], B))
        np.testing.assert_allclose(got[n, 1:], want, atol=2e-4, rtol=0)


def test_distillation_targets_and_formula():
    """Distillation reads the target's logits at anchor + k - 1 (its prediction of the token at
    anchor + k) and KL / soft CE equal their definitions."""
    from dflash_jax.training.losses import distill_per_slot

    a = jnp.asarray([[0, 5]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(anc.teacher_positions(a, 4))[0], [[0, 0, 1, 2], [4, 5, 6, 7]])
    rng = np.random.default_rng(1)
    t = rng.normal(size=(3, 6))
    d = rng.normal(size=(3, 6))
    pt = np.exp(t) / np.exp(t).sum(-1, keepdims=True)
    logpd = d - np.log(np.exp(d).sum(-1, keepdims=True))
    logpd_j = jax.nn.log_softmax(jnp.asarray(d), -1)
    kl = np.sum(pt * (np.log(pt) - logpd), -1)
    np.testing.assert_allclose(np.asarray(distill_per_slot(logpd_j, jnp.asarray(t), "kl")), kl, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(distill_per_slot(logpd_j, jnp.asarray(t), "soft_ce")),
                               -np.sum(pt * logpd, -1), rtol=1e-5)
