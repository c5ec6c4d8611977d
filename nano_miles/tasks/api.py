"""The public API for writing tasks (docs/tasks.md): what a task is, what its setup sees, how an
answer is judged, and the registry every task joins (the built-in catalog, ALFA, a user's module or
TOML file alike). Ground truth is never typed in: a setup computes it by running real commands in the
episode's sandbox (ws.run), with every parameter drawn from the episode's seeded rng.
"""
from __future__ import annotations

import contextlib
import os
import random
import shlex
from dataclasses import dataclass, field
from typing import Callable

SPLITS = ("train", "heldout", "benchmark")  # benchmark: an external evaluation set, never trained on
KINDS = ("text", "int", "lower", "hex")
WORKDIR = "/workspace"  # where the namespaced sandbox mounts an episode's workspace


class SetupError(RuntimeError):
    """A setup command failed: the sandbox (infrastructure) or the task, not the policy, is at fault."""


class TaskUnavailable(SetupError):
    """The task cannot run on this machine (a tool it needs is missing, the sandbox tier cannot mount
    its paths...): it is skipped with this reason and left out of every score."""


@dataclass
class Attempt:
    """What the policy did, for tasks scored by execution rather than by the answer (ALFA)."""
    answer: str
    last_command: str | None        # the last command it ran (None: it ran none)
    last_output: str | None         # that command's stdout then stderr
    workspace: "Workspace"


@dataclass
class TaskInstance:
    instruction: str
    expected: str                  # ground truth, computed by running commands at setup
    kind: str = "text"             # how an answer is compared: text | int | lower | hex
    check: str | None = None       # a command that must exit 0 (workspace state) for success
    solution: list[str] = field(default_factory=list)  # scripted policy; last stdout = answer
    solution_answer: str | None = None  # the scripted policy's answer, when it is not that stdout (ALFA: a command)
    # Scoring by execution (ALFA): called with the Attempt instead of comparing the answer with
    # `expected`; returns {"correct": 0.0 or 1.0, other metrics...}, all recorded on the trajectory.
    score: Callable[[Attempt], dict[str, float]] | None = None


@dataclass(frozen=True)
class Task:
    id: str
    family: str                    # "text", "files", ...; "alfa/fs1": a sub-family of "alfa"
    split: str                     # train | heldout | benchmark
    summary: str
    setup: Callable[["Workspace", random.Random], TaskInstance]
    seed_task: bool = False        # one of the four tasks of the original system
    # absolute paths the task needs as writable directories of their own (/testbed...), each a fresh
    # empty directory per episode, thrown away with it (the namespaced tier only)
    mounts: tuple[str, ...] = ()
    workdir: str | None = None     # the directory the policy's commands start in (None: the workspace)
    source: str = ""               # the module or file that defined it, for error lines


class Workspace:
    """What a task's setup sees: files in the episode's workspace and a way to run commands there."""

    def __init__(self, sandbox, path: str, timeout: float = 20.0, new_sandbox: Callable | None = None):
        self.sandbox, self.path, self.timeout = sandbox, path, timeout
        self._new_sandbox = new_sandbox

    def write(self, rel: str, data: str | bytes, mode: int = 0o644) -> None:
        """Write a file from the host: a path relative to the workspace, or an absolute one under one of
        the task's mounts (/testbed/a.txt). The Sandbox hands the files to its own uid before each exec."""
        root, inside = self.path, rel
        parts = os.path.normpath(rel).split("/") if os.path.isabs(rel) else []
        for i in range(len(parts) - 1, 1, -1):  # the longest prefix that is one of the task's mounts
            try:
                root, inside = self.sandbox.path_of("/".join(parts[:i])), "/".join(parts[i:])
                break
            except (ValueError, AttributeError):
                continue
        full = os.path.join(root, inside)
        if os.path.isabs(inside) or not os.path.realpath(full).startswith(os.path.realpath(root) + os.sep):
            raise ValueError(f"task files must stay inside the workspace or the task's mounts: {rel!r}")
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(full, mode)

    def run(self, cmd: str) -> str:
        """Run a setup command in the sandbox; its stdout with the trailing newline removed."""
        r = self.sandbox.exec(cmd, timeout=self.timeout)
        if r.exit_code != 0 or r.timed_out:
            why = "timed out" if r.timed_out else f"exit {r.exit_code}"
            raise SetupError(f"setup command failed ({why}): {cmd[:200]!r}: {r.stderr.strip()[-300:]}")
        return r.stdout.rstrip("\n")

    def ok(self, cmd: str) -> bool:
        r = self.sandbox.exec(cmd, timeout=self.timeout)
        return r.exit_code == 0 and not r.timed_out

    @contextlib.contextmanager
    def fresh_copy(self):
        """A second, fresh sandbox like this one (same mounts, empty), closed on exit: where a task
        runs its reference solution without touching the policy's copy (ALFA's gold command)."""
        if self._new_sandbox is None:
            raise RuntimeError("this Workspace cannot make fresh copies (no sandbox factory)")
        sandbox = self._new_sandbox()
        try:
            yield Workspace(sandbox, sandbox.workspace, self.timeout, self._new_sandbox)
        finally:
            sandbox.close()


def normalize(answer: str, kind: str) -> str | None:
    """Canonical form of an answer for comparison; None if it cannot be read as `kind`."""
    a = answer.strip()
    for q in ("```", "`", '"', "'"):  # one layer of quoting or code formatting around a bare value
        if len(a) >= 2 * len(q) and a.startswith(q) and a.endswith(q):
            a = a[len(q):-len(q)].strip()
    if kind == "int":
        try:
            return str(int(a.replace(",", "")))
        except ValueError:
            return None
    return a.lower() if kind in ("lower", "hex") else a


def verify(inst: TaskInstance, answer: str | None, ws: Workspace) -> bool:
    """True when the answer matches the ground truth and the workspace passes the task's check."""
    got = None if answer is None else normalize(answer, inst.kind)
    if not got or got != normalize(inst.expected, inst.kind):
        return False
    return inst.check is None or ws.ok(inst.check)


q = shlex.quote


def in_workdir(cmd: str, workdir: str | None) -> str:
    """The command as the sandbox runs it for a task whose commands start in `workdir`."""
    return f"cd {q(workdir)} || exit 125\n{cmd}" if workdir else cmd


# ---- the registry -------------------------------------------------------------------------------

TASKS: dict[str, Task] = {}
# While a user's module or file loads (`loading`): its name, and the list its registration errors go to.
_loading: list[tuple[str, list[str]]] = []


def register(t: Task) -> bool:
    """Add a task to the registry; True when it was added. A bad or duplicate task raises ValueError,
    except while a user's module loads: then the error becomes one line of that module's report, the
    task is left out and the rest of the module still loads."""
    try:
        if not t.id or not t.id.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"task id must be letters, digits, '_' or '-', got {t.id!r}")
        if t.split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, not {t.split!r}")
        if not t.family:
            raise ValueError("family must not be empty")
        for m in t.mounts:
            if not isinstance(m, str) or not os.path.isabs(m) or os.path.normpath(m) != m or m == "/":
                raise ValueError(f"mounts must be normalised absolute paths below /, got {m!r}")
        if t.workdir is not None and not os.path.isabs(t.workdir):
            raise ValueError(f"workdir must be an absolute path, got {t.workdir!r}")
        if t.id in TASKS:
            raise ValueError(f"duplicate id (already defined by {TASKS[t.id].source or 'another module'})")
    except ValueError as e:
        report_problem(t.id, str(e))
        return False
    TASKS[t.id] = t
    return True


def report_problem(task_id: str, problem: str) -> None:
    """A bad task definition: one line of the loading module's report, or ValueError outside one."""
    if not _loading:
        raise ValueError(f"task {task_id!r}: {problem}")
    _loading[-1][1].append(f"task {task_id!r}: {problem}")


def task(id: str, family: str, split: str, summary: str, seed_task: bool = False,
         mounts: tuple[str, ...] = (), workdir: str | None = None):
    """Decorator: register `setup(ws, rng) -> TaskInstance` as a task."""
    def decorate(fn):
        register(Task(id=id, family=family, split=split, summary=summary, setup=fn, seed_task=seed_task,
                      mounts=tuple(mounts), workdir=workdir, source=source_of(fn.__module__)))
        return fn
    return decorate


def source_of(module: str) -> str:
    """What a task registered now names as its source: the user's module or file loading, else `module`."""
    return _loading[-1][0] if _loading else module


@contextlib.contextmanager
def loading(source: str, errors: list[str]):
    """While a user's module or task file `source` loads: tasks name it as their source, and
    registration errors are appended to `errors` instead of raised."""
    _loading.append((source, errors))
    try:
        yield
    finally:
        _loading.pop()
