"""`nano-miles rollout`: run multi-turn rollouts on a task split and write the trajectories as JSONL.

    nano-miles rollout --model qwen2.5-coder-0.5b-instruct --tasks seed --group-size 8 --out r.jsonl
    nano-miles rollout --model M --engine-url http://h1:30000 --engine-url http://h2:30000 ...

Without --engine-url an engine (`nano-miles serve`) is started for the run and stopped after it.
Prints pass rate, mean reward and mean turns. Every flag sets a config key (docs/config.md), which
`--config FILE.toml` and `--set key=value` set too: `--group-size 8` is `--set rollout.group_size=8`.
"""
from __future__ import annotations

import asyncio
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


CONFIG = RolloutCommandConfig

# The flags these commands had before they took config keys: each sets the key it names.
FLAGS = {"--model": "model", "--engine-url": "engine.url", "--tasks": "tasks",
         "--max-turns": "rollout.env.max_turns", "--max-new-tokens": "rollout.max_new_tokens",
         "--max-total-tokens": "rollout.env.max_total_tokens", "--temperature": "rollout.temperature",
         "--seed": "seed", "--max-concurrency": "rollout.max_concurrency",
         "--request-timeout": "rollout.request_timeout", "--device": "engine.device", "--dtype": "dtype",
         "--tasks-module": "tasks_module"}


def add_common_arguments(p, cls, flags: dict[str, str]) -> None:
    add_config_arguments(p, cls, {**FLAGS, **flags}, repeatable=("--engine-url", "--tasks-module"))
    p.add_argument("--results-jsonl", default=None,
                   help="append a summary line (date, commit, machine, figures) to this file")


def add_arguments(p) -> None:
    add_common_arguments(p, RolloutCommandConfig, {"--group-size": "rollout.group_size"})
    p.add_argument("--out", default=None, help="write trajectories here (JSONL, one per line)")


def model_folder(name: str) -> str:
    """The local folder of model `name`, or a ConfigError saying why there is none (one line)."""
    try:
        return str(resolve_model(name))
    except ModelError as e:
        raise ConfigError(str(e)) from None


def collect(cfg: RolloutCommandConfig, tasks, desc: str = "rollout"):
    """Run the rollouts on cfg.engine.url, or on an engine started for them (stopped after), with a
    progress bar (episodes done, ETA) on stderr; returns (trajectories, seconds, setup failures).
    The sandbox is checked before the model is touched: where it cannot run, nothing would."""
    check_sandbox(cfg.sandbox)
    model_path = model_folder(cfg.model)
    tok = AutoTokenizer.from_pretrained(model_path)
    layout = plan_layout(cfg.dtype, cfg.engine, trainer_device=None)
    if not cfg.engine.urls:
        print(f"starting an engine for {cfg.model} on {layout.engine_device} ...", flush=True)
    with EnginePool(cfg.engine, layout, model_path, ready_timeout=900) as urls:
        t0 = time.monotonic()
        stats = {}
        episodes = len(tasks) * cfg.rollout.group_size
        with tqdm(total=episodes, desc=desc, unit="ep", leave=False, dynamic_ncols=True) as bar:
            trajs = asyncio.run(rollout_groups(urls, tok, tasks, cfg.rollout, seed=cfg.seed, stats=stats,
                                               sandbox_factory=sandbox_factory(cfg.sandbox),
                                               on_episode_done=lambda: bar.update(1)))
        return trajs, time.monotonic() - t0, stats["setup_failures"]


def selected_tasks(command: str, which: str, modules=(), select=select_tasks) -> list:
    """The tasks `which` (the tasks key) selects after loading the user's task `modules` (one line
    per bad task; the rest loads), or a ConfigError naming the module that cannot be loaded or the
    unknown task (one line)."""
    report_load_errors(modules, f"nano-miles {command}")
    try:
        return select(which)
    except KeyError as e:
        raise ConfigError(e.args[0]) from None


def solved(t) -> bool:
    return t.reward_components.get("correct", 0.0) > 0


def summarize(trajs, setup_failures: int = 0) -> dict:
    n = len(trajs)
    finish = {}
    for t in trajs:
        finish[t.finish_reason] = finish.get(t.finish_reason, 0) + 1
    model_tokens = sum(sum(t.response_mask) for t in trajs)
    return {
        "episodes": n,
        "pass_rate": sum(solved(t) for t in trajs) / n if n else 0.0,
        "mean_reward": sum(t.reward for t in trajs) / n if n else 0.0,
        "mean_turns": sum(t.num_turns for t in trajs) / n if n else 0.0,
        "infra_failures": setup_failures + sum(int(t.reward_components.get("infra_failures", 0)) for t in trajs),
        "finish_reasons": finish,
        "model_tokens": model_tokens,
    }


def provenance() -> dict:
    # BENCH_COMMIT first, as in bench/results.py: a device machine's copy of .git can be stale.
    try:
        commit = os.environ.get("BENCH_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = ""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit or "unknown", "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpu"}


def append_result(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({**provenance(), **record}) + "\n")


def run(args) -> int:
    cfg = config_from_args(RolloutCommandConfig, args)
    if args.print_config:
        print(to_toml(cfg), end="")
        return 0
    tasks = selected_tasks("rollout", cfg.tasks, cfg.tasks_module)
    trajs, secs, setup_failures = collect(cfg, tasks)
    if args.out:
        with open(args.out, "w") as f:
            for t in trajs:
                f.write(t.to_json() + "\n")
    s = summarize(trajs, setup_failures)
    print(f"{len(tasks)} tasks x {cfg.rollout.group_size} samples = {s['episodes']} episodes in {secs:.1f}s "
          f"({s['model_tokens'] / max(secs, 1e-9):.0f} model tok/s)")
    print(f"pass rate {s['pass_rate']:.3f}   mean reward {s['mean_reward']:+.3f}   mean turns {s['mean_turns']:.2f}   "
          f"infra failures {s['infra_failures']}   finish {s['finish_reasons']}")
    if args.out:
        print(f"trajectories -> {args.out}")
    if args.results_jsonl:
        append_result(args.results_jsonl, {"kind": "rollout", "model": cfg.model, "tasks": cfg.tasks,
                                           "group_size": cfg.rollout.group_size,
                                           "max_turns": cfg.rollout.env.max_turns, "seconds": round(secs, 1), **s})
    return 0
