"""The disk a sandbox's files take, and the check that kills a command taking it past Limits.disk_bytes.

RLIMIT_FSIZE caps one file; without a total, a command writing file after file fills the host's disk
for as long as it runs (~1 GB per 10 s command on the development VM, many times that on NVMe), and
an episode's commands add up. The host directories a sandbox writes to (its workspace and mounts; in
the tiers without namespaces its TMPDIR too: the namespaced tier's /tmp and /dev/shm are size-capped
tmpfs of its own) are walked while a command runs, and the command is killed once they hold more than
the limit. A filesystem quota would stop the write itself, but needs a filesystem set up for it and
privileges the sandbox may not have; the walk works in every tier, as any user.

What is counted: the blocks each file, directory and link really takes (st_blocks: a sparse file counts
what it holds), each hard-linked inode once, and at least one 4 KiB block per entry, so that millions
of empty files (the filesystem's inodes) are bounded as well. The check runs 50 ms into a command,
then every max(100 ms, 10 walks' time), and once when the command ends: a command may overshoot by
what it writes between two walks. A sandbox left over the limit (that overshoot, or a large workspace
the caller brought) runs its next command with what it holds as the limit: it is killed if it adds.
"""
from __future__ import annotations

import errno
import os
import stat
import time

from .workspace import Moved, Replaced, open_subdir, walk

MIN_ENTRY_BYTES = 4096  # an entry costs at least an inode and a block
FIRST_CHECK_S = 0.05    # commands shorter than this are checked once, at their end
MIN_INTERVAL_S = 0.1
WALK_SHARE = 0.1        # at most this share of the time goes into walking, for large trees


def usage(roots: list[str]) -> int:
    """Bytes the trees under roots take on disk, by the rules above. A command may change its files
    while they are walked: every directory is opened relative to its parent's fd, follows no link,
    and must be the one its parent listed (same device and inode), so neither a directory swapped for
    a link to the host's / nor a path longer than PATH_MAX leads the walk astray. The walk goes down by
    name and back up by "..", with one directory open at a time, so no depth exhausts our fds. A
    directory we may not read (a command sharing our uid took our access away) is opened for the walk
    and given its mode back on the way up; one that is not ours is not entered (only the host can put
    such a thing there). OSError when directories keep moving under the walk."""
    for _ in range(3):
        try:
            seen: set[tuple[int, int]] = set()  # hard links across roots count once too
            return sum(_tree_usage(root, seen) for root in roots)
        except Moved:
            continue  # a directory moved to another parent while we were in it: walk again
    raise OSError(errno.ESTALE, "the sandbox's directories kept moving while they were measured")


def _tree_usage(root: str, seen: set) -> int:
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    total = 0

    def listing(d: int) -> list:
        nonlocal total
        subdirs = []
        for name, st in _list(d):
            if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
            total += max(st.st_blocks * 512, MIN_ENTRY_BYTES)
            if stat.S_ISDIR(st.st_mode):
                subdirs.append((name, (st.st_dev, st.st_ino)))
        return subdirs

    def enter(name: str, ident, parent: int):
        try:
            return open_subdir(name, parent, expect=ident)
        except (FileNotFoundError, NotADirectoryError, PermissionError, Replaced):
            return None  # gone, replaced since it was listed, or not ours
        except OSError as e:
            if e.errno != errno.ELOOP:  # a link now, where the listing had a directory
                raise
            return None

    def leave(_parent: int, _name: str, d: int, mode) -> None:
        if mode is not None:  # opened up for the walk: its mode back
            os.fchmod(d, mode)

    try:
        walk(fd, listing, enter, leave)
    finally:
        os.close(fd)
    return total


def _list(fd: int) -> list[tuple[str, os.stat_result]]:
    """(name, lstat) of each entry of the open directory fd (fstatat on it: no path resolved again)."""
    out = []
    with os.scandir(fd) as it:
        for entry in it:
            try:
                out.append((entry.name, entry.stat(follow_symlinks=False)))
            except FileNotFoundError:
                continue
    return out


class DiskCheck:
    """What drain() calls while a command runs: due at next_at, over() says whether the command took
    the files past what is allowed (then the line its stderr gets), finish() measures at its end.
    Allowed is the limit, or what the files took when the command started if that was more (a sandbox
    left over the limit, or a large workspace the caller brought): a command is killed for what it
    adds, so the one that frees the space runs. baseline: the files' size at the start when known
    (the last command's finish()), else measured now."""

    def __init__(self, roots: list[str], limit: int, baseline: int | None = None):
        self.roots, self.limit = roots, limit
        self.used = 0
        if baseline is None:
            self._measure()  # cannot measure: 0, and the first check kills
        else:
            self.used = baseline
        self.allowed = max(limit, self.used)
        self.next_at = time.monotonic() + FIRST_CHECK_S
        self.killed = False

    def _measure(self) -> str | None:
        t0 = time.monotonic()
        try:
            self.used = usage(self.roots)
        except OSError as e:  # EMFILE: nested deeper than our open files; as good as over
            self.next_at = time.monotonic() + MIN_INTERVAL_S
            return f"the sandbox's files cannot be measured ({e.strerror})"
        self.next_at = time.monotonic() + max(MIN_INTERVAL_S, (time.monotonic() - t0) / WALK_SHARE)
        return None

    def over(self) -> str | None:
        why = self._measure()
        if why is None and self.used <= self.allowed:
            return None
        self.killed = True
        why = why or f"the sandbox's files take {self.used} bytes on disk"
        return f"nano-openshell: killed: {why}, over Limits.disk_bytes={self.limit}\n"

    def finish(self) -> str | None:
        """At the command's end: a line for its stderr when the files are over the limit."""
        why = self._measure()  # after a kill too: the next command starts from what is really there
        if self.killed or why is not None or self.used <= self.limit:
            return None
        return (f"nano-openshell: the sandbox's files take {self.used} bytes on disk, over Limits.disk_bytes="
                f"{self.limit}: a command that adds to them is killed\n")
