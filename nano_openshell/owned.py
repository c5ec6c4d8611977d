"""What a Sandbox holds and gives back on close, and every one still held in this process (close_all).

A Sandbox's release runs at close(), when it is collected, or at interpreter exit. A process that
leaves without any of those -- os._exit after a fatal error, a signal it handles by dying -- would
leave its sandboxes' temporary directories in the temp dir, so it calls close_all() first.
"""

import os
import threading
import time

from . import workspace as workspace_mod

_REMOVE_BUDGET = 0.5  # release() removes temporary directories for this long, the rest in the background
_CLOSE_ALL_BUDGET = 2.0  # close_all() removes them all itself, for up to this long (the process is leaving)

_HELD: set["Owned"] = set()  # not yet released
_HELD_LOCK = threading.Lock()
_CLOSED_ALL = False


class Owned:
    """What one Sandbox gives back on release (kept apart from it so that a finalizer can release it too)."""

    def __init__(self):
        self.fds: list[int] = []
        self.proxy = None
        self.init = None
        self.cgroup = None
        self.dirs: list[str] = []  # removed on release: a temporary workspace, the supervisor dir
        self.running: set = set()  # the kill function of every command in flight (fallback tier)
        self.lock = threading.Lock()
        self.released = False
        self.pid = os.getpid()
        with _HELD_LOCK:
            if _CLOSED_ALL:
                raise _closed("this process closed its sandboxes for good (it is leaving)")
            _HELD.add(self)

    def add_dir(self, path: str) -> None:
        """A directory made for this Sandbox. Its maker runs on its own thread: when close_all()
        released the Sandbox meanwhile, the directory goes at once (no one would remove it later)."""
        with self.lock:
            if not self.released:
                self.dirs.append(path)
                return
        workspace_mod.remove(path, float("inf"))
        raise _closed("the sandbox was closed while it started")

    def track(self, kill) -> None:
        """A command started: release() kills it; once released, it is killed at once."""
        with self.lock:
            if not self.released:
                self.running.add(kill)
                return
        kill()

    def untrack(self, kill) -> None:
        with self.lock:
            self.running.discard(kill)

    def release(self, budget: float | None = None) -> None:
        """Give everything back. Temporary directories are removed for `budget` seconds (None:
        _REMOVE_BUDGET), the rest in the background (a command can leave many files behind). Once:
        close() and close_all() may both come to it."""
        with _HELD_LOCK:
            _HELD.discard(self)
        with self.lock:
            if self.released:
                return
            self.released, running = True, list(self.running)
        for kill in running:  # no command outlives its Sandbox (its workspace is about to go)
            kill()
        if self.init is not None:  # EOF: the init exits, and its pid namespace with it
            self.init.close()
            self.init = None
        if self.cgroup is not None:
            self.cgroup.close()  # whatever is left, at once; then the cgroup directories go
            self.cgroup = None
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        while self.fds:
            os.close(self.fds.pop())
        deadline = time.monotonic() + (_REMOVE_BUDGET if budget is None else budget)
        while self.dirs:  # bounded: what a command left beyond the budget goes on in the background
            path = self.dirs.pop()
            try:
                gone = workspace_mod.remove(path, deadline)
            except OSError:
                gone = False
            if not gone:
                workspace_mod.remove_later(path)


def close_all(budget: float = _CLOSE_ALL_BUDGET) -> None:
    """Release every Sandbox of this process now, whoever holds it, and refuse new ones: for a process
    about to leave without running its finally blocks or atexit handlers (os._exit, a signal). Their
    directories are removed within `budget` seconds in all (the background remover's too)."""
    global _CLOSED_ALL
    deadline = time.monotonic() + budget
    with _HELD_LOCK:
        _CLOSED_ALL = True
        held = [o for o in _HELD if o.pid == os.getpid()]  # a forked child's copies are its parent's
    for owned in held:
        owned.release(max(0.0, deadline - time.monotonic()))
    workspace_mod.finish(max(0.0, deadline - time.monotonic()))


def _closed(why: str) -> Exception:
    from .sandbox import SandboxError  # sandbox.py imports this module: it is loaded by now

    return SandboxError(why)
