"""Dotted-key config: TOML + --set overrides, type coercion, clear errors, the command-line helper
every command uses, renamed keys refused by name, TOML out, and the generated key reference."""
import argparse
import importlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import pytest

from nano_miles import COMMANDS
from nano_miles.config import (ConfigError, add_config_arguments, all_keys, commands, config_docs, config_from_args,
                               describe, filled_in, load_config, parse_set, to_dict, to_toml)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"


@dataclass
class Optim:
    lr: float = 1e-6
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError("optim.lr must be positive")


@dataclass
class Sync:
    transport: str = "auto"
    verify: bool = False
    bucket_mb: int = 512


@dataclass
class Run:
    renamed_keys: ClassVar[dict[str, str]] = {"bucket": "sync.bucket_mb"}
    model: str = "tiny"   # the model to run
    steps: int = 8
    engine_url: str | None = None
    optim: Optim = field(default_factory=Optim)
    sync: Sync = field(default_factory=Sync)
    folder: str = field(default="", metadata=filled_in("resolved from model by the program"))


def test_defaults_and_every_key_is_listed():
    cfg = load_config(Run)
    assert cfg.steps == 8 and cfg.optim.lr == 1e-6
    assert set(all_keys(cfg)) == {"model", "steps", "engine_url", "optim.lr", "optim.betas",
                                  "sync.transport", "sync.verify", "sync.bucket_mb"}


def test_set_overrides_coerce_to_the_field_type():
    cfg = load_config(Run, overrides=parse_set(["optim.lr=3e-5", "sync.verify=true", "steps=2",
                                                "engine_url=http://127.0.0.1:1", "optim.betas=[0.8,0.9]"]))
    assert cfg.optim.lr == 3e-5 and cfg.sync.verify is True and cfg.steps == 2
    assert cfg.engine_url == "http://127.0.0.1:1" and cfg.optim.betas == [0.8, 0.9]
    assert load_config(Run, overrides={"engine_url": "none"}).engine_url is None


def test_toml_then_set(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('steps = 3\n[sync]\ntransport = "disk"\nbucket_mb = 64\n')
    cfg = load_config(Run, path, parse_set(["sync.bucket_mb=32"]))
    assert (cfg.steps, cfg.sync.transport, cfg.sync.bucket_mb) == (3, "disk", 32)


@pytest.mark.parametrize("items, message", [
    (["nope=1"], "unknown config key 'nope' (docs/config.md lists every key)"),
    (["optim.lrr=1"], "unknown config key 'optim.lrr' (did you mean 'optim.lr'?)"),
    (["lr=1"], "unknown config key 'lr' (did you mean 'optim.lr'?)"),
    (["folder=x"], "unknown config key 'folder'"),
    (["sync.nope=1"], "unknown config key 'sync.nope'"),
    (["steps=two"], "steps: expected an integer"),
    (["steps=1.5"], "steps: expected an integer"),
    (["sync.verify=maybe"], "sync.verify: expected true/false"),
    (["optim=1"], "'optim' is a section"),
    (["optim.lr=-1"], "optim.lr must be positive"),
    (["optim.lr=nan"], "optim.lr: expected a finite number, got 'nan'"),
    (["optim.lr=1e999"], "optim.lr: expected a finite number, got '1e999'"),  # inf once parsed
    (["optim.betas=[0.9, -Infinity]"], "optim.betas: expected a finite number, got -inf"),
    (["steps"], "--set expects key=value"),
])
def test_bad_overrides_are_clear_errors(items, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(Run, overrides=parse_set(items))


def test_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Run, tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = = 3")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(Run, bad)
    bad.write_text("[optim]\nlr = 1" + "0" * 400)  # a TOML integer too large for a float
    with pytest.raises(ConfigError, match="optim.lr: expected a number"):
        load_config(Run, bad)


def test_errors_are_one_line():
    with pytest.raises(ConfigError) as e:
        load_config(Run, overrides={"steps": "1\n2"})
    assert "\n" not in str(e.value)


def test_a_renamed_key_is_refused_with_one_line_naming_the_new_one(tmp_path):
    """From --set, a TOML file or a saved config.json (train --resume) alike: never a silent mapping."""
    path = tmp_path / "old.toml"
    path.write_text("bucket = 16\n")
    for attempt in (lambda: load_config(Run, overrides={"bucket": "16"}), lambda: load_config(Run, path),
                    lambda: load_config(Run, base={"bucket": 8, "steps": 3})):
        with pytest.raises(ConfigError) as refused:
            attempt()
        assert str(refused.value) == "config key 'bucket' is now 'sync.bucket_mb'"


def test_filled_in_fields_are_not_keys():
    assert "folder" not in all_keys(Run) and "folder" not in to_dict(Run())


def test_toml_out_reads_back_to_the_same_config(tmp_path):
    cfg = load_config(Run, overrides={"engine_url": "none", "optim.lr": "3e-7", "optim.betas": "[0.5, 1e-3]",
                                      "sync.verify": "true", "model": 'a "quoted" \\ name'})
    text = to_toml(cfg)
    assert 'engine_url = "none"' in text and "[optim]" in text and "verify = true" in text
    path = tmp_path / "printed.toml"
    path.write_text(text)
    assert load_config(Run, path) == cfg


def test_meanings_come_from_field_comments():
    rows = {key: (typ, default, meaning) for key, typ, default, meaning in describe(Run)}
    assert rows["model"] == ("str", "tiny", "the model to run")
    assert rows["engine_url"][0] == "str or none" and rows["optim.betas"][0] == "list[float]"
    assert list(rows) == all_keys(Run)


def _command_line(argv):
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, Run, flags={"--steps": "steps", "--url": "engine_url", "--lr": "optim.lr"},
                         repeatable=("--url",))
    return parser, parser.parse_args(argv)


def test_command_flags_are_shorthands_of_keys_and_set_wins(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("steps = 3\n[optim]\nlr = 0.5\n")
    _, args = _command_line(["--config", str(path), "--steps", "4", "--url", "http://a", "--url", "http://b",
                             "--set", "optim.lr=0.25", "--lr", "0.125", "--set", "sync.bucket_mb=2"])
    cfg = config_from_args(Run, args)
    assert (cfg.steps, cfg.engine_url, cfg.optim.lr, cfg.sync.bucket_mb) == (4, "http://a,http://b", 0.25, 2)
    _, args = _command_line([])
    assert config_from_args(Run, args) == Run() and not args.print_config


def test_command_flag_help_shows_the_key_its_meaning_and_default():
    parser, _ = _command_line([])
    text = " ".join(parser.format_help().split())
    assert "--steps INT" in text and "(key steps, default 8)" in text and "--print-config" in text
    with pytest.raises(ConfigError, match="steps: expected an integer, got 'x'"):
        config_from_args(Run, _command_line(["--steps", "x"])[1])


# ---- the key reference -----------------------------------------------------------------------------

def test_docs_config_md_is_generated_from_the_dataclasses():
    assert DOCS.read_text() == config_docs(), \
        "docs/config.md is out of date: python -m nano_miles.config --write-docs docs/config.md"


def test_every_key_of_every_command_says_what_it_means():
    assert {"train", "rollout", "eval"} <= set(commands())
    assert commands()["eval"][1]["--samples"] == "rollout.group_size"
    for command, (cls, _) in commands().items():
        silent = [key for key, _, _, meaning in describe(cls) if not meaning]
        assert not silent, f"{command}: keys without a comment or metadata help: {silent}"


# ---- non-finite numbers ----------------------------------------------------------------------------

def _float_keys(cls) -> list[tuple[str, str]]:
    """(key, type) of every key of a config class that holds floats: float, float or none, list[float]."""
    return [(key, typ) for key, typ, _, _ in describe(cls) if "float" in typ]


def _nested(key: str, value) -> dict:
    """{"a": {"b": value}} for "a.b": a key as config.json nests it."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


@pytest.mark.parametrize("bad", ["nan", "inf", "-inf"])
def test_every_float_key_of_every_command_refuses_nan_and_inf_from_every_source(tmp_path, bad):
    """NaN and inf pass float(); a command must refuse them by key, in one line, before it starts
    anything, whether they come from --set, a flag, --config FILE.toml or a resumed run's config.json.
    Every float key any command has is found from its dataclasses, so a new key is covered too."""
    toml_path, checked = tmp_path / "bad.toml", 0
    for command, (cls, flags) in commands().items():
        parser = argparse.ArgumentParser()
        importlib.import_module(COMMANDS[command][0]).add_arguments(parser)
        for key, typ in _float_keys(cls):
            listed = typ.startswith("list")
            toml_path.write_text(f"{key} = {f'[{bad}]' if listed else bad}\n")  # TOML spells them nan, inf, -inf
            saved = json.loads(json.dumps(_nested(key, [float(bad)] if listed else float(bad))))  # NaN, Infinity
            attempts = {"--set": lambda: config_from_args(cls, parser.parse_args(["--set", f"{key}={bad}"])),
                        "--config": lambda: config_from_args(cls, parser.parse_args(["--config", str(toml_path)])),
                        "config.json": lambda: config_from_args(cls, parser.parse_args([]), base=saved)}
            for flag in [f for f, k in flags.items() if k == key]:  # serve --mem-fraction-static
                attempts[flag] = lambda flag=flag: config_from_args(cls, parser.parse_args([f"{flag}={bad}"]))
            for source, attempt in attempts.items():
                with pytest.raises(ConfigError) as refused:
                    attempt()
                message = str(refused.value)
                assert message.startswith(f"{key}: ") and "\n" not in message, (command, source, message)
                assert message.count(key) == 1, message  # an optional float (loss.dual_clip) too
                checked += 1
    assert checked > 3 * 40  # the discovery found the commands' keys (train alone has more than 30)
