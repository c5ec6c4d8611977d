"""The supervisor's side of the tiers without namespaces ("fallback", and "none"): one init per command.

run() starts the command's init (initproc.py) in the Sandbox's cgroup leaf when it has one, and
drains its output until EOF or the deadline. At the deadline or at close() the tree is killed by
cgroup.kill, or without a cgroup by kill_descendants with the init frozen meanwhile.
"""

import marshal
import os
import signal
import subprocess
import sys

from . import seccomp
from .initproc import kill_descendants
from .output import drain

INLINE_SCRIPT_BYTES = 64 * 1024  # a longer command travels as a file (argv strings are capped at 128 KiB)
# a bare package module: the init imports initproc, landlock and seccomp, not the package's __init__
# and the supervisor's side it loads (every command waits for the init's start)
_BOOT = ("import sys; p = type(sys)('nano_openshell'); p.__path__ = [sys.argv[1]]; "
         "sys.modules['nano_openshell'] = p; from nano_openshell.initproc import main; main()")
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


class Init:
    """One command's init, seen from the supervisor (started in the leaf when the Sandbox has a cgroup)."""

    def __init__(self, cfg: dict, leaf=None, path: str = "/usr/bin:/bin"):
        self.leaf = leaf
        self._ended_r, ended_w = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _BOOT, _PACKAGE_DIR],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         env={"PATH": path}, start_new_session=True, pass_fds=(ended_w,))
        except BaseException:
            os.close(self._ended_r)
            raise
        finally:
            os.close(ended_w)
        try:
            if leaf is not None:
                leaf.add(self.proc.pid)  # before the config: the init forks nothing until it has it
            self.proc.stdin.write(marshal.dumps({**cfg, "ended_fd": ended_w}))  # the same fd number there
            self.proc.stdin.close()
        except BrokenPipeError:
            pass
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            for pipe in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
                pipe.close()
            os.close(self._ended_r)
            raise

    def stop(self) -> None:
        """Kill everything the command started: cgroup.kill; without a cgroup, freeze the init (it stays
        the subreaper its orphans go to, and reaps none of them), kill its descendants until none is
        left, then the init. Never the init first: its orphans would go to PID 1, out of reach."""
        if self.leaf is not None:
            self.leaf.kill()
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)
            try:  # until it has stopped (or exited): a child it reaps meanwhile would unsettle the kill
                os.waitid(os.P_PID, self.proc.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)
            except ChildProcessError:
                pass  # exited, and reaped by another thread's wait
            kill_descendants(self.proc.pid)
        self.proc.kill()

    def ended(self) -> tuple[int, float] | None:
        """(exit code, time.monotonic()) of the command as the init reported it, once the init is over;
        None if the command was killed first."""
        os.set_blocking(self._ended_r, False)
        try:
            code, at = os.read(self._ended_r, 64).split()
            return int(code), float(at)
        except (BlockingIOError, ValueError):
            return None

    def close(self) -> None:
        os.close(self._ended_r)
        if self.leaf is not None:
            self.leaf.close()  # an escapee the init missed would die here; the leaf goes


def run(command: str, cfg: dict, leaf, path: str, deadline: float, output_bytes: int, owned, disk):
    """`bash -c command` in a new init, drained (output.drain); cfg: initproc.main's, "seccomp" a bool here."""
    argv = ["bash", "-c", command]
    if len(command.encode()) > INLINE_SCRIPT_BYTES:
        script = os.path.join(cfg["tmpdir"], ".nano-openshell-command.sh")
        with open(script, "w") as f:
            f.write(command)
        argv = ["bash", script]
    seccomp_hex = seccomp.deny_list(no_sockets=True).hex() if cfg["seccomp"] else None
    cfg = {**cfg, "argv": argv, "supervisor_pid": os.getpid(), "seccomp": seccomp_hex}
    init = Init(cfg, leaf, path)
    try:
        return drain(init.proc, deadline, output_bytes, init.stop, disk, init.ended, owned)
    finally:
        init.close()
