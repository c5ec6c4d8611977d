"""The engine a command uses, and where things run.

`plan_layout` decides the devices from the hardware (two or more GPUs: trainer on cuda:0, engine on
cuda:1; one GPU: both on it; none: the CPU) and the dtype ("auto": nano_miles.dtypes), and turns the
engine.* keys into `nano-miles serve` arguments. `EngineHandle`
is either an engine somebody else runs (`engine.url`: not ours to restart) or a `nano-miles serve`
process this command starts, restarts when it dies, and stops at the end.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nano_miles.client import EngineClient
from nano_miles.config import filled_in
from nano_miles.dtypes import resolve_dtype_name
from nano_miles.engine.engine import EngineConfig
from nano_miles.engine_process import start_engine_process

# A KV cache sized for a GPU of its own would leave the trainer nothing on a shared one.
SHARED_GPU_KV_FRACTION = 0.35
AUTO = "auto"


@dataclass
class EngineLaunchConfig(EngineConfig):
    """The engine.* keys of rollout, eval and train: the engine's own keys (`nano-miles serve
    --set engine.KEY=...`, nano_miles/engine/engine.py), plus where the engine is. Its model and dtype
    are the command's own `model` and `dtype` keys; device and KV share default to the layout's choice."""
    model: str = field(default="", metadata=filled_in("the command's model key"))
    device: str = AUTO                # auto = cuda:1 beside a trainer on cuda:0, else cuda:0, or cpu without a GPU
    dtype: str = field(default=AUTO, metadata=filled_in("the command's dtype key"))
    kv_cache_memory_fraction: float | None = None  # share of the GPU's free memory for the KV cache; none = 0.85, or 0.35 on a GPU shared with the trainer
    true_on_policy: bool = field(default=False, metadata=filled_in("train's true_on_policy key (trainer and engine)"))
    url: str = ""                     # an engine somebody else runs (ours or SGLang); "" = start one (rollout/eval: several, comma-separated)

    def __post_init__(self):
        # Checked as the engine will check it, with the layout's choices standing in for "auto"/none.
        engine_keys = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)}
        fraction = DEFAULT_KV_FRACTION if self.kv_cache_memory_fraction is None else self.kv_cache_memory_fraction
        EngineConfig(**{**engine_keys, "device": "cpu" if self.device == AUTO else self.device,
                        "kv_cache_memory_fraction": fraction})

    @property
    def urls(self) -> list[str]:
        return [u.strip() for u in self.url.split(",") if u.strip()]

    def serve_args(self, kv_cache_memory_fraction: float | None) -> list[str]:
        """`nano-miles serve` arguments for every engine key that differs from the engine's default
        (model, device and dtype are the layout's, passed as flags)."""
        args = []
        for f in dataclasses.fields(EngineConfig):
            value = kv_cache_memory_fraction if f.name == "kv_cache_memory_fraction" else getattr(self, f.name)
            if f.name not in ("model", "device", "dtype") and value is not None and value != _ENGINE_DEFAULTS[f.name]:
                args += ["--set", f"engine.{f.name}={value}"]
        return args


_ENGINE_DEFAULTS = {f.name: getattr(EngineConfig(), f.name) for f in dataclasses.fields(EngineConfig)}
DEFAULT_KV_FRACTION = _ENGINE_DEFAULTS["kv_cache_memory_fraction"]


@dataclass
class Layout:
    trainer_device: str | None  # None: no trainer (rollout, eval)
    engine_device: str
    dtype: str                  # resolved: float32 | bfloat16 | float16
    engine_args: list[str]      # extra `nano-miles serve` flags for an engine started here


def plan_layout(dtype: str, engine: EngineLaunchConfig, trainer_device: str | None = "auto",
                gpus: int | None = None) -> Layout:
    """Devices and dtype for a trainer (trainer_device, "auto" from the hardware) and its engine, or
    for an engine alone (trainer_device=None). The dtype follows the trainer's device when there is one.
    `gpus`: how many GPUs to plan for (None: the ones torch sees)."""
    n = gpus if gpus is not None else torch.cuda.device_count() if torch.cuda.is_available() else 0
    auto_trainer, auto_engine = ("cpu", "cpu") if n == 0 else ("cuda:0", "cuda:0")
    if n >= 2 and trainer_device is not None:
        auto_engine = "cuda:1"
    trainer = None if trainer_device is None else (auto_trainer if trainer_device == "auto" else trainer_device)
    engine_device = auto_engine if engine.device == AUTO else engine.device
    resolved = resolve_dtype_name(dtype, trainer or engine_device)
    fraction = engine.kv_cache_memory_fraction
    if fraction is None and engine_device.startswith("cuda") and engine_device == trainer:
        fraction = SHARED_GPU_KV_FRACTION
    return Layout(trainer, engine_device, resolved, engine.serve_args(fraction))


class EngineHandle:
    """Engines somebody else runs (engine.url) or one `nano-miles serve` process of our own."""

    def __init__(self, cfg: EngineLaunchConfig, layout: Layout, model_path: str, run_dir: Path | None = None,
                 ready_timeout: float = 300.0):
        self.cfg, self.layout, self.model_path, self.run_dir = cfg, layout, model_path, run_dir
        self.ready_timeout = ready_timeout
        self.process = None
        self.restarts = 0
        self.urls = cfg.urls

    def start(self) -> list[str]:
        if self.cfg.urls:
            for url in self.cfg.urls:
                EngineClient(url).wait_until_ready(timeout=60)
            return self.urls
        self.process = start_engine_process(
            self.model_path, device=self.layout.engine_device, dtype=self.layout.dtype,
            extra_args=self.layout.engine_args, ready_timeout=self.ready_timeout,
            log_path=None if self.run_dir is None else self.run_dir / "engine.log")
        self.urls = [self.process.url]
        if self.run_dir is not None:
            (self.run_dir / "engine.json").write_text(json.dumps({"pid": self.process.process.pid,
                                                                  "url": self.process.url}))
        return self.urls

    def restart(self) -> list[str]:
        if self.cfg.urls:
            raise RuntimeError(f"the engine at {self.cfg.url} is unavailable and is not ours to restart")
        self.stop()
        self.restarts += 1
        return self.start()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None

    def __enter__(self) -> list[str]:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
