"""bench/multi_gpu.sh, the harness of every GPU round, rehearsed on the CPU as the device runs it: one
training arm and the base model side by side in the background, then a watch call that packs what
each produced. Tiny model, 2 steps, two ALFA tasks and two held-out ones: a broken phase here would cost a GPU session."""
import json
import os
import subprocess
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHORT = "--set rollout.max_new_tokens=8 --set rollout.env.max_turns=1"
HELDOUT = "md5_file,base64_decode"  # two held-out tasks stand for the split


def multi_gpu(phase, tmp_path, **env):
    env = {**os.environ, "MG_DIR": str(tmp_path / "mg"), "OUT": str(tmp_path / "out"), "MODEL": "tiny-random-qwen2",
           "BENCH_COMMIT": "rehearsal", "STEPS": "2", "INSTANCES": "1", "SAMPLES": "2", "TRAJ": "1", "GREEDY": "1",
           "ALFA_TASKS": "alfa_fs1_0,alfa_fs1_3", "ALFA_SAMPLES": "1", "WATCH": "1", "HELDOUT": HELDOUT,
           "EVAL_EXTRA": f"{SHORT} --set rollout.temperature=0.7", **env}
    out = subprocess.run(["bash", "bench/multi_gpu.sh", phase], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def unpacked(tmp_path, arm) -> Path:
    with tarfile.open(tmp_path / "out" / f"arm-{arm}.tar.gz") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    return tmp_path / "unpacked" / arm


def evals(folder: Path) -> list[tuple]:
    rows = [json.loads(line) for line in (folder / "evals.jsonl").read_text().splitlines()]
    assert {r["commit"] for r in rows} == {"rehearsal"}
    return sorted((r["tasks"], r["instances"], r["samples"], r["temperature"], r["episodes"]) for r in rows)


def test_an_arm_and_the_base_model_run_in_the_background_and_come_back_packed(tmp_path):
    multi_gpu("learn-start", tmp_path, ARM="a", EXTRA=f"{SHORT} --set tasks_per_step=2 --set rollout.group_size=2 "
              "--set eval_every=1 --set eval_alfa_tasks=0 --set eval_tasks=nth_line --set rollout.guide_unsolved=true")
    multi_gpu("base-start", tmp_path, SAMPLED="1")
    watched = multi_gpu("learn-watch", tmp_path, ARMS="a base", WATCH="240")
    assert watched.count("=== learn done") == 2, watched
    assert "eval after step 2: 1 instance(s) x 1 sample(s) a task, 1 tasks pass@1" in watched  # the in-run evaluation

    arm = unpacked(tmp_path, "a")
    steps = [json.loads(line)["step"] for line in (arm / "learn_metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]  # the base policy's evaluation, then the two training steps
    alfa = "alfa_fs1_0,alfa_fs1_3"
    # the final policy: ALFA at the arms' temperature, greedy held-out (INSTANCES x SAMPLES instances of one
    # sample) and ALFA, and held-out at the arms' temperature with its episodes (TRAJ=1)
    assert evals(arm) == [(alfa, 1, 1, 0.0, 2), (alfa, 1, 1, 0.7, 2), (HELDOUT, 1, 2, 0.7, 4),
                          (HELDOUT, 2, 1, 0.0, 4)]
    assert len((arm / "heldout_final.jsonl").read_text().splitlines()) == 4
    assert len((arm / "alfa_final.jsonl").read_text().splitlines()) == 2  # what the policy ran on ALFA
    assert {"learn_train.log", "eval_learn_alfa.log", "eval_learn_alfa_greedy.log", "eval_learn_heldout_greedy.log",
            "eval_learn_heldout_traj.log"} <= {p.name for p in arm.iterdir()}
    # the base model (SAMPLED=1): the same four evaluations
    base = unpacked(tmp_path, "base")
    assert evals(base) == evals(arm)
