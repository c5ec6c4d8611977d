"""OpenShellEnv: one episode of a shell task, played through text turns in a real sandbox.

The policy replies <bash>COMMAND</bash> (run in the episode's sandbox; the output comes back as a tool
turn) or <answer>TEXT</answer> (finish; the task's verifier decides). Reward components, all recorded
on the trajectory: correct, exec_ok, format, timeout (see EnvConfig) and infra_failures (the sandbox
failed, not the policy: counted, earn nothing, end the episode). exec_ok is capped at one command's
worth (with more, policies learn to pad every episode with harmless commands) and forfeited by an
episode that ends without an answer (or running commands and never answering would outpay a wrong one).
"""
from __future__ import annotations

import random
import re
import threading
import time
from dataclasses import dataclass

from nano_openshell import Sandbox
from nano_openshell.sandbox import SandboxError

from nano_miles.tasks.api import (WORKDIR, Attempt, SetupError, Task, TaskInstance, TaskUnavailable, Workspace,
                                 in_workdir, verify)

SYSTEM_PROMPT = """You solve tasks by running commands in a Linux shell (bash, coreutils, python3).
Each reply must do exactly one of these two things:
<bash>COMMAND</bash> runs COMMAND in the task's working directory; you then see its output, stderr and exit code.
<answer>VALUE</answer> gives your final answer and ends the task. Put only the requested value inside.
Run one command per reply. Look at the output before answering."""

# The one-shot example before the task (rollout.env.prompt_example). "multi_step" shows a small model
# that errors are read and fixed, and that a task may need several commands.
PROMPT_EXAMPLES = {
    "one_step": [
        ("user", "How many lines does greeting.txt contain? Answer with the number."),
        ("assistant", "<bash>wc -l < greeting.txt</bash>"),
        ("tool", "3\n[exit code 0]"),
        ("assistant", "<answer>3</answer>"),
    ],
    "multi_step": [
        ("user", "Write the number of lines of notes/todo.txt into count.txt, then answer with that number."),
        ("assistant", "<bash>wc -l < todo.txt > count.txt</bash>"),
        ("tool", "[stderr]\n/bin/bash: line 2: todo.txt: No such file or directory\n[exit code 1]"),
        ("assistant", "<bash>wc -l < notes/todo.txt > count.txt</bash>"),
        ("tool", "[exit code 0]"),
        ("assistant", "<bash>cat count.txt</bash>"),
        ("tool", "3\n[exit code 0]"),
        ("assistant", "<answer>3</answer>"),
    ],
}

ACTION_END_TAGS = ("</bash>", "</answer>")  # the rollout's stop strings: an action ends a turn
ACTION_RE = re.compile(r"<(bash|answer)>(.*?)</\1>", re.DOTALL)  # the first closed tag wins
FORMAT_ERROR = ("Format error: reply with <bash>COMMAND</bash> to run a command, or <answer>VALUE</answer> to "
                "finish. Both tags must be closed.")


def prompt_messages(instruction: str, example: str = "one_step") -> list[dict]:
    shots = [{"role": role, "content": text} for role, text in PROMPT_EXAMPLES[example]]
    return [{"role": "system", "content": SYSTEM_PROMPT}, *shots, {"role": "user", "content": instruction}]


@dataclass
class EnvConfig:
    max_turns: int = 6                 # model turns before the episode is cut off
    max_total_tokens: int = 4096       # prompt + response token budget (enforced by the rollout)
    command_timeout: float = 10.0      # seconds per command
    max_observation_chars: int = 1500  # tool output past this is cut, with a marker saying how much
    correct_reward: float = 1.0        # reward for an answer the verifier accepts
    exec_ok_bonus: float = 0.1         # shaping: per distinct command that exits 0 (only when the episode answers)
    exec_ok_cap: float = 0.1           # shaping: at most this much exec_ok_bonus per episode (more pays padding)
    format_penalty: float = -0.1       # per turn with neither <bash> nor <answer> (or an empty or refused command)
    timeout_penalty: float = -0.1      # per command that ran past command_timeout
    prompt_example: str = "one_step"   # the example exchange before the task: one_step | multi_step (env.py)

    def __post_init__(self):
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if self.prompt_example not in PROMPT_EXAMPLES:
            raise ValueError(f"prompt_example must be one of {', '.join(PROMPT_EXAMPLES)}, got {self.prompt_example!r}")
        if self.exec_ok_cap >= self.correct_reward:
            raise ValueError("exec_ok_cap must stay below correct_reward, or shaping outpays solving the task")


@dataclass
class StepResult:
    observation: str | None   # tool-turn content for the next turn; None once the episode is over
    done: bool
    kind: str                 # exec | timeout | format_error | answer | max_turns | infra_error


def parse_action(text: str) -> tuple[str, str] | None:
    """('bash', cmd) or ('answer', value) from the first closed tag in the text, else None."""
    m = ACTION_RE.search(text)
    return (m.group(1), m.group(2).strip()) if m else None


def format_output(r, cfg: EnvConfig) -> str:
    """The tool-turn text for one command: stdout, stderr, then the exit status; cut past the cap."""
    parts = []
    if r.stdout:
        parts.append(r.stdout.rstrip("\n"))
    if r.stderr:
        parts.append("[stderr]\n" + r.stderr.rstrip("\n"))
    body = "\n".join(parts)
    if len(body) > cfg.max_observation_chars:
        body = body[:cfg.max_observation_chars] + f"\n[... {len(body) - cfg.max_observation_chars} more characters cut]"
    elif r.truncated:
        body += "\n[... output cut by the sandbox]"
    status = (f"[timed out after {cfg.command_timeout:g}s]" if r.timed_out else f"[exit code {r.exit_code}]")
    return (body + "\n" + status) if body else status


class OpenShellEnv:
    """One episode: reset() prepares the sandbox and the task; step(action_text) plays one turn."""

    def __init__(self, task: Task, seed: int, config: EnvConfig | None = None, sandbox_factory=None):
        self.task, self.seed = task, seed
        self.cfg = config or EnvConfig()
        self.sandbox_factory = sandbox_factory or default_sandbox
        self.sandbox = None
        self.workdir: str | None = None
        self.instance: TaskInstance | None = None
        self.turns = 0
        self.done = False
        self.finish_reason = ""
        self.infra_error: str | None = None   # what broke, when the sandbox failed mid-episode
        self.components = {"correct": 0.0, "exec_ok": 0.0, "format": 0.0, "timeout": 0.0, "infra_failures": 0}
        self._ok_commands: set[str] = set()
        self.exec_s = 0.0  # seconds the sandbox spent running this episode's commands
        self.last_command: str | None = None   # the last command run and its output (scoring by execution)
        self.last_output: str | None = None
        self.last_observation: str | None = None  # the last tool turn's text (a scripted policy answers from it)
        # reset/step run in worker threads that a cancelled caller cannot stop; close() takes the same
        # lock, so it waits for the one in flight and no setup can create a sandbox after close.
        self._busy = threading.Lock()
        self._closed = False

    def reset(self) -> list[dict]:
        """The prompt's chat messages, once the sandbox is up and the task set up; SetupError when the
        sandbox cannot run the setup (infrastructure, not the policy)."""
        with self._busy:
            if self._closed:
                raise SetupError(f"task {self.task.id}: the episode was closed before its setup ran")
            try:
                self.sandbox = self._new_sandbox()
                self.workdir = self.sandbox.workspace   # a fresh directory the sandbox owns and removes
                self.instance = self.task.setup(self._workspace(), random.Random(self.seed))
            except SetupError as e:
                self._close()
                raise type(e)(f"{self._name()}: {e}") from e
            except Exception as e:  # the sandbox could not start or exec: an infrastructure failure
                self._close()
                raise SetupError(f"{self._name()}: sandbox failed during setup: {type(e).__name__}: {e}") from e
            return self.messages()

    def _name(self) -> str:
        return f"{self.task.source}: task {self.task.id!r}" if self.task.source else f"task {self.task.id!r}"

    def _workspace(self) -> Workspace:
        return Workspace(self.sandbox, self.workdir, new_sandbox=self._new_sandbox)

    def _new_sandbox(self):
        """A sandbox for this task, with its directories mounted at their fixed paths if it has any."""
        if not self.task.mounts:
            return self.sandbox_factory()
        paths = ", ".join(self.task.mounts)
        try:  # the episode's workspace is at WORKDIR already: only the other paths are mounts
            sandbox = self.sandbox_factory(mounts={m: None for m in self.task.mounts if m != WORKDIR})
        except TypeError as e:  # a factory (or Sandbox) that takes no mounts
            raise TaskUnavailable(f"needs directories at fixed paths ({paths}), which this sandbox cannot "
                                  f"mount: {e}") from e
        except SandboxError as e:  # the tier cannot mount (fallback): said in the error
            raise TaskUnavailable(f"needs directories at fixed paths ({paths}): {e}") from e
        if sandbox.tier != "namespaced":
            sandbox.close()
            raise TaskUnavailable(f"needs directories at fixed paths ({paths}): the {sandbox.tier} tier has no "
                                  "mount namespace, so it cannot put them there")
        return sandbox

    def messages(self) -> list[dict]:
        return prompt_messages(self.instance.instruction, self.cfg.prompt_example)

    def close(self) -> None:
        with self._busy:
            self._closed = True
            self._close()

    def _close(self) -> None:
        sandbox, self.sandbox, self.workdir = self.sandbox, None, None
        if sandbox is not None:
            sandbox.close()

    def step(self, action_text: str) -> StepResult:
        with self._busy:
            if self.done:
                raise RuntimeError(f"episode of {self.task.id} is over ({self.finish_reason}); call reset()")
            if self.instance is None:
                raise RuntimeError("call reset() before step()")
            self.turns += 1
            kind, body = parse_action(action_text) or ("format_error", "")
            if kind == "answer":
                return self._answer(body)
            if kind != "bash" or not body:  # an empty <bash></bash> runs nothing
                return self._format_error(FORMAT_ERROR)
            cmd = in_workdir(body, self.task.workdir)
            t = time.perf_counter()
            try:
                r = self.sandbox.exec(cmd, timeout=self.cfg.command_timeout)
            except ValueError as e:  # the sandbox refused the command itself (a NUL byte...): the policy's fault
                return self._format_error(f"Command refused: {e}.")
            except Exception as e:
                return self.infra_failed(f"{type(e).__name__}: {e}")
            finally:
                self.exec_s += time.perf_counter() - t
            return self._after_exec(body, r)

    def end(self, reason: str) -> None:
        """End the episode from outside (the rollout's token budget, an engine that stopped)."""
        if not self.done:
            self.done, self.finish_reason = True, reason
            self.components["exec_ok"] = 0.0  # no answer, no shaping (see the module docstring)

    @property
    def reward(self) -> float:
        if self.components["infra_failures"]:
            return 0.0
        c = self.components
        return round(c["correct"] + c["exec_ok"] + c["format"] + c["timeout"], 6)

    def _after_exec(self, cmd: str, r) -> StepResult:
        self.last_command, self.last_output = cmd, r.stdout + r.stderr
        if r.timed_out:
            self.components["timeout"] = round(self.components["timeout"] + self.cfg.timeout_penalty, 6)
            kind = "timeout"
        else:
            kind = "exec"
            if r.exit_code == 0 and cmd not in self._ok_commands:
                self._ok_commands.add(cmd)
                self.components["exec_ok"] = round(min(self.cfg.exec_ok_cap,
                                                       self.components["exec_ok"] + self.cfg.exec_ok_bonus), 6)
        return self._next(format_output(r, self.cfg), kind)

    def _answer(self, answer: str) -> StepResult:
        """The task's verifier decides; a task scored by execution (ALFA) also records its metrics."""
        try:
            if self.instance.score is None:
                ok = verify(self.instance, answer, self._workspace())
            else:
                attempt = Attempt(answer, self.last_command, self.last_output, self._workspace())
                metrics = dict(self.instance.score(attempt))
                ok = bool(metrics.pop("correct"))
                self.components.update({k: float(v) for k, v in metrics.items()})
        except Exception as e:
            return self.infra_failed(f"{type(e).__name__}: {e}")
        self.components["correct"] = self.cfg.correct_reward if ok else 0.0
        self.done, self.finish_reason = True, "answer"
        return StepResult(None, True, "answer")

    def _format_error(self, observation: str) -> StepResult:
        self.components["format"] = round(self.components["format"] + self.cfg.format_penalty, 6)
        return self._next(observation, "format_error")

    def _next(self, observation: str, kind: str) -> StepResult:
        if self.turns >= self.cfg.max_turns:
            self.end("max_turns")
            return StepResult(None, True, "max_turns")
        self.last_observation = observation
        return StepResult(observation, False, kind)

    def infra_failed(self, why: str) -> StepResult:
        """End the episode as an infrastructure failure (the sandbox or the engine broke, not the
        policy): it earns nothing and is counted, never trained on or scored."""
        self.components["infra_failures"] += 1
        self.done, self.finish_reason, self.infra_error = True, "infra_error", why
        return StepResult(None, True, "infra_error")


default_sandbox = Sandbox  # a fresh workspace (and mounts={path: None}) removed on close, no network


def answer_from(observation: str | None) -> str:
    """What a scripted policy answers after an observation: the command's stdout, no status line."""
    text = "\n" + (observation or "")
    text = text[:text.rfind("\n[exit code ")] if "\n[exit code " in text else text
    return text.split("\n[stderr]\n", 1)[0].strip()
