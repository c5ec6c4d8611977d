"""A sandbox's directories on the host, which its commands may change under us: walked by fd, never
through a link (walk), handed to the sandbox's uid (Handover), removed within a deadline (remove).

Handover (as root), before each command: whatever the host wrote since becomes the sandbox uid's. No
link is followed and a file with several hard links is left alone (it could be a host file), so a
planted link cannot make us chown a host file. A directory whose mtime has not moved since (an mtime
younger than FRESH_NS is not trusted) holds no new entry: an unchanged tree costs one fstat per
directory (a file the host chowns in place is not seen). A walk cut by the deadline goes on next time.
"""

import atexit
import contextlib
import os
import queue
import stat
import threading
import time

FRESH_NS = 250_000_000  # an mtime this recent is not trusted: timestamps tick coarsely
CHECK_EVERY = 256       # entries between two looks at the clock (or whether to stop)
EXIT_WAIT = 30.0
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class Moved(Exception):
    """The directory a walk is in is no longer under the one it came from."""


class Replaced(Exception):
    """The directory at a name is not the one expected (a command replaced it since it was listed)."""


def walk(root: int, listing, enter, leave) -> bool:
    """Depth first under the directory open at root, down by name and back up by "..", which must be the
    directory it came from (Moved): any depth, one fd more at a time, no path. listing(fd) does a
    directory's work and gives [(subdirectory name, (dev, ino) or None)], or None to stop (False);
    enter(name, ident, parent_fd) -> (fd, state) or None to pass over; leave(parent_fd, name, fd, state)
    on the way back up. True when the whole tree was done."""
    cur = root
    levels = [(dir_ident(root), listing(root), None, None)]  # per depth: (dev, ino), subdirs left, name, state
    try:
        while True:
            ident, subdirs, name, state = levels[-1]
            if subdirs is None:
                return False
            if subdirs:
                sub_name, sub_ident = subdirs.pop()
                opened = enter(sub_name, sub_ident, cur)
                if opened is None:
                    continue
                if cur != root:
                    os.close(cur)
                cur = opened[0]
                levels.append((dir_ident(cur), listing(cur), sub_name, opened[1]))
                continue
            if len(levels) == 1:
                return True
            up = os.open("..", _DIR_FLAGS, dir_fd=cur)
            if dir_ident(up) != levels[-2][0]:
                os.close(up)
                raise Moved()
            leave(up, name, cur, state)
            os.close(cur)
            cur = up
            levels.pop()
    finally:
        if cur != root:
            os.close(cur)


def dir_ident(fd: int) -> tuple[int, int]:  # which directory it is, whatever its name now
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def open_subdir(name: str, dir_fd: int, expect: tuple[int, int] | None = None) -> tuple[int, int | None]:
    """(fd, the mode it had or None) of the subdirectory `name`, no link followed; Replaced when it is
    not `expect` (as listed). One closed to us (mode 000: a non-root supervisor) is given u+rwx first,
    through an O_PATH handle (PermissionError when not ours); the caller may give the mode back."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except PermissionError:
        handle = os.open(name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            if expect is not None and dir_ident(handle) != expect:
                raise Replaced(expect) from None
            mode = stat.S_IMODE(os.fstat(handle).st_mode)
            os.chmod(f"/proc/self/fd/{handle}", mode | stat.S_IRWXU)
            return os.open(f"/proc/self/fd/{handle}", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC), mode
        finally:
            os.close(handle)
    if expect is not None and dir_ident(fd) != expect:
        os.close(fd)
        raise Replaced(expect)
    return fd, None


class Handover:
    def __init__(self, root: str, uid: int):
        self.root, self.uid = root, uid
        self.known: dict[tuple[int, int], tuple[int, tuple[str, ...]]] = {}  # (dev, ino) -> mtime, subdirs
        self.entries = 0  # entries the last walk looked at

    def claim_root(self) -> None:  # only the top directory: bwrap enters it as the sandbox's uid
        fd = os.open(self.root, _DIR_FLAGS)
        try:
            os.fchown(fd, self.uid, self.uid)
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)

    def run(self, deadline: float) -> bool:
        """Hand the tree over; False when the deadline came first (what was finished is kept)."""
        uid, fresh_after, done = self.uid, time.time_ns() - FRESH_NS, {}
        self.entries = 0

        def listing(fd: int):
            if time.monotonic() > deadline:
                return None
            st = os.fstat(fd)
            prev = self.known.get((st.st_dev, st.st_ino))
            if prev is not None and prev[0] == st.st_mtime_ns:
                subdirs = prev[1]
            else:
                subdirs = []
                with os.scandir(fd) as it:
                    for entry in it:
                        self.entries += 1
                        if self.entries % CHECK_EVERY == 0 and time.monotonic() > deadline:
                            return None
                        is_dir = entry.is_dir(follow_symlinks=False)
                        if is_dir:
                            subdirs.append(entry.name)
                        with contextlib.suppress(FileNotFoundError):
                            est = entry.stat(follow_symlinks=False)
                            if est.st_uid != uid and (is_dir or est.st_nlink == 1):
                                os.chown(entry.name, uid, uid, dir_fd=fd, follow_symlinks=False)
                subdirs = tuple(subdirs)
            if st.st_mtime_ns < fresh_after:
                done[st.st_dev, st.st_ino] = (st.st_mtime_ns, subdirs)
            return [(name, None) for name in subdirs]

        root = os.open(self.root, _DIR_FLAGS)
        try:
            st = os.fstat(root)
            if (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) != (uid, uid, 0o700):
                os.fchown(root, uid, uid)
                os.fchmod(root, 0o700)
            while True:
                try:
                    complete = walk(root, listing, _enter, lambda *_: None)
                    break
                except Moved:  # a command moved a directory while we were in it: walk again
                    continue
        finally:
            os.close(root)
        if complete:
            self.known = done  # forget directories that are gone
        else:
            self.known.update(done)
        return complete


def remove(path: str, deadline: float) -> bool:
    """rm -rf path, no link followed, closed directories opened up, until the deadline; True when gone."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return True
    fd = os.open(path, _DIR_FLAGS)
    count = [0]

    def leave(parent: int, name: str, _fd: int, _mode) -> None:
        with contextlib.suppress(OSError):  # not empty: a subdirectory that could not be opened; rmdir below says so
            os.rmdir(name, dir_fd=parent)

    try:
        if not walk(fd, lambda d: _opened_up_listing(d, count, deadline), _enter, leave):
            return False
    except Moved:
        return False  # never follow it out of the tree: the background remover tries again
    finally:
        os.close(fd)
    os.rmdir(path)
    return True


def _enter(name: str, _ident, parent: int):
    """walk's enter in a tree of ours: the subdirectory (opened up if closed), None when it is gone."""
    try:
        return open_subdir(name, parent)
    except OSError:  # gone, or no longer a directory
        return None


def _opened_up_listing(fd: int, count: list[int], deadline: float) -> list | None:
    """Give the directory u+rwx and unlink its files; its subdirectories, for walk (None: the deadline)."""
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o700)
    entries = []
    with os.scandir(fd) as it:
        for e in it:  # a directory of millions of files takes a while to list alone
            if len(entries) % CHECK_EVERY == CHECK_EVERY - 1 and time.monotonic() > deadline:
                return None
            entries.append((e.name, e.is_dir(follow_symlinks=False)))
    subdirs = []
    for name, is_dir in entries:
        count[0] += 1
        if count[0] % CHECK_EVERY == 0 and time.monotonic() > deadline:
            return None
        if is_dir:
            subdirs.append((name, None))
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)
    return subdirs


def rmtree(path: str) -> None:
    """rm -rf path now, through whatever read-only, closed or deeply nested directories a command left."""
    with contextlib.suppress(OSError):
        remove(path, float("inf"))


def remove_soon(path: str, deadline: float) -> None:
    with contextlib.suppress(OSError):
        if remove(path, deadline):
            return
    remove_later(path)


_LEFT: "queue.Queue[str]" = queue.Queue()
_REMOVER: list[threading.Thread] = []
_REMOVER_LOCK = threading.Lock()


def remove_later(path: str) -> None:  # in the background, one thread for the whole process
    with _REMOVER_LOCK:
        if not _REMOVER:
            _REMOVER.append(threading.Thread(target=_remove_loop, name="nano-openshell-remove", daemon=True))
            _REMOVER[0].start()
            atexit.register(finish)
    _LEFT.put(path)


def _remove_loop() -> None:  # waited for at interpreter exit, up to EXIT_WAIT
    while True:
        rmtree(_LEFT.get())
        _LEFT.task_done()


def finish(timeout: float = EXIT_WAIT) -> None:
    end = time.monotonic() + timeout
    while _LEFT.unfinished_tasks and time.monotonic() < end:
        time.sleep(0.05)


def pending() -> int:
    return _LEFT.unfinished_tasks
