"""close_all (nano_openshell/owned.py): what a process about to leave without its atexit handlers or
other threads' finally blocks (os._exit, a signal) calls, so that no workspace stays in the temp dir."""

import os
import threading
import time

import pytest

from nano_openshell import owned as owned_mod
from nano_openshell.sandbox import Sandbox, SandboxError


@pytest.fixture
def own_registry(monkeypatch):
    """close_all() sees this test's sandboxes only, and the process makes sandboxes again afterwards."""
    monkeypatch.setattr(owned_mod, "_HELD", set())
    monkeypatch.setattr(owned_mod, "_CLOSED_ALL", False)


def test_close_all_releases_every_sandbox_nobody_closed_and_refuses_new_ones(own_registry, make_sandbox):
    sandboxes = [make_sandbox() for _ in range(2)]
    result = {}
    running = threading.Thread(target=lambda: result.update(r=sandboxes[0].exec("sleep 30", timeout=60)))
    running.start()
    time.sleep(0.5)  # the command is in flight
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
