"""InterCode-ALFA in our sandbox: the 300 tasks from the installed icalfa package, scored by execution.

Real sandboxes throughout: each episode's set-up script runs in the episode's own mounted directories,
the gold command runs in fresh copies, and the policy's last command is compared with it by output and
by the files changed.
"""
import json
import os

import pytest

from nano_miles.tasks import alfa
from nano_miles import cli
from nano_miles.rollout.env import OpenShellEnv
from nano_miles.tasks.api import TaskUnavailable
from nano_miles.tasks.check import play_solution
from nano_miles.tasks import get_task, select_tasks, training_tasks


def gold(task_id: str) -> str:
    _, setup, index = task_id.split("_")
    return alfa.load_dataset(setup)[1][int(index)]["gold"]


def episode(task_id: str, commands: tuple[str, ...] = (), answer: str = "done", seed: int = 0) -> dict:
    """Play the commands as the policy's <bash> turns, then answer; the reward components."""
    env = OpenShellEnv(get_task(task_id), seed)
    try:
        env.reset()
        assert "Run the bash command that does this" in env.instance.instruction
        for cmd in commands:
            assert not env.step(f"<bash>{cmd}</bash>").done
        assert env.step(f"<answer>{answer}</answer>").done
        return dict(env.components)
    finally:
        env.close()


def test_the_300_tasks_load_from_the_installed_package_with_stable_ids():
    tasks = select_tasks("alfa")
    assert len(tasks) == 300
    per_setup = {s: [t for t in tasks if t.family == f"alfa/{s}"] for s in alfa.SETUPS}
    assert {s: len(ts) for s, ts in per_setup.items()} == {"fs1": 153, "fs2": 49, "fs3": 57, "fs4": 23, "fs5": 18}
    assert [t.id for t in per_setup["fs5"]] == [f"alfa_fs5_{i}" for i in range(18)]
    assert all(t.split == "benchmark" and t.workdir == "/" for t in tasks)
    assert get_task("alfa_fs2_0").mounts == ("/system",) and get_task("alfa_fs3_0").mounts == ("/workspace", "/backup")
    assert get_task("alfa_fs1_0").summary == "list files in the current directory"
    assert len(select_tasks("alfa/fs4")) == 23
    # nothing of the package is copied into the repository
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert not any("nl2bash" in name for _, _, files in os.walk(os.path.join(root, "nano_miles")) for name in files)


def test_alfa_is_never_trained_on():
    assert not any(t.id.startswith("alfa_") for t in select_tasks("all") + select_tasks("train"))
    with pytest.raises(KeyError, match="never trained on"):
        training_tasks("alfa/fs5")
    with pytest.raises(KeyError, match="never trained on"):
        training_tasks("train,alfa_fs1_4")


# one task per set-up, with output, additions, deletions, an in-place file and a uid/mtime-showing ls -l
GOLD_CASES = ["alfa_fs1_4", "alfa_fs2_5", "alfa_fs3_7", "alfa_fs4_0", "alfa_fs5_2", "alfa_fs5_6"]


@pytest.mark.parametrize("task_id", GOLD_CASES)
def test_the_gold_command_as_the_policy_scores_1_and_a_wrong_one_0(task_id):
    right = episode(task_id, [gold(task_id)])
    assert right["correct"] == 1.0, right
    assert right["alfa_score"] == 1.0 and right["alfa_output"] == 1.0 and right["alfa_files"] == 1.0
    wrong = episode(task_id, ["ls /"])
    assert wrong["correct"] == 0.0 and wrong["alfa_score"] < 1.0, wrong
    # looking around first is fine: the last command counts, whatever the answer says
    assert episode(task_id, ["ls /", "pwd", gold(task_id)], answer="42")["correct"] == 1.0
    # a policy that runs nothing and answers with the command (NL2SH style) has it run, fenced or not
    assert episode(task_id, answer=f"```bash\n{gold(task_id)}\n```")["correct"] == 1.0


def test_the_output_alone_is_not_enough_when_files_should_change():
    # alfa_fs1_4: "touch /testbed/test.txt" prints nothing; printing nothing is not creating the file
    other = episode("alfa_fs1_4", ["touch /testbed/other.txt"])
    assert other["correct"] == 0.0 and other["alfa_output"] == 1.0 and other["alfa_files"] == 0.0
    assert other["alfa_score"] < 1.0
    # the right file with the wrong content is a modification the gold did not make
    content = episode("alfa_fs1_4", ["echo x > /testbed/test.txt"])
    assert content["correct"] == 0.0 and content["alfa_files"] == 0.0
    # the right command after a stray deletion fails too: the files count in the end
    stray = episode("alfa_fs1_4", ["rm /testbed/hello.c", "touch /testbed/test.txt"])
    assert stray["correct"] == 0.0 and stray["alfa_output"] == 1.0
    # once commands ran, the answer is not run: the last command ran (an ls) is what counts
    assert episode("alfa_fs1_4", ["ls /testbed"], answer="touch /testbed/test.txt")["correct"] == 0.0
    # nothing run and "done" answered: "done" is no command that creates the file
    assert episode("alfa_fs1_4")["correct"] == 0.0


def test_tasks_whose_gold_cannot_run_here_are_unavailable_with_the_reason():
    rows = {r["id"]: r for r in map(play_solution, select_tasks("alfa_fs1_16,alfa_fs3_11,alfa_fs1_9"))}
    assert all(r["status"] == "unavailable" for r in rows.values()), rows
    assert "reads setup_nl2b_fs_1.sh, a file at the root of the benchmark's Docker image" in rows["alfa_fs1_16"]["reason"]
    assert "writes outside the task's directories (the sandbox's / is read-only)" in rows["alfa_fs3_11"]["reason"]
    assert "output differs between two fresh set-ups" in rows["alfa_fs1_9"]["reason"]   # `date`
    assert rows["alfa_fs1_9"]["reason"].startswith("icalfa: task 'alfa_fs1_9': ")


def test_a_missing_tool_is_named():
    from nano_openshell import Sandbox

    with Sandbox() as sb:
        r = sb.exec("no_such_tool_xyz --version", timeout=10)
    with pytest.raises(TaskUnavailable, match="^a tool is missing here: no_such_tool_xyz$"):
        alfa.cannot_run(r)


def test_the_fallback_tier_cannot_mount_the_set_up_directories():
    from nano_openshell import Sandbox

    row = play_solution(get_task("alfa_fs2_5"),
                        sandbox_factory=lambda **kw: Sandbox(tier="fallback", min_tier="fallback", **kw))
    assert row["status"] == "unavailable"
    assert "needs directories at fixed paths (/system)" in row["reason"] and "namespaced tier" in row["reason"]


def test_eval_gives_pass_at_k_per_set_up_and_the_three_part_score(engine_server, tiny_model_path, capsys):
    assert cli.main(["eval", "--model", str(tiny_model_path), "--engine-url", engine_server.url,
                     "--tasks", "alfa_fs5_0,alfa_fs5_2,alfa_fs4_0,alfa_fs1_16", "--samples", "2",
                     "--set", "rollout.env.max_turns=1", "--set", "rollout.max_new_tokens=8", "--json"]) == 0
    out, err = capsys.readouterr()
    assert ("rollout: 1 of 4 task(s) cannot run here and are left out of every score:\n  icalfa: task 'alfa_fs1_16': "
            "reads setup_nl2b_fs_1.sh") in err
    result = json.loads(out.strip().splitlines()[-1])
    assert set(result["per_family"]) == {"alfa/fs4", "alfa/fs5", "all"}
    assert result["per_family"]["all"]["tasks"] == 3                 # the unavailable one is not in the denominator
    three = result["alfa_three_part"]
    assert three["episodes"] == 6 and 0 <= three["answered"] <= 6 and 0.0 <= three["score"] <= 1.0


def test_a_stale_reference_is_computed_again():
    """Golds compare file times with the clock: an old reference (and its pinned time) is not reused."""
    import dataclasses

    episode("alfa_fs5_4", [gold("alfa_fs5_4")])
    key = ("alfa_fs5_4", "namespaced")
    old = alfa._references[key]
    alfa._references[key] = dataclasses.replace(old, pinned=old.pinned - alfa.REFERENCE_TTL_S - 1)
    assert episode("alfa_fs5_4", [gold("alfa_fs5_4")])["correct"] == 1.0
    assert alfa._references[key].pinned >= old.pinned
