"""`nano-miles` (nano_miles/cli.py): bad input is one line `nano-miles <command>: ...` on stderr and
exit status 2, never a traceback, and it leaves nothing behind (no run directory, no model cache).
SIGTERM stops a command as Ctrl-C does: its sandboxes' workspaces are removed, a run checkpoints."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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
    (["eval", "--samples"], "nano-miles eval: argument --samples: expected one argument"),
    (["nope"], "nano-miles: argument COMMAND: invalid choice: 'nope'"),
])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing_behind(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where train would put runs/<timestamp>/
    monkeypatch.setenv("NANO_MILES_CACHE", str(tmp_path / "cache"))
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message) and captured.err.count("\n") == 1, captured.err
    assert list(tmp_path.iterdir()) == []  # no stray runs/<ts>/config.json, no model built


def test_an_old_key_name_is_refused_in_one_line_naming_the_new_one(capsys, tmp_path):
    """run.toml files, --set lines and the config.json of earlier runs may use the keys train had before
    the trainer and the engine got sections of their own: each is refused (exit 2) with one line naming
    the new key, never mapped silently."""
    old_run = tmp_path / "old-run"
    old_run.mkdir()
    (old_run / "config.json").write_text(json.dumps({"model": "tiny-random-qwen2", "logprob_chunk": 64,
                                                     "rollout": {"group_size": 4}}))
    (tmp_path / "run.toml").write_text("engine_mem_fraction = 0.3\n")
    for argv, old, new in ((["--set", "engine_url=http://h:1"], "engine_url", "engine.url"),
                           (["--config", str(tmp_path / "run.toml")], "engine_mem_fraction",
                            "engine.kv_cache_memory_fraction"),
                           (["--resume", str(old_run)], "logprob_chunk", "trainer.logprob_chunk")):
        assert cli.main(["train", *argv]) == 2
        assert capsys.readouterr().err == f"nano-miles train: config key {old!r} is now {new!r}\n"


def test_cuda_memory_is_allocated_in_expandable_segments_unless_the_user_chose(monkeypatch, capsys):
    """Every command (and the ranks and engines it starts, which inherit the environment) runs the CUDA
    caching allocator with expandable segments: the default holds far more than it allocates
    (docs/benchmarks.md)."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "to be restored")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    assert cli.main(["tasks", "list", "--split", "seed"]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    assert cli.main(["tasks", "list", "--split", "seed"]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    assert "kernel_name" in capsys.readouterr().out


def _start(argv: list[str], tmp: Path, cwd: Path) -> subprocess.Popen:
    """`nano-miles ARGV` in a process of its own, its temporary files (sandbox workspaces) under tmp."""
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    return subprocess.Popen([sys.executable, "-m", "nano_miles.cli", *argv], cwd=cwd, env=env, text=True,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _until(condition, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


@pytest.fixture
def private_tmp():
    path = Path(tempfile.mkdtemp(prefix="sigterm-", dir="/tmp"))
    path.chmod(0o755)  # the sandboxes' uids traverse it to their workspaces
    yield path
    subprocess.run(["rm", "-rf", str(path)])


def _workspaces(tmp: Path) -> list:
    return list(tmp.glob("nano-openshell-ws-*"))


def test_sigterm_during_an_eval_removes_every_workspace_and_ends_with_one_line(tiny_model_path, private_tmp):
    proc = _start(["eval", "--model", "tiny-random-qwen2", "--tasks", "train", "--samples", "4"], private_tmp,
                  private_tmp)
    assert _until(lambda: len(_workspaces(private_tmp)) >= 8, 120), proc.communicate(timeout=60)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.rstrip().endswith("nano-miles eval: interrupted"), err[-2000:]
    assert "Traceback" not in err and _workspaces(private_tmp) == []


def test_sigterm_during_training_checkpoints_and_removes_every_workspace(tiny_model_path, private_tmp):
    run_dir = private_tmp / "run"
    proc = _start(["train", "--set", "model=tiny-random-qwen2", "--set", "steps=200", "--set", "tasks_per_step=2",
                   "--set", "rollout.group_size=2", "--set", "rollout.max_new_tokens=16", "--set", "report_to=none",
                   "--set", f"run_dir={run_dir}"], private_tmp, private_tmp)
    metrics = run_dir / "metrics.jsonl"
    assert _until(lambda: metrics.exists() and metrics.read_text().count("\n") >= 1, 240), proc.communicate(timeout=60)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, err[-2000:]
    state = json.loads((run_dir / "checkpoint" / "state.json").read_text())
    assert state["step"] >= 1 and f"interrupted after step {state['step']}: resume with --resume {run_dir}" in out
    assert "Traceback" not in err and _workspaces(private_tmp) == []
