"""pid 1 of a namespaced Sandbox, in Python, where no C compiler works: nsinit.c's job and protocol
(its header says both). Started as `python3 -I -S -c <init_build.PYTHON_BOOT> FD` inside bwrap: the
sandbox may not see this package, so this file comes on stdin, and it imports only modules built
into the interpreter (its start is Python's own start-up and nothing more).
"""

import _signal
import _socket
import posix as os  # not os: importing os (and _collections_abc) is ~1.5 ms of every start
import select
import time

# a command starts with every signal at its default and none blocked, as from a normal shell: not
# only those the init changed (Python ignores SIGPIPE and SIGXFSZ) but any the supervisor ignored,
# which fork and exec pass down. glibc's own two signals (32, 33) are not ours to name.
_SIGNALS_RESET = tuple(sorted(set(_signal.valid_signals()) - {_signal.SIGKILL, _signal.SIGSTOP}))
_MAX_MESSAGE = 1 << 20   # argv + env of one command; larger scripts come as a file descriptor
_REMOVE_BUDGET = 0.2     # seconds spent removing finished commands' TMPDIRs at a time
_MAX_REMOVE_DEPTH = 64


class _Command:
    __slots__ = ("id", "status_fd", "tmp", "killed")

    def __init__(self, cid, status_fd, tmp):
        self.id, self.status_fd, self.tmp, self.killed = cid, status_fd, tmp, False


class Init:
    def __init__(self, ctl_fd: int):
        os.set_inheritable(ctl_fd, False)
        self.ctl = _socket.socket(fileno=ctl_fd)
        self.running = {}   # pid of a command's main process -> _Command
        self.by_id = {}
        self.devnull = os.open("/dev/null", os.O_RDWR)
        self.wake_r, wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(wake_w, False)
        _signal.signal(_signal.SIGCHLD, lambda *_: None)
        _signal.set_wakeup_fd(wake_w)

    def serve(self) -> None:
        poller = select.poll()
        poller.register(self.ctl.fileno(), select.POLLIN)
        poller.register(self.wake_r, select.POLLIN)
        while True:
            for fd, _ in poller.poll():
                if fd == self.wake_r:
                    _quiet(os.read, self.wake_r, 1 << 16)  # a byte per signal; any left wakes the poll again
                    self.settle()
                else:
                    self.receive()

    def receive(self) -> None:
        """Handle every message waiting (one wakeup may bring several)."""
        flags = _socket.MSG_CMSG_CLOEXEC
        while True:
            try:
                data, anc, _, _ = self.ctl.recvmsg(_MAX_MESSAGE, _socket.CMSG_SPACE(8 * 4), flags)
            except (BlockingIOError, InterruptedError):
                return
            self.handle(data, anc)
            flags |= _socket.MSG_DONTWAIT

    def handle(self, data: bytes, anc: list) -> None:
        if not data:
            os._exit(0)  # the supervisor is gone: pid 1 exits, the kernel kills the rest
        fds = []
        for level, kind, payload in anc:
            if level == _socket.SOL_SOCKET and kind == _socket.SCM_RIGHTS:
                fds += [int.from_bytes(payload[i:i + 4], "little", signed=True)
                        for i in range(0, len(payload) - len(payload) % 4, 4)]
        try:
            kind = data[:1]
            if kind == b"k":
                self.kill(int.from_bytes(data[1:9], "little"))
            elif kind == b"r":
                self.run(data, fds)
            elif kind == b"p":
                _quiet(os.write, fds[0], b"R\n")
            else:
                raise ValueError("an unknown message")
        except Exception as e:  # a message cut short (its fds could not all be received): that command fails
            if fds:
                _quiet(os.write, fds[0], b"E%s\n" % repr(e).encode(errors="replace"))
        finally:
            for fd in fds:
                _quiet(os.close, fd)

    def run(self, data: bytes, fds) -> None:
        cid, argc, envc = (int.from_bytes(data[i:j], "little") for i, j in ((1, 9), (9, 13), (13, 17)))
        strings = data[17:].split(b"\0")
        if argc < 1 or len(fds) < 3 or len(strings) != argc + envc + 1 or strings[-1]:
            raise ValueError("a malformed run message")
        argv = strings[:argc]
        env = dict(s.split(b"=", 1) for s in strings[argc:argc + envc])
        status_fd = os.dup(fds[0])
        tmp = _fresh_dir(cid)
        env[b"TMPDIR"] = (tmp or "/tmp").encode()
        actions = [(os.POSIX_SPAWN_DUP2, self.devnull, 0), (os.POSIX_SPAWN_DUP2, fds[1], 1),
                   (os.POSIX_SPAWN_DUP2, fds[2], 2)]
        if len(fds) > 3:  # a large script, in a memfd: bash reads it as /dev/fd/3
            actions.append((os.POSIX_SPAWN_DUP2, fds[3], 3))
        try:
            pid = os.posix_spawn(argv[0], argv, env, setsid=True, setsigdef=_SIGNALS_RESET, setsigmask=(),
                                 file_actions=actions)
        except Exception as e:  # this command cannot start; the init and the others go on
            _quiet(os.write, status_fd, b"E%s\n" % repr(e).encode(errors="replace"))
            os.close(status_fd)
            if tmp is not None:
                _remove_tree(tmp, time.monotonic() + _REMOVE_BUDGET)
            return
        self.running[pid] = _Command(cid, status_fd, tmp)
        self.by_id[cid] = pid

    def kill(self, cid) -> None:
        pid = self.by_id.get(cid)
        if pid is None:
            return  # already reported
        self.running[pid].killed = True
        if len(self.running) == 1:
            _kill_all()
        else:
            for victim in _tree(_processes(), {pid}):
                _quiet(os.kill, victim, 9)

    def settle(self) -> None:
        """Reap; once a command's main process exited, kill what no running command owns, then report
        the command. Orphans that exit on their own only need reaping."""
        done, others = self.reap()
        if not done:
            return
        while self.running and others:  # others still run: kill every process outside their trees
            extra = _children()
            if extra is not None and extra <= set(self.running):
                break  # every child of ours is a running command: no orphan anywhere
            procs = _processes()
            keep = _tree(procs, set(self.running))
            victims = [pid for pid, (_, state) in procs.items() if pid not in keep and state != "Z"]
            if not victims:
                break
            for victim in victims:
                _quiet(os.kill, victim, 9)
            time.sleep(0.0005)  # let the kills land before looking again
            more, others = self.reap()
            done += more
        if not self.running and others:  # nothing runs: everything but us goes (none left: nothing to do)
            _kill_all()
            while True:  # and is reaped
                try:
                    os.waitpid(-1, 0)
                except ChildProcessError:
                    break
        for cmd, status in done:
            _quiet(os.write, cmd.status_fd, b"X%d\n" % _exit_code(cmd, status))
            os.close(cmd.status_fd)
        # after the reports: a TMPDIR full of files must not delay its command's result; what is not
        # gone within the budget stays in /tmp (the Sandbox's own) until the Sandbox closes
        deadline = time.monotonic() + _REMOVE_BUDGET
        for cmd, _ in done:
            if cmd.tmp is not None:
                _remove_tree(cmd.tmp, deadline)

    def reap(self) -> tuple[list, bool]:
        """Reap every exited child: (commands whose main process it was, whether a child is left). Each is
        told at once that it ended, before what it left is killed (a deadline passing then is not its own)."""
        done = []
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return done, False
            if pid == 0:
                return done, True
            cmd = self.running.pop(pid, None)
            if cmd is not None:
                del self.by_id[cmd.id]
                _quiet(os.write, cmd.status_fd, b"D%d %d\n" % (_exit_code(cmd, status), time.monotonic_ns()))
                done.append((cmd, status))


def _exit_code(cmd: _Command, status: int) -> int:
    if cmd.killed:
        return -9
    if os.WIFSIGNALED(status):  # as bash reports a signal death, in every tier
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def _quiet(func, *args, **kw) -> None:
    """func(...), an OSError ignored: a file gone, a process dead, a supervisor gone from a status pipe."""
    try:
        func(*args, **kw)
    except OSError:
        pass


_TMP_PREFIX = "/tmp/.command-%s-" % os.urandom(4).hex()


def _fresh_dir(cid) -> str | None:
    """A new private TMPDIR in /tmp for one command; None (it gets /tmp itself) when /tmp is full."""
    for attempt in range(3):  # a name another command made first is passed over
        path = _TMP_PREFIX + str(cid) + ("-" + os.urandom(4).hex() if attempt else "")
        try:
            os.mkdir(path, 0o700)
            return path
        except FileExistsError:
            continue
        except OSError:
            return None
    return None


def _kill_all() -> None:  # as pid 1: a process forking meanwhile is listed or fails the fork (SIGKILL pending)
    _quiet(os.kill, -1, 9)


def _children() -> set | None:
    """Our direct children (every process not under one of them is dead), or None if unknown."""
    try:
        with open("/proc/1/task/1/children", "rb") as f:
            return {int(p) for p in f.read().split()}
    except OSError:
        return None


def _processes() -> dict:
    """pid -> (ppid, state) of every process of the namespace but us (its own /proc)."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and name != "1":
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()  # comm may hold spaces and ')'
            except OSError:
                continue
            out[int(name)] = (int(fields[1]), fields[0].decode())
    return out


def _tree(procs: dict, roots: set) -> set:
    children = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out, stack = set(), list(roots)
    while stack:
        pid = stack.pop()
        if pid not in out:
            out.add(pid)
            stack += children.get(pid, ())
    return out


def _remove_tree(path: str, deadline: float, dir_fd=None, depth: int = 0) -> None:
    """rm -rf without following links (the command owned it: links, 0500 dirs), until the deadline;
    what is deeper than _MAX_REMOVE_DEPTH stays in /tmp until the Sandbox closes."""
    try:
        os.rmdir(path, dir_fd=dir_fd)  # the usual case: the command left nothing there
        return
    except FileNotFoundError:
        return
    except OSError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError:
        return _quiet(os.unlink, path, dir_fd=dir_fd)
    try:
        _quiet(os.fchmod, fd, 0o700)
        for entry in os.scandir(fd):
            if time.monotonic() > deadline:
                return
            if not entry.is_dir(follow_symlinks=False):
                _quiet(os.unlink, entry.name, dir_fd=fd)
            elif depth < _MAX_REMOVE_DEPTH:
                _remove_tree(entry.name, deadline, fd, depth + 1)
    finally:
        os.close(fd)
    _quiet(os.rmdir, path, dir_fd=dir_fd)


if __name__ == "__main__":  # init_build.PYTHON_BOOT runs this file's code as __main__
    import sys

    Init(int(sys.argv[1])).serve()
