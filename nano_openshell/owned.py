"""What a Sandbox holds on the host and gives back on close, and every one still held (close_all).

A Sandbox's release runs at close(), when it is collected, or at interpreter exit; a process leaving
without those (os._exit, a fatal signal) calls close_all() first. One that cannot (SIGKILL, the OOM
killer) leaves its temporary directories, cgroups and view directory behind: their names carry its pid
and start time, and a later process removes those whose owner is gone. Processes in other pid
namespaces sharing the temp dir would look gone: we assume none.
"""

import os
import re
import tempfile
import threading
import time

from .api import SandboxError
from .workspace import finish, remove, remove_later, remove_soon

REMOVE_BUDGET = 0.5      # release() removes temporary directories for this long, the rest in the background
CLOSE_ALL_BUDGET = 2.0   # close_all() removes them all itself, for up to this long (the process is leaving)
SANDBOX_UIDS = range(100000, 100000 + (1 << 20))  # as root, each Sandbox runs as one of these, and owns its workspace
KINDS = ("ws", "mnt", "sup", "tmp")  # workspace, a mount's directory, the supervisor's, a command's /tmp

_HELD: set["Owned"] = set()  # not yet released
_HELD_LOCK = threading.Lock()
_CLOSED_ALL = False
_TAG: list[str] = []  # this process's "<pid>.<start time>", once its first temp_dir() has swept
_SWEEP_LOCK = threading.Lock()
os.register_at_fork(after_in_child=_HELD.clear)  # a forked child's copies are its parent's sandboxes
os.register_at_fork(after_in_child=_TAG.clear)   # and it is another process: it sweeps and tags anew


def start_time(pid: int) -> int | None:
    """Clock ticks since boot at the process's start (None when gone): with the pid, a reused pid cannot
    impersonate it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_tag() -> str:
    """This process's "<pid>.<start time>": it names what the process leaves in shared places (temp
    dirs, cgroups), so that a sweep (left_behind) can tell when its owner is gone."""
    pid = os.getpid()
    return f"{pid}.{start_time(pid)}"


class Owned:
    """What one Sandbox gives back on release (apart from it, so that a finalizer can release it)."""

    def __init__(self):
        self.fds: list[int] = []
        self.proxy = self.init = self.cgroup = None
        self.dirs: list[str] = []  # removed on release: a temporary workspace, the mounts, the supervisor dir
        self.running: set = set()  # the kill function of every command in flight (fallback tier)
        self.lock = threading.Lock()
        self.released = False
        with _HELD_LOCK:
            if _CLOSED_ALL:
                raise SandboxError("this process closed its sandboxes for good (it is leaving)")
            _HELD.add(self)

    def add_dir(self, path: str) -> None:
        """A directory made for this Sandbox; when close_all() released it meanwhile, removed at once."""
        with self.lock:
            if not self.released:
                self.dirs.append(path)
                return
        remove(path, float("inf"))
        raise SandboxError("the sandbox was closed while it started")

    def track(self, kill) -> None:  # a command started: release() kills it (at once when released already)
        with self.lock:
            if not self.released:
                self.running.add(kill)
                return
        kill()

    def untrack(self, kill) -> None:
        with self.lock:
            self.running.discard(kill)

    def release(self, budget: float | None = None) -> None:
        """Give everything back, once (close() and close_all() may both come here); temporary directories
        go within `budget` seconds (None: REMOVE_BUDGET), the rest in the background."""
        with _HELD_LOCK:
            _HELD.discard(self)
        with self.lock:
            if self.released:
                return
            self.released, running = True, list(self.running)
        for kill in running:  # no command outlives its Sandbox (its workspace is about to go)
            kill()
        init, cgroup, proxy, self.init, self.cgroup, self.proxy = self.init, self.cgroup, self.proxy, None, None, None
        if init is not None:
            init.close()  # EOF: the init exits, and its pid namespace with it
        if cgroup is not None:
            cgroup.close()  # whatever is left, at once; then its directories go
        if proxy is not None:
            proxy.stop()
        while self.fds:
            os.close(self.fds.pop())
        deadline = time.monotonic() + (REMOVE_BUDGET if budget is None else budget)
        while self.dirs:
            remove_soon(self.dirs.pop(), deadline)


def close_all(budget: float = CLOSE_ALL_BUDGET) -> None:
    """Release every Sandbox of this process now, whoever holds it, and refuse new ones: for a process
    about to leave without its finally blocks or atexit handlers. Within `budget` seconds in all."""
    global _CLOSED_ALL
    deadline = time.monotonic() + budget
    with _HELD_LOCK:
        _CLOSED_ALL = True
        held = list(_HELD)
    for owned in held:
        owned.release(max(0.0, deadline - time.monotonic()))
    finish(max(0.0, deadline - time.monotonic()))


def temp_dir(kind: str) -> str:
    """A new nano-openshell-<kind>-<pid>.<start time>-... in the temp dir; a process's first sweeps."""
    if kind not in KINDS:
        raise ValueError(f"temp_dir kind must be one of {KINDS}, got {kind!r}")
    with _SWEEP_LOCK:
        if not _TAG:
            sweep(tempfile.gettempdir())
            _TAG.append(process_tag())
    return tempfile.mkdtemp(prefix=f"nano-openshell-{kind}-{_TAG[0]}-")


def left_behind(parent: str, prefix: str) -> list[str]:
    """Entries of parent named <prefix><pid>.<start time>-... whose process is gone (or its pid reused)."""
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    matches = [re.match(prefix + r"(\d+)\.(\d+)-", name) for name in names]
    return [os.path.join(parent, m.string) for m in matches if m and start_time(int(m[1])) != int(m[2])]


def sweep(parent: str, prefix: str = "nano-openshell-(?:%s)-" % "|".join(KINDS), remove=remove_later) -> None:
    """Remove (by default in the background) what gone processes left in parent: ours, or as root a sandbox uid's."""
    for path in left_behind(parent, prefix):
        try:
            owner = os.lstat(path).st_uid
        except OSError:
            continue
        if owner == os.geteuid() or (os.geteuid() == 0 and owner in SANDBOX_UIDS):
            remove(path)
