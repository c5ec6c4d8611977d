"""The host's side of a Sandbox's directories: its mounts, handing them to the sandbox's uid, removing them.

Handover (as root): before each command the workspace (and every mount) must belong to the sandbox's
uid, whatever the host wrote there since the last command. The walk is fd-relative and never follows
a link, so a link planted by a command cannot make us chown a host file; files with several hard
links are left alone (where protected_hardlinks is off, one could be a host file). It remembers each
directory it finished (inode, mtime, subdirectories): a directory with the same inode and mtime
holds no entry that was not there last time, so its entries are not looked at again, and an
unchanged tree costs one fstat per directory. A directory's state is trusted only when its mtime is
older than _FRESH_NS (timestamps tick coarsely: a later write could keep the same mtime). Not seen:
the host chowning an existing file in place (writers create files, they do not chown them).
The walk stops at the command's deadline and says so; what it finished is kept, so the next one
goes on from there.

Removal: close() removes a Sandbox's temporary directories, but a command can fill one with
hundreds of thousands of files; remove() works until its deadline and leaves the rest to one
background thread (finished at interpreter exit, up to _EXIT_WAIT). Its traversal, walk(), is also
disk.py's: fd-relative, no link followed, back up by ".." only to the directory it came from.
"""

import atexit
import os
import queue
import shutil
import stat
import threading
import time

from . import namespaced

_FRESH_NS = 250_000_000
_CHECK_EVERY = 256   # entries between two looks at the clock
_EXIT_WAIT = 30.0


def check_mounts(mounts) -> dict:
    """Sandbox(mounts={path in the sandbox: None or a host directory}), checked; ValueError/TypeError say why not."""
    if not mounts:
        return {}
    if not isinstance(mounts, dict):
        raise TypeError(f"mounts must be a dict {{path in the sandbox: None or a host directory}}, got {mounts!r}")
    paths = sorted(namespaced.check_mount_path(p) for p in mounts)
    for a, b in zip(paths, paths[1:]):
        if b.startswith(a + "/"):
            raise ValueError(f"mount paths {a!r} and {b!r} overlap")
    for path, source in mounts.items():
        if source is not None and not os.path.isdir(os.fspath(source)):
            raise ValueError(f"mount {path!r}: host directory {source!r} does not exist or is not a directory")
    return mounts


def make_mount_dir(source) -> str:
    """A Sandbox's own directory behind a mount: empty, or a copy of a host directory (links as links)."""
    from .owned import temp_dir  # owned.py imports this module

    host = temp_dir("mnt")
    if source is not None:
        shutil.copytree(os.fspath(source), host, symlinks=True, dirs_exist_ok=True)
    return host


class Handover:
    def __init__(self, root: str, uid: int):
        self.root, self.uid = root, uid
        self.known: dict[str, tuple[int, int, tuple[str, ...]]] = {}  # relative dir -> ino, mtime, subdirs
        self.entries = 0   # entries the last walk looked at

    def claim_root(self) -> None:
        """Only the top directory (bwrap must enter it as the sandbox's uid when it starts)."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            os.fchown(fd, self.uid, self.uid)
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)

    def run(self, deadline: float) -> bool:
        """Hand the tree over; False when the deadline cut the walk short."""
        uid, seen, done = self.uid, 0, {}
        fresh_after = time.time_ns() - _FRESH_NS
        root_fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        root_st = os.fstat(root_fd)
        if (root_st.st_uid, root_st.st_gid, stat.S_IMODE(root_st.st_mode)) != (uid, uid, 0o700):
            os.fchown(root_fd, uid, uid)
            os.fchmod(root_fd, 0o700)
        stack = [(".", root_fd, None)]  # depth first: open fds only along the current path
        try:
            while stack:
                rel, fd, pending = stack[-1]
                if pending is None:  # first visit: look at this directory's entries, if it changed
                    if time.monotonic() > deadline:
                        return False
                    st = os.fstat(fd)
                    prev = self.known.get(rel)
                    if prev is not None and prev[:2] == (st.st_ino, st.st_mtime_ns):
                        subdirs = prev[2]
                    else:
                        subdirs = []
                        with os.scandir(fd) as it:
                            for entry in it:
                                seen += 1
                                if seen % _CHECK_EVERY == 0 and time.monotonic() > deadline:
                                    return False
                                is_dir = entry.is_dir(follow_symlinks=False)
                                if is_dir:
                                    subdirs.append(entry.name)
                                try:
                                    est = entry.stat(follow_symlinks=False)
                                    if est.st_uid != uid and (is_dir or est.st_nlink == 1):
                                        os.chown(entry.name, uid, uid, dir_fd=fd, follow_symlinks=False)
                                except FileNotFoundError:
                                    pass
                    if st.st_mtime_ns < fresh_after:
                        done[rel] = (st.st_ino, st.st_mtime_ns, tuple(subdirs))
                    pending = list(subdirs)
                    stack[-1] = (rel, fd, pending)
                if pending:
                    name = pending.pop()
                    try:
                        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                    except OSError:  # gone, or no longer a directory
                        continue
                    stack.append((f"{rel}/{name}", sub, None))
                else:
                    os.close(fd)
                    stack.pop()
            self.known = done  # complete: forget directories that are gone
            return True
        finally:
            self.entries = seen
            for _, fd, _ in stack:
                os.close(fd)
            if stack:
                self.known.update(done)  # cut short: keep what was finished


def remove(path: str, deadline: float) -> bool:
    """rm -rf path without following links, until the deadline; True when it is gone. Directories a
    command made read-only are opened up first (a non-root supervisor has no override)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return True
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        if not _empty(fd, deadline, [0]):
            return False
    finally:
        os.close(fd)
    os.rmdir(path)
    return True


def _empty(fd: int, deadline: float, count: list[int]) -> bool:
    """Empty the directory open at fd (left open), until the deadline: files are unlinked as each
    directory is listed, directories removed on the way back up (one that could not be opened stays,
    for rmdir's caller to see). False when cut short, or when a directory moved out from under us."""
    def listing(d: int):
        names = _opened_up_listing(d, count, deadline)
        return None if names is None else [(name, None) for name in names]

    def enter(name: str, _ident, parent: int):
        try:
            return open_subdir(name, parent)
        except OSError:
            return None  # gone, or no longer a directory

    def leave(parent: int, name: str, _fd: int, _mode) -> None:
        try:
            os.rmdir(name, dir_fd=parent)
        except OSError:
            pass  # not empty: a subdirectory that could not be opened

    try:
        return walk(fd, listing, enter, leave)
    except Moved:
        return False  # never follow it out of the tree: the background remover tries again


class Moved(Exception):
    """The directory a walk is in is no longer under the one it came from."""


def walk(root: int, listing, enter, leave) -> bool:
    """Depth first under the directory open at root (left open), with one more fd at a time: a
    subdirectory is entered by name and left by "..", which must be the directory it was entered from
    (Moved otherwise), so a tree of any depth (a command can nest thousands) needs no recursion, no fd
    a level and no path (none longer than PATH_MAX). listing(fd) does a directory's own work and gives
    its subdirectories as [(name, (dev, ino) as listed or None)], or None to stop (False is returned);
    enter(name, ident, parent_fd) opens one, (fd, state) or None to pass it over; leave(parent_fd,
    name, fd, state) runs on the way back up, before fd is closed. True when the whole tree was done."""
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
            up = os.open("..", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=cur)
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


def dir_ident(fd: int) -> tuple[int, int]:
    """(st_dev, st_ino) of an open directory: which directory it is, whatever its name now."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _opened_up_listing(fd: int, count: list[int], deadline: float) -> list[str] | None:
    """Give the directory u+rwx, unlink its files; its subdirectories' names (None: past the deadline)."""
    try:
        os.fchmod(fd, 0o700)
    except OSError:
        pass
    entries = []
    with os.scandir(fd) as it:
        for e in it:  # a directory of millions of files takes a while to list alone
            if len(entries) % _CHECK_EVERY == _CHECK_EVERY - 1 and time.monotonic() > deadline:
                return None
            entries.append((e.name, e.is_dir(follow_symlinks=False)))
    subdirs = []
    for name, is_dir in entries:
        count[0] += 1
        if count[0] % _CHECK_EVERY == 0 and time.monotonic() > deadline:
            return None
        if is_dir:
            subdirs.append(name)
        else:
            _quietly(os.unlink, name, dir_fd=fd)
    return subdirs


class Replaced(Exception):
    """The directory at a name is not the one expected (a command replaced it since it was listed)."""


def open_subdir(name: str, dir_fd: int, expect: tuple[int, int] | None = None) -> tuple[int, int | None]:
    """(fd, mode it had or None) of the subdirectory `name` of dir_fd, no link followed; Replaced when
    expect (its dir_ident as listed) does not match, checked before anything is changed. One its command
    closed to everyone (mode 000), which a non-root supervisor may not read, is given u+rwx first,
    through an O_PATH handle on it (PermissionError when it is not ours); the caller may give the mode back."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
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


def _quietly(func, *args, **kw) -> None:
    try:
        func(*args, **kw)
    except FileNotFoundError:
        pass


_LEFT: "queue.Queue[str]" = queue.Queue()
_REMOVER: threading.Thread | None = None
_REMOVER_LOCK = threading.Lock()


def remove_later(path: str) -> None:
    """Finish removing path in the background (one thread for the whole process)."""
    global _REMOVER
    with _REMOVER_LOCK:
        if _REMOVER is None:
            _REMOVER = threading.Thread(target=_remove_loop, name="nano-openshell-remove", daemon=True)
            _REMOVER.start()
            atexit.register(finish)
    _LEFT.put(path)


def _remove_loop() -> None:
    while True:
        path = _LEFT.get()
        try:
            remove(path, float("inf"))
        except OSError:
            pass
        finally:
            _LEFT.task_done()


def finish(timeout: float = _EXIT_WAIT) -> None:
    """Wait, up to timeout, until the background removals are done."""
    end = time.monotonic() + timeout
    while _LEFT.unfinished_tasks and time.monotonic() < end:
        time.sleep(0.05)


def pending() -> int:
    """Directories still being removed in the background."""
    return _LEFT.unfinished_tasks


def rmtree(path: str) -> None:
    """rm -rf path now, through whatever read-only, closed or deeply nested directories a command left."""
    try:
        remove(path, float("inf"))
    except OSError:
        pass
