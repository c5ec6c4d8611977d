"""Guided groups (nano_miles/rollout/guidance.py, rollout.guide_unsolved): a group no sample solved gets the
task's scripted solution as one of its samples, played through the real environment and sandbox and
tokenized as a sampled episode; the update takes the trainer's own log-probs for it and leaves it
out of parity; the step's reward and accuracy stay the policy's."""
import asyncio
import functools
import json

import pytest
import torch

from nano_miles.trainer.loss import AdvantageConfig
from nano_miles.rollout.batch import Trajectory, build_rollout_batch
from nano_miles.rollout.chat_format import ChatFormat
from nano_miles.config import load_config, parse_set
from nano_miles.rollout.dynamic_sampling import TrainRolloutConfig
from nano_miles.rollout.env import EnvConfig
from nano_miles.rollout.guidance import guide_group, unsolved
from nano_miles.models.prepare import load_tokenizer, resolve_model
from nano_miles.rollout.producer import roll_out_step
from nano_miles.rollout.task_stream import TaskStream
from nano_miles.rollout.episode import GroupRunner, group_key, run_episode
from nano_miles.tasks import select_tasks
from nano_miles.telemetry import read_metrics
from nano_miles.train import TrainConfig, TrainingRun
from nano_miles.trainer.trainer import Trainer, TrainerConfig
from nano_miles.trainer.update import policy_update
from tests.nano_miles.rollout.test_dynamic_sampling import ScriptedEngine
from tests.nano_miles.rollout.test_episode import check_invariants

TASKS = "kernel_name,sed_replace,make_tree,numbers_file"


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return load_tokenizer(tiny_model_path)


def _cfg(**kw):
    return TrainRolloutConfig(group_size=2, max_new_tokens=16, env=EnvConfig(max_turns=4), **kw)


def roll_out_guided(url, tok, tasks, cfg, seed):
    """Each task's group played and guided as a training step does (producer.py): GroupRunner.group,
    then guide_group with the runner's scripted episode. Returns (sampled, guided, replaced, rejected)."""
    async def play():
        runner = GroupRunner([url], tok, cfg)
        try:
            sampled, guided, replaced, rejected = [], [], [], 0
            for index, task in enumerate(tasks):
                task_seed, group_id = group_key(task, seed, index)
                group = [t for t in await runner.group(task, task_seed, group_id) if t.prompt_ids]
                got, lost, was_rejected = await guide_group(
                    group, functools.partial(runner.scripted, task, task_seed, group_id))
                sampled += group
                guided += got
                replaced += [] if lost is None else [lost]
                rejected += was_rejected
            return sampled, guided, replaced, rejected
        finally:
            await runner.close()
    return asyncio.run(play())


def test_a_scripted_episode_plays_the_solution_through_the_environment(tok):
    task = select_tasks("sed_replace")[0]
    fmt = ChatFormat(tok)
    traj = asyncio.run(run_episode(None, fmt, task, 11, "g", _cfg(), scripted=True))
    assert traj.scripted and traj.finish_reason == "answer" and traj.reward_components["correct"] == 1.0
    assert traj.num_turns == 3 and traj.weight_versions == []  # two commands, then the answer
    check_invariants(traj, fmt)  # the token path of a sampled episode: TITO prefix, turns closed once
    # The model turns are the solution's commands and the answer, token for token; the observations
    # between them are the sandbox's real output, not trained on.
    acts, current = [], []
    for token, trained in zip(traj.response_ids, traj.response_mask):
        if trained:
            current.append(token)
        elif current:
            acts.append(tok.decode(current))
            current = []
    acts.append(tok.decode(current))
    assert acts[0].startswith("<bash>sed -i ")
    assert acts[1].startswith("<bash>grep -ow") and acts[2].startswith("<answer>")
    answer = acts[2][len("<answer>"):-len("</answer>")]
    observed = tok.decode([t for t, m in zip(traj.response_ids, traj.response_mask) if not m])
    assert answer.isdigit() and f"\n{answer}\n[exit code 0]" in observed
    assert traj.response_logprobs == [0.0] * len(traj.response_ids)  # none sampled: the update fills them in


def test_only_groups_no_sample_solved_are_guided():
    def traj(group, correct, finish="answer"):
        return Trajectory([1], [2], [0.0], [True], reward=correct, reward_components={"correct": correct},
                          finish_reason=finish, group_id=group)
    assert unsolved([traj("a", 0.0), traj("a", 0.0, "max_turns")])
    assert not unsolved([traj("b", 0.0), traj("b", 1.0)])
    assert not unsolved([traj("c", 0.0, "infra_error")])  # the sandbox lost them all: nothing was tried


def test_every_unsolved_group_gets_one_scripted_sample(tok, engine_server):
    """The random model solves nothing: each group keeps its size, its last sample replaced by a
    correct scripted one (same seed: same files and ground truth as the sampled ones)."""
    tasks = select_tasks(TASKS)
    trajs, guided, replaced, rejected = roll_out_guided(engine_server.url, tok, tasks, _cfg(), seed=5)
    assert not any(t.reward_components.get("correct") for t in trajs)
    assert len(guided) == len(trajs) and len(replaced) == len(tasks) and rejected == 0
    for index, task in enumerate(tasks):
        _, group_id = group_key(task, 5, index)
        group = [t for t in guided if t.group_id == group_id]
        assert [t.scripted for t in group] == [False, True] and group[1].task_id == task.id
        assert group[1].reward > group[0].reward and group[1].reward_components["correct"] == 1.0
    assert all(r in trajs and not r.scripted for r in replaced)


def test_a_task_whose_scripted_episode_fails_stays_unguided_and_is_named_once(tok, engine_server, capsys):
    """No scripted solution, one that answers wrong, or one longer than max_turns: the scripted episode
    is thrown away, the group keeps its sampled episodes, the rejection is counted, and stderr names
    the task once, with why."""
    from nano_miles.rollout import guidance
    from nano_miles.tasks.api import Task, TaskInstance

    def bare(ws, rng):
        return TaskInstance("How many lines does f.txt have?", "3", "int")  # no solution

    def wrong(ws, rng):
        ws.write("f.txt", "a\nb\nc\n")
        return TaskInstance("How many lines does f.txt have?", ws.run("wc -l < f.txt"), "int", solution=["echo 7"])

    def long(ws, rng):  # right, but 5 commands and the answer do not fit in max_turns=4
        return TaskInstance("Print 5.", "5", "int", solution=["true"] * 4 + ["echo 5"])

    tasks = [Task("guide_bare", "text", "train", "no solution", bare),
             Task("guide_wrong", "text", "train", "a wrong solution", wrong),
             Task("guide_long", "text", "train", "a solution longer than max_turns", long)]
    guidance._named_rejected.difference_update({"guide_bare", "guide_wrong", "guide_long"})
    for _ in range(2):  # named the first time only
        trajs, guided, replaced, rejected = roll_out_guided(engine_server.url, tok, tasks, _cfg(), seed=5)
        assert guided == trajs and replaced == [] and rejected == 3
        assert not any(t.scripted for t in guided)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("guidance:")]
    assert lines == [
        "guidance: task guide_bare's scripted episode was not judged correct (it has no scripted commands); "
        "its unsolved groups stay unguided",
        "guidance: task guide_wrong's scripted episode was not judged correct (its scripted solution fails "
        "here); its unsolved groups stay unguided",
        "guidance: task guide_long's scripted episode was not judged correct (its scripted solution takes more "
        "than the 4 turns env.max_turns allows); its unsolved groups stay unguided"]


def test_a_step_trains_on_guided_groups_and_measures_only_sampled_episodes(tok):
    """Dynamic sampling would drop every group of an engine that never solves (no signal); with
    guidance each gets a scripted sample and is kept. Reward and accuracy stay those of the sampled
    episodes (the replaced ones included), and the metrics count the guided groups."""
    engine = ScriptedEngine(tok)  # never answers: every sampled episode fails
    try:
        tasks = select_tasks(TASKS)
        off = roll_out_step(1, TaskStream(tasks, seed=3), 2, [engine.url], tok,
                            _cfg(dynamic_sampling=True, max_sampling_rounds=2), run_seed=0)
        assert off.trajectories == [] and off.sampling.metrics()["groups_guided"] == 0
        on = roll_out_step(1, TaskStream(tasks, seed=3), 2, [engine.url], tok,
                           _cfg(dynamic_sampling=True, max_sampling_rounds=2, guide_unsolved=True), run_seed=0)
    finally:
        engine.close()
    m = on.sampling.metrics()
    assert m["groups_guided"] == 2 and m["groups_kept"] == 2 and on.sampling.rounds == 1
    assert m["groups_guide_rejected"] == 0
    assert [t.scripted for t in on.trajectories] == [False, True, False, True]
    assert len(on.generated) == 4 and not any(t.scripted for t in on.generated)  # 2 trained on, 2 replaced
    assert all(t.reward_components["correct"] == 0 for t in on.generated)


def test_the_update_gives_a_scripted_sample_the_trainers_log_probs_and_leaves_it_out_of_parity():
    trainer = Trainer(TrainerConfig(model=str(resolve_model("tiny-random-qwen2"))))
    sampled = Trajectory([1, 2, 3], [4, 5, 6], [-1.0] * 3, [True] * 3, reward=0.0, group_id="g")
    demo = Trajectory([1, 2, 3], [7, 8, 9], [0.0] * 3, [True] * 3, reward=1.0, group_id="g", scripted=True)
    batch = build_rollout_batch([sampled, demo])
    assert batch.scripted.tolist() == [False, True] and batch.select([1]).scripted.tolist() == [True]
    parity = (trainer.logprobs(batch) - batch.rollout_logprobs).abs()[0][batch.loss_mask[0]]
    metrics, skipped = policy_update(trainer, [sampled, demo], AdvantageConfig(), pad_id=0)
    assert skipped is None and trainer.step == 1
    # Only the sampled row is measured; the demo's made-up 0.0 log-probs (probability 1) are not.
    assert metrics["logprob_diff_max"] == pytest.approx(float(parity.max()), abs=1e-5)
    assert metrics["logprob_diff_mean"] == pytest.approx(float(parity.mean()), abs=1e-5)
    # Its TIS weight is 1: a weight exp(old - 0) < 1 would shrink the demo's gradient; a ratio of 1 keeps it.
    assert metrics["ratio_max"] == 1.0
    assert Trajectory.from_dict(json.loads(demo.to_json())).scripted


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_train_with_guide_unsolved_records_the_guided_groups(mode, tmp_path):
    """The whole loop on the random model (it never solves anything): every step trains on guided
    groups, and metrics.jsonl says how many."""
    sets = ["model=tiny-random-qwen2", "rollout.max_new_tokens=8", "rollout.env.max_turns=3", "rollout.group_size=2",
            "tasks_per_step=2", f"tasks={TASKS}", "rollout.guide_unsolved=true", "rollout.dynamic_sampling=true",
            "report_to=none", f"run_dir={tmp_path / 'run'}", "steps=2", f"mode={mode}"]
    TrainingRun(load_config(TrainConfig, None, parse_set(sets)), echo=lambda *a: None).run()
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["groups_guided"] >= 1 and not row["update_skipped"]
        assert row["trajectories"] == 2 * row["groups_kept"] and row["acc"] == 0.0
        # Async rows sampled by the previous weights are measured apart; parity is None when none is fresh.
        fresh, stale = row["parity_mean"], row["parity_stale_mean"]
        assert fresh is not None if mode == "sync" else (fresh is not None or stale is not None)
        assert all(torch.isfinite(torch.tensor(v)) for v in (fresh, stale) if v is not None)


def test_with_several_updates_the_scripted_rows_take_the_log_probs_taken_before_the_first():
    """updates=2: the trainer's log-probs before the first step are computed once for the ratio; the
    scripted rows take theirs from there, and parity stays that of the sampled rows."""
    trainer = Trainer(TrainerConfig(model=str(resolve_model("tiny-random-qwen2"))))
    trajs = []
    for g in ("a", "b"):
        trajs.append(Trajectory([1, 2, 3], [4, 5, 6], [-1.0] * 3, [True] * 3, reward=0.0, group_id=g))
        trajs.append(Trajectory([1, 2, 3], [7, 8, 9], [0.0] * 3, [True] * 3, reward=1.0, group_id=g, scripted=True))
    batch = build_rollout_batch(trajs)
    parity = (trainer.logprobs(batch) - batch.rollout_logprobs).abs()[batch.loss_mask & ~batch.scripted[:, None]]
    metrics, skipped = policy_update(trainer, trajs, AdvantageConfig(), pad_id=0, updates=2)
    assert skipped is None and trainer.step == 2 and metrics["updates"] == 2
    assert metrics["logprob_diff_max"] == pytest.approx(float(parity.max()), abs=1e-5)
    assert metrics["logprob_diff_mean"] == pytest.approx(float(parity.mean()), abs=1e-5)
