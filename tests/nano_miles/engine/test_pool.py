"""Engine replicas (nano_miles/engine/pool.py, layout.py's plan_layout): where they run, how a
rollout's groups are routed over them, a dead replica restarted while the others serve, and engine
URLs that are not engines."""
import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests

from nano_miles import cli
from nano_miles.engine.client import EngineUnavailable
from nano_miles.engine.layout import EngineLaunchConfig, plan_layout
from nano_miles.engine.pool import EnginePool, GroupRouter, check_engine
from nano_miles.telemetry import read_metrics

REPO = Path(__file__).resolve().parents[3]
FAST = ["--set", "model=tiny-random-qwen2", "--set", "rollout.max_new_tokens=24", "--set", "rollout.env.max_turns=2",
        "--set", "rollout.group_size=2", "--set", "tasks_per_step=2"]


def test_a_group_stays_on_one_replica_the_least_busy_when_it_starts():
    pool = EnginePool.of(["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"])
    router = GroupRouter(pool, timeout=5.0)
    # Two samples of each of four groups start: groups go to the replica with the fewest episodes in flight.
    picks = [router.pick(g)[0].index for g in ("a", "a", "b", "b", "c", "c", "d", "d")]
    assert picks == [0, 0, 1, 1, 2, 2, 0, 0]
    for replica in pool.replicas[:2]:  # group a's and b's episodes finish
        router.done(replica)
        router.done(replica)
    assert router.pick("e")[0].index == 1  # replica 0 still runs group d, replica 1 is idle again
    assert router.pick("a")[0].index == 0  # a later sample of group a: its prefix is cached on replica 0


def test_a_group_whose_replica_died_moves_whole_to_a_serving_one():
    pool = EnginePool.of(["http://127.0.0.1:1", "http://127.0.0.1:2"])
    router = GroupRouter(pool, timeout=5.0)
    replica, generation = router.pick("a")
    assert replica.index == 0
    router.pool.fail(replica, generation, EngineUnavailable("gone"))  # not ours: marked down, not restarted
    router.done(replica)
    assert [r.state for r in pool.replicas] == ["down", "serving"]
    assert [router.pick("a")[0].index for _ in range(2)] == [1, 1]
    router.pool.fail(pool.replicas[1], pool.replicas[1].generation, EngineUnavailable("gone too"))
    with pytest.raises(EngineUnavailable, match="no engine replica is serving"):
        router.pick("b")
    with pytest.raises(EngineUnavailable, match="not ours to restart"):
        pool.wait_restarts()


def test_replicas_take_the_gpus_the_trainer_does_not_use():
    # 4 GPUs, trainer on 2 ranks (cuda:0, cuda:1): one replica on each of the other two, the engine's KV share.
    layout = plan_layout("auto", EngineLaunchConfig(replicas=2), "auto", gpus=4, trainer_ranks=2)
    assert (layout.trainer_device, layout.engine_devices) == ("cuda:0", ["cuda:2", "cuda:3"])
    assert [a for a in layout.args_of(0) if "kv_cache" in a] == []
    # 2 GPUs, one trainer rank: both replicas on cuda:1, each with half of its KV share.
    layout = plan_layout("auto", EngineLaunchConfig(replicas=2), "auto", gpus=2)
    assert layout.engine_devices == ["cuda:1", "cuda:1"]
    assert layout.args_of(1)[-1] == "engine.kv_cache_memory_fraction=0.425"
    # No GPU left over: beside the trainer, with the shared share split; no GPU at all: the CPU.
    layout = plan_layout("auto", EngineLaunchConfig(replicas=2), "auto", gpus=2, trainer_ranks=2)
    assert layout.engine_devices == ["cuda:0", "cuda:1"]
    assert layout.args_of(0)[-1] == "engine.kv_cache_memory_fraction=0.35"
    assert plan_layout("auto", EngineLaunchConfig(replicas=3), "auto", gpus=0).engine_devices == ["cpu"] * 3
    # Engines alone (rollout, eval) spread over every GPU.
    assert plan_layout("auto", EngineLaunchConfig(replicas=2), None, gpus=2).engine_devices == ["cuda:0", "cuda:1"]


@pytest.fixture
def not_an_engine():
    """A real HTTP server that is not an engine (404 on every route but /)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_an_engine_url_that_is_not_an_engine_is_one_line(not_an_engine, engine_server, tmp_path, capsys):
    with pytest.raises(RuntimeError, match="is not an engine: GET /model_info answered HTTP 404"):
        check_engine(not_an_engine)
    assert check_engine(engine_server.url)["model_path"]
    # --engine-url repeats: the first is an engine, the second is not.
    assert cli.main(["train", *FAST, "--set", f"run_dir={tmp_path}", "--engine-url", engine_server.url,
                     "--engine-url", not_an_engine]) == 1
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (f"nano-miles train: engine.url {not_an_engine} is not an engine: "
                                            "GET /model_info answered HTTP 404 (expected `nano-miles serve` or SGLang)")
    assert "Traceback" not in err


@pytest.mark.parametrize("sets,message", [
    (["engine.replicas=0"], "engine.replicas must be an integer >= 1, got 0"),
    (["engine.url=localhost:30000"], "engine.url 'localhost:30000' is not an http(s)://HOST:PORT address"),
    (["engine.replicas=2", "engine.url=http://127.0.0.1:1"], "engine.replicas=2 starts engines here"),
])
def test_bad_engine_keys_are_one_line(sets, message, capsys):
    assert cli.main(["train", *[a for s in sets for a in ("--set", s)]]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


API_KEY = "test-engine-pool-key"


def _running(url: str) -> int:
    try:
        return requests.get(url + "/get_server_info", headers={"Authorization": f"Bearer {API_KEY}"},
                            timeout=2).json()["internal_states"][0]["running"]
    except (requests.RequestException, ValueError, KeyError):
        return 0


def test_a_replica_killed_mid_rollout_is_restarted_and_no_step_is_lost(tmp_path):
    """Its episodes run again on the other replica, the step completes, and the restarted replica gets
    that step's weights, verified, like the other (one step is enough: the kill comes during its rollout)."""
    run_dir = tmp_path / "run"
    # Turns of 128 tokens: a request stays in flight long enough to be seen (and killed) there.
    proc = subprocess.Popen([sys.executable, "-m", "nano_miles.cli", "train", *FAST, "--set", "steps=1",
                             "--set", "rollout.max_new_tokens=128",
                             "--set", "engine.replicas=2", "--set", "sync.verify=true", "--set", f"run_dir={run_dir}"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", NANO_MILES_API_KEY=API_KEY))
    try:
        deadline, victim = time.monotonic() + 240, None
        while victim is None and time.monotonic() < deadline and proc.poll() is None:
            state = run_dir / "engine.json"
            replicas = json.loads(state.read_text())["replicas"] if state.exists() else []
            if len(replicas) == 2 and _running(replicas[1]["url"]) > 0:  # a request in flight on replica 1
                victim = replicas[1]["pid"]
                os.kill(victim, signal.SIGKILL)
            time.sleep(0.05)
        out, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert victim is not None, "replica 1 never had a request in flight"
    assert proc.returncode == 0, out
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1], out
    assert "restarting it and re-syncing" not in out  # no step was retried
    assert all(r["trajectories"] == 4 for r in rows)  # every episode of every step came back
    assert rows[-1]["engine_restarts"] == 1
    killed = next(i for i, r in enumerate(rows) if r["engine_restarts"] == 1)
    # From the step after the kill on, both replicas get every version, verified.
    assert all(r["sync_engines"] == 2 and r["sync_verified"] for r in rows[killed:])
    assert [r["weight_version"] for r in rows] == ["1"]
    replicas = json.loads((run_dir / "engine.json").read_text())["replicas"]
    assert replicas[1]["pid"] != victim
