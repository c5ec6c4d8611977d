"""Seccomp filters as classic BPF, compiled here without libseccomp: deny_list() for the namespaced
tier (bwrap --seccomp FD), deny_list(no_sockets=True) for the fallback tier (_no_sockets says why), and
deny_namespaces(), what a rootless container does to us, which `python -c "import sys; from
nano_openshell.seccomp import main; sys.exit(main())" --deny-namespaces -- CMD...` execs CMD under
(scripts/test_legs.sh, leg 2).
"""

import ctypes
import errno
import functools
import os
import struct
import sys

# struct seccomp_data: int nr; u32 arch; u64 ip; u64 args[6]  (little endian on both arches)
_OFF_NR, _OFF_ARCH = 0, 4


def _arg_lo(i: int) -> int:
    return 16 + 8 * i  # the low 32 bits of args[i]


RET_ALLOW = 0x7FFF0000
RET_KILL_PROCESS = 0x80000000


def RET_ERRNO(e: int) -> int:
    return 0x00050000 | (e & 0xFFFF)


_LD_W_ABS, _JEQ, _JGE, _JSET, _RET, _AND_K = 0x20, 0x15, 0x35, 0x45, 0x06, 0x54

CLONE_NEW_FLAGS = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000
                   | 0x40000000 | 0x00000080)  # NEWNS CGROUP UTS IPC USER PID NET TIME
AF_UNIX = 1
SOCK_TYPE_MASK, SOCK_STREAM, SOCK_SEQPACKET = 0xF, 1, 5  # the type without SOCK_NONBLOCK/SOCK_CLOEXEC

# syscall numbers: (x86_64, aarch64); every one but the last four is denied outright (DENIED)
_NUMBERS = {
    "ptrace": (101, 117), "mount": (165, 40), "umount2": (166, 39), "unshare": (272, 97), "setns": (308, 268),
    "bpf": (321, 280), "io_uring_setup": (425, 425), "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427), "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "perf_event_open": (298, 241), "userfaultfd": (323, 282), "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271), "pivot_root": (155, 41), "chroot": (161, 51), "open_tree": (428, 428),
    "move_mount": (429, 429), "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432),
    "fspick": (433, 433), "mount_setattr": (442, 442), "kexec_load": (246, 104), "kexec_file_load": (320, 294),
    "init_module": (175, 105), "finit_module": (313, 273), "delete_module": (176, 106), "swapon": (167, 224),
    "swapoff": (168, 225), "reboot": (169, 142), "acct": (163, 89), "quotactl": (179, 60),
    "name_to_handle_at": (303, 264), "open_by_handle_at": (304, 265), "kcmp": (312, 272), "syslog": (103, 116),
    "clone": (56, 220), "clone3": (435, 435), "socket": (41, 198), "socketpair": (53, 199)
}
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
DENIED = tuple(_NUMBERS)[:-4]


def machine() -> str:
    m = os.uname().machine.lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(m, m)


def supported() -> bool:
    return machine() in _AUDIT_ARCH


def _ins(code: int, k: int = 0, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("<HBBI", code, jt, jf, k)


def _compile(rules: list[tuple[str, list[bytes]]], arch: str | None = None) -> bytes:
    """rules: (syscall name, body) where body is BPF that ends in a return. Everything else is allowed."""
    arch = arch or machine()
    if arch not in _AUDIT_ARCH:
        raise OSError(f"seccomp filters are not built for architecture {arch!r}")
    column = list(_AUDIT_ARCH).index(arch)
    prog = [_ins(_LD_W_ABS, _OFF_ARCH), _ins(_JEQ, _AUDIT_ARCH[arch], 1, 0), _ins(_RET, RET_KILL_PROCESS),
            _ins(_LD_W_ABS, _OFF_NR)]
    if arch == "x86_64":  # the x32 ABI would reach the same syscalls under other numbers
        prog += [_ins(_JGE, 0x40000000, 0, 1), _ins(_RET, RET_ERRNO(errno.ENOSYS))]
    for name, body in rules:
        assert len(body) < 256
        prog.append(_ins(_JEQ, _NUMBERS[name][column], 0, len(body)))
        prog += body
    prog.append(_ins(_RET, RET_ALLOW))
    return b"".join(prog)


def _deny(e: int = errno.EPERM) -> list[bytes]:
    return [_ins(_RET, RET_ERRNO(e))]


def _no_new_namespaces() -> list[tuple[str, list[bytes]]]:
    """clone() without any CLONE_NEW* bit (its flags are args[0] on both arches); clone3 passes its flags
    in a struct that BPF cannot read: ENOSYS makes glibc fall back to clone."""
    return [("clone", [_ins(_LD_W_ABS, _arg_lo(0)), _ins(_JSET, CLONE_NEW_FLAGS, 0, 1),
                       _ins(_RET, RET_ERRNO(errno.EPERM)), _ins(_RET, RET_ALLOW)]),
            ("clone3", _deny(errno.ENOSYS))]


def _no_sockets() -> list[tuple[str, list[bytes]]]:
    """No socket() at all, and socketpair() only for connected AF_UNIX stream and seqpacket pairs. Where
    the host's filesystem is in view (the fallback tier), a socket that can connect() or sendto() reaches
    every host pathname Unix socket its uid may write (docker's, an engine's): Landlock scopes only
    abstract ones (ABI 6), pathname ones from ABI 9, and seccomp cannot read the path. A connected stream
    pair cannot be connected again (EISCONN) nor given an address; a datagram pair could do both."""
    # socketpair(AF_UNIX, SOCK_STREAM or SOCK_SEQPACKET, ...): args[0] is the domain, args[1] the type
    pairs = [_ins(_LD_W_ABS, _arg_lo(0)), _ins(_JEQ, AF_UNIX, 0, 5),
             _ins(_LD_W_ABS, _arg_lo(1)), _ins(_AND_K, SOCK_TYPE_MASK),
             _ins(_JEQ, SOCK_STREAM, 1, 0), _ins(_JEQ, SOCK_SEQPACKET, 0, 1),
             _ins(_RET, RET_ALLOW), _ins(_RET, RET_ERRNO(errno.EAFNOSUPPORT))]
    return [("socket", _deny(errno.EAFNOSUPPORT)), ("socketpair", pairs)]


@functools.cache  # compiled once per process and arguments
def deny_list(no_sockets: bool = False, arch: str | None = None) -> bytes:
    rules = [(n, _deny()) for n in DENIED] + _no_new_namespaces()
    if no_sockets:
        rules += _no_sockets()
    return _compile(rules, arch)


def deny_namespaces(arch: str | None = None) -> bytes:
    return _compile([("unshare", _deny()), ("setns", _deny())] + _no_new_namespaces(), arch)


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 22, 36, 38
_SECCOMP_MODE_FILTER = 2


def prctl(option: int, arg2, arg3=0) -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(option, arg2, arg3, 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl({option}): {os.strerror(e)}")


def install(program: bytes) -> None:
    """Install a filter on the calling thread (no_new_privs set first). Raises OSError on failure."""
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    buf = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.addressof(buf))
    prctl(PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(fprog))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 3 or argv[0] != "--deny-namespaces" or argv[1] != "--":
        print("usage: ... --deny-namespaces -- CMD [ARGS...]", file=sys.stderr)
        return 2
    install(deny_namespaces())
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    sys.exit(main())
