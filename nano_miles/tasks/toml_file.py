"""Declarative tasks: a TOML file of [[task]] tables, for users who write no Python.

Each table has an id, family, split, instruction and answer command, and optionally a summary,
setup commands, kind, check, solution, mounts, workdir and [task.params] (int = [lo, hi],
choice = [...] or token = N, drawn from the episode's seed in order). `{name}` is replaced by the
parameter's value wherever a declared parameter is named; other braces (awk '{print $1}', ${HOME})
are left alone. The ground truth is always the answer command's output, never typed in.
The format, with a complete example (examples/tasks.toml), is in docs/tasks.md.
"""
from __future__ import annotations

import functools
import random
import re
import tomllib

from nano_miles.tasks.api import KINDS, SetupError, Task, TaskInstance, Workspace, register, report_problem
from nano_miles.tasks.catalog.common import token

REQUIRED = ("id", "family", "split", "instruction", "answer")
OPTIONAL = ("summary", "params", "setup", "kind", "check", "solution", "mounts", "workdir")
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def load_task_file(path: str) -> None:
    """Register every valid task of the file; each invalid one is reported (api.report_problem)
    and left out. A file that is not TOML, or has no [[task]] tables, raises ValueError."""
    with open(path, "rb") as f:
        try:
            doc = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"not valid TOML: {e}") from None
    extra = sorted(set(doc) - {"task"})
    if extra or not isinstance(doc.get("task"), list) or not doc["task"]:
        raise ValueError("a task file holds [[task]] tables and nothing else"
                         + (f" (unknown top-level keys: {', '.join(extra)})" if extra else ""))
    for i, table in enumerate(doc["task"]):
        name = table.get("id") if isinstance(table, dict) and isinstance(table.get("id"), str) else f"#{i + 1}"
        try:
            t = parse_task(table, path)
        except ValueError as e:
            report_problem(name, str(e))
            continue
        register(t)


def parse_task(table: dict, path: str) -> Task:
    """A Task from one [[task]] table; ValueError naming the first problem."""
    if not isinstance(table, dict):
        raise ValueError("each task must be a [[task]] table")
    if "expected" in table:
        raise ValueError("the expected answer is computed by the `answer` command, never typed in")
    if unknown := sorted(set(table) - set(REQUIRED) - set(OPTIONAL)):
        raise ValueError(f"unknown key(s) {', '.join(unknown)} (known: {', '.join(REQUIRED + OPTIONAL)})")
    if missing := [k for k in REQUIRED if k not in table]:
        raise ValueError(f"missing key(s): {', '.join(missing)}")
    for key in ("id", "family", "split", "instruction", "answer", "summary", "kind", "check", "workdir"):
        if key in table and not (isinstance(table[key], str) and table[key].strip()):
            raise ValueError(f"{key} must be a non-empty string")
    for key in ("setup", "solution", "mounts"):
        if key in table and not (isinstance(table[key], list) and all(isinstance(c, str) and c.strip()
                                                                       for c in table[key])):
            raise ValueError(f"{key} must be a list of non-empty strings")
    kind = table.get("kind", "text")
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, not {kind!r}")
    params = table.get("params", {})
    if not isinstance(params, dict):
        raise ValueError("params must be a table")
    for pname, spec in params.items():
        check_param(pname, spec)
    if undeclared := sorted(set(PLACEHOLDER.findall(table["instruction"])) - set(params)):
        raise ValueError(f"the instruction names undeclared parameter(s): {', '.join(undeclared)}")
    if "check" in table and "solution" not in table:
        raise ValueError("a task with a check needs a solution (the commands that make the check pass)")
    return Task(id=table["id"], family=table["family"], split=table["split"],
                summary=table.get("summary", table["instruction"][:60]),
                setup=functools.partial(file_setup, table, params), mounts=tuple(table.get("mounts", ())),
                workdir=table.get("workdir"), source=path)


def check_param(name: str, spec) -> None:
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ValueError(f"param {name}: give exactly one of int = [lo, hi], choice = [...], token = N")
    (how, arg), = spec.items()
    if how == "int":
        if not (isinstance(arg, list) and len(arg) == 2 and all(type(a) is int for a in arg) and arg[0] <= arg[1]):
            raise ValueError(f"param {name}: int wants [lo, hi], two integers with lo <= hi")
    elif how == "choice":
        if not (isinstance(arg, list) and arg and all(isinstance(a, (str, int)) for a in arg)):
            raise ValueError(f"param {name}: choice wants a non-empty list of strings or integers")
    elif how == "token":
        if not (type(arg) is int and 1 <= arg <= 64):
            raise ValueError(f"param {name}: token wants a length from 1 to 64")
    else:
        raise ValueError(f"param {name}: unknown kind {how!r} (int, choice or token)")


def draw(params: dict, rng: random.Random) -> dict[str, str]:
    values = {}
    for name, spec in params.items():
        (how, arg), = spec.items()
        if how == "int":
            values[name] = str(rng.randint(arg[0], arg[1]))
        elif how == "choice":
            values[name] = str(rng.choice(arg))
        else:
            values[name] = token(rng, arg)
    return values


def fill(text: str, values: dict[str, str]) -> str:
    return PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)), text)


def file_setup(t: dict, params: dict, ws: Workspace, rng: random.Random) -> TaskInstance:
    """The setup of a file task: draw the parameters, run the setup commands, run the answer command."""
    values = draw(params, rng)
    for cmd in t.get("setup", ()):
        ws.run(fill(cmd, values))
    answer = fill(t["answer"], values)
    expected = ws.run(answer)
    if not expected.strip():
        raise SetupError(f"the answer command printed nothing, so no answer could match: {answer!r}")
    return TaskInstance(fill(t["instruction"], values), expected, t.get("kind", "text"),
                        check=fill(t["check"], values) if "check" in t else None,
                        solution=[fill(c, values) for c in t.get("solution", [t["answer"]])])
