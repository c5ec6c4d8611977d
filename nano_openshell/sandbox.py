"""Sandbox: run one bash command at a time for an agent, isolated, bounded, never hung (docs/design.md).

Tiers (probe.py says which work here): "namespaced" (namespaced.py, launcher.py), "fallback" (an init
per command: fallback.py), "none" (only with allow_unisolated). As root, each Sandbox runs as an
unprivileged uid of its own and hands the workspace to it before every exec (workspace.Handover).
"""

import asyncio
import concurrent.futures
import os
import random
import shutil
import threading
import time
import weakref

from . import fallback, launcher, namespaced, seccomp
from .api import ExecResult, Limits, SandboxError, validate_command, validate_timeout
from .cgroup import SandboxCgroup
from .disk import DiskCheck, Meter
from .forwarder import sandbox_prelude
from .owned import SANDBOX_UIDS, Owned, close_all, temp_dir  # noqa: F401 (close_all: what a leaving process calls)
from .probe import TIERS, probe
from .proxy import ProxyServer, handshake
from .workspace import Handover, remove_later, remove_soon

SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
PASSED_THROUGH = ("LANG", "LC_ALL", "TERM", "TZ")  # harmless supervisor settings the command inherits
_EXECUTOR = concurrent.futures.ThreadPoolExecutor(64, thread_name_prefix="nano-openshell")  # aexec's (threads: on use)


class Sandbox:
    def __init__(self, workspace=None, policy=None, limits: Limits | None = None,
                 min_tier: str = "namespaced", allow_unisolated: bool = False,
                 tier: str | None = None, env: dict[str, str] | None = None,
                 mounts: dict[str, str | None] | None = None, use_cgroup: bool = True):
        """docs/design.md has the arguments; tier: exactly this tier (it must work here and be >= min_tier),
        None: the best one. env: on top of the allowlist."""
        self.limits = limits if limits is not None else Limits()
        if not isinstance(self.limits, Limits):
            raise TypeError("limits must be a Limits")
        self.probe = probe()
        self.tier = self._choose_tier(min_tier, tier, allow_unisolated)
        for k, v in (env or {}).items():
            if not (isinstance(k, str) and isinstance(v, str)) or not k or "=" in k or "\x00" in k + v:
                raise ValueError(f"bad environment entry {k!r}={v!r}")
        self._extra_env = dict(env or {})
        mounts = namespaced.check_mounts(mounts)
        if mounts and self.tier != "namespaced":
            raise SandboxError(f"mounts at fixed paths ({', '.join(sorted(mounts))}) need the namespaced tier: the "
                               f"{self.tier!r} tier runs commands in the host's own filesystem, where it cannot "
                               "mount anything (run the task in the workspace instead)")
        self._closed = False
        self._disk = Meter()  # what the files take on disk, kept up to date by every command (disk.py)
        self._handovers, self._handover_lock = [], threading.Lock()  # as root: the workspace's, each mount's
        self._owned = Owned()  # every Sandbox of the process is known to close_all() from here on
        self._release = weakref.finalize(self, self._owned.release)  # at close() or collection
        self._proxy = self._socket_fd = self.handshake = None
        self._mounts = {}  # path in the sandbox -> the host directory behind it
        self.cgroup, self.cgroup_reason = None, "not asked for (use_cgroup=False)"
        if workspace is None:
            workspace = temp_dir("ws")
            self._owned.add_dir(workspace)
        self.workspace = os.path.realpath(os.fspath(workspace))
        # as root, the command runs under this Sandbox's own unprivileged uid
        self.uid = random.randrange(SANDBOX_UIDS.start, SANDBOX_UIDS.stop) \
            if os.geteuid() == 0 and self.tier != "none" else None
        try:
            if not os.path.isdir(self.workspace):
                raise ValueError(f"workspace {self.workspace!r} does not exist or is not a directory")
            if self.uid is not None and not namespaced.reachable(os.path.dirname(self.workspace), drop_uid=True):
                raise SandboxError(f"workspace {self.workspace!r} is not reachable by the sandbox's unprivileged "
                                   "uid: as root, every directory above it must be world-traversable (o+x)")
            for path, source in mounts.items():
                self._mounts[path] = temp_dir("mnt")
                self._owned.add_dir(self._mounts[path])
                if source is not None:
                    shutil.copytree(os.fspath(source), self._mounts[path], symlinks=True, dirs_exist_ok=True)
            try:  # what the files take now: a first command over the limit is killed for what it adds
                self._disk.settle([self.workspace, *self._mounts.values()])
            except OSError:
                pass  # the first command's check says why the files cannot be measured, and kills it
            if self.uid is not None:
                self._handovers = [Handover(root, self.uid) for root in [self.workspace, *sorted(self._mounts.values())]]
                for h in self._handovers:  # the rest is walked before the first command, on its clock
                    h.claim_root()
            if use_cgroup and self.tier != "none":
                self.cgroup, self.cgroup_reason = SandboxCgroup.create(self.limits.memory_bytes, self.limits.processes)
                self._owned.cgroup = self.cgroup
            if policy is not None:
                self._start_proxy(policy)
            if self.tier == "namespaced":
                self._start_namespaces()
            self.gaps = self._gaps()
        except BaseException:
            self.close()
            raise

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

    def _start_proxy(self, policy) -> None:
        if self.tier != "namespaced":
            raise SandboxError(f"a network policy needs the namespaced tier (its own network namespace); "
                               f"the {self.tier!r} tier has no egress at all, and is not downgraded silently")
        # <dir> (0700; 0711 when the sandbox has its own uid) holds the audit log; the socket sits in
        # <dir>/sock, 0700 and the sandbox uid's: bwrap must reach it, no one else may
        sup = temp_dir("sup")
        self._owned.add_dir(sup)
        sock_dir = os.path.join(sup, "sock")
        os.mkdir(sock_dir, 0o700)
        if self.uid is not None:
            os.chmod(sup, 0o711)
            os.chown(sock_dir, self.uid, self.uid)
        sock = os.path.join(sock_dir, "proxy.sock")
        self._proxy = ProxyServer(policy, sock, audit_path=os.path.join(sup, "audit.jsonl"),
                                  info={"tier": self.tier, "capabilities": self.probe["capabilities"]},
                                  socket_mode=0o666, audit_max_bytes=self.limits.audit_log_bytes,
                                  rate=(self.limits.proxy_requests_per_second, self.limits.proxy_request_burst))
        self._owned.proxy = self._proxy.start()
        self.handshake = handshake(sock)
        self.audit_path = self._proxy.audit_path
        self._socket_fd = os.open(sock, os.O_PATH | os.O_CLOEXEC)
        self._owned.fds.append(self._socket_fd)

    def _start_namespaces(self) -> None:  # bwrap and the init start now, booting in the background
        ws_fd = os.open(self.workspace, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        self._owned.fds.append(ws_fd)
        try:
            self._namespaces = self._owned.init = launcher.Namespaces(
                self.probe["capabilities"]["bwrap"], self.limits.tmp_bytes, self.uid, ws_fd, self._mounts,
                self._socket_fd, seccomp.deny_list(), self.cgroup.leaf() if self.cgroup else None, SAFE_PATH)
        except launcher.InitDied as e:
            raise SandboxError(str(e)) from None
        self._namespaces.get()

    def _gaps(self) -> list[str]:  # the probe's, the memory one as this Sandbox's cgroup decides
        gaps = [g for g in self.probe["tiers"][self.tier]["gaps"] if not g.startswith("memory")]
        if self.cgroup is not None and "memory" in self.cgroup.capped:
            return gaps
        why = self.cgroup_reason if self.cgroup is None else "no memory controller we may use"
        return gaps + [f"memory is capped per process (RLIMIT_AS), not per sandbox: {why}"]

    def path_of(self, path: str) -> str:
        """The host directory behind /workspace or one of the Sandbox's mounts."""
        if path == namespaced.WORKDIR:
            return self.workspace
        if path not in self._mounts:
            known = ", ".join([namespaced.WORKDIR] + sorted(self._mounts))
            raise ValueError(f"{path!r} is not a directory of this sandbox (it has: {known})")
        return self._mounts[path]

    def _env(self, home: str, tmpdir: str) -> dict[str, str]:
        env = {"PATH": SAFE_PATH, "HOME": home, "PWD": home, "TMPDIR": tmpdir, "SHELL": "/bin/bash",
               "USER": "sandbox", "LOGNAME": "sandbox", "LANG": "C.UTF-8", "TERM": "dumb"}
        env.update({k: os.environ[k] for k in PASSED_THROUGH if k in os.environ})
        return {**env, **self._extra_env}

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
            code, out, err, timed_out = self._exec_namespaced(command, start + timeout,
                                                                   self._disk_check([], self._namespaces.leaf))
        else:
            code, out, err, timed_out = self._exec_init(command, start + timeout)
        return ExecResult(code, out.text(), err.text(), timed_out, out.truncated or err.truncated,
                          round((time.monotonic() - start) * 1000, 3), self.tier, list(self.gaps))

    async def aexec(self, command, timeout: float = 30.0) -> ExecResult:
        return await asyncio.get_running_loop().run_in_executor(_EXECUTOR, self.exec, command, timeout)

    def _hand_over(self, deadline: float) -> bool:
        """As root, the workspace and mounts to the sandbox's uid: False when the deadline came first."""
        if not self._handovers:
            return True
        if not self._handover_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        try:
            return all(h.run(deadline) for h in self._handovers)
        finally:
            self._handover_lock.release()

    def _disk_check(self, extra_roots: list[str], leaf) -> DiskCheck:  # over every host directory it can write
        return DiskCheck(self._disk, [self.workspace, *self._mounts.values(), *extra_roots], self.limits.disk_bytes,
                         leaf)

    def _exec_namespaced(self, command: str, deadline: float, disk: DiskCheck):
        script = self.limits.ulimit_line()
        if self._proxy is not None:
            script += sandbox_prelude(namespaced.PROXY_SOCKET, python=self._namespaces.python) + "\n"
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
            isolated, caps = self.tier == "fallback", self.probe["capabilities"]
            cfg = {"rlimits": self.limits.rlimits(), "workspace": self.workspace, "tmpdir": tmpdir, "uid": self.uid,
                   "gid": self.uid, "landlock": isolated and caps["landlock_abi"] > 0,
                   "seccomp": isolated and caps["seccomp"], "env": self._env(self.workspace, tmpdir)}
            leaf = self.cgroup.leaf() if self.cgroup else None
            return fallback.run(command, cfg, leaf, SAFE_PATH, deadline, self.limits.output_bytes, self._owned,
                                self._disk_check([tmpdir], leaf))
        finally:
            with self._disk.lock:  # it goes with the command: no longer counted (drain stopped the passes)
                self._disk.forget(tmpdir)
            if time.monotonic() < deadline:  # it may hold any number of files: the rest in the background
                remove_soon(tmpdir, deadline)
            else:
                remove_later(tmpdir)

    def wait_ready(self, timeout: float = 10.0) -> bool:
        """Wait, running nothing, until a command would not wait for the init's boot (namespaced tier; the
        others start an init per command): False when it died or took longer."""
        return self.tier != "namespaced" or (not self._closed and self._namespaces.ready(time.monotonic() + timeout))

    def close(self) -> None:
        """Kill every command still running (its exec returns with exit_code -9), give back what it holds
        (owned.py). Idempotent."""
        self._closed = True
        self._release()

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
