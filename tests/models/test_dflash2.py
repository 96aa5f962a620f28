"""DFlash2 modules against the speculators 0.9.0 (authors') modules in float32, and the selector's
greedy path against a numpy transcription of the reference's selection."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.io.checkpoint import load_drafter, save_drafter, save_target
from dflash_jax.models.config import DrafterConfig, ModelConfigError
from dflash_jax.models.dflash2 import (
    DFlash2Drafter,
    dflash2_config_from_dict,
    grouped_dynamic_conv,
)
from dflash_jax.tiny import random_drafter, random_target, tiny_dflash2_config, tiny_target_config

TOL = 1e-4


def close(got, want):
    """Equal within 1e-4 of the values' scale (float32 rounding of sums of many terms)."""
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=TOL, atol=TOL * max(1.0, float(np.abs(want).max())))


@pytest.fixture(scope="module")
def pair():
    tcfg = tiny_target_config(num_layers=6)
    dcfg = tiny_dflash2_config(tcfg, block_size=8, conv_kernel_size=3, conv_group_size=8)
    return random_target(tcfg, seed=0), random_drafter(dcfg, seed=1, std=0.1)


@pytest.fixture(scope="module")
def oracle(pair, tmp_path_factory):
    """speculators' DFlash2 model holding ``pair``'s weights."""
    from dflash2_oracle import torch_model

    return torch_model(pair[1], pair[0], tmp_path_factory.mktemp("oracle"))


@pytest.mark.parametrize("taps,group", [(2, 16), (3, 8), (8, 4)])
def test_grouped_conv_matches_speculators(taps, group):
    from dflash2_oracle import t
    from speculators.models.dflash2.model_definitions import grouped_dynamic_conv as reference

    rng = np.random.default_rng(taps)
    blocks, block, hidden = 3, 8, 64
    x = rng.standard_normal((blocks * block, hidden)).astype(np.float32)
    delta = rng.standard_normal((blocks * block, taps, hidden // group)).astype(np.float32)
    base = rng.standard_normal((taps, hidden)).astype(np.float32)
    want = reference(t(x)[None], t(delta)[None], t(base), block_size=block, group_size=group)[0].numpy()
    got = grouped_dynamic_conv(jnp.asarray(x).reshape(blocks, block, hidden),
                               jnp.asarray(delta).reshape(blocks, block, taps, -1), jnp.asarray(base), group)
    close(np.asarray(got).reshape(want.shape), want)
    # A block's first slot sees only itself: nothing crosses a block start.
    got2 = grouped_dynamic_conv(jnp.asarray(x).reshape(blocks, block, hidden).at[0].set(0.0),
                                jnp.asarray(delta).reshape(blocks, block, taps, -1), jnp.asarray(base), group)
    np.testing.assert_array_equal(np.asarray(got2)[1:], np.asarray(got)[1:])


@pytest.mark.slow
def test_decoder_layer_matches_speculators(pair, oracle):
    from dflash2_oracle import t

    torch = pytest.importorskip("torch")
    cfg, model = pair[1].config, oracle
    rng = np.random.default_rng(0)
    n, block, hidden = 11, cfg.block_size, cfg.hidden_size
    ctx = rng.standard_normal((1, n, hidden)).astype(np.float32)
    h = rng.standard_normal((1, block, hidden)).astype(np.float32)
    pos = torch.arange(n + block)[None]
    emb = model.rotary_emb(t(h), pos)
    want = model.layers[0](target_hidden=t(ctx), hidden_states=t(h), attention_mask=None, position_ids=pos,
                           position_embeddings=emb).detach().numpy()
    layer = pair[1].layers[0]

    @jax.jit  # one program, not op by op
    def ours(ctx, h):
        k, v = layer.self_attn.keys_values(ctx, jnp.arange(n)[None])
        return layer(h[:, None], (n + jnp.arange(block))[None, None], k, v, jnp.asarray([[n]]), jnp.asarray([[block]]))

    got = ours(jnp.asarray(ctx), jnp.asarray(h))
    close(np.asarray(got)[0, 0], want[0])


def test_selector_scores_match_speculators(pair, oracle):
    from dflash2_oracle import t

    torch = pytest.importorskip("torch")
    drafter, model = pair[1], oracle
    cfg = drafter.config
    rng = np.random.default_rng(1)
    rows, vocab = 10, cfg.vocab_size
    logits = rng.standard_normal((1, rows, vocab)).astype(np.float32)
    hidden = rng.standard_normal((1, rows, cfg.hidden_size)).astype(np.float32)
    prev = rng.integers(0, vocab, (1, rows))
    cand = np.stack([rng.permutation(vocab)[:cfg.selector_top_k] for _ in range(rows)])[None]
    want = model.candidate_selector.score_candidates(t(logits), t(hidden), torch.as_tensor(prev),
                                                     torch.as_tensor(cand)).detach().numpy()
    got = drafter.candidate_selector.score_candidates(jnp.asarray(logits), jnp.asarray(hidden), jnp.asarray(prev),
                                                      jnp.asarray(cand))
    close(np.asarray(got), want)


def speculators_block_logits(model, taps, ids, anchors, final_hidden):
    """speculators' anchored-block forward with our anchors: (hidden, logits) ``[blocks, B, ...]``."""
    from dflash2_oracle import fixed_anchors, t

    torch = pytest.importorskip("torch")
    seq = ids.shape[1]
    with fixed_anchors(anchors, np.ones(len(anchors), bool)), torch.no_grad():
        hidden, logits, *_ = model._backbone_forward(
            t(taps), torch.as_tensor(ids), torch.ones(1, seq), t(final_hidden), torch.zeros(1, seq, dtype=torch.long),
            max_anchors=len(anchors))
    block = model.block_size
    return hidden.numpy().reshape(len(anchors), block, -1), logits.numpy().reshape(len(anchors), block, -1)


def compare_block_logits(target, drafter, model, ids, anchors):
    """Our drafter's block hidden states and logits for ``anchors`` == speculators' anchored forward."""
    from dflash_jax.training import anchors as anc

    cfg, B = drafter.config, drafter.config.block_size

    # One program, as training runs it: op by op, each primitive compiles on its own (several times
    # the compile time of the whole forward).
    @jax.jit
    def ours(ids, a):
        _, taps = target.forward(ids, tap_layers=cfg.target_layer_ids)
        final = target.forward(ids, tap_layers=(target.config.num_layers - 1,))[1]
        valid = jnp.ones_like(a, bool)
        ctx_lens, blk_lens = anc.attention_lengths(a, valid, B)
        embeds = target.embed(anc.block_token_ids(ids, a, valid, B, cfg.mask_token_id))
        k, v = drafter.context_kv(taps, jnp.arange(ids.shape[1])[None])
        hidden = drafter(embeds, anc.block_positions(a, B), k, v, ctx_lens, blk_lens)
        return taps, final, hidden, drafter.logits(target, hidden)

    taps, final, hidden, logits = ours(jnp.asarray(ids), jnp.asarray(anchors)[None])
    want_hidden, want = speculators_block_logits(model, np.asarray(taps), ids, anchors, np.asarray(final))
    close(np.asarray(hidden)[0], want_hidden)
    close(np.asarray(logits)[0], want)


@pytest.mark.slow
def test_block_logits_match_speculators(pair, oracle):
    (target, drafter), model = pair, oracle
    ids = np.random.default_rng(2).integers(0, drafter.config.vocab_size - 1, (1, 40))
    compare_block_logits(target, drafter, model, ids, np.array([0, 3, 9, 20, 31]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_select_path_equals_numpy_transcription_with_boundary_ties(seed):
    rng = np.random.default_rng(seed)
    batch, slots, vocab, hidden, rank, k = 5, 7, 40, 16, 6, 4
    cfg = tiny_dflash2_config(tiny_target_config(vocab_size=vocab, hidden_size=64), selector_rank=rank,
                              selector_top_k=k)
    drafter = random_drafter(dataclasses.replace(cfg, hidden_size=hidden, intermediate_size=32, num_heads=2,
                                                 num_kv_heads=1, head_dim=8, conv_group_size=4), seed=seed)
    sel = drafter.candidate_selector
    # Coarse logits: many exact ties, some of them across the top-k boundary.
    logits = rng.integers(0, 6, (batch, slots, vocab)).astype(np.float32)
    logits[0, 0, :] = 3.0  # every candidate tied: the k lowest ids
    hidden_states = rng.standard_normal((batch, slots, hidden)).astype(np.float32)
    anchors = rng.integers(0, vocab, batch)
    got = drafter.select(jnp.asarray(logits), jnp.asarray(hidden_states), jnp.asarray(anchors))
    from dflash2_oracle import numpy_select

    want = numpy_select(logits, hidden_states, anchors, np.asarray(sel.predecessor_codebook[...]),
                        np.asarray(sel.successor_codebook[...]), np.asarray(sel.hidden_projection[...]), k)
    np.testing.assert_array_equal(np.asarray(got), want)
    # The path differs from the per-slot argmax somewhere (the selector is not a no-op here).
    assert (np.asarray(got) != np.argmax(logits, -1)).any()


def test_identity_convolutions_make_a_dflash_layer(pair):
    """Identity kernels: the DFlash2 drafter's hidden states are the DFlash drafter's with the same weights."""
    from dflash_jax.models.drafter import Drafter
    from flax import nnx

    target, drafter = pair
    cfg = drafter.config
    d2 = nnx.clone(drafter)
    d2.reset_convolutions()
    base_cfg = DrafterConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(DrafterConfig)})
    d1 = Drafter(base_cfg, rngs=nnx.Rngs(0))
    for l1, l2 in zip(d1.layers, d2.layers):
        for name in ("input_layernorm", "self_attn", "post_attention_layernorm", "mlp"):
            nnx.update(getattr(l1, name), nnx.state(getattr(l2, name)))
    d1.fc[...] = d2.fc[...]
    for name in ("hidden_norm", "norm"):
        nnx.update(getattr(d1, name), nnx.state(getattr(d2, name)))
    rng = np.random.default_rng(3)
    taps = jnp.asarray(rng.standard_normal((1, 12, 2 * cfg.hidden_size)), jnp.float32)
    k, v = d1.context_kv(taps, jnp.arange(12)[None])
    emb = jnp.asarray(rng.standard_normal((1, 1, cfg.block_size, cfg.hidden_size)), jnp.float32)
    args = (emb, (12 + jnp.arange(cfg.block_size))[None, None], k, v, jnp.asarray([[12]]),
            jnp.asarray([[cfg.block_size]]))
    np.testing.assert_allclose(np.asarray(d2(*args)), np.asarray(d1(*args)), atol=1e-5)


def test_checkpoint_roundtrip_and_speculators_format(pair, oracle, tmp_path):
    """The authors' layout out and in with equal tensors; speculators' own save_pretrained in."""
    from flax import nnx

    target, drafter = pair
    save_drafter(drafter, tmp_path / "zlab")
    back = load_drafter(tmp_path / "zlab")
    assert isinstance(back, DFlash2Drafter) and back.config == drafter.config
    for (p1, a), (p2, b) in zip(nnx.to_flat_state(nnx.state(drafter, nnx.Param)),
                                nnx.to_flat_state(nnx.state(back, nnx.Param))):
        assert p1 == p2
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))
    oracle.save_pretrained(str(tmp_path / "spec"))
    # speculators records the verifier's path, not its depth: read from its config.json when local.
    save_target(target, tmp_path / "target")
    data = json.loads((tmp_path / "spec" / "config.json").read_text())
    data["speculators_config"]["verifier"]["name_or_path"] = str(tmp_path / "target")
    (tmp_path / "spec" / "config.json").write_text(json.dumps(data))
    spec = load_drafter(tmp_path / "spec")
    assert isinstance(spec, DFlash2Drafter)
    assert spec.config == drafter.config
    for (p1, a), (p2, b) in zip(nnx.to_flat_state(nnx.state(drafter, nnx.Param)),
                                nnx.to_flat_state(nnx.state(spec, nnx.Param))):
        assert p1 == p2
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()))


def test_config_fields_are_validated(pair, tmp_path):
    _, drafter = pair
    save_drafter(drafter, tmp_path / "d")
    data = json.loads((tmp_path / "d" / "config.json").read_text())
    cases = [
        (("dflash_config", "conv_group_size", 7), "conv_group_size"),
        (("dflash_config", "conv_kernel_size", 9), "conv_kernel_size"),
        (("dflash_config", "selector_top_k", 1000), "selector_top_k"),
        (("dflash_config", "selector_rank", 0), "selector_rank"),
        (("dflash_config", "sample_from_anchor", True), "sample_from_anchor"),
        (("dflash_config", "selector_gain", 2), "selector_gain"),
        ((None, "layer_types", ["sliding_attention"]), "layer_types"),
        ((None, "layer_types", ["sliding_attention", "full_attention"]), "sliding_window"),
        ((None, "layer_types", ["local", "full_attention"]), "local"),
    ]
    for (section, key, value), needle in cases:
        bad = json.loads(json.dumps(data))
        (bad[section] if section else bad)[key] = value
        with pytest.raises(ModelConfigError, match=needle):
            dflash2_config_from_dict(bad, "x/config.json")
    ok = json.loads(json.dumps(data))
    ok.update(layer_types=["sliding_attention", "full_attention"], sliding_window=5)
    cfg = dflash2_config_from_dict(ok)
    assert cfg.layer_window(0) == 5 and cfg.layer_window(1) is None


def test_unknown_tensor_is_refused(pair, tmp_path):
    from safetensors.numpy import load_file, save_file

    from dflash_jax.io.errors import CheckpointError

    _, drafter = pair
    save_drafter(drafter, tmp_path / "d")
    tensors = load_file(str(tmp_path / "d" / "model.safetensors"))
    tensors["candidate_selector.bias"] = np.zeros(3, np.float32)
    save_file(tensors, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="candidate_selector.bias"):
        load_drafter(tmp_path / "d")


@pytest.mark.slow
def test_sliding_window_layers_match_speculators(tmp_path):
    """Sliding layers (window 4: most anchors see a cut context) against speculators' masks."""
    from dflash2_oracle import torch_model

    tcfg = tiny_target_config(num_layers=6)
    cfg = dataclasses.replace(tiny_dflash2_config(tcfg, block_size=8), layer_types=("sliding_attention",
                              "full_attention"), sliding_window=4)
    target, drafter = random_target(tcfg, seed=0), random_drafter(cfg, seed=2)
    model = torch_model(drafter, target, tmp_path / "d")
    assert model.sliding_window_indices == [0] and model.sliding_window == 4
    ids = np.random.default_rng(5).integers(0, cfg.vocab_size - 1, (1, 30))
    compare_block_logits(target, drafter, model, ids, np.array([1, 6, 13, 21]))


@pytest.mark.parametrize("impl", ["xla", pytest.param("pallas", marks=pytest.mark.slow)])
def test_serving_draft_equals_training_forward(impl):
    """``DFlash2Drafter.draft`` in the serving layout over a context cache (each residual add carried to
    the norm after it; the Pallas kernels in interpret mode for ``impl="pallas"``) equals
    ``__call__`` in the checkpoint layout: a sliding and a full layer, rows of different context
    lengths, a short block, stale cache entries past each row's context."""
    import jax
    from drafter_cases import draft_case

    from dflash_jax.ops.config import OpsConfig
    from dflash_jax.runtime.serving_params import serving_drafter

    tcfg = tiny_target_config(num_layers=6)
    cfg = dataclasses.replace(tiny_dflash2_config(tcfg, num_layers=2, block_size=8, conv_kernel_size=3,
                                                  conv_group_size=8),
                              layer_types=("sliding_attention", "full_attention"), sliding_window=6)
    drafter = random_drafter(cfg, seed=4, std=0.1)
    case = draft_case(drafter, tcfg.hidden_size, seed=1)
    served = serving_drafter(drafter)
    got = jax.jit(lambda e, c: served.draft(e, case.starts, c, case.valid, ops=OpsConfig(attention=impl)))(
        case.embeds, case.cache)
    np.testing.assert_allclose(np.asarray(got)[:, 0][case.rows], np.asarray(case.want)[:, 0][case.rows],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("k", [1, 3, 4, 6, 16])
def test_first_argmax_and_pick_equal_argmax_and_take(k):
    """The selection's elementwise argmax and lookup equal ``jnp.argmax`` (first maximum, first NaN)
    and ``take_along_axis``, for a K that is not a power of two too."""
    from dflash_jax.models.dflash2 import first_argmax, pick

    rng = np.random.default_rng(k)
    x = rng.integers(0, 3, (40, k)).astype(np.float32)  # many ties
    x[0] = -np.inf
    if k > 2:
        x[1, [1, 2]] = np.nan
        x[2, k - 1] = np.nan
    np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(x))), np.argmax(x, axis=-1))
    table, index = rng.integers(0, 1000, (40, k)), rng.integers(0, k, 40)
    np.testing.assert_array_equal(np.asarray(pick(jnp.asarray(table), jnp.asarray(index))),
                                  table[np.arange(40), index])
