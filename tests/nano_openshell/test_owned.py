"""close_all (nano_openshell/owned.py): what a process about to leave without its atexit handlers or
other threads' finally blocks (os._exit, a signal) calls, so that no workspace stays in the temp dir."""

import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from nano_openshell import owned as owned_mod
from nano_openshell import workspace as workspace_mod
from nano_openshell.sandbox import Sandbox, SandboxError


@pytest.fixture
def own_registry(monkeypatch):
    """close_all() sees this test's sandboxes only, and the process makes sandboxes again afterwards."""
    monkeypatch.setattr(owned_mod, "_HELD", set())
    monkeypatch.setattr(owned_mod, "_CLOSED_ALL", False)


def test_close_all_releases_every_sandbox_nobody_closed_and_refuses_new_ones(own_registry, make_sandbox):
    sandboxes = [make_sandbox() for _ in range(2)]
    result = {}
    running = threading.Thread(target=lambda: result.update(r=sandboxes[0].exec("touch running; sleep 30",
                                                                               timeout=60)))
    running.start()
    end = time.monotonic() + 10
    while not os.path.exists(os.path.join(sandboxes[0].workspace, "running")) and time.monotonic() < end:
        time.sleep(0.01)  # until the command is in flight
    t0 = time.monotonic()
    owned_mod.close_all()
    running.join(timeout=20)
    assert time.monotonic() - t0 < 20 and not running.is_alive()
    assert result["r"].exit_code == -9  # killed: no command outlives the workspace it runs in
    assert not any(os.path.exists(sb.workspace) for sb in sandboxes)
    with pytest.raises(SandboxError, match="closed its sandboxes"):
        Sandbox(min_tier="none", allow_unisolated=True)


def test_a_directory_made_for_a_sandbox_that_close_all_released_meanwhile_goes_at_once(own_registry, tmp_path):
    """Sandbox() makes its workspace on its caller's thread; close_all() may release it in between."""
    owned = owned_mod.Owned()
    owned_mod.close_all()
    workspace = tmp_path / "ws"
    workspace.mkdir()
    with pytest.raises(SandboxError, match="closed while it started"):
        owned.add_dir(str(workspace))
    assert not workspace.exists()


HOLD_A_SANDBOX = """
import sys, time
from nano_openshell import Sandbox
sb = Sandbox(tier=sys.argv[1], min_tier="fallback")
r = sb.exec("mkdir -p deep/locked && echo x > deep/locked/f && chmod 500 deep/locked && echo ok", timeout=30)
assert r.stdout.strip() == "ok", r
print(sb.workspace, flush=True)
if sys.argv[2] == "hold":
    time.sleep(300)
sb.close()
"""


def _holders(tier: str, *modes: str) -> list[tuple[subprocess.Popen, str]]:
    """Processes holding a Sandbox each, started side by side; each with its workspace once it holds it."""
    procs = [subprocess.Popen([sys.executable, "-c", HOLD_A_SANDBOX, tier, mode], stdout=subprocess.PIPE, text=True)
             for mode in modes]
    return [(proc, proc.stdout.readline().strip()) for proc in procs]


def test_the_workspace_of_a_killed_process_goes_with_the_next_process_sandbox_and_a_live_ones_stays(tier):
    """SIGKILL (the launcher's escalation, the OOM killer) runs no handler at all: the process's
    workspace stays until a later process's first Sandbox sees that its owner is gone."""
    (killed, killed_ws), (alive, alive_ws) = _holders(tier, "hold", "hold")
    try:
        assert os.path.isdir(killed_ws) and os.path.isdir(alive_ws)
        killed.kill()
        killed.wait(timeout=30)
        assert os.path.isdir(os.path.join(killed_ws, "deep", "locked"))  # left behind, as before any sweep
        [(later, later_ws)] = _holders(tier, "close")
        assert later.wait(timeout=60) == 0 and not os.path.exists(later_ws)
        assert not os.path.exists(killed_ws), "a dead process's workspace survived a later process's first Sandbox"
        assert os.path.isdir(alive_ws), "a live process's workspace was swept"
    finally:
        for proc in (killed, alive):
            proc.kill()
            proc.wait(timeout=30)
    owned_mod.sweep(tempfile.gettempdir())  # the holder just killed: its workspace goes too
    workspace_mod.finish(30)
    assert not os.path.exists(alive_ws)


def test_temp_dir_names_carry_their_owner_and_only_sandbox_kinds_exist():
    path = owned_mod.temp_dir("ws")
    try:
        pid, start = os.path.basename(path).split("-")[3].split(".")
        assert int(pid) == os.getpid() and int(start) == owned_mod.start_time(os.getpid())
    finally:
        os.rmdir(path)
    with pytest.raises(ValueError, match="kind must be one of"):
        owned_mod.temp_dir("home")
