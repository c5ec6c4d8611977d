"""`nano-miles` (nano_miles/cli.py): bad input is one line `nano-miles <command>: ...` on stderr and
exit status 2, never a traceback, and it leaves nothing behind (no run directory, no model cache)."""
import pytest

from nano_miles import cli

UNKNOWN_MODEL = "unknown model 'no-such-model': not a folder, a hub id (org/name) or one of:"


@pytest.mark.parametrize("argv, message", [
    (["eval", "--model", "no-such-model", "--tasks", "kernel_name"], f"nano-miles eval: {UNKNOWN_MODEL}"),
    (["rollout", "--model", "no-such-model", "--tasks", "kernel_name"], f"nano-miles rollout: {UNKNOWN_MODEL}"),
    (["train", "--set", "model=no-such-model"], f"nano-miles train: {UNKNOWN_MODEL}"),
    (["tasks", "list", "--split", "bogus"],
     "nano-miles tasks: --split 'bogus': not a split (train, heldout, benchmark), seed, all, a family or a task id"),
    (["eval", "--tasks", "bogus_task"], "nano-miles eval: unknown task 'bogus_task'; known:"),
    (["train", "--set", "tasks=bogus_task"], "nano-miles train: unknown task 'bogus_task'; known:"),
    (["train", "--set", "report_to=tensorboard,mlflow"], "nano-miles train: report_to: unknown 'mlflow'"),
    (["train", "--set", "max_infra_failed_steps=0"], "nano-miles train: max_infra_failed_steps must be >= 1"),
    (["rollout", "--set", "sandbox.min_tier=none"], "nano-miles rollout: sandbox.min_tier must be one of"),
])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing_behind(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where train would put runs/<timestamp>/
    monkeypatch.setenv("NANO_MILES_CACHE", str(tmp_path / "cache"))
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message) and captured.err.count("\n") == 1, captured.err
    assert list(tmp_path.iterdir()) == []  # no stray runs/<ts>/config.json, no model built

