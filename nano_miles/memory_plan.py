"""What a training run needs in host memory, decided before anything heavy loads.

`plan_memory` estimates from the model's config.json the peak host memory of the run's processes
(term by term in `estimate`; GPU memory is not counted) and refuses in one line with the numbers when
it exceeds MemAvailable and the room under this process's cgroup limits (or `memory_limit_gb`). In
mode=sync rollout and update do not overlap: the peak is what is resident plus the larger phase.
bench/main_job_memory.py measures how close the estimate comes (docs/benchmarks.md).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import psutil
import torch

from nano_miles.dtypes import DTYPES
from nano_miles.engine.model import ModelConfig
from nano_miles.trainer.config import checkpoints_layers

GB = 1e9
TRAINER_RUNTIME = int(0.9 * GB)  # torch + transformers + the loop, measured on the CPU job
ENGINE_RUNTIME = int(0.7 * GB)   # torch + the server + prefill activations of a CPU engine
SANDBOX_BYTES = int(0.02 * GB)   # one episode's sandbox processes (bwrap, shell, init), PSS
CPU_KV_DEFAULT = 2 << 30         # EngineConfig.cpu_kv_cache_bytes: the engine's own default
CPU_LOGPROB_CHUNK = 128          # what trainer.logprob_chunk = 0 means on CPU


class MemoryCheckError(RuntimeError):
    pass


def num_params(mc: ModelConfig) -> int:
    H, L = mc.hidden_size, mc.num_layers
    q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    attention = 2 * H * q + 2 * H * kv + ((q + 2 * kv) if mc.attention_bias else 0)
    embed = mc.vocab_size * H * (1 if mc.tie_word_embeddings else 2)
    return embed + L * (attention + 3 * H * mc.intermediate_size + 2 * H) + H


def activation_bytes_per_token(mc: ModelConfig, checkpointing: bool) -> int:
    """FP32 bytes kept for backward per token: every layer's saved tensors (about 12 hidden-sized and
    4 MLP-sized vectors a layer), or with checkpointing each layer's input plus one layer recomputed."""
    layer = 4 * (12 * mc.hidden_size + 4 * mc.intermediate_size)
    return mc.num_layers * 4 * mc.hidden_size + 2 * layer if checkpointing else mc.num_layers * layer


@dataclass
class MemoryPlan:
    resident: dict[str, int] = field(default_factory=dict)  # held through the whole step
    rollout: dict[str, int] = field(default_factory=dict)   # only while the engine generates
    update: dict[str, int] = field(default_factory=dict)    # only during the trainer's update
    overlap: bool = False  # async: rollouts run during updates, so both phases' terms add up
    available: int = 0
    source: str = ""
    num_params: int = 0

    @property
    def peak(self) -> int:
        phases = (sum(self.rollout.values()), sum(self.update.values()))
        return sum(self.resident.values()) + (sum(phases) if self.overlap else max(phases))

    def breakdown(self) -> str:
        items = sorted({**self.resident, **self.rollout, **self.update}.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{k} {v / GB:.1f}" for k, v in items if v >= 0.05 * GB)


def machine_memory() -> tuple[int, str]:
    """(bytes this process may still use, where the figure comes from)."""
    return min([*_cgroup_room(), (psutil.virtual_memory().available, "MemAvailable")])


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _cgroup_room() -> list[tuple[int, str]]:
    """Room under every memory limit on this process's cgroup path (v2 and v1), reclaimable page
    cache counted as room."""
    room = []
    lines = _read("/proc/self/cgroup").splitlines()
    for _, controllers, path in (line.split(":", 2) for line in lines if line.count(":") >= 2):
        if controllers == "":
            roots, limit_file, usage_file, stat_key = ("/sys/fs/cgroup", "/sys/fs/cgroup/unified"), \
                "memory.max", "memory.current", "inactive_file"
        elif "memory" in controllers.split(","):
            roots, limit_file, usage_file, stat_key = ("/sys/fs/cgroup/memory",), \
                "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
        else:
            continue
        for root in roots:
            d = os.path.normpath(root + path)
            while d.startswith(root):
                limit, usage = _read(f"{d}/{limit_file}").strip(), _read(f"{d}/{usage_file}").strip()
                if limit.isdigit() and usage.isdigit() and int(limit) < 1 << 60:  # "max": no limit
                    stat = [line.split() for line in _read(f"{d}/memory.stat").splitlines()]
                    free = int(limit) - int(usage) + int(dict(kv for kv in stat if len(kv) == 2).get(stat_key, "0"))
                    room.append((max(free, 0), f"cgroup {limit_file} {int(limit) / GB:.1f} GB"))
                if d == root:
                    break
                d = os.path.dirname(d)
    return room


def _in_flight(cfg) -> int:
    """Episodes a step has in flight at most: its first wave (a refill replaces a group that came back)."""
    return min(cfg.rollout.max_concurrency, cfg.rollout.round_size(cfg.tasks_per_step) * cfg.rollout.group_size)


def estimate(cfg, layout, model_path: str, shared: bool) -> MemoryPlan:
    """The plan for a TrainConfig on `layout`. A CPU trainer's weights are shared with a colocated CPU
    engine (`shared`); with N ranks the sharded state counts once, runtime and activations once a rank."""
    mc = ModelConfig.from_pretrained(model_path)
    P, dtype = num_params(mc), DTYPES[layout.dtype]
    weights, plan = P * dtype.itemsize, MemoryPlan(num_params=P, overlap=cfg.mode == "async")
    plan.rollout["sandboxes"] = _in_flight(cfg) * SANDBOX_BYTES  # closed when their episode ends
    if layout.trainer_device == "cpu":
        t, low_precision = cfg.trainer, dtype != torch.float32
        checkpointing = checkpoints_layers(t.gradient_checkpointing, on_gpu=False, true_on_policy=cfg.true_on_policy)
        plan.resident["trainer weights"] = weights
        if low_precision:
            plan.resident["FP32 masters"] = 4 * P
        plan.resident["AdamW moments"] = 8 * P
        plan.resident["trainer runtime"] = t.nproc * TRAINER_RUNTIME
        if cfg.loss.kl_coef > 0:
            plan.resident["reference policy"] = weights
        plan.update["gradients"] = 4 * P + (weights if low_precision else 0)
        tokens = (t.micro_batch_size or 1) * cfg.rollout.env.max_total_tokens
        # The chunk's FP32 [chunk, vocab] tensors (logits, log-softmax, the entropy's two, a gradient)
        # and the tied lm_head's [vocab, hidden] weight gradient, in the backward before the layers'.
        logits = 5 * (t.logprob_chunk or CPU_LOGPROB_CHUNK) * mc.vocab_size * 4 + mc.vocab_size * mc.hidden_size * 4
        plan.update["activations"] = t.nproc * max(tokens * activation_bytes_per_token(mc, checkpointing),
                                                   tokens * 4 * mc.hidden_size * mc.num_layers + logits)
    else:
        plan.resident["trainer runtime"] = 2 * TRAINER_RUNTIME  # CUDA context and pinned buffers on the host
    if not cfg.engine.url and layout.engine_device == "cpu":
        replicas = max(1, layout.engine_devices.count("cpu"))
        plan.resident["engine weights"] = 0 if shared else replicas * weights
        # Shared (colocated): the engine drops its KV cache's memory for the update.
        (plan.rollout if shared else plan.resident)["engine KV cache"] = replicas * job_kv_cache_bytes(cfg, mc, dtype)
        plan.resident["engine runtime"] = replicas * ENGINE_RUNTIME
    elif not cfg.engine.url:
        plan.resident["engine runtime"] = 2 * ENGINE_RUNTIME
    return plan


def uses_shared_weights(cfg, layout) -> bool:
    """Will the weight sync be `shared` (weight_sync.choose_transport, as train asks for it)?"""
    return (cfg.mode == "sync" and cfg.sync.transport in ("auto", "shared") and not cfg.engine.url
            and layout.trainer_device == "cpu" and layout.engine_device == "cpu"
            and cfg.trainer.nproc == 1)  # a sharded trainer holds no whole tensor an engine could map


def job_kv_cache_bytes(cfg, mc: ModelConfig, dtype: torch.dtype) -> int:
    """A CPU engine's KV cache for every episode in flight at its token budget (twice as many in async
    mode, which rolls out the next step during an update), never more than the engine's default."""
    episodes = min(cfg.rollout.max_concurrency, 2 * _in_flight(cfg)) if cfg.mode == "async" else _in_flight(cfg)
    per_token = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * dtype.itemsize  # K and V
    return min(CPU_KV_DEFAULT, episodes * cfg.rollout.env.max_total_tokens * per_token)


def plan_memory(cfg, layout, model_path: str, shared: bool, echo=print) -> MemoryPlan:
    """Estimate, size a CPU engine's KV cache for the job (layout.engine_args), refuse if it won't fit."""
    plan = estimate(cfg, layout, model_path, shared)
    if not cfg.engine.url and layout.engine_device == "cpu":
        kv = {**plan.resident, **plan.rollout}["engine KV cache"] // max(1, layout.engine_devices.count("cpu"))
        layout.engine_args += ["--set", f"engine.cpu_kv_cache_bytes={kv}"]
    if cfg.memory_limit_gb > 0:
        plan.available, plan.source = int(cfg.memory_limit_gb * GB), "memory_limit_gb"
    else:
        plan.available, plan.source = machine_memory()
    line = (f"this run needs about {plan.peak / GB:.1f} GB of memory at its peak ({plan.breakdown()}) and "
            f"{plan.available / GB:.1f} GB is available ({plan.source})")
    if plan.available and plan.peak > plan.available and cfg.memory_check:
        raise MemoryCheckError(f"{line}: lower rollout.env.max_total_tokens, rollout.group_size or tasks_per_step, "
                               "use a smaller model, or set memory_check=false to start anyway")
    echo(f"memory: {line}")
    return plan
