"""What a training run is made of, and what its loop (nano_miles/train.py) asks of it.

`Run` builds the trainer on every rank and, on rank 0 alone, the engines, weight sync, task stream,
metrics and evaluation. Rank 0 decides; `share` hands its decisions to the others at fixed points, so
every rank reaches the same collectives. Rank 0 restarts engines that die; a step whose rollout lost
every engine is retried with the same tasks and seeds.
"""
from __future__ import annotations

import dataclasses
import json
import random
import signal
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from nano_miles.config import to_dict
from nano_miles.engine.client import EngineUnavailable
from nano_miles.engine.pool import EnginePool
from nano_miles.evaluate import RunEvaluation
from nano_miles.job import model_folder, selected_tasks
from nano_miles.memory_plan import plan_memory, uses_shared_weights
from nano_miles.rollout.batch import staleness
from nano_miles.rollout.producer import AsyncProducer, SyncProducer, play_step_rollout
from nano_miles.rollout.task_stream import TaskStream
from nano_miles.rollout.sandbox import check_sandbox, sandbox_factory
from nano_miles.tasks import training_tasks
from nano_miles.telemetry import MetricsLog, check_report_to
from nano_miles.train_config import TrainConfig, train_layout
from nano_miles.trainer.checkpoint import Checkpointer, check_resumable, checkpoint_folder, disk_line, load_checkpoint
from nano_miles.trainer.reference import ReferencePolicy
from nano_miles.trainer.trainer import Trainer
from nano_miles.trainer.weight_sync import WeightSync, WeightSyncError

# Ranks > 0 wait on it for rank 0's rollouts, evaluations and engine restarts, which no collective timeout
# can bound. Should rank 0 die, the elastic agent (torchrun's, launch_ranks') stops every rank at once.
CONTROL_TIMEOUT = timedelta(days=1)


class RunFailed(RuntimeError):
    """The run stopped without a policy to show for it; the message says why and what to do."""


class Stopped(KeyboardInterrupt):
    """Rank 0 ended the run (Ctrl-C): every rank stops at the same point, after the same collectives."""


class Run:
    """One run directory. lead: rank 0 (or the one process); env: this rank's DistEnv with N ranks."""

    def __init__(self, cfg: TrainConfig, resume_dir: str | None = None, echo=print, make_sandbox=None, env=None):
        self.cfg, self.env, self.started = cfg, env, time.monotonic()
        self.world = env.world_size if env is not None else 1
        self.lead = self.world == 1 or env.rank == 0
        self.echo = echo if self.lead else (lambda *_: None)
        self.control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT) if self.world > 1 else None
        self.mid_step = False        # from a step's update to its checkpoint: the trainer is between states
        self.interruptible = False   # rank 0 waits for a rollout (or the base policy's evaluation)
        self.stop_requested = False  # Ctrl-C mid-step: stop once the step is done
        self.syncer = self.engines = None
        self.lost = 0                # steps in a row that lost every episode to the infrastructure
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        if self.lead:
            self._prepare(resume_dir, make_sandbox)
        self.run_dir, self.model_path, self.dtype, self.pad_id = self.share(
            (self.run_dir, self.model_path, self.layout.dtype, self.pad_id) if self.lead else None)
        try:
            self._load(resume_dir)
        except BaseException:
            if self.engines is not None:
                self.engines.stop()  # not left running behind a run that never started
            raise

    def _prepare(self, resume_dir: str | None, make_sandbox) -> None:
        """Rank 0. Whatever can refuse the run does so before a model loads or a directory is written; the
        engines start before the trainer, so that on a shared GPU they size their KV caches first."""
        cfg, echo = self.cfg, self.echo
        self.tasks = selected_tasks("train", cfg.tasks, cfg.tasks_module, select=training_tasks)
        self.evaluation = RunEvaluation(cfg, echo)
        check_sandbox(cfg.sandbox)
        check_report_to(cfg.report_to)
        self.make_sandbox = make_sandbox or sandbox_factory(cfg.sandbox)
        self.layout = train_layout(cfg, self.env)
        self.model_path = model_folder(cfg.model)
        self.memory = plan_memory(cfg, self.layout, self.model_path, uses_shared_weights(cfg, self.layout), echo)
        self.run_dir = Path(resume_dir or cfg.run_dir or Path("runs") / time.strftime("%Y%m%d-%H%M%S", time.gmtime()))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not resume_dir:
            (self.run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        echo(disk_line(self.memory.num_params, self.run_dir, cfg.keep_optimizer_state or self.world > 1))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        echo(f"model {self.model_path} | trainer {self.layout.trainer_device}"
             f"{f' x {self.world} ranks' if self.world > 1 else ''} | engines "
             f"{cfg.engine.url or ', '.join(self.layout.engine_devices)} | dtype {self.layout.dtype} "
             f"| mode {cfg.mode} | run_dir {self.run_dir}")
        self.engines = EnginePool(cfg.engine, self.layout, self.model_path, self.run_dir)
        self.engines.start()

    def _load(self, resume_dir: str | None) -> None:
        cfg = self.cfg
        self.trainer = Trainer(dataclasses.replace(
            cfg.trainer, model=self.model_path, device=self.layout.trainer_device if self.lead else str(self.env.device),
            dtype=self.dtype, true_on_policy=cfg.true_on_policy, loss=cfg.loss, temperature=cfg.rollout.temperature,
            # a decaying lr ends with the run unless told otherwise
            optim=dataclasses.replace(cfg.optim, decay_steps=cfg.optim.decay_steps or cfg.optimizer_steps)), self.env)
        if self.lead and self.world > 1:
            self.trainer.on_gather = lambda *args: self.share(("gather", *args))  # see sync
        self.reference = ReferencePolicy(self.trainer) if cfg.loss.kl_coef > 0 else None  # before any resume
        ckpt = checkpoint_folder(self.run_dir) if self.lead and resume_dir else None
        state = self.share(check_resumable(ckpt) if ckpt is not None else None)
        if state is not None:
            load_checkpoint(self.run_dir, self.trainer, self.echo, state)
            self.echo(f"resumed from {self.run_dir}/checkpoint after step {state['step']}")
        elif resume_dir:
            self.echo(f"{self.run_dir} has no checkpoint yet: starting from step 1")
        self.start_step = self.checkpointed = state["step"] if state else 0
        self.checkpointer = Checkpointer(self.run_dir, self.trainer, cfg.checkpoint_every, cfg.checkpoint_minutes,
                                         cfg.steps, cfg.keep_optimizer_state)
        if self.lead:
            self.stream = TaskStream(self.tasks, cfg.seed, pass_over=cfg.rollout.pass_over_saturated)
            if state:
                self.stream.restore(state.get("stream", state["data_position"]))
            self.stream_after = {self.start_step: self.stream.state()}  # step -> the task stream's state after it
            self.log = MetricsLog(self.run_dir, resume_after_step=self.start_step if resume_dir else None,
                                  echo=self.echo, report_to=cfg.report_to, config=to_dict(cfg))
            self._connect()
            self.producer = (AsyncProducer(self._roll_out, cfg.steps, carry_over=cfg.rollout.carry_over)
                             if cfg.mode == "async" else SyncProducer(self._roll_out))
        # Fresh engines serve the base weights: catch them up (shared, one process only: they map ours).
        if self.trainer.step or (self.lead and self.syncer.transport == "shared"):
            self.sync(self.start_step)

    def share(self, obj):
        """Rank 0's `obj` on every rank (the others pass None)."""
        box = [obj]
        if self.control is not None:
            dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def gather(self, obj) -> list | None:
        """Every rank's `obj`, in rank order, on rank 0 (None on the others)."""
        if self.control is None:
            return [obj]
        out = [None] * self.world if self.lead else None
        dist.gather_object(obj, out, dst=0, group=self.control)
        return out

    def _connect(self) -> None:  # a weight sync to every replica that is up (after a restart: a new group)
        if self.syncer is not None:
            self.syncer.close()
        self.syncer = None
        self.synced_replicas = self.engines.to_sync()
        self.syncer = WeightSync(self.trainer, [r.url for r in self.synced_replicas], self.cfg.sync,
                                 allow_shared=self.cfg.mode == "sync")

    def _recover(self, err: Exception, attempt: int, what: str) -> None:
        """Restart the dead replicas (ours; theirs are left out until they answer) and reconnect the sync."""
        if attempt > self.cfg.max_engine_restarts:
            raise RuntimeError(f"{what}: the engines are still failing after {attempt - 1} restarts: {err}") from err
        self.echo(f"{what}: engine unavailable ({err}); restarting it and re-syncing the weights")
        self.engines.probe()
        self.engines.wait_restarts()
        self._connect()

    async def _roll_out(self, step: int, desc: str, carry):
        cfg = self.cfg  # the pool's replicas are read at call time: a restart changes them
        return await play_step_rollout(step, self.stream, cfg.tasks_per_step, self.engines, self.tokenizer,
                                       cfg.rollout, cfg.seed, desc, sandbox_factory=self.make_sandbox, carry=carry)

    def collect(self, step: int):
        """(rollout, staleness, trajectories, which to train on, skip reason) of `step`, the first two rank
        0's. With every replica dead: a restart, a sync, the same tasks again."""
        attempt = 0
        while True:
            message = None
            if self.lead:
                try:
                    if self.stop_requested:
                        raise KeyboardInterrupt
                    self.interruptible = True
                    try:
                        rollout = self.producer.get(step)
                    finally:
                        self.interruptible = False
                    self.stream_after[step] = rollout.stream_state
                    stale = [staleness(t, self.trainer.step) for t in rollout.trajectories]
                    # Sandbox infrastructure failures are not the policy's doing: counted, never trained on.
                    # Too stale ones are not trained on but stay in their group's advantage baseline.
                    usable = [(t, s) for t, s in zip(rollout.trajectories, stale) if not t.broken]
                    message = ("batch", [t for t, _ in usable], [s <= self.cfg.max_staleness for _, s in usable],
                               rollout.skip_reason)
                except EngineUnavailable as e:
                    attempt += 1
                    self._recover(e, attempt, f"step {step} rollout")
                    message = ("resync",)
                except KeyboardInterrupt:
                    message = ("stop",)
            kind, *rest = self.share(message)
            if kind == "stop":
                raise Stopped
            if kind == "batch":
                return (rollout, stale, *rest) if self.lead else (None, None, *rest)
            self.sync(step)  # the restarted engines serve the base weights
            if self.lead:
                self.producer.restart(step)

    def sync(self, step: int) -> dict | None:
        """The weights to the engines; rank 0's result. The other ranks join each gather rank 0 announces
        as it starts (Trainer.on_gather) until it is done."""
        if not self.lead:
            while (message := self.share(None))[0] == "gather":
                for _ in self.trainer.iter_full_weights(*message[1:]):
                    pass
            return None
        attempt = 0
        while True:
            try:
                if self.engines.wait_restarts():  # a replica came back during the step: sync it too
                    self._connect()
                result = self.syncer.sync(str(self.trainer.step))
                self.engines.synced(self.synced_replicas)  # restarted replicas take rollouts again
                self.share(("synced",))
                return result
            except (EngineUnavailable, WeightSyncError, ConnectionError) as e:
                attempt += 1
                self._recover(e, attempt, f"step {step} weight sync")

    def begin(self) -> float:
        """Rank 0: a fresh run's evaluation of the base policy (step 0), then the first rollouts. Returns
        when the training steps' pace starts (the ETA's)."""
        if self.lead and self.start_step == 0:
            self.interruptible = True
            try:
                self.log.log_eval(self.evaluation.after_step(0, self.engines, self.tokenizer, self.make_sandbox))
            except KeyboardInterrupt:
                self.stop_requested = True  # the first rollout tells every rank
            finally:
                self.interruptible = False
        if self.lead:
            self.producer.start(self.start_step + 1)
        return time.monotonic()

    def checkpoint(self, step: int, background: bool = True) -> None:
        """The trainer's state after `step`; rank 0 adds the run's (data position, weight version)."""
        state = {"step": step}
        if self.lead:
            state.update(data_position=self.stream_after[step]["position"], stream=self.stream_after[step],
                         weight_version=str(self.trainer.step))
        self.checkpointer.save(state, background)
        self.checkpointed = step

    @contextmanager
    def stop_signals(self):
        """Rank 0 takes Ctrl-C (one process: SIGTERM too); with N ranks SIGTERM is the launcher stopping
        them all because one failed, when no step can finish."""
        ours = (signal.SIGINT, signal.SIGTERM) if self.world == 1 else (signal.SIGINT,)
        main = threading.current_thread() is threading.main_thread()
        previous = {s: signal.signal(s, self._on_stop) for s in ours} if main and self.lead else {}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _on_stop(self, signum, frame) -> None:
        # While rank 0 waits for a rollout, stop at once (nothing has changed yet); otherwise after the
        # step (update, sync, log, checkpoint), so no completed step is lost. Twice: now.
        if self.interruptible or self.stop_requested:
            raise KeyboardInterrupt
        self.stop_requested = True
        what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        self.echo(f"{what}: stopping after this step's update and weight sync ({what} again: stop now)")

    def close(self, together: bool) -> None:  # together: every rank ends here at once (else no collective waits)
        if self.world == 1 or together:
            try:
                self.trainer.wait_for_save()  # a checkpoint still being written is finished, not cut off
            except RuntimeError as e:
                self.echo(str(e))
        if self.lead:
            self.producer.stop()
            try:
                self.syncer.close()
            except Exception as e:  # the engine may already be gone
                self.echo(f"weight sync close: {e}")
            self.engines.stop()
            self.log.close()
