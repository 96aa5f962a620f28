"""The one config system: validated dataclasses from YAML, overrides, clear errors."""

import dataclasses

import numpy as np
import pytest

from dflash_jax.config import ConfigError, check_field_types, load_config, save_config
from dflash_jax.engine import EngineConfig
from dflash_jax.sharding import MeshConfig


@dataclasses.dataclass(frozen=True)
class Optim:
    lr: float = 1e-3
    steps: int = 10


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str = "x"
    optim: Optim = dataclasses.field(default_factory=Optim)
    engine: EngineConfig = dataclasses.field(default_factory=EngineConfig)
    layers: tuple[int, ...] = (1, 2)


def test_yaml_overrides_and_roundtrip(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("name: run\noptim:\n  lr: 3e-4\nengine:\n  block_size: 8\n  mesh: {tensor: 4}\nlayers: [3, 5]\n")
    cfg = load_config(Recipe, path, ["optim.steps=20", "engine.max_length=512"])
    assert cfg.optim == Optim(lr=3e-4, steps=20)
    assert cfg.engine.block_size == 8 and cfg.engine.max_length == 512
    assert cfg.engine.mesh == MeshConfig(tensor=4)
    assert cfg.layers == (3, 5)
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(Recipe, tmp_path / "saved.yaml") == cfg


@pytest.mark.parametrize("text, message", [
    ("optim:\n  lrr: 1\n", r"r.yaml.optim: unknown key\(s\) \['lrr'\]"),
    ("optim:\n  steps: many\n", r"optim.steps: expected an integer, got 'many'"),
    ("engine:\n  attention_impl: cuda\n", "attention_impl must be 'xla', 'pallas' or 'auto'"),
    ("engine:\n  decode_loop: forever\n", "decode_loop must be 'until_done', 'fixed' or 'auto'"),
    ("engine:\n  mesh: {tensor: 2, fsdp: -1, data: -1}\n", "at most one of data/fsdp/tensor may be -1"),
    ("- a\n", "the top level must be a mapping"),
])
def test_bad_configs_name_the_file_and_field(tmp_path, text, message):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(Recipe, path)


def test_bad_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(Recipe, None, ["optim.lr"])
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Recipe, tmp_path / "missing.yaml")


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_batch_size="4"), r"max_batch_size: expected an integer, got '4'"),
    (dict(max_length=100.5), r"max_length: expected an integer, got 100.5"),
    (dict(max_length=True), r"max_length: expected an integer, got True"),
    (dict(prompt_buckets=[16, 32]), r"prompt_buckets: expected tuple, got \[16, 32\]"),
    (dict(prompt_buckets=(16, "32")), r"prompt_buckets\[1\]: expected an integer, got '32'"),
    (dict(mesh=MeshConfig(tensor="2")), r"mesh.tensor: expected an integer, got '2'"),
])
def test_configs_built_in_python_are_type_checked(kwargs, message):
    """What the Python API builds directly gets the YAML loader's field checks, by name."""
    with pytest.raises(ConfigError, match=message):
        EngineConfig(**kwargs).validate()


def test_python_built_configs_take_numbers_of_any_kind():
    EngineConfig(max_batch_size=np.int64(4), prompt_buckets=(16, 32), mesh=MeshConfig(tensor=2)).validate()
    assert load_config(Optim, None, ["lr=1"]) == Optim(lr=1.0)
    check_field_types(Optim(lr=1))  # an int where a float is annotated
    check_field_types(Optim(lr=np.float32(1e-3), steps=np.int32(3)))  # numpy's numbers
    with pytest.raises(ConfigError, match=r"lr: expected float, got '1e-3'"):
        check_field_types(Optim(lr="1e-3"))  # YAML's string-as-number is for files only
