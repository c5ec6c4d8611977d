"""`nano-miles rollout` and `eval` take the same config keys as `train` (docs/config.md): their few
flags are shorthands of keys, `--config` / `--set` set any key, `--print-config` shows the result,
and a flag they do not have says in one line how to set its key. Before either loads a model, the
sandbox must reach `sandbox.min_tier`; while they run, a progress bar."""
import os
import re
import subprocess
import sys
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest

from nano_miles import cli
from nano_miles.evaluate import EvalConfig
from nano_miles.job import RolloutCommandConfig
from nano_miles.rollout.dynamic_sampling import TrainRolloutConfig
from nano_miles.rollout.episode import RolloutConfig
from nano_miles.train import TrainConfig

REPO = Path(__file__).resolve().parents[2]


def _printed_config(capsys, argv) -> dict:
    assert cli.main([*argv, "--print-config"]) == 0
    return tomllib.loads(capsys.readouterr().out)


def test_flags_set_the_same_keys_as_set(capsys, tmp_path):
    by_flags = _printed_config(capsys, [
        "rollout", "--model", "tiny-random-qwen2", "--tasks", "kernel_name", "--group-size", "3", "--max-turns", "2",
        "--engine-url", "http://a:1", "--engine-url", "http://b:2", "--tasks-module", "a.py", "--tasks-module", "b"])
    path = tmp_path / "rollout.toml"
    path.write_text('model = "tiny-random-qwen2"\ntasks = "kernel_name"\ntasks_module = ["a.py", "b"]\n'
                    '[engine]\nurl = "http://a:1,http://b:2"\n[rollout]\ngroup_size = 3\n[rollout.env]\nmax_turns = 2\n')
    assert _printed_config(capsys, ["rollout", "--config", str(path)]) == by_flags
    by_set = _printed_config(capsys, ["rollout", *(a for kv in (
        "model=tiny-random-qwen2", "tasks=kernel_name", "rollout.group_size=3", "rollout.env.max_turns=2",
        "engine.url=http://a:1,http://b:2", "tasks_module=a.py,b") for a in ("--set", kv))])
    assert by_set == by_flags
    assert _printed_config(capsys, ["eval", "--model", "m", "--tasks", "seed", "--samples", "8"]) == \
        _printed_config(capsys, ["eval", "--set", "model=m", "--set", "tasks=seed", "--set", "rollout.group_size=8"])


@pytest.mark.parametrize("argv, message", [
    (["rollout", "--max-new-tokens", "16"],
     "--max-new-tokens is not a flag of rollout: use --set rollout.max_new_tokens=16"),
    (["rollout", "--temperature=0.5"], "--temperature is not a flag of rollout: use --set rollout.temperature=0.5"),
    (["rollout", "--seed", "7"], "--seed is not a flag of rollout: use --set seed=7"),
    (["rollout", "--device", "cpu"], "--device is not a flag of rollout: use --set engine.device=cpu"),
    (["eval", "--instances", "8"], "--instances is not a flag of eval: use --set instances=8"),
    (["eval", "--max-turns", "1"], "--max-turns is not a flag of eval: use --set rollout.env.max_turns=1"),
    (["train", "--steps", "5"], "--steps is not a flag of train: use --set steps=5"),
    (["rollout", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
])
def test_a_flag_a_command_does_not_have_names_the_set_form_of_its_key(capsys, argv, message):
    assert cli.main(argv) == 2
    assert capsys.readouterr().err == f"nano-miles {argv[0]}: {message}\n"


def test_one_default_per_key_across_commands(capsys):
    rollout, evaluate, train = (_printed_config(capsys, [c]) for c in ("rollout", "eval", "train"))
    assert (rollout["tasks"], evaluate["tasks"], train["tasks"]) == ("seed", "heldout", "train")
    assert rollout["engine"] == evaluate["engine"] == train["engine"]
    # train's rollout.* is every command's rollout.* plus its own task-sampling keys, nothing renamed
    train_only = {f.name for f in fields(TrainRolloutConfig)} - {f.name for f in fields(RolloutConfig)}
    assert train_only == {"dynamic_sampling", "max_sampling_rounds", "oversample", "pass_over_saturated", "guide_unsolved",
                          "carry_over"}
    assert rollout["rollout"] == evaluate["rollout"] == {k: v for k, v in train["rollout"].items() if k not in train_only}
    assert train["rollout"]["group_size"] == 4 and train["rollout"]["env"]["max_turns"] == 6
    # eval's --samples is the group size; set it and the TOML says so.
    assert _printed_config(capsys, ["eval", "--samples", "8"])["rollout"]["group_size"] == 8
    assert issubclass(EvalConfig, RolloutCommandConfig) and issubclass(TrainConfig, RolloutCommandConfig)


@pytest.mark.parametrize("argv, message", [
    (["rollout", "--group-size", "0"], "group_size must be >= 1, got 0"),
    (["eval", "--samples", "two"], "rollout.group_size: expected an integer, got 'two'"),
    (["rollout", "--max-turns", "0"], "max_turns must be >= 1"),
    (["eval", "--set", "dtype=fp8"], "dtype must be one of"),
    (["rollout", "--set", "rollout.group_sise=2"], "did you mean 'rollout.group_size'?"),
])
def test_bad_values_are_one_line_and_exit_2(capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def _under_denied_namespaces(argv, env) -> subprocess.CompletedProcess:
    """`nano-miles ARGV` in a process whose namespaces a seccomp filter denies (a rootless container)."""
    return subprocess.run([sys.executable, "-c", "import sys; from nano_openshell.seccomp import main; sys.exit(main())",
                           "--deny-namespaces", "--", sys.executable, "-m", "nano_miles.cli", *argv],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("command", ["rollout", "eval"])
def test_a_sandbox_below_min_tier_is_refused_before_the_model_loads(command, tmp_path):
    cache = tmp_path / "model-cache"
    proc = _under_denied_namespaces([command, "--model", "tiny-random-qwen2", "--tasks", "kernel_name"],
                                    dict(os.environ, NANO_MILES_CACHE=str(cache)))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"nano-miles {command}: every episode would fail: the sandbox cannot reach "
                                  "sandbox.min_tier=namespaced here")
    assert "--set sandbox.min_tier=fallback" in proc.stderr
    assert not cache.exists() and proc.stdout == ""  # no model built, no engine started


def test_rollout_on_the_fallback_tier_when_asked_with_a_progress_bar(tmp_path, tiny_model_path):
    """The fix the refusal names works: the same machine, sandbox.min_tier=fallback, real episodes.
    Progress (episodes done, ETA) goes to stderr while they run."""
    out = tmp_path / "r.jsonl"
    proc = _under_denied_namespaces(["rollout", "--model", str(tiny_model_path), "--tasks", "kernel_name,md5_file",
                                     "--group-size", "2", "--max-turns", "1", "--set", "rollout.max_new_tokens=8",
                                     "--set", "sandbox.min_tier=fallback", "--out", str(out)], dict(os.environ))
    assert proc.returncode == 0, proc.stderr
    assert "2 tasks x 2 samples = 4 episodes" in proc.stdout and "infra failures 0" in proc.stdout
    assert len(out.read_text().splitlines()) == 4
    assert re.search(r"rollout: +\d+%\|.*\| \d/4 \[", proc.stderr), proc.stderr  # episodes done of 4, time left
