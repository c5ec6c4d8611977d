"""`nano-miles train` end to end on CPU: tiny-random-qwen2 through a real engine process and the real
sandbox. The run directory, resume after SIGKILL, Ctrl-C, a dead engine, the async staleness bound,
a NaN update, and failing safely: a sandbox that cannot run, steps that lose every episode."""
import argparse
import functools
import json
import os
import pickle
import signal
import subprocess
import sys
import random
import tempfile
import time
import tomllib
from pathlib import Path

import pytest
import torch

from nano_miles import cli
from nano_miles.engine.client import EngineClient
from nano_miles.engine.process import start_engine_process
from nano_miles.config import config_from_args, load_config, parse_set
from nano_miles.engine.engine import EngineConfig
from nano_miles.engine.protocol import API_KEY_ENV
from nano_miles.engine.server import ServerConfig, add_arguments
from nano_miles.engine.layout import EngineLaunchConfig, plan_layout
from nano_miles.models.prepare import resolve_model
from nano_miles.rollout.task_stream import TaskStream
from nano_miles.tasks import select_tasks
from nano_miles.telemetry import REQUIRED_KEYS, read_metrics
from nano_miles.train import RunFailed, TrainConfig, TrainingRun
from nano_openshell import Sandbox
from tests.nano_miles.trainer.test_checkpoint import CreatesFile, damaged_copies, format_1_run

REPO = Path(__file__).resolve().parents[2]
DENY_NAMESPACES = [sys.executable, "-c", "import sys; from nano_openshell.seccomp import main; sys.exit(main())",
                   "--deny-namespaces", "--"]
FAST = ["--set", "model=tiny-random-qwen2", "--set", "rollout.max_new_tokens=24",
        "--set", "rollout.env.max_turns=2", "--set", "rollout.group_size=2", "--set", "tasks_per_step=2",
        "--set", "checkpoint_every=1"]  # the tests below kill runs between steps: a checkpoint after each


def _train(args, api_key: str | None = None, tmpdir: Path | None = None, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if tmpdir is not None:  # where its sandboxes' workspaces go
        env["TMPDIR"] = str(tmpdir)
    if api_key is not None:  # the key of an engine somebody else runs (--engine-url)
        env[API_KEY_ENV] = api_key
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
                              "--engine-url", engine.url], api_key=engine.api_key))
        assert EngineClient(engine.url).model_info()["weight_version"] == "2"
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert set(REQUIRED_KEYS) <= set(r)
        assert r["sync_verified"] is True and r["update_skipped"] is None
        assert r["parity_max"] <= 1e-5  # FP32 trainer vs FP32 engine on CPU
        phases = [r[f"sync_{p}_ms"] for p in ("pause", "prepare", "pack", "send", "free", "resume")]
        assert all(ms >= 0 for ms in phases) and sum(phases) <= r["sync_ms"]  # where the sync's time went
        assert 0 <= r["sync_engine_total_ms"] <= r["sync_send_ms"]  # of the send, the engine's own part
    assert [r["weight_version"] for r in rows] == ["1", "2"]
    assert "reward" in out and "parity" in out  # the live table ...
    header = next(line for line in out.splitlines() if "parity" in line)
    assert header.split()[-2:] == ["elapsed", "ETA"]  # ... with the whole run's elapsed time and ETA
    # It ends with a summary: first vs last reward and accuracy, wall time, where the files are.
    summary = out[out.index("summary: 2 steps, "):]
    assert f"reward    {rows[0]['reward_mean']:+.3f} (step 1) -> {rows[1]['reward_mean']:+.3f} (step 2)" in summary
    assert f"accuracy  {rows[0]['acc']:.1%} (step 1) -> {rows[1]['acc']:.1%} (step 2)" in summary
    assert f"files     {run_dir}/: metrics.jsonl, tensorboard/, reward_mean.png" in summary
    assert f"nano-miles eval --model {run_dir / 'final'}" in summary and "wall time" in summary
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert all((run_dir / f"{k}.png").exists() for k in ("reward_mean", "acc", "parity_mean"))
    assert json.loads((run_dir / "checkpoint" / "state.json").read_text())["step"] == 2
    # The exported policy is a HF folder that the engine serves.
    with start_engine_process(str(run_dir / "final"), dtype="float32") as served:
        reply = EngineClient(served.url).generate([1, 2, 3], {"max_new_tokens": 2, "temperature": 0})
        assert len(reply["output_ids"]) == 2


def test_a_step_that_makes_the_weights_nan_stops_the_run_in_one_line(tmp_path):
    """optim.lr=1e38: the first optimizer step overflows the weights to inf/NaN. The run stops at that
    step with one line saying so, and the engine (served by somebody else) never got them. (Not with
    sync.transport=shared, which `auto` picks here: its engine maps the trainer's own memory.)"""
    model = resolve_model("tiny-random-qwen2")
    with start_engine_process(str(model), dtype="float32") as engine:
        client = EngineClient(engine.url)
        served = client.weights_checksum()  # (with its weight_version)
        run_dir = tmp_path / "run"
        proc = _train(["--set", "steps=2", "--set", "optim.lr=1e38", "--set", f"run_dir={run_dir}",
                       "--set", "sync.transport=distributed", "--engine-url", engine.url], api_key=engine.api_key)
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 1, out
        assert client.weights_checksum() == served
        assert client.generate([1, 2, 3], {"max_new_tokens": 2})["output_ids"]
    said = [line for line in out.splitlines() if line.startswith("nano-miles train:")]
    assert len(said) == 1 and "Traceback" not in out, out
    assert said[0].startswith("nano-miles train: stopped at step 1: optimizer step 1 left NaN or infinite values in ")
    assert said[0].endswith(f"lower optim.lr (or find what diverged) and continue with --resume {run_dir} (from step 1)")
    assert read_metrics(run_dir / "metrics.jsonl") == [] and not (run_dir / "final").exists()


@pytest.fixture
def traversable_tmp():
    """A temporary directory the sandboxes' uids can traverse to their workspaces (tmp_path's parents
    are private), removed afterwards with whatever a killed run left there."""
    path = Path(tempfile.mkdtemp(prefix="nano-miles-test-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    subprocess.run(["rm", "-rf", str(path)])


def test_resume_after_sigkill_loses_and_repeats_no_step(tmp_path, traversable_tmp):
    run_dir = tmp_path / "run"
    # a SIGKILLed supervisor cannot remove its episodes' workspaces: they go to a directory of the test's
    proc = _train(["--set", "steps=3", "--set", f"run_dir={run_dir}"], tmpdir=traversable_tmp)
    _wait_for_step(run_dir, 2, proc)
    engine_pid = json.loads((run_dir / "engine.json").read_text())["pid"]
    proc.kill()
    proc.wait()
    assert _wait_dead(engine_pid), "the engine outlived a SIGKILLed trainer"
    _finish(_train(["--resume", str(run_dir)], tmpdir=traversable_tmp))
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # The data position survived: every step trained on the tasks an uninterrupted run would use.
    assert [r["task_ids"] for r in rows] == _expected_task_ids(3)
    assert [r["weight_version"] for r in rows] == ["1", "2", "3"]


def test_an_async_run_with_carry_over_checkpoints_its_carried_tasks_and_resumes_them_first(tmp_path):
    run_dir = tmp_path / "run"
    carry = ["--set", "mode=async", "--set", "rollout.carry_over=true", "--set", "max_staleness=2"]
    _finish(_train([*carry, "--set", "steps=2", "--set", f"run_dir={run_dir}"]))
    steps = 2
    # A step carries the groups still running when its batch is full; when the last ones came back in
    # the same instant as the batch filled (a busy machine), nothing is carried: then one more step
    while not (pending := json.loads((run_dir / "checkpoint" / "state.json").read_text())["stream"].get("pending")):
        assert steps < 6, "no step in five carried a group on"
        steps += 1
        _finish(_train(["--resume", str(run_dir), *carry, "--set", f"steps={steps}"]))
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, steps + 1)) and all(r["trajectories"] == 4 for r in rows)
    assert all(r["staleness_trained_max"] <= 2 for r in rows)
    assert rows[-1]["groups_carried"] == len(pending)  # groups still running after the last step
    _finish(_train(["--resume", str(run_dir), *carry, "--set", f"steps={steps + 1}"]))
    last = read_metrics(run_dir / "metrics.jsonl")[-1]
    still = json.loads((run_dir / "checkpoint" / "state.json").read_text())["stream"].get("pending", [])
    # the resumed run started them first: each was trained on in the next step or is still carried after it
    assert last["step"] == steps + 1 and set(pending) <= set(last["task_ids"]) | set(still)


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
    handler_before = signal.getsignal(signal.SIGINT)  # default_int_handler, or SIG_IGN under a background shell

    def interrupted_update(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)  # handled in this (main) thread, inside the update
        return update(*args, **kwargs)

    run.trainer.train_step = interrupted_update
    with pytest.raises(KeyboardInterrupt):
        run.run()
    assert json.loads((run_dir / "checkpoint" / "state.json").read_text())["step"] == 1
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [(r["step"], r["weight_version"], r["update_skipped"]) for r in rows] == [(1, "1", None)]
    assert signal.getsignal(signal.SIGINT) is handler_before  # the run put the caller's handler back


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


def test_several_updates_per_step_the_kl_penalty_clip_cov_and_rollouts_below_t1_train_end_to_end(tmp_path):
    """loss.kl_coef > 0 builds the frozen reference and trains with the penalty (whether the KL grows
    depends on the tiny model's rewards; the update test shows it does once the policy moves);
    updates_per_step=2 reaches the engine; rollout.temperature reaches the trainer (its log-probs of the
    sampled tokens match the engine's tempered ones: parity stays at float32 rounding); and
    loss.clip_cov_ratio its loss and metrics. One run for all: each is checked on its own elsewhere."""
    run_dir = tmp_path / "run"
    _finish(_train(["--set", "steps=1", "--set", "updates_per_step=2", "--set", "sync.verify=true",
                    "--set", "loss.kl_coef=0.1", "--set", f"run_dir={run_dir}", "--set", "optim.lr=1e-4",
                    "--set", "optim.lr_schedule=linear", "--set", "optim.min_lr_ratio=0.5",
                    "--set", "rollout.temperature=0.7", "--set", "loss.clip_cov_ratio=0.01"]))
    (row,) = read_metrics(run_dir / "metrics.jsonl")
    assert row["updates"] == 2 and row["weight_version"] == "2"  # one version per optimizer step
    # the linear decay spans the run's 2 optimizer steps (as HF's schedulers count): 1e-4, then 7.5e-5
    assert row["lr"] == pytest.approx(7.5e-5)
    assert row["sync_verified"] is True and row["parity_max"] <= 1e-4, row["parity_max"]
    assert row["update_skipped"] is None and row["kl_ref"] >= 0.0  # computed against the reference
    assert isinstance(row["clip_cov_frac"], float) and 0.0 <= row["clip_cov_frac"] <= 0.01 + 1e-9


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
    return config_from_args(ServerConfig, parser.parse_args(["--model", "m", *layout.args_of(0)])).engine


def test_engine_keys_reach_the_engine_process():
    """train's engine.* keys are serve's: the layout passes the ones that differ from the engine's
    defaults. On one shared GPU the KV share is 0.35 unless engine.kv_cache_memory_fraction says
    otherwise; on a GPU of its own the engine's default stands."""
    for sets, fraction in (([], 0.35), (["engine.kv_cache_memory_fraction=0.3"], 0.3)):
        cfg = load_config(TrainConfig, overrides=parse_set(sets))
        shared = plan_layout(cfg.dtype, cfg.engine, cfg.trainer_device, gpus=1)
        assert _served_engine(shared).kv_cache_memory_fraction == fraction
    own = plan_layout("auto", EngineLaunchConfig(), "auto", gpus=2)
    assert own.engine_args == [] and _served_engine(own).kv_cache_memory_fraction == 0.85
    cfg = load_config(TrainConfig, overrides=parse_set(["engine.max_running_requests=32", "engine.block_size=32",
                                                        "engine.cuda_graph=false", "engine.max_model_len=2048"]))
    served = _served_engine(plan_layout(cfg.dtype, cfg.engine, cfg.trainer_device, gpus=0))
    assert (served.max_running_requests, served.block_size, served.cuda_graph, served.max_model_len) == (
        32, 32, False, 2048)


def test_bad_command_lines_are_clear_errors(tmp_path, capsys):
    """Exit 2 and one line, before a run directory is made."""
    broken_tasks, run_dir = tmp_path / "broken_tasks.py", tmp_path / "run"
    broken_tasks.write_text('raise RuntimeError("the config server is down")\n')
    cases = ((["--set", "steps=zero"], "steps: expected an integer"),
             (["--set", "mode=turbo"], "mode must be one of"),
             (["--set", "nope=1"], "unknown config key 'nope'"),
             (["--set", "updates_per_step=0"], "updates_per_step must be >= 1"),
             (["--set", "engine.attention_backend=fast"], "engine.attention_backend must be auto"),
             (["--set", "engine.num_continuous_decode_steps=0"], "engine.num_continuous_decode_steps must be >= 1"),
             (["--set", "engine.overlap_schedule=maybe"], "engine.overlap_schedule: expected true/false, got 'maybe'"),
             (["--set", "engine.enable_torch_compile=2"], "engine.enable_torch_compile: expected true/false, got '2'"),
             (["--set", "rollout.temperature=0"], "rollout.temperature must be > 0 to train"),
             (["--set", "rollout.temperature=inf"], "rollout.temperature: expected a finite number, got 'inf'"),
             (["--set", f'tasks_module=["{broken_tasks}"]'],
              f"{broken_tasks}: cannot load: RuntimeError: the config server is down"),
             (["--resume", str(tmp_path)], "not a run directory"))
    for args, message in cases:  # in this process: `nano-miles train` is cli.main, less the interpreter's start
        code = cli.main(["train", "--set", f"run_dir={run_dir}", *args])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and message in err, (args, err)
    assert not run_dir.exists()


def test_a_sandbox_below_min_tier_refuses_the_run_before_any_model_loads(tmp_path):
    """Namespaces denied (a rootless container): every episode would be lost, so train refuses at once
    with the probe's reason and the fix, before it builds or loads a model, and writes no run directory."""
    run_dir, cache = tmp_path / "run", tmp_path / "model-cache"
    env = dict(os.environ, NANO_MILES_CACHE=str(cache))  # tiny-random-qwen2 would be built here
    proc = subprocess.run([*DENY_NAMESPACES, sys.executable, "-m", "nano_miles.cli", "train", *FAST,
                           "--set", f"run_dir={run_dir}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("nano-miles train: every episode would fail: the sandbox cannot reach "
                                  "sandbox.min_tier=namespaced here (bwrap")
    assert "--set sandbox.min_tier=fallback" in proc.stderr and "unprivileged" in proc.stderr
    assert not run_dir.exists() and not cache.exists()


def _run_with_broken_sandboxes(tmp_path, *sets):
    """A run whose every sandbox fails to start (its workspace is gone): real sandboxes, real failures."""
    cfg = load_config(TrainConfig, None, parse_set(FAST[1::2] + [f"run_dir={tmp_path / 'run'}", *sets]))
    printed = []
    broken = functools.partial(Sandbox, workspace="/nonexistent/workspace")
    run = TrainingRun(cfg, echo=printed.append, make_sandbox=broken)
    engine_pid = run.engines.replicas[0].process.process.pid
    with pytest.raises(RunFailed) as failed:
        run.run()
    assert _wait_dead(engine_pid), "engine left running after a failed run"
    return str(failed.value), read_metrics(tmp_path / "run" / "metrics.jsonl"), "\n".join(printed)


def test_consecutive_steps_that_lose_every_episode_stop_the_run_with_the_cause(tmp_path):
    message, rows, _ = _run_with_broken_sandboxes(tmp_path, "steps=5", "max_infra_failed_steps=2")
    assert [(r["step"], r["setup_failures"], r["trajectories"]) for r in rows] == [(1, 4, 0), (2, 4, 0)]
    assert all(r["update_skipped"] == "every episode failed for infrastructure reasons (sandbox)" for r in rows)
    assert message.startswith("stopped at step 2: steps 1-2 lost every episode to infrastructure failures")
    assert "'/nonexistent/workspace' does not exist" in message  # the cause, in the sandbox's words
    assert f"--resume {tmp_path / 'run'} (from step 1)" in message
    assert not (tmp_path / "run" / "final").exists()


def test_a_run_that_trained_on_nothing_writes_no_final_policy(tmp_path):
    """One lost step is below max_infra_failed_steps, so the run ends; but its policy never changed."""
    message, rows, printed = _run_with_broken_sandboxes(tmp_path, "steps=1")
    assert [r["step"] for r in rows] == [1] and rows[0]["setup_failures"] == 4
    assert message.startswith("trained on nothing: no step updated the policy (every episode failed for "
                              "infrastructure reasons (sandbox)), so it is still the base model and no final/ was written")
    assert not (tmp_path / "run" / "final").exists() and "summary: 1 step," in printed


def test_resume_runs_no_code_from_the_run_directory_and_refuses_a_damaged_checkpoint_in_one_line(tmp_path, capsys):
    """A run directory may come from anyone (a shared disk, a download). Before any model loads, resume
    refuses a crafted pickle (never run), a damaged checkpoint file (named) and a tasks module only its
    config.json asks for (Python this host would import); nothing in the directory changes."""
    marker = tmp_path / "marker"
    damaged = damaged_copies(tmp_path / "damaged")
    sharded = tmp_path / "sharded" / "checkpoint"
    sharded.mkdir(parents=True)
    (sharded / "state.json").write_text(json.dumps({"step": 1, "data_position": 2, "sharded": True, "world_size": 2,
                                                    "rng": {"python": list(random.getstate()),
                                                            "torch": torch.get_rng_state().tolist()}}))
    (sharded / ".metadata").write_bytes(pickle.dumps(CreatesFile(marker)))
    plugin = tmp_path / "plugin" / "tasks.py"
    plugin.parent.mkdir()
    plugin.write_text(f"open({str(marker)!r}, 'w')\nraise SystemExit(3)\n")  # imported, it would run
    format_1, truncated = format_1_run(tmp_path / "format1", marker), damaged["truncated weights"][0]
    refused = {  # run directory: the start of the one line it gets
        format_1: f"{format_1}/checkpoint cannot be resumed: its state.json says format 1",
        sharded.parent: f"{sharded}/.metadata cannot be loaded: UnpicklingError",
        truncated: f"{truncated}/checkpoint/model.safetensors cannot be read: ",
        plugin.parent: f"--resume {plugin.parent}: its config.json loads tasks_module {plugin}, code this host would "
                       f"run, which a run directory is not trusted to ask for: --set tasks_module={plugin} resumes "
                       "with it"}
    for run_dir in refused:
        (run_dir / "config.json").write_text(json.dumps({"model": "tiny-random-qwen2"}))
    (plugin.parent / "config.json").write_text(json.dumps({"model": "tiny-random-qwen2",
                                                           "tasks_module": [str(plugin)]}))
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    # in this process (`nano-miles train` is cli.main, less the interpreter's start): code the directory
    # got run would write the marker here as well (and the plugin's SystemExit would end the test)
    capsys.readouterr()  # (what making the format-1 run above printed)
    for run_dir, message in refused.items():
        code = cli.main(["train", "--resume", str(run_dir)])
        out, err = capsys.readouterr()
        assert code == 2 and err.count("\n") == 1, (run_dir, out, err)
        assert err.startswith(f"nano-miles train: {message}"), err
    # the tasks module named on the command line: taken
    code = cli.main(["train", "--resume", str(plugin.parent), "--set", f"tasks_module={plugin}", "--print-config"])
    out, err = capsys.readouterr()
    assert code == 0 and tomllib.loads(out)["tasks_module"] == [str(plugin)], err
    assert not marker.exists()
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
