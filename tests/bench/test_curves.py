"""bench/curves.py: several runs' metrics.jsonl drawn on one set of axes, a line a run. Run as a user runs it."""
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


def run(*args):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(REPO / "bench" / "curves.py"), *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=120)


def metrics(path: Path, slope: float, alfa: bool) -> Path:
    """A run's metrics.jsonl as train writes it: step 0's evaluation, then steps with an evaluation every 2."""
    rows = [{"step": 0, "eval_pass_at_1": 0.1, **({"eval_alfa_pass_at_1": 0.0} if alfa else {})}]
    for step in range(1, 7):
        row = {"step": step, "reward_mean": slope * step, "acc": slope * step / 2, "entropy": 0.3 - 0.02 * step,
               "parity_mean": 0.01}
        if step % 2 == 0:
            row["eval_pass_at_1"] = 0.1 + slope * step
            if alfa:
                row["eval_alfa_pass_at_1"] = slope * step / 3
        rows.append(row)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_each_curve_any_run_has_is_drawn_with_a_line_a_run(tmp_path):
    a = metrics(tmp_path / "a.jsonl", 0.05, alfa=True)
    b = metrics(tmp_path / "b.jsonl", 0.08, alfa=False)   # no ALFA evaluations: its line is left out there
    out = run("--out", tmp_path / "figs", f"constant={a}", f"cosine={b}")
    assert out.returncode == 0, out.stderr
    names = [Path(line).name for line in out.stdout.splitlines()]
    assert names == ["compare_reward_mean.png", "compare_acc.png", "compare_entropy.png", "compare_parity_mean.png",
                     "compare_eval_pass_at_1.png", "compare_eval_alfa_pass_at_1.png"]
    for name in names:
        assert (tmp_path / "figs" / name).read_bytes()[:8] == PNG


def test_no_run_with_evaluations_draws_no_evaluation_curve(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"step": 1, "reward_mean": 0.5, "acc": 0.5, "entropy": 0.2, "parity_mean": 0.0}) + "\n")
    out = run("--out", tmp_path, f"only={path}")
    assert out.returncode == 0, out.stderr
    assert not (tmp_path / "compare_eval_pass_at_1.png").exists()
    assert (tmp_path / "compare_entropy.png").read_bytes()[:8] == PNG


def test_bad_input_is_one_line_and_writes_nothing(tmp_path):
    missing = run("--out", tmp_path / "figs", f"c1={tmp_path / 'nope.jsonl'}")
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"curves: no metrics file at {tmp_path / 'nope.jsonl'} (run 'c1')"
    unlabeled = run("--out", tmp_path / "figs", str(tmp_path / "a.jsonl"))
    assert unlabeled.returncode == 2 and len(unlabeled.stderr.strip().splitlines()) == 1
    assert "is not LABEL=METRICS" in unlabeled.stderr
    assert not (tmp_path / "figs").exists()


def test_where_a_steps_time_went_is_drawn_for_the_runs_that_have_it(tmp_path):
    rows = [{"step": s, "reward_mean": 0.1, "step_s": 5.0 - s, "engine_busy_share": 0.2 + 0.1 * s,
             "sandbox_share": 0.3, "critical_path_s": 2.0, "refill_s": 1.0 if s % 2 else 0.0} for s in (1, 2, 3)]
    new = tmp_path / "new.jsonl"
    new.write_text("".join(json.dumps(r) + "\n" for r in rows))
    old = tmp_path / "old.jsonl"  # a run from before the breakdown: no line on its curves
    old.write_text(json.dumps({"step": 1, "reward_mean": 0.0}) + "\n")
    out = run("--out", tmp_path / "figs", f"new={new}", f"old={old}")
    assert out.returncode == 0, out.stderr
    names = [Path(line).name for line in out.stdout.splitlines()]
    assert names == ["compare_reward_mean.png", "compare_step_s.png", "compare_engine_busy_share.png",
                     "compare_sandbox_share.png", "compare_critical_path_s.png", "compare_refill_s.png"]
    for name in names:
        assert (tmp_path / "figs" / name).read_bytes()[:8] == PNG
