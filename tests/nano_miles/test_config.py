"""Dotted-key config: TOML + --set overrides, type coercion, clear errors."""
from dataclasses import dataclass, field

import pytest

from nano_miles.config import ConfigError, all_keys, load_config, parse_set


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
    model: str = "tiny"
    steps: int = 8
    engine_url: str | None = None
    optim: Optim = field(default_factory=Optim)
    sync: Sync = field(default_factory=Sync)


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
    (["nope=1"], "unknown config key 'nope'"),
    (["sync.nope=1"], "unknown config key 'sync.nope'"),
    (["steps=two"], "steps: expected an integer"),
    (["steps=1.5"], "steps: expected an integer"),
    (["sync.verify=maybe"], "sync.verify: expected true/false"),
    (["optim=1"], "'optim' is a section"),
    (["optim.lr=-1"], "optim.lr must be positive"),
    (["steps"], "--set expects key=value"),
])
def test_bad_overrides_are_clear_errors(items, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(Run, overrides=parse_set(items))


def test_bad_files_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(Run, tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = = 3")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(Run, bad)
