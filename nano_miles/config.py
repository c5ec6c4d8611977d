"""One config system for every subcommand: dotted keys over nested dataclasses.

Every field of every nested dataclass is a dotted key (`optim.lr`, `rollout.env.max_turns`). A
command's value comes from, later winning:

    the dataclass defaults <- a saved config (`train --resume`) <- `--config FILE.toml`
                           <- the command's own flags (aliases of keys) <- `--set key=value`

Values are coerced to the field's declared type (a float key takes finite numbers only: nan and inf
are refused whichever source gave them), then every dataclass's __post_init__ validates.
Anything wrong is a ConfigError with one line naming the key; an unknown key suggests the nearest
known one. A key's one-line meaning is its field's trailing comment (or metadata["help"]); docs/config.md
is generated from them: `python -m nano_miles.config --write-docs docs/config.md`.

A root dataclass may declare `config_aliases: ClassVar[dict[str, str]]` (old key -> new key): the
old key keeps working and says once, on stderr, what it is now called.
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


class ConfigError(ValueError):
    """Bad configuration input; str(e) is one line that names the key."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def filled_in(help: str) -> dict:
    """Field metadata for a field the program fills in itself: not a config key (e.g. the trainer's
    model folder, which `train` resolves from its own `model` key)."""
    return {"config_key": False, "help": help}


def _key_fields(cfg) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cfg) if f.metadata.get("config_key", True)]


def _field_types(cls) -> dict[str, typing.Any]:
    return typing.get_type_hints(cls)


def _is_optional(typ) -> bool:
    return typing.get_origin(typ) in (typing.Union, types.UnionType) and type(None) in typing.get_args(typ)


def _coerce(key: str, raw, typ):
    """Turn a TOML value or a --set string into `typ`, or raise ConfigError."""
    origin = typing.get_origin(typ)
    args = typing.get_args(typ)
    if origin in (typing.Union, types.UnionType):
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
            value = float(raw)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{key}: expected a number, got {raw!r}") from None
        if not math.isfinite(value):  # float() takes "nan" and "inf" (TOML and JSON too); no key means them
            raise ConfigError(f"{key}: expected a finite number, got {raw!r}")
        return value
    if typ is str:
        if isinstance(raw, (dict, list)):
            raise ConfigError(f"{key}: expected a string, got {raw!r}")
        return str(raw)
    raise ConfigError(f"{key}: unsupported field type {typ}")


# ----------------------------------------------------------------------------- keys

def all_keys(cfg, prefix: str = "") -> list[str]:
    """Every dotted key of a dataclass (instance or class), in declaration order."""
    keys = []
    hints = _field_types(cfg if isinstance(cfg, type) else type(cfg))
    for f in _key_fields(cfg):
        if dataclasses.is_dataclass(hints[f.name]):
            keys += all_keys(hints[f.name], prefix + f.name + ".")
        else:
            keys.append(prefix + f.name)
    return keys


def aliases(cfg) -> dict[str, str]:
    """old key -> current key, as the root dataclass declares them."""
    return dict(getattr(cfg, "config_aliases", {}))


def _unknown(cfg, key: str) -> ConfigError:
    known = all_keys(cfg) + list(aliases(cfg))
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    if not near:  # a section left out or wrong (`lr`, `trainer.lr`): match the last part alone
        tails = {k.rsplit(".", 1)[-1]: k for k in reversed(known)}
        near = [tails[t] for t in difflib.get_close_matches(key.rsplit(".", 1)[-1], tails, n=1, cutoff=0.8)]
    hint = f"did you mean {near[0]!r}?" if near else "docs/config.md lists every key"
    return ConfigError(f"unknown config key {key!r} ({hint})")


def canonical_key(cfg, key: str, note=None) -> str:
    """The current name of `key`: an alias is renamed (and `note` told so, once per call)."""
    new = aliases(cfg).get(key)
    if new is None:
        return key
    if note is not None:
        note(f"config key {key!r} is now {new!r} (the old name still works)")
    return new


def set_key(cfg, key: str, raw, note=None) -> None:
    """Set a dotted key on a nested dataclass instance, coercing the value."""
    root, key = cfg, canonical_key(cfg, key, note)
    parts = key.split(".")
    target = cfg
    for i, part in enumerate(parts):
        names = {f.name: f for f in _key_fields(target)} if dataclasses.is_dataclass(target) else {}
        if part not in names:
            raise _unknown(root, key)
        if i == len(parts) - 1:
            typ = _field_types(type(target))[part]
            if dataclasses.is_dataclass(typ):
                raise ConfigError(f"{key!r} is a section, set one of its keys (e.g. {key}.<name>)")
            setattr(target, part, _coerce(key, raw, typ))
        else:
            target = getattr(target, part)


def _flatten(d: dict, prefix: str = "") -> dict[str, typing.Any]:
    flat = {}
    for k, v in d.items():
        if isinstance(v, dict):
            flat.update(_flatten(v, prefix + k + "."))
        else:
            flat[prefix + k] = v
    return flat


def apply_dict(cfg, data: dict, note=None) -> None:
    """Set every (possibly nested) key of `data` on cfg, e.g. a saved config.json or parsed TOML."""
    for key, value in _flatten(data).items():
        set_key(cfg, key, value, note)


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


def _note_on_stderr(message: str) -> None:
    print(f"note: {message}", file=sys.stderr)


def read_toml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML: {e}") from None


def load_config(cls, path: str | Path | None = None, overrides: dict[str, typing.Any] | None = None,
                base: dict | None = None, note=_note_on_stderr):
    """Defaults <- base (a saved config, renamed keys taken silently) <- TOML file <- overrides,
    then the dataclasses' own validation (__post_init__)."""
    cfg = cls()
    if base:
        apply_dict(cfg, base)
    if path is not None:
        apply_dict(cfg, read_toml(path), note)
    for key, value in (overrides or {}).items():
        set_key(cfg, key, value, note)
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
    """The config keys and their values, nested like the dataclasses (what config.json holds)."""
    out = {}
    for f in _key_fields(cfg):
        value = getattr(cfg, f.name)
        out[f.name] = to_dict(value) if dataclasses.is_dataclass(value) else value
    return out


# ----------------------------------------------------------------------------- TOML out

def _toml_value(value) -> str:
    if value is None:
        return '"none"'  # TOML has no null; the loader reads "none" back as None
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))  # a JSON string is a TOML basic string


def to_toml(cfg, prefix: str = "") -> str:
    """The config as a TOML file that load_config reads back to the same values."""
    data = to_dict(cfg) if dataclasses.is_dataclass(cfg) else cfg
    lines = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    text = "\n".join(lines) + ("\n" if lines else "")
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
    comments = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    out = {}
    for node in ast.parse(source).body[0].body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            for line in range(node.lineno, node.end_lineno + 1):
                if line in comments:
                    out[node.target.id] = comments[line]
                    break
    return out


def field_help(cls, name: str) -> str:
    """The one-line meaning of field `name`: metadata["help"], else its trailing comment."""
    for f in dataclasses.fields(cls):
        if f.name == name and f.metadata.get("help"):
            return f.metadata["help"]
    for klass in cls.__mro__:  # the class that declares (or last re-declares) the field
        if name in inspect.get_annotations(klass):
            return _source_comments(klass).get(name, "")
    return ""


def describe(cfg, prefix: str = "") -> list[tuple[str, str, typing.Any, str]]:
    """(key, type, default, meaning) of every key of a config class (or instance: its values)."""
    cfg = cfg() if isinstance(cfg, type) else cfg
    rows, hints = [], _field_types(type(cfg))
    for f in _key_fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            rows += describe(value, prefix + f.name + ".")
        else:
            rows.append((prefix + f.name, _type_name(hints[f.name]), value, field_help(type(cfg), f.name)))
    return rows


def _type_name(typ) -> str:
    if _is_optional(typ):
        return " or ".join(_type_name(t) for t in typing.get_args(typ) if t is not type(None)) + " or none"
    if typing.get_origin(typ) is list:
        return f"list[{_type_name(typing.get_args(typ)[0])}]"
    return getattr(typ, "__name__", str(typ))


def _default_text(value) -> str:
    if value == "":
        return '""'
    return _toml_value(value).strip('"') if not isinstance(value, str) else value


# ----------------------------------------------------------------------------- command lines

def add_config_arguments(parser: argparse.ArgumentParser, cls, flags: dict[str, str] | None = None,
                         repeatable: tuple[str, ...] = (), switches: dict[str, tuple[str, str]] | None = None) -> None:
    """--config FILE, --set KEY=VALUE (repeatable), --print-config, and one flag per `flags` item
    (flag -> the dotted key it sets). A flag in `repeatable` may be given several times; its values
    join with commas. A flag's help is its key's meaning and default. `switches` are flags without a
    value (flag -> (key, the value it sets)), e.g. {"--no-cuda-graph": ("engine.cuda_graph", "false")}."""
    parser.add_argument("--config", metavar="FILE.toml",
                        help="a TOML file of config keys (sections for dotted keys, e.g. [optim] lr = 1e-6)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="set any config key (docs/config.md), e.g. --set rollout.group_size=4; repeatable")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as TOML and exit (a file --config takes)")
    rows = {k: (t, d, h) for k, t, d, h in describe(cls)}
    for flag, key in (flags or {}).items():
        typ, default, meaning = rows[key]
        parser.add_argument(flag, dest=_dest(flag), default=argparse.SUPPRESS, metavar=typ.split(" ")[0].upper(),
                            action="append" if flag in repeatable else "store",
                            help=f"{meaning} (key {key}, default {_default_text(default)})".lstrip(" "))
    for flag, (key, value) in (switches or {}).items():
        parser.add_argument(flag, dest=_dest(flag), default=argparse.SUPPRESS, action="store_const", const=value,
                            help=f"{key} = {value} ({rows[key][2]})")
    parser.set_defaults(config_flags={**(flags or {}), **{f: k for f, (k, _) in (switches or {}).items()}})


def _dest(flag: str) -> str:
    return "flag_" + flag.lstrip("-").replace("-", "_")


def config_from_args(cls, args: argparse.Namespace, base: dict | None = None, note=_note_on_stderr):
    """The validated config of a command line made by add_config_arguments: defaults <- base <-
    --config <- flags <- --set. Raises ConfigError (one line)."""
    overrides = {}
    for flag, key in getattr(args, "config_flags", {}).items():
        if hasattr(args, _dest(flag)):  # given on this command line (absent flags leave no attribute)
            value = getattr(args, _dest(flag))
            overrides[key] = ",".join(value) if isinstance(value, list) else value
    for key, value in parse_set(getattr(args, "overrides", [])).items():
        overrides[canonical_key(cls, key, note)] = value  # --set wins over a flag for the same key
    return load_config(cls, getattr(args, "config", None), overrides, base=base, note=note)


# ----------------------------------------------------------------------------- docs/config.md

def commands() -> dict[str, tuple[type, dict[str, str]]]:
    """subcommand -> (its root config dataclass, its flags: flag -> key), for every subcommand
    module that has a CONFIG."""
    # Imported here, not at the top: cli.py imports this module (and the subcommands import torch).
    from nano_miles.cli import SUBCOMMANDS

    found = {}
    for name, (module_name, _) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        if getattr(module, "CONFIG", None) is not None:
            parser = argparse.ArgumentParser()
            module.add_arguments(parser)
            found[name] = (module.CONFIG, parser.get_default("config_flags") or {})
    return found


def config_docs() -> str:
    out = ["# Config keys", "",
           "Generated from the config dataclasses by `python -m nano_miles.config --write-docs docs/config.md`",
           "(tests/nano_miles/test_config.py fails when this file is out of date). Every subcommand below takes",
           "`--config FILE.toml` and `--set key=value`; `--print-config` prints the resolved values as TOML.",
           "Later wins: defaults, `--config`, the command's own flags, `--set`. A float key takes finite numbers",
           "only: `nan`, `inf` and `-inf` are refused.", ""]
    for command, (cls, flags) in commands().items():
        out += [f"## nano-miles {command}", "", f"`{cls.__module__}.{cls.__name__}`", "",
                "| key | type | default | meaning |", "|---|---|---|---|"]
        for key, typ, default, meaning in describe(cls):
            meaning = meaning.replace("|", "\\|")  # a literal | inside a Markdown table cell
            out.append(f"| `{key}` | {typ} | `{_default_text(default)}` | {meaning} |")
        if flags:
            out += ["", "Flags, each the key it sets: " + ", ".join(f"`{f}` = `{k}`" for f, k in flags.items()) + "."]
        old = aliases(cls)
        if old:
            out += ["", "Old names that still work: " + ", ".join(f"`{k}` -> `{v}`" for k, v in old.items()) + "."]
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m nano_miles.config", description="generate docs/config.md")
    p.add_argument("--write-docs", metavar="PATH", help="write the key reference here (else print it)")
    args = p.parse_args(argv)
    text = config_docs()
    if args.write_docs:
        Path(args.write_docs).write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
