"""The one config system: validated dataclasses loaded from YAML, with ``key=value`` overrides.

A config class is a (frozen) dataclass whose fields may be scalars, tuples/lists, optional values or
nested config dataclasses. ``load_config(cls, path, overrides)`` reads YAML, applies dotted
overrides (``optim.lr=3e-4``), rejects unknown keys naming the file and the key, converts and checks
types, then calls the class's ``validate()`` if it has one.
"""

from __future__ import annotations

import dataclasses
import numbers
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

C = TypeVar("C")


class ConfigError(ValueError):
    """A config file or override is malformed: the message names the file and the field."""


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0], True
    return tp, False


@dataclasses.dataclass(frozen=True)
class _Override:
    """A ``key=value`` override's value: YAML's reading of it, and its text for a string field (YAML
    reads ``api_key=12345`` as an integer, ``name=on`` as a boolean)."""

    parsed: Any
    text: str
    override: str = ""  # the whole ``key=value``, which errors about this value name instead of the file

    def __repr__(self) -> str:  # as errors show a value
        return repr(self.parsed)


class _OverrideSection(dict):
    """A section that only ``key=value`` overrides wrote (absent from the file): ``override`` is the
    first of them, which an error about the section names instead of the file."""

    def __init__(self, override: str):
        super().__init__()
        self.override = override


def _override_of(value: Any) -> str | None:
    """The ``key=value`` override that gave ``value``, or None for a value of the file."""
    return value.override if isinstance(value, (_Override, _OverrideSection)) else None


def _plain(value: Any) -> Any:
    """``value`` with the overrides inside it (a key of a free-form mapping) as YAML read them."""
    if isinstance(value, _Override):
        return _plain(value.parsed)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _convert(value: Any, tp: Any, where: str) -> Any:
    tp, optional = _strip_optional(tp)
    # A value the command line gave: its errors name the override, not the file. (A section that
    # overrides created keeps its fields' own names: each of them is an override.)
    if (override := _override_of(value)) and (isinstance(value, _Override) or not dataclasses.is_dataclass(tp)):
        where = f"override {override!r}"
    if isinstance(value, _Override):
        value = value.text if tp is str and isinstance(value.parsed, (bool, int, float)) else value.parsed
    if value is None:
        if optional:
            return None
        if dataclasses.is_dataclass(tp):  # a section written with no keys (``model:``): its defaults
            return _build(tp, {}, where)
        raise ConfigError(f"{where}: must not be null")
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping for {tp.__name__}, got {value!r}")
        return _build(tp, value, where)
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{where}: must be one of {list(typing.get_args(tp))}, got {value!r}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        item_tp = args[0] if args else Any
        items = [_convert(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        return _plain(value)
    if tp is Any:
        return _plain(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # numpy's integers too
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads "3e-4" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy's floats too
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


def _build(cls: type[C], data: dict[str, Any], where: str) -> C:
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields), key=str)  # YAML keys may be numbers too
    if overridden := [k for k in unknown if _override_of(data[k])]:
        raise ConfigError(f"override {_override_of(data[overridden[0]])!r}: unknown key(s) {overridden} for "
                          f"{cls.__name__}; known keys: {sorted(fields)}")
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {unknown} for {cls.__name__}; known keys: {sorted(fields)}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(value, hints[name], f"{where}.{name}" if where else name)
    try:
        obj = cls(**kwargs)
    except TypeError as err:  # a required field is missing
        raise ConfigError(f"{where or cls.__name__}: {err}") from None
    validate = getattr(obj, "validate", None)
    if callable(validate):
        try:
            validate()
        except ConfigError:
            raise
        except ValueError as err:
            raise ConfigError(f"{where or cls.__name__}: {err}") from None
    return obj


def check_field_types(config: Any, where: str = "") -> None:
    """Raises ``ConfigError`` naming the field where a config dataclass built in Python, not loaded
    through this module, holds a value its annotation does not allow (``max_length=100.5``, a list
    where a tuple keeps the config hashable); nested configs are checked too. YAML's conveniences
    (a number written as a string, a list for a tuple) are for files, not for Python callers."""
    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        name = f"{where}.{f.name}" if where else f.name
        if dataclasses.is_dataclass(value):
            check_field_types(value, name)
        converted = _convert(value, hints[f.name], name)
        if type(converted) is not type(value) and not (type(converted) is float and isinstance(value, numbers.Real)):
            tp, _ = _strip_optional(hints[f.name])
            raise ConfigError(f"{name}: expected {getattr(tp, '__name__', tp)}, got {value!r}")


def _apply_override(data: dict[str, Any], override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override {override!r}: expected key=value")
    key, raw = override.split("=", 1)
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if isinstance(child, _Override):  # an earlier override gave the whole section
            child = child.parsed
        if child is None:  # absent, or written with no keys or as null (an optional section left off)
            child = _OverrideSection(override) if part not in node else {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {override!r}: {part!r} is not a section")
        node[part] = node = child
    try:
        parsed = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as err:
        raise ConfigError(f"override {override!r}: invalid YAML value: {err}") from None
    node[parts[-1]] = _Override(parsed, raw.strip(), override)


def config_from_dict(cls: type[C], data: dict[str, Any], *, source: str = "") -> C:
    """Builds and validates ``cls`` from a plain mapping; errors name ``source`` and the field."""
    return _build(cls, data, source)


def load_config(cls: type[C], path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> C:
    """Loads ``cls`` from the YAML file ``path`` (or defaults when None) plus ``key=value`` overrides."""
    data: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:  # bytes: YAML's reader decodes them (UTF-8 or UTF-16, a BOM) and reports bad ones as YAMLError
            loaded = yaml.safe_load(Path(path).read_bytes())
        except FileNotFoundError:
            raise ConfigError(f"{path}: config file not found") from None
        except OSError as err:  # a directory, no permission
            raise ConfigError(f"{path}: cannot read: {err.strerror or err}") from None
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: invalid YAML: {err}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping")
        data = loaded
    for override in overrides:
        _apply_override(data, override)
    return _build(cls, data, source)


def config_to_dict(config: Any) -> dict[str, Any]:
    """The plain-YAML form of a config (tuples as lists), for saving the resolved config."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v

    return plain(config)


def save_config(config: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
