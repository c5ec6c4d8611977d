"""The trainer's process group: N ranks, one device each, started by torchrun or by `launch`.

A rank learns its place from the environment torchrun's elastic agent sets (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so `torchrun --nproc-per-node N -m ...` and `launch(N, ...)`
start the same thing. NCCL on GPUs (one per local rank), gloo on CPU. Every group is created with a
timeout, so a rank that dies or hangs makes the others' next collective fail within it instead of
waiting forever; the error names the rank that saw it, and `launch` names the ranks that failed.

Besides the default group there is `cpu_group` (gloo on the same ranks): DCP's background checkpoint
writer and small Python objects (metrics) go through it, so a checkpoint written in a thread never
interleaves its collectives with the training step's on the default group.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, NoReturn

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from nano_openshell.sandbox import close_all as close_sandboxes


class DistError(RuntimeError):
    """A one-line account of what failed and on which rank."""


@dataclass
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    cpu_group: Any = None  # gloo group over the same ranks (None when world_size == 1 without a group)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def where(self) -> str:
        return f"rank {self.rank}/{self.world_size} ({socket.gethostname()}, pid {os.getpid()})"


def check_nproc(nproc, device_type: str) -> None:
    """Raise DistError (one line) unless `nproc` ranks can run on `device_type` ('cuda' or 'cpu')."""
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise DistError(f"trainer.nproc must be an integer >= 1, got {nproc!r}")
    if device_type == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if nproc > have:
            raise DistError(f"trainer.nproc={nproc} needs {nproc} GPUs (one per rank) but {have} "
                            f"{'is' if have == 1 else 'are'} visible")
    elif device_type != "cpu":
        raise DistError(f"the trainer's ranks run on 'cuda' or 'cpu', not {device_type!r}")


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise DistError(f"{name} is not set: start the ranks with torchrun or nano_miles.trainer.distributed.launch")
    try:
        return int(value)
    except ValueError:
        raise DistError(f"{name}={value!r} is not an integer") from None


def init_distributed(device_type: str = "auto", timeout_s: float = 300.0) -> DistEnv:
    """Join the process group described by torchrun's environment; return this rank's DistEnv.

    device_type 'auto' is cuda when a GPU is visible, else cpu. On cuda, rank i of a host uses GPU
    LOCAL_RANK. timeout_s bounds every collective of both groups (and the rendezvous)."""
    if device_type == "auto":
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    rank, world, local_rank = _env_int("RANK"), _env_int("WORLD_SIZE"), _env_int("LOCAL_RANK")
    where = f"rank {rank}/{world} ({socket.gethostname()}, pid {os.getpid()})"
    if device_type == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if local_rank >= have:
            raise DistError(f"{where}: local rank {local_rank} needs GPU {local_rank} but {have} are visible")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    elif device_type == "cpu":
        device = torch.device("cpu")
    else:
        raise DistError(f"{where}: device type must be auto, cuda or cpu, got {device_type!r}")
    timeout = timedelta(seconds=timeout_s)
    try:
        if device_type == "cuda":  # device_id: NCCL forms its communicator now, so a bad GPU fails here
            dist.init_process_group("nccl", timeout=timeout, device_id=device)
            cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        else:
            dist.init_process_group("gloo", timeout=timeout)
            cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    except Exception as e:
        raise DistError(f"{where}: joining the process group failed: {type(e).__name__}: {_first_line(e)}") from e
    return DistEnv(rank, world, local_rank, device, cpu_group)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def _first_line(e: BaseException | str) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def run_rank(fn: Callable, *args, device_type: str = "auto", timeout_s: float = 300.0):
    """A rank's main: join the group, run fn(env, *args), leave the group. Any failure is re-raised
    as DistError naming this rank (collective errors and timeouts included); torchrun's error file
    records it, so the launcher reports it too."""
    env = None
    try:
        env = init_distributed(device_type, timeout_s)
        return fn(env, *args)
    except DistError:
        raise
    except Exception as e:
        where = env.where() if env else "rank ?"
        hint = " (a collective failed: another rank died or stopped answering)" if isinstance(
            e, dist.DistError) or "Timed out" in str(e) or "by peer" in str(e) else ""
        raise DistError(f"{where}: {type(e).__name__}: {_first_line(e)}{hint}") from e
    finally:
        destroy_distributed()


# ----------------------------------------------------------------------------- launch

_AGENT_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


def launch(nproc: int, entrypoint: Callable | str, args: tuple | list = (), *, device_type: str = "cpu",
           max_restarts: int = 0, shutdown_timeout_s: int = 5) -> dict[int, Any]:
    """Start `nproc` ranks on this host through torch.distributed.run's elastic agent, wait for them.

    entrypoint: a picklable function (each rank runs entrypoint(*args); the ranks' return values come
    back as {rank: value}) or a program such as sys.executable (each rank runs `program *args`, e.g.
    `python -m nano_miles.train ...`, exactly as `torchrun --standalone --nproc-per-node N` would).
    When one rank fails the agent stops the others and this raises DistError naming every failed rank.
    """
    check_nproc(nproc, device_type)
    # shutdown_timeout (how long a failed rank's siblings get after SIGTERM) is torch >= 2.12's
    shutdown = {"shutdown_timeout": shutdown_timeout_s} if "shutdown_timeout" in LaunchConfig.__dataclass_fields__ else {}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=uuid.uuid4().hex,
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts,
                          monitor_interval=0.1, start_method="spawn", **shutdown)
    # torchrun would set OMP_NUM_THREADS=1 with a warning; split this host's cores between the ranks.
    omp_was = os.environ.get("OMP_NUM_THREADS")
    if omp_was is None:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    # The agent installs its own SIGINT/SIGTERM/SIGHUP/SIGQUIT handlers and leaves them behind; put
    # the caller's back, or a later Ctrl-C in this process would kill it instead of raising.
    handlers = {sig: signal.getsignal(sig) for sig in _AGENT_SIGNALS}
    try:
        return elastic_launch(config, entrypoint)(*args)
    except ChildFailedError as e:
        raise DistError(describe_failures(e.failures)) from None
    finally:
        if omp_was is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        if threading.current_thread() is threading.main_thread():
            for sig, handler in handlers.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def describe_failures(failures: dict) -> str:
    """One line for the elastic agent's {rank: ProcessFailure}: every failed rank and why."""
    parts = []
    for rank in sorted(failures):
        f = failures[rank]
        if f.exitcode < 0:
            why = f"killed by {f.signal_name()}"
        else:
            msg = f.message.get("message", "") if isinstance(f.message, dict) else str(f.message)
            why = _first_line(msg) if msg and not msg.startswith("To enable traceback") else f"exit code {f.exitcode}"
            why = why.removeprefix("DistError: ")
        parts.append(f"rank {rank} (pid {f.pid}) {why}" if not why.startswith("rank ") else why)
    return "trainer ranks failed: " + "; ".join(parts)


def main_guard(fn: Callable) -> Callable:
    """Decorate a rank's __main__ function: a failure prints one line (naming the rank) to stderr,
    is recorded in torchrun's error file (so the launcher's report has it) and exits with status 1.
    On SIGTERM (the launcher stopping the ranks because one failed) the rank closes its sandboxes
    first, then dies of it."""
    recorded = record(fn)

    def wrapper(*args, **kwargs):
        if threading.current_thread() is threading.main_thread():
            _close_sandboxes_on_sigterm()
        try:
            return recorded(*args, **kwargs)
        except DistError as e:
            print(f"error: {e}", file=sys.stderr)
            # After a failed collective gloo's threads may still run; tearing the interpreter down
            # then aborts now and then ("terminate called without an active exception": exit -6
            # instead of 1, 1 run in 25 on a loaded 2-core machine). The error file is written
            # and the line printed: leave at once, with the status the launcher expects.
            leave(1)

    return wrapper


def leave(code: int) -> NoReturn:
    """os._exit(code) for a rank that cannot tear down in order. It runs no atexit handler and no
    other thread's finally block, so first close the sandboxes of the episodes in flight (rank 0's
    rollouts, set up in worker threads): their workspaces would stay in the temp dir."""
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
    """From the main thread: on SIGTERM, close this process's sandboxes, then die of the signal.

    A Python handler alone is not enough. The kernel may hand the signal to any thread, and then the
    handler waits until the main thread runs Python again, which can be a minute away (a sleep, a
    collective, a lock). The launcher kills the rank before that, and its workspaces stay behind
    (1 run in ~50 on a loaded 2-core machine). The signal's C handler also writes its number to the
    wakeup fd, whichever thread it runs on, so a watcher thread reading that fd closes the sandboxes at once."""
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
