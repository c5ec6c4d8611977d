"""`nano-miles train` with the trainer on 2 ranks (FSDP2 over gloo, CPU), every rank running the loop
(nano_miles/train.py), end to end: 2 engine replicas, the KL penalty to a sharded reference, guided
groups; the run resumed on 1 rank; a one-process run resumed on 2 ranks and stopped by Ctrl-C; a
killed rank; bad input."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from nano_miles import cli
from nano_miles.config import load_config, parse_set
from nano_miles.rollout.task_stream import TaskStream
from nano_miles.tasks import select_tasks
from nano_miles.telemetry import read_metrics
from nano_miles.train import TrainConfig, TrainingRun

REPO = Path(__file__).resolve().parents[2]
FAST = ["--set", "model=tiny-random-qwen2", "--set", "rollout.max_new_tokens=24", "--set", "rollout.env.max_turns=2",
        "--set", "rollout.group_size=2", "--set", "tasks_per_step=2", "--set", "trainer.dist_timeout_s=60"]


def _train(*args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "nano_miles.cli", "train", *FAST, *args], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _finish(proc) -> str:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return out


def _expected_task_ids(steps, seed=0, tasks="train", per_step=2, group=2):
    stream = TaskStream(select_tasks(tasks), seed)
    return [[t.id for t in stream.take(per_step) for _ in range(group)] for _ in range(steps)]


def _wait_for(condition, proc, timeout=300):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)


def _checkpointed_step(run_dir: Path) -> int:
    try:
        return json.loads((run_dir / "checkpoint" / "state.json").read_text())["step"]
    except (FileNotFoundError, json.JSONDecodeError, KeyError):
        return 0


def _rank_pid(launcher: int, rank: int) -> int | None:
    for child in psutil.Process(launcher).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "nano_miles.train" in " ".join(child.cmdline()):
                return child.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def _gone(pid: int, timeout=20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    """2 ranks, 2 replicas, verified syncs; the KL penalty and guided groups need the ranks' log-probs
    before the update (the reference's, and the trainer's own for the scripted samples: the random
    model solves nothing, so every group is guided)."""
    run_dir = tmp_path_factory.mktemp("ranks") / "run"
    _finish(_train("--set", "steps=2", "--set", "trainer.nproc=2", "--set", "engine.replicas=2",
                   "--set", "sync.verify=true", "--set", "loss.kl_coef=0.1", "--set", "rollout.guide_unsolved=true",
                   "--set", f"run_dir={run_dir}"))
    return run_dir


def test_two_ranks_and_two_replicas_train_and_both_replicas_serve_each_version(two_rank_run):
    rows = read_metrics(two_rank_run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert [r["weight_version"] for r in rows] == ["1", "2"]
    for r in rows:
        assert (r["world_size"], r["engine_replicas"]) == (2, 2)
        assert r["sync_engines"] == 2 and r["sync_verified"] is True  # per-tensor checksums of both replicas
        assert r["update_skipped"] is None and r["parity_max"] <= 1e-4  # FP32 ranks vs FP32 engines
        assert len(r["mem_gb_ranks"]) == 2 and r["mem_gb"] == max(r["mem_gb_ranks"]) > 0
        assert min(r["engine_requests"]) > 0  # each step's 2 groups went one to each replica
        assert r["groups_guided"] == 2 and r["acc"] == 0.0  # the scripted samples are not the policy's
    assert rows[0]["kl_ref"] == 0.0  # the first update starts from the initial policy: the reference
    # The checkpoint: each rank wrote its shards, rank 0 the metadata and the run's state.
    ckpt = two_rank_run / "checkpoint"
    assert (ckpt / ".metadata").exists() and len(list(ckpt.glob("*.distcp"))) == 2
    state = json.loads((ckpt / "state.json").read_text())
    assert (state["step"], state["world_size"], state["weight_version"]) == (2, 2, "2")
    assert (two_rank_run / "final" / "model.safetensors").exists()


def test_a_two_rank_run_resumes_on_one_rank_at_the_same_data_position(two_rank_run):
    out = _finish(_train("--resume", str(two_rank_run), "--set", "steps=3", "--set", "trainer.nproc=1",
                         "--set", "engine.replicas=1"))
    assert f"resumed from {two_rank_run}/checkpoint after step 2" in out
    rows = read_metrics(two_rank_run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["world_size"] for r in rows] == [2, 2, 1]
    # Every step trained on the tasks an uninterrupted run would use, and versions go on from 2.
    assert [r["task_ids"] for r in rows] == _expected_task_ids(3)
    assert [r["weight_version"] for r in rows] == ["1", "2", "3"]


def test_a_one_process_run_resumes_on_two_ranks_and_ctrl_c_stops_them_after_a_step(tmp_path):
    """Ctrl-C reaches rank 0, which lets the step finish on every rank, checkpoints it with them and
    ends the run: exit 130, nothing left running, the checkpoint resumable."""
    run_dir = tmp_path / "run"
    cfg = load_config(TrainConfig, None, parse_set(FAST[1::2] + ["steps=2", "keep_optimizer_state=true",
                                                                 f"run_dir={run_dir}"]))
    TrainingRun(cfg, echo=lambda *a: None).run()
    assert not (run_dir / "checkpoint" / ".metadata").exists()  # checkpoint.py's files, not DCP's
    proc = _train("--resume", str(run_dir), "--set", "steps=50", "--set", "trainer.nproc=2",
                  "--set", "checkpoint_every=1")
    _wait_for(lambda: _checkpointed_step(run_dir) >= 3, proc)
    engine = json.loads((run_dir / "engine.json").read_text())["pid"]
    ranks = [_rank_pid(proc.pid, r) for r in (0, 1)]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, out[-3000:] + err[-3000:]
    assert f"resumed from {run_dir}/checkpoint after step 2" in out
    assert "moments restart from zero" not in out  # AdamW's state came along
    assert "interrupted after step" in out and "resume with --resume" in out
    assert all(_gone(pid) for pid in [engine, *ranks]), "a rank or the engine outlived the run"
    rows = read_metrics(run_dir / "metrics.jsonl")
    done = json.loads((run_dir / "checkpoint" / "state.json").read_text())
    assert done["world_size"] == 2 and [r["step"] for r in rows] == list(range(1, done["step"] + 1))
    assert [r["world_size"] for r in rows] == [1, 1] + [2] * (done["step"] - 2)
    assert [r["task_ids"] for r in rows] == _expected_task_ids(done["step"])
    assert [r["weight_version"] for r in rows] == [str(s) for s in range(1, done["step"] + 1)]


def test_a_killed_rank_stops_the_whole_run_naming_it(tmp_path):
    run_dir = tmp_path / "run"
    proc = _train("--set", "steps=20", "--set", "trainer.nproc=2", "--set", f"run_dir={run_dir}")
    try:
        _wait_for(lambda: read_metrics(run_dir / "metrics.jsonl"), proc)  # step 1 is done: step 2 is under way
        engine = json.loads((run_dir / "engine.json").read_text())["pid"]
        rank0, rank1 = _rank_pid(proc.pid, 0), _rank_pid(proc.pid, 1)
        os.kill(rank1, signal.SIGKILL)
        killed_at = time.monotonic()
        out, err = proc.communicate(timeout=120)
        stopped_after = time.monotonic() - killed_at
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert err.strip().splitlines()[-1] == (f"nano-miles train: trainer ranks failed: rank 1 (pid {rank1}) killed by "
                                            "SIGKILL; the launcher stopped the others")
    assert stopped_after < 60, "the run waited for a collective timeout although the rank was gone"
    assert _gone(rank0) and _gone(engine), "rank 0 or its engine outlived the run"


@pytest.mark.parametrize("sets,message", [
    (["trainer.nproc=0"], "trainer.nproc must be an integer >= 1, got 0"),
    ([f"trainer.nproc={max(2, torch.cuda.device_count() + 1)}", "trainer_device=cuda"], "GPUs (one per rank) but"),
    (["trainer.nproc=2", "true_on_policy=true"], "true_on_policy needs trainer.nproc = 1"),
])
def test_bad_rank_settings_are_one_line(sets, message, capsys):
    assert cli.main(["train", *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
