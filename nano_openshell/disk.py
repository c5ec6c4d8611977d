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

MIN_ENTRY_BYTES = 4096  # an entry costs at least an inode and a block
FIRST_CHECK_S = 0.05    # commands shorter than this are checked once, at their end
MIN_INTERVAL_S = 0.1
WALK_SHARE = 0.1        # at most this share of the time goes into walking, for large trees


def usage(roots: list[str]) -> int:
    """Bytes the trees under roots take on disk, by the rules above. A command may change its files
    while they are walked: the walk follows no symlink, and enters only the directories it listed
    (same device and inode once opened), so a directory swapped for a link to the host's / is not
    walked. A directory we may not read (a command sharing our uid took our access away) is opened for
    the walk and given its mode back."""
    seen: set[tuple[int, int]] = set()
    total = 0
    stack = [(root, None) for root in roots]  # (path, its (st_dev, st_ino) as its parent listed it)
    while stack:
        path, ident = stack.pop()
        try:
            entries = _scan(path, ident)
        except (FileNotFoundError, NotADirectoryError, _Changed):
            continue  # gone or replaced since it was listed: the next walk sees what is there then
        except OSError as e:
            if e.errno != errno.ELOOP:  # a link now, where the listing had a directory (ENOTDIR here)
                raise
            continue
        for name, st in entries:
            if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
            total += max(st.st_blocks * 512, MIN_ENTRY_BYTES)
            if stat.S_ISDIR(st.st_mode):
                stack.append((os.path.join(path, name), (st.st_dev, st.st_ino)))
    return total


class _Changed(Exception):
    """The directory at a path is not the one its parent listed."""


def _scan(path: str, ident: tuple[int, int] | None) -> list:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except PermissionError:
        return _scan_closed(path, ident)
    try:
        _check(os.fstat(fd), ident)
        return _list(fd)
    finally:
        os.close(fd)


def _scan_closed(path: str, ident: tuple[int, int] | None) -> list:
    """A directory without read access for us: through an O_PATH handle on that very directory (no
    link followed), give it u+rwx, list it, give it its mode back. PermissionError when not ours."""
    handle = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(handle)
        _check(st, ident)
        mode, where = stat.S_IMODE(st.st_mode), f"/proc/self/fd/{handle}"
        os.chmod(where, mode | stat.S_IRWXU)
        try:
            fd = os.open(where, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                return _list(fd)
            finally:
                os.close(fd)
        finally:
            os.chmod(where, mode)
    finally:
        os.close(handle)


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


def _check(st, ident) -> None:
    if ident is not None and (st.st_dev, st.st_ino) != ident:
        raise _Changed(ident)


class DiskCheck:
    """What drain() calls while a command runs: due at next_at, over() says whether the command took
    the files past what is allowed (then the line its stderr gets), finish() measures at its end.
    Allowed is the limit, or what the files took when the command started if that was more (a sandbox
    left over the limit, or a large workspace the caller brought): a command is killed for what it
    adds, so the one that frees the space runs. baseline: the files' size at the start when known
    (the last command's finish()), else measured now."""

    def __init__(self, roots: list[str], limit: int, baseline: int | None = None):
        self.roots, self.limit = roots, limit
        self.used = usage(roots) if baseline is None else baseline
        self.allowed = max(limit, self.used)
        self.next_at = time.monotonic() + FIRST_CHECK_S
        self.killed = False

    def _measure(self) -> str | None:
        t0 = time.monotonic()
        try:
            self.used = usage(self.roots)
        except PermissionError as e:  # a directory we can neither read nor open: as good as over
            self.next_at = time.monotonic() + MIN_INTERVAL_S
            return f"the sandbox's files cannot be measured ({e.strerror}: {e.filename})"
        self.next_at = time.monotonic() + max(MIN_INTERVAL_S, (time.monotonic() - t0) / WALK_SHARE)
        return None

    def over(self) -> str | None:
        why = self._measure()
        if why is None and self.used <= self.allowed:
            return None
        self.killed = True
        return (f"nano-openshell: killed: {why or f'the sandbox files take {self.used} bytes on disk'}, over "
                f"Limits.disk_bytes={self.limit}\n")

    def finish(self) -> str | None:
        """At the command's end: a line for its stderr when the files are over the limit."""
        why = self._measure()  # after a kill too: the next command starts from what is really there
        if self.killed or why is not None or self.used <= self.limit:
            return None
        return (f"nano-openshell: the sandbox's files take {self.used} bytes on disk, over Limits.disk_bytes="
                f"{self.limit}: a command that adds to them is killed\n")
