"""Sandbox: run one bash command at a time for an agent, isolated, bounded, never hung.

    with Sandbox() as sb:
        r = sb.exec("echo hi", timeout=10)
        r.exit_code, r.stdout, r.stderr, r.timed_out, r.truncated, r.duration_ms, r.tier

Tiers (probe.py decides which work here, and says why): "namespaced" (bwrap, see namespaced.py),
"fallback" (a subreaper init with Landlock + seccomp, see initproc.py) and "none" (the same init with
no isolation, only with allow_unisolated=True). Every tier kills the whole process tree at the
timeout, closes stdin, caps the output it keeps and gives the command an allowlisted environment.

As root, each Sandbox picks its own unprivileged uid for its commands and hands the workspace to it
(before every exec, whatever the host wrote there since the last one; a host chown of an existing
file in place is not undone), so the workspace's parents must be world-traversable.
In the namespaced tier a root Sandbox starts its commands through one launcher of its own, already
under that uid (launcher.py): one program start per command (bwrap), not two.
Where the host lets us create one (cgroup.py; as root it usually does), each Sandbox has its own
cgroup: memory (Limits.memory_bytes) and processes (Limits.processes) are capped for the sandbox as a
whole, and its commands are killed by cgroup.kill. Without one, a command's tree is killed by
scanning /proc for its init's descendants, and memory is bounded per process only (RLIMIT_AS).
What a Sandbox does not protect here is listed in `gaps` (ExecResult.gaps, probe's tiers[t]["gaps"]).
Known limits: disk use in the workspace is bounded per file (RLIMIT_FSIZE), not in total; in the
fallback tier Landlock (below ABI 9) does not cover connect() to pathname Unix sockets, and a
non-root supervisor's sandboxes share its uid, so they can read (not write) each other's workspaces.
"""

import asyncio
import concurrent.futures
import math
import os
import random
import selectors
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import asdict, dataclass, field

from . import initproc, launcher, namespaced, seccomp
from .cgroup import SandboxCgroup
from .probe import TIERS, probe

MAX_TIMEOUT = 24 * 3600.0
INLINE_SCRIPT_BYTES = 64 * 1024  # larger commands travel as a file (argv strings are capped at 128 KiB)
SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PASSED_THROUGH = ("LANG", "LC_ALL", "TERM", "TZ")  # harmless supervisor settings the command inherits
PROXY_URL = "http://127.0.0.1:3128"
_KILL_GRACE = 0.3  # after a kill, how long we still wait for the pipes to reach EOF


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
    reports it, in every tier); negative (-9) when the supervisor killed the sandbox, which it does
    only at the timeout: timed_out is the authority. stdout/stderr: UTF-8 with errors replaced,
    head and tail kept when longer than Limits.output_bytes (truncated=True, the cut is marked).
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


class _Capped:
    """Keeps the first and last bytes of a stream; memory stays bounded whatever is written."""

    def __init__(self, cap: int):
        self.head_cap, self.tail_cap = cap // 2, cap - cap // 2
        self.head, self.tail, self.total = bytearray(), bytearray(), 0

    def add(self, data: bytes) -> None:
        self.total += len(data)
        room = self.head_cap - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if data:
            self.tail += data[-self.tail_cap:]
            if len(self.tail) > 2 * self.tail_cap:
                del self.tail[:-self.tail_cap]

    @property
    def truncated(self) -> bool:
        return self.total > self.head_cap + self.tail_cap

    def text(self) -> str:
        tail = bytes(self.tail[-self.tail_cap:])
        if not self.truncated:
            return (bytes(self.head) + tail).decode("utf-8", errors="replace")
        dropped = self.total - len(self.head) - len(tail)
        return (bytes(self.head).decode("utf-8", errors="replace")
                + f"\n[... nano-openshell: {dropped} bytes truncated ...]\n"
                + tail.decode("utf-8", errors="replace"))


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


_SBIN_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"
_UID_DROPPER = None


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
_SECCOMP = {}
_EXECUTOR = None
_EXECUTOR_LOCK = threading.Lock()


def _seccomp_program(unix_only: bool) -> bytes:
    if unix_only not in _SECCOMP:
        _SECCOMP[unix_only] = seccomp.deny_list(unix_only=unix_only)
    return _SECCOMP[unix_only]


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="nano-openshell")
        return _EXECUTOR


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
        self._handed_over = {}  # root -> its directory state when it was last handed over whole
        self._owned = _Owned()
        self._fds = self._owned.fds
        self._proxy = None
        self._launcher = None
        self._release = weakref.finalize(self, self._owned.release)  # runs at close() or collection
        self.handshake = None
        self._extra_env = self._check_env(env or {})
        self._mounts = {}  # path in the sandbox -> the host directory behind it
        mounts = self._check_mounts(mounts)
        self.cgroup, self.cgroup_reason = None, "not asked for (use_cgroup=False)"
        self._processes_in_cgroup = False  # does every process of this tier start inside self.cgroup

        if workspace is None:
            workspace = tempfile.mkdtemp(prefix="nano-openshell-ws-")
            self._owned.dirs.append(workspace)
        self.workspace = os.path.realpath(os.fspath(workspace))
        # as root, the command runs under this Sandbox's own unprivileged uid (see namespaced.py)
        self.uid = random.randrange(100000, 100000 + (1 << 20)) if os.geteuid() == 0 and self.tier != "none" else None
        try:
            if not os.path.isdir(self.workspace):
                raise ValueError(f"workspace {self.workspace!r} does not exist or is not a directory")
            if self.uid is not None and not namespaced.reachable(os.path.dirname(self.workspace), drop_uid=True):
                raise SandboxError(f"workspace {self.workspace!r} is not reachable by the sandbox's unprivileged "
                                   "uid: as root, every directory above it must be world-traversable (o+x)")
            self._make_mounts(mounts)
            self._fix_workspace_owner()
            if use_cgroup and self.tier != "none":
                self.cgroup, self.cgroup_reason = SandboxCgroup.create(self.limits.memory_bytes,
                                                                       self.limits.processes)
                self._owned.cgroup = self.cgroup
                self._processes_in_cgroup = self.cgroup is not None and self.tier == "fallback"
            if self.tier == "namespaced":
                self._bwrap_argv = namespaced.base_argv(self.probe["capabilities"]["bwrap"],
                                                        self.limits.tmp_bytes, self.uid is not None)
                ws_fd = os.open(self.workspace, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
                self._fds.append(ws_fd)
                self._bwrap_argv += namespaced.workspace_args(ws_fd)
                self._bwrap_argv += namespaced.mount_args(self._mounts)
                self._start_launcher(ws_fd)
            if policy is not None:
                self._start_proxy(policy)
            self.gaps = self._gaps()
        except BaseException:
            self.close()
            raise

    # ---- setup -------------------------------------------------------------------------------
    _LAUNCH_FDS = {"workspace": 3, "seccomp": 4, "socket": 5, "script": 6}  # fd numbers inside bwrap

    def _start_launcher(self, ws_fd: int) -> None:
        """As root: one launcher per Sandbox, already under the sandbox uid (launcher.py), so a command
        costs one program start (bwrap), not two. Without a uid-drop tool or a Python the sandbox uid
        can run, each command drops the uid itself (_exec_namespaced)."""
        self._ws_fd = ws_fd
        drop = uid_drop_argv(self.uid) if self.uid is not None else None
        python = namespaced.forwarder_python(True) if drop else None
        if python is None:
            return
        self._launch_argv = self._bwrap_argv[:-len(namespaced.workspace_args(ws_fd) + namespaced.mount_args(
            self._mounts))]
        self._launch_argv += namespaced.workspace_args(self._LAUNCH_FDS["workspace"]) + namespaced.mount_args(
            self._mounts)
        self._launcher = self._owned.launcher = launcher.Launcher(drop, python, {"PATH": SAFE_PATH})
        if self.cgroup is not None:  # idle until the first command: every bwrap starts inside
            self.cgroup.leaf().add(self._launcher._proc.pid)
            self._processes_in_cgroup = True

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
        if not mounts:
            return {}
        if not isinstance(mounts, dict):
            raise TypeError(f"mounts must be a dict {{path in the sandbox: None or a host directory}}, got {mounts!r}")
        paths = sorted(namespaced.check_mount_path(p) for p in mounts)
        for a, b in zip(paths, paths[1:]):
            if b.startswith(a + "/"):
                raise ValueError(f"mount paths {a!r} and {b!r} overlap")
        for path, source in mounts.items():
            if source is not None and not os.path.isdir(os.fspath(source)):
                raise ValueError(f"mount {path!r}: host directory {source!r} does not exist or is not a directory")
        if self.tier != "namespaced":
            raise SandboxError(f"mounts at fixed paths ({', '.join(paths)}) need the namespaced tier: the "
                               f"{self.tier!r} tier runs commands in the host's own filesystem, where it cannot "
                               "mount anything (run the task in the workspace instead)")
        return mounts

    def _make_mounts(self, mounts: dict) -> None:
        for path, source in mounts.items():
            host = tempfile.mkdtemp(prefix="nano-openshell-mnt-")
            self._owned.dirs.append(host)
            if source is not None:
                shutil.copytree(os.fspath(source), host, symlinks=True, dirs_exist_ok=True)
            self._mounts[path] = host

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
        self._supervisor_dir = tempfile.mkdtemp(prefix="nano-openshell-sup-")
        self._owned.dirs.append(self._supervisor_dir)
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
        self._forwarder_python = namespaced.forwarder_python(self.uid is not None)
        if self._forwarder_python is None:
            raise SandboxError("no Python that the sandbox can execute for the network forwarder")
        fd = os.open(sock, os.O_PATH | os.O_CLOEXEC)
        self._fds.append(fd)
        self._socket_fd = fd

    def _fix_workspace_owner(self) -> None:
        """As root, hand the workspace to the sandbox uid. fd-relative and never following symlinks,
        so a link planted by the command cannot make us chown a host file; files with several hard
        links are left alone too (where protected_hardlinks is off, one could be a host file).

        The walk over every file is skipped when no directory of the workspace changed (same inodes,
        same mtimes) since the last walk: a file the host writes, moves or links in changes its
        directory's mtime, and the command's own files are its uid's already. The state is taken
        before the walk, so a write during it shows next time; it is not trusted while a directory
        changed within _FRESH_NS (coarse timestamp ticks: a later write could keep the same mtime).
        Not seen: the host chowning an existing file in place (writers create files, they do not chown)."""
        if self.uid is None:
            return
        for root in [self.workspace] + sorted(self._mounts.values()):
            self._hand_over(root)

    def _hand_over(self, root: str) -> None:
        os.chown(root, self.uid, self.uid, follow_symlinks=False)
        os.chmod(root, 0o700)
        state = _directory_state(root)
        if state is not None and state == self._handed_over.get(root):
            return
        self._handed_over[root] = state
        for _, dirs, files, dir_fd in os.fwalk(root, follow_symlinks=False):
            for name in dirs + files:
                try:
                    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                    if st.st_uid != self.uid and (st.st_nlink == 1 or stat.S_ISDIR(st.st_mode)):
                        os.chown(name, self.uid, self.uid, dir_fd=dir_fd, follow_symlinks=False)
                except FileNotFoundError:
                    pass

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
        self._fix_workspace_owner()
        start = time.monotonic()
        if self.tier == "namespaced":
            code, out, err, timed_out = self._exec_namespaced(command, start + timeout)
        else:
            code, out, err, timed_out = self._exec_init(command, start + timeout)
        return ExecResult(code, out.text(), err.text(), timed_out, out.truncated or err.truncated,
                          round((time.monotonic() - start) * 1000, 3), self.tier, list(self.gaps))

    async def aexec(self, command, timeout: float = 30.0) -> ExecResult:
        return await asyncio.get_running_loop().run_in_executor(_executor(), self.exec, command, timeout)

    def _exec_namespaced(self, command: str, deadline: float):
        script = self.limits.ulimit_line()
        if self._proxy is not None:
            from .forwarder import sandbox_prelude

            script += sandbox_prelude(namespaced.PROXY_SOCKET, python=self._forwarder_python) + "\n"
        script += command
        prog_r, prog_w = os.pipe()
        owned = [prog_r]
        try:
            os.write(prog_w, _seccomp_program(False))  # a few hundred bytes: fits the pipe buffer
            os.close(prog_w)
            script_fd = None
            if len(script.encode()) > INLINE_SCRIPT_BYTES:
                script_fd = os.memfd_create("nano-openshell-command", 0)
                owned.append(script_fd)
                os.write(script_fd, script.encode())
                os.lseek(script_fd, 0, os.SEEK_SET)
                tail = ["/bin/bash", namespaced.SCRIPT_PATH]
            else:
                tail = ["/bin/bash", "-c", script]
            sock_fd = self._socket_fd if self._proxy is not None else None
            if self._launcher is not None:
                proc = self._spawn_launched(prog_r, script_fd, sock_fd, tail)
                return _drain(proc, deadline, self.limits.output_bytes, proc.kill, self._owned)
            argv = self._bwrap_argv + namespaced.command_args(prog_r, script_fd, sock_fd) + tail
            user = {}
            drop = uid_drop_argv(self.uid) if self.uid is not None else None
            if drop:
                # a tool changes the uid, so Popen may vfork: a fork of a supervisor holding GBs
                # (torch loaded) costs tens of ms, more than the whole sandbox
                argv = drop + argv
            elif self.uid is not None:
                user = dict(user=self.uid, group=self.uid, extra_groups=[])
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=self._env(namespaced.WORKDIR, "/tmp"),
                                    pass_fds=tuple(self._fds + owned), **user)
        finally:
            for fd in owned:
                os.close(fd)
        # killing bwrap kills its pid 1 (--die-with-parent), and with it the whole pid namespace
        return _drain(proc, deadline, self.limits.output_bytes, proc.kill, self._owned)

    def _spawn_launched(self, prog_fd: int, script_fd: int | None, sock_fd: int | None, tail: list[str]):
        at = self._LAUNCH_FDS
        argv = self._launch_argv + namespaced.command_args(
            at["seccomp"], at["script"] if script_fd is not None else None,
            at["socket"] if sock_fd is not None else None) + tail
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        fds, targets = [out_w, err_w, self._ws_fd, prog_fd], [1, 2, at["workspace"], at["seccomp"]]
        for fd, name in ((sock_fd, "socket"), (script_fd, "script")):
            if fd is not None:
                fds.append(fd)
                targets.append(at[name])
        try:
            proc = self._launcher.spawn(argv, self._env(namespaced.WORKDIR, "/tmp"), fds, targets)
        except BaseException:
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        proc.stdout, proc.stderr = open(out_r, "rb", buffering=0), open(err_r, "rb", buffering=0)
        return proc

    def _exec_init(self, command: str, deadline: float):
        tmpdir = tempfile.mkdtemp(prefix="nano-openshell-tmp-")
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
                return _drain(init.proc, deadline, self.limits.output_bytes, init.stop, self._owned)
            finally:
                init.close()
        finally:
            _rmtree(tmpdir)

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


class _Owned:
    """What a Sandbox gives back on close (kept apart from it so a finalizer can release it too)."""

    def __init__(self):
        self.fds: list[int] = []
        self.proxy = None
        self.launcher = None
        self.cgroup = None
        self.dirs: list[str] = []  # removed on release: a temporary workspace, the supervisor dir
        self.running: set = set()  # the kill function of every command in flight
        self.lock = threading.Lock()
        self.released = False

    def track(self, kill) -> None:
        """A command started: release() kills it; once released, it is killed at once."""
        with self.lock:
            if not self.released:
                self.running.add(kill)
                return
        kill()

    def untrack(self, kill) -> None:
        with self.lock:
            self.running.discard(kill)

    def release(self) -> None:
        with self.lock:
            self.released, running = True, list(self.running)
        for kill in running:  # no command outlives its Sandbox (its workspace is about to go)
            kill()
        if self.cgroup is not None:
            self.cgroup.close()  # whatever is left, at once; then the cgroup directories go
            self.cgroup = None
        if self.launcher is not None:
            self.launcher.close()
            self.launcher = None
        if self.proxy is not None:
            self.proxy.stop()
            self.proxy = None
        while self.fds:
            os.close(self.fds.pop())
        while self.dirs:
            _rmtree(self.dirs.pop())


def _drain(proc: subprocess.Popen, deadline: float, cap: int, kill,
           owned: "_Owned | None" = None) -> tuple[int, _Capped, _Capped, bool]:
    """Read stdout/stderr until EOF or the deadline; at the deadline kill, then give the pipes a short
    grace to reach EOF (they do once the tree is dead) and stop reading regardless. owned: the
    Sandbox's, so that close() kills the command meanwhile."""
    out, err = _Capped(cap), _Capped(cap)
    sinks = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    sel = selectors.DefaultSelector()
    for fd in sinks:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    timed_out, give_up = False, None
    try:
        if owned is not None:
            owned.track(kill)
        while sel.get_map():
            now = time.monotonic()
            if not timed_out and now >= deadline:
                timed_out, give_up = True, now + _KILL_GRACE
                kill()
            if give_up is not None and now >= give_up:
                break
            for key, _ in sel.select(max(0.0, (give_up or deadline) - now)):
                try:
                    data = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if data:
                    sinks[key.fd].add(data)
                else:
                    sel.unregister(key.fd)
        if not timed_out:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                kill()
        proc.wait()
    finally:
        if owned is not None:
            owned.untrack(kill)
        sel.close()
        proc.stdout.close()
        proc.stderr.close()
    return proc.returncode, out, err, timed_out


_FRESH_NS = 250_000_000


def _directory_state(root: str) -> frozenset | None:
    """(path, inode, mtime) of every directory under root (symlinks not followed); None when one
    changed too recently for its mtime to tell a later change apart."""
    fresh_after = time.time_ns() - _FRESH_NS
    state = []
    for path, _, _, dir_fd in os.fwalk(root, follow_symlinks=False):
        st = os.fstat(dir_fd)
        if st.st_mtime_ns >= fresh_after:
            return None
        state.append((path, st.st_ino, st.st_mtime_ns))
    return frozenset(state)


def _rmtree(path: str) -> None:
    def retry(func, p, _exc):  # the command may have left read-only directories behind
        try:
            os.chmod(os.path.dirname(p), 0o700)
            func(p)
        except OSError:
            pass

    if sys.version_info >= (3, 12):  # onerror is deprecated there; the handler fits both
        shutil.rmtree(path, onexc=retry)
    else:
        shutil.rmtree(path, onerror=retry)
    if os.path.exists(path):
        shutil.rmtree(path, ignore_errors=True)
