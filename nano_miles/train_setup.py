"""What a training run is made of, and what its loop (nano_miles/train.py) asks of it.

`TrainConfig` holds the keys of `nano-miles train`.
`Run` builds the trainer on every rank and, on rank 0 alone, the engines, the weight sync, the task
stream, the metrics and the evaluation. Rank 0 decides; `share` hands its decisions to the other ranks
at fixed points, so that every rank reaches the same collectives. Rank 0 restarts engines that die and
re-syncs them; a step whose rollout lost every engine is retried with the same tasks and seeds.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist
from transformers import AutoTokenizer

from nano_miles.config import to_dict
from nano_miles.dtypes import TRAINABLE
from nano_miles.engine.client import EngineUnavailable
from nano_miles.engine.layout import Layout, plan_layout
from nano_miles.engine.pool import EnginePool
from nano_miles.evaluate import RunEvaluation
from nano_miles.job import RolloutCommandConfig, model_folder, selected_tasks
from nano_miles.memory_plan import plan_memory, uses_shared_weights
from nano_miles.rollout.batch import staleness
from nano_miles.rollout.dynamic_sampling import TrainRolloutConfig
from nano_miles.rollout.producer import AsyncProducer, SyncProducer, TaskStream, roll_out_step
from nano_miles.rollout.sandbox import check_sandbox, sandbox_factory
from nano_miles.tasks import training_tasks
from nano_miles.telemetry import MetricsLog, check_report_to, parse_report_to
from nano_miles.trainer.checkpoint import Checkpointer, check_resumable, checkpoint_folder, disk_line, load_checkpoint
from nano_miles.trainer.config import OptimConfig, TrainerConfig
from nano_miles.trainer.loss import AdvantageConfig, LossConfig
from nano_miles.trainer.reference import ReferencePolicy
from nano_miles.trainer.trainer import Trainer
from nano_miles.trainer.weight_sync import SyncConfig, WeightSync, WeightSyncError

MODES = ("sync", "async")
# Ranks > 0 wait on it for rank 0's rollouts, evaluations and engine restarts, which no collective timeout
# can bound. Should rank 0 die, the elastic agent (torchrun's, launch_ranks') stops every rank at once.
CONTROL_TIMEOUT = timedelta(days=1)
SYNC_ERRORS = (EngineUnavailable, WeightSyncError, ConnectionError)


@dataclass
class TrainConfig(RolloutCommandConfig):
    """The keys of `nano-miles train`: rollout's (model, tasks, seed, dtype, engine.*, rollout.*) and these."""
    renamed_keys: ClassVar[dict[str, str]] = {  # old key -> new: refused with a line naming the new one
        "engine_url": "engine.url", "engine_device": "engine.device",
        "engine_max_running_requests": "engine.max_running_requests",
        "engine_mem_fraction": "engine.kv_cache_memory_fraction",
        "micro_batch_size": "trainer.micro_batch_size", "logprob_chunk": "trainer.logprob_chunk",
        "gradient_checkpointing": "trainer.gradient_checkpointing"}
    tasks: str = "train"              # seed | train | heldout | all | a family | comma-separated task ids (never a benchmark)
    seed: int = 0                     # run seed: initial RNG, task order, and every step's task instances
    dtype: str = "auto"               # trainer and engine compute dtype: float32 | bfloat16 | auto (bfloat16 on GPU, float32 on CPU)
    steps: int = 8                    # training steps, each one rollout batch and its update
    run_dir: str = ""                 # "" = runs/<UTC timestamp>
    tasks_per_step: int = 2           # groups per step; each group is rollout.group_size samples of one task
    mode: str = "sync"                # sync | async
    max_staleness: int = 1            # async: max weight versions between a trajectory's oldest token and the policy
    updates_per_step: int = 1         # optimizer steps per rollout batch (PPO mini-batches of whole groups)
    checkpoint_every: int = 0         # steps between checkpoints; 0 = by time (checkpoint_minutes); always at the end and on Ctrl-C (the latest one is kept)
    checkpoint_minutes: float = 10.0  # checkpoint_every = 0: minutes between checkpoints (longer if the last one blocked the loop for over a tenth of that)
    keep_optimizer_state: bool = False  # keep AdamW's moments in checkpoint/ once the run completes (8 bytes a parameter), to train it further exactly
    memory_check: bool = True         # refuse to start when the estimated peak memory exceeds the budget (nano_miles/memory_plan.py)
    memory_limit_gb: float = 0.0      # the memory budget in GB; 0 = what the machine has at start-up (MemAvailable, cgroup limit)
    trainer_device: str = "auto"      # auto = cuda:0 with a GPU, else cpu
    max_engine_restarts: int = 3      # per step, before the run stops with an error
    true_on_policy: bool = False      # batch-invariant engine and trainer: log-probs equal bit for bit, parity_max 0.0
    max_infra_failed_steps: int = 2   # steps in a row that lose every episode to the sandbox before the run stops
    report_to: str = "tensorboard"    # besides metrics.jsonl, comma-separated: tensorboard, wandb (needs wandb), none
    eval_every: int = 0               # pass@1 of the current policy before step 1 (a step 0 row), every this many steps and after the last, into the metrics (eval_*); 0 = off
    eval_tasks: str = "heldout"       # eval_every: the tasks evaluated besides ALFA (a selection, as `nano-miles eval --tasks`)
    eval_samples: int = 1             # eval_every: samples per task instance (pass@1 is their mean), at rollout.temperature like `nano-miles eval`
    eval_instances: int = 1           # eval_every: instances per eval task (seeded draws of its files and ground truth), eval_samples on each; the ALFA subset stays at one instance: its set-ups are fixed
    eval_alfa_tasks: int = 20         # eval_every: also this many ALFA tasks, the same fixed subset in every run (needs icalfa); 0 = none
    keep_best: bool = False           # eval_every: also export the policy with the best pass@1 on eval_tasks so far to best/ (with best.json)
    rollout: TrainRolloutConfig = field(default_factory=TrainRolloutConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)

    def __post_init__(self):
        super().__post_init__()
        if self.steps < 1 or self.tasks_per_step < 1 or self.updates_per_step < 1:
            raise ValueError("steps, tasks_per_step and updates_per_step must be >= 1")
        if self.checkpoint_every < 0 or not self.checkpoint_minutes > 0 or self.memory_limit_gb < 0:
            raise ValueError("checkpoint_every and memory_limit_gb must be >= 0 (0 = auto), checkpoint_minutes > 0")
        if self.sync.transport == "shared" and self.mode != "sync":
            raise ValueError("sync.transport=shared serves the trainer's live weights: it needs mode=sync")
        if self.dtype not in ("auto", *TRAINABLE):
            raise ValueError(f"dtype must be one of {['auto', *TRAINABLE]}, got {self.dtype!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.max_staleness < 0 or self.max_engine_restarts < 0:
            raise ValueError("max_staleness and max_engine_restarts must be >= 0")
        if (self.eval_every < 0 or min(self.eval_samples, self.eval_instances) < 1 or self.eval_alfa_tasks < 0
                or (self.keep_best and not self.eval_every)):
            raise ValueError("eval_every and eval_alfa_tasks must be >= 0 (0 = off), eval_samples and eval_instances "
                             ">= 1; keep_best needs eval_every")
        check_world(self, self.trainer.nproc)
        if not self.rollout.temperature > 0:
            raise ValueError("rollout.temperature must be > 0 to train: greedy rollouts (0) have no distribution "
                             "to compute a policy gradient of")
        if self.true_on_policy and self.rollout.temperature != 1.0:
            raise ValueError("true_on_policy needs rollout.temperature = 1 (the engine's log-probs are of the "
                             "tempered distribution, the trainer's of the model's)")
        if (self.optim.lr_schedule != "constant" and not self.optim.decay_steps
                and self.optim.warmup_steps >= self.optimizer_steps):
            raise ValueError(f"optim.lr_schedule={self.optim.lr_schedule} decays after optim.warmup_steps "
                             f"({self.optim.warmup_steps}), but the run has only {self.optimizer_steps} "
                             "optimizer steps: fewer warm-up steps, or optim.decay_steps")
        if self.max_infra_failed_steps < 1:
            raise ValueError(f"max_infra_failed_steps must be >= 1, got {self.max_infra_failed_steps}")
        parse_report_to(self.report_to)

    @property
    def optimizer_steps(self) -> int:
        """The run's optimizer steps: where a decaying lr ends unless optim.decay_steps says otherwise."""
        return self.steps * self.updates_per_step


class RunFailed(RuntimeError):
    """The run stopped, or ended, without a policy to show for it; the message says why and what to do."""


class Stopped(KeyboardInterrupt):
    """Rank 0 ended the run (Ctrl-C): every rank stops at the same point, after the same collectives."""


def check_world(cfg: TrainConfig, world_size: int) -> None:
    """What a trainer on several ranks cannot do yet: one line each."""
    if world_size > 1 and cfg.true_on_policy:
        raise ValueError("true_on_policy needs trainer.nproc = 1 for now (its trainer runs unsharded parameters)")


def train_layout(cfg: TrainConfig, env=None) -> Layout:
    """plan_layout for a training run (N ranks take this host's first GPUs); true_on_policy turns the
    engines' side on too (engine.url's must run `serve --true-on-policy`)."""
    if env is None:
        layout = plan_layout(cfg.dtype, cfg.engine, cfg.trainer_device)
    else:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", env.world_size))
        layout = plan_layout(cfg.dtype, cfg.engine, str(env.device), trainer_ranks=local_ranks)
    if cfg.true_on_policy:
        layout.engine_args.append("--true-on-policy")
    return layout


class Run:
    """One run directory. lead: rank 0 (or the one process); env: this rank's DistEnv with N ranks;
    make_sandbox: what makes an episode's sandbox (default: sandbox.min_tier's)."""

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
            self.producer = (AsyncProducer(self._roll_out, cfg.steps) if cfg.mode == "async"
                             else SyncProducer(self._roll_out))
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

    def _roll_out(self, step: int, desc: str):
        cfg = self.cfg  # the pool's replicas are read at call time: a restart changes them
        return roll_out_step(step, self.stream, cfg.tasks_per_step, self.engines, self.tokenizer, cfg.rollout,
                             cfg.seed, desc, sandbox_factory=self.make_sandbox)

    def collect(self, step: int):
        """(rollout, staleness, kept trajectories, skip reason) of `step`, the first two rank 0's. A dead
        replica's episodes move to the others; with none left, a restart, a sync, the same tasks again."""
        attempt = 0
        while True:
            message = None
            if self.lead:
                try:
                    if self.stop_requested:
                        raise KeyboardInterrupt
                    self.interruptible = True
                    rollout = self.producer.get(step)
                    self.interruptible = False
                    self.stream_after[step] = rollout.stream_state
                    stale = [staleness(t, self.trainer.step) for t in rollout.trajectories]
                    # Sandbox infrastructure failures are not the policy's doing: counted, never trained on.
                    message = ("batch", [t for t, s in zip(rollout.trajectories, stale)
                                         if s <= self.cfg.max_staleness and t.finish_reason != "infra_error"],
                               rollout.skip_reason)
                except EngineUnavailable as e:
                    self.interruptible = False
                    attempt += 1
                    self._recover(e, attempt, f"step {step} rollout")
                    message = ("resync",)
                except KeyboardInterrupt:
                    message = ("stop",)
                finally:
                    self.interruptible = False
            kind, *rest = self.share(message)
            if kind == "stop":
                raise Stopped
            if kind == "batch":
                return (rollout, stale, *rest) if self.lead else (None, None, *rest)
            self.sync(step)  # the restarted engines serve the base weights
            if self.lead:
                self.producer.restart(step)

    def sync(self, step: int) -> dict | None:
        """The weights to the engines; rank 0's result. Rank 0 sends (restarting engines that died first);
        the others join each gather it announces as it starts (Trainer.on_gather) until it is done."""
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
            except SYNC_ERRORS as e:
                attempt += 1
                self._recover(e, attempt, f"step {step} weight sync")

    def begin(self) -> float:
        """Rank 0: a fresh run's evaluation of the base policy (step 0, as every later one), then the
        first rollouts. Returns when the training steps' pace starts (the ETA's)."""
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
