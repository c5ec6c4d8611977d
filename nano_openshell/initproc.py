"""The fallback tier's per-command init (runs as `python -I -S`, config as JSON on stdin), and the
supervisor's handle on it (Init, at the end).

It is a child subreaper in a new session: every process the command starts, including setsid and
double-forked escapees, is reparented to it when its parent dies. When the command exits, or on
SIGTERM (sent by the kernel as PDEATHSIG when the supervisor dies), it SIGKILLs its whole tree, scan
after scan of /proc, until a scan finds nothing alive it has not killed, then exits with the
command's status. At the timeout or at close() the supervisor kills the tree itself: by cgroup.kill
when the Sandbox has a cgroup (cgroup.py), else by the same scan, with the init frozen meanwhile.
The command itself runs with rlimits, under another uid when we are root, with no_new_privs,
Landlock (workspace and private tmp writable, the rest read-only, /proc hidden but for a few
system-wide files, no TCP, signals scoped) and the seccomp filter without sockets. The init stays
outside the Landlock domain and, as root, under another uid: the command can neither signal it nor
read its /proc entries.
"""

import ctypes
import json
import os
import resource
import signal
import sys

from nano_openshell import landlock, seccomp

_PR_SET_PDEATHSIG, _PR_SET_CHILD_SUBREAPER, _PR_SET_NO_NEW_PRIVS = 1, 36, 38


class _Stop(Exception):
    pass


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option})")


def _scan() -> dict[int, tuple[int, bytes, int]]:
    """pid -> (ppid, state, start time) of every process, from one pass over /proc."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat.rsplit(b")", 1)[1].split()  # after comm, which may hold spaces and parentheses
        out[int(name)] = (int(fields[1]), fields[0], int(fields[19]))  # fields 4, 3 and 22 of stat
    return out


def descendants(root: int) -> dict[int, int]:
    """{pid: start time} of every live (not zombie) process whose parent chain reaches root."""
    procs = _scan()
    children = {}
    for pid, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            _, state, start = procs[child]
            if state not in (b"Z", b"X"):
                out[child] = start
            todo.append(child)
    return out


def kill_descendants(root: int) -> None:
    """SIGKILL root's whole tree, one scan of /proc after another, until a scan finds no live
    descendant that was not killed already: once SIGKILL is pending a process cannot fork, so
    nothing new can appear after that. The whole tree goes in each pass (not level by level: a
    200-deep fork chain costs one pass, not 200). Each kill goes through a pidfd, and the start time
    is checked again once it is open, so a pid reused by another process since the scan is spared."""
    killed = set()
    while True:
        fresh = {pid: start for pid, start in descendants(root).items() if (pid, start) not in killed}
        if not fresh:
            return
        for pid, start in fresh.items():
            killed.add((pid, start))
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    if int(f.read().rsplit(b")", 1)[1].split()[19]) == start:
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(fd)


def kill_tree() -> None:
    """In the init: kill every descendant, then reap them all."""
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
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)  # after the uid change, which clears it
        _prctl(_PR_SET_NO_NEW_PRIVS, 1)  # Landlock and seccomp both require it
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
    cfg = json.loads(sys.stdin.buffer.read())
    fd = os.open("/dev/null", os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, _stop)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    status = None
    try:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != cfg["supervisor_pid"]:  # the supervisor died before PDEATHSIG was armed
            raise _Stop()
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
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
    kill_tree()
    if status is None:  # stopped: report it the way a killed process is reported
        os.kill(os.getpid(), signal.SIGKILL)
    if os.WIFSIGNALED(status):  # 128+N, as bash and bwrap's pid 1 report it, in every tier
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


# ---- the supervisor's side -------------------------------------------------------------------
_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); from nano_openshell.initproc import main; main()"
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Init:
    """One command's init, seen from the supervisor: Init(cfg, leaf) starts it (in the cgroup leaf
    when the Sandbox has a cgroup), stop() kills the command's whole tree, close() once it is over."""

    def __init__(self, cfg: dict, leaf=None, path: str = "/usr/bin:/bin"):
        import subprocess  # here, not at the top: the init itself starts faster without it

        self.leaf = leaf
        self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _BOOT, _PACKAGE_PARENT],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env={"PATH": path}, start_new_session=True)
        try:
            if leaf is not None:
                leaf.add(self.proc.pid)  # before the config: the init forks nothing until it has it
            self.proc.stdin.write(json.dumps(cfg).encode())
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                pipe.close()
            raise

    def stop(self) -> None:
        """Kill everything the command started. With a cgroup: cgroup.kill. Without: freeze the init
        (SIGSTOP; it stays the subreaper its orphans are reparented to, so the tree keeps its
        ancestry), kill its descendants until a scan finds none, then the init. Never the init
        first: its orphans would go to PID 1, out of reach."""
        if self.leaf is not None:
            self.leaf.kill()
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)
            kill_descendants(self.proc.pid)
        self.proc.kill()

    def close(self) -> None:
        if self.leaf is not None:
            self.leaf.close()  # an escapee the init missed would die here; the leaf goes


if __name__ == "__main__":
    main()
