"""`nano-miles eval`: pass@1 and pass@K of a model on a task split, per task family.

    nano-miles eval --model qwen2.5-coder-0.5b-instruct --tasks heldout --samples 8

K samples per task (one group each, same files and ground truth); a sample passes when the verifier
accepts its answer. pass@k uses the unbiased estimator 1 - C(n-c, k) / C(n, k) per task (n samples,
c correct), averaged over the tasks of a family. The keys are rollout's (docs/config.md); K is
`rollout.group_size` (`--samples`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from nano_miles.alfa import three_part_summary
from nano_miles.config import config_from_args, to_toml
from nano_miles.rollout_cli import (RolloutCommandConfig, add_common_arguments, append_result, collect, solved,
                                    selected_tasks, summarize)


@dataclass
class EvalConfig(RolloutCommandConfig):
    tasks: str = "heldout"            # seed | train | heldout | all | a family (alfa: per set-up) | comma-separated task ids


CONFIG = EvalConfig


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def per_family(trajs, tasks, k: int) -> dict[str, dict]:
    """{family: {tasks, pass@1, pass@k}} plus "all"."""
    family = {t.id: t.family for t in tasks}
    by_task: dict[str, list[bool]] = {}
    for t in trajs:
        by_task.setdefault(t.task_id, []).append(solved(t))
    rows: dict[str, list[tuple[float, float]]] = {}
    for task_id, results in by_task.items():
        n, c = len(results), sum(results)
        scores = (pass_at_k(n, c, 1), pass_at_k(n, c, min(k, n)))
        rows.setdefault(family[task_id], []).append(scores)
        rows.setdefault("all", []).append(scores)
    return {fam: {"tasks": len(v), "pass@1": sum(a for a, _ in v) / len(v), f"pass@{k}": sum(b for _, b in v) / len(v)}
            for fam, v in sorted(rows.items(), key=lambda kv: (kv[0] == "all", kv[0]))}


def add_arguments(p) -> None:
    add_common_arguments(p, EvalConfig, {"--samples": "rollout.group_size"})
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.add_argument("--out", default=None, help="also write the trajectories here (JSONL)")


def run(args) -> int:
    cfg = config_from_args(EvalConfig, args)
    if args.print_config:
        print(to_toml(cfg), end="")
        return 0
    tasks = selected_tasks("eval", cfg.tasks, cfg.tasks_module)
    trajs, secs, setup_failures = collect(cfg, tasks, desc="eval")
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(t.to_json() + "\n" for t in trajs)
    k = cfg.rollout.group_size
    table = per_family(trajs, tasks, k)
    s = summarize(trajs, setup_failures)
    alfa = three_part_summary(trajs)  # ALFA episodes: the benchmark's own score too
    if alfa:
        s["alfa_three_part"] = alfa
    if args.json:
        print(json.dumps({"per_family": table, **s}))
    else:
        print(f"{cfg.model} on {cfg.tasks}: {len(tasks)} tasks x {k} samples in {secs:.1f}s")
        print(f"{'family':<12} {'tasks':>5} {'pass@1':>8} {f'pass@{k}':>8}")
        for fam, row in table.items():
            print(f"{fam:<12} {row['tasks']:>5} {row['pass@1']:>8.3f} {row[f'pass@{k}']:>8.3f}")
        print(f"mean reward {s['mean_reward']:+.3f}   mean turns {s['mean_turns']:.2f}   "
              f"infra failures {s['infra_failures']}   finish {s['finish_reasons']}")
        if alfa:
            print(f"ALFA three-part score (exact output for the judge) {alfa['score']:.3f}   output matched "
                  f"{alfa['output']:.3f}   files matched {alfa['files']:.3f}   over {alfa['episodes']} episodes "
                  f"({alfa['answered']} answered)")
    if args.results_jsonl:
        append_result(args.results_jsonl, {"kind": "eval", "model": cfg.model, "tasks": cfg.tasks, "samples": k,
                                           "max_turns": cfg.rollout.env.max_turns, "seconds": round(secs, 1),
                                           "per_family": table, **s})
    return 0
