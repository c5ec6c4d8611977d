"""The trainer on N ranks inside the training loop: rank 0 runs the loop, the other ranks follow it.

    nano-miles train --set trainer.nproc=N            N ranks on this host, started here (launch_ranks)
    torchrun --nproc-per-node N -m nano_miles.train   the same ranks started by torchrun (also with
                                                      --nnodes/--node-rank/--rdzv-endpoint)

Rank 0 owns everything outside the model: the engines, rollouts, advantages, telemetry and the
checkpoints' metadata (state.json). Every rank holds its shards of the model (ShardedTrainer). Each
collective call rank 0's loop makes on its trainer (log-probs, a train step, gathering the weights for
a sync or the export, a checkpoint) is first announced to the others as a command on a gloo group of
its own (CommandChannel): its name and arguments, tensors included, broadcast from rank 0. The batch
goes whole (its advantages computed on rank 0 before any split), and each rank takes its share of
whole groups as ShardedTrainer plans it. Then every rank makes the same call.

Never a hang: every collective has the trainer's timeout (trainer.dist_timeout_s). Between commands
rank 0 sends a heartbeat every quarter of it, so a rank waiting for work learns within the timeout
that rank 0 is gone (and rank 0 that a rank is). The launcher (torch's elastic agent) stops every
rank when one exits and names the ranks that failed.

Checkpoints with N ranks are DCP folders (nano_miles/trainer/dist_checkpoint.py: each rank writes its shards,
in the background) with rank 0's state.json beside them; any number of ranks loads one, a single
process included (load_run_checkpoint), so a run saved with N ranks resumes with another N.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
import warnings
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from nano_miles.trainer import dist_checkpoint
from nano_miles.trainer.checkpoint import (Checkpointer, check_single_process, checkpoint_folder, load_checkpoint,
                                   read_state, restore_rng)
from nano_miles.config import to_toml
from nano_miles.trainer.distributed import DistError, check_nproc, describe_failures, launch, leave, main_guard, run_rank
from nano_miles.engine.weights import NonFiniteWeights
from nano_miles.trainer.reference import ReferencePolicy
from nano_miles.trainer.sharded import ShardedTrainer
from nano_miles.telemetry import memory_gb


def rank_env() -> tuple[int, int] | None:
    """(rank, world size) when this process is one of torchrun's (or launch's) ranks, else None."""
    if not all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def rank_device_type(trainer_device: str) -> str:
    if trainer_device == "auto":
        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
    return torch.device(trainer_device).type


# ----------------------------------------------------------------------------- the command channel

class _TensorRef(int):
    """Where a tensor was in a command's arguments (its index in the broadcast buffer)."""


def _map_leaves(obj, leaf):
    """obj rebuilt with leaf(x) for every x that is not a list, tuple, dict or dataclass instance."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map_leaves(getattr(obj, f.name), leaf)
                                           for f in dataclasses.fields(obj) if f.init})
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_leaves(x, leaf) for x in obj)
    if isinstance(obj, dict):
        return {k: _map_leaves(v, leaf) for k, v in obj.items()}
    return leaf(obj)


def _strip(obj, tensors: list):
    """obj with every tensor (in lists, tuples, dicts, dataclasses) replaced by a _TensorRef."""
    def ref(x):
        if not isinstance(x, torch.Tensor):
            return x
        tensors.append(x)
        return _TensorRef(len(tensors) - 1)
    return _map_leaves(obj, ref)


def _fill(obj, tensors: list):
    return _map_leaves(obj, lambda x: tensors[x] if isinstance(x, _TensorRef) else x)


class CommandChannel:
    """Rank 0 -> the other ranks: a command and its arguments, on a gloo group of its own (so it never
    interleaves with the training step's collectives or a checkpoint being written in a thread)."""

    BEAT = "beat"

    def __init__(self, timeout_s: float):
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.beat_s = max(0.5, timeout_s / 4)
        self._lock = threading.Lock()
        self._last, self._busy = time.monotonic(), 0
        self._stop = threading.Event()
        self._beats = None
        self.broken = False

    def send(self, name: str, *args) -> None:
        """(rank 0) Broadcast a command: its name and argument skeleton as an object, then its
        tensors as one flat byte buffer."""
        tensors = []
        skeleton = _strip(args, tensors)
        specs = [(tuple(t.shape), t.dtype) for t in tensors]
        with self._lock:
            dist.broadcast_object_list([name, skeleton, specs], src=0, group=self.group)
            if tensors:
                flat = torch.cat([t.detach().contiguous().cpu().reshape(-1).view(torch.uint8) for t in tensors])
                dist.broadcast(flat, src=0, group=self.group)
            self._last = time.monotonic()

    def receive(self) -> tuple[str, tuple]:
        """(ranks > 0) The next command, skipping heartbeats."""
        while True:
            box = [None, None, None]
            dist.broadcast_object_list(box, src=0, group=self.group)
            name, skeleton, specs = box
            if name != self.BEAT:
                break
        tensors = []
        if specs:
            sizes = [torch.Size(shape).numel() * dtype.itemsize for shape, dtype in specs]
            flat = torch.empty(sum(sizes), dtype=torch.uint8)
            dist.broadcast(flat, src=0, group=self.group)
            offset = 0
            for (shape, dtype), size in zip(specs, sizes):
                tensors.append(flat[offset:offset + size].clone().view(dtype).reshape(shape))
                offset += size
        return name, _fill(skeleton, tensors)

    @contextmanager
    def command(self, name: str, *args):
        """(rank 0) Announce a command, then run rank 0's part of it inside the block: no heartbeat is
        sent meanwhile (the others are busy with the same call, not listening). A block left by an
        exception marks the channel broken: the others may still be inside that call."""
        self._busy += 1  # before the send: a heartbeat must not queue up behind the command
        try:
            self.send(name, *args)
            yield
        except GeneratorExit:  # a generator's block closed early has finished its part (iter_full_weights)
            raise
        except BaseException:
            self.broken = True
            raise
        finally:
            self._busy -= 1
            self._last = time.monotonic()

    def start_heartbeat(self) -> None:
        self._beats = threading.Thread(target=self._beat, name="rank0-heartbeat", daemon=True)
        self._beats.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.beat_s / 4):
            with self._lock:
                if self._busy or time.monotonic() - self._last < self.beat_s:
                    continue
                try:
                    dist.broadcast_object_list([self.BEAT, None, None], src=0, group=self.group)
                except Exception as e:
                    # The loop itself may be far from any collective (rolling out): stop the run here.
                    print(f"error: rank 0/{dist.get_world_size()}: the other trainer ranks stopped answering "
                          f"({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})",
                          file=sys.stderr, flush=True)
                    leave(1)  # its sandboxes closed first
                self._last = time.monotonic()

    def stop_heartbeat(self) -> None:
        self._stop.set()
        if self._beats is not None:
            self._beats.join(timeout=self.beat_s + 5)


# ----------------------------------------------------------------------------- rank 0 and the others

class TrainerRanks:
    """Rank 0's trainer when there are N ranks: the Trainer interface the loop uses, each collective
    call announced to the other ranks first (see the module docstring)."""

    def __init__(self, env, channel: CommandChannel):
        self.env, self.channel = env, channel
        self.trainer: ShardedTrainer | None = None
        self._pending = None  # a checkpoint being written in the background
        self.reference = None  # the KL penalty's frozen shards (freeze_reference)
        channel.start_heartbeat()

    @property
    def world_size(self) -> int:
        return self.env.world_size

    def build(self, cfg) -> "TrainerRanks":
        """Every rank builds its ShardedTrainer of `cfg` (a TrainerConfig; its device is each rank's own)."""
        with self.channel.command("build", cfg):
            self.trainer = ShardedTrainer(cfg, self.env)
        return self

    # What the loop reads of a trainer (nothing else: e.g. no share_weights, which shards cannot do).
    @property
    def step(self) -> int:
        return self.trainer.step

    @property
    def device(self) -> torch.device:
        return self.trainer.device

    @property
    def dtype(self) -> torch.dtype:
        return self.trainer.dtype

    @property
    def cfg(self):
        return self.trainer.cfg

    @property
    def model(self) -> torch.nn.Module:  # its config (the export); its parameters are this rank's shards
        return self.trainer.model

    # The collective calls.
    def logprobs(self, batch, mask=None) -> torch.Tensor:
        self.wait_for_save()
        with self.channel.command("logprobs", batch, mask):
            return self.trainer.logprobs(batch, mask)

    def train_step(self, batch, advantages, old_logprobs=None, ref_logprobs=None, on_micro_batch=None) -> dict:
        self.wait_for_save()  # DCP's writer thread and the step's metrics share the gloo group
        with self.channel.command("train_step", batch, torch.as_tensor(advantages), old_logprobs, ref_logprobs):
            return self.trainer.train_step(batch, advantages, old_logprobs, ref_logprobs, on_micro_batch)

    def freeze_reference(self) -> None:
        """Every rank freezes its shards as the KL penalty's reference (nano_miles.trainer.reference)."""
        with self.channel.command("freeze_reference"):
            self.reference = ReferencePolicy(self.trainer)

    def reference_logprobs(self, batch) -> torch.Tensor:
        self.wait_for_save()
        with self.channel.command("reference_logprobs", batch):
            return self.reference.logprobs(batch)

    def iter_full_weights(self, dtype=None, bucket_bytes: int = 512 * 2**20):
        """Whole tensors a bucket at a time, gathered from every rank's shards (the weight sync)."""
        with self.channel.command("weights", dtype, bucket_bytes):
            gathered = self.trainer.iter_full_weights(dtype, bucket_bytes)
            try:
                for bucket in gathered:
                    yield bucket
            finally:
                for _ in gathered:  # stopped early (a failed send): the others are in this gather; finish it
                    pass

    def named_weights(self, dtype=None):
        """Every tensor, whole, on the CPU (the final export): gathered a bucket at a time."""
        return [(n, t.cpu()) for bucket in self.iter_full_weights(dtype) for n, t in bucket]

    def memory_gb(self) -> list[float]:
        """Each rank's trainer memory (CUDA peak allocated, or resident set size on the CPU)."""
        with self.channel.command("memory"):
            parts = [None] * self.world_size
            dist.gather_object(memory_gb(self.env.device), parts, dst=0, group=self.channel.group)
        return parts

    def save_checkpoint(self, folder: Path, state: dict) -> "RankSave":
        """Every rank writes its shards into `folder` in the background; state.json (this run's
        metadata, RNG included) goes in with them, so the folder appears whole or not at all."""
        self.wait_for_save()
        with self.channel.command("save", str(folder)):
            self._pending = RankSave(dist_checkpoint.save(self.trainer, folder, background=True))
        self._pending.save.tmp.mkdir(parents=True, exist_ok=True)
        (self._pending.save.tmp / "state.json").write_text(json.dumps(with_rng(state, self.world_size)))
        return self._pending

    def wait_for_save(self) -> None:
        """Finish the checkpoint being written (renamed into place once every rank has written its
        part). Nothing to do once a call failed half-way: the others are not listening any more."""
        if self._pending is not None and not self.channel.broken:
            with self.channel.command("wait_save"):
                pending, self._pending = self._pending, None
                pending.wait()

    def load_checkpoint(self, folder: Path) -> None:
        self.wait_for_save()
        with self.channel.command("load", str(folder)):
            dist_checkpoint.load(self.trainer, folder)

    def close(self, clean: bool) -> None:
        """clean: tell the others to stop (after the last checkpoint is written). Otherwise, or when a
        call failed half-way (a second Ctrl-C, a collective error), they are left to the launcher, which
        stops every rank when this one exits, or to their own collective's timeout."""
        self.channel.stop_heartbeat()
        if clean and not self.channel.broken:
            self.wait_for_save()
            self.channel.send("stop")


class RankSave:
    """A DCP checkpoint being written (dist_checkpoint.PendingSave), timed as checkpoint.py's are."""

    def __init__(self, save):
        self.save, self.started = save, time.perf_counter()
        self.seconds, self.waited_s = None, 0.0  # how long it took; how long the loop waited for it

    def wait(self) -> None:
        t = time.perf_counter()
        self.save.wait()
        self.waited_s += time.perf_counter() - t
        self.seconds = time.perf_counter() - self.started


class RankCheckpointer(Checkpointer):
    """Checkpointer's schedule and accounting for N ranks: each checkpoint is their DCP shards and rank
    0's state.json (TrainerRanks.save_checkpoint). AdamW's state is always kept: a resume with
    another N needs it, and it is spread over the ranks' files."""

    def save(self, state: dict, background: bool = True) -> None:
        t = time.perf_counter()
        pending = self.trainer.save_checkpoint(self.run_dir / "checkpoint", state)
        if not background:
            self.trainer.wait_for_save()
        self.saved.append((time.perf_counter() - t - pending.waited_s, pending))
        self.last_time = time.monotonic()


class Follower:
    """A rank > 0: makes the calls rank 0 announces, until it says stop."""

    def __init__(self, env, channel: CommandChannel):
        self.env, self.channel = env, channel
        self.trainer, self.pending, self.reference = None, None, None

    def run(self) -> None:
        while True:
            name, args = self.channel.receive()
            if name == "stop":
                return
            getattr(self, "on_" + name)(*args)

    def on_build(self, cfg):
        self.trainer = ShardedTrainer(cfg, self.env)

    def on_logprobs(self, batch, mask):
        self.trainer.logprobs(batch, mask)

    def on_train_step(self, batch, advantages, old_logprobs, ref_logprobs):
        try:
            self.trainer.train_step(batch, advantages, old_logprobs, ref_logprobs)
        except FloatingPointError:
            pass  # the gradient norm is global: rank 0 skips this update too, and says so
        except NonFiniteWeights:
            pass  # every rank found it (sharded_trainer's all-reduce): rank 0 stops the run and says why

    def on_freeze_reference(self):
        self.reference = ReferencePolicy(self.trainer)

    def on_reference_logprobs(self, batch):
        self.reference.logprobs(batch)

    def on_weights(self, dtype, bucket_bytes):
        for _ in self.trainer.iter_full_weights(dtype, bucket_bytes):
            pass

    def on_memory(self):
        dist.gather_object(memory_gb(self.env.device), None, dst=0, group=self.channel.group)

    def on_save(self, folder):
        self.pending = dist_checkpoint.save(self.trainer, Path(folder), background=True)

    def on_wait_save(self):
        pending, self.pending = self.pending, None
        pending.wait()

    def on_load(self, folder):
        dist_checkpoint.load(self.trainer, Path(folder))


def is_collective_failure(e: BaseException) -> bool:
    """A collective failed or timed out: another rank died or stopped answering."""
    text = str(e)
    return isinstance(e, dist.DistError) or "Timed out" in text or "by peer" in text or "Connection closed" in text


def run_as_rank(device_type: str, timeout_s: float, lead) -> int:
    """This process's part of an N-rank run: join the group; rank 0 runs lead(ranks) -> exit code
    (the loop, with a TrainerRanks to build its trainer from), the others follow. A failure is one
    line naming the rank (stderr, and torchrun's error file, which the launcher reports)."""

    def rank_main(env):
        channel = CommandChannel(timeout_s)
        if not env.is_main:
            # Ctrl-C is rank 0's to handle: it lets the step finish with us and then says stop.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            Follower(env, channel).run()
            return 0
        ranks, clean = TrainerRanks(env, channel), False
        try:
            code = lead(ranks)
            clean = True
            return code
        finally:
            ranks.close(clean)

    return main_guard(lambda: run_rank(rank_main, device_type=device_type, timeout_s=timeout_s))()


# ----------------------------------------------------------------------------- checkpoints

def with_rng(state: dict, world_size: int) -> dict:
    return dict(state, sharded=True, world_size=world_size,
                rng={"python": random.getstate(), "torch": torch.get_rng_state().tolist()})


def load_run_checkpoint(run_dir: Path, trainer, echo=print) -> dict | None:
    """Load run_dir/checkpoint into `trainer` (one process, or TrainerRanks), whichever number of
    ranks wrote it; returns its state.json (step, data position, ...) or None when there is none.
    A checkpoint that cannot be resumed is a CheckpointError naming the file."""
    ckpt = checkpoint_folder(Path(run_dir))
    if ckpt is None:
        return None
    state = check_resumable(ckpt)
    if not (ckpt / ".metadata").exists():
        if not isinstance(trainer, TrainerRanks):
            return load_checkpoint(Path(run_dir), trainer, echo)
        # Written by one process: every rank reads its rows of it (dist_checkpoint.load_single_process).
        if not (state.get("optimizer") and (ckpt / "optimizer.pt").exists()):
            echo("the checkpoint keeps no AdamW state (the run had completed; keep_optimizer_state=true keeps "
                 "it): AdamW's moments restart from zero")
    if isinstance(trainer, TrainerRanks):
        trainer.load_checkpoint(ckpt)
    else:
        with warnings.catch_warnings():  # DCP's note that it loads in one process: that is the point here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dist_checkpoint.load(trainer, ckpt)
    restore_rng(ckpt, state)
    return state


def check_resumable(ckpt: Path) -> dict:
    """What resuming from the checkpoint folder `ckpt` reads, checked without reading its tensors (so a
    bad one is refused before any model loads): its state.json, returned, and the index of its tensors."""
    state = read_state(ckpt)
    if (ckpt / ".metadata").exists():
        dist_checkpoint.read_metadata(ckpt)
    else:
        check_single_process(ckpt, state)
    return state


# ----------------------------------------------------------------------------- launch

def launch_ranks(cfg, resume_dir: str | None, echo=print) -> int:
    """`nano-miles train --set trainer.nproc=N`: start N ranks on this host, each `python -m
    nano_miles.train` with this resolved config, and wait for them. Ctrl-C goes to rank 0 only (it
    finishes the step with the others, checkpoints and stops them). Returns the exit code."""
    device_type = rank_device_type(cfg.trainer_device)
    check_nproc(cfg.trainer.nproc, device_type)  # DistError: one line
    if not resume_dir and not cfg.run_dir:  # every rank must write into the same run directory
        cfg = dataclasses.replace(cfg, run_dir=str(Path("runs") / time.strftime("%Y%m%d-%H%M%S", time.gmtime())))
    fd, config_path = tempfile.mkstemp(prefix="nano-miles-train-", suffix=".toml")
    with os.fdopen(fd, "w") as f:
        f.write(to_toml(cfg))
    args = ["-m", "nano_miles.train", "--config", config_path, *(["--resume", resume_dir] if resume_dir else [])]
    echo(f"starting {cfg.trainer.nproc} trainer ranks ({device_type}) ...")
    # SIGINT is ours (forwarded to rank 0), not the elastic agent's (which would stop every rank at once).
    signals_was = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = "SIGTERM,SIGHUP,SIGQUIT"
    previous = signal.signal(signal.SIGINT, _forward_sigint_to_rank0)
    try:
        launch(cfg.trainer.nproc, sys.executable, args, device_type=device_type)
    except DistError as e:
        failures = getattr(e.__context__, "failures", None) or {}  # launch's ChildFailedError
        # Ranks the agent stopped (SIGTERM) because another failed are not news: name the others.
        first = {r: f for r, f in failures.items() if f.exitcode != -signal.SIGTERM} or failures
        if set(first) == {0} and first[0].exitcode in (1, 130):
            return first[0].exitcode  # rank 0 stopped the run itself, and has said why
        stopped = "; the launcher stopped the others" if len(first) < len(failures) else ""
        print(f"nano-miles train: {describe_failures(first) if first else e}{stopped}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, previous)
        if signals_was is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = signals_was
        os.unlink(config_path)
    return 0


def _forward_sigint_to_rank0(signum, frame) -> None:
    for child in psutil.Process().children(recursive=True):
        try:
            if child.environ().get("RANK") == "0" and "nano_miles.train" in " ".join(child.cmdline()):
                child.send_signal(signal.SIGINT)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
