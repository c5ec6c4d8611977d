"""The task catalog: its shape, and that every task is solvable, through the env and the real sandbox.

The scripted policy runs each task's solution commands as <bash> turns and answers with the stdout
of the last one (read back from the observation), exactly as a model would.
"""
import collections
import json
import re

import pytest

from nano_miles import cli
from nano_miles.rollout.env import EnvConfig, OpenShellEnv
from nano_miles.tasks import TaskInstance, Workspace, get_task, normalize, select_tasks, verify
from nano_miles.tasks.api import TASKS as REGISTRY

TASKS = list(REGISTRY.values())


def test_catalog_shape():
    ids = [t.id for t in TASKS]
    assert len(ids) == len(set(ids))
    seed = select_tasks("seed")
    assert sorted(t.id for t in seed) == ["kernel_name", "numbers_file", "python_product", "sha256_string"]
    assert all(t.split == "train" for t in seed)
    assert len(TASKS) - len(seed) >= 24
    heldout, train = select_tasks("heldout"), select_tasks("train")
    assert len(heldout) >= 20 and len(train) >= 4
    assert not {t.id for t in heldout} & {t.id for t in train}
    families = collections.Counter(t.family for t in TASKS)
    for fam in ("text", "files", "archives", "json", "permissions", "process", "scripts"):
        assert families[fam] >= 2, f"family {fam} is thin: {families}"
    # the held-out set spans the families too, so per-family eval means something
    assert len({t.family for t in heldout}) >= 7


def test_select_and_get_errors():
    assert [t.id for t in select_tasks("nth_line,md5_file")] == ["nth_line", "md5_file"]
    with pytest.raises(KeyError, match="unknown task 'nope'"):
        get_task("nope")


def test_tasks_list_cli(capsys):
    assert cli.main(["tasks", "list", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == len(TASKS)
    assert {r["split"] for r in rows} == {"train", "heldout"}
    assert all(set(r) >= {"id", "split", "family", "summary"} for r in rows)
    assert cli.main(["tasks", "list", "--split", "heldout"]) == 0
    out = capsys.readouterr().out
    assert "heldout" in out and "sha256_string" not in out


def test_normalize():
    assert normalize(" 1,024\n", "int") == "1024"
    assert normalize("`42`", "int") == "42"
    assert normalize("forty", "int") is None
    assert normalize('"ABCdef"', "hex") == "abcdef"
    assert normalize("  linux ", "text") == "linux"


def wrong_answer(inst: TaskInstance) -> str:
    if inst.kind == "int":
        return str(int(inst.expected) + 1)
    return inst.expected + "x"


def answer_from(observation: str) -> str:
    # the observation ends with the exit status line; everything before it is the command's output
    assert observation.endswith("[exit code 0]"), observation
    return observation[: -len("[exit code 0]")].strip()


@pytest.mark.parametrize("task", TASKS, ids=[t.id for t in TASKS])
def test_scripted_policy_solves_and_verifier_discriminates(task):
    scripted_policy_solves_and_verifier_discriminates(task)


def scripted_policy_solves_and_verifier_discriminates(task, seed: int = 7) -> None:
    """The task's scripted solution, played through the env, is judged right; wrong or early answers are not.
    (Also run on the opt-in skills set: test_catalog_skills.py.)"""
    env = OpenShellEnv(task, seed=seed, config=EnvConfig(max_turns=10))
    try:
        env.reset()
        inst = env.instance
        assert inst.expected.strip(), "ground truth must not be empty"
        ws = Workspace(env.sandbox, env.workdir)
        # Before doing anything: an empty answer never passes; a task with a state check refuses the
        # right value until the workspace is in the right state.
        assert not verify(inst, "", ws) and not verify(inst, None, ws)
        if inst.check:
            assert not verify(inst, inst.expected, ws), "the check passed before the task was done"
        obs = None
        for cmd in inst.solution:
            step = env.step(f"<bash>{cmd}</bash>")
            assert step.kind == "exec" and not step.done, (cmd, step)
            obs = step.observation
        answer = answer_from(obs)
        assert not verify(inst, wrong_answer(inst), ws)
        step = env.step(f"<answer>{answer}</answer>")
        assert step.done and env.finish_reason == "answer"
        assert env.components["correct"] == 1.0, (answer, inst.expected)
        assert env.reward == pytest.approx(1.0 + EnvConfig().exec_ok_cap)   # a solution runs >= 1 command
    finally:
        env.close()
    assert env.workdir is None


def test_ground_truth_depends_on_the_seed():
    """Parameters come from the episode seed: different seeds, different instructions (bar uname)."""
    for task in select_tasks("seed") + select_tasks("nth_line,json_sum,md5_file"):
        if task.id == "kernel_name":
            continue
        seen = set()
        for seed in (1, 2):
            env = OpenShellEnv(task, seed)
            try:
                env.reset()
                seen.add((env.instance.instruction, env.instance.expected))
            finally:
                env.close()
        assert len(seen) == 2, task.id


def test_kernel_name_is_computed_not_hardcoded():
    import platform

    env = OpenShellEnv(get_task("kernel_name"), 0)
    try:
        env.reset()
        assert env.instance.expected == platform.system().lower()
        assert re.fullmatch(r"[a-z]+", env.instance.expected)
    finally:
        env.close()


def test_checks_cannot_be_hijacked_from_the_workspace():
    """A json.py planted by the policy must not stand in for the real module in json_write's check."""
    env = OpenShellEnv(get_task("json_write"), seed=3)
    try:
        env.reset()
        env.step("<bash>echo 'import sys; sys.exit(0)' > json.py</bash>")
        env.step(f"<answer>{env.instance.expected}</answer>")
        assert env.components["correct"] == 0.0
    finally:
        env.close()
