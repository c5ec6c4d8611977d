"""scripts/test_legs.sh: legs 2 and 3 run on a selection of tests, and whatever leg 3 changed on the
host (the user it created, the directory modes it opened) is undone when the script ends, passing or
failing. Run for real on one quick test, with a fresh user and a repo behind a private directory."""
import grp
import os
import pwd
import secrets
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SELECTION = "tests/nano_openshell/test_api.py::test_expected_tier_engaged"  # each leg checks its tier


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _run_legs(repo: Path, user: str, leg3_tier: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, NANO_TEST_PYTHON=sys.executable, NANO_OPENSHELL_TEST_USER=user,
               NANO_OPENSHELL_LEG3_TIER=leg3_tier)
    return subprocess.run(["bash", str(repo / "scripts" / "test_legs.sh"), SELECTION], env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("leg3_tier, status", [("namespaced", 0), ("fallback", 1)])
def test_leg_3_undoes_its_user_and_modes_whether_it_passes_or_fails(tmp_path, leg3_tier, status):
    """A leg-3 tier that does not match makes its test fail: the undo must still run."""
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    (private / "repo").symlink_to(REPO)  # the repo, reached through a directory others cannot traverse
    user = "nanolegs" + secrets.token_hex(3)
    interpreter = Path(sys.executable).resolve()
    ancestors = {*private.parents, private, *interpreter.parents}
    modes = {d: _mode(d) for d in ancestors}
    proc = _run_legs(private / "repo", user, leg3_tier)
    out = proc.stdout + proc.stderr
    if os.geteuid() != 0:  # leg 3 is root's: as anyone else the script changes nothing
        assert proc.returncode == 0 and "== leg 3: skipped" in out, out
        assert {d: _mode(d) for d in ancestors} == modes
        return
    assert proc.returncode == status, out
    assert f"== leg 3: {SELECTION} as {user}" in out  # it really ran leg 3 ...
    assert f"leg 3: chmod o+x {private} (so {user} can reach" in out  # ... after opening the way
    assert f"undo: chmod 700 {private}" in out and f"undo: userdel {user}" in out
    assert {d: _mode(d) for d in ancestors} == modes
    with pytest.raises(KeyError):
        pwd.getpwnam(user)
    with pytest.raises(KeyError):
        grp.getgrnam(user)  # useradd's group of the same name goes with it
    assert not Path(f"/tmp/pytest-of-{user}").exists()


def test_a_user_that_existed_before_is_left_alone():
    """The default user may be somebody's: the script deletes only a user it created."""
    user = "nanolegs" + secrets.token_hex(3)
    if os.geteuid() != 0:
        assert "== leg 3: skipped" in _run_legs(REPO, user, "namespaced").stdout
        return
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/bash", user], check=True)
    try:
        proc = _run_legs(REPO, user, "namespaced")
        assert proc.returncode == 0 and f"== leg 3: {SELECTION} as {user}" in proc.stdout, proc.stdout + proc.stderr
        assert "userdel" not in proc.stdout + proc.stderr
        assert pwd.getpwnam(user)
    finally:
        subprocess.run(["userdel", user], check=True)


def test_ctrl_c_stops_both_legs_and_still_undoes_leg_3():
    """Leg 2 runs in the background beside leg 3: Ctrl-C (SIGINT to the whole process group, as a
    terminal sends it) ends the script with 130, stops leg 2 too and undoes what leg 3 changed."""
    user = "nanolegs" + secrets.token_hex(3)
    env = dict(os.environ, NANO_TEST_PYTHON=sys.executable, NANO_OPENSHELL_TEST_USER=user)
    modes = {d: _mode(d) for d in Path(sys.executable).resolve().parents}
    # the sandbox's disk tests take long enough to be interrupted; SIGINT at its default in the child
    # (a background job of a script would ignore it)
    proc = subprocess.Popen(["bash", str(REPO / "scripts" / "test_legs.sh"), "tests/nano_openshell/test_disk.py"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    last_leg = "== leg 3: tests" if os.geteuid() == 0 else "== leg 3: skipped"
    seen = []
    for line in proc.stdout:  # wait for the last leg to start
        seen.append(line)
        if line.startswith(last_leg):
            break
    os.killpg(proc.pid, signal.SIGINT)
    out = "".join(seen) + proc.stdout.read()
    assert proc.wait(timeout=120) == 130, out
    leg2 = subprocess.run(["pgrep", "-f", "deny-namespaces -- .* tests/nano_openshell/test_disk.py"], capture_output=True)
    assert leg2.returncode == 1, leg2.stdout  # no leg 2 left running
    if os.geteuid() == 0:
        assert f"undo: userdel {user}" in out, out
        with pytest.raises(KeyError):
            pwd.getpwnam(user)
    assert {d: _mode(d) for d in Path(sys.executable).resolve().parents} == modes
