"""Evaluation inside a training run (`eval_every`, nano_miles/evaluate.py's RunEvaluation): a real run
(tiny-random-qwen2, real engine, real sandbox) writes eval columns into metrics.jsonl, TensorBoard
and the PNG curves, and the evaluations never move the training data position.

Task instances (`nano-miles eval --set instances=N`, train's `eval_instances`): each task runs on several
seeded draws of its files and ground truth; pass@1 averages over all of them, pass@k over the
per-instance estimators."""
import json
import sys

import pytest
from safetensors import safe_open

from nano_miles import cli
from nano_miles.rollout.batch import Trajectory
from nano_miles.trainer.checkpoint import save_checkpoint
from nano_miles.config import ConfigError, load_config, parse_set
from nano_miles.engine.weights import checksums
from nano_miles.evaluate import RunEvaluation, alfa_subset, lost, pass_at_k, per_family, solved_by_task
from nano_miles.models.prepare import load_tokenizer
from nano_miles.rollout.task_stream import TaskStream
from nano_miles.tasks import select_tasks
from nano_miles.telemetry import read_metrics
from nano_miles.train import TrainConfig, TrainingRun
from tests.nano_miles.trainer.test_checkpoint import _batch, _trainer
from tests.nano_miles.test_telemetry import tensorboard_scalars

FAST = ["model=tiny-random-qwen2", "rollout.max_new_tokens=16", "rollout.env.max_turns=1", "rollout.group_size=2",
        "tasks_per_step=2", "checkpoint_every=1"]


def _config(*sets):
    return load_config(TrainConfig, None, parse_set(FAST + list(sets)))


def _expected_task_ids(steps, seed=0, per_step=2, group=2):
    stream = TaskStream(select_tasks("train"), seed)
    return [[t.id for t in stream.take(per_step) for _ in range(group)] for _ in range(steps)]


def test_eval_every_measures_the_policy_and_leaves_the_training_stream_alone(tmp_path):
    run_dir = tmp_path / "run"
    printed = []
    sets = ["eval_every=2", "eval_tasks=kernel_name,md5_file", "eval_alfa_tasks=2", f"run_dir={run_dir}", "keep_best=true"]
    TrainingRun(_config("steps=3", *sets), echo=printed.append).run()
    rows = read_metrics(run_dir / "metrics.jsonl")
    evaluated = [r for r in rows if "eval_seconds" in r]
    # the base policy before any training (a row of its own, step 0), every 2 steps, and after the last one
    assert [r["step"] for r in evaluated] == [0, 2, 3]
    assert set(rows[0]) - {"step"} == {key for key in evaluated[1] if key.startswith("eval_")}  # eval alone
    for r in evaluated:
        assert 0.0 <= r["eval_pass_at_1"] <= 1.0 and r["eval_task_count"] == 2 and r["eval_seconds"] > 0
        mine = {k: v for k, v in r["eval_by_task"].items() if not k.startswith("alfa_")}  # pass@1 of each task
        assert set(mine) == {"kernel_name", "md5_file"} and sum(mine.values()) / 2 == r["eval_pass_at_1"]
        assert len(r["eval_by_task"]) == 2 + r["eval_alfa_task_count"]
        # ALFA: scored, or left out with the reason when this sandbox cannot mount its paths; never lost
        assert r["eval_alfa_task_count"] + r["eval_alfa_unavailable"] == 2
        assert r["eval_alfa_pass_at_1"] is None or 0.0 <= r["eval_alfa_pass_at_1"] <= 1.0
    lines = [line for line in printed if line.startswith("eval ")]
    assert lines[0].startswith("eval of the base policy (step 0): 1 instance(s) x 1 sample(s) a task, 2 tasks pass@1 ")
    assert lines[1].startswith("eval after step 2: ") and len(lines) == 3
    assert [s for s, _ in tensorboard_scalars(run_dir)["eval_pass_at_1"]] == [0, 2, 3]
    assert (run_dir / "eval_pass_at_1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The evaluations took no task from the training stream: the run trained on what a run without
    # them would, and a resumed run continues the same order (with no second step 0).
    assert [r["task_ids"] for r in rows[1:]] == _expected_task_ids(3)
    # keep_best: best/ is the trained policy that first scored highest on the eval tasks (ALFA aside)
    trained = [r for r in evaluated if r["step"] > 0]
    first_best = max(trained, key=lambda r: (r["eval_pass_at_1"], -r["step"]))
    assert json.loads((run_dir / "best" / "best.json").read_text()) == {
        "step": first_best["step"], "eval_pass_at_1": first_best["eval_pass_at_1"]}
    with safe_open(str(run_dir / "best" / "model.safetensors"), "pt") as f:
        assert len(list(f.keys())) > 0 and (run_dir / "best" / "config.json").exists()
    assert f"keep_best: the policy after step {first_best['step']} is the best so far on the eval tasks " \
           f"({first_best['eval_pass_at_1']:.3f}), exported to {run_dir / 'best'}" in printed
    TrainingRun(_config("steps=4", *sets), resume_dir=str(run_dir), echo=printed.append).run()
    rows = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and [r["task_ids"] for r in rows[1:]] == _expected_task_ids(4)
    assert "eval_seconds" in rows[4]


def test_keep_best_picks_only_a_trained_policy_that_beats_every_earlier_one_resumed_runs_included(tmp_path):
    evaluation, best_dir = RunEvaluation(_config("steps=9", "eval_every=2", "keep_best=true")), tmp_path / "best"
    picks = [evaluation.new_best(step, {"eval_pass_at_1": score}, best_dir)
             for step, score in ((0, 0.5), (2, 0.2), (4, 0.2), (6, 0.1), (8, 0.3), (9, None))]
    assert picks == [False, True, False, False, True, False]  # step 0 is the base model; ties keep the earlier
    best_dir.mkdir()
    (best_dir / "best.json").write_text(json.dumps({"step": 8, "eval_pass_at_1": 0.3}))
    resumed = RunEvaluation(_config("steps=12", "eval_every=2", "keep_best=true"))
    assert [resumed.new_best(s, {"eval_pass_at_1": v}, best_dir) for s, v in ((10, 0.25), (12, 0.4))] == [False, True]
    off = RunEvaluation(_config("steps=4", "eval_every=2"))
    assert not off.new_best(2, {"eval_pass_at_1": 1.0}, best_dir)
    with pytest.raises(ValueError, match="keep_best needs eval_every"):
        _config("keep_best=true")


def test_a_bad_eval_selection_is_one_line_before_anything_loads(tmp_path):
    with pytest.raises(ConfigError, match=r"^eval_tasks: unknown task 'nope'; known: "):
        TrainingRun(_config("eval_every=1", "eval_tasks=nope", f"run_dir={tmp_path / 'run'}"))
    assert not (tmp_path / "run").exists()


def test_without_icalfa_the_alfa_part_is_left_out_with_one_line(monkeypatch):
    printed = []
    monkeypatch.setitem(sys.modules, "icalfa", None)  # what importlib sees when the package is not installed
    assert alfa_subset(5, printed.append) == []
    assert printed == ["eval: the ALFA part is left out: the alfa tasks need the icalfa package: pip install "
                       "icalfa==0.3.6 (the project's [alfa] extra)"]


def test_the_alfa_subset_is_the_same_in_every_run_and_the_schedule_ends_with_the_last_step():
    first = [t.id for t in alfa_subset(20)]
    assert first == [t.id for t in alfa_subset(20)] and len(set(first)) == 20
    assert all(t.startswith("alfa_") for t in first) and len({t.split("_")[1] for t in first}) > 1
    evaluation = RunEvaluation(_config("steps=5", "eval_every=2", "eval_alfa_tasks=0"))
    assert [s for s in range(1, 6) if evaluation.due(s)] == [2, 4, 5]
    assert not any(RunEvaluation(_config("steps=5")).due(s) for s in range(1, 6))  # eval_every = 0: off


# ---- task instances ------------------------------------------------------------------------------

def _sample(task_id, instance, correct):
    return Trajectory([1], [2], [-1.0], [True], reward_components={"correct": float(correct)}, task_id=task_id,
                      group_id=f"{task_id}-s{instance}")


def test_pass_at_1_averages_all_samples_and_pass_at_k_the_instances_estimators():
    tasks = select_tasks("kernel_name,md5_file")  # families system and hashing
    trajs = [_sample("kernel_name", 0, c) for c in (1, 1)] + [_sample("kernel_name", 1, c) for c in (0, 0)] + \
            [_sample("md5_file", 2, c) for c in (1, 0)] + [_sample("md5_file", 3, c) for c in (0, 0)]
    table = per_family(trajs, tasks, 2)
    # kernel_name: 2 of 4 samples, pass@2 1 on its first instance and 0 on its second (pooled it would be 5/6);
    # md5_file: 1 of 4 samples, pass@2 1 and 0 again
    assert table == {"hashing": {"tasks": 1, "pass@1": 0.25, "pass@2": 0.5},
                     "system": {"tasks": 1, "pass@1": 0.5, "pass@2": 0.5},
                     "all": {"tasks": 2, "pass@1": 0.375, "pass@2": 0.5}}
    # an instance that lost a sample to a setup failure weighs as much as the others: kernel_name's
    # instances score 1/1 and 0/2, so 0.5 (pooled over samples it would be 1/3)
    short = [_sample("kernel_name", 0, 1)] + [_sample("kernel_name", 1, c) for c in (0, 0)]
    assert per_family(short, tasks, 2)["system"] == {"tasks": 1, "pass@1": 0.5, "pass@2": 0.5}
    # one instance a task: the figures are the estimator's on the task's samples, as before instances
    one = [_sample("kernel_name", 0, c) for c in (1, 0, 0)] + [_sample("md5_file", 1, c) for c in (1, 1, 0)]
    assert per_family(one, tasks, 2)["all"] == {"tasks": 2, "pass@1": (pass_at_k(3, 1, 1) + pass_at_k(3, 2, 1)) / 2,
                                                "pass@2": (pass_at_k(3, 1, 2) + pass_at_k(3, 2, 2)) / 2}


def test_episodes_the_sandbox_or_engine_broke_are_left_out_and_said():
    """An engine that runs out of memory aborts episodes; scored as failures they would pull the model's
    pass@k down. Such episodes say nothing about the model: they are left out and counted in one line."""
    tasks = select_tasks("kernel_name,md5_file")
    broken = Trajectory([1], [2], [-1.0], [True], reward_components={"infra_failures": 1, "error": "engine error: "
                        "OutOfMemoryError: CUDA out of memory"}, finish_reason="infra_error", task_id="kernel_name",
                        group_id="kernel_name-s0")
    trajs = [_sample("kernel_name", 0, 1), broken, broken, _sample("md5_file", 1, 0)]
    assert per_family(trajs, tasks, 1)["all"] == {"tasks": 2, "pass@1": 0.5}
    assert lost(trajs).startswith("2 of 4 episodes broke on the sandbox or the engine and are left out of every "
                                  "score: engine error: OutOfMemoryError: CUDA out of memory")
    assert "kernel_name" not in per_family([broken], tasks, 1) and lost(trajs[:1]) == ""
    assert solved_by_task(trajs) == {"kernel_name": [True], "md5_file": [False]}  # the in-run eval_by_task


def test_eval_runs_every_task_on_its_instances_and_says_on_what(engine_server, tiny_model_path, tmp_path, capsys):
    out, results = tmp_path / "e.jsonl", tmp_path / "results.jsonl"
    sets = ("instances=2", "seed=3", "rollout.env.max_turns=1", "rollout.max_new_tokens=8", "rollout.temperature=0.7")
    assert cli.main(["eval", "--model", str(tiny_model_path), "--engine-url", engine_server.url, "--tasks",
                     "kernel_name,md5_file", "--samples", "2", *(a for kv in sets for a in ("--set", kv)),
                     "--out", str(out), "--results-jsonl", str(results)]) == 0
    printed = capsys.readouterr().out
    assert f"{tiny_model_path} on kernel_name,md5_file: 2 tasks x 2 instances x 2 samples in " in printed
    assert "(seed 3, temperature 0.7)" in printed
    trajs = [Trajectory.from_dict(json.loads(line)) for line in out.read_text().splitlines()]
    groups = {}
    for t in trajs:
        groups.setdefault(t.task_id, {}).setdefault(t.group_id, []).append(t)
    # each copy of a task in the list is an instance with a task seed of its own: seed * 100_003 + its position
    assert {task: sorted(g) for task, g in groups.items()} == {
        "kernel_name": ["kernel_name-s300009", "kernel_name-s300010"], "md5_file": ["md5_file-s300011", "md5_file-s300012"]}
    assert all(len(samples) == 2 for g in groups.values() for samples in g.values())
    row = json.loads(results.read_text())
    assert (row["kind"], row["instances"], row["samples"], row["seed"], row["temperature"]) == ("eval", 2, 2, 3, 0.7)
    assert row["episodes"] == 8 and row["per_family"] == per_family(trajs, select_tasks("kernel_name,md5_file"), 2)


def test_instances_below_one_are_one_line_and_exit_2(capsys):
    assert cli.main(["eval", "--set", "instances=0"]) == 2
    err = capsys.readouterr().err
    assert err == "nano-miles eval: instances must be >= 1, got 0\n"
    with pytest.raises(ValueError, match="eval_samples and eval_instances >= 1"):
        _config("eval_instances=0")


def test_the_run_evaluates_each_eval_task_on_eval_instances_instances(engine_server, tiny_model_path):
    printed = []
    evaluation = RunEvaluation(_config("eval_every=1", "eval_tasks=kernel_name,md5_file", "eval_instances=2",
                                       "eval_alfa_tasks=0"), echo=printed.append)
    tok = load_tokenizer(tiny_model_path)
    trajs = evaluation.episodes([engine_server.url], tok)
    assert sorted((t.task_id, t.group_id) for t in trajs) == [  # eval_samples = 1 on each of 2 instances
        ("kernel_name", "kernel_name-s0"), ("kernel_name", "kernel_name-s1"),
        ("md5_file", "md5_file-s2"), ("md5_file", "md5_file-s3")]
    evaluated = evaluation.after_step(1, [engine_server.url], tok)
    assert evaluated["eval_task_count"] == 2 and set(evaluated["eval_by_task"]) == {"kernel_name", "md5_file"}
    assert all(v in (0.0, 0.5, 1.0) for v in evaluated["eval_by_task"].values())  # the mean of 2 instances' samples
    assert printed[0].startswith("eval after step 1: 2 instance(s) x 1 sample(s) a task, 2 tasks pass@1 ")


# ---- a run's folders as --model -------------------------------------------------------------------

def test_eval_takes_a_runs_checkpoint_as_its_model(engine_server, restore_engine_weights, tmp_path, capsys):
    """A run stopped before final/ leaves checkpoint/: the engine loads its weights as a model folder's,
    and eval takes it as --model (its tokenizer, its name), as it takes final/."""
    trainer = _trainer()
    trainer.train_step(*_batch(1))
    save_checkpoint(tmp_path / "run", trainer, {"step": 1, "data_position": 2})
    ckpt = tmp_path / "run" / "checkpoint"
    client = engine_server.client()
    client.update_weights_from_disk(ckpt)
    served = client.weights_checksum()["checksums"]
    assert served == checksums((n, m) for n, m in zip(trainer.names, trainer.masters) if n in served)
    client.close()
    assert cli.main(["eval", "--model", str(ckpt), "--engine-url", engine_server.url, "--tasks", "kernel_name",
                     "--samples", "1", "--set", "rollout.env.max_turns=1", "--set", "rollout.max_new_tokens=4"]) == 0
    assert f"{ckpt} on kernel_name: 1 tasks x 1 instances x 1 samples in " in capsys.readouterr().out


def test_a_run_directory_or_a_sharded_checkpoint_as_the_model_names_the_folders_that_are_models(tmp_path, capsys):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoint").mkdir(parents=True)  # what N trainer ranks write: shards, no model config
    (run_dir / "checkpoint" / "state.json").write_text("{}")
    (run_dir / "config.json").write_text("{}")  # the run's config, not a model's
    for model in (run_dir, run_dir / "checkpoint"):
        assert cli.main(["eval", "--model", str(model)]) == 2
        assert capsys.readouterr().err.endswith(": it has no model folder yet (final/ at the end of the run, best/ "
                                                "with keep_best, checkpoint/ when one process trains)\n")
    (run_dir / "best").mkdir()
    (run_dir / "best" / "config.json").write_text("{}")
    assert cli.main(["eval", "--model", str(run_dir / "checkpoint")]) == 2
    assert capsys.readouterr().err == (f"nano-miles eval: {run_dir / 'checkpoint'} is a checkpoint of sharded trainer "
                                       f"ranks, not a model: its models are {run_dir / 'best'}\n")
    assert cli.main(["eval", "--model", str(run_dir)]) == 2
    assert capsys.readouterr().err == (f"nano-miles eval: {run_dir} is a training run's directory, not a model: its "
                                       f"models are {run_dir / 'best'}\n")
