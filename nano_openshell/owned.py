"""What a Sandbox holds and gives back on close, and every one still held in this process (close_all).

A Sandbox's release runs at close(), when it is collected, or at interpreter exit. A process that
leaves without any of those -- os._exit after a fatal error, a signal it handles by dying -- would
leave its sandboxes' temporary directories in the temp dir, so it calls close_all() first. A process
that cannot (SIGKILL, the OOM killer) leaves them; their names say whose they are (temp_dir), and the
first Sandbox of a later process removes those whose process is gone.
"""

import os
import re
import tempfile
import threading
import time

from . import workspace as workspace_mod
from .namespaced import start_time

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


_KINDS = ("ws", "mnt", "sup", "tmp")  # workspace, a mount's directory, the supervisor's, a command's /tmp
_NAME = re.compile(r"nano-openshell-(?:%s)-(\d+)\.(\d+)-" % "|".join(_KINDS))
SANDBOX_UIDS = range(100000, 100000 + (1 << 20))  # as root, each Sandbox runs as one of these, and owns its workspace
_ME = {"pid": None, "tag": ""}  # this process's "<pid>.<start time>", and whose it is (a forked child remakes it)
_SWEEP_LOCK = threading.Lock()


def temp_dir(kind: str) -> str:
    """A new directory for a Sandbox in the temp dir, named nano-openshell-<kind>-<pid>.<start time>-...
    (the pid alone could be reused). The first one a process makes removes, in the background, those
    of processes that are gone (killed before they could remove theirs). Processes in other pid
    namespaces sharing this temp dir would look gone: like cgroup.py and namespaced.py, this assumes
    they do not."""
    if kind not in _KINDS:
        raise ValueError(f"temp_dir kind must be one of {_KINDS}, got {kind!r}")
    pid = os.getpid()
    if _ME["pid"] != pid:  # once per process (a forked child sweeps again: cheap); not per command
        with _SWEEP_LOCK:
            if _ME["pid"] != pid:
                _sweep(tempfile.gettempdir())
                _ME["tag"] = f"{pid}.{start_time(pid)}"
                _ME["pid"] = pid  # last: a thread that sees our pid also sees our tag
    return tempfile.mkdtemp(prefix=f"nano-openshell-{kind}-{_ME['tag']}-")


def _sweep(parent: str) -> None:
    try:
        names = os.listdir(parent)
    except OSError:
        return
    for name in names:
        match = _NAME.match(name)
        if not match or start_time(int(match[1])) == int(match[2]):
            continue  # not ours, or its process is alive
        path = os.path.join(parent, name)
        try:
            owner = os.lstat(path).st_uid
        except OSError:
            continue
        mine = owner == os.geteuid() or (os.geteuid() == 0 and owner in SANDBOX_UIDS)
        if mine:
            workspace_mod.remove_later(path)


def _closed(why: str) -> Exception:
    from .sandbox import SandboxError  # sandbox.py imports this module: it is loaded by now

    return SandboxError(why)
