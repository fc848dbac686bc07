"""Turn a YAML mapping into the frozen dataclass tree of ``schema.py``, validating as it goes.

Errors name the offending key by its dotted path (``workers[1].port``) and, for closed
choices, the allowed values. Unknown keys are errors too: a typo must not be ignored.
"""
from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, get_args, get_origin

import yaml

from services.config.deployment_checks import check_deployment
from services.config.errors import ConfigError
from services.config.schema import DeploymentConfig

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_D = TypeVar("_D", bound="DataclassInstance")


def load_config(path: str | Path) -> DeploymentConfig:
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    try:
        return parse_config(raw or {})
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None


def parse_config(raw: Any) -> DeploymentConfig:
    config = build(DeploymentConfig, raw, "")
    check_deployment(config)
    return config


def build(cls: type[_D], raw: Any, path: str) -> _D:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {type(raw).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ConfigError(
            f"{_join(path, unknown[0])}: unknown key (allowed: {', '.join(sorted(fields))})"
        )
    hints = typing.get_type_hints(cls)
    values = {name: convert(hints[name], raw[name], _join(path, name)) for name in raw}
    missing = [
        name for name, f in fields.items()
        if name not in values and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{_join(path, missing[0])}: required key is missing")
    return cls(**values)


def convert(hint: Any, value: Any, path: str) -> Any:
    origin = get_origin(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return build(hint, value, path)
    if origin is Literal:
        allowed = get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{path}: {value!r} is not allowed (allowed: {', '.join(map(str, allowed))})")
        return value
    if origin in (typing.Union, types.UnionType):
        return _convert_optional(hint, value, path)
    if origin is tuple:
        return _convert_tuple(hint, value, path)
    if origin is dict or hint is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {type(value).__name__}")
        return dict(value)
    return _convert_scalar(hint, value, path)


def _convert_optional(hint: Any, value: Any, path: str) -> Any:
    options = [arg for arg in get_args(hint) if arg is not type(None)]
    if value is None:
        return None
    return convert(options[0], value, path)


def _convert_tuple(hint: Any, value: Any, path: str) -> tuple[Any, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"{path}: expected a list, got {type(value).__name__}")
    (item,) = [arg for arg in get_args(hint) if arg is not Ellipsis]
    return tuple(convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))


def _convert_scalar(hint: type, value: Any, path: str) -> Any:
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint is int and isinstance(value, bool) or not isinstance(value, hint):
        raise ConfigError(f"{path}: expected {hint.__name__}, got {value!r}")
    return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
