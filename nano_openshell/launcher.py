"""One long-lived launcher per root Sandbox: it starts each command's bwrap already under the sandbox uid.

Dropping the uid per command costs one more program start per command (unshare/setpriv, then bwrap).
Instead the Sandbox starts this launcher once, through the same uid-drop tool, as a small Python of
its own (`python -I -S -c <this file>`, stdlib only: the sandbox uid needs no access to the package).
Per command the supervisor sends one SOCK_SEQPACKET message: JSON {argv, env, targets} and, by
SCM_RIGHTS, a reply pipe's write end plus the fds bwrap needs (stdout/stderr pipes, workspace, seccomp
program, proxy socket, script); the launcher puts each fd at its target number and posix_spawns bwrap
(vfork-like: no fork of anything big). On the reply pipe it writes "P<pid>" once spawned (or "E<why>"),
and "X<exit code>" once it reaped the command. {"kill": pid} kills a command that is not reaped yet:
the launcher peeks at exits with WNOWAIT and reaps under the same lock, so a pid it kills is never a
reused one.
Lifetime: when the supervisor dies or the Sandbox closes, the socket reaches EOF and the launcher
exits at once; its bwraps have --die-with-parent, so every sandbox process dies with it. (EOF, not
PR_SET_PDEATHSIG: that fires when the supervisor THREAD that started us ends, e.g. a pool thread.)
"""

import array
import fcntl
import json
import os
import socket
import sys
import threading

MAX_MESSAGE = 1 << 18   # argv + env of one command; the Sandbox sends larger scripts as a file
_FD_FLOOR = 16          # received fds move above every target number before the dup2s


def _reaper(lock: threading.Lock, replies: dict, spawned: threading.Semaphore) -> None:
    while True:
        spawned.acquire()
        while True:
            try:
                pid = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOWAIT).si_pid
                break
            except InterruptedError:
                continue
        with lock:  # the kill path holds this lock too: a pid in `replies` is not reaped yet
            reply = replies.pop(pid, None)
            _, status = os.waitpid(pid, 0)
        if reply is not None:
            try:
                os.write(reply, b"X%d\n" % os.waitstatus_to_exitcode(status))
            except OSError:
                pass
            os.close(reply)


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    sock.set_inheritable(False)
    lock, replies, spawned = threading.Lock(), {}, threading.Semaphore(0)
    threading.Thread(target=_reaper, args=(lock, replies, spawned), daemon=True).start()
    while True:
        try:
            data, anc, _, _ = sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(32 * 4), socket.MSG_CMSG_CLOEXEC)
        except InterruptedError:
            continue
        if not data:
            os._exit(0)  # the supervisor is gone: exit, and every bwrap dies with us
        fds = array.array("i")
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        fds = list(fds)
        try:
            msg = json.loads(data)
            if "kill" in msg:
                with lock:
                    if msg["kill"] in replies:
                        os.kill(msg["kill"], 9)
                continue
            reply, srcs = fds[0], fds[1:]
            moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, _FD_FLOOR) for fd in srcs]
            fds += moved
            actions = [(os.POSIX_SPAWN_DUP2, src, dst) for src, dst in zip(moved, msg["targets"])]
            with lock:
                try:
                    pid = os.posix_spawn(msg["argv"][0], msg["argv"], msg["env"], file_actions=actions)
                except OSError as e:
                    os.write(reply, b"E%s\n" % str(e).encode(errors="replace"))
                else:
                    replies[pid] = os.dup(reply)  # CLOEXEC like every fd we hold
                    os.write(reply, b"P%d\n" % pid)
                    spawned.release()
        except Exception as e:  # a bad message costs that command, never the launcher
            if fds:
                try:
                    os.write(fds[0], b"E%s\n" % repr(e).encode(errors="replace"))
                except OSError:
                    pass
        finally:
            for fd in fds:
                os.close(fd)


# ---- the supervisor's side -------------------------------------------------------------------
class LauncherDied(RuntimeError):
    pass


class Launcher:
    """The supervisor's handle: start(drop_argv, python) once, spawn() per command, close() at the end."""

    def __init__(self, drop_argv: list[str], python: str, env: dict[str, str]):
        import subprocess

        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        with open(os.path.abspath(__file__)) as f:
            source = f.read()
        try:
            self._proc = subprocess.Popen(drop_argv + [python, "-I", "-S", "-c", source, str(theirs.fileno())],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, env=env, pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()

    def spawn(self, argv: list[str], env: dict[str, str], fds: list[int], targets: list[int]) -> "Launched":
        """Start argv with fds[i] at number targets[i] in it; fds are not closed here."""
        reply_r, reply_w = os.pipe()
        try:
            msg = json.dumps({"argv": argv, "env": env, "targets": targets}).encode()
            try:
                self._sock.sendmsg([msg], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [reply_w] + fds))])
            except OSError as e:
                raise LauncherDied(f"the sandbox launcher is gone: {e}") from None
        except BaseException:
            os.close(reply_r)
            raise
        finally:
            os.close(reply_w)
        return Launched(self, reply_r)

    def kill(self, pid: int) -> None:
        try:
            self._sock.sendmsg([json.dumps({"kill": pid}).encode()])
        except OSError:
            pass  # the launcher is gone, and with it the command

    def close(self) -> None:
        self._sock.close()  # EOF: the launcher exits, and any command still running dies with it
        self._proc.wait()


class Launched:
    """What _drain needs of a Popen: pid, wait(timeout), returncode, kill(); stdout/stderr are set by the caller."""

    def __init__(self, launcher: Launcher, reply_fd: int):
        self._launcher, self._reply, self._buf = launcher, reply_fd, b""
        self.returncode = None
        line = self._line(None)
        if line is None or not line.startswith(b"P"):
            os.close(self._reply)
            why = line[1:].decode(errors="replace") if line else "it exited"
            raise LauncherDied(f"the sandbox launcher could not start the command: {why}")
        self.pid = int(line[1:])

    def _line(self, timeout):
        import select

        while b"\n" not in self._buf:
            if not select.select([self._reply], [], [], timeout)[0]:
                return False
            data = os.read(self._reply, 4096)
            if not data:
                return None
            self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def wait(self, timeout=None):
        import subprocess

        if self.returncode is None:
            line = self._line(timeout)
            if line is False:
                raise subprocess.TimeoutExpired("bwrap", timeout)
            os.close(self._reply)
            # None: the launcher died (and bwrap with it, --die-with-parent): report a SIGKILL
            self.returncode = int(line[1:]) if line else -9
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            self._launcher.kill(self.pid)


if __name__ == "__main__":
    main()
