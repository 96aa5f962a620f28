"""The one config system: validated dataclasses from YAML, overrides, clear errors."""

import dataclasses

import numpy as np
import pytest

from dflash_jax.io.config import ConfigError, check_field_types, load_config, save_config
from dflash_jax.runtime.engine import EngineConfig
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



@pytest.mark.parametrize("override, message", [
    ("optim.lrr=1", r"^override 'optim.lrr=1': unknown key\(s\) \['lrr'\] for Optim; known keys"),
    ("engine.max_batch_sise=4", r"^override 'engine.max_batch_sise=4': unknown key\(s\) \['max_batch_sise'\]"),
    ("stesp=10", r"^override 'stesp=10': unknown key\(s\) \['stesp'\] for Recipe"),
    ("nosection.x=1", r"^override 'nosection.x=1': unknown key\(s\) \['nosection'\] for Recipe"),
    ("optim.steps=many", r"^override 'optim.steps=many': expected an integer, got 'many'"),
    ("optim=3", r"^override 'optim=3': expected a mapping for Optim, got 3"),
    ("layers=[1, x]", r"^override 'layers=\[1, x\]'\[1\]: expected an integer, got 'x'"),
])
def test_a_bad_override_is_named_not_the_file(tmp_path, override, message):
    """A typo on the command line is reported as the override the person typed: the file, where
    the key or value cannot be found, is not named for it."""
    path = tmp_path / "r.yaml"
    path.write_text("name: run\noptim:\n  lr: 3e-4\nengine:\n  block_size: 8\n")
    with pytest.raises(ConfigError, match=message) as err:
        load_config(Recipe, path, [override])
    assert "r.yaml" not in str(err.value)
    path.write_text("optim:\n  lrr: 1\n")  # the file's own mistakes still name the file
    with pytest.raises(ConfigError, match=r"r.yaml.optim: unknown key\(s\) \['lrr'\]"):
        load_config(Recipe, path, ["optim.steps=3"])


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


@dataclasses.dataclass(frozen=True)
class Served:
    api_key: str | None = None
    name: str = "x"
    kwargs: dict = dataclasses.field(default_factory=dict)
    optim: Optim = dataclasses.field(default_factory=Optim)
    mesh: MeshConfig | None = None


def test_overrides_keep_their_text_for_strings_and_fill_empty_sections(tmp_path):
    """YAML reads ``12345`` as a number and ``on`` as a boolean: a string field takes the text as
    written. A section left empty or null takes its defaults (or an override's keys); a free-form
    mapping's keys are set as YAML reads them; numeric keys are named in errors, not a TypeError."""
    cfg = load_config(Served, None, ["api_key=12345", "name=on", "optim.steps=3", "kwargs.enable_thinking=false",
                                     "kwargs.depth=2"])
    assert cfg.api_key == "12345" and cfg.name == "on" and cfg.optim.steps == 3
    assert cfg.kwargs == {"enable_thinking": False, "depth": 2}
    path = tmp_path / "s.yaml"
    path.write_text("optim:\nmesh: null\n")
    assert load_config(Served, path) == Served()
    assert load_config(Served, path, ["mesh.tensor=2", "optim.lr=0.5"]) == Served(mesh=MeshConfig(tensor=2),
                                                                                   optim=Optim(lr=0.5))
    assert load_config(Served, None, ["optim={lr: 2}", "optim.steps=4"]).optim == Optim(lr=2.0, steps=4)
    with pytest.raises(ConfigError, match=r"override 'optim.steps=x': expected an integer, got 'x'"):
        load_config(Served, None, ["optim.steps=x"])
    with pytest.raises(ConfigError, match=r"override 'name.x=1': expected a string, got \{'x': 1\}"):
        load_config(Served, None, ["name.x=1"])
    with pytest.raises(ConfigError, match=r"'name' is not a section"):
        load_config(Served, None, ["name=a", "name.x=1"])
    path.write_text("name: a\n1: b\nfoo: c\n")
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \[1, 'foo'\]"):
        load_config(Served, path)
