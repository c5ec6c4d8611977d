"""InterCode-ALFA in our sandbox: 300 natural-language-to-bash tasks, scored by execution, no judge.

The tasks are read from the installed icalfa package (the `alfa` extra), which is never imported: it
pulls in docker, openai and scikit-learn. Task `alfa_<setup>_<index>`, family "alfa/<setup>", split
"benchmark". Correct: the last command's output and the files it changed match those of the gold
command run in a fresh copy of the same set-up; icalfa's own three-part score is recorded too, as
alfa_* components. A gold command that cannot run here makes its task unavailable (docs/tasks.md).
"""
from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import re
import threading
import time
from dataclasses import dataclass

from nano_miles.tasks.api import (WORKDIR, Attempt, SetupError, Task, TaskInstance, TaskUnavailable, Workspace,
                                 in_workdir, normalize, q, register)

# set-up -> the directories its script writes (each mounted fresh per episode) and its task count;
# fs4's script writes nothing (its tasks read the system). Counts as icalfa.main.index_to_img.
SETUPS = {"fs1": (("/testbed",), 153), "fs2": (("/system",), 49), "fs3": (("/workspace", "/backup"), 57),
          "fs4": ((), 23), "fs5": (("/testbed",), 18)}
GOLD_TIMEOUT = 10.0      # seconds, as EnvConfig.command_timeout: a policy running the gold gets the same
REPRODUCE_GAP_S = 1.1    # the second gold run starts this long after the first: a clock in seconds shows
# A reference is reused for this long, then computed again: golds compare file times with the clock
# (find -mmin +5), so the policy's copy must be set up, pinned to the same time, soon after the gold ran.
REFERENCE_TTL_S = 300.0
INSTALL_HINT = "pip install icalfa==0.3.6 (the project's [alfa] extra)"
# gold commands that need what the benchmark's Docker image has and this sandbox cannot have
IMAGE_ONLY = ((re.compile(r"setup_nl2b_fs_\d\.sh"), "reads {m}, a file at the root of the benchmark's Docker "
               "image, which this sandbox's / does not have"),
              (re.compile(r"\$FILES\b"), "uses $FILES, an environment variable of the benchmark's Docker image"))
NO_NETWORK = re.compile(r"Could not resolve host|Temporary failure in name resolution|Network is unreachable|"
                        r"connect: Connection refused|No address associated with hostname")


def package_dir() -> str:
    """Where icalfa is installed; KeyError with the install line when it is not (without importing it)."""
    if (spec := importlib.util.find_spec("icalfa")) is None or not spec.submodule_search_locations:
        raise KeyError(f"the alfa tasks need the icalfa package: {INSTALL_HINT}")
    return list(spec.submodule_search_locations)[0]


def load_dataset(setup: str) -> tuple[str, list[dict]]:
    """(set-up script, [{query, gold, ...}]) of one set-up, from the installed package."""
    n = setup[2:]
    base = os.path.join(package_dir(), "assets")
    with open(os.path.join(base, "docker", f"setup_nl2b_fs_{n}.sh")) as f:
        script = f.read()
    with open(os.path.join(base, "datasets", f"nl2bash_fs_{n}.json")) as f:
        rows = json.load(f)
    if len(rows) != SETUPS[setup][1]:
        raise KeyError(f"icalfa's {setup} has {len(rows)} tasks, not {SETUPS[setup][1]}: {INSTALL_HINT}")
    return script, rows


@functools.cache  # once: a call that raised (icalfa missing) is not cached
def register_alfa() -> None:
    """Register the 300 tasks. KeyError when icalfa is missing."""
    for setup, (mounts, _) in SETUPS.items():
        script, rows = load_dataset(setup)
        for i, row in enumerate(rows):
            register(Task(id=f"alfa_{setup}_{i}", family=f"alfa/{setup}", split="benchmark",
                          summary=row["query"][:80], setup=functools.partial(alfa_setup, f"alfa_{setup}_{i}", setup,
                                                                              script, row),
                          mounts=mounts, workdir="/", source="icalfa"))


# ---- the episode ----------------------------------------------------------------------------------

def snapshot_roots(setup: str) -> list[str]:
    return sorted(set(SETUPS[setup][0]) | {WORKDIR})


def prepare(ws: Workspace, setup: str, script: str, pinned: int) -> dict[str, tuple]:
    """Run the set-up script in the sandbox, pin the times it set to `pinned`, return the snapshot.

    Timestamps the script sets on purpose (touch -t 2023...) are kept; those that are just "now" become
    `pinned`, the task's reference time, so `ls -l` shows the same in every copy of the set-up."""
    roots = " ".join(q(r) for r in snapshot_roots(setup))
    cmd = (f"t0=$(date +%s)\nbash -c {q(script)} >/dev/null 2>&1\n"
           f"find {roots} -xdev -newermt \"@$((t0 - 1))\" -exec touch -h -d @{pinned} {{}} + 2>/dev/null\n"
           + snapshot_command(setup))
    r = ws.sandbox.exec(cmd, timeout=ws.timeout)
    files = parse_snapshot(r.stdout) if not r.timed_out and not r.truncated else None
    if files is None or (SETUPS[setup][0] and len(files) <= len(snapshot_roots(setup))):
        raise SetupError(f"the {setup} set-up script did not run (exit {r.exit_code}): {r.stderr.strip()[-200:]}")
    return files


def snapshot_command(setup: str) -> str:
    """Every path under the task's directories: type, mode, link target, then the content hashes."""
    roots = " ".join(q(r) for r in snapshot_roots(setup))
    return (f"find {roots} -xdev -printf '%y\\0%m\\0%l\\0%p\\0' 2>/dev/null; printf '\\0--hashes--\\0'; "
            f"find {roots} -xdev -type f -exec sha256sum -z -- {{}} + 2>/dev/null; true")


def parse_snapshot(out: str) -> dict[str, tuple] | None:
    """{path: (type, mode, link target or content hash)}; None when the output is not a snapshot."""
    if "\0--hashes--\0" not in out:
        return None
    meta, hashes = out.split("\0--hashes--\0", 1)
    fields = meta.split("\0")[:-1]
    if len(fields) % 4:
        return None
    digest = {}
    for entry in hashes.split("\0"):
        if len(entry) > 66 and entry[64:66] == "  ":
            digest[entry[66:]] = entry[:64]
    files = {}
    for i in range(0, len(fields), 4):
        kind, mode, link, path = fields[i:i + 4]
        files[path] = (kind, mode, link if kind == "l" else digest.get(path, "unreadable") if kind == "f" else "")
    return files


def changes(before: dict, after: dict) -> dict[str, tuple | None]:
    """{path: its new (type, mode, content)} for added and modified paths, None for deleted ones."""
    out = {p: v for p, v in after.items() if before.get(p) != v}
    out.update({p: None for p in before if p not in after})
    return out


def status_of(path: str, before: dict, diff: dict) -> str:
    return "D" if diff[path] is None else "M" if path in before else "A"


def normalize_output(text: str | None, uid) -> str | None:
    """Whitespace collapsed; the sandbox's own uid (random per sandbox, shown by ls -l) made neutral."""
    if text is None:
        return None
    if uid is not None:
        text = re.sub(rf"\b{uid}\b", "<uid>", text)
    return " ".join(text.split())


@dataclass
class Reference:
    """The gold command's effect on a fresh copy of the set-up."""
    output: str                      # its output, normalised
    diff: dict[str, tuple | None]    # the files it changed
    pinned: int                      # the set-up's pinned time


# (task id, sandbox tier) -> its reference, or why it is unavailable
_references: dict[tuple[str, str], Reference | str] = {}
_reference_locks: dict[tuple[str, str], threading.Lock] = {}  # setdefault on a dict is atomic


def reference(task_id: str, setup: str, script: str, gold: str, ws: Workspace) -> Reference:
    """The task's reference, computed once per REFERENCE_TTL_S (the group's other episodes wait for it).
    TaskUnavailable when the gold command cannot run here (that verdict is kept for the process)."""
    key = (task_id, ws.sandbox.tier)
    with _reference_locks.setdefault(key, threading.Lock()):
        cached = _references.get(key)
        if cached is None or (isinstance(cached, Reference) and time.time() - cached.pinned > REFERENCE_TTL_S):
            try:
                _references[key] = compute_reference(setup, script, gold, ws)
            except TaskUnavailable as e:
                _references[key] = str(e)
        ref = _references[key]
    if isinstance(ref, str):
        raise TaskUnavailable(ref)
    return ref


def compute_reference(setup: str, script: str, gold: str, ws: Workspace) -> Reference:
    for pattern, why in IMAGE_ONLY:
        if m := pattern.search(gold):
            raise TaskUnavailable(why.format(m=m.group(0)))
    pinned = int(time.time())
    runs, started = [], 0.0
    for copy in range(2):
        with ws.fresh_copy() as fresh:
            before = prepare(fresh, setup, script, pinned)
            if copy == 1:  # a clock read twice in one second would look reproducible
                time.sleep(max(0.0, started + REPRODUCE_GAP_S - time.monotonic()))
            started = time.monotonic()
            r = fresh.sandbox.exec(in_workdir(gold, "/"), timeout=GOLD_TIMEOUT)
            cannot_run(r)
            after = parse_snapshot(fresh.sandbox.exec(snapshot_command(setup), timeout=fresh.timeout).stdout)
            if after is None:
                raise TaskUnavailable("the files the gold command leaves could not be listed")
            runs.append((normalize_output(r.stdout + r.stderr, fresh.sandbox.uid), changes(before, after)))
    (out_a, diff_a), (out_b, diff_b) = runs
    if out_a != out_b or diff_a != diff_b:
        what = "output differs" if out_a != out_b else "file changes differ"
        raise TaskUnavailable(f"the gold command's {what} between two fresh set-ups (time, process or machine "
                              "state): no policy could match it")
    return Reference(out_a, diff_a, pinned)


def cannot_run(r) -> None:
    """TaskUnavailable when the gold command's run shows it cannot work in this sandbox."""
    err = r.stderr.strip()
    if r.timed_out:
        raise TaskUnavailable(f"the gold command timed out here ({GOLD_TIMEOUT:g}s)")
    if r.exit_code in (126, 127) or "command not found" in err:
        m = re.search(r"([^\s:]+): (?:command not found|Permission denied)", err)
        raise TaskUnavailable(f"a tool is missing here: {m.group(1) if m else err[-120:]}")
    if r.exit_code != 0 and "Read-only file system" in err:
        raise TaskUnavailable("the gold command writes outside the task's directories (the sandbox's / is "
                              "read-only)")
    if r.exit_code != 0 and NO_NETWORK.search(err + r.stdout):
        raise TaskUnavailable("the gold command needs the network (the sandbox has none)")


def alfa_setup(task_id: str, setup: str, script: str, row: dict, ws: Workspace, rng) -> TaskInstance:
    """An episode: the reference (once per task), then this copy's set-up; scored by `score`."""
    ref = reference(task_id, setup, script, row["gold"], ws)
    before = prepare(ws, setup, script, ref.pinned)
    instruction = (f"{row['query'].strip()}\n\nRun the bash command that does this with <bash>COMMAND</bash> (the "
                   "shell starts in /). The output of the last command you run and the files changed are compared "
                   "with those of a reference command. After it has run, finish with <answer>done</answer>.")
    return TaskInstance(instruction, expected=ref.output, kind="text", solution=[row["gold"]], solution_answer="done",
                        score=functools.partial(score, ref, before, setup, row["gold"]))


def score(ref: Reference, before: dict, setup: str, gold: str, attempt: Attempt) -> dict[str, float]:
    """The last command the policy ran counts (or, when it ran none, the command it answered with, run now
    in its copy as the gold ran in a fresh one). correct: that command's output and the copy's file
    changes both match the gold's; alfa_*: the benchmark's three parts."""
    sandbox = attempt.workspace.sandbox
    command, output = attempt.last_command, attempt.last_output
    if command is None:
        command = command_from(attempt.answer)
        try:
            r = sandbox.exec(in_workdir(command, "/"), timeout=GOLD_TIMEOUT) if command else None
            output = r.stdout + r.stderr if r else None
        except ValueError:  # a command the sandbox refuses (a NUL byte): no output
            pass
    output = normalize_output(output, sandbox.uid)
    # {} when there were too many files to list, or the listing itself failed: nothing to compare
    after = parse_snapshot(sandbox.exec(snapshot_command(setup), timeout=attempt.workspace.timeout).stdout) or {}
    diff = changes(before, after)
    output_ok = output is not None and output == ref.output
    files_ok = diff == ref.diff
    # icalfa BashEnv.get_reward, judge left out: (path, status) sets, then hashes of common additions/changes
    mine = {(p, status_of(p, before, diff)) for p in diff}
    gold_set = {(p, status_of(p, before, ref.diff)) for p in ref.diff}
    file_diff = round(0.33 * (1 - math.erf(len(mine ^ gold_set))), 2)
    common = [p for p, s in mine & gold_set if s in ("A", "M")]
    file_changes = round(0.33 * sum(diff[p] == ref.diff[p] for p in common) / len(common), 2) if common else 0.33
    answer = 0.33 if output_ok or command == gold else 0.0
    return {"correct": float(output_ok and files_ok), "alfa_score": round(0.01 + file_diff + file_changes + answer, 2),
            "alfa_output": float(output_ok), "alfa_files": float(files_ok)}


def command_from(answer: str) -> str:
    """The command in an answer: inside a ```bash fence, or with one layer of quotes/backticks removed."""
    fenced = re.fullmatch(r"```[\w-]*\n(.*?)\n?```", answer.strip(), re.DOTALL)
    return fenced.group(1).strip() if fenced else normalize(answer, "text")


def three_part_summary(trajs) -> dict | None:
    """Means of the benchmark's score and its output / files parts over the ALFA episodes (None: none).
    An episode that ended without an answer (turn or token limit) never submitted: it counts 0."""
    if not (rows := [t.reward_components for t in trajs if t.task_id.startswith("alfa_")]):
        return None
    return {"episodes": len(rows), "answered": sum("alfa_score" in r for r in rows),
            **{key: round(sum(r.get(f"alfa_{key}", 0.0) for r in rows) / len(rows), 4)
               for key in ("score", "output", "files")}}
