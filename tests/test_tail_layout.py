"""The target in the layer-tail serving layout (``dflash_jax/tail_layout.py``): the same model as
transformers', and an engine that generates what the fused layout's engine generates.

On the CPU ``kernels_pallas.layer_tail`` runs its jnp reference (the Mosaic kernel has no interpret
mode; ``bench/bench_engine.py --tail-layout off,on`` checks it on the GPU), and the attention kernel
runs in interpret mode: these tests cover the layout, the padded rows and the layer loop."""

import dataclasses

import numpy as np
import pytest
import torch
from flax import nnx

from dflash_jax import Engine, EngineConfig, load_drafter, load_target, target_forward
from dflash_jax.checkpoint import save_target
from dflash_jax.layers import fuse_projections
from dflash_jax.sharding import MeshConfig
from dflash_jax.target import Target
from dflash_jax import tail_layout
from dflash_jax.tail_layout import padded_rows, to_tail_layout, unsupported_reason
from dflash_jax.tiny import tiny_target_config, write_copycat_pair
from kernels_pallas import layer_tail_gpu, tail_attention_gpu
from kernels_pallas.layer_tail_gpu import config_for


def _tail_target(path):
    target = fuse_projections(load_target(path))
    to_tail_layout(target.layers, target.config)
    return target


@pytest.mark.parametrize("pair", ["qwen3_pair", "llama_pair"])
def test_tail_layout_logits_and_taps_match_transformers(pair, request, reference):
    target_dir, _ = request.getfixturevalue(pair)
    ours = _tail_target(target_dir)
    assert ours.layers[0].tail is not None and ours.layers[0].self_attn.qkv_proj is None
    ids = np.random.RandomState(0).randint(0, 95, (2, 33))
    layers = tuple(range(ours.config.num_layers))
    logits, taps = target_forward(ours, ids, layer_ids=layers)
    with torch.no_grad():
        out = reference.target(target_dir)(torch.tensor(ids), output_hidden_states=True)
    np.testing.assert_allclose(np.asarray(logits), out.logits.numpy(), atol=1e-4, rtol=0)
    want = torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1).numpy()
    np.testing.assert_allclose(np.asarray(taps), want, atol=1e-4, rtol=1e-5)
    assert np.abs(logits).max() > 1.0


def test_padded_rows_fill_the_kernel_rows_only_where_they_fit():
    assert padded_rows(1, 1, "pallas") == 8  # a decode token: the kernel's 8 rows
    assert padded_rows(3, 1, "pallas") == 8
    assert padded_rows(16, 16, "pallas") == 16  # a verify block as it is
    assert padded_rows(4, 4, "pallas") == 8  # two whole blocks of 4, the second padding
    assert padded_rows(6, 3, "pallas") == 6  # 8 rows are not whole blocks of 3
    assert padded_rows(17, 1, "pallas") == 17  # past the kernel's 16 rows
    assert padded_rows(1, 1, "xla") == 1


@pytest.fixture(scope="module")
def copycat(tmp_path_factory):
    return write_copycat_pair(tmp_path_factory.mktemp("copycat_tail"), block_size=8)


@pytest.mark.parametrize("speculative", [True, False])
def test_tail_layout_engine_generates_what_the_fused_engine_generates(copycat, speculative, monkeypatch):
    """Batch 1 pads a decode token to 8 rows and runs a verify block of 8 as it is; a batch bucket of 4
    pads 4 decode rows to 8, and its verify blocks (32 rows) run unpadded through the reference. With
    ``ATTENTION_IN_TAIL`` a batch-1 decode token's layers 1.. take their attention (and their cache
    writes) from the layer tail before them (``next_attention_reference`` on the CPU); no other
    batch changes with it, so it runs batch 1 only."""
    rs = np.random.RandomState(1)
    prompts = [rs.randint(0, 95, n).tolist() for n in (5, 17, 9)]
    batches = (prompts[:1], prompts)
    config = dict(max_batch_size=4, max_length=80, steps_per_sync=4)
    drafter = lambda: load_drafter(copycat[1]) if speculative else None  # noqa: E731
    fused = Engine(load_target(copycat[0]), drafter(), EngineConfig(**config))
    want = [fused.generate(batch, 16) for batch in batches]
    if speculative:
        assert max(max(w.acceptance_lengths) for w in want[1]) > 1  # drafts were accepted
    for attention_in_tail, runs in ((False, 2), (True, 1)):
        monkeypatch.setattr(tail_layout, "ATTENTION_IN_TAIL", attention_in_tail)
        tail = Engine(load_target(copycat[0]), drafter(),
                      EngineConfig(**config, attention_impl="pallas", tail_layout="on"))
        assert tail.tail_layout and not fused.tail_layout
        for batch, expected in list(zip(batches, want))[:runs]:
            got = tail.generate(batch, 16)
            assert [g.output_ids for g in got] == [w.output_ids for w in expected], attention_in_tail
            assert [g.acceptance_lengths for g in got] == [w.acceptance_lengths for w in expected], attention_in_tail


def test_tail_layout_choice_and_its_errors(copycat, tmp_path):
    assert not Engine(load_target(copycat[0]), None, EngineConfig(max_length=32)).tail_layout  # off by default
    with pytest.raises(ValueError, match="tail_layout must be"):
        EngineConfig(tail_layout="yes").validate()
    with pytest.raises(ValueError, match="needs attention_impl"):
        EngineConfig(tail_layout="on", attention_impl="xla").validate()
    with pytest.raises(ValueError, match="needs attention_impl 'pallas'"):  # "auto" is XLA on the CPU
        Engine(load_target(copycat[0]), None, EngineConfig(max_length=32, tail_layout="on"))
    assert "attention_bias" in unsupported_reason(tiny_target_config(attention_bias=True))
    assert "multiple of 32" in unsupported_reason(tiny_target_config(intermediate_size=80))
    tail_on = EngineConfig(max_length=32, attention_impl="pallas", tail_layout="on")
    with pytest.raises(ValueError, match="one device, not a mesh of 2"):
        Engine(load_target(copycat[0]), None, dataclasses.replace(tail_on, mesh=MeshConfig(data=1, fsdp=1, tensor=2)))
    with pytest.raises(ValueError, match="attention_bias"):
        Engine(Target(tiny_target_config(attention_bias=True), rngs=nnx.Rngs(0)), None, tail_on)
    target = _tail_target(copycat[0])
    with pytest.raises(ValueError, match="already in the layer-tail layout"):
        Engine(target, None, EngineConfig(max_length=32))
    assert Engine(target, None, tail_on).tail_layout
    with pytest.raises(ValueError, match="serving layout"):
        save_target(target, tmp_path / "t")


@pytest.mark.parametrize("intermediate", [12288, 14336])  # Qwen3-8B, Llama-3-8B
def test_layer_kernel_takes_8b_layers_at_up_to_16_rows(intermediate):
    """The Mosaic kernel's shape rule (checked without a GPU): both 8B layers, with and without the
    next layer's QKV, take 8 rows with the 8-stage ring and 16 with 6 (8 do not fit in shared memory);
    24 rows are the reference's."""
    for qkv in (6144, None):
        assert config_for(8, 4096, intermediate, qkv).stages == 8
        assert config_for(16, 4096, intermediate, qkv).stages == 6
        assert config_for(24, 4096, intermediate, qkv) is None
    assert config_for(8, 4096, intermediate, 6144, attention=2048) is not None  # heads x head_dim != hidden
    assert config_for(8, 4096, intermediate + 32, 6144) is None  # ready counters need whole 2048-column groups


def test_next_attention_reference_equals_the_models_attention():
    """The layer tail's attention phase (its jnp reference, which the Mosaic kernel is checked
    against on the GPU) is the model's cached attention of one token: q / k norms, RoPE at its
    position, the cache before it and its own key (``Attention.attend_unfused``), and hands out the
    key and value that the model writes into the cache."""
    import jax
    import jax.numpy as jnp

    cfg = tiny_target_config(num_kv_heads=2, num_heads=8, head_dim=16)
    target = Target(cfg, rngs=nnx.Rngs(2))
    attn = fuse_projections(target).layers[1].self_attn
    for w in (attn.q_norm.weight, attn.k_norm.weight):  # not all ones
        w.set_value(1.0 + 0.3 * jax.random.normal(jax.random.key(5), w.get_value().shape))
    groups, capacity, position = cfg.num_heads // cfg.num_kv_heads, 64, 37
    keys = jax.random.split(jax.random.key(0), 3)
    qkv = jax.random.normal(keys[0], (1, 1, cfg.num_kv_heads, groups + 2, cfg.head_dim))
    caches = [jax.random.normal(k, (1, capacity, cfg.num_kv_heads, cfg.head_dim)) for k in keys[1:]]
    starts = jnp.array([position], jnp.int32)
    want, k_want, v_want = attn.attend_unfused(qkv, starts, *caches, jnp.ones((1,), jnp.int32), impl="xla")
    meta, rope_table = tail_layout._attention_tables(target, starts, jnp.float32)
    rows = jnp.broadcast_to(qkv.reshape(1, -1), (8, qkv.size))  # a decode token padded with copies of it
    got, k_new, v_new = tail_attention_gpu.next_attention_reference(
        rows, caches[0][0], caches[1][0], meta, tail_layout._norm_tables(attn, jnp.float32), rope_table,
        groups=groups, scale=cfg.head_dim ** -0.5, eps=cfg.rms_norm_eps)
    np.testing.assert_allclose(np.asarray(got), np.broadcast_to(np.asarray(want).reshape(1, -1), got.shape),
                               atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(k_new[3]), np.asarray(k_want[0, position]).reshape(-1), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(v_new[3]), np.asarray(v_want[0, position]).reshape(-1), atol=0, rtol=0)


def test_layer_kernel_with_the_attention_phase_lowers_for_gpus():
    """The Mosaic kernel with the next layer's attention (no interpret mode) lowers for CUDA at the
    8B shapes it takes, and its shape rule: a decode token's 8 rows, 128-wide heads, whole key tiles."""
    import jax
    import jax.numpy as jnp

    sd, bf = jax.ShapeDtypeStruct, jnp.bfloat16
    config = config_for(8, 4096, 12288, 6144)
    assert layer_tail_gpu.attention_supported(8, 6144, 8, 4, 128, 1152, config)
    assert not layer_tail_gpu.attention_supported(16, 6144, 8, 4, 128, 1152, config)  # a verify block
    assert not layer_tail_gpu.attention_supported(8, 6144, 8, 4, 128, 1100, config)  # not whole tiles
    assert not layer_tail_gpu.attention_supported(8, 3072, 8, 4, 64, 1152, config)  # 64-wide heads
    shapes = [sd((8, 4096), bf), sd((8, 4096), bf), sd((4096, 4096), bf), sd((24576, 4096), bf),
              sd((4096, 12288), bf), sd((6144, 4096), bf), sd((1152, 8, 128), bf), sd((1152, 8, 128), bf),
              sd((tail_attention_gpu.META,), jnp.int32), sd((2, 64, 128), bf), sd((64, 128), bf)]
    fn = jax.jit(lambda *x: layer_tail_gpu.layer_tail(*x, eps=1e-6, groups=4, scale=128 ** -0.5, config=config))
    text = fn.trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text
