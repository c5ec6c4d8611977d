"""Tasks from outside the package: a user's Python module, a module by dotted name, a TOML task file.

They register through the same public API as the built-in catalog and run through the same
environment in a real sandbox. Bad input (a module that does not import, a duplicate id, a malformed
task file, a setup command that fails) gives one line naming the file and the task; the rest loads.
A module or file that cannot be loaded at all stops every command that takes it (exit 2, one line).
"""
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from nano_miles import cli
from nano_miles import tasks
from nano_miles.config import ConfigError
from nano_miles.rollout.env import OpenShellEnv
from nano_miles.tasks.api import TASKS, SetupError
from nano_miles.tasks.check import play_solution
from nano_miles.tasks import load_task_modules, select_tasks, training_tasks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
EXAMPLE_PY = os.path.join(ROOT, "examples", "my_tasks.py")
EXAMPLE_TOML = os.path.join(ROOT, "examples", "tasks.toml")


@pytest.fixture(autouse=True)
def registry():
    """Each test starts from the built-in tasks and leaves the registry as it found it."""
    saved, loaded = dict(TASKS), dict(tasks._LOADED)
    yield
    TASKS.clear()
    TASKS.update(saved)
    tasks._LOADED.clear()
    tasks._LOADED.update(loaded)


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return str(path)


def play(task, answer=None, seed=7):
    """The task's scripted solution through the env; `answer` replaces the one read back."""
    if answer is None:
        return play_solution(task, seed)
    env = OpenShellEnv(task, seed)
    try:
        env.reset()
        for cmd in env.instance.solution:
            env.step(f"<bash>{cmd}</bash>")
        env.step(f"<answer>{answer}</answer>")
        return env.components["correct"]
    finally:
        env.close()


def test_the_example_module_registers_and_its_tasks_are_solved_in_a_real_sandbox():
    assert load_task_modules([EXAMPLE_PY]) == []
    logs = select_tasks("logs")
    assert {t.id for t in logs} == {"log_errors", "log_busiest_worker", "log_rotate", "app_config_port"}
    assert {t.split for t in logs} == {"train", "heldout"} and all(t.source == EXAMPLE_PY for t in logs)
    for t in logs:
        row = play(t)
        assert row["status"] == "solved", row
        assert play(t, answer="12345678") == 0.0          # a wrong answer scores nothing
    # log_rotate's check holds the workspace state to account: the right number alone is not enough
    env = OpenShellEnv(tasks.get_task("log_rotate"), 7)
    try:
        env.reset()
        env.step(f"<answer>{env.instance.expected}</answer>")
        assert env.components["correct"] == 0.0
    finally:
        env.close()
    assert load_task_modules([EXAMPLE_PY]) == []          # loading it again is a no-op, not a duplicate
    assert len(select_tasks("logs")) == 4


def test_the_example_task_file_registers_and_its_tasks_are_solved():
    assert load_task_modules([EXAMPLE_TOML]) == []
    inventory = select_tasks("inventory")
    assert [t.id for t in inventory] == ["inventory_total", "inventory_rename"]
    for t in inventory:
        assert play(t)["status"] == "solved"
        assert play(t, answer="0") == 0.0
    # parameters come from the episode's seed: other seeds, other files and other answers
    seen = set()
    for seed in (1, 2, 3):
        env = OpenShellEnv(tasks.get_task("inventory_total"), seed)
        try:
            env.reset()
            seen.add((env.instance.instruction, env.instance.expected))
        finally:
            env.close()
    assert len(seen) == 3


def test_a_module_by_dotted_name(tmp_path, monkeypatch):
    pkg = tmp_path / "acme_tasks"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    write(pkg, "shell.py", """
        from nano_miles.tasks import TaskInstance, task

        @task("acme_echo", family="acme", split="train", summary="echo a seeded number")
        def acme_echo(ws, rng):
            n = rng.randint(10, 99)
            return TaskInstance(f"Print {n} with echo and answer with it.", ws.run(f"echo {n}"), "int",
                                solution=[f"echo {n}"])
    """)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_task_modules(["acme_tasks.shell"]) == []
    assert tasks.get_task("acme_echo").source == "acme_tasks.shell"
    assert play(tasks.get_task("acme_echo"))["status"] == "solved"
    with pytest.raises(ConfigError, match=r"^acme_tasks.nope: cannot load: ModuleNotFoundError: "
                                          r"No module named 'acme_tasks.nope'$"):
        load_task_modules(["acme_tasks.nope"])


def test_the_skills_set_under_its_old_flat_name_says_its_new_name():
    with pytest.raises(ConfigError, match=r"^nano_miles.task_catalog_skills is now nano_miles.tasks.catalog_skills$"):
        load_task_modules(["nano_miles.task_catalog_skills"])


def broken_modules(tmp_path) -> dict[str, str]:
    """Each way a task module fails to load -> the one line that names it."""
    raises = write(tmp_path, "raises.py", """
        from nano_miles.tasks import TaskInstance, task

        @task("broken_first", family="broken", split="train", summary="registered before the error")
        def first(ws, rng):
            return TaskInstance("x", ws.run("echo 1"))

        raise RuntimeError("the config server is down\\nsecond line")
    """)
    syntax = write(tmp_path, "syntax.py", "def oops(:\n")
    needs = write(tmp_path, "needs.py", "import nonexistent_dependency_xyz\n")
    exits = write(tmp_path, "exits.py", "raise SystemExit(0)\n")  # would end the command with status 0
    missing = str(tmp_path / "missing.py")
    return {raises: f"{raises}: cannot load: RuntimeError: the config server is down",
            syntax: f"{syntax}: cannot load: SyntaxError: invalid syntax (line 1)",
            needs: f"{needs}: cannot load: ModuleNotFoundError: No module named 'nonexistent_dependency_xyz'",
            exits: f"{exits}: cannot load: SystemExit: 0",
            missing: f"{missing}: no such file"}


def test_a_module_that_cannot_be_loaded_is_an_error_naming_it_and_registers_nothing(tmp_path):
    for spec, line in broken_modules(tmp_path).items():
        with pytest.raises(ConfigError) as refused:
            load_task_modules([EXAMPLE_TOML, spec])
        assert str(refused.value) == line
    assert "broken_first" not in TASKS                     # a half-imported module leaves nothing behind


def test_every_command_that_takes_task_modules_stops_on_one_that_cannot_load(tmp_path, capsys):
    """A script must be able to tell: exit 2 and one line naming the file, before anything runs (no
    engine, no --out, no run directory), for each way a module fails and each command that takes one."""
    out, run_dir = tmp_path / "out.jsonl", tmp_path / "run"
    for spec, line in broken_modules(tmp_path).items():
        command_lines = {"tasks": [["tasks", "list", "--tasks-module", spec],
                                   ["tasks", "check", "--tasks-module", spec, "--tasks", "inventory"]],
                         "rollout": [["rollout", "--tasks-module", spec, "--out", str(out)]],
                         "eval": [["eval", "--tasks-module", spec, "--out", str(out)]],
                         "train": [["train", "--set", f'tasks_module=["{spec}"]', "--set", f"run_dir={run_dir}"]]}
        for command, argvs in command_lines.items():
            for argv in argvs:
                assert cli.main(argv) == 2, argv
                captured = capsys.readouterr()
                assert (captured.out, captured.err) == ("", f"nano-miles {command}: {line}\n"), argv
    assert not out.exists() and not run_dir.exists() and "broken_first" not in TASKS


def test_a_module_that_cannot_load_is_exit_2_from_the_command_line(tmp_path):
    """The same through real processes (train's is in test_train.py): no traceback, one line."""
    bad = broken_modules(tmp_path)
    syntax, needs, missing = (str(tmp_path / name) for name in ("syntax.py", "needs.py", "missing.py"))
    cases = ((["tasks", "list", "--tasks-module", syntax], f"nano-miles tasks: {bad[syntax]}\n"),
             (["rollout", "--tasks-module", needs], f"nano-miles rollout: {bad[needs]}\n"),
             (["eval", "--tasks-module", missing], f"nano-miles eval: {bad[missing]}\n"))
    # all at once: each spends its seconds importing torch, not waiting on the others
    procs = [subprocess.Popen([sys.executable, "-m", "nano_miles.cli", *argv], cwd=ROOT, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for argv, _ in cases]
    for (argv, err), proc in zip(cases, procs):
        assert proc.communicate(timeout=120) == ("", err) and proc.returncode == 2, argv


def test_duplicate_ids_name_the_file_and_the_task_and_the_rest_loads(tmp_path):
    dup = write(tmp_path, "dup.py", """
        from nano_miles.tasks import TaskInstance, task

        @task("sha256_string", family="mine", split="train", summary="clashes with the catalog")
        def mine(ws, rng):
            return TaskInstance("x", ws.run("echo 1"))

        @task("mine_ok", family="mine", split="train", summary="fine")
        def ok(ws, rng):
            return TaskInstance("Answer 1.", ws.run("echo 1"), "int", solution=["echo 1"])
    """)
    assert load_task_modules([dup]) == [
        f"{dup}: task 'sha256_string': duplicate id (already defined by nano_miles.tasks.catalog.hashing)"]
    assert TASKS["sha256_string"].source == "nano_miles.tasks.catalog.hashing"   # the catalog's task is untouched
    assert [t.id for t in select_tasks("mine")] == ["mine_ok"]
    copy = write(tmp_path, "copy.toml", open(EXAMPLE_TOML).read())
    assert load_task_modules([EXAMPLE_TOML, copy]) == [
        f"{copy}: task 'inventory_total': duplicate id (already defined by {EXAMPLE_TOML})",
        f"{copy}: task 'inventory_rename': duplicate id (already defined by {EXAMPLE_TOML})"]


def test_malformed_task_files(tmp_path):
    good = """
        [[task]]
        id = "fine_task"
        family = "fine"
        split = "train"
        instruction = "Answer with {n}."
        answer = "echo {n}"
        kind = "int"
        [task.params]
        n = { int = [1, 9] }
    """
    not_toml = write(tmp_path, "not.toml", "[[task]\nid = ")
    empty = write(tmp_path, "empty.toml", "title = 'no tasks here'\n")
    bad = write(tmp_path, "bad.toml", good + """
        [[task]]
        id = "typed_answer"
        family = "f"
        split = "train"
        instruction = "What is 2 + 2?"
        answer = "echo 4"
        expected = "4"

        [[task]]
        id = "no_answer"
        family = "f"
        split = "train"
        instruction = "x"

        [[task]]
        id = "bad_split"
        family = "f"
        split = "test"
        instruction = "x"
        answer = "echo 1"

        [[task]]
        id = "bad_kind"
        family = "f"
        split = "train"
        instruction = "x"
        answer = "echo 1"
        kind = "float"

        [[task]]
        id = "undeclared"
        family = "f"
        split = "train"
        instruction = "How many {things}?"
        answer = "echo 1"

        [[task]]
        id = "bad_param"
        family = "f"
        split = "train"
        instruction = "{n}"
        answer = "echo {n}"
        [task.params]
        n = { int = [9, 1] }

        [[task]]
        id = "check_without_solution"
        family = "f"
        split = "train"
        instruction = "x"
        answer = "echo 1"
        check = "true"

        [[task]]
        id = "typo_key"
        family = "f"
        split = "train"
        instruction = "x"
        answer = "echo 1"
        setpu = ["true"]
    """)
    with pytest.raises(ConfigError, match="^" + re.escape(f"{not_toml}: cannot load: ValueError: not valid TOML: ")):
        load_task_modules([not_toml])
    with pytest.raises(ConfigError) as refused:
        load_task_modules([empty])
    assert str(refused.value) == f"{empty}: cannot load: ValueError: a task file holds [[task]] tables and " \
                                 "nothing else (unknown top-level keys: title)"
    errors = load_task_modules([bad])
    assert errors == [
        f"{bad}: task 'typed_answer': the expected answer is computed by the `answer` command, never typed in",
        f"{bad}: task 'no_answer': missing key(s): answer",
        f"{bad}: task 'bad_split': split must be one of train, heldout, benchmark, not 'test'",
        f"{bad}: task 'bad_kind': kind must be one of text, int, lower, hex, not 'float'",
        f"{bad}: task 'undeclared': the instruction names undeclared parameter(s): things",
        f"{bad}: task 'bad_param': param n: int wants [lo, hi], two integers with lo <= hi",
        f"{bad}: task 'check_without_solution': a task with a check needs a solution (the commands that make "
        "the check pass)",
        f"{bad}: task 'typo_key': unknown key(s) setpu (known: id, family, split, instruction, answer, summary, "
        "params, setup, kind, check, solution, mounts, workdir)"]
    assert all("\n" not in e for e in errors)
    assert [t.id for t in select_tasks("fine")] == ["fine_task"]   # the valid task of bad.toml loaded
    assert play(TASKS["fine_task"])["status"] == "solved"


def test_a_failing_setup_command_names_the_file_and_the_task(tmp_path):
    path = write(tmp_path, "setup.toml", """
        [[task]]
        id = "needs_a_missing_file"
        family = "fragile"
        split = "train"
        instruction = "How many lines?"
        setup = ["cat /nonexistent/input.txt > copy.txt"]
        answer = "wc -l < copy.txt"

        [[task]]
        id = "prints_nothing"
        family = "fragile"
        split = "train"
        instruction = "What does it print?"
        answer = "true"

        [[task]]
        id = "sturdy"
        family = "fragile"
        split = "train"
        instruction = "Answer 3."
        answer = "echo 3"
    """)
    assert load_task_modules([path]) == []
    env = OpenShellEnv(TASKS["needs_a_missing_file"], 0)
    with pytest.raises(SetupError) as e:
        env.reset()
    line = str(e.value)
    assert line.startswith(f"{path}: task 'needs_a_missing_file': setup command failed (exit 1): 'cat /nonexistent")
    assert "No such file or directory" in line and "\n" not in line
    assert env.sandbox is None                              # the episode's sandbox is gone with it
    row = play(TASKS["prints_nothing"])
    assert row["status"] == "failed" and "the answer command printed nothing" in row["reason"], row
    assert play(TASKS["sturdy"])["status"] == "solved"     # its neighbours are not affected


def test_tasks_cli_reports_bad_input_in_one_line_each_and_lists_the_rest(tmp_path, capsys):
    half = write(tmp_path, "half.toml", "[[task]]\nid = 'half'\n")
    assert cli.main(["tasks", "list", "--json", "--tasks-module", half, "--tasks-module", EXAMPLE_PY,
                     "--tasks-module", EXAMPLE_TOML, "--split", "logs,inventory"]) == 0
    out, err = capsys.readouterr()
    assert err == f"nano-miles tasks: {half}: task 'half': missing key(s): family, split, instruction, answer\n"
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["id"] for r in rows] == ["log_errors", "log_busiest_worker", "log_rotate", "app_config_port",
                                       "inventory_total", "inventory_rename"]
    assert rows[3]["mounts"] == ["/srv/app"]
    assert cli.main(["tasks", "check", "--tasks-module", EXAMPLE_TOML, "--tasks", "inventory", "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "2 tasks: 2 solved by their scripted solution, 0 cannot run here (left out), 0 FAILED" in out


def test_selections_and_the_training_guard(tmp_path):
    bench = write(tmp_path, "bench.toml", """
        [[task]]
        id = "my_bench_task"
        family = "mybench"
        split = "benchmark"
        instruction = "Answer 1."
        answer = "echo 1"
    """)
    assert load_task_modules([bench, EXAMPLE_TOML]) == []
    assert [t.id for t in select_tasks("inventory_total,mybench")] == ["inventory_total", "my_bench_task"]
    assert "my_bench_task" not in {t.id for t in select_tasks("all")}      # benchmarks are chosen by name
    bench_split = select_tasks("benchmark")  # (ALFA too, when an earlier test loaded it)
    assert "my_bench_task" in {t.id for t in bench_split} and {t.split for t in bench_split} == {"benchmark"}
    assert {t.id for t in training_tasks("inventory")} == {"inventory_total", "inventory_rename"}
    with pytest.raises(KeyError, match="never trained on"):
        training_tasks("inventory,mybench")
    with pytest.raises(KeyError, match="unknown task 'nope'"):
        select_tasks("train,nope")


def test_rollout_and_eval_take_tasks_modules(engine_server, tiny_model_path, tmp_path, capsys):
    """--tasks-module on rollout and eval: the user's tasks run against a real engine; a broken module
    is one line on stderr and the run goes on with the rest."""
    broken = write(tmp_path, "broken.toml", "[[task]]\nid = 'half'\n")
    out = tmp_path / "r.jsonl"
    common = ["--model", str(tiny_model_path), "--engine-url", engine_server.url, "--set", "rollout.env.max_turns=1",
              "--set", "rollout.max_new_tokens=8", "--tasks-module", EXAMPLE_PY, "--tasks-module", broken]
    assert cli.main(["rollout", *common, "--tasks-module", EXAMPLE_TOML, "--tasks", "log_errors,inventory_total",
                     "--group-size", "2", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    # one line; the progress bar after it redraws in place (\r), it adds no line
    assert captured.err.count("\n") == 1 and captured.err.splitlines()[0] == \
        f"nano-miles rollout: {broken}: task 'half': missing key(s): family, split, instruction, answer"
    ids = [json.loads(line)["task_id"] for line in out.read_text().splitlines()]
    assert sorted(ids) == ["inventory_total", "inventory_total", "log_errors", "log_errors"]
    assert cli.main(["eval", *common, "--tasks", "logs", "--samples", "2"]) == 0
    captured = capsys.readouterr()
    assert "logs" in captured.out and "pass@2" in captured.out and captured.err.count("\n") == 1


def test_train_refuses_benchmark_tasks_before_starting_anything(tmp_path, capsys):
    bench = write(tmp_path, "bench.toml", """
        [[task]]
        id = "my_bench_task"
        family = "mybench"
        split = "benchmark"
        instruction = "Answer 1."
        answer = "echo 1"
    """)
    run_dir = tmp_path / "run"
    assert cli.main(["train", "--set", f'tasks_module=["{bench}"]', "--set", "tasks=mybench",
                     "--set", "model=tiny-random-qwen2", "--set", f"run_dir={run_dir}"]) == 2
    err = capsys.readouterr().err
    assert err == ("nano-miles train: 1 benchmark task(s) selected for training (my_bench_task): benchmark tasks "
                   "are evaluated, never trained on\n")
    assert not run_dir.exists()


def test_fixed_paths_in_the_fallback_tier_are_skipped_with_the_reason(tmp_path):
    """The fallback tier has no mount namespace: a task that needs /testbed cannot run there, and says so."""
    from nano_openshell import Sandbox

    path = write(tmp_path, "mounts.toml", """
        [[task]]
        id = "testbed_files"
        family = "fixed"
        split = "train"
        instruction = "How many files are in /testbed?"
        mounts = ["/testbed"]
        setup = ["touch /testbed/a /testbed/b"]
        answer = "ls /testbed | wc -l"
        kind = "int"
    """)
    assert load_task_modules([path]) == []
    row = play_solution(TASKS["testbed_files"], sandbox_factory=lambda **kw: Sandbox(tier="fallback",
                                                                                      min_tier="fallback", **kw))
    assert row["status"] == "unavailable", row
    assert row["reason"].startswith(f"{path}: task 'testbed_files': needs directories at fixed paths (/testbed)")


def test_fixed_paths_are_fresh_per_episode_and_gone_with_it():
    """app_config_port's /srv/app: prepared by its setup, private to the episode, removed at close."""
    assert load_task_modules([EXAMPLE_PY]) == []
    first, second = OpenShellEnv(TASKS["app_config_port"], 1), OpenShellEnv(TASKS["app_config_port"], 2)
    try:
        first.reset()
        second.reset()
        host_dir = first.sandbox.path_of("/srv/app")
        assert first.step("<bash>pwd; echo mine > /srv/app/left_behind</bash>").observation.startswith("/srv/app\n")
        assert "left_behind" not in second.step("<bash>ls /srv/app</bash>").observation
        with pytest.raises(ValueError, match="inside the workspace or the task's mounts"):
            tasks.Workspace(first.sandbox, first.workdir).write("/etc/passwd", "x")
    finally:
        first.close()
        second.close()
    assert not os.path.exists(host_dir)
