"""Landlock for the fallback tier, through ctypes.

restrict(rw=[...]) makes the calling thread (and what it execs) read-only everywhere but `rw` and a
few devices, hides /proc but for a few system-wide files (PROC_VISIBLE), denies every TCP bind and
connect (ABI >= 4), and scopes signals and abstract Unix sockets to its own domain (ABI >= 6): a
command cannot signal the supervisor or its init. Landlock grants, never subtracts: "read-only but
/proc" is a rule per entry of / plus listing / itself (a procfs mounted elsewhere stays readable).
UDP and pathname Unix sockets are seccomp.py's (no socket() at all in the fallback tier).
"""

import ctypes
import os

_SYS = {"create_ruleset": 444, "add_rule": 445, "restrict_self": 446}  # same on x86_64 and aarch64
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH, _RULE_NET_PORT = 1, 2

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # ABI 2, 3, 5
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1             # ABI 4
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1  # ABI 6

READ = EXECUTE | READ_FILE | READ_DIR
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV
# what stays readable of /proc: system-wide figures that tools like free, uptime and nproc read
PROC_VISIBLE = ("cpuinfo", "meminfo", "stat", "uptime", "loadavg", "version", "filesystems", "sys")


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


def _syscall(name: str, *args) -> int:
    r = _libc.syscall(ctypes.c_long(_SYS[name]), *args)
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"landlock_{name}: {os.strerror(e)}")
    return r


def abi_version() -> int:  # 0 when the kernel has no Landlock (or it is disabled)
    try:
        return _syscall("create_ruleset", None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0


def restrict(rw: list[str]) -> None:
    """Apply the ruleset to the calling thread. Needs no_new_privs (or CAP_SYS_ADMIN)."""
    abi = abi_version()
    if abi < 1:
        raise OSError("Landlock is not available on this kernel")
    fs = (1 << 13) - 1 | (REFER if abi >= 2 else 0) | (TRUNCATE if abi >= 3 else 0) | (IOCTL_DEV if abi >= 5 else 0)
    # (path, rights, required): an entry of / that went away since the listing is skipped;
    # isdir/isfile follow symlinks
    readable = [p for p in ("/" + n for n in sorted(os.listdir("/")) if n != "proc")
                if os.path.isdir(p) or os.path.isfile(p)]
    readable += ["/proc/" + n for n in PROC_VISIBLE if os.path.exists("/proc/" + n)]
    rules = ([("/", READ_DIR, False)] + [(p, READ, False) for p in readable] + [(p, fs, True) for p in rw]
             + [(p, FILE_RIGHTS | READ_FILE, True) for p in ("/dev/null", "/dev/zero")])
    attr = _RulesetAttr(fs, NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0,
                        SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0)
    size = 8 if abi < 4 else 16 if abi < 6 else 24
    ruleset = _syscall("create_ruleset", ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    try:
        for path, rights, required in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                if required:
                    raise
                continue
            try:
                # a rule on a file may only carry file rights
                allowed = rights if os.path.isdir(path) else rights & FILE_RIGHTS
                rule = _PathBeneath(allowed & fs, fd)
                _syscall("add_rule", ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH),
                         ctypes.byref(rule), ctypes.c_uint32(0))
            finally:
                os.close(fd)
        _syscall("restrict_self", ctypes.c_int(ruleset), ctypes.c_uint32(0))
    finally:
        os.close(ruleset)
