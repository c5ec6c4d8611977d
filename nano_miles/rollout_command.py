"""`nano-miles rollout`: run multi-turn rollouts on a task split and write the trajectories as JSONL.

    nano-miles rollout --model qwen2.5-coder-0.5b-instruct --tasks seed --group-size 8 --out r.jsonl
    nano-miles rollout --model M --engine-url http://h1:30000 --engine-url http://h2:30000 ...

Without --engine-url an engine is started for the run and stopped after it. The flags are shorthands
of config keys (`--group-size 8` is `--set rollout.group_size=8`).
"""
from __future__ import annotations

from nano_miles.job import RolloutCommandConfig, add_job_arguments, append_result, run_rollouts

CONFIG = RolloutCommandConfig


def add_arguments(p) -> None:
    add_job_arguments(p, RolloutCommandConfig, {"--group-size": "rollout.group_size",
                                                "--max-turns": "rollout.env.max_turns"})
    p.add_argument("--out", default=None, help="write trajectories here (JSONL, one per line)")


def run(args) -> int:
    if (done := run_rollouts(RolloutCommandConfig, args, "rollout")) is None:
        return 0
    cfg, tasks, trajs, secs, s = done
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
