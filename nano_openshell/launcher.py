"""The supervisor's side of a namespaced Sandbox: its one bwrap, the init inside (nsinit.c), each command.

Namespaces(...).get() starts `[uid drop] bwrap <layout> --as-pid-1 -- INIT FD` and returns at once.
INIT is nsinit.c compiled (init_build.py: the supervisor passes the file, the sandbox execs
/proc/self/fd/N) or, where no C compiler works, `python3 -I -S -c <init_build.PYTHON_BOOT>` with
nsinit.py on stdin.
The init boots while the caller goes on, and a first command simply waits in the socket until the
init reads it; a dead init is replaced at the next get(). run() is one command: Init.spawn() sends
it (argv, env and its fds by SCM_RIGHTS) and returns a Command, which is what output.drain needs of a
Popen: wait(timeout), kill(), returncode.
With a cgroup, bwrap and the init are moved into it by a thread while they boot (Init.__init__ says
why); no command is sent before they are in.

Lifetime. Every bwrap is started from one long-lived thread of ours: bwrap's --die-with-parent is
PR_SET_PDEATHSIG, which fires when the THREAD that started it ends (a pool thread that created a
Sandbox may end long before the Sandbox does). So a killed supervisor takes every sandbox with it;
close() closes the socket (the init exits, and the kernel kills the rest of its pid namespace) and
kills bwrap if that takes more than a moment.

Trust. The init runs under the sandbox's uid, beside the commands: what it reports is parsed as
untrusted (short lines), and no deadline depends on it; what it says of when a command ended
decides only whether that command's result is a timeout. A command it does not stop within
_KILL_WAIT of a kill request gets the whole sandbox killed instead (the next command starts a new one).
"""

import array
import concurrent.futures
import fcntl
import json
import os
import select
import shutil
import socket
import struct
import subprocess
import threading
import time

from . import init_build, namespaced
from .output import drain

_KILL_WAIT = 2.0       # after a kill request, how long the init has to report the command gone
_CLOSE_WAIT = 1.0      # after EOF, how long bwrap has to exit before it is killed
_MAX_STATUS = 4096
_INLINE_SCRIPT_BYTES = 64 * 1024
_POOLS: dict[tuple[int, str], concurrent.futures.ThreadPoolExecutor] = {}  # (pid, name) -> its threads
_POOLS_LOCK = threading.Lock()


def _pool(name: str, workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """Long-lived threads of this process (a forked child makes its own: the parent's are not in it)."""
    key = (os.getpid(), name)
    with _POOLS_LOCK:
        if key not in _POOLS:
            for old in [k for k in _POOLS if k[0] != key[0]]:
                del _POOLS[old]
            _POOLS[key] = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=f"nano-openshell-{name}")
        return _POOLS[key]


def _spawner() -> concurrent.futures.ThreadPoolExecutor:
    """The one thread every bwrap starts from (see Lifetime above)."""
    return _pool("bwrap", 1)


def _joiner() -> concurrent.futures.ThreadPoolExecutor:
    """Threads that move sandboxes into their cgroups (each waits out a grace period: several at once)."""
    return _pool("cgroup", 16)


class InitDied(RuntimeError):
    """The sandbox's init is gone (or never started): the command did not run to its end."""


class NotDelivered(InitDied):
    """The command never reached the init (it is gone): it did not run at all."""


class NotStarted(RuntimeError):
    """The init could not start this command (it says why); the sandbox itself is fine."""


_SBIN_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"
_UID_DROPPER = None  # (tool kind, path), found once


def uid_drop_argv(uid: int) -> list[str] | None:
    """A prefix that runs the rest of argv with real/effective/saved uid and gid `uid` and no
    supplementary groups, or None when neither tool is here. util-linux `unshare -S -G` (with no
    namespace flag it only does unshare(0), setgroups([]), setgid, setuid, exec) takes numbers as
    they are; setpriv looks every id up through NSS first (getpwnam): ~0.3 ms more per command.
    unshare is tried once for real: busybox's has no --setuid, and a seccomp filter denying the
    unshare syscall (a rootless container) makes even unshare(0) fail."""
    global _UID_DROPPER
    if _UID_DROPPER is None:
        unshare, setpriv = shutil.which("unshare", path=_SBIN_PATH), shutil.which("setpriv", path=_SBIN_PATH)
        works = False
        if unshare:
            trial = [unshare, "--setuid=65534", "--setgid=65534", "--", "/bin/sh", "-c", "test $(id -u) = 65534"]
            works = subprocess.run(trial, stdin=subprocess.DEVNULL, capture_output=True).returncode == 0
        _UID_DROPPER = ("unshare", unshare) if works else ("setpriv", setpriv) if setpriv else ("", None)
    kind, path = _UID_DROPPER
    if kind == "unshare":
        return [path, f"--setuid={uid}", f"--setgid={uid}", "--"]
    if kind == "setpriv":
        return [path, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return None


class Namespaces:
    """A Sandbox's bwrap and init: how to start them (namespaced.py's layout, as root under the
    sandbox's uid: through a uid-drop tool, vfork-cheap, else Popen(user=uid), a fork) and the one
    running. get() returns it, starting a new one when there is none or it died."""

    def __init__(self, bwrap: str, tmp_bytes: int, uid: int | None, workspace_fd: int, mounts: dict[str, str],
                 socket_fd: int | None, seccomp_program: bytes, cgroup_leaf, path: str):
        self.init_binary = init_build.binary() if init_build.kind() == "c" else None
        self.python, _ = namespaced.sandbox_python(uid is not None)
        if self.python is None:
            raise InitDied("no Python that the sandbox can run for its init (neither under /usr nor ours)")
        argv = (namespaced.base_argv(bwrap, tmp_bytes, uid is not None) + namespaced.workspace_args(workspace_fd)
                + namespaced.mount_args(mounts))
        drop = uid_drop_argv(uid) if uid is not None else None
        self._argv, self._user = (drop + argv if drop else argv), (uid if uid is not None and not drop else None)
        self._fds = (workspace_fd,) + ((socket_fd,) if socket_fd is not None else ())
        self._socket_fd, self._seccomp, self._leaf, self._path = socket_fd, seccomp_program, cgroup_leaf, path
        self._lock, self._init, self._closed = threading.Lock(), None, False

    def get(self) -> "Init":
        with self._lock:
            if self._init is not None and self._init.alive():
                return self._init
            if self._closed:
                raise InitDied("the sandbox is closed")
            if self._init is not None:
                self._init.close()
            prog_r, prog_w = os.pipe()
            try:
                os.write(prog_w, self._seccomp)  # a few hundred bytes: fits the pipe buffer
                os.close(prog_w)
                argv = self._argv + namespaced.command_args(prog_r, self._socket_fd)[:-1]  # Init adds "--"
            except BaseException:
                os.close(prog_r)
                raise
            self._init = Init(argv, self.python, {"PATH": self._path}, self._fds, self._user, self._leaf,
                              own_fds=(prog_r,), binary=self.init_binary)
            return self._init

    def ready(self, deadline: float) -> bool:
        """Init.ready of the running init; starts none (False when there is none or it died)."""
        with self._lock:
            init = self._init
        return init is not None and init.ready(deadline)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._init is not None:
                self._init.close()


def encode(msg: tuple) -> bytes:
    """A message to the init, in the one format both inits parse (nsinit.c's header says it):
    ("run", id, argv, env) | ("kill", id) | ("ping",)."""
    if msg[0] == "run":
        _, cid, argv, env = msg
        strings = [os.fsencode(a) for a in argv] + [os.fsencode(f"{k}={v}") for k, v in env.items()]
        if any(b"\0" in x for x in strings):
            raise ValueError("a command's argv and environment cannot hold NUL bytes")
        return b"r" + struct.pack("<QII", cid, len(argv), len(env)) + b"".join(x + b"\0" for x in strings)
    if msg[0] == "kill":
        return b"k" + struct.pack("<Q", msg[1])
    if msg[0] == "ping":
        return b"p"
    raise ValueError(f"unknown init message {msg[0]!r}")


class Init:
    def __init__(self, argv: list[str], python: str, env: dict[str, str], pass_fds: tuple[int, ...],
                 user: int | None = None, cgroup_leaf=None, own_fds: tuple[int, ...] = (),
                 binary: str | None = None):
        """argv: [uid drop] bwrap ... -- (the layout; see namespaced.py); binary: the C init (else
        python runs nsinit.py); user: a uid to start it under
        when there is no uid-drop tool (Popen then forks instead of vforking: once per Sandbox).
        own_fds: passed to bwrap too, and closed here once it started. Returns before bwrap runs:
        the spawner thread starts it (the first use of _proc waits for that).
        cgroup_leaf (cgroup.Leaf): every process of the sandbox lives in it. Moving a process into a
        fresh cgroup waits out an RCU grace period (~10-15 ms of wall time, little CPU), so it is not
        done before bwrap starts: bwrap reports its child (our init, pid 1) on --info-fd before that
        child does anything, and a thread moves bwrap and the init into the leaf while the mounts are
        made and Python boots; no command is sent before they are in (spawn() waits for it). The init
        forks nothing until it is sent a command, so every command's process is born inside."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        err_r, err_w = os.pipe()
        if binary is not None:  # its file, open: the sandbox cannot see our cache, but can exec an fd
            src_r, src_w = init_build.open_binary(), None
            init_argv = [f"/proc/self/fd/{src_r}", str(theirs.fileno()), str(src_r)]
        else:
            src_r, src_w = os.pipe()  # the init's program (see init_build.PYTHON_BOOT), ~35 KB
            init_argv = [python, "-I", "-S", "-c", init_build.PYTHON_BOOT, str(theirs.fileno())]
        info_r, info_w = os.pipe() if cgroup_leaf is not None else (None, None)
        self._sock, self._err, self._ids = ours, err_r, iter(range(1, 1 << 62))
        self.dead: str | None = None  # why, once the init is known to be gone
        self.closed = False
        self._answered = False  # the init answered a ping (ready())
        self._joining = None  # the future of moving bwrap and the init into the cgroup leaf
        ids = dict(user=user, group=user, extra_groups=[]) if user is not None else {}
        info = ["--info-fd", str(info_w)] if info_w is not None else []
        full = argv + info + ["--as-pid-1", "--"] + init_argv
        theirs_fd = theirs.detach()
        keep = pass_fds + own_fds + (theirs_fd,) + ((info_w,) if info_w is not None else ()) + \
            ((src_r,) if binary is not None else ())
        closing = (theirs_fd, err_w, src_r) + own_fds + ((info_w,) if info_w is not None else ())
        popen = dict(stdin=subprocess.DEVNULL if binary is not None else src_r, stdout=subprocess.DEVNULL,
                     stderr=err_w, env=env, pass_fds=keep, **ids)
        self._started = _spawner().submit(self._start, full, popen, closing, src_w)
        if cgroup_leaf is not None:  # a pool's thread: starting a thread waits for it to run (~ms when busy)
            self._joining = _joiner().submit(self._join_cgroup, cgroup_leaf, info_r)
        os.set_blocking(err_r, False)
        ours.setblocking(False)

    def _start(self, argv: list[str], popen: dict, closing: tuple[int, ...], src_w: int | None):
        """In the spawner thread: start bwrap, close our copies of its fds, send the init's program
        (nsinit.py's; none to the C init). A failure to start is this init's death (the first command
        says why), not an exception."""
        program, sent = init_build.python_program() if src_w is not None else b"", 0
        if src_w is not None:
            try:
                fcntl.fcntl(src_w, fcntl.F_SETPIPE_SZ, len(program))
            except OSError:
                pass  # a user over its pipe quota gets small pipes: the rest is written once bwrap runs
            os.set_blocking(src_w, False)
            try:
                sent = os.write(src_w, program)
            except BlockingIOError:
                pass
        try:
            return subprocess.Popen(argv, **popen)
        except Exception as e:
            self.dead = f"bwrap could not be started: {e!r}"
            return None
        finally:
            for fd in closing:
                os.close(fd)
            if src_w is None:
                pass
            elif sent < len(program):  # the init reads the rest as it boots: not on this thread's time
                threading.Thread(target=_write_all, args=(src_w, program[sent:]), daemon=True).start()
            else:
                os.close(src_w)

    @property
    def _proc(self) -> subprocess.Popen | None:
        """bwrap, once the spawner thread started it; None when it could not be started."""
        return self._started.result()

    def _join_cgroup(self, leaf, info_r: int) -> None:
        """Move bwrap and its child, the init, into the leaf (see __init__); on failure the sandbox is
        killed (its first command fails clearly, the next one starts a new init)."""
        try:
            report = b""
            while True:  # bwrap writes {"child-pid": N, ...} and closes it before its child runs
                chunk = os.read(info_r, 4096)
                if not chunk:
                    break
                report += chunk
            child = int(json.loads(report)["child-pid"])
            leaf.add(self._proc.pid)
            leaf.add(child)
        except Exception as e:
            self.abort(f"the sandbox could not be moved into its cgroup ({e!r}); it was killed")
        finally:
            os.close(info_r)

    def _joined(self, deadline: float) -> None:
        """Wait until the sandbox is in its cgroup (nothing may run outside it)."""
        if self._joining is None:
            return
        try:
            self._joining.result(max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError:
            self.abort("the sandbox was not in its cgroup before the deadline; it was killed")
            raise InitDied(self.dead) from None

    def ready(self, deadline: float) -> bool:
        """Has the init booted: in its cgroup and answering on its socket? Runs nothing in the sandbox
        (a ping, nsinit.py) and, unlike spawn(), does not kill a sandbox that is slow to boot: False at
        the deadline, or once it is dead. After one answer, only whether it is still alive."""
        if not self._answered:
            try:
                if self._joining is not None:
                    self._joining.result(max(0.0, deadline - time.monotonic()))
                if not self.alive():
                    return False
                status_r, status_w = os.pipe()
                try:
                    self._send(("ping",), [status_w], deadline)
                finally:
                    os.close(status_w)
                try:
                    answered = _ready(status_r, select.POLLIN, deadline - time.monotonic())
                    answer = os.read(status_r, 2) if answered else b""
                finally:
                    os.close(status_r)
            except (concurrent.futures.TimeoutError, InitDied):
                return False
            self._answered = answer == b"R\n"
        return self._answered and self.alive()

    def alive(self) -> bool:
        if self._proc is None:
            return False
        if self.dead is None and self._proc.poll() is not None:
            self.dead = self._why(f"bwrap exited with status {self._proc.returncode}")
        return self.dead is None

    def _why(self, what: str) -> str:
        try:
            said = os.read(self._err, 2000).decode(errors="replace").strip()
        except OSError:
            said = ""
        return what + (f": {said}" if said else "")

    def _send(self, msg: tuple, fds: list[int], deadline: float) -> None:
        data = encode(msg)
        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        while True:
            try:
                self._sock.sendmsg([data], anc)
                return
            except BlockingIOError:  # the init is not reading (yet): wait for room, up to the deadline
                left = deadline - time.monotonic()
                if left <= 0 or not _ready(self._sock.fileno(), select.POLLOUT, left):
                    self.abort("the sandbox's init took no command before the deadline; it was killed")
                    raise InitDied(self.dead) from None
            except OSError as e:
                self.dead = self.dead or self._why(f"the sandbox's init is gone ({e.strerror})")
                raise NotDelivered(self.dead) from None

    def spawn(self, argv: list[str], env: dict[str, str], out_w: int, err_w: int, script_fd: int | None,
              deadline: float) -> "Command":
        """Start argv with out_w/err_w as its stdout/stderr (and script_fd as fd 3); fds are not closed here."""
        self._joined(deadline)
        if not self.alive():
            raise NotDelivered(self.dead)
        status_r, status_w = os.pipe()
        cid = next(self._ids)
        try:
            self._send(("run", cid, argv, env), [status_w, out_w, err_w] + ([script_fd] if script_fd else []),
                       deadline)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        return Command(self, cid, status_r)

    def kill(self, cid: int) -> None:
        try:
            self._send(("kill", cid), [], time.monotonic() + 0.1)
        except InitDied:
            pass  # gone: so is the command

    def abort(self, why: str) -> None:
        """Kill the whole sandbox now (bwrap; its init dies with it, and the pid namespace with that)."""
        self.dead = self.dead or why
        try:
            if self._proc is not None:
                self._proc.kill()
        except OSError:
            pass

    def close(self) -> None:
        self.closed, self.dead = True, self.dead or "the sandbox is closed"
        self._sock.close()  # EOF: the init exits, and every process of the sandbox dies with it
        if self._proc is not None:
            if not _exited(self._proc, _CLOSE_WAIT):
                self._proc.kill()
            self._proc.wait()
        if self._joining is not None:
            self._joining.result()  # it ends with bwrap (EOF on --info-fd, or a move that now fails)
        os.close(self._err)


class Command:
    """One command in the init: what output.drain needs of a Popen (run() sets stdout/stderr), and
    ended: (exit code, time.monotonic()) of its main process as the init reaped it, before killing
    what it left (None until wait() has read that)."""

    def __init__(self, init: Init, cid: int, status_fd: int):
        self._init, self._cid, self._status, self._buf = init, cid, status_fd, b""
        self.returncode, self._killed_at, self.ended = None, None, None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        if timeout is None and self._killed_at is not None:
            timeout = max(0.0, self._killed_at + _KILL_WAIT - time.monotonic())
        line = self._line(timeout)
        if line is False:
            if self._killed_at is None:
                raise subprocess.TimeoutExpired("sandbox command", timeout)
            # killed, and the init did not report it gone: kill the whole sandbox instead
            self._init.abort("the sandbox's init did not stop a command in time; it was killed with it")
            line = b"X-9"
        os.close(self._status)
        if line is None:  # EOF without a status: the sandbox was closed (killed, as at a timeout), or its init died
            self.returncode = -9
            if self._init.closed:
                return self.returncode
            self._init.alive()
            raise InitDied(self._init.dead or "the sandbox's init died")
        if line.startswith(b"E"):
            self.returncode = -9
            raise NotStarted(line[1:].decode(errors="replace"))
        try:
            self.returncode = int(line[1:]) if line.startswith(b"X") else -9
        except ValueError:
            self.returncode = -9
        return self.returncode

    def _line(self, timeout):
        """The next status line but D lines (each one before it goes into ended); False at the
        timeout; at EOF, what came without a newline, or None."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            while b"\n" not in self._buf:
                left = None if end is None else max(0.0, end - time.monotonic())
                if not _ready(self._status, select.POLLIN, left):
                    return False
                data = os.read(self._status, _MAX_STATUS)
                if not data:
                    return self._buf or None
                self._buf = (self._buf + data)[-_MAX_STATUS:]
            line, self._buf = self._buf.split(b"\n", 1)
            if not line.startswith(b"D"):
                return line
            try:
                code, ns = line[1:].split()
                self.ended = int(code), int(ns) / 1e9
            except (ValueError, OverflowError):  # not what the init writes: as if it had said nothing
                pass

    def kill(self) -> None:
        if self.returncode is None and self._killed_at is None:
            self._killed_at = time.monotonic()
            self._init.kill(self._cid)


def run(start_init, script: str, env: dict[str, str], deadline: float, output_bytes: int, disk=None):
    """One command: `bash -c script` in the init that start_init() returns (live, or a new one), its
    stdout/stderr drained until EOF or the deadline (output.drain). A script too long for argv
    (strings are capped at 128 KiB) travels as a memfd, read as /dev/fd/3."""
    script_fd, argv = None, ["/bin/bash", "-c", script]
    if len(script.encode()) > _INLINE_SCRIPT_BYTES:
        script_fd = os.memfd_create("nano-openshell-command", 0)
        os.write(script_fd, script.encode())
        os.lseek(script_fd, 0, os.SEEK_SET)
        argv = ["/bin/bash", "/dev/fd/3"]
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        try:
            proc = start_init().spawn(argv, env, out_w, err_w, script_fd, deadline)
        except NotDelivered:  # the init died since the last command: once more, with a new one
            proc = start_init().spawn(argv, env, out_w, err_w, script_fd, deadline)
    except BaseException:
        os.close(out_r)
        os.close(err_r)
        raise
    finally:
        for fd in (out_w, err_w, script_fd):
            if fd is not None:
                os.close(fd)
    proc.stdout, proc.stderr = open(out_r, "rb", buffering=0), open(err_r, "rb", buffering=0)
    code, out, err, timed_out = drain(proc, deadline, output_bytes, proc.kill, disk=disk)
    if timed_out and proc.ended is not None and proc.ended[1] < deadline:  # only its leftovers' kill ran late
        code, timed_out = proc.ended[0], False
    return code, out, err, timed_out


def _write_all(fd: int, data: bytes) -> None:
    try:
        os.set_blocking(fd, True)
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass  # bwrap failed: the first command says why
    finally:
        os.close(fd)


def _exited(proc: subprocess.Popen, timeout: float) -> bool:
    """Has proc exited within timeout? Woken by its pidfd the moment it does (Popen.wait(timeout)
    sleeps in growing steps: a bwrap gone after 3 ms was seen after ~7 ms)."""
    if proc.returncode is not None:
        return True
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):  # Linux < 5.3, or Python without it
        try:
            proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        return _ready(fd, select.POLLIN, timeout)
    finally:
        os.close(fd)


def _ready(fd: int, event: int, timeout: float | None) -> bool:
    poller = select.poll()
    poller.register(fd, event)
    return bool(poller.poll(None if timeout is None else max(0, int(timeout * 1000) + 1)))
