"""`nano-miles tasks check`: is each task solvable here? Its scripted solution, played as a policy would.

Each solution command goes through OpenShellEnv as a <bash> turn in a real sandbox, and the answer is
read back from the last observation, so a task that passes here is solvable through the environment.
A task that cannot run on this machine (TaskUnavailable: a tool missing, no mount namespace) is listed
with its reason and is neither a pass nor a failure.
"""
from __future__ import annotations

import concurrent.futures
import json
import time

from nano_miles.rollout.env import EnvConfig, OpenShellEnv, answer_from
from nano_miles.tasks.api import SetupError, Task, TaskUnavailable


def play_solution(task: Task, seed: int = 7, sandbox_factory=None) -> dict:
    """One episode with the task's scripted solution: {id, family, status, reason, setup_s, solve_s}."""
    row = {"id": task.id, "family": task.family, "status": "solved", "reason": "", "setup_s": 0.0, "solve_s": 0.0}
    env = OpenShellEnv(task, seed, EnvConfig(max_turns=50), sandbox_factory)
    t0 = time.monotonic()
    try:
        try:
            env.reset()
        except SetupError as e:  # TaskUnavailable is a SetupError: cannot run here, not a failure
            return {**row, "status": "unavailable" if isinstance(e, TaskUnavailable) else "failed", "reason": str(e)}
        t1 = time.monotonic()
        for cmd in env.instance.solution:
            if env.step(f"<bash>{cmd}</bash>").done:
                return {**row, "status": "failed", "reason": f"episode ended at {cmd!r}: {env.finish_reason}"}
        answer = env.instance.solution_answer
        env.step(f"<answer>{answer_from(env.last_observation) if answer is None else answer}</answer>")
        row.update(setup_s=round(t1 - t0, 3), solve_s=round(time.monotonic() - t1, 3))
        if env.components["infra_failures"]:
            return {**row, "status": "failed", "reason": f"sandbox failure: {env.infra_error}"}
        if env.components["correct"] <= 0:
            return {**row, "status": "failed", "reason": "the scripted solution was judged wrong"}
        return row
    finally:
        env.close()


def check_tasks(tasks: list[Task], jobs: int = 1, as_json: bool = False) -> int:
    """Play every task's solution (jobs at a time); print one line per task and a summary.
    Exit status 1 when a task that can run here is not solved by its own solution."""
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        rows = list(pool.map(play_solution, tasks))
    for r in rows:
        print(json.dumps(r) if as_json else f"{r['status'].upper() if r['status'] != 'solved' else 'solved':<12} "
              f"{r['id']:<24} " + (r["reason"] or f"setup {r['setup_s']:.2f}s, solution+verify {r['solve_s']:.2f}s"))
    solved = [r for r in rows if r["status"] == "solved"]
    n_failed = sum(r["status"] == "failed" for r in rows)
    if not as_json:
        mean = {k: sum(r[k] for r in solved) / max(1, len(solved)) for k in ("setup_s", "solve_s")}
        print(f"{len(rows)} tasks: {len(solved)} solved by their scripted solution, "
              f"{sum(r['status'] == 'unavailable' for r in rows)} cannot run here (left out), {n_failed} FAILED; "
              f"mean setup {mean['setup_s']:.2f}s, solution+verify {mean['solve_s']:.2f}s per episode")
    return 1 if n_failed else 0
