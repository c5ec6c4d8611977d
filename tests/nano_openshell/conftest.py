"""Fixtures for the sandbox tests.

Tests that need isolation take the `tier` fixture: they run once per isolated tier that the probe
finds working here ("namespaced" and/or "fallback"). Every adversarial command prints MARK first, so a
sandbox that never started cannot pass a negative test (see `started`).
"""

import ctypes
import os
import signal
import threading
import time
import uuid

import pytest

from nano_openshell import Limits, Sandbox, probe

MARK = "nano-openshell-test-started"
ISOLATED = [t for t in ("namespaced", "fallback") if probe()["tiers"][t]["ok"]]


def pytest_generate_tests(metafunc):
    if "tier" in metafunc.fixturenames:  # module scope: shared_sandbox is one per tier and module
        metafunc.parametrize("tier", ISOLATED, scope="module")


@pytest.fixture
def make_sandbox(tier):
    """make_sandbox(**kwargs) -> a Sandbox of the test's tier, closed after the test."""
    made = []

    def make(**kwargs):
        kwargs.setdefault("min_tier", "fallback")
        sb = Sandbox(tier=tier, **kwargs)
        made.append(sb)
        return sb

    yield make
    for sb in made:
        sb.close()


@pytest.fixture
def sandbox(make_sandbox):
    return make_sandbox()


@pytest.fixture(scope="module")
def shared_sandbox(tier):
    """One Sandbox of the tier for a module's tests that only run commands in it (none closes it,
    changes its limits or needs it empty)."""
    sb = Sandbox(tier=tier, min_tier="fallback")
    yield sb
    sb.close()


def started(result):
    """The command really ran in the sandbox: its first output line is the marker."""
    assert result.stdout.startswith(MARK), (result.stdout[:300], result.stderr[:300])
    return result


def token() -> str:
    """A unique string to find a test's processes by their command line."""
    return uuid.uuid4().hex[:12]


def sleep_arg(tok: str) -> str:
    """A `sleep` duration that carries the token into /proc/<pid>/cmdline: 900.<digits>."""
    return "900." + str(int(tok, 16) % 10**9)


def processes_with(text: str) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit() and int(name) != os.getpid():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        out.append(int(name))
            except OSError:
                pass
    return out


def wait_gone(text: str, within: float = 2.0) -> list[int]:
    """Processes still carrying `text` after `within` seconds (the kernel tears trees down async)."""
    end = time.monotonic() + within
    while True:
        left = processes_with(text)
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.05)


def wait_until(condition, what: str, within: float = 20.0):
    """Poll condition() until it holds and return its value; fail saying `what` was awaited after
    `within` seconds. For a test that waits on an event: no fixed sleep, however slow the host."""
    end = time.monotonic() + within
    while not (value := condition()):
        assert time.monotonic() < end, f"{what}: not within {within:g} s"
        time.sleep(0.01)
    return value


_PTRACE_SEIZE, _WALL = 0x4206, 0x40000000


def exec_held_past_its_deadline(sandbox):
    """Run a command that exits 3 long before its 1.5 s deadline but whose init's end of command
    (kill and reap what it left) is held past that deadline: the sleep it leaves is traced by us, so
    once killed it stays a zombie that only we can reap. Returns the command's ExecResult."""
    tok = token()
    sleeping = f"sleep\0{sleep_arg(tok)}"
    cmd = f"echo {MARK}; sleep {sleep_arg(tok)} & while [ ! -e go ]; do sleep 0.01; done; exit 3"
    results = []
    runner = threading.Thread(target=lambda: results.append(sandbox.exec(cmd, timeout=1.5)))
    runner.start()
    end = time.monotonic() + 10
    while not processes_with(sleeping) and time.monotonic() < end:
        time.sleep(0.01)
    [leftover] = processes_with(sleeping)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.ptrace(_PTRACE_SEIZE, leftover, None, None) == 0, os.strerror(ctypes.get_errno())
    try:
        with open(os.path.join(sandbox.workspace, "go"), "w"):
            pass
        runner.join(timeout=10)
    finally:
        os.kill(leftover, signal.SIGKILL)
        os.waitpid(leftover, _WALL)  # the zombie, released to the init (or to PID 1 once it died)
    [r] = results
    return r


__all__ = ["MARK", "ISOLATED", "Limits", "started", "token", "sleep_arg", "processes_with", "wait_gone", "wait_until",
           "exec_held_past_its_deadline"]
