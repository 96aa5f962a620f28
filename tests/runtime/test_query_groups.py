"""Query heads padded to a power of two per KV head (``serving_params.pad_query_groups``), as the serving
layout does on a GPU for the fused cached-attention kernel: the same model, the same generations."""

import numpy as np
import pytest

from dflash_jax import target_forward
from dflash_jax.io.checkpoint import load_drafter, load_target
from dflash_jax.runtime import serving_params
from dflash_jax.runtime.engine import Engine, EngineConfig
from dflash_jax.tiny import write_tiny_pair

# 6 query heads on 2 KV heads: 3 a group, not a power of two
SHAPE = dict(num_heads=6, num_kv_heads=2, head_dim=16, num_layers=2)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, drafter_dir = write_tiny_pair(tmp_path_factory.mktemp("groups3"), target_overrides=SHAPE,
                                              drafter_overrides=dict(num_heads=6, num_kv_heads=2, head_dim=16))
    return load_target(target_dir), load_drafter(drafter_dir)


def _pad_to_four(monkeypatch):
    monkeypatch.setattr(serving_params, "fused_query_groups", lambda groups, impl: 4 if groups == 3 else groups)


def test_padded_query_heads_are_the_same_model(pair, monkeypatch):
    """Zero queries per KV head and zero output-projection rows for them: logits and taps within float32
    rounding of the unpadded serving layout's; the module padded from keeps its heads."""
    target, _ = pair
    plain = serving_params.serving_target(target)
    _pad_to_four(monkeypatch)
    padded = serving_params.serving_target(target, attention_impl="pallas")
    attn = padded.layers[0].self_attn
    assert attn.num_heads == 8 and attn.qkv_proj.shape[1:3] == (2, 6) and attn.o_proj.shape[0] == 8
    assert target.layers[0].self_attn.num_heads == 6 and plain.layers[0].self_attn.num_heads == 6
    np.testing.assert_array_equal(np.asarray(attn.o_proj[...]).reshape(2, 4, -1)[:, 3], 0)
    ids = np.random.RandomState(0).randint(0, target.config.vocab_size, (2, 21))
    want, want_taps = target_forward(plain, ids, layer_ids=(0, 1))
    got, got_taps = target_forward(padded, ids, layer_ids=(0, 1))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got_taps), np.asarray(want_taps), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_padded_heads_on_the_fused_kernel_generate_as_the_reference(pair, monkeypatch):
    """An engine with the kernels on (interpret mode) over padded heads, whose decode tokens and verify
    blocks the fused cached-attention kernel takes, and the plain engine (XLA attention, 3 heads a group):
    the same tokens and acceptance lengths, speculative and target-only."""
    target, drafter = pair
    prompts = [list(range(3, 3 + n)) for n in (5, 12)]
    config = EngineConfig(max_batch_size=2, max_length=64, steps_per_sync=4)
    want = [Engine(target, drafter, config).generate(prompts, 10), Engine(target, None, config).generate(prompts, 10)]
    _pad_to_four(monkeypatch)
    kernels = EngineConfig(max_batch_size=2, max_length=64, steps_per_sync=4, attention_impl="pallas")
    engines = [Engine(target, drafter, kernels), Engine(target, None, kernels)]
    assert engines[0].target.layers[0].self_attn.num_heads == 8 and engines[0].drafter.layers[0].self_attn.num_heads == 8
    for engine, theirs in zip(engines, want):
        got = engine.generate(prompts, 10)
        assert [g.output_ids for g in got] == [w.output_ids for w in theirs]
        assert [g.acceptance_lengths for g in got] == [w.acceptance_lengths for w in theirs]


def test_padded_heads_with_attention_biases(monkeypatch):
    """A layer with q/k/v biases: the padded queries get zero biases, the model's logits are unchanged."""
    import jax
    from flax import nnx

    from dflash_jax.models.target import Target
    from dflash_jax.tiny import tiny_target_config

    target = Target(tiny_target_config("llama", num_heads=6, num_kv_heads=2, head_dim=16, num_layers=2,
                                       attention_bias=True), rngs=nnx.Rngs(4))
    for path, var in nnx.to_flat_state(nnx.state(target, nnx.Param)):
        if "bias" in str(path[-1]):  # zero-initialised: make them matter
            var.set_value(0.1 * jax.random.normal(jax.random.key(len(path)), var.get_value().shape))
    plain = serving_params.serving_target(target)
    _pad_to_four(monkeypatch)
    padded = serving_params.serving_target(target, attention_impl="pallas")
    bias = np.asarray(padded.layers[0].self_attn.qkv_bias[...])  # [kv_heads, 4 + 2, head_dim]
    assert bias.shape == (2, 6, 16) and not bias[:, 3].any() and bias[:, :3].any()
    np.testing.assert_array_equal(bias[:, 4:], np.asarray(plain.layers[0].self_attn.qkv_bias[...])[:, 3:])
    ids = np.random.RandomState(1).randint(0, target.config.vocab_size, (2, 13))
    np.testing.assert_allclose(np.asarray(target_forward(padded, ids)[0]), np.asarray(target_forward(plain, ids)[0]),
                               rtol=1e-5, atol=1e-5)
