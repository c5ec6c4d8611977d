"""bench/episodes.py: a trajectories JSONL read back as text -- how the episodes ended, pass@1 by
task, and the episodes decoded with the model's own tokenizer. Run as a user runs it."""
import json
import os
import subprocess
import sys
from pathlib import Path

from nano_miles.rollout.batch import Trajectory

REPO = Path(__file__).resolve().parents[2]


def run(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(REPO / "bench" / "episodes.py"), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=120)


def episode(tokenizer, task, text, turns, exec_ok, correct):
    ids = tokenizer.encode(text)
    return Trajectory([1, 2], ids, [0.0] * len(ids), [True] * len(ids), reward=correct + exec_ok,
                      reward_components={"correct": correct, "exec_ok": exec_ok}, num_turns=turns,
                      finish_reason="answer", task_id=task, group_id=task)


def test_it_counts_how_episodes_ended_and_decodes_them(tmp_path, tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model_path))
    padded = "<bash>uname -s</bash> ... <bash>echo done; exit 0</bash> ... <answer>linux</answer>"
    episodes = [episode(tok, "kernel_name", padded, 3, 0.2, 1.0),
                episode(tok, "kernel_name", "<bash>uname</bash> <answer>linux</answer>", 2, 0.1, 1.0),
                episode(tok, "md5_file", "<answer>0</answer>", 1, 0.0, 0.0)]
    path = tmp_path / "trajectories.jsonl"
    path.write_text("".join(t.to_json() + "\n" for t in episodes))
    out = run(path, "--model", tiny_model_path, "--per-task", 1)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "3 episodes; (turns, exec_ok, correct): count"
    assert "  (3, 0.2, 1.0): 1" in lines and "  (1, 0.0, 0.0): 1" in lines
    assert any(line.startswith("  kernel_name") and "1.000  (2 episodes)" in line for line in lines)
    assert any(line.startswith("  md5_file") and "0.000  (1 episodes)" in line for line in lines)
    # one episode a task, decoded to the text the policy wrote
    assert out.stdout.count("===== kernel_name") == 1 and "echo done; exit 0" in out.stdout
    only = run(path, "--model", tiny_model_path, "--task", "md5_file")
    assert "===== md5_file" in only.stdout and "===== kernel_name" not in only.stdout


def test_a_file_that_is_not_trajectories_is_one_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    for path in (bad, tmp_path / "missing.jsonl"):
        out = run(path, "--per-task", 0)
        assert out.returncode == 2 and out.stdout == ""
        assert len(out.stderr.strip().splitlines()) == 1 and out.stderr.startswith(f"episodes: cannot read {path}")
