"""`nano-miles eval`: pass@1 and pass@K of a model on a task split, per task family.

    nano-miles eval --model qwen2.5-coder-0.5b-instruct --tasks heldout --samples 8

A task runs on `instances` instances (seeded draws of its files and ground truth, one group each),
K samples on each; a sample passes when the verifier accepts its answer. A task's pass@1 is the mean
over all its samples; its pass@k the unbiased estimator 1 - C(n-c, k) / C(n, k) on each instance
(n samples, c correct), averaged over its instances. Both are averaged over the tasks of a family.
The keys are rollout's and `instances` (docs/config.md); K is `rollout.group_size` (`--samples`).
Inside a training run (`eval_every`) RunEvaluation measures the policy the same way.
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from nano_miles.config import ConfigError
from nano_miles.engine.client import EngineUnavailable
from nano_miles.job import (RolloutCommandConfig, add_job_arguments, append_result, roll_out, run_rollouts,
                            selected_tasks)
from nano_miles.rollout.batch import scored, solved_by_task
from nano_miles.tasks import alfa, select_tasks
from nano_miles.tasks.alfa import three_part_summary


@dataclass
class EvalConfig(RolloutCommandConfig):
    tasks: str = "heldout"            # seed | train | heldout | all | a family (alfa: per set-up) | comma-separated task ids
    instances: int = 1                # task instances per task (seeded draws of its files and ground truth), each with --samples samples: pass@1 averages over them all

    def __post_init__(self):
        super().__post_init__()
        if self.instances < 1:
            raise ValueError(f"instances must be >= 1, got {self.instances}")


CONFIG = EvalConfig


def pass_at_k(n: int, c: int, k: int) -> float:
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 if n - c < k else 1.0 - math.comb(n - c, k) / math.comb(n, k)


def lost(trajs) -> str:
    """One line on the episodes an infrastructure failure took out of the scores ('' when none did)."""
    if not (failed := [t for t in trajs if t.broken]):
        return ""
    why = list(dict.fromkeys(str(t.reward_components.get("error", "?"))[:160] for t in failed))
    return (f"{len(failed)} of {len(trajs)} episodes broke on the sandbox or the engine and are left out of "
            f"every score: {'; '.join(why[:2])}{' ...' if len(why) > 2 else ''}")


def per_family(trajs, tasks, k: int) -> dict[str, dict]:
    """{family: {tasks, pass@1, pass@k}} plus "all". A task's scores are means over its instances
    (group_id): each weighs the same, also when a setup failure left it fewer samples."""
    family = {t.id: t.family for t in tasks}
    instances: dict[str, dict[str, list[bool]]] = {}
    for t in scored(trajs):
        instances.setdefault(t.task_id, {}).setdefault(t.group_id, []).append(t.solved)
    rows: dict[str, list[tuple[float, float]]] = {}
    for task_id, groups in instances.items():
        at = [(pass_at_k(len(g), sum(g), 1), pass_at_k(len(g), sum(g), min(k, len(g)))) for g in groups.values()]
        scores = (sum(a for a, _ in at) / len(at), sum(b for _, b in at) / len(at))
        rows.setdefault(family[task_id], []).append(scores)
        rows.setdefault("all", []).append(scores)
    return {fam: {"tasks": len(v), "pass@1": sum(a for a, _ in v) / len(v), f"pass@{k}": sum(b for _, b in v) / len(v)}
            for fam, v in sorted(rows.items(), key=lambda kv: (kv[0] == "all", kv[0]))}


def alfa_subset(n: int, echo=print) -> list:
    """`n` ALFA tasks, the same ones in every run; [] (with one line why) without the icalfa package."""
    if n <= 0:
        return []
    try:
        alfa.package_dir()
    except KeyError as e:
        echo(f"eval: the ALFA part is left out: {e.args[0]}")
        return []
    tasks = select_tasks("alfa")
    chosen = set(random.Random(0).sample([t.id for t in tasks], min(n, len(tasks))))
    return [t for t in tasks if t.id in chosen]


class RunEvaluation:
    """Evaluation inside a training run (step 0, every `eval_every` steps, the last): pass@1 of the
    policy the engines serve on `eval_tasks` and the ALFA subset. Its instances are seeded by the run
    seed alone, so the curve moves with the policy only, and it never touches the training task stream.
    keep_best: new_best() picks on eval_tasks only (choosing on ALFA would be choosing on the benchmark)."""

    def __init__(self, cfg, echo=print):
        self.every, self.last_step, self.seed, self.echo = cfg.eval_every, cfg.steps, cfg.seed, echo
        self.keep_best, self.best, self.instances = cfg.keep_best, None, cfg.eval_instances
        self.rollout = dataclasses.replace(cfg.rollout, group_size=cfg.eval_samples, dynamic_sampling=False)
        try:
            self.tasks = selected_tasks("train", cfg.eval_tasks) if self.every else []
        except ConfigError as e:
            raise ConfigError(f"eval_tasks: {e}") from None
        self.alfa = alfa_subset(cfg.eval_alfa_tasks, echo) if self.every else []

    def due(self, step: int) -> bool:
        return self.every > 0 and (step % self.every == 0 or step == self.last_step)

    def after_step(self, step: int, engines, tokenizer, sandbox_factory=None) -> dict:
        """The eval_* metrics of `step` ({} when no evaluation is due)."""
        if not self.due(step):
            return {}
        when = "of the base policy (step 0)" if step == 0 else f"after step {step}"
        stats, t0 = {}, time.perf_counter()
        try:
            trajs = self.episodes(engines, tokenizer, sandbox_factory, f"eval {when}", stats)
        except EngineUnavailable as e:  # the next step's rollout restarts the engine; this measurement is lost
            self.echo(f"eval {when} left out: engine unavailable ({e})")
            return {"eval_seconds": time.perf_counter() - t0, "eval_error": str(e)}
        seconds, alfa_ids = time.perf_counter() - t0, {t.id for t in self.alfa}
        heldout = per_family([t for t in trajs if t.task_id not in alfa_ids], self.tasks, 1).get("all", {})
        out = {"eval_seconds": seconds, "eval_pass_at_1": heldout.get("pass@1"),
               "eval_task_count": heldout.get("tasks", 0), "eval_infra_failures": len(trajs) - len(scored(trajs)),
               # which tasks moved between evaluations (metrics.jsonl only: not a scalar)
               "eval_by_task": {task_id: sum(r) / len(r) for task_id, r in sorted(solved_by_task(trajs).items())}}
        line = (f"eval {when}: {self.instances} instance(s) x {self.rollout.group_size} sample(s) a task, "
                f"{out['eval_task_count']} tasks pass@1 {_show(out['eval_pass_at_1'])}")
        if self.alfa:
            theirs = [t for t in trajs if t.task_id in alfa_ids]
            alfa_all = per_family(theirs, self.alfa, 1).get("all", {})
            unavailable = sum(task_id in alfa_ids for task_id in stats.get("unavailable", {}))
            out.update({"eval_alfa_pass_at_1": alfa_all.get("pass@1"), "eval_alfa_task_count": alfa_all.get("tasks", 0),
                        "eval_alfa_unavailable": unavailable,
                        "eval_alfa_score": (three_part_summary(theirs) or {}).get("score")})
            line += (f", ALFA {out['eval_alfa_task_count']} tasks pass@1 {_show(out['eval_alfa_pass_at_1'])} "
                     f"({unavailable} of {len(self.alfa)} cannot run here, left out)")
        self.echo(f"{line}, in {seconds:.1f}s")
        if why := lost(trajs):
            self.echo(f"eval {when}: {why}")
        return out

    def episodes(self, engines, tokenizer, sandbox_factory=None, desc: str = "eval", stats: dict | None = None) -> list:
        # the ALFA subset's set-ups are fixed: one instance each
        tasks = [t for t in self.tasks for _ in range(self.instances)] + self.alfa
        return roll_out(engines, tokenizer, tasks, self.rollout, self.seed, desc, sandbox_factory=sandbox_factory,
                        stats=stats)

    def new_best(self, step: int, evaluated: dict, best_dir: Path) -> bool:
        """keep_best: does the policy after `step` beat every earlier one (a resumed run's: best.json)?"""
        score = evaluated.get("eval_pass_at_1")
        if not self.keep_best or step == 0 or score is None:
            return False
        if self.best is None:
            try:
                self.best = json.loads((best_dir / "best.json").read_text())
            except (OSError, ValueError):
                self.best = {}
        if self.best and score <= self.best["eval_pass_at_1"]:
            return False
        self.best = {"step": step, "eval_pass_at_1": score}
        self.echo(f"keep_best: the policy after step {step} is the best so far on the eval tasks ({score:.3f}), "
                  f"exported to {best_dir}")
        return True


def _show(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def add_arguments(p) -> None:
    add_job_arguments(p, EvalConfig, {"--samples": "rollout.group_size"})
    p.add_argument("--json", action="store_true", help="print the table as JSON")
    p.add_argument("--out", default=None, help="also write the trajectories here (JSONL)")


def run(args) -> int:
    if (done := run_rollouts(EvalConfig, args, "eval")) is None:
        return 0
    cfg, tasks, trajs, secs, s = done
    k = cfg.rollout.group_size
    table = per_family(trajs, tasks, k)
    # what the figures were measured on: which instances (seed) and at which temperature
    measured = {"instances": cfg.instances, "seed": cfg.seed, "temperature": cfg.rollout.temperature}
    if alfa_score := three_part_summary(trajs):  # ALFA episodes: the benchmark's own score too
        s["alfa_three_part"] = alfa_score
    if why := lost(trajs):
        print(f"nano-miles eval: {why}", file=sys.stderr)
    if args.json:
        print(json.dumps({"per_family": table, **measured, **s}))
    else:
        print(f"{cfg.model} on {cfg.tasks}: {len(tasks)} tasks x {cfg.instances} instances x {k} samples in "
              f"{secs:.1f}s (seed {cfg.seed}, temperature {cfg.rollout.temperature})")
        print(f"{'family':<12} {'tasks':>5} {'pass@1':>8} {f'pass@{k}':>8}")
        for fam, row in table.items():
            print(f"{fam:<12} {row['tasks']:>5} {row['pass@1']:>8.3f} {row[f'pass@{k}']:>8.3f}")
        print(f"mean reward {s['mean_reward']:+.3f}   mean turns {s['mean_turns']:.2f}   "
              f"infra failures {s['infra_failures']}   finish {s['finish_reasons']}")
        if alfa_score:
            print(f"ALFA three-part score (exact output for the judge) {alfa_score['score']:.3f}   output matched "
                  f"{alfa_score['output']:.3f}   files matched {alfa_score['files']:.3f}   over "
                  f"{alfa_score['episodes']} episodes ({alfa_score['answered']} answered)")
    if args.results_jsonl:
        append_result(args.results_jsonl, {"kind": "eval", "model": cfg.model, "tasks": cfg.tasks, "samples": k,
                                           **measured, "max_turns": cfg.rollout.env.max_turns,
                                           "seconds": round(secs, 1), "per_family": table, **s})
    return 0
