"""Hybrid linear-attention targets (Qwen3.5) against transformers: logits and taps, both
checkpoint nestings, tied and untied heads, prompts shorter and longer than the prefill chunk; the
cached path (prefill, then blocks and single tokens) against the cache-free forward."""

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
torch = pytest.importorskip("torch")  # the oracles; without torch (e.g. a jax-only venv) the module skips

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hybrid_fixtures import write_hf_hybrid  # noqa: E402

from dflash_jax.io.errors import CheckpointError  # noqa: E402
from dflash_jax.io.checkpoint import load_target  # noqa: E402
from dflash_jax.models.config import ModelConfigError  # noqa: E402
from dflash_jax.models.hybrid_config import hybrid_config_from_dict  # noqa: E402

ATOL = 1e-4
ALL_LAYERS = (0, 1, 2, 3, 4)


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    return write_hf_hybrid(tmp_path_factory.mktemp("hybrid_text"), nesting="text")


def _forward(target, ids, layers):
    return jax.jit(lambda i: target.forward(i, tap_layers=layers))(jnp.asarray(ids))


def _assert_parity(target, ref, ids, layers=ALL_LAYERS):
    logits, taps = _forward(target, ids, layers)
    with torch.no_grad():
        out = ref(torch.tensor(ids), output_hidden_states=True)
    np.testing.assert_allclose(np.asarray(logits), out.logits.numpy(), atol=ATOL, rtol=0)
    want = torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1).numpy()
    np.testing.assert_allclose(np.asarray(taps), want, atol=ATOL, rtol=0)
    assert np.abs(out.logits.numpy()).max() > 1.0  # not a near-zero model


def test_text_checkpoint_matches_transformers_short_prompt(text_model):
    directory, ref = text_model
    target = load_target(directory)
    assert target.config.linear_layers == (0, 2, 4) and target.config.rotary_dim == 6
    _assert_parity(target, ref, np.random.RandomState(0).randint(0, 97, (2, 19)))


@pytest.mark.slow
def test_text_checkpoint_matches_transformers_past_the_chunk(text_model):
    directory, ref = text_model
    _assert_parity(load_target(directory), ref, np.random.RandomState(1).randint(0, 97, (2, 70)))


@pytest.mark.slow
@pytest.mark.parametrize("nesting,tied", [("vl", False), ("vl", True), ("text", True)])
def test_nestings_and_tied_heads_match_transformers(tmp_path, nesting, tied):
    directory, ref = write_hf_hybrid(tmp_path, nesting=nesting, seed=3, tie_word_embeddings=tied)
    target = load_target(directory)
    assert (target.lm_head is None) == tied
    assert target.config.weight_prefix == ("model.language_model." if nesting == "vl" else "model.")
    _assert_parity(target, ref, np.random.RandomState(2).randint(0, 97, (2, 67)), layers=(1, 4))


@pytest.mark.slow
def test_cached_prefill_blocks_and_tokens_equal_the_forward(text_model):
    """Padded prompts of mixed lengths, then a block per row and single tokens through the decode
    state: the logits and taps of each position equal the cache-free forward's."""
    target = load_target(text_model[0])
    ids = np.random.RandomState(4).randint(0, 97, (2, 24))
    full_logits, full_taps = _forward(target, ids, (1, 4))
    lens = np.array([13, 7])
    prompt = np.where(np.arange(16)[None] < lens[:, None], ids[:, :16], 0)
    step = jax.jit(lambda ids, starts, cache, n, prefill: target.step(ids, starts, cache, blk_lens=n,
                                                                      tap_layers=(1, 4), prefill=prefill),
                   static_argnames="prefill")

    def check(hidden, taps, starts, n):
        for b in range(2):
            sl = slice(int(starts[b]), int(starts[b]) + n)
            np.testing.assert_allclose(np.asarray(target.head(hidden[b, :n])), np.asarray(full_logits[b, sl]),
                                       atol=ATOL)
            np.testing.assert_allclose(np.asarray(taps[b, :n]), np.asarray(full_taps[b, sl]), atol=ATOL)

    cache = target.new_cache(2, 32)
    hidden, taps, cache = step(jnp.asarray(prompt), jnp.zeros(2, jnp.int32), cache, jnp.asarray(lens), prefill=True)
    for b in range(2):  # each row's own length
        np.testing.assert_allclose(np.asarray(target.head(hidden[b, :lens[b]])),
                                   np.asarray(full_logits[b, :lens[b]]), atol=ATOL)
    starts = lens.copy()
    block = np.stack([ids[b, starts[b]:starts[b] + 4] for b in range(2)])
    hidden, taps, cache = step(jnp.asarray(block), jnp.asarray(starts, jnp.int32), cache, jnp.full(2, 4), prefill=False)
    check(hidden, taps, starts, 4)
    starts = starts + 4
    for _ in range(2):
        token = np.stack([ids[b, starts[b]:starts[b] + 1] for b in range(2)])
        hidden, taps, cache = step(jnp.asarray(token), jnp.asarray(starts, jnp.int32), cache, jnp.ones(2, jnp.int32),
                                   prefill=False)
        check(hidden, taps, starts, 1)
        starts = starts + 1


def _text_config(**overrides):
    base = dict(model_type="qwen3_5_text", vocab_size=97, hidden_size=48, intermediate_size=80,
                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=10,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5})
    base.update(overrides)
    return base


def test_config_defaults_and_errors_name_the_field():
    cfg = hybrid_config_from_dict(_text_config(), "c.json")
    assert cfg.layer_types == ("linear_attention",) * 3 + ("full_attention",)  # every 4th layer is full
    assert cfg.rotary_dim == 6 and cfg.conv_dim == 2 * 16 + 60
    nested = hybrid_config_from_dict({"model_type": "qwen3_5", "tie_word_embeddings": True,
                                      "text_config": _text_config(), "vision_config": {}}, "c.json")
    assert nested.weight_prefix == "model.language_model." and nested.tie_word_embeddings
    for overrides, words in [
        (dict(layer_types=["linear_attention"] * 3), "'layer_types' has 3 entries"),
        (dict(layer_types=["linear_attention"] * 3 + ["sliding_attention"]), "sliding_attention"),
        (dict(linear_num_value_heads=5), "not a multiple of linear_num_key_heads"),
        (dict(linear_key_head_dim=0), "'linear_key_head_dim' must be positive"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.1}),
         "rotary dims"),
        (dict(attention_bias=True), "attention_bias"),
    ]:
        with pytest.raises(ModelConfigError, match=words):
            hybrid_config_from_dict(_text_config(**overrides), "c.json")
    with pytest.raises(ModelConfigError, match="c.json: model_type 'qwen3_5' needs a 'text_config'"):
        hybrid_config_from_dict({"model_type": "qwen3_5"}, "c.json")


def test_a_checkpoint_that_does_not_fit_its_config_names_file_and_tensor(text_model, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = text_model[0]
    tensors = load_file(str(directory / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())

    def write(name, tensors, config=config):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(config))
        save_file(tensors, str(d / "model.safetensors"))
        return d

    missing = {k: v for k, v in tensors.items() if k != "model.layers.2.linear_attn.A_log"}
    with pytest.raises(CheckpointError, match="'model.layers.2.linear_attn.A_log' is missing"):
        load_target(write("missing", missing))
    bad = dict(tensors, **{"model.layers.0.linear_attn.conv1d.weight": torch.zeros(96, 1, 3)})
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'model.layers.0.linear_attn.conv1d.weight' "
                                              r"has shape \(96, 1, 3\)"):
        load_target(write("shape", bad))
    nested = dict(config, model_type="qwen3_5", text_config=dict(config, model_type="qwen3_5_text"))
    with pytest.raises(CheckpointError, match="'model.language_model.embed_tokens.weight' is missing"):
        load_target(write("nesting", tensors, nested))


# -- the MoE variant (qwen3_5_moe_text, qwen3_5_moe) ---------------------------------------------


@pytest.fixture(scope="module")
def moe_text_model(tmp_path_factory):
    return write_hf_hybrid(tmp_path_factory.mktemp("hybrid_moe_text"), nesting="text", moe=True, seed=1)


def test_moe_text_checkpoint_matches_transformers(moe_text_model):
    """Routed experts (7, top-3) plus the gated shared expert in every layer, per-expert tensors as
    ``save_pretrained`` writes them."""
    directory, ref = moe_text_model
    target = load_target(directory)
    c = target.config
    assert (c.model_type, c.num_experts, c.num_experts_per_tok, c.norm_topk_prob) == ("qwen3_5_moe_text", 7, 3, True)
    assert (c.moe_intermediate_size, c.intermediate_size) == (20, 28)
    _assert_parity(target, ref, np.random.RandomState(0).randint(0, 97, (2, 19)))


def _fuse_experts(directory: Path, out: Path) -> None:
    """``directory``'s checkpoint with each layer's per-expert tensors fused as transformers holds
    them in memory (and the published Qwen3.5-MoE checkpoints store them): ``experts.gate_up_proj
    [E, 2 * inter, hidden]``, ``experts.down_proj [E, hidden, inter]``."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    fused, groups = {}, {}
    for name, value in tensors.items():
        m = re.match(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$", name)
        if m:
            groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = value
        else:
            fused[name] = value
    for base, parts in groups.items():
        n = 1 + max(e for e, _ in parts)
        fused[f"{base}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]], 0) for e in range(n)]).contiguous()
        fused[f"{base}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(n)]).contiguous()
    out.mkdir()
    shutil.copy(directory / "config.json", out / "config.json")
    save_file(fused, str(out / "model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("tied", [False, True])
def test_moe_vision_language_nesting_and_fused_experts_match_transformers(tmp_path, tied):
    """``qwen3_5_moe`` (weights under ``model.language_model.``, the vision tower ignored), prompts
    past the prefill chunk; the same weights with fused expert tensors load to the same model."""
    directory, ref = write_hf_hybrid(tmp_path / "per_expert", nesting="vl", moe=True, seed=6,
                                     tie_word_embeddings=tied)
    target = load_target(directory)
    assert target.config.weight_prefix == "model.language_model." and (target.lm_head is None) == tied
    ids = np.random.RandomState(2).randint(0, 97, (2, 67))
    _assert_parity(target, ref, ids, layers=(1, 4))
    _fuse_experts(directory, tmp_path / "fused")
    fused = load_target(tmp_path / "fused")
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(nnx_state(target)),
                                 jax.tree_util.tree_leaves_with_path(nnx_state(fused))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def nnx_state(module):
    from flax import nnx

    return nnx.state(module, nnx.Param)


def test_moe_config_fields_and_errors():
    moe = dict(num_experts=7, num_experts_per_tok=3, moe_intermediate_size=20, shared_expert_intermediate_size=28)
    cfg = hybrid_config_from_dict(_text_config(model_type="qwen3_5_moe_text", **moe), "c.json")
    assert (cfg.num_experts, cfg.intermediate_size, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (7, 28, 20, True)
    nested = hybrid_config_from_dict({"model_type": "qwen3_5_moe", "text_config": _text_config(
        model_type="qwen3_5_moe_text", **moe)}, "c.json")
    assert nested.weight_prefix == "model.language_model." and nested.num_experts == 7
    assert hybrid_config_from_dict(_text_config(), "c.json").num_experts == 0  # the dense variant
    for overrides, words in [
        (dict(moe, num_experts_per_tok=9), "num_experts_per_tok must be in"),
        (dict(moe, shared_expert_intermediate_size=0), "'shared_expert_intermediate_size' must be positive"),
        ({k: v for k, v in moe.items() if k != "num_experts"}, "missing field 'num_experts'"),
    ]:
        with pytest.raises(ModelConfigError, match=words):
            hybrid_config_from_dict(_text_config(model_type="qwen3_5_moe_text", **overrides), "c.json")
    with pytest.raises(ModelConfigError, match="is not qwen3_5_moe_text"):
        hybrid_config_from_dict({"model_type": "qwen3_5_moe", "text_config": _text_config(**moe)}, "c.json")


def test_moe_checkpoint_missing_an_expert_names_the_tensor(moe_text_model, tmp_path):
    from safetensors.torch import load_file, save_file

    directory = moe_text_model[0]
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.3.mlp.experts.5.up_proj.weight"]
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text((directory / "config.json").read_text())
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"))
    with pytest.raises(CheckpointError, match="'model.layers.3.mlp.experts.5.up_proj.weight' is missing"):
        load_target(tmp_path / "m")
