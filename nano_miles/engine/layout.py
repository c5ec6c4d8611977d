"""Where things run (the Layout), and the engine.* keys of the commands that start engines.

`plan_layout`: the trainer on cuda:0 (its N ranks on cuda:0..N-1), the engine replicas on the GPUs
after the trainer's, round-robin (replicas sharing a GPU split its KV-cache share); with no GPU left
over they share the trainer's (a smaller KV share), with no GPU at all everything runs on the CPU.
The engine.* keys become `nano-miles serve` arguments for the pool that starts them (pool.py).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from urllib.parse import urlparse

import torch

from nano_miles.config import filled_in
from nano_miles.dtypes import resolve_dtype_name
from nano_miles.engine.engine import EngineConfig

# A KV cache sized for a GPU of its own would leave the trainer nothing on a shared one.
SHARED_GPU_KV_FRACTION = 0.35
AUTO = "auto"


@dataclass
class EngineLaunchConfig(EngineConfig):
    """The engine.* keys of rollout, eval and train: the engine's own (engine.py) plus where it is.
    Model and dtype are the command's own keys; device and KV share default to the layout's choice."""
    model: str = field(default="", metadata=filled_in("the command's model key"))
    device: str = AUTO                # auto = the GPUs after the trainer's (cuda:1 beside one on cuda:0), else the trainer's, or cpu without a GPU
    dtype: str = field(default=AUTO, metadata=filled_in("the command's dtype key"))
    kv_cache_memory_fraction: float | None = None  # share of the GPU's free memory for the KV cache; none = 0.85, or 0.35 on a GPU shared with the trainer
    true_on_policy: bool = field(default=False, metadata=filled_in("train's true_on_policy key (trainer and engine)"))
    url: str = ""                     # engines somebody else runs (ours or SGLang), comma-separated (--engine-url repeats); "" = start engine.replicas here
    replicas: int = 1                 # engine servers to start here; rollouts spread over them, each group on one

    def __post_init__(self):
        # Checked as the engine will check it, with the layout's choices standing in for "auto"/none.
        engine_keys = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)}
        fraction = DEFAULT_KV_FRACTION if self.kv_cache_memory_fraction is None else self.kv_cache_memory_fraction
        EngineConfig(**{**engine_keys, "device": "cpu" if self.device == AUTO else self.device,
                        "kv_cache_memory_fraction": fraction})
        if isinstance(self.replicas, bool) or not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"engine.replicas must be an integer >= 1, got {self.replicas!r}")
        if self.replicas > 1 and self.urls:
            raise ValueError(f"engine.replicas={self.replicas} starts engines here and engine.url drives engines "
                             "somebody else runs: set one of them")
        for url in self.urls:
            parsed = urlparse(url)
            if parsed.scheme not in ("http", "https") or not parsed.hostname:
                raise ValueError(f"engine.url {url!r} is not an http(s)://HOST:PORT address")

    @property
    def urls(self) -> list[str]:
        return [u.strip() for u in self.url.split(",") if u.strip()]

    def serve_args(self) -> list[str]:
        """`nano-miles serve` arguments for every engine key that differs from the engine's default but
        model, device and dtype (the layout's flags) and the KV share (each replica's own, Layout.args_of)."""
        return [a for f in dataclasses.fields(EngineConfig) if f.name not in _PER_REPLICA
                and getattr(self, f.name) != f.default
                for a in ("--set", f"engine.{f.name}={getattr(self, f.name)}")]


_PER_REPLICA = ("model", "device", "dtype", "kv_cache_memory_fraction")
DEFAULT_KV_FRACTION = EngineConfig.kv_cache_memory_fraction


@dataclass
class Layout:
    trainer_device: str | None  # None: no trainer (rollout, eval); with N ranks, rank 0's
    engine_device: str          # the first replica's
    dtype: str                  # resolved: float32 | bfloat16 | float16
    engine_args: list[str]      # `nano-miles serve` flags of every engine started here (args_of adds each one's KV share)
    engine_devices: list[str] = field(default_factory=list)          # one per replica started here
    kv_fractions: list[float | None] = field(default_factory=list)   # per replica; None: the engine's default

    def args_of(self, replica: int = 0) -> list[str]:
        """The `nano-miles serve` flags of one replica."""
        fraction = self.kv_fractions[replica] if replica < len(self.kv_fractions) else None
        if fraction is None or fraction == DEFAULT_KV_FRACTION:
            return list(self.engine_args)
        return [*self.engine_args, "--set", f"engine.kv_cache_memory_fraction={fraction}"]


def plan_layout(dtype: str, engine: EngineLaunchConfig, trainer_device: str | None = "auto",
                gpus: int | None = None, trainer_ranks: int = 1) -> Layout:
    """Devices and dtype for a trainer of `trainer_ranks` ranks on this host (trainer_device "auto":
    from the hardware) and its engine replicas, or for engines alone (trainer_device=None). The dtype
    follows the trainer's device when there is one. `gpus`: how many GPUs to plan for (None: the ones
    torch sees)."""
    n = gpus if gpus is not None else torch.cuda.device_count() if torch.cuda.is_available() else 0
    trainer = None if trainer_device is None else (("cpu" if n == 0 else "cuda:0") if trainer_device == "auto"
                                                   else trainer_device)
    trainer_gpus = []
    if trainer is not None and trainer.startswith("cuda"):
        first = torch.device(trainer).index or 0
        trainer_gpus = [f"cuda:{i}" for i in range(first, first + trainer_ranks)]
    if engine.device != AUTO:
        devices = [engine.device] * engine.replicas
    elif n == 0:
        devices = ["cpu"] * engine.replicas
    else:
        free = [f"cuda:{i}" for i in range(n) if f"cuda:{i}" not in trainer_gpus] or trainer_gpus
        devices = [free[i % len(free)] for i in range(engine.replicas)]
    fractions = []
    for d in devices:
        fraction = engine.kv_cache_memory_fraction
        if fraction is None and d.startswith("cuda"):
            sharing = devices.count(d)  # replicas on one GPU split its share
            if d in trainer_gpus:
                fraction = round(SHARED_GPU_KV_FRACTION / sharing, 4)
            elif sharing > 1:
                fraction = round(DEFAULT_KV_FRACTION / sharing, 4)
        fractions.append(fraction)
    resolved = resolve_dtype_name(dtype, trainer or devices[0])
    return Layout(trainer, devices[0], resolved, engine.serve_args(), devices, fractions)
