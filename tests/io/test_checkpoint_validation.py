"""The loaders refuse what they cannot load faithfully: every damaged tensor or config field either
loads a model whose logits equal the intact one's, or fails with a one-line ``ValueError``
(``CheckpointError`` / ``ModelConfigError``) that names the file and the tensor or field."""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from dflash_jax.io.checkpoint import CheckpointError, load_drafter, load_target, save_drafter
from dflash_jax.models.api import draft_logits, target_forward
from dflash_jax.models.config import ModelConfigError
from dflash_jax.tiny import write_tiny_pair

# No square weight (a transposed square matrix has the right shape and cannot be told apart): q [64, 48],
# k/v [32, 48], o [48, 64], gate/up [96, 48], down [48, 96], embed/lm_head [80, 48], fc [48, 96].
TARGET = dict(vocab_size=80, hidden_size=48, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
              head_dim=16)
DRAFTER = dict(num_layers=1, block_size=4, target_layer_ids=(0, 1))
IDS = [[3, 17, 42, 5, 9, 77]]
CONTEXT, ANCHOR = [3, 17, 42, 5, 9], 11


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, drafter_dir = write_tiny_pair(tmp_path_factory.mktemp("pair"), target_overrides=TARGET,
                                              drafter_overrides=DRAFTER)
    target = load_target(target_dir)
    drafter = load_drafter(drafter_dir)
    return dict(target_dir=target_dir, drafter_dir=drafter_dir, target=target,
                target_logits=_target_logits(target), drafter_logits=_drafter_logits(drafter, target))


def _target_logits(target):
    return np.asarray(target_forward(target, IDS)[0])


def _drafter_logits(drafter, target):
    return np.asarray(draft_logits(drafter, target, CONTEXT, ANCHOR))


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _expect_same_or_named_error(pair, kind: str, directory: Path, names) -> str:
    """Loads ``directory`` as ``kind``: its logits equal the intact model's, or it fails with a
    one-line ValueError naming a file of ``directory`` and one of ``names``. Anything else fails."""
    try:
        if kind == "target":
            got, want = _target_logits(load_target(directory)), pair["target_logits"]
        else:
            got, want = _drafter_logits(load_drafter(directory), pair["target"]), pair["drafter_logits"]
    except (CheckpointError, ModelConfigError, ValueError) as err:
        message = str(err)
        assert "\n" not in message, message
        assert str(directory) in message, message
        assert any(n in message for n in names), (names, message)
        return "refused"
    np.testing.assert_array_equal(got, want, err_msg=f"{directory} loaded a different model")
    return "loaded"


# ------------------------------------------------------------------------------------------ tensors


def _tensor_mutations(name: str, value: np.ndarray):
    """(label, {name: array} edits, names one of which the error must carry)."""
    extra = "extra." + name
    if value.ndim == 2:
        yield "transposed", {name: np.ascontiguousarray(value.T)}, [name]
    else:
        yield "reshaped", {name: value.reshape(1, -1)}, [name]
    yield "truncated", {name: value[:-1]}, [name]
    yield "int32", {name: value.astype(np.int32)}, [name]
    yield "removed", {name: None}, [name]
    yield "renamed", {name: None, name + "_renamed": value}, [name, name + "_renamed"]
    yield "duplicated", {extra: value}, [extra]


def _mutated_dir(src: Path, dst: Path, edits: dict) -> Path:
    _copy(src, dst)
    tensors = load_file(src / "model.safetensors")
    for key, value in edits.items():
        if value is None:
            tensors.pop(key)
        else:
            tensors[key] = value
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def _run_tensor_fuzz(pair, tmp_path, select=lambda name: True, mutations=None):
    outcomes = {}
    for kind in ("target", "drafter"):
        src = pair[f"{kind}_dir"]
        for name, value in sorted(load_file(src / "model.safetensors").items()):
            if not select(name):
                continue
            for label, edits, names in _tensor_mutations(name, value):
                if mutations is not None and label not in mutations:
                    continue
                case = _mutated_dir(src, tmp_path / f"{kind}-{name}-{label}", edits)
                outcomes[(kind, name, label)] = _expect_same_or_named_error(pair, kind, case, names)
    return outcomes


def test_gqa_projections_fuzz(pair, tmp_path):
    """The fast subset: the GQA K/V projections (same element count when transposed) and a norm."""
    picked = ("model.layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
              "model.layers.1.post_attention_layernorm.weight")
    outcomes = _run_tensor_fuzz(pair, tmp_path, select=lambda name: name in picked)
    assert len(outcomes) == 18 and set(outcomes.values()) == {"refused"}, outcomes


@pytest.mark.slow
def test_every_tensor_mutation_is_refused(pair, tmp_path):
    outcomes = _run_tensor_fuzz(pair, tmp_path)
    assert len(outcomes) == 6 * (25 + 14)
    assert set(outcomes.values()) == {"refused"}, [k for k, v in outcomes.items() if v != "refused"]


def test_transposed_projection_names_file_and_tensor(pair, tmp_path):
    for kind, name in (("target", "model.layers.1.self_attn.k_proj.weight"),
                       ("drafter", "layers.0.self_attn.v_proj.weight")):
        src = pair[f"{kind}_dir"]
        value = load_file(src / "model.safetensors")[name]
        case = _mutated_dir(src, tmp_path / kind, {name: np.ascontiguousarray(value.T)})
        load = load_target if kind == "target" else load_drafter
        with pytest.raises(CheckpointError, match=rf"{case}/model.safetensors: tensor '{name}' has shape \(48, 32\)"):
            load(case)


def test_unused_tensors_and_fewer_layers(pair, tmp_path):
    case = _copy(pair["target_dir"], tmp_path / "fewer")
    _edit_config(case, num_hidden_layers=1)
    with pytest.raises(CheckpointError, match=r"uses nowhere: 'model.layers.1.input_layernorm.weight', .* and 7 more "
                                              r"\(11 in all\)"):
        load_target(case)


def test_tied_head_must_be_a_copy_of_the_table(pair, tmp_path):
    case = _copy(pair["target_dir"], tmp_path / "tied")
    _edit_config(case, tie_word_embeddings=True)
    with pytest.raises(CheckpointError, match="'lm_head.weight' differs from 'model.embed_tokens.weight'"):
        load_target(case)
    tensors = load_file(case / "model.safetensors")
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    save_file(tensors, case / "model.safetensors")
    assert load_target(case).config.tie_word_embeddings


# ----------------------------------------------------------------------------------- non-finite weights


def _with_nonfinite(value: np.ndarray, nan: int, inf: int, dtype=None) -> np.ndarray:
    """``value`` (cast to ``dtype``) with its first ``nan`` values NaN and the next ``inf`` values +-inf."""
    out = value.astype(dtype or value.dtype).reshape(-1).copy()
    out[:nan] = np.nan
    out[nan:nan + inf] = [np.inf, -np.inf] * (inf // 2) + [np.inf] * (inf % 2)
    return out.reshape(value.shape)


def test_nonfinite_target_weights_name_the_shard_and_the_tensors(pair, tmp_path):
    """Sharded target: the error names the shard file, the first bad tensor with its count, and the others."""
    case = _copy(pair["target_dir"], tmp_path / "sharded")
    tensors = load_file(case / "model.safetensors")
    (case / "model.safetensors").unlink()
    names = sorted(tensors)
    up, down = "model.layers.1.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight"
    tensors[up] = _with_nonfinite(tensors[up], nan=9, inf=3)
    tensors[down] = _with_nonfinite(tensors[down], nan=0, inf=1)
    shards = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, case / file)
    (case / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: f for f, part in shards.items() for n in part}}))
    file = next(f for f, part in shards.items() if down in part)
    with pytest.raises(CheckpointError, match=rf"^{case}/{file}: tensor '{down}' holds 1 NaN/inf value; so do 1 more "
                                              rf"tensor: '{up}' \(.*check_finite=False loads it anyway\)$"):
        load_target(case)
    target = load_target(case, check_finite=False)  # asked for: loaded as it is
    assert np.isnan(np.asarray(target.layers[1].mlp.up_proj.get_value())).sum() == 9


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_nonfinite_drafter_weights_are_refused_in_every_stored_float_dtype(pair, tmp_path, dtype):
    import ml_dtypes

    name = "layers.0.self_attn.q_proj.weight"
    value = load_file(pair["drafter_dir"] / "model.safetensors")[name]
    stored = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    case = _mutated_dir(pair["drafter_dir"], tmp_path / dtype, {name: _with_nonfinite(value, nan=4, inf=8,
                                                                                        dtype=stored)})
    with pytest.raises(CheckpointError, match=rf"^{case}/model.safetensors: tensor '{name}' holds 12 NaN/inf values "):
        load_drafter(case)
    # The largest finite values of a 16-bit format are finite: counted by their exponent bits, not by a cast.
    big = value.astype(stored)
    big.reshape(-1)[:2] = [ml_dtypes.finfo(stored).max, ml_dtypes.finfo(stored).min]
    assert load_drafter(_mutated_dir(pair["drafter_dir"], tmp_path / f"{dtype}-max", {name: big})) is not None


@pytest.mark.parametrize("on_cpu", [True, False])
def test_weights_beyond_float16_are_refused_when_loaded_as_float16(pair, tmp_path, monkeypatch, on_cpu):
    """A bfloat16 or float32 weight above float16's largest value is inf once cast: loading as float16 names
    the tensor (on the host and on an accelerator alike); float32 and bfloat16 load the same file."""
    import ml_dtypes

    from dflash_jax.io import errors

    monkeypatch.setattr(errors, "_on_cpu", lambda tensor: on_cpu)
    name = "layers.0.mlp.down_proj.weight"
    value = load_file(pair["drafter_dir"] / "model.safetensors")[name].astype(ml_dtypes.bfloat16)
    value.reshape(-1)[[3, 5]] = [7e4, -1e5]
    case = _mutated_dir(pair["drafter_dir"], tmp_path / f"wide-{on_cpu}", {name: value})
    with pytest.raises(CheckpointError, match=rf"^{case}/model.safetensors: tensor '{name}' holds 2 values that are "
                                              r"NaN or inf as float16 \(beyond its range of \+-65504\) \(load it as "):
        load_drafter(case, dtype="float16")
    for dtype in ("bfloat16", "float32"):
        assert load_drafter(case, dtype=dtype) is not None
    loaded = load_drafter(case, dtype="float16", check_finite=False)  # asked for: the cast's infs kept
    assert np.isinf(np.asarray(loaded.layers[0].mlp.down_proj.get_value(), np.float32)).sum() == 2


def test_nonfinite_expert_weights_name_the_expert_tensor(tmp_path):
    """Qwen3-MoE's per-expert tensors go through the same check, by their own names."""
    from dflash_jax.io.checkpoint import save_target
    from dflash_jax.tiny import random_target, tiny_target_config

    directory = tmp_path / "moe"
    save_target(random_target(tiny_target_config("qwen3_moe", num_layers=2), seed=3), directory)
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    tensors = load_file(directory / "model.safetensors")
    tensors[name] = _with_nonfinite(tensors[name], nan=2, inf=0)
    save_file(tensors, directory / "model.safetensors")
    with pytest.raises(CheckpointError, match=rf"^{directory}/model.safetensors: tensor '{name}' holds 2 NaN/inf "):
        load_target(directory)


@pytest.mark.parametrize("on_cpu", [True, False])
def test_nonfinite_counts_on_the_host_equal_the_jitted_ones(monkeypatch, on_cpu):
    """The two ways ``FiniteCheck`` counts (numpy on the CPU, a jitted reduction where the tensor lies on an
    accelerator) agree, and integer tensors (MXFP4 blocks and scales) are not counted."""
    import jax.numpy as jnp
    import ml_dtypes

    from dflash_jax.io import errors

    monkeypatch.setattr(errors, "_on_cpu", lambda tensor: on_cpu)
    rng = np.random.default_rng(0)
    check = errors.FiniteCheck()
    for dtype in (np.float32, ml_dtypes.bfloat16, np.float16):
        value = (rng.standard_normal(1000) * 10).astype(dtype)
        value[rng.choice(1000, 37, replace=False)] = rng.choice([np.nan, np.inf, -np.inf], 37)
        value[0] = ml_dtypes.finfo(dtype).max
        assert int((~np.isfinite(value.astype(np.float32))).sum()) == 37
        check.add("f", np.dtype(dtype).name, jnp.asarray(value), host=value)
    check.add("f", "blocks", jnp.full((4, 16), 255, jnp.uint8))
    with pytest.raises(CheckpointError, match=r"^f: tensor 'float32' holds 37 NaN/inf values; so do 2 more tensors: "
                                              r"'bfloat16', 'float16' "):
        check.check()


def test_a_run_with_nonfinite_params_names_the_step_and_the_parameter(run_dir, tmp_path):
    import orbax.checkpoint as ocp
    from flax import nnx

    from dflash_jax.io.orbax import load_drafter_from_orbax

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copy(run_dir / "drafter_config.json", run / "drafter_config.json")
    params = nnx.state(load_drafter(run_dir), nnx.Param)
    params["fc"].set_value(params["fc"].get_value().at[0, :3].set(np.nan))
    manager = ocp.CheckpointManager(run / "checkpoints", item_handlers={"params": ocp.StandardCheckpointHandler()})
    manager.save(7, args=ocp.args.Composite(params=ocp.args.StandardSave(params)))
    manager.close()
    with pytest.raises(CheckpointError, match=rf"^{run}/checkpoints/7: parameter 'fc' holds 3 NaN/inf values "):
        load_drafter(run)
    assert np.isnan(np.asarray(load_drafter_from_orbax(run, check_finite=False).fc.get_value())).sum() == 3


# ------------------------------------------------------------------------------------------- config


def _edit_config(directory: Path, *path_value_pairs, file: str = "config.json", **changes):
    cfg = json.loads((directory / file).read_text())
    for key, value in changes.items():
        cfg[key] = value
    for path, value in path_value_pairs:
        node = cfg
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    (directory / file).write_text(json.dumps(cfg))


def _wrong_values(value, field):
    """Wrong types, boundary values and null for a config field of ``value``'s JSON type."""
    if isinstance(value, bool):
        return ["true", 1, None]
    if isinstance(value, int):
        bounds = [-1, 80] if field == "mask_token_id" else [0, -1]
        return ["64", 2.5, True, *bounds, None]
    if isinstance(value, float):
        return ["1e-6", True, 0.0, -1.0, math.nan, math.inf, None]
    if isinstance(value, str):
        return [7, "", "gelu", None]
    if isinstance(value, list):
        return ["0, 1", [], [True], ["1"], [99], [-1], None]
    if isinstance(value, dict):
        return ["x", [], None]
    return [0, "x", {}]


def _config_cases(pair):
    """(kind, field path, value) for every field of both config.json files, plus fields the loaders read
    when present (hidden_act, eos ids, scales, RoPE parameters)."""
    for kind in ("target", "drafter"):
        cfg = json.loads((pair[f"{kind}_dir"] / "config.json").read_text())
        fields = [((k,), v) for k, v in cfg.items() if k != "dflash_config"]
        fields += [(("dflash_config", k), v) for k, v in cfg.get("dflash_config", {}).items()]
        fields += [(("dflash_config",), cfg["dflash_config"])] if kind == "drafter" else []
        fields += [(("rope_scaling",), {"rope_type": "linear", "factor": 1.0}),
                   (("rope_parameters",), {"rope_type": "default", "rope_theta": 10000.0})]
        fields += ([(("eos_token_id",), [1, 2])] if kind == "target" else
                   [(("dflash_config", "input_embedding_scale"), 1.0), (("dflash_config", "output_multiplier"), 1.0),
                    (("dflash_config", "final_logit_softcapping"), 0.0)])
        for path, value in fields:
            for bad in _wrong_values(value, path[-1]):
                yield kind, path, bad


def _run_config_case(pair, tmp_path, i, kind, path, bad):
    case = _copy(pair[f"{kind}_dir"], tmp_path / f"{kind}-{i}")
    _edit_config(case, (path, bad))
    return _expect_same_or_named_error(pair, kind, case, [path[-1], "tensor '"])


@pytest.mark.slow
def test_every_config_field_wrong_type_boundary_and_null(pair, tmp_path):
    outcomes = {(kind, path, repr(bad)): _run_config_case(pair, tmp_path, i, kind, path, bad)
                for i, (kind, path, bad) in enumerate(_config_cases(pair))}
    assert len(outcomes) > 150
    loaded = {k for k, v in outcomes.items() if v == "loaded"}
    # Only fields that cannot change the logits, and nulls that mean "unset", load.
    assert {k[1][-1] for k in loaded} <= {"architectures", "torch_dtype", "attention_dropout", "model_type",
                                         "max_position_embeddings", "rope_scaling", "rope_parameters",
                                         "eos_token_id", "final_logit_softcapping", "tie_word_embeddings",
                                         "attention_bias", "mlp_bias", "is_causal", "head_dim"}, loaded


@pytest.mark.parametrize("kind, path, bad, field", [
    ("drafter", ("block_size",), 4.5, "block_size"),
    ("drafter", ("block_size",), "4", "block_size"),
    ("drafter", ("dflash_config", "mask_token_id"), True, "dflash_config.mask_token_id"),
    ("drafter", ("dflash_config", "target_layer_ids"), [True, 1], "dflash_config.target_layer_ids[0]"),
    ("drafter", ("dflash_config", "input_embedding_scale"), None, "input_embedding_scale"),
    ("drafter", ("is_causal",), "false", "is_causal"),
    ("drafter", ("hidden_size",), "48", "hidden_size"),
    ("target", ("eos_token_id",), ["1"], "eos_token_id"),
    ("target", ("eos_token_id",), [1, 10**6], "eos_token_id"),
    ("target", ("hidden_act",), "gelu_pytorch_tanh", "hidden_act"),
    ("target", ("hidden_act",), "relu", "hidden_act"),
    ("target", ("rope_theta",), math.nan, "rope_theta"),
    ("target", ("rope_theta",), 0, "rope_theta"),
    ("target", ("rope_scaling",), {"rope_type": "linear", "factor": 0}, "rope_scaling.factor"),
    ("target", ("rope_scaling",), {"rope_type": "linear", "factor": None}, "rope_scaling.factor"),
    ("target", ("rope_scaling",), {"rope_type": "linear", "factor": -2.0}, "rope_scaling.factor"),
    ("target", ("rope_parameters",), {"rope_type": "linear", "factor": 0.0}, "rope_parameters.factor"),
    ("target", ("rope_scaling",), {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
     "high_freq_factor"),
])
def test_fields_are_checked_not_coerced(pair, tmp_path, kind, path, bad, field):
    case = _copy(pair[f"{kind}_dir"], tmp_path / kind)
    _edit_config(case, (path, bad))
    load = load_target if kind == "target" else load_drafter
    with pytest.raises(ModelConfigError) as err:
        load(case)
    assert str(case / "config.json") in str(err.value) and field in str(err.value), str(err.value)


def test_a_target_config_without_model_type_is_named(pair, tmp_path):
    case = _copy(pair["target_dir"], tmp_path / "target")
    cfg = json.loads((case / "config.json").read_text())
    del cfg["model_type"]
    (case / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match=f"^{case}/config.json: missing field 'model_type'$"):
        load_target(case)


def test_config_fuzz_subset(pair, tmp_path):
    """The fast subset of the config fuzz: one field of each JSON type in each file."""
    picked = {("target", ("num_key_value_heads",)), ("target", ("rms_norm_eps",)), ("target", ("hidden_act",)),
              ("drafter", ("dflash_config", "target_layer_ids")), ("drafter", ("is_causal",))}
    cases = [c for c in _config_cases(pair) if (c[0], c[1]) in picked]
    outcomes = [_run_config_case(pair, tmp_path, i, *c) for i, c in enumerate(cases)]
    assert len(outcomes) == 6 + 7 + 4 + 7 + 3 and outcomes.count("loaded") == 1  # is_causal: null is false


# --------------------------------------------------------------------------------- files and export


def test_damaged_files_are_named(pair, tmp_path):
    case = _copy(pair["target_dir"], tmp_path / "truncated")
    data = (case / "model.safetensors").read_bytes()
    (case / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=f"{case}/model.safetensors: not a readable safetensors file"):
        load_target(case)
    (case / "model.safetensors").write_bytes(b"\x00" * 5)
    with pytest.raises(CheckpointError, match=f"{case}/model.safetensors: not a readable safetensors file"):
        load_target(case)
    (case / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match=f"{case}/config.json: invalid JSON"):
        load_target(case)


@pytest.mark.parametrize("index", ["[1, 2]", "{}", '{"weight_map": [1]}', '{"weight_map": {"a": 3}}',
                                   '{"weight_map": {"a": "../x.safetensors"}}',
                                   '{"weight_map": {"model.norm.weight": "missing.safetensors"}}', "{oops"])
def test_malformed_index_is_named(pair, tmp_path, index):
    case = _copy(pair["target_dir"], tmp_path / "sharded")
    (case / "model.safetensors.index.json").write_text(index)
    with pytest.raises(CheckpointError, match=f"{case}/model.safetensors.index.json: (malformed index|shard)"):
        load_target(case)


def test_sharded_checkpoint_loads_and_a_wrong_shard_entry_is_named(pair, tmp_path):
    case = _copy(pair["target_dir"], tmp_path / "sharded")
    tensors = load_file(case / "model.safetensors")
    (case / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:10], "model-00002-of-00002.safetensors": names[10:]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, case / file)
    weight_map = {n: f for f, part in shards.items() for n in part}
    (case / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    np.testing.assert_array_equal(_target_logits(load_target(case)), pair["target_logits"])
    weight_map[names[0]] = "model-00002-of-00002.safetensors"
    (case / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=f"model-00002-of-00002.safetensors: tensor '{names[0]}' cannot be read"):
        load_target(case)


def test_save_replaces_an_older_sharded_checkpoint(pair, tmp_path):
    out = tmp_path / "out"
    old = load_drafter(pair["drafter_dir"])
    save_drafter(old, out)
    tensors = load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    save_file({n: v * 0 for n, v in tensors.items()}, out / "model-00001-of-00001.safetensors")
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "model-00001-of-00001.safetensors" for n in tensors}}))
    (out / "notes.safetensors").write_text("not named by the index: kept")
    save_drafter(old, out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "notes.safetensors"]
    np.testing.assert_array_equal(_drafter_logits(load_drafter(out), pair["target"]), pair["drafter_logits"])


def test_save_drafter_writes_is_causal(pair, tmp_path):
    import dataclasses

    drafter = load_drafter(pair["drafter_dir"])
    drafter.config = dataclasses.replace(drafter.config, causal=True)
    save_drafter(drafter, tmp_path / "causal")
    assert json.loads((tmp_path / "causal" / "config.json").read_text())["is_causal"] is True
    assert load_drafter(tmp_path / "causal").config.causal
    save_drafter(load_drafter(pair["drafter_dir"]), tmp_path / "bidirectional")
    assert json.loads((tmp_path / "bidirectional" / "config.json").read_text())["is_causal"] is False


def test_directory_that_is_no_drafter(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="neither a z-lab drafter directory \\(no config.json\\) nor a training run"):
        load_drafter(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        load_drafter(tmp_path / "missing")


def test_damaged_run_drafter_config_is_named(tmp_path, capsys):
    from dflash_jax.io.orbax import load_drafter_from_orbax
    from dflash_jax.training import cli as train_cli

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "drafter_config.json").write_text('{"hidden_size": 4')
    with pytest.raises(ModelConfigError, match=f"{run}/drafter_config.json: invalid JSON"):
        load_drafter_from_orbax(run)
    assert train_cli.main(["export", "--checkpoint", str(run), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {run}/drafter_config.json: invalid JSON") and "\n" not in err, err


@pytest.fixture(scope="module")
def run_dir(pair, tmp_path_factory):
    """A training run of ``pair``'s drafter: drafter_config.json and the params of step 5."""
    import orbax.checkpoint as ocp
    from flax import nnx

    run = tmp_path_factory.mktemp("run")
    shutil.copy(pair["drafter_dir"] / "config.json", run / "drafter_config.json")
    params = nnx.state(load_drafter(pair["drafter_dir"]), nnx.Param)
    manager = ocp.CheckpointManager(run / "checkpoints", item_handlers={"params": ocp.StandardCheckpointHandler()})
    manager.save(5, args=ocp.args.Composite(params=ocp.args.StandardSave(params)))
    manager.close()
    return run


@pytest.mark.parametrize("path, value, message", [
    (("intermediate_size",), 64, r"parameter 'layers.0.mlp.down_proj' has shape \(96, 48\), which does not fit "
                                 r"{config} \(expected \(64, 48\)\)"),
    (("dflash_config", "target_layer_ids"), [1], r"parameter 'fc' has shape \(96, 48\), .* \(expected \(48, 48\)\)"),
    (("num_hidden_layers",), 2, r"parameter 'layers.1.input_layernorm.weight' is missing from the checkpoint "
                                r"\(does {config} describe this run\?\)"),
])
def test_a_run_whose_drafter_config_does_not_fit_its_params_names_the_parameter(run_dir, tmp_path, path, value,
                                                                               message):
    from dflash_jax.io.orbax import load_drafter_from_orbax

    run = _copy(run_dir, tmp_path / "run")
    _edit_config(run, (path, value), file="drafter_config.json")
    with pytest.raises(CheckpointError, match=f"^{run}/checkpoints/5: " + message.format(
            config=f"{run}/drafter_config.json")):
        load_drafter_from_orbax(run)


@pytest.mark.parametrize("value", ["verifier", [1]])
def test_a_speculators_config_that_is_no_object_is_named(value):
    from dflash_jax.io.dflash2_checkpoint import speculators_config_from_dict
    from dflash_jax.models.dflash2 import dflash2_config_to_dict
    from dflash_jax.tiny import tiny_dflash2_config, tiny_target_config

    layer = dflash2_config_to_dict(tiny_dflash2_config(tiny_target_config(), num_layers=1))
    dflash = layer.pop("dflash_config")
    data = {"speculators_model_type": "dflash2", "transformer_layer_config": layer,
            "aux_hidden_state_layer_ids": dflash["target_layer_ids"], "mask_token_id": dflash["mask_token_id"],
            "speculators_config": {"verifier": {"name_or_path": "Qwen/Qwen3-8B"}}}
    assert speculators_config_from_dict(data, "d/config.json").num_target_layers == max(dflash["target_layer_ids"]) + 1
    data["speculators_config"] = value
    with pytest.raises(ModelConfigError, match=r"^d/config.json: field 'speculators_config' must be an object"):
        speculators_config_from_dict(data, "d/config.json")


def test_engine_refuses_a_drafter_of_another_hidden_size(pair):
    from flax import nnx

    from dflash_jax.models.drafter import Drafter
    from dflash_jax.runtime.engine import Engine, EngineConfig
    from dflash_jax.tiny import tiny_drafter_config, tiny_target_config

    config = tiny_drafter_config(tiny_target_config(**dict(TARGET, hidden_size=32)), **DRAFTER)
    drafter = nnx.eval_shape(lambda: Drafter(config, rngs=nnx.Rngs(0)))  # only its config is read
    with pytest.raises(ValueError, match="drafter hidden_size 32 != target hidden_size 48"):
        Engine(pair["target"], drafter, EngineConfig(max_batch_size=1, max_length=32))


def test_a_model_path_must_be_a_directory(pair, tmp_path):
    weights = pair["target_dir"] / "model.safetensors"
    for load in (load_target, load_drafter):
        with pytest.raises(FileNotFoundError, match=f"{tmp_path}/missing: no such directory"):
            load(tmp_path / "missing")
        with pytest.raises(FileNotFoundError, match=f"{weights}: a file, not a directory"):
            load(weights)
        with pytest.raises(TypeError, match=f"{load.__name__}: path must be a directory path .*got NoneType"):
            load(None)


def test_a_target_and_a_drafter_are_told_apart(pair, tmp_path):
    with pytest.raises(CheckpointError, match="a target model's config, not a drafter's .*load_target"):
        load_drafter(pair["target_dir"])
    with pytest.raises(CheckpointError, match="a DFlash drafter's config, not a target's .*load_drafter"):
        load_target(pair["drafter_dir"])
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "drafter_config.json").write_text("{}")
    with pytest.raises(CheckpointError, match="a drafter's training run, not a target .*load_drafter"):
        load_target(tmp_path / "run")


@pytest.mark.parametrize("dtype", [None, "int8", np.float64, "bf16"])
def test_dtypes_other_than_the_float_ones_are_refused(pair, dtype):
    for load, directory in ((load_target, pair["target_dir"]), (load_drafter, pair["drafter_dir"])):
        with pytest.raises(ValueError, match=r"dtype must be one of \['bfloat16', 'float16', 'float32'\]"):
            load(directory, dtype=dtype)
