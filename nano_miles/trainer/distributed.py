"""The trainer's process group: N ranks, one device each, started by torchrun or by `launch`.

A rank learns its place from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), so `torchrun --nproc-per-node N` and `launch(N, ...)` start the same thing. NCCL on GPUs,
gloo on CPU; `cpu_group` (gloo, the same ranks) carries DCP's background writer and small Python
objects. Every group has a timeout: a rank that dies or hangs makes the others' next collective fail.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import tempfile
import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, NoReturn

import psutil
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from nano_openshell.sandbox import close_all as close_sandboxes


class DistError(RuntimeError):
    """A one-line account of what failed and on which rank (failures: the agent's {rank: ProcessFailure})."""

    def __init__(self, message: str, failures: dict | None = None):
        super().__init__(message)
        self.failures = failures or {}


@dataclass
class DistEnv:
    rank: int
    world_size: int
    device: torch.device  # GPU LOCAL_RANK on cuda
    cpu_group: Any = None  # gloo group over the same ranks

    def where(self) -> str:
        return f"rank {self.rank}/{self.world_size} ({socket.gethostname()}, pid {os.getpid()})"


def rank_env() -> tuple[int, int] | None:
    """(rank, world size) when this process is one of torchrun's (or launch's) ranks."""
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def rank_device_type(trainer_device: str) -> str:
    """'cuda' or 'cpu': where a trainer of `trainer_device` (auto: a GPU if one is visible) runs its ranks."""
    if trainer_device == "auto":
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
    return torch.device(trainer_device).type


def check_nproc(nproc, device_type: str) -> None:
    """Raise DistError unless `nproc` ranks can run on `device_type`."""
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise DistError(f"trainer.nproc must be an integer >= 1, got {nproc!r}")
    if device_type == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if nproc > have:
            raise DistError(f"trainer.nproc={nproc} needs {nproc} GPUs (one per rank) but {have} "
                            f"{'is' if have == 1 else 'are'} visible")
    elif device_type != "cpu":
        raise DistError(f"the trainer's ranks run on 'cuda' or 'cpu', not {device_type!r}")


def init_distributed(device_type: str = "auto", timeout_s: float = 300.0) -> DistEnv:
    """Join the process group of torchrun's environment (on cuda, GPU LOCAL_RANK); timeout_s bounds
    every collective of both groups."""
    if rank_env() is None:
        raise DistError("RANK is not set: start the ranks with torchrun or nano_miles.trainer.distributed.launch")
    env, local_rank = DistEnv(*rank_env(), torch.device("cpu")), int(os.environ["LOCAL_RANK"])
    cuda = rank_device_type(device_type) == "cuda"
    if cuda:
        if local_rank >= torch.cuda.device_count():
            raise DistError(f"{env.where()}: local rank {local_rank} needs GPU {local_rank} but "
                            f"{torch.cuda.device_count()} are visible")
        env.device = torch.device("cuda", local_rank)
        torch.cuda.set_device(env.device)
    timeout = timedelta(seconds=timeout_s)
    try:  # device_id: NCCL forms its communicator now, so a bad GPU fails here
        dist.init_process_group("nccl" if cuda else "gloo", timeout=timeout,
                                device_id=env.device if cuda else None)
        env.cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    except Exception as e:
        raise DistError(f"{env.where()}: joining the process group failed: "
                        f"{type(e).__name__}: {_first_line(e)}") from e
    return env


def _first_line(e: BaseException | str) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def is_collective_failure(e: BaseException) -> bool:
    """A collective failed or timed out: another rank died or stopped answering."""
    text = str(e)
    return isinstance(e, dist.DistError) or "Timed out" in text or "by peer" in text or "Connection closed" in text


def run_rank(fn: Callable, *args, device_type: str = "auto", timeout_s: float = 300.0):
    """A rank's main: join the group, run fn(env, *args), leave the group. Any failure is re-raised
    as DistError naming this rank, which torchrun's error file records for the launcher."""
    env = None
    try:
        env = init_distributed(device_type, timeout_s)
        return fn(env, *args)
    except DistError:
        raise
    except Exception as e:
        hint = " (a collective failed: another rank died or stopped answering)" if is_collective_failure(e) else ""
        raise DistError(f"{env.where() if env else 'rank ?'}: {type(e).__name__}: {_first_line(e)}{hint}") from e
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def launch(nproc: int, entrypoint: Callable | str, args: tuple | list = (), *, device_type: str = "cpu",
           shutdown_timeout_s: int = 5, agent_signals: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT") -> dict[int, Any]:
    """Start `nproc` ranks on this host through torch.distributed.run's elastic agent, wait for them.
    entrypoint: a picklable function (returns {rank: its value}) or a program such as sys.executable
    (each rank runs `program *args`, as torchrun would). When one rank fails the agent stops the others
    and this raises DistError naming every failed rank. agent_signals: those that stop every rank."""
    check_nproc(nproc, device_type)
    # shutdown_timeout (how long a failed rank's siblings get after SIGTERM) is torch >= 2.12's;
    # signals_to_handle a field of recent ones (older ones read TORCHELASTIC_SIGNALS_TO_HANDLE)
    extra = {k: v for k, v in (("shutdown_timeout", shutdown_timeout_s), ("signals_to_handle", agent_signals))
             if k in LaunchConfig.__dataclass_fields__}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0,
                          monitor_interval=0.1, start_method="spawn", **extra)
    # torchrun would set OMP_NUM_THREADS=1 with a warning; split this host's cores between the ranks.
    environ = {"TORCHELASTIC_SIGNALS_TO_HANDLE": agent_signals,
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(max(1, (os.cpu_count() or 1) // nproc))}
    was = {k: os.environ.get(k) for k in environ}
    os.environ.update(environ)
    # The agent installs its own SIGINT/SIGTERM/SIGHUP/SIGQUIT handlers and leaves them behind; put
    # the caller's back, or a later Ctrl-C in this process would kill it instead of raising.
    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
    handlers = {sig: signal.getsignal(sig) for sig in signals}
    try:
        return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as e:
        raise DistError(describe_failures(e.failures), e.failures) from None
    finally:
        for key, value in was.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def launch_ranks(nproc: int, device_type: str, module: str, config_toml: str, args: list[str]) -> int:
    """`python -m MODULE --config FILE ARGS` as `nproc` ranks (FILE holds config_toml); returns the exit
    code. Ctrl-C goes to rank 0 alone, not to the agent (which would stop every rank at once). A failure
    is one line on stderr naming the rank that failed first, unless rank 0 ended the run itself."""
    fd, config_path = tempfile.mkstemp(prefix="nano-miles-ranks-", suffix=".toml")
    with os.fdopen(fd, "w") as f:
        f.write(config_toml)
    previous = signal.signal(signal.SIGINT, _forward_sigint_to_rank0)
    try:
        launch(nproc, sys.executable, ["-m", module, "--config", config_path, *args], device_type=device_type,
               agent_signals="SIGTERM,SIGHUP,SIGQUIT")
    except DistError as e:
        failures = e.failures
        rank0 = failures.get(0)
        if rank0 is not None and rank0.exitcode in (1, 2, 130) and not _message(rank0):
            return rank0.exitcode  # rank 0 stopped the run itself (no error recorded), and has said why
        # Ranks the agent stopped (SIGTERM), and ranks whose collective failed because another rank
        # was gone, are not the news: name the others.
        first = ({r: f for r, f in failures.items()
                  if f.exitcode != -signal.SIGTERM and "a collective failed" not in _message(f)}
                 or {r: f for r, f in failures.items() if f.exitcode != -signal.SIGTERM} or failures)
        stopped = "; the launcher stopped the others" if len(first) < len(failures) else ""
        print(f"nano-miles train: {describe_failures(first) if first else e}{stopped}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, previous)
        os.unlink(config_path)
    return 0


def _message(failure) -> str:
    msg = failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)
    return "" if msg.startswith("To enable traceback") else msg  # the agent's text when no error was recorded


def _forward_sigint_to_rank0(signum, frame) -> None:
    for child in psutil.Process().children(recursive=True):
        try:
            if child.environ().get("RANK") == "0" and "nano_miles.train" in " ".join(child.cmdline()):
                child.send_signal(signal.SIGINT)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue


def describe_failures(failures: dict) -> str:
    """One line for the elastic agent's {rank: ProcessFailure}: every failed rank and why."""
    parts = []
    for rank in sorted(failures):
        f = failures[rank]
        why = f"killed by {f.signal_name()}" if f.exitcode < 0 else (
            _first_line(_message(f)).removeprefix("DistError: ") if _message(f) else f"exit code {f.exitcode}")
        parts.append(why if why.startswith("rank ") else f"rank {rank} (pid {f.pid}) {why}")
    return "trainer ranks failed: " + "; ".join(parts)


def main_guard(fn: Callable) -> Callable:
    """Decorate a rank's main: a failure is one line on stderr, recorded in torchrun's error file, and
    exit status 1. On SIGTERM (the launcher stopping the ranks) the rank closes its sandboxes first."""
    recorded = record(fn)

    def wrapper(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            _close_sandboxes_on_sigterm()
        try:
            return recorded(*args, **kwargs)
        except DistError as e:
            print(f"error: {e}", file=sys.stderr)
            # after a failed collective gloo's threads may still run, and tearing the interpreter down
            # would abort now and then (-6 instead of 1): the line is printed, the error file written
            leave(1)

    return wrapper


def leave(code: int) -> NoReturn:
    """os._exit(code) for a rank that cannot tear down in order. It runs no atexit handler and no other
    thread's finally block, so first close the sandboxes of the episodes in flight (their workspaces
    would stay in the temp dir)."""
    _close_sandboxes()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_CLOSING = threading.RLock()


def _close_sandboxes() -> None:
    # leave(), the SIGTERM watcher and the main thread's handler may all come here: a second caller
    # waits until the first has removed the workspaces, rather than leaving while it removes them
    with _CLOSING:
        close_sandboxes()


def _close_sandboxes_on_sigterm() -> None:
    """On SIGTERM, close this process's sandboxes, then die of the signal. A Python handler alone waits
    until the main thread runs Python again, and the launcher kills the rank before that; the signal's C
    handler writes to the wakeup fd from any thread, so a watcher thread reading it closes them at once."""
    signal.signal(signal.SIGTERM, _die_of_sigterm)
    read_fd, write_fd = os.pipe()  # both close-on-exec: no sandbox process inherits them
    os.set_blocking(write_fd, False)
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    threading.Thread(target=_watch_for_sigterm, args=(read_fd,), daemon=True, name="sigterm-watch").start()


def _watch_for_sigterm(read_fd: int) -> None:
    while signal.SIGTERM not in os.read(read_fd, 64):  # one byte a signal caught (SIGINT too)
        pass
    _close_sandboxes()
    # a signal aimed at the main thread interrupts what it waits in, so its handler runs and the
    # process dies of SIGTERM
    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)


def _die_of_sigterm(signum, frame) -> None:
    # Dying of the signal itself, as without this handler: the launcher tells the ranks it stopped
    # (-SIGTERM) from the one that failed.
    _close_sandboxes()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)
