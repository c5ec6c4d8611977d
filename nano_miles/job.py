"""What rollout, eval and train share: the keys that name a model, its tasks, the engines and the
sandboxes (RolloutCommandConfig), the model folder and the tasks they resolve to, and, for rollout
and eval, rollouts on engines started for the command, their summary and the results line.
"""
from __future__ import annotations

import asyncio
import collections
import datetime
import json
import os
import platform
import subprocess
import time
from dataclasses import dataclass, field

from tqdm import tqdm
from transformers import AutoTokenizer

from nano_miles.config import ConfigError, add_config_arguments, config_from_args, to_toml
from nano_miles.dtypes import DTYPE_NAMES
from nano_miles.engine.layout import EngineLaunchConfig, plan_layout
from nano_miles.engine.pool import EnginePool
from nano_miles.models.prepare import ModelError, resolve_model
from nano_miles.rollout.episode import RolloutConfig, rollout_groups
from nano_miles.rollout.sandbox import SandboxConfig, check_sandbox, sandbox_factory
from nano_miles.tasks import report_load_errors, select_tasks


@dataclass
class RolloutCommandConfig:
    """The keys of `nano-miles rollout`; eval and train have these too (same names, same defaults)."""
    model: str = "qwen2.5-coder-0.5b-instruct"  # registered name (see prepare-model), HF folder or hub id; its tokenizer is used
    tasks: str = "seed"               # seed | train | heldout | all | a family (alfa) | comma-separated task ids
    tasks_module: list[str] = field(default_factory=list)  # your own tasks: PATH.py, package.module or FILE.toml (docs/tasks.md)
    seed: int = 0                     # task seed: the files and ground truth of every group
    dtype: str = "auto"               # float32 | bfloat16 | float16 | auto (bfloat16 on GPU, float32 on CPU)
    engine: EngineLaunchConfig = field(default_factory=EngineLaunchConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)

    def __post_init__(self):
        if self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {list(DTYPE_NAMES)}, got {self.dtype!r}")


def add_job_arguments(p, cls, flags: dict[str, str]) -> None:
    """rollout's and eval's flags: the shorthands they share, theirs (`flags`), --results-jsonl."""
    shared = {"--model": "model", "--engine-url": "engine.url", "--tasks": "tasks",
              "--tasks-module": "tasks_module"}
    add_config_arguments(p, cls, {**shared, **flags}, repeatable=("--engine-url", "--tasks-module"))
    p.add_argument("--results-jsonl", default=None,
                   help="append a summary line (date, commit, machine, figures) to this file")


def model_folder(name: str) -> str:
    """The local folder of model `name`, or a ConfigError saying why there is none (one line)."""
    try:
        return str(resolve_model(name))
    except ModelError as e:
        raise ConfigError(str(e)) from None


def selected_tasks(command: str, which: str, modules=(), select=select_tasks) -> list:
    """The tasks `which` selects after loading the user's task `modules` (one line per bad task; the
    rest loads), or a ConfigError naming the module that cannot load or the unknown task."""
    report_load_errors(modules, f"nano-miles {command}")
    try:
        return select(which)
    except KeyError as e:
        raise ConfigError(e.args[0]) from None


def run_rollouts(cls, args, command: str):
    """rollout's and eval's work: (cfg, tasks, trajectories, seconds, summary), or None once
    --print-config printed the config. With eval each task runs `instances` times in a row
    (rollout_groups gives every copy a task seed of its own). The rollouts run on cfg.engine.url, or
    on an engine started for them; the sandbox is checked first: where it cannot run, nothing would."""
    cfg = config_from_args(cls, args)
    if args.print_config:
        print(to_toml(cfg), end="")
        return None
    tasks = selected_tasks(command, cfg.tasks, cfg.tasks_module)
    check_sandbox(cfg.sandbox)
    model_path = model_folder(cfg.model)
    tok = AutoTokenizer.from_pretrained(model_path)
    layout = plan_layout(cfg.dtype, cfg.engine, trainer_device=None)
    if not cfg.engine.urls:
        print(f"starting an engine for {cfg.model} on {layout.engine_device} ...", flush=True)
    with EnginePool(cfg.engine, layout, model_path, ready_timeout=900) as urls:
        t0, stats = time.monotonic(), {}
        copies = [t for t in tasks for _ in range(getattr(cfg, "instances", 1))]
        trajs = roll_out(urls, tok, copies, cfg.rollout, cfg.seed, command, stats=stats,
                         sandbox_factory=sandbox_factory(cfg.sandbox))
        secs = time.monotonic() - t0
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(t.to_json() + "\n" for t in trajs)
    return cfg, tasks, trajs, secs, summarize(trajs, stats["setup_failures"])


def roll_out(engines, tokenizer, tasks, rollout: RolloutConfig, seed: int, desc: str, **kwargs) -> list:
    """rollout_groups (its keyword arguments: stats, sandbox_factory) with a progress bar on stderr."""
    with tqdm(total=len(tasks) * rollout.group_size, desc=desc, unit="ep", leave=False, dynamic_ncols=True) as bar:
        return asyncio.run(rollout_groups(engines, tokenizer, tasks, rollout, seed=seed,
                                          on_episode_done=lambda: bar.update(1), **kwargs))


def summarize(trajs, setup_failures: int = 0) -> dict:
    n, finish = max(len(trajs), 1), dict(collections.Counter(t.finish_reason for t in trajs))
    return {"episodes": len(trajs), "pass_rate": sum(t.solved for t in trajs) / n,
            "mean_reward": sum(t.reward for t in trajs) / n, "mean_turns": sum(t.num_turns for t in trajs) / n,
            "infra_failures": setup_failures + sum(int(t.reward_components.get("infra_failures", 0)) for t in trajs),
            "finish_reasons": finish, "model_tokens": sum(sum(t.response_mask) for t in trajs)}


def append_result(path: str, record: dict) -> None:
    """Append `record` to a results file with its date, commit and machine."""
    try:  # BENCH_COMMIT first, as in bench/results.py: a device machine's copy of .git can be stale
        commit = os.environ.get("BENCH_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = ""
    provenance = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "commit": commit or "unknown",
                  "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpu"}
    with open(path, "a") as f:
        f.write(json.dumps({**provenance, **record}) + "\n")
