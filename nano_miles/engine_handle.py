"""The engine a command uses, and where things run.

`plan_layout` decides the devices from the hardware (two or more GPUs: trainer on cuda:0, engine on
cuda:1; one GPU: both on it; none: the CPU) and the dtype ("auto": nano_miles.dtypes). `EngineHandle`
is either an engine somebody else runs (`engine.url`: not ours to restart) or a `nano-miles serve`
process this command starts, restarts when it dies, and stops at the end.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from nano_miles.client import EngineClient
from nano_miles.dtypes import resolve_dtype_name
from nano_miles.engine_process import start_engine_process

# A KV cache sized for a GPU of its own would leave the trainer nothing on a shared one.
SHARED_GPU_KV_FRACTION = 0.35


@dataclass
class EngineLaunchConfig:
    """The `engine.*` keys. Field names are the engine's own (`nano-miles serve`)."""
    url: str = ""                    # an engine somebody else runs (ours or SGLang); "" = start one (rollout/eval: several, comma-separated)
    device: str = "auto"             # for an engine started here: auto = cuda:1 beside a trainer on cuda:0, else cuda:0, or cpu without a GPU
    max_running_requests: int = 256  # requests the engine decodes at once
    kv_cache_memory_fraction: float | None = None  # share of free GPU memory for the KV cache; none = the engine's 0.85, or 0.35 on a GPU shared with the trainer

    def __post_init__(self):
        if self.max_running_requests < 1:
            raise ValueError(f"engine.max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.kv_cache_memory_fraction is not None and not 0 < self.kv_cache_memory_fraction < 1:
            raise ValueError(f"engine.kv_cache_memory_fraction must be in (0, 1), got {self.kv_cache_memory_fraction}")

    @property
    def urls(self) -> list[str]:
        return [u.strip() for u in self.url.split(",") if u.strip()]


@dataclass
class Layout:
    trainer_device: str | None  # None: no trainer (rollout, eval)
    engine_device: str
    dtype: str                  # resolved: float32 | bfloat16 | float16
    engine_args: list[str]      # extra `nano-miles serve` flags for an engine started here


def plan_layout(dtype: str, engine: EngineLaunchConfig, trainer_device: str | None = "auto") -> Layout:
    """Devices and dtype for a trainer (trainer_device, "auto" from the hardware) and its engine, or
    for an engine alone (trainer_device=None). The dtype follows the trainer's device when there is one."""
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    auto_trainer, auto_engine = ("cpu", "cpu") if n == 0 else ("cuda:0", "cuda:0")
    if n >= 2 and trainer_device is not None:
        auto_engine = "cuda:1"
    trainer = None if trainer_device is None else (auto_trainer if trainer_device == "auto" else trainer_device)
    engine_device = auto_engine if engine.device == "auto" else engine.device
    resolved = resolve_dtype_name(dtype, trainer or engine_device)
    args = ["--max-running-requests", str(engine.max_running_requests)]
    fraction = engine.kv_cache_memory_fraction
    if fraction is None and engine_device.startswith("cuda") and engine_device == trainer:
        fraction = SHARED_GPU_KV_FRACTION
    if fraction is not None:
        args += ["--mem-fraction-static", str(fraction)]  # serve's SGLang-named flag
    return Layout(trainer, engine_device, resolved, args)


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
