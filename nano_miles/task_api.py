"""What a task is, what its setup sees, how an answer is judged, and the registry tasks join.

The built-in catalog (task_catalog.py) registers through it; tasks.py (selection, the CLI) imports
the catalog. This module imports neither, so there is no import cycle.
"""
from __future__ import annotations

import os
import random
import shlex
from dataclasses import dataclass, field
from typing import Callable

SPLITS = ("train", "heldout")


class SetupError(RuntimeError):
    """A setup command failed: the sandbox (infrastructure), not the policy, is at fault."""


@dataclass
class TaskInstance:
    instruction: str
    expected: str                  # ground truth, computed by running commands at setup
    kind: str = "text"             # how an answer is compared: text | int | lower | hex
    check: str | None = None       # a command that must exit 0 (workspace state) for success
    solution: list[str] = field(default_factory=list)  # scripted policy; last stdout = answer


@dataclass(frozen=True)
class Task:
    id: str
    family: str
    split: str                     # train | heldout
    summary: str
    setup: Callable[["Workspace", random.Random], TaskInstance]
    seed_task: bool = False        # one of the four tasks of the original system


class Workspace:
    """What a task's setup sees: files in the episode's workspace and a way to run commands there."""

    def __init__(self, sandbox, path: str, timeout: float = 20.0):
        self.sandbox, self.path, self.timeout = sandbox, path, timeout

    def write(self, rel: str, data: str | bytes, mode: int = 0o644) -> None:
        """Write a file from the host (the Sandbox hands workspace files to its own uid before each exec)."""
        full = os.path.join(self.path, rel)
        if os.path.isabs(rel) or not os.path.realpath(full).startswith(os.path.realpath(self.path) + os.sep):
            raise ValueError(f"task files must stay inside the workspace: {rel!r}")
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(full, mode)

    def run(self, cmd: str) -> str:
        """Run a setup command in the sandbox; its stdout with the trailing newline removed."""
        r = self.sandbox.exec(cmd, timeout=self.timeout)
        if r.exit_code != 0 or r.timed_out:
            raise SetupError(f"setup command failed (exit {r.exit_code}, timed_out={r.timed_out}): "
                             f"{cmd!r}: {r.stderr.strip()[:300]}")
        return r.stdout.rstrip("\n")

    def ok(self, cmd: str) -> bool:
        r = self.sandbox.exec(cmd, timeout=self.timeout)
        return r.exit_code == 0 and not r.timed_out


def normalize(answer: str, kind: str) -> str | None:
    """Canonical form of an answer for comparison; None if it cannot be read as `kind`."""
    a = answer.strip()
    # Tolerate one layer of quoting/code formatting around a bare value.
    for q in ("```", "`", '"', "'"):
        if len(a) >= 2 * len(q) and a.startswith(q) and a.endswith(q):
            a = a[len(q):-len(q)].strip()
    if kind == "int":
        try:
            return str(int(a.replace(",", "")))
        except ValueError:
            return None
    if kind in ("lower", "hex"):
        return a.lower()
    return a


def verify(inst: TaskInstance, answer: str | None, ws: Workspace) -> bool:
    """True when the answer matches the ground truth and the workspace passes the task's check."""
    if answer is None:
        return False
    got = normalize(answer, inst.kind)
    if got is None or got == "" or got != normalize(inst.expected, inst.kind):
        return False
    return inst.check is None or ws.ok(inst.check)


# ---- the registry -------------------------------------------------------------------------------

TASKS: dict[str, Task] = {}


def task(id: str, family: str, split: str, summary: str, seed_task: bool = False):
    if split not in SPLITS:
        raise ValueError(f"task {id}: split must be one of {SPLITS}, not {split!r}")

    def register(fn):
        if id in TASKS:
            raise ValueError(f"duplicate task id {id!r}")
        TASKS[id] = Task(id=id, family=family, split=split, summary=summary, setup=fn, seed_task=seed_task)
        return fn
    return register


def q(s: str) -> str:
    return shlex.quote(s)
