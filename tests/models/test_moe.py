"""Mixture-of-experts targets (Qwen3-MoE, gpt-oss) against transformers; the expert op against its dense reference."""

import json

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
torch = pytest.importorskip("torch")  # the oracles; without torch (e.g. a jax-only venv) the module skips
from safetensors.torch import load_file, save_file

from dflash_jax import load_target, target_forward
from dflash_jax.io.checkpoint import CheckpointError, save_target
from dflash_jax.models.config import ModelConfigError, target_config_from_dict
from dflash_jax.ops.experts import (IMPLEMENTATIONS, ExpertWeights, gemv_pair_limit, mxfp4_dequantize,
                                    resolve_implementation, route, routed_experts, routed_experts_reference,
                                    touched_experts)
from dflash_jax.ops.rope import rope_attention_factor, rope_inv_freq
from dflash_jax.tiny import random_target, tiny_target_config

ATOL = 1e-4

QWEN3_30B_A3B = {
    "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
    "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960, "tie_word_embeddings": False, "use_sliding_window": False,
}
GPT_OSS_20B = {
    "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
    "num_hidden_layers": 24, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
    "num_local_experts": 32, "num_experts_per_tok": 4, "sliding_window": 128, "attention_bias": True,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "rms_norm_eps": 1e-5,
    "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                     "original_max_position_embeddings": 4096, "truncate": False},
    "rope_theta": 150000, "max_position_embeddings": 131072, "tie_word_embeddings": False,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
}


def test_published_moe_configs_parse():
    q = target_config_from_dict(QWEN3_30B_A3B)
    assert (q.num_experts, q.num_experts_per_tok, q.moe_intermediate_size, q.qk_norm) == (128, 8, 768, True)
    assert all(q.is_moe_layer(i) for i in range(48))
    g = target_config_from_dict(GPT_OSS_20B)
    assert (g.num_experts, g.num_experts_per_tok, g.experts_quantization, g.attention_sinks) == (32, 4, "mxfp4", True)
    assert g.layer_window(0) == 128 and g.layer_window(1) is None and not g.qk_norm
    sparse = target_config_from_dict({**QWEN3_30B_A3B, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert [sparse.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]


@pytest.mark.parametrize("change,message", [
    (dict(num_experts_per_tok=129), "num_experts_per_tok must be in"),
    (dict(mlp_only_layers=[48]), "mlp_only_layers"),
    (dict(num_experts=0), "'num_experts' must be positive"),
    (dict(moe_intermediate_size="768"), "'moe_intermediate_size' must be an integer"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step must be positive"),
])
def test_bad_qwen3_moe_configs_are_named(change, message):
    with pytest.raises(ModelConfigError, match=message):
        target_config_from_dict({**QWEN3_30B_A3B, **change}, "x/config.json")


@pytest.mark.parametrize("change,message", [
    (dict(layer_types=["sliding_attention"] * 3), "layer_types has 3 entries"),
    (dict(layer_types=["chunked_attention"] * 24), "layer_types \\['chunked_attention'\\]"),
    (dict(sliding_window=None), "need a positive sliding_window"),
    (dict(quantization_config={"quant_method": "fp8"}), "only mxfp4"),
    (dict(swiglu_limit=10.0), "'swiglu_limit' is 10.0"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 32.0}), "needs 'original_max_position_embeddings'"),
])
def test_bad_gpt_oss_configs_are_named(change, message):
    with pytest.raises(ModelConfigError, match=message):
        target_config_from_dict({**GPT_OSS_20B, **change}, "x/config.json")


@pytest.mark.parametrize("truncate", [True, False])
@pytest.mark.parametrize("head_dim", [8, 64])
def test_yarn_matches_transformers(truncate, head_dim):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
              "original_max_position_embeddings": 4096, "rope_theta": 150000.0, "truncate": truncate}
    cfg = GptOssConfig(head_dim=head_dim, hidden_size=64, num_attention_heads=4, rope_parameters=params)
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](cfg, None)
    np.testing.assert_allclose(rope_inv_freq(head_dim, 150000.0, params), inv_freq.numpy(), rtol=2e-7, atol=0)
    assert rope_attention_factor(params) == pytest.approx(factor, rel=1e-12)


def _random_experts(key, e, hidden, inter, *, gpt_oss: bool, mxfp4: bool) -> ExpertWeights:
    k = jax.random.split(key, 6)
    if mxfp4:
        def packed(kb, ks, rows, cols):
            blocks = jax.random.randint(kb, (e, rows, cols // 32, 16), 0, 256).astype(jnp.uint8)
            return blocks, jax.random.randint(ks, (e, rows, cols // 32), 118, 130).astype(jnp.uint8)
        gate_up, down = packed(k[0], k[1], 2 * inter, hidden), packed(k[2], k[3], hidden, inter)
    else:
        gate_up = 0.3 * jax.random.normal(k[0], (e, hidden, 2 * inter))
        down = 0.3 * jax.random.normal(k[2], (e, inter, hidden))
    biases = (jax.random.normal(k[4], (e, 2 * inter)), jax.random.normal(k[5], (e, hidden))) if gpt_oss else (None, None)
    return ExpertWeights(gate_up, down, *biases, interleaved=gpt_oss)


@pytest.mark.parametrize("tokens", [1, pytest.param(3, marks=pytest.mark.slow), 24])
@pytest.mark.parametrize("kind", ["qwen3_moe", pytest.param("gpt_oss", marks=pytest.mark.slow), "gpt_oss_mxfp4"])
def test_grouped_experts_equal_dense_reference(tokens, kind):
    """Fewer (token, expert) pairs than experts (the touched experts gathered) and more (all experts)."""
    gpt_oss = kind.startswith("gpt_oss")
    e, hidden, inter = 7, 32, 64
    w = _random_experts(jax.random.key(tokens), e, hidden, inter, gpt_oss=gpt_oss, mxfp4=kind.endswith("mxfp4"))
    x = jax.random.normal(jax.random.key(1), (tokens, hidden))
    weights, experts = route(jax.random.normal(jax.random.key(2), (tokens, e)), 3, softmax_first=not gpt_oss,
                             normalize=True)
    act = "gpt_oss" if gpt_oss else "silu"
    want = routed_experts_reference(x, experts, weights, w, activation=act)
    for impl in set(IMPLEMENTATIONS) - {"auto"}:  # "auto" runs one of them
        got = jax.jit(lambda x: routed_experts(x, experts, weights, w, activation=act, implementation=impl))(x)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4 * float(jnp.abs(want).max()),
                                   rtol=0, err_msg=impl)
    assert int(touched_experts(experts, e)) == len(set(np.asarray(experts).ravel().tolist()))


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss_mxfp4"])
@pytest.mark.parametrize("routing", ["shared", "repeated", pytest.param("natural", marks=pytest.mark.slow)])
def test_gemv_experts_equal_grouped_matmuls(kind, routing):
    """The per-pair products against the grouped matmuls, top-k 3 of 7: every token on the same three
    experts ("shared"), a token's experts recurring across tokens ("repeated", more pairs than
    experts), random routing; bf16 as a step runs them, to bf16 rounding."""
    gpt_oss = kind.startswith("gpt_oss")
    e, hidden, inter, tokens = 7, 64, 32, 5
    w = _random_experts(jax.random.key(3), e, hidden, inter, gpt_oss=gpt_oss, mxfp4=kind.endswith("mxfp4"))
    w = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if jnp.issubdtype(a.dtype, jnp.floating) else a, w)
    x = jax.random.normal(jax.random.key(4), (tokens, hidden), jnp.bfloat16)
    weights, experts = route(jax.random.normal(jax.random.key(5), (tokens, e)), 3, softmax_first=not gpt_oss,
                             normalize=True)
    if routing == "shared":
        experts = jnp.broadcast_to(jnp.array([4, 0, 6], jnp.int32), experts.shape)
    elif routing == "repeated":
        experts = jnp.array([[1, 2, 3], [3, 1, 2], [2, 5, 1], [1, 3, 2], [6, 2, 1]], jnp.int32)
    weights = weights.astype(jnp.bfloat16)
    act = "gpt_oss" if gpt_oss else "silu"
    run = jax.jit(lambda x, impl: routed_experts(x, experts, weights, w, activation=act, implementation=impl),
                  static_argnums=1)
    want, got = np.asarray(run(x, "ragged_dot"), np.float32), np.asarray(run(x, "gemv"), np.float32)
    np.testing.assert_allclose(got, want, atol=2e-2 * float(np.abs(want).max()), rtol=0)
    # "auto" runs MXFP4 experts as "gemv" for a decode token and a 5-token block (15 pairs <= 4 x 7
    # experts); float experts always as "ragged_dot" (the faster of the two on the H200).
    mxfp4 = kind.endswith("mxfp4")
    assert resolve_implementation("auto", 3, w) == ("gemv" if mxfp4 else "ragged_dot")
    assert resolve_implementation("auto", experts.size, w) == ("gemv" if mxfp4 else "ragged_dot")


@pytest.mark.parametrize("mxfp4", [False, True])
def test_gemv_experts_read_only_the_routed_experts(mxfp4):
    """A decode token's "gemv" program holds no sort, no ragged or dense matmul over the experts, and
    no value as large as one routed expert's weights times the expert count: only the routed experts'
    weights are gathered (and decoded), inside the products' reductions."""
    e, hidden, inter, top_k = 16, 64, 32, 2
    w = _random_experts(jax.random.key(6), e, hidden, inter, gpt_oss=mxfp4, mxfp4=mxfp4)
    x = jax.random.normal(jax.random.key(7), (1, hidden))
    weights, experts = route(jax.random.normal(jax.random.key(8), (1, e)), top_k, softmax_first=True, normalize=True)
    assert resolve_implementation("auto", experts.size, w) == ("gemv" if mxfp4 else "ragged_dot")
    assert gemv_pair_limit(w) == (4 * e if mxfp4 else 0)
    jaxpr = jax.make_jaxpr(lambda x, w: routed_experts(x, experts, weights, w, activation="silu",
                                                       implementation="gemv"))(x, w)
    leaves = {id(v) for v in jaxpr.jaxpr.invars}
    # Values in the routed experts' gate-up matrices; every expert's 4-bit blocks are 4x as many bytes.
    routed_gate_up = top_k * 2 * inter * hidden

    def eqns(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from eqns(sub)

    names = set()
    for eqn in eqns(jaxpr.jaxpr):
        names.add(eqn.primitive.name)
        for out in eqn.outvars:
            if id(out) not in leaves and hasattr(out.aval, "shape"):
                assert int(np.prod(out.aval.shape)) <= routed_gate_up, (eqn.primitive.name, out.aval)
    assert not names & {"sort", "ragged_dot_general", "dot_general"}, names


@pytest.mark.parametrize("softmax_first,normalize", [(True, True), (True, False), (False, True)])
def test_routing_equals_transformers_formula(softmax_first, normalize):
    """``route`` against transformers' routing written out (Qwen3-MoE: float32 softmax over all experts,
    top-k of the probabilities, optionally renormalised; gpt-oss: top-k logits, softmax over them):
    the same experts in the same order, ties to the lower id, and the same weights to float32 rounding."""
    rs = np.random.RandomState(4)
    logits = rs.randn(9, 16).astype(np.float32)
    logits[3] = np.round(logits[3])  # ties at the k-th logit
    logits[4] = 0.25                 # every expert equal
    weights, experts = jax.jit(lambda l: route(l, 4, softmax_first=softmax_first, normalize=normalize))(logits)
    if softmax_first:
        probs = np.exp(logits - logits.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        want_experts = np.argsort(-probs, axis=-1, kind="stable")[:, :4]
        want = np.take_along_axis(probs, want_experts, axis=-1)
        if normalize:
            want = want / want.sum(-1, keepdims=True)
    else:
        want_experts = np.argsort(-logits, axis=-1, kind="stable")[:, :4]
        top = np.take_along_axis(logits, want_experts, axis=-1)
        want = np.exp(top - top.max(-1, keepdims=True))
        want /= want.sum(-1, keepdims=True)
    np.testing.assert_array_equal(np.asarray(experts), want_experts)
    np.testing.assert_allclose(np.asarray(weights), want, rtol=2e-6, atol=1e-7)
    bf16_weights, bf16_experts = route(jnp.asarray(logits, jnp.bfloat16), 4, softmax_first=softmax_first,
                                       normalize=normalize)
    assert bf16_weights.dtype == jnp.bfloat16 and bf16_experts.dtype == jnp.int32


def test_unknown_expert_implementation_is_named():
    from dflash_jax import EngineConfig
    from dflash_jax.ops.config import OpsConfig

    for make in (lambda: EngineConfig(experts_impl="dense").validate(), lambda: OpsConfig(experts="dense"),
                 lambda: resolve_implementation("dense", 8, _random_experts(jax.random.key(0), 4, 32, 32,
                                                                              gpt_oss=False, mxfp4=False))):
        with pytest.raises(ValueError, match="'dense'"):
            make()


@pytest.mark.parametrize("kind", ["qwen3_moe", "gpt_oss_mxfp4"])
def test_grouped_matmuls_go_through_tokamax_where_it_runs(monkeypatch, kind):
    """With the kernels on, 16-bit activations and a Hopper GPU (patched here), "ragged_dot"'s two grouped
    matmuls are tokamax's ragged dot (a stand-in recording its calls, computing ``jax.lax.ragged_dot``),
    asked for its Mosaic GPU kernel with its XLA version as the fallback; the result is the reference's.
    Float32 activations, the kernels off, an older GPU, a kernel mesh, or no tokamax: ``jax.lax.ragged_dot``."""
    import kernels_pallas._mosaic
    from dflash_jax import sharding
    from dflash_jax.ops import experts as experts_ops

    calls = []

    def tokamax_ragged_dot(lhs, rhs, group_sizes, *, preferred_element_type, implementation, bypass_device_check):
        calls.append((implementation, bypass_device_check))
        return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)

    monkeypatch.setattr(experts_ops, "_tokamax_ragged_dot", lambda: tokamax_ragged_dot)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(kernels_pallas._mosaic, "hopper_or_later", lambda: True)
    assert experts_ops.library_ragged_dot(jnp.bfloat16, kernels=True)
    assert not experts_ops.library_ragged_dot(jnp.float32, kernels=True)
    assert not experts_ops.library_ragged_dot(jnp.bfloat16, kernels=False)
    monkeypatch.setattr(kernels_pallas._mosaic, "hopper_or_later", lambda: False)
    assert not experts_ops.library_ragged_dot(jnp.bfloat16, kernels=True)
    monkeypatch.setattr(kernels_pallas._mosaic, "hopper_or_later", lambda: True)
    with sharding.kernel_mesh(sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=1, tensor=2), jax.devices()[:2])):
        assert not experts_ops.library_ragged_dot(jnp.bfloat16, kernels=True)  # a mesh: XLA's

    gpt_oss = kind.startswith("gpt_oss")
    tokens, e, hidden, inter = 12, 7, 64, 64
    w = _random_experts(jax.random.key(3), e, hidden, inter, gpt_oss=gpt_oss, mxfp4=kind.endswith("mxfp4"))
    w = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 else a, w)  # a bf16 model's
    x = jax.random.normal(jax.random.key(1), (tokens, hidden)).astype(jnp.bfloat16)
    weights, experts = route(jax.random.normal(jax.random.key(2), (tokens, e)), 3, softmax_first=not gpt_oss,
                             normalize=True)
    act = "gpt_oss" if gpt_oss else "silu"
    run = lambda x, kernels: routed_experts(x, experts, weights.astype(x.dtype), w, activation=act,  # noqa: E731
                                            implementation="ragged_dot", kernels=kernels)
    got = jax.jit(lambda x: run(x, True))(x)
    assert calls == [(("mosaic", "xla"), True)] * 2  # gate-up and down
    want = jax.jit(lambda x: run(x, False))(x)
    assert len(calls) == 2  # the kernels off: no tokamax
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    jax.jit(lambda x: run(x, True))(x.astype(jnp.float32))
    assert len(calls) == 2  # float32: no tokamax


def test_a_broken_tokamax_is_reported_and_left_out(monkeypatch, tmp_path, caplog):
    """A tokamax that fails in its own imports (one built for another JAX) leaves the grouped matmuls on
    ``jax.lax.ragged_dot`` and says so once in the log; an absent one says nothing."""
    import sys

    from dflash_jax.ops import experts as experts_ops

    (tmp_path / "tokamax").mkdir()
    (tmp_path / "tokamax" / "__init__.py").write_text("raise AttributeError('pl.dot was removed')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "tokamax", raising=False)
    experts_ops._tokamax_ragged_dot.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="dflash_jax.ops.experts"):
            assert experts_ops._tokamax_ragged_dot() is None
        assert "tokamax is installed but does not import (AttributeError: pl.dot was removed)" in caplog.text
        experts_ops._tokamax_ragged_dot.cache_clear()
        caplog.clear()
        monkeypatch.setitem(sys.modules, "tokamax", None)  # not installed
        assert experts_ops._tokamax_ragged_dot() is None and not caplog.text
    finally:
        experts_ops._tokamax_ragged_dot.cache_clear()


def test_mxfp4_dequantization_equals_transformers_bit_for_bit():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rs = np.random.RandomState(0)
    blocks = rs.randint(0, 256, (3, 10, 4, 16)).astype(np.uint8)  # every code in both nibbles
    scales = rs.randint(100, 150, (3, 10, 4)).astype(np.uint8)
    for ours_dtype, torch_dtype in ((jnp.bfloat16, torch.bfloat16), (jnp.float32, torch.float32)):
        want = convert_moe_packed_tensors(torch.from_numpy(blocks.copy()), torch.from_numpy(scales.copy()),
                                          dtype=torch_dtype).float().numpy()
        got = np.asarray(jnp.swapaxes(mxfp4_dequantize(jnp.asarray(blocks), jnp.asarray(scales), ours_dtype), 1, 2)
                         .astype(jnp.float32))
        assert got.shape == want.shape == (3, 128, 10)
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def _write(tmp_path, model_type, **overrides):
    cfg = tiny_target_config(model_type, **overrides)
    save_target(random_target(cfg, seed=3), tmp_path / model_type)
    return tmp_path / model_type


def _assert_matches_transformers(directory, ids, layers, reference):
    ours = load_target(directory)
    logits, taps = target_forward(ours, ids, layer_ids=layers)
    ref = reference.target(directory).float()  # MXFP4 experts: transformers dequantizes them to bf16 values
    with torch.no_grad():
        out = ref(torch.tensor(ids), output_hidden_states=True)
    np.testing.assert_allclose(np.asarray(logits), out.logits.numpy(), atol=ATOL, rtol=0)
    want = torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1).numpy()
    np.testing.assert_allclose(np.asarray(taps), want, atol=ATOL, rtol=1e-5)
    assert np.abs(out.logits.numpy()).max() > 1.0


@pytest.mark.slow
@pytest.mark.parametrize("model_type,overrides", [
    ("qwen3_moe", dict(num_layers=4)),  # GQA 4/2, 5 experts top-2, layer 1 dense
    ("qwen3_moe", dict(num_layers=4, num_experts=7, num_experts_per_tok=3, norm_topk_prob=False,
                       decoder_sparse_step=2, mlp_only_layers=(), num_heads=6, num_kv_heads=2, head_dim=12)),
    ("gpt_oss", dict(num_layers=4)),  # window 6, sinks, YaRN, biases, 5 experts top-2
    ("gpt_oss", dict(num_layers=3, experts_quantization="mxfp4", num_heads=8, num_kv_heads=2)),
])
def test_moe_target_logits_and_taps_match_transformers(model_type, overrides, tmp_path, reference, monkeypatch):
    from dflash_jax.ops import attention

    monkeypatch.setattr(attention, "SINK_PROMPT_CHUNK", 8)  # the 23-token prompt through sink layers: 3 chunks
    directory = _write(tmp_path, model_type, **overrides)
    layers = tuple(range(overrides["num_layers"]))
    for seq in (5, 23):  # within the sliding window and past it
        _assert_matches_transformers(directory, np.random.RandomState(seq).randint(0, 95, (2, seq)), layers, reference)


@pytest.mark.slow
def test_qwen3_moe_fused_expert_layout_loads_the_same(tmp_path):
    """transformers' fused ``experts.gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]`` and the hub's
    per-expert tensors load to the same model; a missing expert tensor is named."""
    directory = _write(tmp_path, "qwen3_moe", num_layers=3)
    tensors = load_file(str(directory / "model.safetensors"))
    fused, per_expert = {}, {}
    for name, t in tensors.items():
        (per_expert if ".experts." in name else fused)[name] = t
    for layer in (0, 2):  # layer 1 is dense
        base = f"model.layers.{layer}.mlp.experts"
        fused[f"{base}.gate_up_proj"] = torch.stack([torch.cat([per_expert[f"{base}.{e}.gate_proj.weight"],
                                                                per_expert[f"{base}.{e}.up_proj.weight"]])
                                                     for e in range(5)])
        fused[f"{base}.down_proj"] = torch.stack([per_expert[f"{base}.{e}.down_proj.weight"] for e in range(5)])
    other = tmp_path / "fused"
    other.mkdir()
    (other / "config.json").write_text((directory / "config.json").read_text())
    save_file(fused, str(other / "model.safetensors"), metadata={"format": "pt"})
    a, b = load_target(directory), load_target(other)
    ids = np.random.RandomState(0).randint(0, 95, (1, 9))
    np.testing.assert_array_equal(np.asarray(target_forward(a, ids)[0]), np.asarray(target_forward(b, ids)[0]))

    del tensors["model.layers.2.mlp.experts.3.up_proj.weight"]
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"'model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight' is missing"):
        load_target(directory)


@pytest.mark.slow
def test_mxfp4_checkpoint_stays_4bit_and_refuses_float_blocks(tmp_path):
    directory = _write(tmp_path, "gpt_oss", num_layers=2, experts_quantization="mxfp4")
    target = load_target(directory, dtype="bfloat16")
    experts = target.layers[0].mlp.experts
    assert experts.gate_up_proj is None and experts.gate_up_proj_blocks[...].dtype == jnp.uint8
    assert json.loads((directory / "config.json").read_text())["quantization_config"]["quant_method"] == "mxfp4"
    tensors = load_file(str(directory / "model.safetensors"))
    name = "model.layers.1.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name].float()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"tensor '{name}' has dtype F32; expected \\(U8\\)"):
        load_target(directory)


@pytest.mark.slow
def test_drafter_with_yarn_on_gpt_oss_target_matches_dflash(tmp_path, reference):
    """A drafter (YaRN RoPE, as a gpt-oss drafter's config has it) over a gpt-oss target's taps: its
    block logits equal the authors' reference code's."""
    from models.test_models import _reference_draft_logits

    from dflash_jax import draft_logits, load_drafter
    from dflash_jax.models.config import freeze_rope_scaling
    from dflash_jax.tiny import write_tiny_pair

    yarn = freeze_rope_scaling({"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                "original_max_position_embeddings": 16, "truncate": False})
    target_dir, drafter_dir = write_tiny_pair(tmp_path, model_type="gpt_oss", target_overrides=dict(num_layers=6),
                                              drafter_overrides=dict(block_size=8, rope_scaling=yarn,
                                                                     rope_theta=150000.0))
    target, drafter = load_target(target_dir), load_drafter(drafter_dir)
    ref_target, ref_drafter = reference.target(target_dir), reference.drafter(drafter_dir)
    for n in (1, 7, 30):
        ctx = np.random.RandomState(n).randint(0, 95, n).tolist()
        ours = np.asarray(draft_logits(drafter, target, ctx, 5))
        want = _reference_draft_logits(ref_target, ref_drafter, reference, ctx, 5, 8)
        np.testing.assert_allclose(ours, want, atol=ATOL, rtol=0)


@pytest.mark.slow
def test_sharded_moe_checkpoint_loads(tmp_path):
    """A sharded index splitting one layer's experts over two files loads as the single file does."""
    directory = _write(tmp_path, "gpt_oss", num_layers=2, experts_quantization="mxfp4")
    tensors = load_file(str(directory / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    other = tmp_path / "sharded"
    other.mkdir()
    (other / "config.json").write_text((directory / "config.json").read_text())
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(other / file), metadata={"format": "pt"})
    index = {"weight_map": {n: file for file, part in shards.items() for n in part}}
    (other / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = np.random.RandomState(0).randint(0, 95, (1, 9))
    np.testing.assert_array_equal(np.asarray(target_forward(load_target(directory), ids)[0]),
                                  np.asarray(target_forward(load_target(other), ids)[0]))


@pytest.mark.parametrize("window", [None, 4])
def test_chunked_prompt_attention_equals_the_reference(window):
    """A long prompt through sink / window layers runs in query chunks: the same function."""
    from dflash_jax.ops.attention import chunked_prompt_attention
    from kernels_pallas.block_attention.reference import block_attention_reference

    k = jax.random.split(jax.random.key(0), 4)
    b, seq, heads, kv, d = 2, 11, 4, 2, 8
    q = jax.random.normal(k[0], (b, 1, seq, heads, d))
    keys, values = (jax.random.normal(k[i], (b, 1, seq, kv, d)) for i in (1, 2))
    sinks = jax.random.normal(k[3], (heads,))
    lens = jnp.asarray([[11], [6]], jnp.int32)
    empty = jnp.zeros((b, 0, kv, d))
    want = block_attention_reference(q, empty, empty, jnp.zeros((b, 1), jnp.int32), keys, values, lens, causal=True,
                                     sinks=sinks, window=window)
    got = chunked_prompt_attention(q, keys, values, lens, chunk=4, sinks=sinks, window=window)
    for row, n in enumerate((11, 6)):
        np.testing.assert_allclose(np.asarray(got[row, :, :n]), np.asarray(want[row, :, :n]), atol=1e-5, rtol=0)
