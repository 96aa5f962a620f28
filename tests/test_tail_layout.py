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
from dflash_jax.tail_layout import padded_rows, to_tail_layout, unsupported_reason
from dflash_jax.tiny import tiny_target_config, write_copycat_pair
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
def test_tail_layout_engine_generates_what_the_fused_engine_generates(copycat, speculative):
    """Batch 1 pads a decode token to 8 rows and runs a verify block of 8 as it is; a batch bucket of 4
    pads 4 decode rows to 8, and its verify blocks (32 rows) run unpadded through the reference."""
    rs = np.random.RandomState(1)
    prompts = [rs.randint(0, 95, n).tolist() for n in (5, 17, 9)]
    config = dict(max_batch_size=4, max_length=80, steps_per_sync=4)
    drafter = lambda: load_drafter(copycat[1]) if speculative else None  # noqa: E731
    fused = Engine(load_target(copycat[0]), drafter(), EngineConfig(**config))
    tail = Engine(load_target(copycat[0]), drafter(), EngineConfig(**config, attention_impl="pallas", tail_layout="on"))
    assert tail.tail_layout and not fused.tail_layout
    for batch in (prompts[:1], prompts):
        got, want = tail.generate(batch, 16), fused.generate(batch, 16)
        assert [g.output_ids for g in got] == [w.output_ids for w in want]
        assert [g.acceptance_lengths for g in got] == [w.acceptance_lengths for w in want]
    if speculative:
        assert max(max(g.acceptance_lengths) for g in got) > 1  # drafts were accepted


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
