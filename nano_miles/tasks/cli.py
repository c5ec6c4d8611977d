"""`nano-miles tasks list|check`: the tasks there are, and whether each is solvable here."""
from __future__ import annotations

import json
import os
import sys

from nano_miles.tasks import SPLITS, report_load_errors, select_tasks
from nano_miles.tasks.check import check_tasks


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="tasks_command", metavar="ACTION")
    listing = sub.add_parser("list", help="list tasks with their split and family")
    listing.add_argument("--split", default="all", help="a selection: seed | train | heldout | benchmark | all "
                         "(default) | a family (alfa) | task ids, comma-separated")
    check = sub.add_parser("check", help="run each task's scripted solution in a real sandbox: is it solvable here?")
    check.add_argument("--tasks", default="all", help="a selection, as for list")
    check.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="episodes at once")
    for p in (listing, check):
        p.add_argument("--json", action="store_true", help="one JSON object per line")
        p.add_argument("--tasks-module", action="append", default=[], metavar="PATH.py|package.module|FILE.toml",
                       help="load your own tasks from this module or TOML task file (repeatable); see docs/tasks.md")


def run(args) -> int:
    if getattr(args, "tasks_command", None) not in ("list", "check"):
        print("usage: nano-miles tasks list|check [--tasks-module M] ...")
        return 2
    report_load_errors(args.tasks_module, "nano-miles tasks")
    flag, which = ("--split", args.split) if args.tasks_command == "list" else ("--tasks", args.tasks)
    try:
        tasks = select_tasks(which)
    except KeyError as e:  # say what the item is not, not just "unknown task": --split names splits too
        print(f"nano-miles tasks: {flag} {which!r}: not a split ({', '.join(SPLITS)}), seed, all, a family or a "
              f"task id ({e.args[0]})", file=sys.stderr)
        return 2
    if args.tasks_command == "check":
        return check_tasks(tasks, jobs=args.jobs, as_json=args.json)
    if args.json:
        for t in tasks:
            print(json.dumps({"id": t.id, "split": t.split, "family": t.family, "seed_task": t.seed_task,
                              "summary": t.summary, "mounts": list(t.mounts), "source": t.source}))
        return 0
    print(f"{'id':<24} {'split':<9} {'family':<12} summary")
    for t in tasks:
        print(f"{t.id:<24} {t.split:<9} {t.family:<12} {t.summary}")
    counts = {s: sum(t.split == s for t in tasks) for s in SPLITS if any(t.split == s for t in tasks)}
    print(f"{len(tasks)} tasks: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    return 0
