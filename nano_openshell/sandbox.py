"""Sandbox: run one bash command at a time for an agent, isolated, bounded, never hung.

    with Sandbox() as sb:
        r = sb.exec("echo hi", timeout=10)
        r.exit_code, r.stdout, r.stderr, r.timed_out, r.truncated, r.duration_ms, r.tier

Tiers (probe.py decides which work here, and says why): "namespaced" (bwrap, see namespaced.py),
"fallback" (a subreaper init with Landlock + seccomp, see initproc.py) and "none" (the same init with
no isolation, only with allow_unisolated=True). Every tier kills the whole process tree at the
timeout, closes stdin, caps the output it keeps and gives the command an allowlisted environment.

As root, each Sandbox picks its own unprivileged uid for its commands and hands the workspace to it
(before every exec, whatever the host wrote there since the last one, on the command's clock: see
workspace.py), so the workspace's parents must be world-traversable.
In the namespaced tier a Sandbox keeps one set of namespaces for its whole life: one bwrap, started
at Sandbox() and booting in the background, whose pid 1 is our init (launcher.py, nsinit.c), so a
command costs a posix_spawn inside, not a sandbox start. /tmp and /dev/shm last as long as the
Sandbox; each command gets a fresh TMPDIR, cwd /workspace, and its whole process tree killed at its end.
Where the host lets us create one (cgroup.py; as root it usually does), each Sandbox has its own
cgroup: memory (Limits.memory_bytes) and processes (Limits.processes) are capped for the sandbox as a
whole (the namespaced tier's bwrap and init are moved in before its first command), and the fallback
tier's commands are killed by cgroup.kill. Without one, a fallback command's tree is killed by
scanning /proc for its init's descendants, and memory is bounded per process only (RLIMIT_AS).
A process that leaves without running its atexit handlers (os._exit, a signal it dies of) calls
close_all() first, or its sandboxes' workspaces stay in the temp dir (owned.py).
What a Sandbox does not protect here is listed in `gaps` (ExecResult.gaps, probe's tiers[t]["gaps"]).
Disk: one file is capped by RLIMIT_FSIZE, all of a sandbox's files on the host by Limits.disk_bytes
(disk.py: a command taking them past it is killed). Known limits: a fallback command can create no
socket (Landlock below ABI 9 cannot keep it off host Unix sockets: seccomp.py), and a non-root
supervisor's sandboxes share its uid, so they can read (not write) each other's workspaces.
"""

import asyncio
import concurrent.futures
import math
import os
import random
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field

from . import initproc, launcher, namespaced, seccomp
from . import workspace as workspace_mod
from .cgroup import SandboxCgroup
from .disk import DiskCheck, Meter
from .output import Capped as _Capped, drain as _drain  # noqa: F401 (_Capped: tests)
from .owned import SANDBOX_UIDS, Owned, close_all, temp_dir  # noqa: F401 (close_all: what a leaving process calls)
from .probe import TIERS, probe

MAX_TIMEOUT = 24 * 3600.0
INLINE_SCRIPT_BYTES = 64 * 1024  # larger commands travel as a file (argv strings are capped at 128 KiB)
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PASSED_THROUGH = ("LANG", "LC_ALL", "TERM", "TZ")  # harmless supervisor settings the command inherits
PROXY_URL = "http://127.0.0.1:3128"


class SandboxError(RuntimeError):
    """The sandbox cannot run here as asked (tier below min_tier, policy without network isolation...)."""


@dataclass(frozen=True)
class Limits:
    address_space_bytes: int = 4 << 30
    file_size_bytes: int = 256 << 20
    cpu_seconds: int = 60
    processes: int = 256
    open_files: int = 1024
    output_bytes: int = 256 << 10   # kept per stream: head and tail, the middle is dropped
    tmp_bytes: int = 256 << 20      # size of the private /tmp (namespaced tier)
    command_bytes: int = 4 << 20    # the longest command accepted
    memory_bytes: int = 4 << 30     # all the sandbox's processes together (its cgroup's memory.max)
    disk_bytes: int = 1 << 30       # what its files may take on the host's disk, all together (disk.py)
    proxy_requests_per_second: int = 50  # egress requests refused (429) beyond this rate...
    proxy_request_burst: int = 200       # ...once a burst of this many is spent (a token bucket)
    audit_log_bytes: int = 4 << 20  # the proxy's audit log rotates at this size (one old file kept)

    def __post_init__(self):
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"Limits.{name} must be a positive int, got {value!r}")
        if self.output_bytes < 64:
            raise ValueError("Limits.output_bytes must be at least 64")

    def rlimits(self) -> dict[str, int]:
        return {"RLIMIT_AS": self.address_space_bytes, "RLIMIT_FSIZE": self.file_size_bytes,
                "RLIMIT_CPU": self.cpu_seconds, "RLIMIT_NPROC": self.processes,
                "RLIMIT_NOFILE": self.open_files, "RLIMIT_CORE": 0}

    def ulimit_line(self) -> str:
        """bash's ulimit: -v and -f in KiB (bash's units outside POSIX mode), hard and soft."""
        return (f"ulimit -H -S -v {self.address_space_bytes // 1024} -f {self.file_size_bytes // 1024} "
                f"-t {self.cpu_seconds} -u {self.processes} -n {self.open_files} -c 0 || "
                "{ echo 'nano-openshell: could not set limits' >&2; exit 126; }\n")


@dataclass
class ExecResult:
    """exit_code: the command's status; 128+N when a signal N killed it inside the sandbox (as bash
    reports it, in every tier); negative (-9) when the supervisor killed the sandbox: at the timeout
    (timed_out), when the sandbox's files passed Limits.disk_bytes (stderr says so), or at close().
    stdout/stderr: UTF-8 with errors replaced, head and tail kept when longer than
    Limits.output_bytes (truncated=True, the cut is marked).
    gaps: what this sandbox does not protect on this host (Sandbox.gaps), one sentence each."""
    exit_code: int
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool
    duration_ms: float
    tier: str
    gaps: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def validate_command(command) -> str:
    if isinstance(command, (bytes, bytearray)):
        try:
            command = bytes(command).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"command is not valid UTF-8: {e}") from None
    if not isinstance(command, str):
        raise TypeError(f"command must be a str, got {type(command).__name__}")
    if not command.strip():
        raise ValueError("command is empty")
    if "\x00" in command:
        raise ValueError("command contains a NUL byte")
    try:
        command.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"command is not valid UTF-8: {e}") from None
    return command


def validate_timeout(timeout) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
    if not math.isfinite(timeout) or timeout <= 0 or timeout > MAX_TIMEOUT:
        raise ValueError(f"timeout must be in (0, {MAX_TIMEOUT:.0f}] seconds, got {timeout!r}")
    return float(timeout)


_SECCOMP = {}
_EXECUTOR = None
_EXECUTOR_LOCK = threading.Lock()


def _seccomp_program(no_sockets: bool) -> bytes:
    if no_sockets not in _SECCOMP:
        _SECCOMP[no_sockets] = seccomp.deny_list(no_sockets=no_sockets)
    return _SECCOMP[no_sockets]


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="nano-openshell")
        return _EXECUTOR


_INIT_BOOT = ("import sys; sys.path.insert(0, sys.argv[1]); "
              "from nano_openshell.initproc import main; main()")
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Sandbox:
    def __init__(self, workspace=None, policy=None, limits: Limits | None = None,
                 min_tier: str = "namespaced", allow_unisolated: bool = False,
                 tier: str | None = None, env: dict[str, str] | None = None,
                 mounts: dict[str, str | None] | None = None, use_cgroup: bool = True):
        """tier: run exactly this tier (it must work here and be >= min_tier); None = the best one.
        env: extra variables for the command (on top of the allowlist).
        mounts: {path in the sandbox: None or a host directory}: a writable directory of this Sandbox's
        own at each fixed absolute path (namespaced tier only), empty (None) or a copy of the host
        directory, removed at close; path_of(path) is where the host sees it.
        use_cgroup=False: no cgroup even where one could be made (tests of the path without one)."""
        self.limits = limits if limits is not None else Limits()
        if not isinstance(self.limits, Limits):
            raise TypeError("limits must be a Limits")
        self.probe = probe()
        self.tier = self._choose_tier(min_tier, tier, allow_unisolated)
        self._closed = False
        self._disk = Meter()  # what the files take on disk, kept up to date by every command (disk.py)
        self._handovers = []  # workspace.Handover per root (as root): the workspace, each mount
        self._handover_lock = threading.Lock()
        self._owned = Owned()  # every Sandbox of the process is known to close_all() from here on
        self._fds = self._owned.fds
        self._proxy = None
        self._release = weakref.finalize(self, self._owned.release)  # runs at close() or collection
        self.handshake = None
        self._extra_env = self._check_env(env or {})
        self._mounts = {}  # path in the sandbox -> the host directory behind it
        mounts = self._check_mounts(mounts)
        self.cgroup, self.cgroup_reason = None, "not asked for (use_cgroup=False)"
        self._processes_in_cgroup = False  # does every command of this tier start inside self.cgroup

        if workspace is None:
            workspace = temp_dir("ws")
            self._owned.add_dir(workspace)
        self.workspace = os.path.realpath(os.fspath(workspace))
        # as root, the command runs under this Sandbox's own unprivileged uid (see namespaced.py)
        isolated_as_root = os.geteuid() == 0 and self.tier != "none"
        self.uid = random.randrange(SANDBOX_UIDS.start, SANDBOX_UIDS.stop) if isolated_as_root else None
        try:
            if not os.path.isdir(self.workspace):
                raise ValueError(f"workspace {self.workspace!r} does not exist or is not a directory")
            if self.uid is not None and not namespaced.reachable(os.path.dirname(self.workspace), drop_uid=True):
                raise SandboxError(f"workspace {self.workspace!r} is not reachable by the sandbox's unprivileged "
                                   "uid: as root, every directory above it must be world-traversable (o+x)")
            self._make_mounts(mounts)
            self._measure_files()
            if self.uid is not None:
                self._handovers = [workspace_mod.Handover(root, self.uid)
                                   for root in [self.workspace] + sorted(self._mounts.values())]
                for h in self._handovers:  # the rest is walked before the first command, on its clock
                    h.claim_root()
            if use_cgroup and self.tier != "none":
                self.cgroup, self.cgroup_reason = SandboxCgroup.create(self.limits.memory_bytes,
                                                                       self.limits.processes)
                self._owned.cgroup = self.cgroup
                self._processes_in_cgroup = self.cgroup is not None  # namespaced: the init is moved in first
            if policy is not None:
                self._start_proxy(policy)
            if self.tier == "namespaced":
                self._start_namespaces()
            self.gaps = self._gaps()
        except BaseException:
            self.close()
            raise

    # ---- setup -------------------------------------------------------------------------------
    def _start_namespaces(self) -> None:
        """This Sandbox's bwrap and init (launcher.Namespaces): started now, booting in the background."""
        ws_fd = os.open(self.workspace, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._fds.append(ws_fd)
        try:
            self._namespaces = self._owned.init = launcher.Namespaces(
                self.probe["capabilities"]["bwrap"], self.limits.tmp_bytes, self.uid, ws_fd, self._mounts,
                self._socket_fd if self._proxy is not None else None, _seccomp_program(False),
                self.cgroup.leaf() if self.cgroup is not None else None, SAFE_PATH)
        except launcher.InitDied as e:
            raise SandboxError(str(e)) from None
        self._python = self._namespaces.python
        self._namespaces.get()

    def _choose_tier(self, min_tier, tier, allow_unisolated) -> str:
        if min_tier not in TIERS:
            raise ValueError(f"min_tier must be one of {TIERS}, got {min_tier!r}")
        if tier is not None and tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS} or None, got {tier!r}")
        tiers = self.probe["tiers"]
        if tier is None:
            tier = next(t for t in reversed(TIERS) if tiers[t]["ok"])
        elif not tiers[tier]["ok"]:
            raise SandboxError(f"tier {tier!r} does not work here: {tiers[tier]['reason']}")
        if TIERS.index(tier) < TIERS.index(min_tier):
            why = "; ".join(f"{t}: {tiers[t]['reason']}" for t in TIERS[TIERS.index(min_tier):])
            raise SandboxError(f"best isolation here is {tier!r}, below min_tier={min_tier!r} ({why})")
        if tier == "none" and not allow_unisolated:
            raise SandboxError("running without isolation needs allow_unisolated=True")
        return tier

    def _gaps(self) -> list[str]:
        """The probe's gaps for this tier, with the memory one decided for this Sandbox."""
        gaps = [g for g in self.probe["tiers"][self.tier]["gaps"] if not g.startswith("memory")]
        if self.cgroup is None:
            why = self.cgroup_reason
        elif not self._processes_in_cgroup:
            why = "this Sandbox's processes do not start in its cgroup"
        elif "memory" not in self.cgroup.capped:
            why = "no memory controller we may use"
        else:
            return gaps
        return gaps + [f"memory is capped per process (RLIMIT_AS), not per sandbox: {why}"]

    @staticmethod
    def _check_env(env: dict) -> dict[str, str]:
        for k, v in env.items():
            if not (isinstance(k, str) and isinstance(v, str)) or not k or "=" in k or "\x00" in k + v:
                raise ValueError(f"bad environment entry {k!r}={v!r}")
        return dict(env)

    def _check_mounts(self, mounts) -> dict:
        mounts = workspace_mod.check_mounts(mounts)
        if mounts and self.tier != "namespaced":
            raise SandboxError(f"mounts at fixed paths ({', '.join(sorted(mounts))}) need the namespaced tier: the "
                               f"{self.tier!r} tier runs commands in the host's own filesystem, where it cannot "
                               "mount anything (run the task in the workspace instead)")
        return mounts

    def _make_mounts(self, mounts: dict) -> None:
        for path, source in mounts.items():
            self._mounts[path] = workspace_mod.make_mount_dir(source)
            self._owned.add_dir(self._mounts[path])

    def _measure_files(self) -> None:
        """What the workspace and the mounts take when the Sandbox is made: the first command is
        allowed that much if it is over the limit (it is killed for what it adds)."""
        try:
            self._disk.settle([self.workspace, *self._mounts.values()])
        except OSError:
            pass  # the first command's check says why the files cannot be measured, and kills it

    def path_of(self, path: str) -> str:
        """The host directory behind a path of the sandbox: /workspace or one of the Sandbox's mounts."""
        if path == namespaced.WORKDIR:
            return self.workspace
        if path not in self._mounts:
            known = ", ".join([namespaced.WORKDIR] + sorted(self._mounts))
            raise ValueError(f"{path!r} is not a directory of this sandbox (it has: {known})")
        return self._mounts[path]

    def _start_proxy(self, policy) -> None:
        if self.tier != "namespaced":
            raise SandboxError(f"a network policy needs the namespaced tier (its own network namespace); "
                               f"the {self.tier!r} tier has no egress at all, and is not downgraded silently")
        from .proxy import PROTOCOL_VERSION, ProxyServer, handshake

        # <dir> (0700; 0711 when the sandbox has its own uid) holds the audit log; the socket sits in
        # <dir>/sock, 0700 and owned by the sandbox's uid: bwrap must reach it, no one else may
        self._supervisor_dir = temp_dir("sup")
        self._owned.add_dir(self._supervisor_dir)
        sock_dir = os.path.join(self._supervisor_dir, "sock")
        os.mkdir(sock_dir, 0o700)
        if self.uid is not None:
            os.chmod(self._supervisor_dir, 0o711)
            os.chown(sock_dir, self.uid, self.uid)
        sock = os.path.join(sock_dir, "proxy.sock")
        info = {"tier": self.tier, "capabilities": self.probe["capabilities"]}
        # the socket may be opened by the sandbox's uid; the private directory guards it from the host
        self._proxy = ProxyServer(policy, sock, audit_path=os.path.join(self._supervisor_dir, "audit.jsonl"),
                                  info=info, socket_mode=0o666, audit_max_bytes=self.limits.audit_log_bytes,
                                  rate=(self.limits.proxy_requests_per_second, self.limits.proxy_request_burst))
        self._owned.proxy = self._proxy.start()
        self.handshake = handshake(sock, protocol=PROTOCOL_VERSION)
        self.audit_path = self._proxy.audit_path
        fd = os.open(sock, os.O_PATH | os.O_CLOEXEC)
        self._fds.append(fd)
        self._socket_fd = fd

    def _hand_over(self, deadline: float) -> bool:
        """As root, hand the workspace and the mounts to the sandbox's uid (workspace.py), within the
        command's time: False when the deadline came first (the command does not run)."""
        if not self._handovers:
            return True
        if not self._handover_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        try:
            return all(h.run(deadline) for h in self._handovers)
        finally:
            self._handover_lock.release()

    def _env(self, home: str, tmpdir: str) -> dict[str, str]:
        env = {"PATH": SAFE_PATH, "HOME": home, "PWD": home, "TMPDIR": tmpdir, "SHELL": "/bin/bash",
               "USER": "sandbox", "LOGNAME": "sandbox", "LANG": "C.UTF-8", "TERM": "dumb"}
        env.update({k: os.environ[k] for k in PASSED_THROUGH if k in os.environ})
        if self._proxy is not None:
            env.update(HTTP_PROXY=PROXY_URL, HTTPS_PROXY=PROXY_URL, http_proxy=PROXY_URL, https_proxy=PROXY_URL)
        env.update(self._extra_env)
        return env

    # ---- running -----------------------------------------------------------------------------
    def exec(self, command, timeout: float = 30.0) -> ExecResult:
        command = validate_command(command)
        timeout = validate_timeout(timeout)
        if len(command.encode("utf-8")) > self.limits.command_bytes:
            raise ValueError(f"command is longer than Limits.command_bytes={self.limits.command_bytes}")
        if self._closed:
            raise SandboxError("the sandbox is closed")
        start = time.monotonic()  # the handover is the command's time too: it counts, and it is cut
        if not self._hand_over(start + timeout):
            seen = sum(h.entries for h in self._handovers)
            return ExecResult(-9, "", f"nano-openshell: handing the workspace to the sandbox took longer than the "
                              f"command's timeout ({seen} entries looked at); the command did not run\n", True,
                              False, round((time.monotonic() - start) * 1000, 3), self.tier, list(self.gaps))
        if self.tier == "namespaced":
            code, out, err, timed_out = self._exec_namespaced(command, start + timeout, self._disk_check([]))
        else:
            code, out, err, timed_out = self._exec_init(command, start + timeout)
        return ExecResult(code, out.text(), err.text(), timed_out, out.truncated or err.truncated,
                          round((time.monotonic() - start) * 1000, 3), self.tier, list(self.gaps))

    async def aexec(self, command, timeout: float = 30.0) -> ExecResult:
        return await asyncio.get_running_loop().run_in_executor(_executor(), self.exec, command, timeout)

    def _disk_check(self, extra_roots: list[str]) -> DiskCheck:
        """The check of Limits.disk_bytes over the host directories this command can write to: the
        workspace, the mounts and (tiers without namespaces) its TMPDIR."""
        return DiskCheck(self._disk, [self.workspace, *self._mounts.values(), *extra_roots], self.limits.disk_bytes)

    def _exec_namespaced(self, command: str, deadline: float, disk: DiskCheck):
        """One command through the Sandbox's init (launcher.py, nsinit.c): a posix_spawn of bash in
        namespaces that already exist. A dead init is replaced for the next command."""
        script = self.limits.ulimit_line()
        if self._proxy is not None:
            from .forwarder import sandbox_prelude

            script += sandbox_prelude(namespaced.PROXY_SOCKET, python=self._python) + "\n"
        try:
            return launcher.run(self._namespaces.get, script + command, self._env(namespaced.WORKDIR, "/tmp"),
                                deadline, self.limits.output_bytes, disk)
        except launcher.InitDied as e:
            if self._closed:
                raise SandboxError("the sandbox is closed") from None
            raise SandboxError(f"the sandbox's init died ({e}); the command did not finish "
                               "(the next one starts a new init)") from None
        except launcher.NotStarted as e:
            raise SandboxError(f"the sandbox could not start the command: {e}") from None

    def _exec_init(self, command: str, deadline: float):
        tmpdir = temp_dir("tmp")
        try:
            if self.uid is not None:
                os.chown(tmpdir, self.uid, self.uid)
            isolated = self.tier == "fallback"
            caps = self.probe["capabilities"]
            argv = ["bash", "-c", command]
            if len(command.encode()) > INLINE_SCRIPT_BYTES:
                path = os.path.join(tmpdir, ".nano-openshell-command.sh")
                with open(path, "w") as f:
                    f.write(command)
                argv = ["bash", path]
            cfg = {"supervisor_pid": os.getpid(), "rlimits": self.limits.rlimits(),
                   "workspace": self.workspace, "tmpdir": tmpdir, "uid": self.uid, "gid": self.uid,
                   "landlock": isolated and caps["landlock_abi"] > 0,
                   "seccomp": _seccomp_program(True).hex() if isolated and caps["seccomp"] else None,
                   "argv": argv, "env": self._env(self.workspace, tmpdir)}
            init = initproc.Init(cfg, self.cgroup.leaf() if self.cgroup is not None else None, SAFE_PATH)
            try:
                code, out, err, timed_out = _drain(init.proc, deadline, self.limits.output_bytes, init.stop,
                                                   self._owned, self._disk_check([tmpdir]))
                ended = init.ended()
                if timed_out and ended is not None and ended[1] < deadline:  # only its leftovers' kill ran late
                    code, timed_out = ended[0], False
                return code, out, err, timed_out
            finally:
                init.close()
        finally:
            self._remove_tmpdir(tmpdir, deadline)

    def _remove_tmpdir(self, tmpdir: str, deadline: float) -> None:
        """A command's TMPDIR goes with it: no longer counted, and removed until the deadline (it may
        hold any number of files), the rest in the background."""
        with self._disk.lock:  # the command's passes are over (drain stopped them)
            self._disk.forget(tmpdir)
        try:
            gone = time.monotonic() < deadline and workspace_mod.remove(tmpdir, deadline)
        except OSError:
            gone = False
        if not gone:
            workspace_mod.remove_later(tmpdir)

    def wait_ready(self, timeout: float = 10.0) -> bool:
        """Wait, running nothing, until the first command would not wait for the init's boot (the
        namespaced tier; the others start an init per command): False when it died or took longer."""
        return self.tier != "namespaced" or (not self._closed and self._namespaces.ready(time.monotonic() + timeout))

    # ---- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Kill every command still running (its exec returns with exit_code -9), stop the proxy,
        close our fds, remove the cgroup and the temporary workspace. Idempotent."""
        self._closed = True
        self._release()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
