"""Which tasks there are and which to run: the built-in catalog, ALFA, and the user's own tasks.

A task is a setup that prepares an episode's sandbox, an instruction, and a verifier (the public API,
in api.py, is re-exported here for users' modules). A selection is a comma-separated list of: a
split (train, heldout, benchmark), seed (the four original tasks), all (every task but the benchmark
ones), a family ("text"; "alfa" covers "alfa/fs1" to "alfa/fs5") or a task id. ALFA (InterCode-ALFA,
from the icalfa package) is registered the first time a selection names it.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys

from nano_miles.config import ConfigError
from nano_miles.tasks import alfa, catalog, toml_file  # noqa: F401  (catalog registers the built-in tasks)
from nano_miles.tasks.api import (KINDS, SPLITS, TASKS, Attempt, SetupError, Task, TaskInstance,  # noqa: F401
                                  TaskUnavailable, Workspace, loading, normalize, q, register, task, verify)

_LOADED: dict[str, list[str]] = {}  # user modules and task files loaded -> their report (loaded once)
RENAMED = {"nano_miles.task_catalog_skills": "nano_miles.tasks.catalog_skills"}


def load_task_modules(specs) -> list[str]:
    """Load the user's tasks from Python files, importable modules or TOML task files. A spec that
    cannot be loaded at all raises ConfigError naming it; a bad task is one line of the returned report
    ("my_tasks.py: task 'x': duplicate id ...") and the file's other tasks load all the same."""
    return [line for spec in specs for line in _load_one(spec.strip())]


def _load_one(spec: str) -> list[str]:
    if spec in RENAMED:
        raise ConfigError(f"{spec} is now {RENAMED[spec]}")
    is_file = spec.endswith((".py", ".toml")) or os.sep in spec
    key = os.path.realpath(spec) if is_file else spec
    if key in _LOADED:
        return _LOADED[key]
    if is_file and not os.path.isfile(spec):
        raise ConfigError(f"{spec}: no such file")
    errors: list[str] = []
    before = set(TASKS)
    with loading(spec, errors):
        try:
            if spec.endswith(".toml"):
                toml_file.load_task_file(spec)
            elif is_file:
                _import_file(spec)
            else:
                importlib.import_module(spec)
        except (Exception, SystemExit) as e:  # a module that fails to import (or exits) registers nothing at all
            for added in set(TASKS) - before:
                del TASKS[added]
            raise ConfigError(f"{spec}: cannot load: {one_line(e)}") from None
    _LOADED[key] = [f"{spec}: {line}" for line in errors]
    return _LOADED[key]


def _import_file(path: str) -> None:
    digest = hashlib.sha1(os.path.realpath(path).encode()).hexdigest()[:8]
    name = f"_nano_miles_user_tasks_{os.path.basename(path)[:-3]}_{digest}"  # two my_tasks.py never collide
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look a task's module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise


def one_line(e: BaseException) -> str:
    if isinstance(e, SyntaxError):
        return f"SyntaxError: {e.msg} (line {e.lineno})"
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def report_load_errors(specs, prog: str = "nano-miles") -> None:
    """load_task_modules, printing its report on stderr."""
    for line in load_task_modules(specs):
        print(f"{prog}: {line}", file=sys.stderr)


# ---- selection ----------------------------------------------------------------------------------

def get_task(task_id: str) -> Task:
    _register_alfa_if_named([task_id])
    if task_id not in TASKS:
        raise KeyError(f"unknown task {task_id!r}; known: {', '.join(sorted(TASKS)[:60])}"
                       + (f" ... ({len(TASKS)} in all: nano-miles tasks list)" if len(TASKS) > 60 else ""))
    return TASKS[task_id]


def select_tasks(which: str) -> list[Task]:
    """The tasks a selection names (see the module docstring), in registry order, each once."""
    items = [i.strip() for i in which.split(",") if i.strip()]
    _register_alfa_if_named(items)
    chosen: dict[str, Task] = {}
    for item in items:
        tasks = list(TASKS.values())
        if item == "seed":
            found = [t for t in tasks if t.seed_task]
        elif item in SPLITS:
            found = [t for t in tasks if t.split == item]
        elif item == "all":
            found = [t for t in tasks if t.split != "benchmark"]
        elif item in TASKS:
            found = [TASKS[item]]
        else:
            if not (found := [t for t in tasks if t.family == item or t.family.startswith(item + "/")]):
                get_task(item)  # raises: unknown task
        chosen.update((t.id, t) for t in found)
    return list(chosen.values())


def training_tasks(which: str) -> list[Task]:
    """select_tasks for training: benchmark tasks (ALFA) are evaluated, never trained on."""
    tasks = select_tasks(which)
    if bench := [t.id for t in tasks if t.split == "benchmark"]:
        raise KeyError(f"{len(bench)} benchmark task(s) selected for training ({', '.join(bench[:3])}"
                       f"{' ...' if len(bench) > 3 else ''}): benchmark tasks are evaluated, never trained on")
    return tasks


def _register_alfa_if_named(items: list[str]) -> None:
    """ALFA registers itself the first time a selection names it (the icalfa package must be installed)."""
    if any(i == "alfa" or i.startswith(("alfa/", "alfa_")) for i in items):
        alfa.register_alfa()
