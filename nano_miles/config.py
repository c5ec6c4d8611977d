"""Dotted-key configuration over nested dataclasses: TOML files and `--set key=value` overrides.

Every field of every nested dataclass is addressable as a dotted key (`optim.lr`, `sync.transport`);
values are coerced to the field's declared type, and an unknown key or a value of the wrong type is
a clear error naming the key.
"""
from __future__ import annotations

import dataclasses
import json
import tomllib
import typing
from pathlib import Path


class ConfigError(ValueError):
    pass


def _field_types(cls) -> dict[str, typing.Any]:
    return typing.get_type_hints(cls)


def _coerce(key: str, raw, typ):
    """Turn a TOML value or a --set string into `typ`, or raise ConfigError."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null", "")):
            if type(None) in args:
                return None
        errors = []
        for option in args:
            if option is type(None):
                continue
            try:
                return _coerce(key, raw, option)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: {raw!r} is not a valid value ({'; '.join(errors)})")
    if typ is typing.Any:
        return raw
    if origin is list:
        if isinstance(raw, str):
            raw = json.loads(raw) if raw.strip().startswith("[") else [s for s in raw.split(",") if s]
        if not isinstance(raw, list):
            raise ConfigError(f"{key}: expected a list, got {raw!r}")
        return [_coerce(key, item, args[0] if args else typing.Any) for item in raw]
    if typ is bool:
        if isinstance(raw, bool):
            return raw
        if isinstance(raw, str) and raw.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(raw, str) and raw.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected true/false, got {raw!r}")
    if typ is int:
        if isinstance(raw, bool):
            raise ConfigError(f"{key}: expected an integer, got {raw!r}")
        try:
            value = int(raw) if not isinstance(raw, float) or raw.is_integer() else None
        except (TypeError, ValueError):
            value = None
        if value is None:
            raise ConfigError(f"{key}: expected an integer, got {raw!r}")
        return value
    if typ is float:
        if isinstance(raw, bool):
            raise ConfigError(f"{key}: expected a number, got {raw!r}")
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ConfigError(f"{key}: expected a number, got {raw!r}") from None
    if typ is str:
        if isinstance(raw, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {raw!r}")
        return str(raw)
    raise ConfigError(f"{key}: unsupported field type {typ}")


def set_key(cfg, key: str, raw) -> None:
    """Set a dotted key on a nested dataclass instance, coercing the value."""
    parts = key.split(".")
    target = cfg
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(target):
            raise ConfigError(f"unknown config key {key!r}")
        names = {f.name: f for f in dataclasses.fields(target)}
        if part not in names:
            known = ", ".join(sorted(all_keys(cfg)))
            raise ConfigError(f"unknown config key {key!r} (known keys: {known})")
        if i == len(parts) - 1:
            typ = _field_types(type(target))[part]
            if dataclasses.is_dataclass(typ):
                raise ConfigError(f"{key!r} is a section, set one of its keys (e.g. {key}.<name>)")
            setattr(target, part, _coerce(key, raw, typ))
        else:
            target = getattr(target, part)


def all_keys(cfg, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            keys += all_keys(value, prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


def _flatten(d: dict, prefix: str = "") -> dict[str, typing.Any]:
    flat = {}
    for k, v in d.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, prefix + k + "."))
        else:
            flat[prefix + k] = v
    return flat


def apply_dict(cfg, data: dict) -> None:
    """Set every (possibly nested) key of `data` on cfg, e.g. a saved config.json or parsed TOML."""
    for key, value in _flatten(data).items():
        set_key(cfg, key, value)


def parse_set(items: list[str]) -> dict[str, str]:
    overrides = {}
    for item in items or []:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        if not key.strip():
            raise ConfigError(f"--set expects key=value, got {item!r}")
        overrides[key.strip()] = value
    return overrides


def load_config(cls, path: str | Path | None = None, overrides: dict[str, typing.Any] | None = None):
    """Defaults <- TOML file <- overrides, then the dataclasses' own validation (__post_init__)."""
    cfg = cls()
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            data = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
        apply_dict(cfg, data)
    for key, value in (overrides or {}).items():
        set_key(cfg, key, value)
    validate(cfg)
    return cfg


def validate(cfg) -> None:
    """Re-run __post_init__ checks of every nested dataclass after overrides were applied."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            validate(value)
    post = getattr(cfg, "__post_init__", None)
    if post is not None:
        try:
            post()
        except (ValueError, TypeError) as e:
            raise ConfigError(str(e)) from None


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
