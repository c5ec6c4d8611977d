"""The supervisor's side of a namespaced Sandbox: its one bwrap, the init inside (nsinit.c, or
nsinit.py without a C compiler), each command.

Namespaces.get() starts `[uid drop] bwrap <layout> --as-pid-1 -- INIT FD` and returns at once (a
command sent before the init boots waits in the socket). Every bwrap starts from one long-lived
thread: --die-with-parent fires when the THREAD that started it ends. Closing the socket ends the init
and its pid namespace. The init runs beside the commands, under their uid: what it reports is
untrusted, no deadline depends on it (when it says a command ended decides only whether that result
is a timeout), and a command it does not report gone within KILL_WAIT of a kill gets the sandbox killed.
"""

import array
import concurrent.futures
import contextlib
import json
import os
import select
import socket
import struct
import subprocess
import threading
import time

from . import init_build, namespaced
from .output import drain

KILL_WAIT = 2.0      # after a kill request, how long the init has to report the command gone
CLOSE_WAIT = 1.0     # after EOF, how long bwrap has to exit before it is killed
INLINE_SCRIPT_BYTES = 64 * 1024  # a longer script travels as a memfd (argv strings are capped at 128 KiB)
_MAX_STATUS = 4096
_POOLS: dict = {}  # name -> ThreadPoolExecutor
_POOLS_LOCK = threading.Lock()
os.register_at_fork(after_in_child=_POOLS.clear)  # a forked child has none of its parent's threads


def _pool(name: str, workers: int) -> concurrent.futures.ThreadPoolExecutor:
    with _POOLS_LOCK:
        if name not in _POOLS:
            _POOLS[name] = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=f"nano-openshell-{name}")
        return _POOLS[name]


class InitDied(RuntimeError):
    """The sandbox's init is gone (or never started): the command did not run to its end."""


class NotDelivered(InitDied):
    """The command never reached the init (it is gone): it did not run at all."""


class NotStarted(RuntimeError):
    """The init could not start this command (it says why); the sandbox itself is fine."""


class Namespaces:
    def __init__(self, bwrap: str, tmp_bytes: int, uid: int | None, workspace_fd: int, mounts: dict[str, str],
                 socket_fd: int | None, seccomp_program: bytes, cgroup_leaf, path: str):
        self.init_binary = init_build.binary() if init_build.kind() == "c" else None
        self.python = namespaced.sandbox_python(uid is not None)[0]
        if self.python is None:
            raise InitDied("no Python that the sandbox can run for its init (neither under /usr nor ours)")
        argv = namespaced.base_argv(bwrap, tmp_bytes, uid is not None)
        argv += namespaced.workspace_args(workspace_fd)
        argv += [arg for path, host in sorted(mounts.items()) for arg in ("--bind", host, path)]
        drop = namespaced.uid_drop_argv(uid) if uid is not None else None
        self.argv, self.user = (drop + argv if drop else argv), (uid if uid is not None and not drop else None)
        self.fds = (workspace_fd,) + ((socket_fd,) if socket_fd is not None else ())
        self.socket_fd, self.seccomp, self.leaf, self.env = socket_fd, seccomp_program, cgroup_leaf, {"PATH": path}
        self._lock, self._init, self._closed = threading.Lock(), None, False

    def get(self) -> "Init":
        with self._lock:
            if self._init is not None and self._init.alive():
                return self._init
            if self._closed:
                raise InitDied("the sandbox is closed")
            if self._init is not None:
                self._init.close()
            self._init = Init(self)
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
    """("run", id, argv, env) | ("kill", id) | ("ping",), as both inits parse it (nsinit.c's header)."""
    kind, *args = msg
    if kind == "kill":
        return b"k" + struct.pack("<Q", *args)
    if kind == "ping":
        return b"p"
    cid, argv, env = args
    strings = [os.fsencode(a) for a in argv] + [os.fsencode(f"{k}={v}") for k, v in env.items()]
    if any(b"\0" in x for x in strings):
        raise ValueError("a command's argv and environment cannot hold NUL bytes")
    return b"r" + struct.pack("<QII", cid, len(argv), len(env)) + b"".join(x + b"\0" for x in strings)


class Init:
    def __init__(self, spec: Namespaces):
        """Returns before bwrap runs. With a cgroup leaf: moving into a fresh cgroup waits out an RCU
        grace period, so a thread moves bwrap and its child (--info-fd) while the init boots; no command
        is sent before they are in, and the init forks nothing before it: all are born inside."""
        prog_r, prog_w = os.pipe()
        try:
            os.write(prog_w, spec.seccomp)  # a few hundred bytes: fits the pipe buffer
        finally:
            os.close(prog_w)
        argv = spec.argv + namespaced.command_args(prog_r, spec.socket_fd)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        err_r, err_w = os.pipe()
        binary = spec.init_binary
        if binary is not None:  # its file, open: the sandbox cannot see our cache, but can exec an fd
            src_r, src_w = init_build.open_binary(), None
            init_argv = [f"/proc/self/fd/{src_r}", str(theirs.fileno()), str(src_r)]
        else:
            src_r, src_w = os.pipe()  # the init's program (init_build.PYTHON_BOOT reads it)
            init_argv = [spec.python, "-I", "-S", "-c", init_build.PYTHON_BOOT, str(theirs.fileno())]
        info_r, info_w = os.pipe() if spec.leaf is not None else (None, None)
        self._sock, self._err, self._ids = ours, err_r, iter(range(1, 1 << 62))
        self.dead: str | None = None  # why, once the init is known to be gone
        self.closed = self._answered = False
        self._joining = None  # moving bwrap and the init into the cgroup leaf
        theirs_fd = theirs.detach()
        info = (info_w,) if info_w is not None else ()
        full = argv + (["--info-fd", str(info_w)] if info else []) + ["--as-pid-1", "--"] + init_argv
        popen = dict(stdin=subprocess.DEVNULL if binary is not None else src_r, stdout=subprocess.DEVNULL,
                     stderr=err_w, env=spec.env, pass_fds=spec.fds + (prog_r, theirs_fd) + info
                     + ((src_r,) if binary is not None else ()))
        if spec.user is not None:
            popen.update(user=spec.user, group=spec.user, extra_groups=[])
        self._started = _pool("bwrap", 1).submit(self._start, full, popen, (prog_r, theirs_fd, err_w, src_r) + info,
                                                 src_w)
        if spec.leaf is not None:
            self._joining = _pool("cgroup", 16).submit(self._join_cgroup, spec.leaf, info_r)
        os.set_blocking(err_r, False)
        ours.setblocking(False)

    def _start(self, argv: list[str], popen: dict, closing: tuple[int, ...], src_w: int | None):
        """On the spawner thread: start bwrap (a failure is this init's death: the first command says why)."""
        try:
            return subprocess.Popen(argv, **popen)
        except Exception as e:
            self.dead = f"bwrap could not be started: {e!r}"
            return None
        finally:
            for fd in closing:
                os.close(fd)
            if src_w is not None:
                threading.Thread(target=_write_all, args=(src_w, init_build.python_program()), daemon=True).start()

    @property
    def _proc(self) -> subprocess.Popen | None:
        return self._started.result()

    def _join_cgroup(self, leaf, info_r: int) -> None:
        """Move bwrap and the init into the leaf; on failure the sandbox is killed."""
        try:
            with open(info_r, "rb") as info:  # {"child-pid": N, ...}, closed before the child runs
                child = int(json.loads(info.read())["child-pid"])
            leaf.add(self._proc.pid)
            leaf.add(child)
        except Exception as e:
            self.abort(f"the sandbox could not be moved into its cgroup ({e!r}); it was killed")

    def ready(self, deadline: float) -> bool:
        """Has the init booted (in its cgroup, answering a ping)? Unlike spawn(), kills none slow to boot."""
        if not self._answered:
            try:
                if self._joining is not None:
                    self._joining.result(max(0.0, deadline - time.monotonic()))
                status_r = self._request(("ping",), [], deadline)
                try:
                    self._answered = Command(self, 0, status_r)._line(deadline - time.monotonic()) == b"R"
                finally:
                    os.close(status_r)
            except (concurrent.futures.TimeoutError, InitDied):
                return False
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
        if self._joining is not None:  # nothing may run outside the cgroup
            try:
                self._joining.result(max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                self.abort("the sandbox was not in its cgroup before the deadline; it was killed")
                raise InitDied(self.dead) from None
        if not self.alive():
            raise NotDelivered(self.dead)
        cid = next(self._ids)
        fds = [out_w, err_w] + ([script_fd] if script_fd else [])
        return Command(self, cid, self._request(("run", cid, argv, env), fds, deadline))

    def _request(self, msg: tuple, fds: list[int], deadline: float) -> int:
        """Send msg with the write end of a new status pipe before fds; returns its read end."""
        status_r, status_w = os.pipe()
        try:
            self._send(msg, [status_w] + fds, deadline)
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(status_w)
        return status_r

    def kill(self, cid: int) -> None:
        with contextlib.suppress(InitDied):  # gone: so is the command
            self._send(("kill", cid), [], time.monotonic() + 0.1)

    def abort(self, why: str) -> None:
        """Kill the whole sandbox now (bwrap; the init and its pid namespace go with it)."""
        self.dead = self.dead or why
        if self._proc is not None:
            self._proc.kill()  # Popen.kill: a no-op once it has exited

    def close(self) -> None:
        self.closed, self.dead = True, self.dead or "the sandbox is closed"
        self._sock.close()  # EOF: the init exits, and every process of the sandbox dies with it
        if self._proc is not None:
            if not _exited(self._proc, CLOSE_WAIT):
                self._proc.kill()
            self._proc.wait()
        if self._joining is not None:
            self._joining.result()  # it ends with bwrap (EOF on --info-fd, or a move that now fails)
        os.close(self._err)


class Command:
    """One command in the init: what output.drain needs of a Popen, and ended: (exit code,
    time.monotonic()) of its main process as the init reaped it, before killing what it left."""

    def __init__(self, init: Init, cid: int, status_fd: int):
        self._init, self._cid, self._status, self._buf = init, cid, status_fd, b""
        self.returncode, self._killed_at, self.ended = None, None, None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is not None:
            return self.returncode
        if timeout is None and self._killed_at is not None:
            timeout = max(0.0, self._killed_at + KILL_WAIT - time.monotonic())
        line = self._line(timeout)
        if line is False:
            if self._killed_at is None:
                raise subprocess.TimeoutExpired("sandbox command", timeout)
            self._init.abort("the sandbox's init did not stop a command in time; it was killed with it")
            line = b"X-9"
        os.close(self._status)
        self.returncode = -9
        if line is None:  # EOF without a status: the sandbox was closed (killed, as at a timeout), or its init died
            if self._init.closed:
                return self.returncode
            self._init.alive()
            raise InitDied(self._init.dead or "the sandbox's init died")
        if line.startswith(b"E"):
            raise NotStarted(line[1:].decode(errors="replace"))
        with contextlib.suppress(ValueError):
            self.returncode = int(line[1:]) if line.startswith(b"X") else -9
        return self.returncode

    def _line(self, timeout):
        """The next status line but D lines (into ended); False at the timeout; None at a bare EOF."""
        end = None if timeout is None else time.monotonic() + timeout
        while True:
            while b"\n" not in self._buf:
                if not _ready(self._status, select.POLLIN, None if end is None else max(0.0, end - time.monotonic())):
                    return False
                data = os.read(self._status, _MAX_STATUS)
                if not data:
                    return self._buf or None
                self._buf = (self._buf + data)[-_MAX_STATUS:]
            line, self._buf = self._buf.split(b"\n", 1)
            if not line.startswith(b"D"):
                return line
            with contextlib.suppress(ValueError, OverflowError):  # not what the init writes: as if it had said nothing
                code, ns = line[1:].split()
                self.ended = int(code), int(ns) / 1e9

    def kill(self) -> None:
        if self.returncode is None and self._killed_at is None:
            self._killed_at = time.monotonic()
            self._init.kill(self._cid)


def run(start_init, script: str, env: dict[str, str], deadline: float, output_bytes: int, disk):
    """`bash -c script` in start_init()'s init, drained (output.drain); a long script goes as a memfd."""
    script_fd, argv = None, ["/bin/bash", "-c", script]
    if len(script.encode()) > INLINE_SCRIPT_BYTES:
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
    return drain(proc, deadline, output_bytes, proc.kill, disk, lambda: proc.ended)


def _write_all(fd: int, data: bytes) -> None:
    with contextlib.suppress(OSError):  # bwrap failed: the first command says why
        with open(fd, "wb") as f:
            f.write(data)


def _exited(proc: subprocess.Popen, timeout: float) -> bool:
    """Has proc exited within timeout? Its pidfd wakes us at once (Popen.wait sleeps in growing steps)."""
    if proc.returncode is not None:
        return True
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:  # Linux < 5.3
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
