"""Targets and drafter against the oracles: transformers and the authors' `dflash` package."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
torch = pytest.importorskip("torch")  # the oracles; without torch (e.g. a jax-only venv) the module skips

from dflash_jax import draft_logits, load_drafter, load_target, target_forward
from dflash_jax.ops.cache import KVCache
from dflash_jax.io.checkpoint import CheckpointError, save_drafter
from dflash_jax.models.config import ModelConfigError, default_target_layer_ids
from dflash_jax.tiny import write_tiny_pair

ATOL = 1e-4


def _ids(seed, batch, seq, vocab=95):
    return np.random.RandomState(seed).randint(0, vocab, (batch, seq))


def _assert_matches_transformers(ours, ref, ids, layers) -> np.ndarray:
    """Our logits and taps at ``layers`` equal transformers' ``ref`` on ``ids``; returns the logits."""
    logits, taps = target_forward(ours, ids, layer_ids=layers)
    with torch.no_grad():
        out = ref(torch.tensor(ids), output_hidden_states=True)
    np.testing.assert_allclose(np.asarray(logits), out.logits.numpy(), atol=ATOL, rtol=0)
    want = torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1).numpy()
    np.testing.assert_allclose(np.asarray(taps), want, atol=ATOL, rtol=1e-5)
    return out.logits.numpy()


@pytest.mark.parametrize("pair", ["qwen3_pair", "llama_pair"])
@pytest.mark.slow
def test_target_logits_and_taps_match_transformers(pair, request, reference):
    target_dir, _ = request.getfixturevalue(pair)
    ours = load_target(target_dir)
    ref = reference.target(target_dir)
    layers = tuple(range(ours.config.num_layers))  # includes the last layer (HF: final-normed)
    logits = _assert_matches_transformers(ours, ref, _ids(0, 2, 33), layers)
    assert np.abs(logits).max() > 1.0  # not a near-zero model


@pytest.mark.slow
def test_gqa_ratios_and_untied_llama_match(tmp_path, reference):
    for heads, kv in [(4, 4), (8, 2), (4, 1)]:
        target_dir, _ = write_tiny_pair(tmp_path / f"{heads}_{kv}", model_type="llama",
                                        target_overrides=dict(num_heads=heads, num_kv_heads=kv, head_dim=8,
                                                              attention_bias=heads == 8))
        ids = _ids(heads + kv, 1, 21)
        logits, _ = target_forward(load_target(target_dir), ids)
        with torch.no_grad():
            want = reference.target(target_dir)(torch.tensor(ids)).logits.numpy()
        np.testing.assert_allclose(np.asarray(logits), want, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_cached_prefill_and_block_extension_equal_full_forward(qwen3_pair):
    target = load_target(qwen3_pair[0])
    cfg = target.config
    ids = _ids(1, 2, 30)
    # jitted, as the engine runs it: op by op, each primitive compiles on its own
    full_logits, full_taps = jax.jit(lambda x: target.forward(x, tap_layers=(1, 3)))(jnp.asarray(ids))
    step = jax.jit(lambda ids, start, cache, blk_lens=None: target.step(ids, start, cache, blk_lens=blk_lens,
                                                                        tap_layers=(1, 3)))
    lens = np.array([19, 12])
    prompt = np.where(np.arange(24)[None] < lens[:, None], ids[:, :24], 0)  # padded prompts
    cache = KVCache.zeros(cfg.num_layers, 2, 64, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    hidden, taps, cache = step(jnp.asarray(prompt), jnp.zeros(2, jnp.int32), cache, jnp.asarray(lens))
    for b in range(2):
        n = lens[b]
        np.testing.assert_allclose(np.asarray(target.head(hidden[b, :n])), np.asarray(full_logits[b, :n]),
                                   atol=ATOL)
        np.testing.assert_allclose(np.asarray(taps[b, :n]), np.asarray(full_taps[b, :n]), atol=ATOL)
    # Every row extends by a block of 6 at its own position.
    block = np.stack([ids[b, lens[b]:lens[b] + 6] for b in range(2)])
    hidden, taps, cache = step(jnp.asarray(block), jnp.asarray(lens, jnp.int32), cache)
    for b in range(2):
        n = lens[b]
        np.testing.assert_allclose(np.asarray(target.head(hidden[b])), np.asarray(full_logits[b, n:n + 6]),
                                   atol=ATOL)
        np.testing.assert_allclose(np.asarray(taps[b]), np.asarray(full_taps[b, n:n + 6]), atol=ATOL)


def _reference_draft_logits(ref_target, ref_drafter, reference, ctx, anchor, block):
    with torch.no_grad():
        out = ref_target(torch.tensor([ctx]), output_hidden_states=True)
        feats = reference.model.extract_context_feature(out.hidden_states, ref_drafter.target_layer_ids)
        block_ids = torch.tensor([[anchor] + [ref_drafter.mask_token_id] * (block - 1)])
        noise = ref_target.get_input_embeddings()(block_ids)
        positions = torch.arange(len(ctx) + block)[None]
        hidden = ref_drafter(target_hidden=feats, noise_embedding=noise, position_ids=positions)
        return ref_drafter.compute_logits(hidden[:, 1:], ref_target.lm_head)[0].numpy()


@pytest.mark.parametrize("block", [4, 10, 16])
@pytest.mark.slow
def test_drafter_block_logits_match_dflash(block, tmp_path, reference):
    target_dir, drafter_dir = write_tiny_pair(tmp_path, target_overrides=dict(num_layers=6),
                                              drafter_overrides=dict(block_size=block, num_layers=2))
    target, drafter = load_target(target_dir), load_drafter(drafter_dir)
    ref_target, ref_drafter = reference.target(target_dir), reference.drafter(drafter_dir)
    assert list(drafter.config.target_layer_ids) == list(ref_drafter.target_layer_ids) == [1, 3]
    for n in (1, 7, 30):
        ctx = _ids(n, 1, n)[0].tolist()
        anchor = int(_ids(n + 1, 1, 1)[0, 0])
        ours = np.asarray(draft_logits(drafter, target, ctx, anchor))
        want = _reference_draft_logits(ref_target, ref_drafter, reference, ctx, anchor, block)
        assert ours.shape == (block - 1, target.config.vocab_size)
        np.testing.assert_allclose(ours, want, atol=ATOL, rtol=0)


# Drafters with sliding_attention layers, as the reference reads their config: is_causal missing (None: the
# sliding layer causal, the full one bidirectional), false or true for every layer; a window shorter than the
# block (the non-causal block is windowed both ways) and none (use_sliding_window false: a causal layer over
# the whole context).
SLIDING = [pytest.param(None, 5, id="causal-default"), pytest.param(False, 3, id="bidirectional", marks=pytest.mark.slow),
           pytest.param(True, 5, id="causal", marks=pytest.mark.slow), pytest.param(None, None, id="windowless")]


@pytest.mark.parametrize("is_causal, window", SLIDING)
def test_sliding_drafter_block_logits_match_dflash(is_causal, window, tmp_path, reference):
    block = 8
    target_dir, drafter_dir = write_tiny_pair(
        tmp_path, target_overrides=dict(num_layers=6),
        drafter_overrides=dict(block_size=block, num_layers=2, layer_types=("sliding_attention", "full_attention"),
                               sliding_window=window, causal=is_causal))
    config = json.loads((drafter_dir / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["is_causal"] == is_causal
    target, drafter = load_target(target_dir), load_drafter(drafter_dir)
    ref_target, ref_drafter = reference.target(target_dir), reference.drafter(drafter_dir)
    ref_layer = ref_drafter.layers[0].self_attn
    assert (ref_layer.sliding_window, ref_layer.is_causal) == (window, is_causal is not False)
    assert (drafter.config.layer_window(0), drafter.config.layer_causal(0)) == (window, is_causal is not False)
    for n in (1, 7, 30):
        ctx = _ids(n, 1, n)[0].tolist()
        anchor = int(_ids(n + 1, 1, 1)[0, 0])
        ours = np.asarray(draft_logits(drafter, target, ctx, anchor))
        want = _reference_draft_logits(ref_target, ref_drafter, reference, ctx, anchor, block)
        np.testing.assert_allclose(ours, want, atol=ATOL, rtol=0)


def test_sliding_layers_from_max_window_layers_as_transformers_reads_them(qwen3_pair, tmp_path, reference):
    """No layer_types: with use_sliding_window the layers from max_window_layers on slide, as transformers'
    Qwen3Config derives them; without it, sliding_window is ignored."""
    _, drafter_dir = qwen3_pair
    config = json.loads((drafter_dir / "config.json").read_text())
    config.pop("layer_types", None)
    for use, want in ((True, ("full_attention", "sliding_attention")), (False, ())):
        path = tmp_path / str(use)
        path.mkdir()
        (path / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2, "use_sliding_window": use,
                                                      "sliding_window": 7, "max_window_layers": 1}))
        from dflash_jax.models.config import drafter_config_from_dict

        ours = drafter_config_from_dict(json.loads((path / "config.json").read_text()), str(path))
        assert ours.layer_types == want and ours.sliding_window == (7 if use else None)
        ref = reference.model.DFlashDraftModel.config_class.from_pretrained(path)
        assert list(ref.layer_types) == list(want or ("full_attention", "full_attention"))
        assert ref.sliding_window == (7 if use else None)


def test_default_target_layer_ids_rule(reference):
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    for n, layers in [(36, 5), (28, 3), (40, 1), (12, 2), (64, 8)]:
        assert list(default_target_layer_ids(n, layers)) == list(reference.model.build_target_layer_ids(n, layers))


def test_drafter_roundtrip_with_reference(qwen3_pair, tmp_path, reference):
    _, drafter_dir = qwen3_pair
    ours = load_drafter(drafter_dir)
    # ours -> reference: every tensor equal.
    ref = reference.drafter(drafter_dir)
    from safetensors.torch import load_file

    saved = load_file(str(drafter_dir / "model.safetensors"))
    ref_sd = ref.state_dict()
    assert set(saved) == {k for k in ref_sd if "rotary" not in k}
    for name, tensor in saved.items():
        torch.testing.assert_close(ref_sd[name], tensor, rtol=0, atol=0)
    # reference -> ours -> ours saved again: tensors equal.
    ref.save_pretrained(tmp_path / "from_ref")
    reloaded = load_drafter(tmp_path / "from_ref")
    save_drafter(reloaded, tmp_path / "again")
    again = load_file(str(tmp_path / "again" / "model.safetensors"))
    for name, tensor in saved.items():
        torch.testing.assert_close(again[name], tensor, rtol=0, atol=0)
    assert reloaded.config.target_layer_ids == ours.config.target_layer_ids
    assert reloaded.config.mask_token_id == ours.config.mask_token_id


def test_transformers5_rope_parameters_config(tmp_path, reference):
    """A target saved by transformers 5 (``rope_parameters``) loads and matches."""
    target_dir, _ = write_tiny_pair(tmp_path / "src", model_type="llama")
    ref = reference.target(target_dir)
    ref.save_pretrained(tmp_path / "hf5")
    config = json.loads((tmp_path / "hf5" / "config.json").read_text())
    assert "rope_parameters" in config
    ids = _ids(3, 1, 40)
    logits, _ = target_forward(load_target(tmp_path / "hf5"), ids)
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(logits), want, atol=ATOL, rtol=0)


def test_sharded_index_checkpoint(tmp_path, qwen3_pair, reference):
    ref = reference.target(qwen3_pair[0])
    ref.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    ids = _ids(4, 1, 9)
    a, _ = target_forward(load_target(tmp_path / "sharded"), ids)
    b, _ = target_forward(load_target(qwen3_pair[0]), ids)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_bfloat16_agrees_with_float32(qwen3_pair, reference):
    """Documented tolerance: our bf16 error is at most 1.5x transformers' own bf16 error (+0.02),
    and bf16 top-1 agrees with float32 on >= 90% of positions."""
    ids = _ids(5, 2, 40)
    f32, _ = target_forward(load_target(qwen3_pair[0], dtype="float32"), ids)
    bf16, _ = target_forward(load_target(qwen3_pair[0], dtype="bfloat16"), ids)
    assert bf16.dtype == jnp.bfloat16
    ours = np.abs(np.asarray(bf16, np.float32) - np.asarray(f32))
    ref = reference.target(qwen3_pair[0])
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
        theirs = np.abs(ref.to(torch.bfloat16)(torch.tensor(ids)).logits.float().numpy() - want)
    assert ours.mean() <= 1.5 * theirs.mean() + 0.02, (ours.mean(), theirs.mean())
    assert ours.max() <= 1.5 * theirs.max() + 0.02, (ours.max(), theirs.max())
    agree = (np.asarray(bf16, np.float32).argmax(-1) == np.asarray(f32).argmax(-1)).mean()
    assert agree >= 0.9


def _rewrite_config(directory, **changes):
    path = directory / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def test_clear_errors(tmp_path):
    target_dir, drafter_dir = write_tiny_pair(tmp_path)
    _rewrite_config(target_dir, model_type="mistral")
    with pytest.raises(ModelConfigError, match="model_type 'mistral' is not supported"):
        load_target(target_dir)
    _rewrite_config(target_dir, model_type="qwen3", num_key_value_heads=3)
    with pytest.raises(ModelConfigError, match="not a multiple of num_key_value_heads=3"):
        load_target(target_dir)
    _rewrite_config(target_dir, num_key_value_heads=2, hidden_size=32)
    with pytest.raises(CheckpointError, match=r"embed_tokens.weight' has shape \(96, 64\)"):
        load_target(target_dir)
    _rewrite_config(target_dir, hidden_size=64, num_hidden_layers=5)
    with pytest.raises(CheckpointError, match="'model.layers.4.input_layernorm.weight' is missing"):
        load_target(target_dir)
    _rewrite_config(drafter_dir, dflash_config={"mask_token_id": 500, "target_layer_ids": [1]})
    with pytest.raises(ModelConfigError, match="mask_token_id=500 is outside"):
        load_drafter(drafter_dir)
    _rewrite_config(drafter_dir, dflash_config={"mask_token_id": 5, "target_layer_ids": [9]})
    with pytest.raises(ModelConfigError, match=r"target_layer_ids \[9\] outside"):
        load_drafter(drafter_dir)
    _rewrite_config(drafter_dir, dflash_config={"mask_token_id": 5, "target_layer_ids": [1]},
                    rope_scaling={"rope_type": "longrope", "factor": 2.0})
    with pytest.raises(ModelConfigError, match="rope type 'longrope' is not supported"):
        load_drafter(drafter_dir)


def test_a_drafter_config_without_block_size_drafts_the_reference_default_and_says_so(tmp_path, caplog,
                                                                                     reference):
    """No block_size anywhere: blocks of 16, as ``dflash.model.DFlashDraftModel`` reads it, with a warning
    naming the file and the field; one in ``dflash_config`` or at the top level is read without a word."""
    import logging

    from dflash_jax.embedded import DEFAULT_DRAFTER, DEFAULT_DRAFTER2
    from dflash_jax.models.config import load_drafter_config

    _, drafter_dir = write_tiny_pair(tmp_path, drafter_overrides=dict(block_size=4))
    cfg = json.loads((drafter_dir / "config.json").read_text())
    cfg.pop("block_size")
    cfg["dflash_config"].pop("block_size", None)
    (drafter_dir / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.WARNING, logger="dflash_jax.models"):
        assert load_drafter(drafter_dir).config.block_size == 16
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(f"{drafter_dir / 'config.json'}: field 'block_size' is "
                                                         "missing"), warnings
    assert reference.drafter(drafter_dir).block_size == 16
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflash_jax.models"):
        for changes in ({"block_size": 4}, {"dflash_config": {**cfg["dflash_config"], "block_size": 4}}):
            (drafter_dir / "config.json").write_text(json.dumps({**cfg, **changes}))
            assert load_drafter_config(drafter_dir).block_size == 4
        for directory in (DEFAULT_DRAFTER, DEFAULT_DRAFTER2):  # the shipped drafters state theirs
            if (directory / "config.json").exists():
                assert load_drafter_config(directory).block_size == 16
    assert not caplog.records, [r.getMessage() for r in caplog.records]


@pytest.fixture(scope="module")
def tp8_pair(tmp_path_factory):
    """8 query heads and 2 KV heads: TP=8 splits heads, MLP and vocab and replicates KV heads."""
    return write_tiny_pair(tmp_path_factory.mktemp("tp8"), target_overrides=dict(num_heads=8, head_dim=8))


@pytest.mark.parametrize("mesh_shape", [dict(data=1, tensor=8), dict(data=2, tensor=4)])
@pytest.mark.slow
def test_sharded_forward_equals_unsharded(mesh_shape, tp8_pair):
    from dflash_jax.sharding import MeshConfig, make_mesh, shard_module

    assert len(jax.devices()) == 8
    ids = jnp.asarray(_ids(6, 2, 16))
    target = load_target(tp8_pair[0])
    forward = jax.jit(lambda t, x: t.forward(x, tap_layers=(1, 3)))  # one program, not op by op
    want, want_taps = forward(target, ids)
    mesh = make_mesh(MeshConfig(fsdp=1, **mesh_shape))
    shard_module(target, mesh)
    q_proj = target.layers[0].self_attn.q_proj[...]
    assert q_proj.sharding.spec[1] == "tensor"  # heads split over TP
    k_proj = target.layers[0].self_attn.k_proj[...]
    assert k_proj.sharding.spec[1] is None  # 2 KV heads < TP degree: replicated
    assert target.layers[0].mlp.gate_proj[...].sharding.spec[1] == "tensor"
    assert target.lm_head[...].sharding.spec[1] == "tensor"
    got, got_taps = forward(target, ids)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got_taps), np.asarray(want_taps), atol=1e-4, rtol=1e-5)


def test_embedding_lookup_on_a_vocab_sharded_mesh_is_exact(tp8_pair):
    """Under ``kernel_mesh`` each device looks up the ids of its vocabulary slice and an all-reduce
    sums the rows: bit-identical to the plain lookup, for ids in every slice and rows split over
    ``data``. (The H200's XLA gathered the whole table for the plain lookup on a mesh, this
    machine's XLA:CPU does not; ``bench_engine.py --collectives`` lists what a mesh step moves.)"""
    from dflash_jax import sharding
    from dflash_jax.sharding import MeshConfig, make_mesh, named_sharding, shard_module

    target = load_target(tp8_pair[0], dtype=jnp.bfloat16)
    vocab = target.config.vocab_size
    ids = np.random.RandomState(3).randint(0, vocab, (4, 5))
    ids[0] = [0, vocab - 1, vocab // 2, vocab // 4, 1]  # the first and last row of the table, every slice
    ids = jnp.asarray(ids, jnp.int32)
    want = np.asarray(jnp.take(target.embed_tokens[...], ids, axis=0))
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))
    shard_module(target, mesh)
    table = target.embed_tokens[...]
    with sharding.kernel_mesh(mesh):
        assert sharding.kernel_mesh_axes(("vocab", "embed"), table.shape, 0) == ("tensor",)
        got = jax.jit(target.embed)(jax.device_put(ids, named_sharding(("batch", "length"), ids.shape, mesh)))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got), want)


def test_dense_pads_a_single_row_where_xla_gpu_would_strength_reduce_its_dot(monkeypatch):
    """``ops.linear.dense`` gives a one-row dot a second row when the weight's shard on this device is
    under the strength-reduction limit of XLA:GPU (which makes such dots a multiply and a
    reduction, ~3x slower); the real row's result is unchanged. The shard is what counts: the
    same weight is padded on a TP=2 mesh, where each device holds half of it, and not on one
    device. The second row repeats the first (a broadcast, which XLA fuses into the GEMM), not
    zeros (a concatenate: a pad kernel of its own on the GPU). (The GPU-only rule is switched on
    here, with a limit scaled to a small weight.)"""
    from flax import nnx

    from dflash_jax import sharding
    from dflash_jax.ops import linear
    from dflash_jax.sharding import MeshConfig, make_mesh

    monkeypatch.setattr(linear, "_strength_reduces_single_rows", lambda: True)
    monkeypatch.setattr(linear, "GPU_STRENGTH_REDUCTION_LIMIT", 3000)
    rng = np.random.RandomState(0)
    w = nnx.Param(jnp.asarray(rng.randn(64, 8, 8), jnp.float32), axes=("embed", "heads", "head_dim"))  # 4096
    mesh = make_mesh(MeshConfig(data=1, fsdp=1, tensor=2), jax.devices()[:2])

    def lowered(x, on_mesh: bool) -> tuple[np.ndarray, str]:
        fn = jax.jit(lambda x: linear.dense(x, w))
        if not on_mesh:
            return np.asarray(fn(x)), fn.lower(x).as_text()
        with sharding.kernel_mesh(mesh):
            assert sharding.local_shape(("embed", "heads", "head_dim"), (64, 8, 8)) == (64, 4, 8)
            return np.asarray(fn(x)), fn.lower(x).as_text()

    for rows in (1, 3):
        x = jnp.asarray(rng.randn(rows, 1, 64), jnp.float32)
        want = (np.asarray(x, np.float64) @ np.asarray(w[...], np.float64).reshape(64, 64)).reshape(rows, 1, 8, 8)
        for on_mesh in (False, True):
            got, text = lowered(x, on_mesh)
            assert got.shape == (rows, 1, 8, 8)
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            padded = "tensor<2x64xf32>" in text
            assert padded == (rows == 1 and on_mesh), (rows, on_mesh)
            assert "concatenate" not in text
    assert sharding.local_shape(("embed", "heads", "head_dim"), (64, 8, 8)) == (64, 8, 8)  # outside the mesh


@pytest.mark.parametrize("bias", [False, True])
def test_fused_serving_layout_matches_transformers(bias, tmp_path, reference):
    """The engine's serving layout (``runtime.serving_params``: fused QKV / gate-up, then the norms
    folded) gives the same logits and taps as transformers, with GQA and with attention and MLP
    biases; a served module refuses to be saved as a checkpoint; the loaded module is unchanged."""
    from flax import nnx

    from dflash_jax.io.checkpoint import save_target
    from dflash_jax.models.target import Target
    from dflash_jax.ops.linear import INPUT_LAST
    from dflash_jax.runtime.serving_params import serving_target
    from dflash_jax.tiny import tiny_target_config

    cfg = tiny_target_config("llama", num_heads=8, num_kv_heads=2, head_dim=8, attention_bias=bias, mlp_bias=bias)
    target = Target(cfg, rngs=nnx.Rngs(3))
    for path, var in nnx.to_flat_state(nnx.state(target, nnx.Param)):
        if "bias" in str(path[-1]):  # zero-initialised: make them matter
            var.set_value(0.1 * jax.random.normal(jax.random.key(len(path)), var.get_value().shape))
    save_target(target, tmp_path / "t")
    ref = reference.target(tmp_path / "t")
    loaded = load_target(tmp_path / "t")
    fused = serving_target(loaded, fold_norms=False)
    assert fused.layers[0].self_attn.q_proj is None and fused.layers[0].mlp.gate_up_proj.shape == (64, 128, 2)
    assert loaded.layers[0].self_attn.q_proj is not None and loaded.layers[0].mlp.gate_up_proj is None
    _assert_matches_transformers(fused, ref, _ids(4, 2, 17), (0, cfg.num_layers - 1))
    # the norms folded into the matmuls (the engine's layout): the same model; a layer with biases keeps them
    fused = serving_target(loaded)
    assert all(layer.norms_folded != bias for layer in fused.layers)
    _assert_matches_transformers(fused, ref, _ids(4, 2, 17), (0, cfg.num_layers - 1))
    with pytest.raises(ValueError, match="serving layout"):
        save_target(fused, tmp_path / "again")
    # the weights stored input-last (the engine's layout on a CPU): transposed, axes with them; the same model
    stored = serving_target(loaded, input_last=True)
    attn, mlp = stored.layers[0].self_attn, stored.layers[0].mlp
    assert attn.qkv_proj.shape == (2, 6, 8, 64) and attn.o_proj.shape == (64, 8, 8)
    assert attn.qkv_proj.get_metadata()["axes"] == ("kv_heads", None, "head_dim", "embed")
    assert mlp.gate_up_proj.shape == (128, 2, 64) and stored.lm_head.shape == (cfg.vocab_size, 64)
    assert all(w.get_metadata()[INPUT_LAST] for w in (attn.qkv_proj, attn.o_proj, mlp.down_proj, stored.lm_head))
    assert fused.layers[0].self_attn.qkv_proj.shape == (64, 2, 6, 8)  # each copy its own arrays
    _assert_matches_transformers(stored, ref, _ids(4, 2, 17), (0, cfg.num_layers - 1))


def test_bfloat16_weights_serve_the_same_model(tmp_path, reference):
    """A checkpoint of bfloat16 values served in float32 with bfloat16 weights (``serving_params``, a CPU with
    bfloat16 matrix units): the weights in bfloat16 in their ``[in, out]`` layout (not input-last), the norms
    left unfolded (folded, a weight would no longer hold bfloat16 values), a tied head a bfloat16 copy of the
    table beside the float32 table the lookup reads; the logits and taps equal transformers' within float32
    rounding. Weights of other values stay float32, input-last, the norms folded."""
    from flax import nnx

    from dflash_jax.io.checkpoint import save_target
    from dflash_jax.models.target import Target
    from dflash_jax.ops.linear import INPUT_LAST
    from dflash_jax.runtime.serving_params import serving_target
    from dflash_jax.tiny import tiny_target_config

    cfg = tiny_target_config("qwen3", num_heads=8, num_kv_heads=2, head_dim=8, tie_word_embeddings=True)
    target = Target(cfg, rngs=nnx.Rngs(6))
    for path, var in nnx.to_flat_state(nnx.state(target, nnx.Param)):
        value = var.get_value()
        if "norm" in str(path):  # norm weights of ones would fold into the same values
            value = 1 + 0.2 * jax.random.normal(jax.random.key(len(str(path))), value.shape)
        var.set_value(value.astype(jnp.bfloat16).astype(jnp.float32))
    save_target(target, tmp_path / "t")
    loaded = load_target(tmp_path / "t")
    stored = serving_target(loaded, input_last=True, bfloat16_weights=True)
    attn, mlp = stored.layers[0].self_attn, stored.layers[0].mlp
    weights = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj, stored.lm_head)
    assert all(w.dtype == jnp.bfloat16 and not w.get_metadata().get(INPUT_LAST) for w in weights)
    assert stored.embed_tokens.dtype == jnp.float32 and loaded.lm_head is None
    assert stored.lm_head.shape == (cfg.hidden_size, cfg.vocab_size)
    assert mlp.down_proj.shape == loaded.layers[0].mlp.down_proj.shape
    assert not any(layer.norms_folded for layer in stored.layers)
    _assert_matches_transformers(stored, reference.target(tmp_path / "t"), _ids(4, 2, 17), (0, cfg.num_layers - 1))
    # weights of other values (a float32 model): float32, the norms folded as without bfloat16 weights
    plain = serving_target(Target(cfg, rngs=nnx.Rngs(7)), input_last=True, bfloat16_weights=True)
    down = plain.layers[0].mlp.down_proj
    assert down.dtype == jnp.float32 and down.get_metadata()[INPUT_LAST] and plain.lm_head is None
    assert all(layer.norms_folded for layer in plain.layers)


@pytest.mark.slow
def test_folded_norms_decode_step_equals_unfolded(monkeypatch):
    """The norms folded into the matmuls (``runtime.serving_params``), a random Qwen3 target whose norm weights are
    not ones: a decode token on "one GPU" (the rule switched on here; its row scales applied after the
    QKV and gate-up dots, by the cached-attention kernel in interpret mode and the SwiGLU) and a block
    of 4 (its norms before the matmuls, unit weights) give the unfolded layout's hidden state and caches to float32
    rounding. The module folded from keeps its norm weights; dropping the row scale moves the result
    far off."""
    from flax import nnx

    from dflash_jax.models import layers
    from dflash_jax.models.target import Target
    from dflash_jax.ops import linear
    from dflash_jax.ops.config import OpsConfig
    from dflash_jax.runtime.serving_params import serving_target
    from dflash_jax.tiny import tiny_target_config

    monkeypatch.setattr(linear, "_strength_reduces_single_rows", lambda: True)
    cfg = tiny_target_config(num_layers=2)
    original = Target(cfg, rngs=nnx.Rngs(6))
    for path, var in nnx.to_flat_state(nnx.state(original, nnx.Param)):
        if "layernorm" in str(path):
            var.set_value(1 + 0.3 * jax.random.normal(jax.random.key(len(path)), var.get_value().shape))
    plain = serving_target(original, fold_norms=False)
    folded = serving_target(original)
    assert not np.all(np.asarray(original.layers[0].input_layernorm.weight[...]) == 1)
    layer = folded.layers[0]
    assert layer.norms_folded and np.all(np.asarray(layer.input_layernorm.weight[...]) == 1)
    np.testing.assert_allclose(np.asarray(layer.mlp.gate_up_proj[...]), np.asarray(
        plain.layers[0].mlp.gate_up_proj[...] * plain.layers[0].post_attention_layernorm.weight[...][:, None, None]),
        rtol=1e-6)
    ids = jnp.asarray(np.random.RandomState(3).randint(0, cfg.vocab_size, (1, 16)), jnp.int32)
    zeros = jnp.zeros((1,), jnp.int32)
    cache = KVCache.zeros(cfg.num_layers, 1, 64, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    _, _, cache = plain.step(ids[:, :11], zeros, cache, prefill=True)

    def step(model, block):
        hidden, _, new = jax.jit(lambda c: model.step(ids[:, 11:11 + block], zeros + 11, c,
                                                      ops=OpsConfig(attention="pallas")))(cache)
        return np.asarray(hidden), np.asarray(new.k[1]), np.asarray(new.v[1])

    for block in (1, 4):
        for got, want in zip(step(folded, block), step(plain, block)):
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    monkeypatch.setattr(layers.RMSNorm, "row_scale", lambda self, x: jnp.ones(x.shape[:-1] + (1,), jnp.float32))
    unscaled, _, _ = step(folded, 1)
    assert np.max(np.abs(unscaled - step(plain, 1)[0])) > 100 * 2e-5


@pytest.mark.parametrize("impl", ["xla", "pallas"])
@pytest.mark.parametrize("bias, sliding", [(False, False), (True, False), (False, True)])
@pytest.mark.slow
def test_drafter_serving_layout_draft_equals_training_forward(impl, bias, sliding):
    """``Drafter.draft`` in the engine's serving layout (fused QKV / gate-up, one context-K/V matmul
    for all layers; Pallas kernels in interpret mode for ``impl="pallas"``) over a context cache equals
    ``Drafter.__call__`` in the checkpoint layout: rows of different context lengths, a short block,
    stale cache entries past each row's context that must not be read. ``sliding``: the first layer a
    causal sliding one (window 5, is_causal unset), the second full and bidirectional."""
    from drafter_cases import draft_case
    from flax import nnx

    from dflash_jax.models.drafter import Drafter
    from dflash_jax.ops.config import OpsConfig
    from dflash_jax.runtime.serving_params import serving_drafter
    from dflash_jax.tiny import tiny_drafter_config, tiny_target_config

    tcfg = tiny_target_config(num_layers=6)
    layers = dict(layer_types=("sliding_attention", "full_attention"), sliding_window=5, causal=None) if sliding else {}
    dcfg = tiny_drafter_config(tcfg, num_layers=2, block_size=8, attention_bias=bias, **layers)
    drafter = Drafter(dcfg, rngs=nnx.Rngs(5))
    if bias:  # zero-initialised: make them matter
        for path, var in nnx.to_flat_state(nnx.state(drafter, nnx.Param)):
            if "bias" in str(path[-1]):
                var.set_value(0.1 * jax.random.normal(jax.random.key(len(path)), var.get_value().shape))
    case = draft_case(drafter, tcfg.hidden_size)
    k, v = drafter.context_kv(case.taps, case.positions)

    served = serving_drafter(drafter)
    assert served.context_kv_proj.shape == (tcfg.hidden_size, dcfg.num_kv_heads, dcfg.num_layers, 2, dcfg.head_dim)
    assert served.layers[0].self_attn.k_proj is None and drafter.layers[0].self_attn.k_proj is not None
    got_k, got_v = jax.jit(served.context_kv)(case.taps, case.positions)
    np.testing.assert_allclose(np.asarray(got_k), np.asarray(k), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got_v), np.asarray(v), atol=1e-5, rtol=1e-5)
    got = jax.jit(lambda e, c: served.draft(e, case.starts, c, case.valid, ops=OpsConfig(attention=impl)))(
        case.embeds, case.cache)
    assert got.shape == case.want.shape
    np.testing.assert_allclose(np.asarray(got)[:, 0][case.rows], np.asarray(case.want)[:, 0][case.rows],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_single_row_partials_decode_step_equals_plain_dots(monkeypatch):
    """A decode token through a fused random Qwen3 target with the QKV and output projections'
    split-K written out (``ops.linear.single_row_partials``, as on one GPU; the rule switched on here),
    the QKV partials summed by the cached-attention kernel (interpret mode): the same hidden state
    and cache as the plain dots, to float32 rounding. Each partial matters: leaving one out moves
    the result far past that tolerance."""
    from flax import nnx

    from dflash_jax.models import layers
    from dflash_jax.models.target import Target
    from dflash_jax.ops import linear
    from dflash_jax.ops.cache import KVCache
    from dflash_jax.ops.config import OpsConfig
    from dflash_jax.runtime.serving_params import serving_target
    from dflash_jax.tiny import tiny_target_config

    cfg = tiny_target_config(num_layers=2)
    target = serving_target(Target(cfg, rngs=nnx.Rngs(4)), fold_norms=False)
    ids = jnp.asarray(np.random.RandomState(2).randint(0, cfg.vocab_size, (1, 12)), jnp.int32)
    cache = KVCache.zeros(cfg.num_layers, 1, 64, cfg.num_kv_heads, cfg.head_dim, jnp.float32)
    zeros = jnp.zeros((1,), jnp.int32)
    _, _, cache = target.step(ids[:, :11], zeros, cache, prefill=True)

    def decode(qkv_parts: int, output_parts: int):
        ops = OpsConfig(attention="pallas", qkv_partials=qkv_parts, output_partials=output_parts)
        hidden, _, new = jax.jit(lambda c: target.step(ids[:, 11:], zeros + 11, c, ops=ops))(cache)
        return np.asarray(hidden), np.asarray(new.k[1])

    monkeypatch.setattr(linear, "_strength_reduces_single_rows", lambda: True)
    taken = []
    partials = linear.single_row_partials

    def patch(fn):  # the QKV's partials are taken in the model, the output projection's in ``ops.linear``
        monkeypatch.setattr(layers, "single_row_partials", fn)
        monkeypatch.setattr(linear, "single_row_partials", fn)

    patch(lambda x, w, parts, in_dims=1: taken.append(parts) or partials(x, w, parts, in_dims))
    plain, plain_k = decode(0, 0)
    assert taken == [0, 0] * cfg.num_layers  # asked, declined: one dot each
    taken.clear()
    got, got_k = decode(8, 4)
    assert taken == [8, 4] * cfg.num_layers
    np.testing.assert_allclose(got, plain, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got_k, plain_k, rtol=2e-5, atol=2e-5)  # the written K (normed, RoPE'd)

    patch(lambda x, w, parts, in_dims=1: (None if (p := partials(x, w, parts, in_dims)) is None else p.at[0].set(0.0)))
    dropped, _ = decode(8, 4)
    assert np.max(np.abs(dropped - plain)) > 100 * 2e-5


def test_default_target_layer_ids_follow_the_published_rule_and_refuse_a_target_too_shallow():
    """N = 36, L = 5 gives the published [1, 9, 17, 25, 33]; one draft layer takes the middle; a
    rule that would give a layer outside the target (2 target layers, 5 draft layers) is an error
    naming ``target_layer_ids``, not a negative index that fails later inside the model."""
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(6, 1) == (3,)
    with pytest.raises(ModelConfigError, match="target_layer_ids"):
        default_target_layer_ids(2, 5)
