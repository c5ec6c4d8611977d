"""The fallback tier's per-command init (runs as `python -I -S`, config as JSON on stdin).

It is a child subreaper in a new session: every process the command starts, including setsid and
double-forked escapees, is reparented to it when its parent dies. When the command exits, or on
SIGTERM (sent by the supervisor at the timeout, or by the kernel as PDEATHSIG when the supervisor
dies), it SIGKILLs what is left, level by level, until it has no child, then exits with the command's
status. The command itself runs with rlimits, under another uid when we are root, with
no_new_privs, Landlock (workspace and private tmp writable, the rest read-only, no TCP, signals
scoped) and the AF_UNIX-only seccomp filter. The init stays outside the Landlock domain and, as root,
under another uid: the command can neither signal it nor read its /proc entries.
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


def _children(me: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        if int(stat.rsplit(b")", 1)[1].split()[1]) == me:  # field 4: ppid (comm may hold spaces)
            out.append(int(name))
    return out


def kill_tree() -> None:
    me = os.getpid()
    while True:
        for pid in _children(me):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(-1, 0)  # a dead child's own children are already ours when it is reaped
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            return


def _exec_command(cfg: dict) -> None:
    """In the forked child: drop everything, then exec bash. Never returns."""
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
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


if __name__ == "__main__":
    main()
