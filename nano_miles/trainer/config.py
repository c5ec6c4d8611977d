"""The trainer's keys: `trainer.*`, `optim.*` and `sync.*` (the weight sync, trainer/weight_sync.py)
of `nano-miles train`."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from nano_miles.config import filled_in
from nano_miles.dtypes import TRAINABLE
from nano_miles.trainer.loss import LossConfig
from nano_miles.trainer.lr_schedule import SCHEDULES


@dataclass
class OptimConfig:
    lr: float = 1e-6            # AdamW learning rate
    beta1: float = 0.9          # AdamW first-moment decay
    beta2: float = 0.999        # AdamW second-moment decay
    eps: float = 1e-8           # AdamW denominator epsilon
    weight_decay: float = 0.0   # AdamW decoupled weight decay
    max_grad_norm: float = 1.0  # clip the global FP32 gradient norm; 0 disables clipping
    lr_schedule: str = "constant"  # constant | cosine | linear: the decay after warm-up (nano_miles/trainer/lr_schedule.py)
    warmup_steps: int = 0       # optimizer steps of linear warm-up from lr/warmup_steps to lr; 0 = none
    decay_steps: int = 0        # cosine | linear: optimizer steps until the decay reaches min_lr_ratio; 0 = the run's (steps x updates_per_step), as HF's schedulers count
    min_lr_ratio: float = 0.0   # cosine | linear: the final learning rate, as a fraction of lr

    def __post_init__(self):
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"optim.lr must be a positive number, got {self.lr}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"optim betas must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.eps <= 0 or self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ValueError("optim.eps must be > 0, weight_decay and max_grad_norm >= 0")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"optim.lr_schedule must be one of {', '.join(SCHEDULES)}, got {self.lr_schedule!r}")
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ValueError("optim.warmup_steps and optim.decay_steps must be >= 0")
        if self.decay_steps and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"optim.decay_steps ({self.decay_steps}) must be past optim.warmup_steps ({self.warmup_steps})")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


def checkpoints_layers(setting: bool | None, on_gpu: bool, true_on_policy: bool) -> bool:
    """trainer.gradient_checkpointing's auto (None): on for a CPU trainer, whose activations are the
    memory to save, but not in true on-policy mode, whose exact ops cost far more to rerun."""
    return not (on_gpu or true_on_policy) if setting is None else setting


@dataclass
class TrainerConfig:
    """`trainer.*` of `nano-miles train`; whoever builds the trainer gives the filled_in fields."""
    model: str = field(default="", metadata=filled_in("HF folder (see nano_miles.models.prepare.resolve_model)"))
    device: str = field(default="cpu", metadata=filled_in("the trainer's device"))
    dtype: str = field(default="float32", metadata=filled_in(
        "compute dtype: float32 | bfloat16 (masters and AdamW state are FP32)"))
    micro_batch_size: int = 0     # sequences per forward/backward; 0 = auto (8 on GPU, 1 on CPU)
    logprob_chunk: int = 0        # tokens per lm_head -> float32 log_softmax chunk; 0 = auto (1024 on GPU, 128 on CPU: 0.08 GB a [chunk, vocab] tensor for Qwen)
    gradient_checkpointing: bool | None = None  # recompute decoder layers in backward; none = on for a CPU trainer (a 4096-token episode keeps ~12 GB of activations without it), off on GPU and in true on-policy mode (it would rerun the exact forward)
    compute_entropy: bool = True  # report the policy entropy (one more pass over each chunk's logits)
    nproc: int = 1                # trainer ranks: FSDP2 shards, one GPU each (gloo processes on CPU); train starts them itself
    dist_timeout_s: float = 300.0  # seconds before any collective of the trainer ranks fails the run
    true_on_policy: bool = field(default=False, metadata=filled_in(
        "batch-invariant forward shared with the engine: log-probs equal bit for bit (train: true_on_policy)"))
    temperature: float = field(default=1.0, metadata=filled_in(
        "the rollouts' sampling temperature: log-probs are of softmax(logits / T), the distribution sampled "
        "(train: rollout.temperature)"))
    optim: OptimConfig = field(default_factory=OptimConfig, metadata=filled_in("AdamW"))
    loss: LossConfig = field(default_factory=LossConfig, metadata=filled_in("the policy loss"))

    def __post_init__(self):
        if self.dtype not in TRAINABLE:
            raise ValueError(f"trainer dtype must be one of {list(TRAINABLE)}, got {self.dtype!r}")
        if self.micro_batch_size < 0 or self.logprob_chunk < 0:
            raise ValueError("trainer.micro_batch_size and trainer.logprob_chunk must be >= 0 (0 = auto)")
        if isinstance(self.nproc, bool) or not isinstance(self.nproc, int) or self.nproc < 1:
            raise ValueError(f"trainer.nproc must be an integer >= 1, got {self.nproc!r}")
        if not self.dist_timeout_s > 0:
            raise ValueError(f"trainer.dist_timeout_s must be > 0, got {self.dist_timeout_s}")
        if not self.temperature > 0:  # greedy rollouts (T=0) have no distribution to train
            raise ValueError(f"the trainer's temperature must be > 0, got {self.temperature}")


TRANSPORTS = ("auto", "ipc", "distributed", "disk", "shared")
PAUSE_MODES = ("in_place", "auto")  # "auto": what older configs hold; it is in_place now
_REMOVED = {"staged": "sync.transport=distributed (NCCL: what auto picks for a GPU without P2P)",
            "drain": "sync.pause_mode=in_place", "retract": "sync.pause_mode=in_place",
            "abort": "sync.pause_mode=in_place"}


@dataclass
class SyncConfig:
    """`sync.*`: how each new version of the weights reaches the engines (trainer/weight_sync.py)."""
    transport: str = "auto"        # auto | ipc | distributed | disk | shared (CPU, mode=sync: one copy of the weights)
    verify: bool = False           # compare per-tensor checksums with every engine after each sync
    bucket_mb: float = 1024.0      # MiB per flattened bucket (one HTTP call / broadcast each)
    timeout_s: float = 300.0       # per HTTP call and per broadcast
    master_address: str = "127.0.0.1"  # distributed: the address this (rank 0) process's store listens on, and only it
    master_port: int = 0           # 0: a free port
    disk_dir: str = ""             # disk: the folder written each sync ("" = a temporary folder)
    pause_mode: str = "in_place"   # requests in flight during a sync keep their KV and continue under the new weights (the one mode; docs/design.md)

    def __post_init__(self):
        for key, allowed in (("transport", TRANSPORTS), ("pause_mode", PAUSE_MODES)):
            value = getattr(self, key)
            if value in _REMOVED:
                raise ValueError(f"sync.{key}={value} is no longer offered: use {_REMOVED[value]}")
            if value not in allowed:
                raise ValueError(f"sync.{key} must be one of {allowed}, got {value!r}")
        if not self.bucket_mb > 0 or not self.timeout_s > 0:
            raise ValueError(f"sync.bucket_mb and sync.timeout_s must be > 0, got {self.bucket_mb}, {self.timeout_s}")
