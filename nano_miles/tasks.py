"""Shell tasks: a setup that prepares an episode's workspace, an instruction, and a verifier.

Ground truth is never hard-coded: each task's setup runs real commands in the episode's sandbox
(sha256sum, wc, tar, python3 ...) and keeps their output as the expected answer. Every parameter
(strings, numbers, file contents) comes from a per-episode seed, so answers cannot be memorised.

A task also carries a scripted solution (real commands; the last one prints the answer), used by
the tests to prove every task is solvable through the environment and the real sandbox.

    nano-miles tasks list [--split train|heldout|seed] [--json]
"""
from __future__ import annotations

import json

from nano_miles import task_catalog  # noqa: F401  (registers the built-in tasks)
from nano_miles.task_api import (SPLITS, TASKS, SetupError, Task, TaskInstance, Workspace,  # noqa: F401  (the API,
                                 normalize, q, task, verify)                                  # re-exported)


def all_tasks() -> list[Task]:
    return list(TASKS.values())


def get_task(task_id: str) -> Task:
    tasks = {t.id: t for t in all_tasks()}
    if task_id not in tasks:
        raise KeyError(f"unknown task {task_id!r}; known: {', '.join(sorted(tasks))}")
    return tasks[task_id]


def select_tasks(which: str) -> list[Task]:
    """'seed' (the four original tasks), 'train', 'heldout', 'all', or comma-separated task ids."""
    tasks = all_tasks()
    if which == "seed":
        return [t for t in tasks if t.seed_task]
    if which in SPLITS:
        return [t for t in tasks if t.split == which]
    if which == "all":
        return tasks
    return [get_task(i.strip()) for i in which.split(",") if i.strip()]


# ---- CLI ------------------------------------------------------------------------------------------

def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="tasks_command", metavar="ACTION")
    p = sub.add_parser("list", help="list tasks with their split and family")
    p.add_argument("--split", default="all", help="seed | train | heldout | all (default)")
    p.add_argument("--json", action="store_true", help="one JSON object per line")


def run(args) -> int:
    if getattr(args, "tasks_command", None) != "list":
        print("usage: nano-miles tasks list [--split S] [--json]")
        return 2
    tasks = select_tasks(args.split)
    if args.json:
        for t in tasks:
            print(json.dumps({"id": t.id, "split": t.split, "family": t.family,
                              "seed_task": t.seed_task, "summary": t.summary}))
        return 0
    print(f"{'id':<24} {'split':<8} {'family':<12} summary")
    for t in tasks:
        print(f"{t.id:<24} {t.split:<8} {t.family:<12} {t.summary}")
    counts = {s: sum(t.split == s for t in tasks) for s in SPLITS}
    print(f"{len(tasks)} tasks: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return 0
