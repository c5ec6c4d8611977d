"""One config system for every command: dotted keys (`optim.lr`) over nested dataclasses.

Later wins: the default (for `train --resume`, the run's saved config.json), `--config FILE.toml`, the
command's shorthand flags, `--set key=value`. Values are coerced to the field's type, then every
__post_init__ validates; anything wrong is a one-line ConfigError naming the key (an unknown one
suggests the nearest, a renamed one names its new name). A key's meaning is its field's trailing
comment (or metadata["help"]): `python -m nano_miles.config --write-docs docs/config.md`.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import importlib
import inspect
import io
import json
import math
import sys
import textwrap
import tokenize
import tomllib
import types
import typing
from functools import cache
from pathlib import Path

from nano_miles import COMMANDS


class ConfigError(ValueError):
    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def filled_in(help: str) -> dict:
    """Metadata of a field the program fills in itself (e.g. the trainer's model folder): not a key."""
    return {"config_key": False, "help": help}


def _key_fields(cfg) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cfg) if f.metadata.get("config_key", True)]


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _value(raw, typ):
    """`raw` (a TOML or JSON value, or a --set string) as a `typ`, or a ValueError saying what was expected."""
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (raw is None or (isinstance(raw, str) and raw.lower() in ("none", "null", ""))):
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return _value(raw, option)
            except ValueError as e:
                errors.append(str(e))
        raise ValueError(" or ".join(dict.fromkeys(errors)))
    if typ is typing.Any:
        return raw
    if origin is list:
        if isinstance(raw, str):
            raw = json.loads(raw) if raw.strip().startswith("[") else [s for s in raw.split(",") if s]
        if not isinstance(raw, list):
            raise ValueError(f"expected a list, got {raw!r}")
        return [_value(item, args[0] if args else typing.Any) for item in raw]
    if typ is bool:
        if isinstance(raw, bool) or (isinstance(raw, str) and raw.lower() in _TRUE + _FALSE):
            return raw if isinstance(raw, bool) else raw.lower() in _TRUE
        raise ValueError(f"expected true/false, got {raw!r}")
    if typ in (int, float):
        try:
            if isinstance(raw, bool) or (typ is int and isinstance(raw, float) and not raw.is_integer()):
                raise TypeError
            value = typ(raw)
        except (TypeError, ValueError, OverflowError):
            raise ValueError(f"expected {'an integer' if typ is int else 'a number'}, got {raw!r}") from None
        if not math.isfinite(value):  # float() takes "nan" and "inf" (TOML and JSON too); no key means them
            raise ValueError(f"expected a finite number, got {raw!r}")
        return value
    if typ is str and not isinstance(raw, (dict, list)):
        return str(raw)
    raise ValueError(f"expected a {getattr(typ, '__name__', typ)}, got {raw!r}")


# ----------------------------------------------------------------------------- keys

def all_keys(cfg) -> list[str]:
    return [key for key, *_ in describe(cfg)]


def _unknown(cfg, key: str) -> ConfigError:
    if (new := getattr(cfg, "renamed_keys", {}).get(key)) is not None:
        return ConfigError(f"config key {key!r} is now {new!r}")
    known = all_keys(cfg)
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not near:  # a section left out or wrong (`lr`, `trainer.lr`): match the last part alone
        tails = {k.rsplit(".", 1)[-1]: k for k in reversed(known)}
        near = [tails[t] for t in difflib.get_close_matches(key.rsplit(".", 1)[-1], tails, n=1, cutoff=0.8)]
    hint = f"did you mean {near[0]!r}?" if near else "docs/config.md lists every key"
    return ConfigError(f"unknown config key {key!r} ({hint})")


def set_key(cfg, key: str, raw) -> None:
    target, parts = cfg, key.split(".")
    for i, part in enumerate(parts):
        if not dataclasses.is_dataclass(target) or part not in {f.name for f in _key_fields(target)}:
            raise _unknown(cfg, key)
        if i < len(parts) - 1:
            target = getattr(target, part)
    typ = typing.get_type_hints(type(target))[parts[-1]]
    if dataclasses.is_dataclass(typ):
        raise ConfigError(f"{key!r} is a section, set one of its keys (e.g. {key}.<name>)")
    try:
        setattr(target, parts[-1], _value(raw, typ))
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def _flatten(d: dict, prefix: str = "") -> dict[str, typing.Any]:
    flat = {}
    for k, v in d.items():
        flat.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k: v})
    return flat


def parse_set(items: list[str]) -> dict[str, str]:
    overrides = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"--set expects key=value, got {item!r}")
        overrides[key.strip()] = value
    return overrides


def read_toml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def load_config(cls, path: str | Path | None = None, overrides: dict[str, typing.Any] | None = None,
                base: dict | None = None):
    """The defaults, or `base` (a saved config.json), <- the TOML file <- overrides; then validated."""
    cfg = cls()
    for layer in (base or {}, read_toml(path) if path is not None else {}, overrides or {}):
        for key, value in _flatten(layer).items():
            set_key(cfg, key, value)
    validate(cfg)
    return cfg


def validate(cfg) -> None:
    """Every nested dataclass's __post_init__ again, now that the overrides are set."""
    for f in dataclasses.fields(cfg):
        if dataclasses.is_dataclass(getattr(cfg, f.name)):
            validate(getattr(cfg, f.name))
    try:
        getattr(cfg, "__post_init__", lambda: None)()
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


def to_dict(cfg) -> dict:
    """The keys' values, nested like the dataclasses (what config.json holds)."""
    return {f.name: to_dict(v) if dataclasses.is_dataclass(v := getattr(cfg, f.name)) else v for f in _key_fields(cfg)}


def _toml_value(value) -> str:
    if value is None:
        return '"none"'  # TOML has no null; the loader reads "none" back as None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):  # finite: a float key refuses nan and inf
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a TOML basic string


def to_toml(cfg, prefix: str = "") -> str:
    """The config as a TOML file that load_config reads back to the same values."""
    data = to_dict(cfg) if dataclasses.is_dataclass(cfg) else cfg
    text = "".join(f"{k} = {_toml_value(v)}\n" for k, v in data.items() if not isinstance(v, dict))
    for k, v in data.items():
        if isinstance(v, dict):
            text += f"\n[{prefix}{k}]\n" + to_toml(v, f"{prefix}{k}.")
    return text


# ----------------------------------------------------------------------------- meanings

@cache
def _source_comments(cls) -> dict[str, str]:
    """field name -> the comment on its line(s) in the class body."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments = {tok.start[0]: tok.string.lstrip("#").strip()
                for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    out = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            if lines := [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments]:
                out[node.target.id] = lines[0]
    return out


def describe(cfg, prefix: str = "") -> list[tuple[str, str, typing.Any, str]]:
    """(key, type, default, meaning) of every key of a config class (or instance: its values)."""
    cfg = cfg() if isinstance(cfg, type) else cfg
    rows, hints = [], typing.get_type_hints(type(cfg))
    for f in _key_fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            rows += describe(value, f"{prefix}{f.name}.")
            continue
        # the class of the field's last (re-)declaration holds its comment
        declared = next(k for k in type(cfg).__mro__ if f.name in inspect.get_annotations(k))
        meaning = f.metadata.get("help") or _source_comments(declared).get(f.name, "")
        rows.append((prefix + f.name, _type_name(hints[f.name]), value, meaning))
    return rows


def _type_name(typ) -> str:
    args = typing.get_args(typ)
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        names = [_type_name(t) for t in args if t is not type(None)] + (["none"] if type(None) in args else [])
        return " or ".join(names)
    if typing.get_origin(typ) is list:
        return f"list[{_type_name(args[0])}]"
    return getattr(typ, "__name__", str(typ))


def _default_text(value) -> str:
    return '""' if value == "" else value if isinstance(value, str) else _toml_value(value).strip('"')


# ----------------------------------------------------------------------------- command lines

def add_config_arguments(parser: argparse.ArgumentParser, cls, flags: dict[str, str] | None = None,
                         repeatable: tuple[str, ...] = (), switches: dict[str, tuple[str, str]] | None = None) -> None:
    """--config, --set, --print-config and the shorthands: `flags` (flag -> key; one in `repeatable`
    may be given again, its values joined with commas) and `switches` (flag -> (key, value it sets))."""
    parser.add_argument("--config", metavar="FILE.toml",
                        help="a TOML file of config keys (sections for dotted keys, e.g. [optim] lr = 1e-6)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="set any config key (docs/config.md), e.g. --set rollout.group_size=4; repeatable")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as TOML and exit (a file --config takes)")
    rows = {key: (typ, default, meaning) for key, typ, default, meaning in describe(cls)}
    for flag, key in (flags or {}).items():  # dest "set:KEY": config_from_args finds what was given
        typ, default, meaning = rows[key]
        parser.add_argument(flag, dest="set:" + key, default=argparse.SUPPRESS, metavar=typ.split(" ")[0].upper(),
                            action="append" if flag in repeatable else "store",
                            help=f"{meaning} (key {key}, default {_default_text(default)})".lstrip(" "))
    for flag, (key, value) in (switches or {}).items():
        parser.add_argument(flag, dest="set:" + key, default=argparse.SUPPRESS, action="store_const", const=value,
                            help=f"{key} = {value} ({rows[key][2]})")
    parser.set_defaults(config_flags={**(flags or {}), **{f: k for f, (k, _) in (switches or {}).items()}})


def config_from_args(cls, args: argparse.Namespace, base: dict | None = None):
    """The validated config of a command line made by add_config_arguments."""
    overrides = {dest[4:]: ",".join(value) if isinstance(value, list) else value
                 for dest, value in vars(args).items() if dest.startswith("set:")}  # the flags given
    overrides.update(parse_set(getattr(args, "overrides", [])))
    return load_config(cls, getattr(args, "config", None), overrides, base=base)


def not_a_flag(cls, command: str, words: list[str]) -> str:
    """One line for words no flag took: the `--set` form of the key an unknown flag names."""
    flag, _, value = words[0].partition("=")
    value = value or (words[1] if len(words) > 1 and not words[1].startswith("-") else "VALUE")
    name = flag.lstrip("-").replace("-", "_")
    keys = [k for k in all_keys(cls) if k == name or k.endswith("." + name)] if cls and flag.startswith("--") else []
    if not keys:
        return f"unrecognized arguments: {' '.join(words)}"
    keys = [k for k in keys if k == name] or keys
    return f"{flag} is not a flag of {command}: use " + " or ".join(f"--set {k}={value}" for k in keys)


# ----------------------------------------------------------------------------- docs/config.md

def commands() -> dict[str, tuple[type, dict[str, str]]]:
    """command -> (its root config dataclass, its shorthand flags), for each command that takes keys."""
    found = {}
    for name, (module_name, _) in COMMANDS.items():
        module = importlib.import_module(module_name)
        if getattr(module, "CONFIG", None) is not None:
            parser = argparse.ArgumentParser()
            module.add_arguments(parser)
            found[name] = (module.CONFIG, parser.get_default("config_flags") or {})
    return found


def config_docs() -> str:
    out = ["# Config keys", "",
           "Generated from the config dataclasses by `python -m nano_miles.config --write-docs docs/config.md`",
           "(tests/nano_miles/test_config.py fails when this file is out of date). Every command below takes",
           "`--config FILE.toml` and `--set key=value`; `--print-config` prints the resolved values as TOML.",
           "Later wins: the defaults (for `train --resume`, the run's saved config.json), `--config`, `--set`.",
           "A command's few flags are shorthands of the keys they set, listed under its table; any other key",
           "is set with `--set`. A float key takes finite numbers only: `nan`, `inf` and `-inf` are refused.", ""]
    for command, (cls, flags) in commands().items():
        out += [f"## nano-miles {command}", "", f"`{cls.__module__}.{cls.__name__}`", "",
                "| key | type | default | meaning |", "|---|---|---|---|"]
        for key, typ, default, meaning in describe(cls):
            meaning = meaning.replace("|", "\\|")  # a literal | inside a Markdown table cell
            out.append(f"| `{key}` | {typ} | `{_default_text(default)}` | {meaning} |")
        if flags:
            out += ["", "Shorthands: " + ", ".join(f"`{f}` sets `{k}`" for f, k in flags.items()) + "."]
        if renamed := getattr(cls, "renamed_keys", {}):
            out += ["", "Renamed keys, refused with a line naming the new one: "
                    + ", ".join(f"`{k}` is `{v}`" for k, v in renamed.items()) + "."]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nano_miles.config", description="generate docs/config.md")
    p.add_argument("--write-docs", metavar="PATH", help="write the key reference here (else print it)")
    args = p.parse_args(argv)
    if args.write_docs:
        Path(args.write_docs).write_text(config_docs())
    else:
        print(config_docs(), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
