"""The keys of `nano-miles train` (`TrainConfig`) and what they decide before anything starts: whether
a layout of ranks can run them (`check_world`) and which devices the trainer and engines take
(`train_layout`)."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

from nano_miles.dtypes import TRAINABLE
from nano_miles.engine.layout import Layout, plan_layout
from nano_miles.job import RolloutCommandConfig
from nano_miles.rollout.dynamic_sampling import TrainRolloutConfig
from nano_miles.telemetry import parse_report_to
from nano_miles.trainer.config import OptimConfig, SyncConfig, TrainerConfig
from nano_miles.trainer.loss import AdvantageConfig, LossConfig

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
    max_staleness: int = 1            # async: max weight versions between a trajectory's oldest token and the policy to train on it (an older one still counts in its group's baseline)
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
        if self.rollout.carry_over and (self.mode != "async" or self.max_staleness < 2):
            # a group started while step v is built may end in step v+1's, trained on by version v+1
            raise ValueError("rollout.carry_over carries groups into the next step: it needs mode=async and "
                             f"max_staleness >= 2 (got mode={self.mode}, max_staleness={self.max_staleness})")
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
