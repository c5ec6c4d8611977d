"""The trainer's process group and launcher (nano_miles/trainer/distributed.py): bad input is one line, a
dead or hung rank stops the run with a message naming a rank instead of a hang."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nano_miles.trainer.distributed import DistError, check_nproc, init_distributed, launch

ROOT = Path(__file__).resolve().parents[3]


def rank_env(rank: int, port: int, timeout_s: int) -> dict:
    """What torchrun's agent gives each rank (one agent per host, as with --nnodes 2)."""
    env = dict(os.environ, RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), TEST_TIMEOUT_S=str(timeout_s), OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("nproc,device,message", [
    (0, "cpu", "trainer.nproc must be an integer >= 1, got 0"),
    (-2, "cpu", "trainer.nproc must be an integer >= 1, got -2"),
    ("2", "cpu", "trainer.nproc must be an integer >= 1, got '2'"),
    (torch.cuda.device_count() + 1, "cuda", "GPUs (one per rank) but"),
])
def test_bad_nproc_is_one_clear_line(nproc, device, message):
    for call in (lambda: check_nproc(nproc, device), lambda: launch(nproc, print, device_type=device)):
        with pytest.raises(DistError) as e:
            call()
        assert message in str(e.value) and "\n" not in str(e.value)


def test_a_rank_outside_torchrun_is_told_how_to_start(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    with pytest.raises(DistError, match="RANK is not set: start the ranks with torchrun"):
        init_distributed("cpu")


def test_a_killed_rank_makes_the_other_fail_naming_itself(tmp_path, tiny_model_path):
    """Ranks under separate agents (as on two hosts): nobody kills rank 0 for us; its own collective
    fails once rank 1 is gone, well within the collective timeout, with one line naming the rank."""
    port, timeout_s = free_port(), 60
    cmd = [sys.executable, "-m", "tests.nano_miles.trainer.sharded_ranks", "kill", str(tmp_path), str(tiny_model_path)]
    procs = [subprocess.Popen(cmd, env=rank_env(r, port, timeout_s), cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        _, err0 = procs[0].communicate(timeout=180)
        procs[1].wait(timeout=30)
    finally:
        for p in procs:
            p.kill()
    failed_at = time.time()
    killed_at = float((tmp_path / "kill_at").read_text())
    assert procs[1].returncode == -9
    # 1, never -6: a failed collective left gloo threads that aborted the interpreter's teardown
    assert procs[0].returncode == 1 and not (tmp_path / "finished_0").exists(), err0[-2000:]
    last = err0.strip().splitlines()[-1]
    assert last.startswith("error: rank 0/2 (") and "another rank died" in last, err0[-2000:]
    assert failed_at - killed_at < timeout_s / 2, "rank 0 waited for the timeout although its peer was gone"


def test_a_hung_rank_times_out_the_collective_and_the_launcher_names_it(tmp_path, monkeypatch):
    """Rank 1 stops answering: rank 0's collective gives up after the timeout (5 s), the
    agent stops rank 1, and launch raises one line naming rank 0's failure."""
    monkeypatch.setenv("TEST_TIMEOUT_S", "5")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with pytest.raises(DistError) as e:
        launch(2, sys.executable, ["-m", "tests.nano_miles.trainer.sharded_ranks", "hang", str(tmp_path)])
    waited = time.time() - float((tmp_path / "hang_at").read_text())
    message = str(e.value)
    assert message.startswith("trainer ranks failed: rank 0/2 (") and "\n" not in message, message
    assert "Timed out" in message and "another rank died or stopped answering" in message, message
    assert 5 <= waited < 5 + 25, waited
    assert not (tmp_path / "finished_0").exists()


def test_launch_gives_the_callers_signal_handlers_back():
    """The elastic agent installs its own SIGINT/SIGTERM handlers; after launch the caller's are back,
    so a later Ctrl-C in the same process still raises KeyboardInterrupt (the train loop relies on it)."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    results = launch(1, os.getpid)
    assert set(results) == {0} and results[0] != os.getpid()
    assert {sig: signal.getsignal(sig) for sig in before} == before


# Rank 0 sets its episodes up on worker threads (rollout.py); a rank that leaves through main_guard
# (os._exit) or dies of the launcher's SIGTERM runs none of their finally blocks and no atexit handler.
_EPISODE_IN_FLIGHT = """
import signal, sys, threading, time
from nano_miles.trainer.distributed import DistError, main_guard
from nano_openshell import Sandbox

opened = threading.Event()

def set_up():  # an episode's setup on a worker thread: it holds its sandbox and never closes it
    sb = Sandbox(min_tier="none", allow_unisolated=True)
    print(sb.workspace, flush=True)
    opened.set()
    if sys.argv[1] == "sigterm-on-a-worker":  # the kernel gives the launcher's SIGTERM to this thread
        time.sleep(1)  # once the main thread waits in its sleep, where only a signal to it would wake it
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
    time.sleep(60)

@main_guard
def rank_main(how):
    threading.Thread(target=set_up, daemon=True).start()
    opened.wait()
    if how == "error":
        raise DistError("rank 0/2: RuntimeError: Connection closed by peer")
    time.sleep(60)  # the launcher's SIGTERM comes: the main thread waits in C, not in Python

rank_main(sys.argv[1])
"""


@pytest.mark.parametrize("how,status", [("error", 1), ("sigterm", -signal.SIGTERM),
                                        ("sigterm-on-a-worker", -signal.SIGTERM)])
def test_a_rank_that_leaves_at_once_removes_the_workspaces_of_its_episodes(how, status):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-c", _EPISODE_IN_FLIGHT, how], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        workspace = proc.stdout.readline().strip()
        assert workspace and os.path.isdir(workspace), proc.communicate(timeout=60)
        if how == "sigterm":
            proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{how}: the rank still runs 20 s later (its handler waits for the main thread's sleep)")
    finally:
        proc.kill()
    assert proc.returncode == status, err  # still the status the launcher's report reads
    assert not os.path.exists(workspace), "the rank left its episode's workspace in the temp dir"
