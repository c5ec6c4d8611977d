"""What the Sandbox API takes and gives: Limits, ExecResult, SandboxError, and exec's argument checks."""

import math
from dataclasses import asdict, dataclass, field

MAX_TIMEOUT = 24 * 3600.0


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
        command.encode("utf-8")  # lone surrogates
    except UnicodeEncodeError as e:
        raise ValueError(f"command is not valid UTF-8: {e}") from None
    return command


def validate_timeout(timeout) -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(f"timeout must be a number of seconds, got {timeout!r}")
    if not math.isfinite(timeout) or timeout <= 0 or timeout > MAX_TIMEOUT:
        raise ValueError(f"timeout must be in (0, {MAX_TIMEOUT:.0f}] seconds, got {timeout!r}")
    return float(timeout)
