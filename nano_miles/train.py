"""`nano-miles train`: the closed loop. Rollout -> batch -> advantages -> update -> weight sync -> metrics.

    nano-miles train [--config FILE.toml] [--set key=value ...] [--engine-url URL ...] [--resume RUN_DIR]
    torchrun --nproc-per-node N -m nano_miles.train [the same arguments]

Where things run (nano_miles/engine/layout.py): the trainer on cuda:0 (its ranks on cuda:0..N-1 with
trainer.nproc=N, nano_miles/trainer/ranks.py), the engine replicas (engine.replicas) on the GPUs after
them, or beside them, or everything on the CPU. Engines are separate processes (`nano-miles serve`)
that this loop starts, restarts when they die, and stops at the end; or `--engine-url` (repeatable)
drives engines somebody else runs (ours or SGLang). Rollouts spread over them (nano_miles/engine/pool.py).

Modes (nano_miles/rollout/producer.py): `sync` (on-policy: every rollout uses the latest weights) and `async`
(rollouts for step v+1 are generated while step v trains; a trajectory whose oldest token is more
than `max_staleness` weight versions behind the trained policy is dropped and counted, newer ones are
corrected by truncated importance sampling against the engine's log-probs).

Failing safely: before any model is loaded, the sandbox must reach `sandbox.min_tier` and every
`report_to` reporter must be usable, else the run refuses with the reason and the fix (and leaves
no run directory behind). `max_infra_failed_steps` consecutive steps whose episodes all failed for
infrastructure reasons stop the run with the cause; a run whose policy never changed writes no final/.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from transformers import AutoTokenizer

from nano_miles.trainer.loss import AdvantageConfig, LossConfig
from nano_miles.trainer.checkpoint import (CheckpointError, Checkpointer, checkpoint_folder, disk_line, export_best,
                                   export_model)
from nano_miles.engine.client import EngineUnavailable
from nano_miles.config import ConfigError, add_config_arguments, config_from_args, to_dict, to_toml
from nano_miles.trainer.distributed import DistError
from nano_miles.dtypes import TRAINABLE
from nano_miles.rollout.dynamic_sampling import TrainRolloutConfig
from nano_miles.engine.weights import NonFiniteWeights
from nano_miles.engine.layout import train_layout
from nano_miles.engine.pool import EnginePool
from nano_miles.evaluate import RunEvaluation
from nano_miles.memory_plan import plan_memory, uses_shared_weights
from nano_miles.rollout.producer import AsyncProducer, StepRollout, SyncProducer, TaskStream, roll_out_step, staleness
from nano_miles.trainer.reference import ReferencePolicy
from nano_miles.job import RolloutCommandConfig, model_folder, selected_tasks
from nano_miles.rollout.sandbox import check_sandbox, sandbox_factory
from nano_miles.tasks import training_tasks
from nano_miles.telemetry import (MetricsLog, check_report_to, memory_gb, parse_report_to, read_metrics, run_summary,
                                  step_metrics)
from nano_miles.trainer.trainer import OptimConfig, Trainer, TrainerConfig
from nano_miles.trainer.ranks import (RankCheckpointer, TrainerRanks, check_resumable, is_collective_failure,
                                      launch_ranks, load_run_checkpoint, rank_device_type, rank_env, run_as_rank)
from nano_miles.trainer.update import policy_update
from nano_miles.trainer.weight_sync import SyncConfig, WeightSync, WeightSyncError

MODES = ("sync", "async")


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


def check_world(cfg: TrainConfig, world_size: int) -> None:
    """What a trainer on several ranks cannot do yet: one line each."""
    if world_size > 1 and cfg.true_on_policy:
        raise ValueError("true_on_policy needs trainer.nproc = 1 for now (its trainer runs unsharded parameters)")


CONFIG = TrainConfig


class TrainingRun:
    """One run directory: the trainer, the engines, the weight sync, the data position, the metrics."""

    def __init__(self, cfg: TrainConfig, resume_dir: str | None = None, echo=print, make_sandbox=None,
                 ranks: TrainerRanks | None = None):
        """make_sandbox: what makes an episode's sandbox (default: a Sandbox of sandbox.min_tier).
        ranks: on rank 0 of N trainer ranks, the handle that builds the sharded trainer and tells the
        other ranks each collective call (nano_miles/trainer/ranks.py); None for one process."""
        self.cfg, self.echo, self.ranks = cfg, echo, ranks
        self.started = time.monotonic()
        # Everything that can refuse the run does so before a model is loaded or a directory written:
        # a bad task selection or a benchmark (never trained on), the sandbox, the reporters, the model.
        tasks = selected_tasks("train", cfg.tasks, cfg.tasks_module, select=training_tasks)
        self.evaluation = RunEvaluation(cfg, echo)
        check_sandbox(cfg.sandbox)
        check_report_to(cfg.report_to)
        self.make_sandbox = make_sandbox or sandbox_factory(cfg.sandbox)
        self.layout = train_layout(cfg, ranks)
        self.world_size = ranks.world_size if ranks else 1
        self.model_path = model_folder(cfg.model)
        self.memory = plan_memory(cfg, self.layout, self.model_path, uses_shared_weights(cfg, self.layout), echo)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        self.run_dir = Path(resume_dir or cfg.run_dir or Path("runs") / stamp)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not resume_dir:
            (self.run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        echo(disk_line(self.memory.num_params, self.run_dir, cfg.keep_optimizer_state))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        engines = cfg.engine.url or ", ".join(self.layout.engine_devices)
        echo(f"model {self.model_path} | trainer {self.layout.trainer_device}"
             f"{f' x {self.world_size} ranks' if ranks else ''} | engines {engines} | dtype {self.layout.dtype} "
             f"| mode {cfg.mode} | run_dir {self.run_dir}")
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        # The engines start before the trainer so that, on a shared GPU, they size their KV caches first.
        self.engines = EnginePool(cfg.engine, self.layout, self.model_path, self.run_dir)
        self.engines.start()
        try:
            self._load(tasks, resume_dir)
        except BaseException:
            self.engines.stop()  # not left running behind a run that never started
            raise

    def _load(self, tasks: list, resume_dir: str | None) -> None:
        cfg, echo = self.cfg, self.echo
        trainer_cfg = dataclasses.replace(
            cfg.trainer, model=self.model_path, device=self.layout.trainer_device, dtype=self.layout.dtype,
            true_on_policy=cfg.true_on_policy, loss=cfg.loss, temperature=cfg.rollout.temperature,
            # a decaying lr ends with the run unless told otherwise
            optim=dataclasses.replace(cfg.optim, decay_steps=cfg.optim.decay_steps or cfg.optimizer_steps))
        self.trainer = self.ranks.build(trainer_cfg) if self.ranks else Trainer(trainer_cfg)
        self.reference = ReferencePolicy(self.trainer) if cfg.loss.kl_coef > 0 else None  # before any resume
        self.stream = TaskStream(tasks, cfg.seed, pass_over=cfg.rollout.pass_over_saturated)
        self.start_step = 0
        if resume_dir:
            state = load_run_checkpoint(self.run_dir, self.trainer, echo)
            if state is None:
                echo(f"{self.run_dir} has no checkpoint yet: starting from step 1")
            else:
                self.start_step = state["step"]
                self.stream.restore(state.get("stream", state["data_position"]))
                echo(f"resumed from {self.run_dir}/checkpoint after step {self.start_step}")
        self.stream_after = {self.start_step: self.stream.state()}  # step -> the task stream's state after it
        self.checkpointer = (RankCheckpointer if self.ranks else Checkpointer)(
            self.run_dir, self.trainer, cfg.checkpoint_every, cfg.checkpoint_minutes, cfg.steps, cfg.keep_optimizer_state)
        self.log = MetricsLog(self.run_dir, resume_after_step=self.start_step if resume_dir else None, echo=echo,
                              report_to=cfg.report_to, config=to_dict(cfg))
        self.syncer = None
        self._mutating = False
        self._stop_after_step = False
        self._connect()
        if self.trainer.step or self.syncer.transport == "shared":
            # Fresh engines serve the base weights: catch them up (shared: map ours, freeing their own copy).
            self._sync_now()
        self.producer = (AsyncProducer(self._roll_out, cfg.steps) if cfg.mode == "async"
                         else SyncProducer(self._roll_out))

    # -- the engines ---------------------------------------------------------------------------

    def _connect(self) -> None:
        """A weight sync to every replica that is up (after a restart, a new one: a new group)."""
        if self.syncer is not None:
            self.syncer.close()
        self.syncer = None
        self.synced_replicas = self.engines.to_sync()
        self.syncer = WeightSync.from_config(self.trainer, [r.url for r in self.synced_replicas], self.cfg.sync,
                                             allow_shared=self.cfg.mode == "sync")

    def _recover(self, err: Exception, attempt: int, what: str) -> None:
        """Restart the replicas that are dead (ours; theirs are left out until they answer again)
        and reconnect the weight sync to the ones that are up."""
        if attempt > self.cfg.max_engine_restarts:
            raise RuntimeError(f"{what}: the engines are still failing after {attempt - 1} restarts: {err}") from err
        self.echo(f"{what}: engine unavailable ({err}); restarting it and re-syncing the weights")
        self.engines.probe()
        self.engines.wait_restarts()
        self._connect()

    def _roll_out(self, step: int, desc: str) -> StepRollout:
        cfg = self.cfg  # the pool's replicas are read at call time: a restart changes them
        return roll_out_step(step, self.stream, cfg.tasks_per_step, self.engines, self.tokenizer, cfg.rollout,
                             cfg.seed, desc, sandbox_factory=self.make_sandbox)

    def _collect(self, step: int) -> StepRollout:
        """This step's trajectories. A dead replica's episodes move to the others while it restarts;
        only when none is left is the step retried (same tasks, same seeds) after a restart."""
        attempt = 0
        while True:
            try:
                return self.producer.get(step)
            except EngineUnavailable as e:
                attempt += 1
                self._recover(e, attempt, f"step {step} rollout")
                self._sync(step)  # the restarted engines serve the base weights
                self.producer.restart(step)

    def _sync_now(self) -> dict:
        result = self.syncer.sync(str(self.trainer.step))
        self.engines.synced(self.synced_replicas)  # restarted replicas take rollouts again
        return result

    def _sync(self, step: int) -> dict:
        attempt = 0
        while True:
            try:
                if self.engines.wait_restarts():  # a replica came back during the step: sync it too
                    self._connect()
                return self._sync_now()
            except (EngineUnavailable, WeightSyncError, ConnectionError) as e:
                attempt += 1
                self._recover(e, attempt, f"step {step} weight sync")

    # -- one step ----------------------------------------------------------------------------

    def step(self, step: int) -> dict:
        t0 = time.perf_counter()
        rollout = self._collect(step)
        self.stream_after[step] = rollout.stream_state
        stale = [staleness(t, self.trainer.step) for t in rollout.trajectories]
        # Sandbox infrastructure failures are not the policy's doing: counted, never trained on.
        kept = [t for t, s in zip(rollout.trajectories, stale)
                if s <= self.cfg.max_staleness and t.finish_reason != "infra_error"]
        self._mutating = True  # from here until the step is logged, the trainer is between states
        self._release_engine_memory()
        train, skipped = {}, rollout.skip_reason  # all lost to the sandbox; dynamic sampling found no signal
        if skipped is None:
            train, skipped = policy_update(self.trainer, kept, self.cfg.advantage, self.pad_id, self.echo,
                                           updates=self.cfg.updates_per_step, reference=self.reference)
        if self.trainer.device.type == "cuda":
            # AdamW and the master -> bf16 copy are still queued on the GPU: let the update pay for
            # them, so that sync_ms measures the weight transfer and not the optimizer's tail.
            torch.cuda.synchronize(self.trainer.device)
        sync = self._sync(step)
        memory = self.ranks.memory_gb() if self.ranks else [memory_gb(self.layout.trainer_device)]
        metrics = step_metrics(step, rollout, stale, self.cfg.max_staleness, train, skipped, sync,
                               mem_gb=max(memory), mem_gb_ranks=memory, step_s=time.perf_counter() - t0,
                               world_size=self.world_size, engine_replicas=len(self.engines.replicas),
                               engine_requests=rollout.engine_requests, sync_engines=sync["engines"],
                               engine_restarts=self.engines.restarts, all_lost=rollout.all_lost)
        return {**metrics, "true_on_policy": self.cfg.true_on_policy}  # parity_max != 0 is then an error

    def _release_engine_memory(self) -> None:
        try:
            self.syncer.before_update()  # colocated: the idle engine drops its KV memory during the update
        except (EngineUnavailable, WeightSyncError) as e:  # only memory: a dead engine is found by the sync
            self.echo(f"engine memory release: {e}")

    def _checkpoint(self, step: int, background: bool = True) -> None:
        self.checkpointer.save({"step": step, "data_position": self.stream_after[step]["position"],
                                "stream": self.stream_after[step],
                                "weight_version": str(self.trainer.step)}, background)
        self.checkpointed = step

    # -- the whole run -----------------------------------------------------------------------

    def _on_sigint(self, signum, frame) -> None:
        # Ctrl-C during a rollout stops at once (nothing has changed yet); during the update, sync and
        # logging of a step it lets that step finish, so the checkpoint written on the way out is that
        # step's (otherwise every step since the last periodic checkpoint would be lost). Twice: now.
        if self._mutating and not self._stop_after_step:
            self._stop_after_step = True
            what = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
            self.echo(f"{what}: stopping after this step's update and weight sync ({what} again: stop now)")
            return
        raise KeyboardInterrupt

    def _timing(self, step: int, loop_started: float) -> dict:
        """The whole run's elapsed time so far and the remaining steps' estimate (this process's pace)."""
        now = time.monotonic()
        per_step = (now - loop_started) / (step - self.start_step)
        return {"elapsed_s": now - self.started, "eta_s": per_step * (self.cfg.steps - step)}

    def _stop_for_lost_steps(self, step: int, lost: int, metrics: dict) -> None:
        """`lost` consecutive steps up to `step` lost every episode to the infrastructure: stop, with a
        checkpoint from before them (the trainer has not changed since), so --resume redoes them."""
        before = step - lost
        if before > self.checkpointed:
            self._checkpoint(before)
        cause = "; ".join(metrics["infra_errors"]) or "no message"
        raise RunFailed(f"stopped at step {step}: steps {before + 1}-{step} lost every episode to infrastructure "
                        f"failures, nothing was trained on in them (max_infra_failed_steps="
                        f"{self.cfg.max_infra_failed_steps}). Cause: {cause}. Fix it and continue with "
                        f"--resume {self.run_dir} (from step {before + 1})")

    def run(self) -> Path:
        cfg = self.cfg
        self.checkpointed = completed = self.start_step
        in_main = threading.current_thread() is threading.main_thread()
        # SIGTERM as Ctrl-C, single-process only: ranks that a failed sibling's agent stops must not
        # finish a step whose collectives can no longer complete
        stops = (signal.SIGINT, signal.SIGTERM) if self.ranks is None else (signal.SIGINT,)
        previous = {s: signal.signal(s, self._on_sigint) for s in stops} if in_main else {}
        loop_started, lost = time.monotonic(), 0
        try:
            if self.start_step == 0:  # the base policy, measured as every later evaluation is (step 0)
                self.log.log_eval(self.evaluation.after_step(0, self.engines, self.tokenizer, self.make_sandbox))
                loop_started = time.monotonic()  # the ETA is the training steps' pace
            self.producer.start(self.start_step + 1)
            for step in range(self.start_step + 1, cfg.steps + 1):
                try:
                    metrics = self.step(step)
                except NonFiniteWeights as e:  # a training failure: neither skipped nor retried
                    raise RunFailed(f"stopped at step {step}: {e}. The engines keep the weights they had; lower "
                                    f"optim.lr (or find what diverged) and continue with --resume {self.run_dir} "
                                    f"(from step {self.checkpointed + 1})") from None
                evaluated = self.evaluation.after_step(step, self.engines, self.tokenizer, self.make_sandbox)
                if self.evaluation.new_best(step, evaluated, self.run_dir / "best"):
                    export_best(self.trainer, self.model_path, self.run_dir / "best", self.run_dir / "checkpoint",
                                self.evaluation.best)
                metrics.update(evaluated)
                metrics.update(self._timing(step, loop_started))
                self.log.log(metrics)
                completed, self._mutating = step, False
                lost = lost + 1 if metrics["all_lost"] else 0
                if lost >= cfg.max_infra_failed_steps:
                    self._stop_for_lost_steps(step, lost, metrics)
                if step == cfg.steps or self.checkpointer.due(step):
                    self._checkpoint(step)
                if self._stop_after_step and step < cfg.steps:
                    raise KeyboardInterrupt
            # trainer.step counts optimizer steps: 0 means the policy is still the base model.
            if self.trainer.step > 0:
                export_model(self.trainer, self.model_path, self.run_dir / "final", self.run_dir / "checkpoint")
            self.echo(self.checkpointer.finish())
        except KeyboardInterrupt:
            # Steps are atomic: the trainer state is the one after the last completed step's sync
            # unless a second Ctrl-C hit mid-update, in which case the older checkpoint stands.
            if completed > self.checkpointed and not self._mutating:
                self._checkpoint(completed, background=False)
            self.echo(f"interrupted after step {completed}: resume with --resume {self.run_dir}")
            raise
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            self.close()
        rows = read_metrics(self.log.path)
        for line in run_summary(rows, time.monotonic() - self.started, self.run_dir):
            self.echo(line)
        if self.trainer.step == 0:
            reasons = sorted({r["update_skipped"] for r in rows if r.get("update_skipped")})
            raise RunFailed(f"trained on nothing: no step updated the policy ({'; '.join(reasons) or 'no step ran'}), "
                            f"so it is still the base model and no final/ was written; metrics in {self.run_dir}")
        return self.run_dir

    def close(self) -> None:
        try:
            self.trainer.wait_for_save()  # a checkpoint still being written is finished, not cut off
        except RuntimeError as e:
            self.echo(str(e))
        self.producer.stop()
        if self.syncer is not None:
            try:
                self.syncer.close()
            except Exception as e:  # the engine may already be gone
                self.echo(f"weight sync close: {e}")
        self.engines.stop()
        self.log.close()


def run_training(cfg: TrainConfig, resume_dir: str | None = None, echo=print, ranks: TrainerRanks | None = None) -> Path:
    return TrainingRun(cfg, resume_dir, echo, ranks=ranks).run()


# ----------------------------------------------------------------------------- CLI

def add_arguments(p) -> None:
    add_config_arguments(p, TrainConfig, {"--engine-url": "engine.url"}, repeatable=("--engine-url",))
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")


def saved_config(run_dir: str) -> tuple[dict, list[str]]:
    """A run directory's config.json less its tasks modules, and those modules. They are code this host
    would run, and a run directory may come from anyone: they load only if the command line names them."""
    config_json = Path(run_dir) / "config.json"
    if not config_json.is_file():
        raise ConfigError(f"--resume {run_dir}: not a run directory (no config.json)")
    try:
        saved = json.loads(config_json.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{config_json} cannot be read: {type(e).__name__}: {e}") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{config_json} is not a run's config: a JSON {type(saved).__name__}")
    modules = saved.pop("tasks_module", None) or []
    return saved, [str(m) for m in (modules if isinstance(modules, list) else [modules])]


def run(args) -> int:
    # the run's own config, then what this command line sets
    saved, saved_modules = saved_config(args.resume) if args.resume else (None, [])
    cfg = config_from_args(TrainConfig, args, base=saved)
    unconfirmed = [m for m in saved_modules if m not in cfg.tasks_module]
    if unconfirmed:
        raise ConfigError(f"--resume {args.resume}: its config.json loads tasks_module {', '.join(unconfirmed)}, "
                          "code this host would run, which a run directory is not trusted to ask for: "
                          f"--set tasks_module={','.join(saved_modules)} resumes with it")
    if args.print_config:
        print(to_toml(cfg), end="")
        return 0
    if args.resume and (ckpt := checkpoint_folder(Path(args.resume))) is not None:
        check_resumable(ckpt)  # a checkpoint that cannot be resumed: one line, before any model loads
    ranks = rank_env()
    try:
        if ranks is not None and ranks[1] > 1:  # one of N ranks (torchrun, or launch_ranks below)
            check_world(cfg, ranks[1])
            return run_as_rank(rank_device_type(cfg.trainer_device), cfg.trainer.dist_timeout_s,
                               lambda handle: _train(cfg, args.resume, handle))
        if cfg.trainer.nproc > 1 and ranks is None:
            return launch_ranks(cfg, args.resume)
    except (DistError, ValueError) as e:  # more ranks than GPUs, a setting ranks cannot do yet
        raise ConfigError(str(e)) from None
    return _train(cfg, args.resume)


def _train(cfg: TrainConfig, resume_dir: str | None, ranks: TrainerRanks | None = None) -> int:
    try:
        run_training(cfg, resume_dir=resume_dir, ranks=ranks)
    except KeyboardInterrupt:
        return 130
    except RuntimeError as e:
        if ranks is not None and is_collective_failure(e):
            raise  # the rank's wrapper says which rank and why, in one line
        print(f"nano-miles train: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m nano_miles.train ARGS` is `nano-miles train ARGS`; under torchrun every rank runs it."""
    parser = argparse.ArgumentParser(prog="python -m nano_miles.train", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ConfigError, CheckpointError) as e:
        print(f"nano-miles train: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
