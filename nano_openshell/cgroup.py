"""A cgroup per Sandbox: one kill for everything its commands started, and memory and process caps for
the sandbox as a whole (docs/design.md, Cgroups). A pid joins its leaf before it starts anything.

Made under the supervisor's own cgroup v2 (or its parent, where that one hands controllers down and
is ours to write), processes only in its leaves; a hybrid host's v1 memory or pids controller gets a
group of the same name. A kill writes cgroup.kill, or before Linux 5.14 SIGKILLs cgroup.procs until it
is empty. A command cannot move itself out: the files are not its uid's, or Landlock keeps /sys read-only.
"""

import contextlib
import itertools
import os
import secrets
import select
import signal
import time
from pathlib import Path

from .owned import left_behind, process_tag

EMPTY_WAIT = 2.0  # after a kill, how long we wait for the kernel to tear processes down
_counter = itertools.count()
_layout = None  # (v2 parent, v2 caps?, {v1 controller: parent}): where this process makes its cgroups


def _hierarchies() -> tuple[str | None, dict[str, str]]:
    """(our v2 cgroup directory, {v1 controller: our cgroup directory}) for memory and pids, from
    /proc/self/mountinfo and /proc/self/cgroup. A cgroup mounted elsewhere than we sit is skipped."""
    mounts = {}  # "" for v2, else the v1 controller -> (mount point, root of the mount)
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            sep = fields.index("-")
            fstype, options = fields[sep + 1], fields[sep + 3].split(",")
            if fstype == "cgroup2":
                mounts.setdefault("", (fields[4], fields[3]))
            for ctrl in ("memory", "pids") if fstype == "cgroup" else ():
                if ctrl in options:
                    mounts.setdefault(ctrl, (fields[4], fields[3]))
    ours = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            for ctrl in ctrls.split(",") if ctrls else [""]:
                if ctrl in mounts and (mounts[ctrl][1] == "/" or path.startswith(mounts[ctrl][1])):
                    mount, root = mounts[ctrl]
                    rel = path if root == "/" else path[len(root):]
                    ours[ctrl] = os.path.normpath(mount + "/" + rel.lstrip("/"))
    return ours.pop("", None), ours


def _v2_parent(base: str) -> tuple[str, bool]:
    """(where the sandbox's v2 cgroup goes, can memory and pids be capped there): our own cgroup if it hands
    both down (or we can make it: only one without processes can), else its parent if it does and is ours."""
    def hands_down(d: str, file: str = "cgroup.subtree_control") -> bool:
        return {"memory", "pids"} <= set(Path(d, file).read_text().split())

    if hands_down(base):
        return base, True
    if hands_down(base, "cgroup.controllers"):
        with contextlib.suppress(OSError):  # EBUSY: we live in it ("no internal processes"), or it is not ours
            Path(base, "cgroup.subtree_control").write_text("+memory +pids")
            return base, True
    parent = os.path.dirname(base)
    with contextlib.suppress(OSError):
        if hands_down(parent) and os.access(parent, os.W_OK) and os.access(os.path.join(parent, "cgroup.procs"), os.W_OK):
            return parent, True
    return base, False


def _kill(path: str) -> None:
    try:
        Path(path, "cgroup.kill").write_text("1")
        return
    except FileNotFoundError:
        pass  # older than Linux 5.14: kill what is listed until nothing is (a fork lands in the list)
    except OSError:
        return  # already removed
    end = time.monotonic() + EMPTY_WAIT
    while time.monotonic() < end:
        pids = []
        for dirpath, _, _ in os.walk(path):
            with contextlib.suppress(OSError):
                pids += [int(p) for p in Path(dirpath, "cgroup.procs").read_text().split()]
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.001)


def _populated(path: str) -> bool:
    try:
        return "populated 1" in Path(path, "cgroup.events").read_text()
    except OSError:
        return False


def _remove(path: str, wait: float = EMPTY_WAIT) -> None:
    """rmdir a cgroup tree (leaves first) once its processes are gone; one busy after `wait` is left."""
    end = time.monotonic() + wait
    while _populated(path) and time.monotonic() < end:
        time.sleep(0.001)
    for dirpath, _, _ in sorted(os.walk(path), key=lambda w: -len(w[0])):
        while True:
            try:
                os.rmdir(dirpath)
                break
            except FileNotFoundError:
                break
            except OSError:  # EBUSY: v1 tasks still exiting
                if time.monotonic() > end:
                    break
                time.sleep(0.001)


class Leaf:
    """One command's (or one bwrap's) place in the sandbox cgroup."""

    def __init__(self, path: str, v1_dirs: list[str]):
        self.path, self._v1_dirs = path, v1_dirs

    def add(self, pid: int) -> None:  # what pid starts afterwards is born inside
        for d in [self.path, *self._v1_dirs]:
            Path(d, "cgroup.procs").write_text(str(pid))

    def kill(self) -> None:  # frozen or not
        _kill(self.path)

    def can_freeze(self) -> bool:  # the v2 freezer (Linux 5.2)
        return os.path.exists(os.path.join(self.path, "cgroup.freeze"))

    def freeze(self, timeout: float) -> bool:
        """Stop every process of the leaf where it is; True once the kernel reports them all frozen
        (cgroup.events says so, and signals a change by POLLPRI), False if not within timeout."""
        Path(self.path, "cgroup.freeze").write_text("1")
        fd = os.open(os.path.join(self.path, "cgroup.events"), os.O_RDONLY | os.O_CLOEXEC)
        try:
            poller = select.poll()
            poller.register(fd, select.POLLPRI)
            end = time.monotonic() + timeout
            while b"frozen 1" not in os.pread(fd, 4096, 0):
                left = end - time.monotonic()
                if left <= 0:
                    return False
                poller.poll(max(1, int(left * 1000)))
            return True
        finally:
            os.close(fd)

    def thaw(self) -> None:
        with contextlib.suppress(FileNotFoundError):  # removed with the sandbox: nothing left to thaw
            Path(self.path, "cgroup.freeze").write_text("0")

    def close(self) -> None:
        _kill(self.path)
        _remove(self.path)


class SandboxCgroup:
    def __init__(self, path: str, v1_dirs: dict[str, str], capped: list[str]):
        self.path = path          # the Sandbox's v2 cgroup
        self.v1_dirs = v1_dirs    # {controller: its v1 cgroup} on a hybrid host
        self.capped = capped      # what is capped for the whole sandbox: "memory", "pids"
        self._leaves = itertools.count()

    @classmethod
    def create(cls, memory_bytes: int, processes: int) -> "tuple[SandboxCgroup | None, str]":  # or (None, why)
        global _layout
        name = f"nano-openshell-{process_tag()}-{next(_counter)}-{secrets.token_hex(3)}"
        made = []
        try:
            if _layout is None:  # once per process (a supervisor does not change cgroups under us)
                v2_base, v1_bases = _hierarchies()
                if v2_base is None:
                    return None, "no cgroup v2 tree is mounted (cgroup.kill needs one)"
                _layout = (*_v2_parent(v2_base), v1_bases)
                for parent in (_layout[0], *v1_bases.values()):  # what processes that are gone left
                    for old in left_behind(parent, "nano-openshell-"):
                        if not _populated(old):
                            _remove(old, wait=0.0)
            parent, v2_caps, v1_bases = _layout
            path = os.path.join(parent, name)
            os.mkdir(path)
            made.append(path)
            capped, v1_dirs = [], {}
            if v2_caps:
                Path(path, "memory.max").write_text(str(memory_bytes))
                if os.path.exists(os.path.join(path, "memory.swap.max")):
                    Path(path, "memory.swap.max").write_text("0")
                Path(path, "pids.max").write_text(str(processes))
                capped = ["memory", "pids"]
            else:
                for ctrl, base in sorted(v1_bases.items()):
                    d = os.path.join(base, name)
                    try:
                        os.mkdir(d)
                    except OSError:
                        continue  # not ours to write: that cap stays per process
                    made.append(d)
                    if ctrl == "memory":
                        Path(d, "memory.limit_in_bytes").write_text(str(memory_bytes))
                        if os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):
                            Path(d, "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
                    else:
                        Path(d, "pids.max").write_text(str(processes))
                    v1_dirs[ctrl] = d
                    capped.append(ctrl)
        except (OSError, ValueError) as e:
            for d in reversed(made):
                _remove(d)
            return None, f"cannot create a cgroup here: {e}"
        how = "cgroup.kill" if os.path.exists(os.path.join(path, "cgroup.kill")) else "SIGKILL of cgroup.procs"
        caps = ", ".join(f"{c} (v1)" if c in v1_dirs else c for c in capped) or "nothing (no controller we may use)"
        return cls(path, v1_dirs, capped), f"{path}: kill by {how}; capped per sandbox: {caps}"

    def leaf(self) -> Leaf:
        path = os.path.join(self.path, f"c{next(self._leaves)}")
        os.mkdir(path)
        return Leaf(path, list(self.v1_dirs.values()))

    def close(self) -> None:
        """Kill every process of the sandbox and remove its cgroups. Idempotent."""
        _kill(self.path)  # every process is in the v2 tree too: the v1 groups need no kill of their own
        for d in [self.path, *self.v1_dirs.values()]:
            _remove(d)


def check() -> dict:  # what a Sandbox would get here (probe.py): a real cgroup, made and removed
    cg, why = SandboxCgroup.create(1 << 30, 64)
    if cg is not None:
        cg.close()
    return {"usable": cg is not None, "kill": cg is not None, "capped": cg.capped if cg else [], "reason": why}
