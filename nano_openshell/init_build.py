"""The namespaced tier's init as a program: nsinit.c compiled once per machine, or None (nsinit.py then).

The binary is cached by the hash of its source and compiler command in a directory only this user can
write (~/.cache/nano-openshell, else a private one in the temp directory): a file another user could
replace would run as every sandbox's pid 1. Every sandbox execs the one file opened and checked
(open_binary): a later swap of the path changes nothing. NANO_OPENSHELL_INIT=python forces the
Python init (and =c fails loudly where it cannot be built).
"""

import functools
import hashlib
import marshal
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading

_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nsinit.c")
_FLAGS = ["-O2", "-std=gnu11", "-Wall"]
_LOCK = threading.Lock()
_BUILT: dict[str, tuple[str, int] | None] = {}  # cache key -> (path, its open fd); None: cannot be built
_WHY: dict[str, str] = {}  # cache key -> why it could not be built


def kind() -> str:
    """Which init new sandboxes get: "c" or "python" (NANO_OPENSHELL_INIT, default auto)."""
    wanted = os.environ.get("NANO_OPENSHELL_INIT", "auto")
    if wanted not in ("auto", "c", "python"):
        raise ValueError(f"NANO_OPENSHELL_INIT must be auto, c or python, got {wanted!r}")
    if wanted == "python":
        return "python"
    if binary() is not None:
        return "c"
    if wanted == "c":
        raise RuntimeError(f"NANO_OPENSHELL_INIT=c, but the C init cannot be built here: {why_not()}")
    return "python"


def binary() -> str | None:  # built on first use; None where no C compiler works
    built = _built()
    return built[0] if built else None


def open_binary() -> int:  # a new fd of the checked binary, to exec as /proc/self/fd/N
    built = _built()
    if built is None:
        raise RuntimeError(f"the C init cannot be built here: {why_not()}")
    return os.dup(built[1])


def _built() -> tuple[str, int] | None:
    key = _key()
    with _LOCK:
        if key not in _BUILT:
            try:
                path = _build(key)
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
                if not _trusted(os.fstat(fd)):
                    os.close(fd)
                    raise RuntimeError(f"{path} was changed while it was being checked")
                _BUILT[key] = (path, fd)
            except (OSError, subprocess.SubprocessError, RuntimeError) as e:  # RuntimeError: ours, saying why
                _BUILT[key], _WHY[key] = None, str(e)
        return _BUILT[key]


def why_not() -> str:
    return _WHY.get(_key(), "")


def _key() -> str:
    return _key_for(os.environ.get("CC", "cc"), os.environ.get("PATH", ""))


@functools.lru_cache(maxsize=8)
def _key_for(cc: str, path: str) -> str:
    """The build's cache key: machine, source, compiler, flags (computed once per CC and PATH)."""
    compiler = shutil.which(cc, path=path) or ""
    try:
        with open(_SOURCE, "rb") as f:
            source = f.read()
    except OSError:  # an installation without it: the Python init (binary() says why)
        source = b""
    digest = hashlib.sha256(source + "\0".join([compiler] + _FLAGS).encode()).hexdigest()[:16]
    return f"{os.uname().machine}-{digest}"


def _cache_dir() -> str:
    """The first of these that is a directory of ours no other user can write (made so if new)."""
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    for candidate in (os.path.join(home, "nano-openshell"),
                      os.path.join(tempfile.gettempdir(), f"nano-openshell-{os.geteuid()}")):
        try:
            os.makedirs(candidate, mode=0o700, exist_ok=True)
            st = os.lstat(candidate)
        except OSError:
            continue
        if _trusted(st, stat.S_ISDIR) and os.access(candidate, os.W_OK):
            return candidate
    return tempfile.mkdtemp(prefix="nano-openshell-init-")


def _trusted(st: os.stat_result, kind=stat.S_ISREG) -> bool:  # ours, and no other user can write it
    return kind(st.st_mode) and st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _build(key: str) -> str:
    cache = _cache_dir()
    target = os.path.join(cache, f"nsinit-{key}")
    try:
        if _trusted(os.lstat(target)):
            return _checked(target)
    except FileNotFoundError:
        pass
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise RuntimeError("no C compiler (cc) on PATH")
    fd, tmp = tempfile.mkstemp(prefix=".nsinit-", dir=cache)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_FLAGS, "-o", tmp, _SOURCE], capture_output=True, text=True,
                              timeout=120, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, target)  # atomic: a concurrent build of the same source writes the same file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    for name in os.listdir(cache):  # older sources' builds (a process still using one holds it open)
        if name.startswith("nsinit-") and name != os.path.basename(target):
            os.unlink(os.path.join(cache, name))
    return _checked(target)


def _checked(path: str) -> str:
    """path, once it has run (a cache on a noexec mount would fail every sandbox's start instead)."""
    done = subprocess.run([path, "--check"], capture_output=True, timeout=30, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"{path} does not run here (exit {done.returncode})")
    return path


# The Python init gets its program on stdin: its code compiled here (rather than at every sandbox
# start), used when the sandbox's Python has our bytecode format (the cache tag), else its source.
PYTHON_BOOT = ("import sys, marshal\n"
               "tag, size, rest = sys.stdin.buffer.read().split(b'\\n', 2)\n"
               "try:\n"
               "    code = marshal.loads(rest[:int(size)]) if tag == sys.implementation.cache_tag.encode() else None\n"
               "except Exception:\n"
               "    code = None\n"
               "exec(code or compile(rest[int(size):], 'nsinit.py', 'exec'))\n")


@functools.cache
def python_program() -> bytes:
    with open(os.path.join(os.path.dirname(_SOURCE), "nsinit.py"), "rb") as f:
        source = f.read()
    code = marshal.dumps(compile(source, "nsinit.py", "exec"))
    return b"%s\n%d\n" % (sys.implementation.cache_tag.encode(), len(code)) + code + source
