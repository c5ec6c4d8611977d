"""bench/side_by_side.py: an arm's row from what `side_by_side.sh watch` brought back. Run as a user runs it."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(REPO / "bench" / "side_by_side.py"), *map(str, args), "--dry-run"],
                          env=env, capture_output=True, text=True, timeout=120)


def arm(directory: Path, name: str, step_seconds: list[float], families: dict | None) -> None:
    """ARM_metrics.jsonl (a step 0 evaluation row, then step rows) and, if given, ARM_evals.jsonl."""
    rows, elapsed = [{"step": 0, "eval_pass_at_1": 0.1}], 10.0
    for step, seconds in enumerate(step_seconds, 1):
        elapsed += seconds
        rows.append({"step": step, "step_s": seconds, "elapsed_s": elapsed, "rollout_s": seconds - 0.5,
                     "sync_ms": 20.0 + step, "parity_mean": 0.004 if step % 2 else None, "acc": step / 10})
    (directory / f"{name}_metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if families is not None:
        record = {"kind": "eval", "tasks": "heldout", "samples": 4, "instances": 8, "temperature": 0.7, "seed": 0,
                  "per_family": families}
        (directory / f"{name}_evals.jsonl").write_text(json.dumps(record) + "\n")


def test_each_arm_gets_steps_an_hour_its_medians_and_its_task_weighted_pass_at_1(tmp_path):
    arm(tmp_path, "old", [4.0, 6.0, 8.0, 10.0], {"text": {"tasks": 3, "pass@1": 0.5}, "json": {"tasks": 1, "pass@1": 0.1}})
    arm(tmp_path, "carry", [1.0, 2.0, 3.0, 2.0], None)   # its evaluation never came back
    out = run(tmp_path, "--arm", "old=f4cd568", "--arm", "carry=abc1234", "--device", "one H100",
              "--extra", "carry=rollout.carry_over=true max_staleness=3")
    assert out.returncode == 0, out.stderr
    old, carry = (json.loads(line) for line in out.stdout.splitlines())
    assert (old["arm"], old["commit"], old["machine"], old["extra"]) == ("old", "f4cd568", "one H100", "")
    assert carry["extra"] == "rollout.carry_over=true max_staleness=3"
    assert old["steps"] == 4 and old["step_s_median"] == 7.0 and old["step_s_p90"] == 10.0
    assert old["steps_per_hour"] == 514.3   # 4 steps in 28 s of steps
    assert abs(old["steps_per_hour_wall"] - 3600 * 4 / 38) < 0.1   # the wall clock counts the 10 s start
    assert old["sync_ms_median"] == 22.5 and old["parity_mean"] == 0.004
    assert old["heldout_pass_at_1"] == 0.4   # (3 x 0.5 + 1 x 0.1) / 4 tasks
    assert old["heldout_protocol"] == {"samples": 4, "instances": 8, "temperature": 0.7, "seed": 0}
    assert carry["heldout_pass_at_1"] is None and carry["steps_per_hour"] == 1800.0


def test_an_arm_without_step_rows_is_one_line(tmp_path):
    (tmp_path / "old_metrics.jsonl").write_text(json.dumps({"step": 0, "eval_pass_at_1": 0.1}) + "\n")
    out = run(tmp_path, "--arm", "old=f4cd568", "--device", "cpu")
    assert out.returncode != 0
    assert out.stderr.strip() == f"side_by_side: old has no step rows in {tmp_path}"


def test_an_arm_that_never_came_back_is_one_line(tmp_path):
    out = run(tmp_path, "--arm", "plain=abc1234", "--device", "cpu")
    assert out.returncode != 0
    assert out.stderr.strip() == f"side_by_side: no {tmp_path / 'plain_metrics.jsonl'} (did `side_by_side.sh watch` bring it back?)"
