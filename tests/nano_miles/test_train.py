"""`nano-miles train` end to end on CPU: tiny-random-qwen2 through a real engine process and the real
sandbox. The run directory, resume after SIGKILL, Ctrl-C, a dead engine, the async staleness bound,
and a NaN update."""
import argparse
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import torch

from nano_miles.client import EngineClient, start_engine_process
from nano_miles.config import config_from_args, load_config, parse_set
from nano_miles.engine.engine import EngineConfig
from nano_miles.engine.server import ServerConfig, add_arguments
from nano_miles.engine_handle import EngineLaunchConfig, plan_layout
from nano_miles.models import resolve_model
from nano_miles.producer import TaskStream
from nano_miles.tasks import select_tasks
from nano_miles.telemetry import REQUIRED_KEYS, read_metrics
from nano_miles.train import TrainConfig, TrainingRun

REPO = Path(__file__).resolve().parents[2]
FAST = ["--set", "model=tiny-random-qwen2", "--set", "rollout.max_new_tokens=24",
        "--set", "rollout.env.max_turns=2", "--set", "rollout.group_size=2", "--set", "tasks_per_step=2"]


def _train(args, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "nano_miles.cli", "train", *FAST, *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def _finish(proc, timeout=240) -> str:
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out
    return out


def _wait_for_step(run_dir: Path, step: int, proc, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = run_dir / "checkpoint" / "state.json"
        if state.exists():
            try:
                if json.loads(state.read_text())["step"] >= step:
                    return
            except (json.JSONDecodeError, KeyError):
                pass  # mid-write
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.2)
    raise AssertionError(f"step {step} not checkpointed within {timeout}s")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def _wait_dead(pid: int, timeout=20) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def _expected_task_ids(steps, seed=0, tasks="train", per_step=2, group=2):
    stream = TaskStream(select_tasks(tasks), seed)
    return [[t.id for t in stream.take(per_step) for _ in range(group)] for _ in range(steps)]


def test_two_step_run_writes_the_run_directory_and_advances_the_engine(tmp_path):
    model = resolve_model("tiny-random-qwen2")
    with start_engine_process(str(model), dtype="float32") as engine:
        run_dir = tmp_path / "run"
        out = _finish(_train(["--set", "steps=2", "--set", f"run_dir={run_dir}", "--set", "sync.verify=true",
                              "--engine-url", engine.url]))
        assert EngineClient(engine.url).model_info()["weight_version"] == "2"
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert set(REQUIRED_KEYS) <= set(r)
        assert r["sync_verified"] is True and r["update_skipped"] is None
        assert r["parity_max"] <= 1e-5  # FP32 trainer vs FP32 engine on CPU
    assert [r["weight_version"] for r in rows] == ["1", "2"]
    assert "reward" in out and "parity" in out  # the live table
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert all((run_dir / f"{k}.png").exists() for k in ("reward_mean", "acc", "parity_mean"))
    assert json.loads((run_dir / "checkpoint" / "state.json").read_text())["step"] == 2
    # The exported policy is a HF folder that the engine serves.
    with start_engine_process(str(run_dir / "final"), dtype="float32") as served:
        reply = EngineClient(served.url).generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0})
        assert len(reply["output_ids"]) == 2


def test_resume_after_sigkill_loses_and_repeats_no_step(tmp_path):
    run_dir = tmp_path / "run"
    proc = _train(["--set", "steps=3", "--set", f"run_dir={run_dir}"])
    _wait_for_step(run_dir, 2, proc)
    engine_pid = json.loads((run_dir / "engine.json").read_text())["pid"]
    proc.kill()
    proc.wait()
    assert _wait_dead(engine_pid), "the engine outlived a SIGKILLed trainer"
    _finish(_train(["--resume", str(run_dir)]))
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # The data position survived: every step trained on the tasks an uninterrupted run would use.
    assert [r["task_ids"] for r in rows] == _expected_task_ids(3)
    assert [r["weight_version"] for r in rows] == ["1", "2", "3"]


def test_ctrl_c_leaves_a_resumable_checkpoint_and_no_orphans(tmp_path):
    run_dir = tmp_path / "run"
    proc = _train(["--set", "steps=50", "--set", f"run_dir={run_dir}"])
    _wait_for_step(run_dir, 1, proc)
    engine_pid = json.loads((run_dir / "engine.json").read_text())["pid"]
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out
    assert "resume with --resume" in out
    assert _wait_dead(engine_pid), "engine left running after Ctrl-C"
    done = json.loads((run_dir / "checkpoint" / "state.json").read_text())["step"]
    assert done >= 1
    _finish(_train(["--resume", str(run_dir), "--set", f"steps={done + 1}"]))
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == list(range(1, done + 2))


def test_ctrl_c_during_an_update_finishes_that_step_and_checkpoints_it(tmp_path):
    """Ctrl-C landing mid-update lets the step finish (update, sync, metrics) and checkpoints it on
    the way out, although no periodic checkpoint is due: no completed step is lost."""
    run_dir = tmp_path / "run"
    cfg = load_config(TrainConfig, None, parse_set(FAST[1::2] + ["steps=5", "checkpoint_every=100",
                                                                 f"run_dir={run_dir}"]))
    run = TrainingRun(cfg, echo=lambda *a: None)
    update = run.trainer.train_step

    def interrupted_update(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # handled in this (main) thread, inside the update
        return update(*args, **kwargs)

    run.trainer.train_step = interrupted_update
    with pytest.raises(KeyboardInterrupt):
        run.run()
    assert json.loads((run_dir / "checkpoint" / "state.json").read_text())["step"] == 1
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [(r["step"], r["weight_version"], r["update_skipped"]) for r in rows] == [(1, "1", None)]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_dead_engine_is_restarted_resynced_and_the_step_retried(tmp_path):
    run_dir = tmp_path / "run"
    proc = _train(["--set", "steps=3", "--set", f"run_dir={run_dir}"])
    _wait_for_step(run_dir, 1, proc)
    os.kill(json.loads((run_dir / "engine.json").read_text())["pid"], signal.SIGKILL)
    out = _finish(proc)
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3], out
    assert rows[-1]["engine_restarts"] >= 1 and "restarting it and re-syncing" in out
    assert [r["weight_version"] for r in rows] == ["1", "2", "3"]


def test_async_mode_respects_the_staleness_bound(tmp_path):
    run_dir = tmp_path / "run"
    _finish(_train(["--set", "steps=3", "--set", f"run_dir={run_dir}", "--set", "mode=async",
                    "--set", "max_staleness=0"]))
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Rollouts overlapped training: some trajectories were sampled by an older policy ...
    assert max(r["staleness_max"] for r in rows) >= 1
    # ... and none beyond the bound was trained on: they were dropped and counted.
    assert all(r["staleness_trained_max"] <= 0 for r in rows)
    assert sum(r["dropped_stale"] for r in rows) >= 1


def test_several_updates_per_step_reach_the_engine_with_the_kl_penalty(tmp_path):
    """loss.kl_coef > 0 builds the frozen reference and trains with the penalty (it used to pass
    validation and fail at step 1). Whether the KL grows depends on the tiny model's rewards; the
    update test shows it does once the policy moves."""
    run_dir = tmp_path / "run"
    _finish(_train(["--set", "steps=1", "--set", "updates_per_step=2", "--set", "sync.verify=true",
                    "--set", "loss.kl_coef=0.1", "--set", f"run_dir={run_dir}"]))
    (row,) = read_metrics(run_dir / "metrics.jsonl")
    assert row["updates"] == 2 and row["weight_version"] == "2"  # one version per optimizer step
    assert row["sync_verified"] is True and row["parity_max"] <= 1e-5
    assert row["update_skipped"] is None and row["kl_ref"] >= 0.0  # computed against the reference


def test_layout_follows_the_hardware_and_config_overrides():
    cfg = TrainConfig()
    layout = plan_layout(cfg.dtype, cfg.engine, cfg.trainer_device)  # this machine's GPUs
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert (layout.trainer_device, layout.engine_device) == {0: ("cpu", "cpu"), 1: ("cuda:0", "cuda:0")}.get(
        n, ("cuda:0", "cuda:1"))
    assert layout.dtype == ("float32" if n == 0 else "bfloat16")
    for gpus, devices, dtype in ((0, ("cpu", "cpu"), "float32"), (1, ("cuda:0", "cuda:0"), "bfloat16"),
                                 (2, ("cuda:0", "cuda:1"), "bfloat16")):
        planned = plan_layout("auto", EngineLaunchConfig(), "auto", gpus=gpus)
        assert ((planned.trainer_device, planned.engine_device), planned.dtype) == (devices, dtype)
    forced = plan_layout("bfloat16", EngineLaunchConfig(device="cpu"), "cpu", gpus=2)
    assert (forced.trainer_device, forced.engine_device, forced.dtype) == ("cpu", "cpu", "bfloat16")
    # An engine alone (rollout, eval) takes the first GPU, or the CPU.
    alone = plan_layout("auto", EngineLaunchConfig(), trainer_device=None, gpus=2)
    assert (alone.trainer_device, alone.engine_device) == (None, "cuda:0")


def _served_engine(layout) -> EngineConfig:
    """The engine config `nano-miles serve` builds from the layout's arguments (serve's own parser)."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return config_from_args(ServerConfig, parser.parse_args(["--model", "m", *layout.engine_args])).engine


def test_engine_keys_reach_the_engine_process():
    """train's engine.* keys are serve's: the layout passes the ones that differ from the engine's
    defaults. On one shared GPU the KV share is 0.35 unless engine.kv_cache_memory_fraction (or its
    old name engine_mem_fraction) says otherwise; on a GPU of its own the engine's default stands."""
    for sets, fraction in (([], 0.35), (["engine.kv_cache_memory_fraction=0.3"], 0.3),
                           (["engine_mem_fraction=0.25"], 0.25)):
        cfg = load_config(TrainConfig, overrides=parse_set(sets), note=lambda _: None)
        shared = plan_layout(cfg.dtype, cfg.engine, cfg.trainer_device, gpus=1)
        assert _served_engine(shared).kv_cache_memory_fraction == fraction
    own = plan_layout("auto", EngineLaunchConfig(), "auto", gpus=2)
    assert own.engine_args == [] and _served_engine(own).kv_cache_memory_fraction == 0.85
    cfg = load_config(TrainConfig, overrides=parse_set(["engine.max_running_requests=32", "engine.block_size=32",
                                                        "engine.cuda_graph=false", "engine.max_model_len=2048"]))
    served = _served_engine(plan_layout(cfg.dtype, cfg.engine, cfg.trainer_device, gpus=0))
    assert (served.max_running_requests, served.block_size, served.cuda_graph, served.max_model_len) == (
        32, 32, False, 2048)


def test_bad_command_lines_are_clear_errors(tmp_path):
    for args, message in ((["--set", "steps=zero"], "steps: expected an integer"),
                          (["--set", "mode=turbo"], "mode must be one of"),
                          (["--set", "nope=1"], "unknown config key 'nope'"),
                          (["--set", "updates_per_step=0"], "updates_per_step must be >= 1"),
                          (["--set", "engine.attention_backend=fast"], "engine.attention_backend must be auto"),
                          (["--resume", str(tmp_path)], "not a run directory")):
        proc = subprocess.run([sys.executable, "-m", "nano_miles.cli", "train", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and message in proc.stderr, (args, proc.stderr)


def test_old_key_names_still_work_and_say_their_new_name(tmp_path):
    """run.toml files, --set lines and the config.json of earlier runs use the keys train had before
    the trainer and the engine got sections of their own."""
    def print_config(*args):
        proc = subprocess.run([sys.executable, "-m", "nano_miles.cli", "train", *args, "--print-config"], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return tomllib.loads(proc.stdout), proc.stderr

    cfg, err = print_config("--set", "micro_batch_size=2", "--set", "engine_mem_fraction=0.3",
                            "--set", "engine_url=http://127.0.0.1:1")
    assert cfg["trainer"]["micro_batch_size"] == 2 and cfg["engine"]["kv_cache_memory_fraction"] == 0.3
    assert cfg["engine"]["url"] == "http://127.0.0.1:1" and "micro_batch_size" not in cfg
    assert "config key 'micro_batch_size' is now 'trainer.micro_batch_size'" in err
    # An earlier run's config.json resumes with its values, silently; this command line still wins.
    run_dir = tmp_path / "old-run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"model": "tiny-random-qwen2", "logprob_chunk": 64,
                                                     "engine_device": "cpu", "rollout": {"group_size": 4}}))
    cfg, err = print_config("--resume", str(run_dir), "--set", "rollout.group_size=2")
    assert (cfg["trainer"]["logprob_chunk"], cfg["engine"]["device"], cfg["rollout"]["group_size"]) == (64, "cpu", 2)
    assert err == ""
