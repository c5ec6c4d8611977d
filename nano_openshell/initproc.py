"""The fallback tier's per-command init: `python -I -S`, its config marshalled on stdin (fallback.py).

A child subreaper in a new session: every process the command starts, setsid and double-forked
escapees included, is reparented to it. When the command exits, or on SIGTERM (the supervisor died:
PDEATHSIG), it kills its whole tree and exits with the command's status, first telling the
supervisor when the command ended (a deadline passing during the kill is not the command's). The
command runs with rlimits, as root under the sandbox's uid, no_new_privs, Landlock and the seccomp
filter without sockets; the init stays outside them, where the command can neither signal it nor
read its /proc entries.
"""

import marshal
import os
import resource
import select
import signal
import sys
import time

from . import landlock, seccomp
from .seccomp import PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS, PR_SET_PDEATHSIG, prctl


class _Stop(Exception):
    pass


_CHILDREN_FILES = os.path.exists("/proc/thread-self/children")  # CONFIG_PROC_CHILDREN


def _children_now(pid: int) -> list[int]:
    """pid's children, from /proc/PID/task/*/children: a few short reads, no pass over /proc."""
    out = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out += map(int, f.read().split())
        except OSError:
            pass
    return out


def _scanned_children(root: int):
    """pid -> its children, from one pass over /proc (a kernel without children files). Newest first, each
    child of root killed once read: the newest link of a chain forking faster than the pass goes first."""
    out = {}
    for pid in sorted((int(name) for name in os.listdir("/proc") if name.isdigit()), reverse=True):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                ppid = int(f.read().rsplit(b")", 1)[1].split()[1])  # after comm, which may hold ")"
        except OSError:
            continue
        if ppid == root:
            _kill(pid, (root,))
        out.setdefault(ppid, []).append(pid)
    return lambda pid: out.get(pid, [])


def _kill(pid: int, parents: tuple[int, ...]) -> bool:
    """SIGKILL pid if it is still the child of one of parents, through a pidfd opened before that check
    (a pid reaped and reused meanwhile is never signalled). True while it has not exited (a process
    whose main thread ended looks like a zombie in /proc, and is not one)."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            if int(f.read().rsplit(b")", 1)[1].split()[1]) not in parents:
                return False
        signal.pidfd_send_signal(fd, signal.SIGKILL)
        poller = select.poll()
        poller.register(fd, select.POLLIN)  # readable once the whole process has exited
        return not poller.poll(0)
    except OSError:
        return False
    finally:
        os.close(fd)


def kill_descendants(root: int) -> None:
    """SIGKILL root's whole tree, even one that forks faster than /proc can be read (docs/design.md).
    root must not reap meanwhile: its children, pids nobody can reuse, only accumulate, orphans included.
    Each process is killed before its children are read: with SIGKILL pending it cannot fork, so that
    list is final (and the children of one that dies after it go to root). It ends when two rounds in a
    row find the same children of root, all exited."""
    settled = None  # root's children, when the last round found every one exited
    exited = set()  # root's children that have exited: they stay so, as root reaps none
    signalled = set()
    while True:
        children_of = _children_now if _CHILDREN_FILES else _scanned_children(root)
        children = set(children_of(root))
        todo = [(pid, root) for pid in children - exited]
        walked, alive, fresh_kill = set(children), False, False
        while todo:
            pid, parent = todo.pop()
            if _kill(pid, (parent, root)):  # root too: orphaned since its parent's list was read
                alive, fresh_kill = True, fresh_kill or pid not in signalled
                signalled.add(pid)
            elif parent == root:
                exited.add(pid)
            elif _CHILDREN_FILES:  # it has exited (no children), or its pid may be another's by now
                continue
            # (from a scan, one that has exited is walked on: the children seen then are root's now)
            fresh = set(children_of(pid)) - walked
            walked |= fresh
            todo += [(child, pid) for child in fresh]
        if alive:
            settled = None
            if not fresh_kill:  # only processes killed already, still exiting: give them the CPU
                time.sleep(0.001)
        elif children == settled:
            return
        else:
            settled = children


def kill_tree() -> None:
    """In the init: kill every descendant, then reap them all (all exited by then: no wait hangs)."""
    kill_descendants(os.getpid())
    while True:
        try:
            os.waitpid(-1, 0)  # an orphan of a killed process is already ours, and already killed
        except ChildProcessError:
            return


def _exec_command(cfg: dict) -> None:
    """In the forked child: drop everything, then exec bash. Never returns."""
    try:
        # every signal at its default and none blocked, as from a normal shell: not only those the
        # init changed (Python ignores SIGPIPE and SIGXFSZ) but any the supervisor ignored
        for sig in signal.valid_signals() - {signal.SIGKILL, signal.SIGSTOP}:
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        for name, value in cfg["rlimits"].items():
            resource.setrlimit(getattr(resource, name), (value, value))
        os.chdir(cfg["workspace"])
        if cfg.get("uid") is not None:
            os.setgroups([])
            os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
            os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
        prctl(PR_SET_NO_NEW_PRIVS, 1)  # Landlock and seccomp both require it
        if cfg["landlock"]:
            landlock.restrict(rw=[cfg["workspace"], cfg["tmpdir"]])
        if cfg["seccomp"]:
            seccomp.install(bytes.fromhex(cfg["seccomp"]))
        os.execve("/bin/bash", cfg["argv"], cfg["env"])
    except BaseException as e:  # report, never run the command half-isolated
        os.write(2, f"nano-openshell: sandbox setup failed: {e!r}\n".encode())
    os._exit(126)


def _stop(signum, frame):
    raise _Stop()


def main() -> None:
    cfg = marshal.loads(sys.stdin.buffer.read())  # from our supervisor; marshal is built in (json costs re)
    fd = os.open("/dev/null", os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _stop)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    os.set_inheritable(cfg["ended_fd"], False)
    status = None
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != cfg["supervisor_pid"]:  # the supervisor died before PDEATHSIG was armed
            raise _Stop()
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        pid = os.fork()
        if pid == 0:
            _exec_command(cfg)
        while status is None:
            wpid, st = os.waitpid(-1, 0)
            if wpid == pid:
                status = st
    except _Stop:
        pass
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # finish the kill even if asked twice
    if status is None:  # stopped: report it the way a killed process is reported
        kill_tree()
        os.kill(os.getpid(), signal.SIGKILL)
    # 128+N for a signal, as bash and bwrap's pid 1 report it, in every tier
    code = 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
    try:  # told before the kill: if the deadline comes meanwhile, the command still ended in time
        os.write(cfg["ended_fd"], f"{code} {time.monotonic()}".encode())
    except OSError:
        pass
    kill_tree()
    os._exit(code)

