"""The disk a sandbox's files take, and the check that kills a command taking it past Limits.disk_bytes.

docs/design.md (Disk) says what is counted, how Meter's passes keep the total up to date in a thread
of their own (no walk holds a deadline up), and what gets through.
"""
from __future__ import annotations

import errno
import math
import os
import stat
import threading
import time

from .workspace import CHECK_EVERY, FRESH_NS, Moved, Replaced, dir_ident, open_subdir, walk

MIN_ENTRY_BYTES = 4096  # an entry costs at least an inode and a block
FIRST_CHECK_S = 0.05    # commands shorter than this are measured once, at their end
MIN_INTERVAL_S = 0.02   # between two passes, and between two looks of the drain at the total
SETTLE_S = 0.1          # the pass at a command's end may run this long past its deadline
WALK_SHARE = 0.1        # this share of the time goes into passes (more near the limit), as much into refreshes
WATCH_S = 2.0           # a file seen growing is looked at on every pass until it stops for this long
MAX_MOVES = 3           # passes in a row cut short by moving directories before the check gives up
FREEZE_WAIT_S = 0.1     # how long freezing a command's cgroup may take before the pass goes on without it
FREEZE_FROM = 0.8       # share of what is allowed past which every pass after growth is frozen


def usage(roots: list[str]) -> int:
    """Bytes the trees under roots take, measured once in full (OSError when directories keep moving)."""
    meter = Meter()
    meter.settle(roots)
    return meter.total


class _Dir:  # what the Meter remembers of one directory
    __slots__ = ("mtime", "entries", "subdirs", "watch", "total", "refreshed", "own")

    def __init__(self):
        self.mtime = None            # st_mtime_ns when it was last listed in full; None: list it again
        self.entries = {}            # name -> (inode, bytes counted)
        self.subdirs = {}            # name -> (st_dev, st_ino) of those that are directories
        self.watch = {}              # name -> until when it is looked at again on every pass
        self.total = 0               # bytes its entries count
        self.refreshed = -math.inf   # when all of its entries were last looked at
        self.own = 0                 # the directory's own blocks, from its fstat at every visit


class Meter:
    """The bytes a Sandbox's directories take (total), kept up to date pass after pass, one walker at a
    time (lock). A root that comes and goes (the fallback tier's TMPDIR) is forgotten when it goes."""

    def __init__(self):
        self.lock = threading.Lock()
        self.total = 0
        self._trees: dict[str, dict[tuple[int, int], _Dir]] = {}  # root -> directory (dev, ino) -> _Dir
        self._visited: set[tuple[int, int]] = set()               # this pass's directories, of one root
        self._cut = False                                         # this pass was told to stop
        self._cycle = None             # when the refresh cycle under way began (None: none is)
        self._cycle_cost = 0.0         # the time its passes took
        self._next_cycle = -math.inf   # when the next one is due
        self.pass_cost = 0.0           # what the last pass outside a refresh cycle took
        self.moves = 0                 # passes in a row cut short by a directory moving under them
        self._root = None              # (dev, ino) of the root being walked

    def settle(self, roots: list[str]) -> None:  # until one whole refresh pass is done (no deadline)
        self._next_cycle = -math.inf
        while not (self.measure(roots, lambda: False) and self._cycle is None):
            self.check_moves()

    def check_moves(self) -> None:
        """OSError after MAX_MOVES passes cut short by moving directories: their moves would hide the rest."""
        if self.moves >= MAX_MOVES:
            raise OSError(errno.ESTALE, "the sandbox's directories kept moving while they were measured")

    def forget(self, root: str) -> None:
        self.total -= sum(d.total for d in self._trees.pop(root, {}).values())

    def measure(self, roots: list[str], stop) -> bool:
        """One pass over roots; False when stop() said to stop first, or a directory moved under it
        (what it did see is kept). A refresh cycle begins when one is due and ends with a whole pass."""
        started = time.monotonic()
        if self._cycle is None and started >= self._next_cycle:
            self._cycle, self._cycle_cost = started, 0.0
        cycle = self._cycle
        try:
            complete = all(self._measure_root(root, stop) for root in roots)  # up to the first one cut short
        except Moved:  # a directory moved to another parent while we were in it: what was seen is kept
            complete = False
            self.moves += 1
        else:
            self.moves = 0 if complete else self.moves
        if cycle is None:
            self.pass_cost = time.monotonic() - started
        else:
            self._cycle_cost += time.monotonic() - started
            if complete:
                self._cycle = None
                self._next_cycle = time.monotonic() + max(MIN_INTERVAL_S, self._cycle_cost / WALK_SHARE)
        return complete

    def _measure_root(self, root: str, stop) -> bool:
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            self.forget(root)
            return True
        dirs = self._trees.setdefault(root, {})
        self._visited, self._cut, self._root = set(), False, dir_ident(fd)
        try:
            walk(fd, lambda d: self._visit(dirs, d, stop), self._enter, _leave)
        finally:
            os.close(fd)
        if self._cut:
            return False
        for ident in [i for i in dirs if i not in self._visited]:  # gone, or no longer reachable
            self.total -= dirs.pop(ident).total
        return True

    def _visit(self, dirs: dict, fd: int, stop) -> list:
        """The walk's listing: this directory brought up to date; its subdirectories. Stopping, none:
        the walk goes back up to the root, and each directory opened up for it gets its mode back."""
        if self._cut or stop():
            self._cut = True
            return []
        fresh_after = time.time_ns() - FRESH_NS
        st = os.fstat(fd)
        ident = (st.st_dev, st.st_ino)
        self._visited.add(ident)
        d = dirs.get(ident)
        if d is None:
            d = dirs[ident] = _Dir()
        # A directory's own blocks grow with its entries while its parent, whose mtime does not
        # change, is not listed again: so they are counted here, from every visit's fstat.
        own = 0 if ident == self._root else _bytes(st)  # (a root is the caller's, as before)
        d.total += own - d.own
        self.total += own - d.own
        d.own = own
        refresh = self._cycle is not None and d.refreshed < self._cycle
        if refresh or d.mtime != st.st_mtime_ns:
            if not self._list(dirs, d, fd, refresh, stop):
                d.mtime, self._cut = None, True
                return []
            d.mtime = st.st_mtime_ns if st.st_mtime_ns < fresh_after else None
        else:  # the same entries as last time: only those being watched are looked at
            now = time.monotonic()
            for i, name in enumerate(list(d.watch)):  # every new empty file is watched: any number of them
                if i % CHECK_EVERY == CHECK_EVERY - 1 and stop():
                    self._cut = True  # the rest stay watched for the next pass
                    return []
                try:
                    st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                except FileNotFoundError:
                    d.mtime = None  # removed since the fstat: the next pass lists the directory
                    continue
                self._look(dirs, d, name, st, d.entries[name][0], now)
        return list(d.subdirs.items())

    def _list(self, dirs: dict, d: _Dir, fd: int, refresh: bool, stop) -> bool:
        """List the directory again: new entries (and, refreshing, all) looked at, gone ones dropped."""
        now = time.monotonic()
        listed = set()
        with os.scandir(fd) as it:
            for entry in it:
                if len(listed) % CHECK_EVERY == CHECK_EVERY - 1 and stop():
                    return False
                name = entry.name
                listed.add(name)
                known = d.entries.get(name)
                if known is not None and known[0] == entry.inode() and not refresh and name not in d.watch:
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)  # fstatat on the listed directory's fd
                except FileNotFoundError:
                    listed.discard(name)
                    continue
                self._look(dirs, d, name, st, entry.inode(), now)
        for name in [n for n in d.entries if n not in listed]:
            self._drop(dirs, d, name)
        if refresh:
            d.refreshed = now
        return True

    def _look(self, dirs: dict, d: _Dir, name: str, st: os.stat_result, ino: int, now: float) -> None:
        """Count what the entry takes now, and decide whether to look at it again on the next pass.
        ino: the inode its directory lists (overlayfs may list another number than stat says)."""
        is_dir = stat.S_ISDIR(st.st_mode)
        counted = 0 if is_dir else _bytes(st)  # a directory counts its own blocks when visited (_visit)
        known = d.entries.get(name)
        if known is None or known[0] != ino:  # new under this name
            self._prune(dirs, d.subdirs.pop(name, None))
            if is_dir:
                d.subdirs[name] = (st.st_dev, st.st_ino)
            elif st.st_size == 0 or counted > MIN_ENTRY_BYTES:  # once more on the next pass: it may be
                d.watch[name] = now                              # being written (one block counts as much)
            known = (ino, 0)
        elif counted > known[1] and not is_dir:
            d.watch[name] = now + WATCH_S
        elif d.watch.get(name, math.inf) <= now:
            del d.watch[name]
        d.entries[name] = (ino, counted)
        d.total += counted - known[1]
        self.total += counted - known[1]

    def _drop(self, dirs: dict, d: _Dir, name: str) -> None:
        _, counted = d.entries.pop(name)
        d.total -= counted
        self.total -= counted
        d.watch.pop(name, None)
        self._prune(dirs, d.subdirs.pop(name, None))

    def _prune(self, dirs: dict, ident) -> None:
        """Forget a directory gone from its name, and what is below it, now, unless this pass saw it elsewhere."""
        stack = [] if ident is None else [ident]
        while stack:
            ident = stack.pop()
            if ident in self._visited or ident not in dirs:
                continue
            gone = dirs.pop(ident)
            self.total -= gone.total
            stack.extend(gone.subdirs.values())

    def _enter(self, name: str, ident, parent: int):
        """The walk's enter: the subdirectory listed as ident, opened (None: passed over)."""
        if self._cut:
            return None  # on the way back up: the directories left are not entered
        try:
            return open_subdir(name, parent, expect=ident)
        except (FileNotFoundError, NotADirectoryError, PermissionError, Replaced):
            return None  # gone, replaced since it was listed, or not ours
        except OSError as e:
            if e.errno == errno.ELOOP:  # a link now, where the listing had a directory
                return None
            raise


def _bytes(st: os.stat_result) -> int:
    held = st.st_blocks * 512
    if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
        held //= st.st_nlink  # a hard-linked inode counts once over all its links, wherever they are listed
    return max(held, MIN_ENTRY_BYTES)


def _leave(_parent: int, _name: str, d: int, mode) -> None:
    if mode is not None:  # opened up for the walk: its mode back
        os.fchmod(d, mode)


def freeze_next_pass(total: int, allowed: int, rate: float, cost: float) -> bool:
    """Whether the next pass runs with the command frozen: where the files, growing at rate (bytes a
    second) while a pass takes cost seconds, could cross what is allowed before the pass after it; and,
    since rate and cost are a prediction a load spike can beat, past FREEZE_FROM of what is allowed
    whenever the files grew at all."""
    return total + 2 * rate * (2 * cost + MIN_INTERVAL_S) > allowed or (rate > 0 and total > FREEZE_FROM * allowed)


class DiskCheck:
    """One command's check, on the Sandbox's Meter: drain() calls over() while the command runs, finish()
    at its end. The first over() at FIRST_CHECK_S starts the thread that runs the passes. Allowed is the
    limit, or what the files took when the command started if that was more."""

    def __init__(self, meter: Meter, roots: list[str], limit: int, leaf=None):
        self.meter, self.roots, self.limit = meter, roots, limit
        self.allowed = max(limit, meter.total)
        self.killed = False
        self._start_at = time.monotonic() + FIRST_CHECK_S
        self._stop = threading.Event()
        self._thread = None
        self._failed = None  # why the files cannot be measured: as good as over
        self._leaf = leaf if leaf is not None and leaf.can_freeze() else None  # the command's cgroup
        self._freeze_lock = threading.Lock()  # stop() thaws: no freeze may follow it
        self._frozen = False

    def over(self, now: float) -> str | None:
        if self._thread is None and now >= self._start_at:
            self._thread = threading.Thread(target=self._watch, name="nano-openshell-disk", daemon=True)
            self._thread.start()
        if self._failed is None and self.meter.total <= self.allowed:
            return None
        self.killed = True
        why = self._failed or f"the sandbox's files take {self.meter.total} bytes on disk"
        return f"nano-openshell: killed: {why}, over Limits.disk_bytes={self.limit}\n"

    def _watch(self) -> None:
        last_end, last_total = time.monotonic(), self.meter.total
        rate, cost = 0.0, 0.0  # bytes a second the files grew by while the command ran; a plain pass's seconds
        while not self._stop.is_set():
            with self.meter.lock:
                try:
                    began = time.monotonic()
                    # What a writer adds while a plain pass lags behind it lands on disk past the count (and
                    # past the limit, at the kill). So where the next pass could cross the limit, the
                    # command's processes are frozen for it, if they have a cgroup: the count is what is there.
                    frozen = freeze_next_pass(self.meter.total, self.allowed, rate, cost) and self._freeze()
                    while not self.meter.measure(self.roots, self._stop.is_set) and frozen and not self._stop.is_set():
                        self.meter.check_moves()  # frozen: until one whole pass
                    self.meter.check_moves()
                    if not frozen and self.meter.total > self.allowed:
                        self._freeze()  # now, not at the drain's next look: it writes no more until the kill
                    now = time.monotonic()
                    cost = cost if frozen else now - began
                    rate = max(0, self.meter.total - last_total) / max(1e-3, (began if frozen else now) - last_end)
                    last_end, last_total = now, self.meter.total
                except Exception as e:  # EACCES on a directory that is not ours, EMFILE...: no check, so killed
                    self._failed = f"the sandbox's files cannot be measured ({getattr(e, 'strerror', None) or e})"
                    return
                finally:  # over the limit a frozen command stays so until its kill (stop() thaws it then)
                    if self.meter.total <= self.allowed and self._failed is None:
                        self._thaw()
            # ten times what a pass takes, less as the files near what is allowed (back to back there)
            free = max(0.0, 1.0 - self.meter.total / self.allowed)
            self._stop.wait(max(MIN_INTERVAL_S, self.meter.pass_cost / WALK_SHARE * free))

    def _freeze(self) -> bool:
        with self._freeze_lock:
            if self._leaf is None or self._stop.is_set():
                return False
            self._frozen = True
            if not self._leaf.freeze(FREEZE_WAIT_S):  # a process that would not stop in time: a plain pass
                self._leaf.thaw()
                self._frozen = False
            return self._frozen

    def _thaw(self) -> None:
        with self._freeze_lock:
            if self._frozen:
                self._leaf.thaw()
                self._frozen = False

    def stop(self) -> None:  # within CHECK_EVERY entries; the thread is not waited for; a frozen command thawed
        self._stop.set()
        self._thaw()

    def finish(self, deadline: float) -> str | None:
        """At the command's end (by the deadline, or SETTLE_S from now if later) one more pass, so that the
        next command starts from what is there; a line for its stderr when the files are over the limit."""
        deadline = max(deadline, time.monotonic() + SETTLE_S)
        self.stop()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
        if self.meter.lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            try:
                while not self.meter.measure(self.roots, lambda: time.monotonic() > deadline):
                    if time.monotonic() > deadline:
                        break
            except OSError:
                pass  # the next command's passes say so
            finally:
                self.meter.lock.release()
        if self.killed or self._failed is not None or self.meter.total <= self.limit:
            return None
        return (f"nano-openshell: the sandbox's files take {self.meter.total} bytes on disk, over Limits.disk_bytes="
                f"{self.limit}: a command that adds to them is killed\n")
