"""DAPO dynamic sampling (nano_miles/rollout/dynamic_sampling.py, run by producer.roll_out_step): groups whose
samples all got the same reward are dropped and the batch is refilled from the task stream, within a
bound, in both producer modes.

A random model never answers, so every group it plays has equal rewards. The groups with a signal
come from a scripted engine: a real HTTP server speaking SGLang's /generate whose replies are
scripted per task (the model side of the test, as ScriptedPolicy in test_episode.py); the rollout,
the sandbox, the environment and its verifier are the real ones. The end-to-end run uses the real
engine with tiny-random-qwen2."""
import json
import math
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from nano_miles.engine.client import EngineUnavailable
from nano_miles.rollout.batch import Trajectory
from nano_miles.config import ConfigError, load_config, parse_set
from nano_miles.rollout.dynamic_sampling import TrainRolloutConfig, has_signal
from nano_miles.engine.model import ModelConfig
from nano_miles.rollout.env import EnvConfig, default_sandbox
from nano_miles.rollout.episode import group_key
from nano_miles.memory_plan import job_kv_cache_bytes
from nano_miles.models.prepare import load_tokenizer
from nano_miles.rollout.producer import AsyncProducer, SyncProducer, play_step_rollout, roll_out_step, step_seed
from nano_miles.rollout.task_stream import TaskStream
from nano_miles.tasks import select_tasks
from nano_miles.telemetry import read_metrics
from nano_miles.train import RunFailed, TrainConfig, TrainingRun

TASKS = "kernel_name,md5_file,nth_line,word_count_total"


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return load_tokenizer(tiny_model_path)


class ScriptedEngine:
    """/generate over HTTP: for a task in `mixed`, the first episode of each group to ask answers
    `linux` at once (reward 1.0 on kernel_name, 0.0 elsewhere), every other turn is text without a tag
    (a format penalty each turn): its groups' rewards differ. Other tasks' groups get only text
    without a tag: equal rewards, no signal."""

    def __init__(self, tok, mixed=()):
        self.tok, self.mixed, self.answered = tok, set(mixed), set()
        self.im_end = tok.convert_tokens_to_ids("<|im_end|>")
        self.lock = threading.Lock()
        engine = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, reply = engine.answer(body)
                reply = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def answer(self, body: dict) -> tuple[int, dict]:
        return 200, self.reply(body)

    def reply(self, body: dict) -> dict:
        group, turn = body["rid"].split("-t")  # rid = {task id}-s{task seed}-{task seed}-t{turn}-{hex}
        task_id = group.split("-s")[0]
        with self.lock:
            answer = task_id in self.mixed and turn.startswith("0-") and group not in self.answered
            if answer:
                self.answered.add(group)
        ids = self.tok.encode("<answer>linux</answer>" if answer else "let me think", add_special_tokens=False)
        ids.append(self.im_end)
        return {"output_ids": ids, "meta_info": {"finish_reason": {"type": "stop", "matched": self.im_end},
                                                 "weight_version": "0",
                                                 "output_token_logprobs": [[-0.5, i, None] for i in ids]}}

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def scripted(tok):
    engines = []

    def make(mixed):
        engines.append(ScriptedEngine(tok, mixed))
        return engines[-1]
    yield make
    for e in engines:
        e.close()


def _cfg(**kw):
    return TrainRolloutConfig(group_size=2, max_new_tokens=16, env=EnvConfig(max_turns=2), **kw)


def _expected(order, position, mixed, target, max_rounds=100):
    """What the step should take from the stream `order` at `position`: (tasks taken, rounds' worth):
    a first wave of `target` tasks, then one more for each group without a signal, until `target`
    groups have one or max_rounds x target groups were started."""
    n = target
    while sum(t in mixed for t in order[position:position + n]) < target and n < max_rounds * target:
        n += 1
    return order[position:position + n], math.ceil(n / target)


def _signal(trajs) -> bool:
    groups: dict[str, set] = {}
    for t in trajs:
        groups.setdefault(t.group_id, set()).add(t.reward)
    return all(len(r) > 1 for r in groups.values())


def test_a_group_has_a_signal_when_the_samples_training_uses_disagree():
    def traj(group, reward, finish="answer"):
        return Trajectory([1], [2], [0.0], [True], reward=reward, finish_reason=finish, task_id=group, group_id=group)
    assert has_signal([traj("a", 1.0), traj("a", 0.0)])
    assert not has_signal([traj("b", 0.0), traj("b", 0.0)])
    # c's second sample was lost to the sandbox (never trained on): one sample left, no signal
    assert not has_signal([traj("c", 1.0), traj("c", 0.0, "infra_error")])
    assert not has_signal([traj("d", 1.0)])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_groups_without_a_signal_are_dropped_and_the_batch_refilled(mode, tok, scripted):
    tasks = select_tasks(TASKS)
    mixed = {"kernel_name", "nth_line"}
    engine = scripted(mixed)
    stream = TaskStream(tasks, seed=3)
    order = [t.id for t in TaskStream(tasks, seed=3).take(4 * len(tasks))]
    cfg = _cfg(dynamic_sampling=True, max_sampling_rounds=8)

    def roll_out(step, desc, carry):
        return play_step_rollout(step, stream, 2, [engine.url], tok, cfg, run_seed=0, desc=desc, carry=carry)
    producer = SyncProducer(roll_out) if mode == "sync" else AsyncProducer(roll_out, last_step=2)
    producer.start(1)
    try:
        got = [producer.get(1), producer.get(2)]
    finally:
        producer.stop()
    position = 0
    for rollout in got:
        # the step's batch: the next two tasks of the stream whose groups have a signal, nothing else
        taken, rounds = _expected(order, position, mixed, 2)
        position += len(taken)
        assert rollout.stream_state["position"] == position
        assert [t.task_id for t in rollout.trajectories] == [t for t in taken if t in mixed for _ in range(2)]
        assert _signal(rollout.trajectories) and len(rollout.trajectories) == 4
        assert sorted({t.task_id for t in rollout.dropped}) == sorted({t for t in taken if t not in mixed})
        assert all(t.reward == pytest.approx(-0.2) for t in rollout.dropped)  # two turns without a tag
        m = rollout.sampling.metrics()
        dropped = len(taken) - 2
        assert (m["groups_generated"], m["groups_kept"], m["groups_dropped"]) == (len(taken), 2, dropped)
        assert m["dropped_group_share"] == m["zero_variance_share"] == pytest.approx(dropped / len(taken))
        assert m["sampling_rounds"] == rounds
        assert m["sampling_note"] is None and rollout.skip_reason is None
    assert any(r.sampling.rounds > 1 for r in got)  # this seed's order needs a refill


def test_the_bound_stops_the_refill_and_the_metrics_say_so(tok, scripted):
    tasks = select_tasks(TASKS)
    engine = scripted({"kernel_name"})  # one task in four has a signal
    stream = TaskStream(tasks, seed=3)
    order = [t.id for t in TaskStream(tasks, seed=3).take(8)]
    cfg = _cfg(dynamic_sampling=True, max_sampling_rounds=2)
    rollout = roll_out_step(1, stream, 3, [engine.url], tok, cfg, run_seed=0)
    taken, rounds = _expected(order, 0, {"kernel_name"}, 3, max_rounds=2)
    kept = taken.count("kernel_name")
    assert rollout.sampling.rounds == rounds == 2 and kept < 3 and rollout.stream_state["position"] == len(taken)
    assert [t.task_id for t in rollout.trajectories] == ["kernel_name"] * 2 * kept
    m = rollout.sampling.metrics()
    assert m["groups_kept"] == kept and m["groups_generated"] == len(taken)
    assert m["sampling_note"].startswith(f"dynamic sampling: {kept} of 3 groups with a learning signal after 2 "
                                         "round(s)")
    assert "rollout.max_sampling_rounds=2" in m["sampling_note"]
    # Nothing with a signal at all: the step has nothing to train on, and says why.
    nothing = scripted(set())
    rollout = roll_out_step(2, TaskStream(tasks, seed=3), 2, [nothing.url], tok, cfg, run_seed=0)
    assert rollout.trajectories == [] and len(rollout.dropped) == 8
    assert rollout.sampling.metrics()["dropped_group_share"] == 1.0
    assert rollout.skip_reason.endswith("nothing to train on, update skipped")


def test_oversampled_surplus_is_not_trained_on_and_off_means_unfiltered(tok, scripted):
    tasks = select_tasks(TASKS)
    engine = scripted({t.id for t in tasks})  # every group has a signal
    rollout = roll_out_step(1, TaskStream(tasks, seed=3), 2, [engine.url], tok,
                            _cfg(dynamic_sampling=True, oversample=2.0), run_seed=0)
    assert rollout.sampling.rounds == 1 and rollout.stream_state["position"] == 4  # one round of 2 x 2 groups
    assert len(rollout.trajectories) == 4 and len(rollout.dropped) == 4  # the surplus: rolled out, not trained on
    assert rollout.sampling.metrics()["groups_dropped"] == 0
    # Off: every group is trained on; the share without a signal is still measured.
    half = scripted({"kernel_name", "nth_line"})
    stream = TaskStream(tasks, seed=3)
    rollout = roll_out_step(1, stream, 4, [half.url], tok, _cfg(), run_seed=0)
    assert len(rollout.trajectories) == 8 and rollout.dropped == [] and stream.position == 4
    m = rollout.sampling.metrics()
    assert (m["groups_generated"], m["groups_kept"], m["groups_dropped"], m["zero_variance_share"]) == (4, 4, 0, 0.5)


class HeldEngine(ScriptedEngine):
    """A ScriptedEngine that holds its replies to the first group of step 1 (run seed 0) until a group
    started after the first wave asks for a turn (`released`: it did), or, with `refills_fail`, until
    the engine is closed, answering the later groups 503 (the engine is gone)."""

    def __init__(self, tok, mixed, first_wave: int, refills_fail: bool = False):
        super().__init__(tok, mixed)
        self.first_wave, self.refills_fail = first_wave, refills_fail
        self.refill_asked, self.holding, self.closing = threading.Event(), threading.Event(), threading.Event()
        self.released = None

    def answer(self, body: dict) -> tuple[int, dict]:
        task_seed = int(body["rid"].split("-t")[0].rsplit("-", 1)[1])  # rid = {group id}-{task seed}-t{turn}-{hex}
        index = task_seed - step_seed(0, 1) * 100_003  # group_key: task seed = step seed x 100_003 + index
        if index >= self.first_wave:
            self.refill_asked.set()
            if self.refills_fail:
                self.holding.wait(timeout=120)  # fail once group 0 is surely running
                return 503, {"error": {"message": "the engine is gone"}}
        elif index == 0 and self.refills_fail:
            self.holding.set()
            self.closing.wait(timeout=120)
        elif index == 0:
            self.released = self.refill_asked.wait(timeout=120)
        return super().answer(body)

    def close(self):
        self.closing.set()
        super().close()


class GatedEngine(ScriptedEngine):
    """A ScriptedEngine that holds every turn of step 1's first group (run seed 0) until `gate` is set."""

    def __init__(self, tok):
        super().__init__(tok)
        self.gate, self.held = threading.Event(), threading.Event()

    def answer(self, body: dict) -> tuple[int, dict]:
        task_seed = int(body["rid"].split("-t")[0].rsplit("-", 1)[1])
        if task_seed == step_seed(0, 1) * 100_003:  # group_key: the index-0 group of step 1
            self.held.set()
            self.gate.wait(timeout=120)
        return super().answer(body)


def test_with_carry_over_a_step_takes_the_groups_that_came_back_and_carries_the_slowest_on(tok):
    """Step 1 is handed over while its first group is still held; that group goes on into step 2 (as a
    pending task of step 1's stream state, which a resume rolls out first) and is trained on there."""
    tasks = select_tasks(TASKS)
    slow = TaskStream(tasks, seed=3).take(1)[0].id
    engine, stream = GatedEngine(tok), TaskStream(tasks, seed=3)

    def roll_out(step, desc, carry):
        return play_step_rollout(step, stream, 2, [engine.url], tok, _cfg(), run_seed=0, desc=desc, carry=carry)
    producer = AsyncProducer(roll_out, last_step=2, carry_over=True)
    producer.start(1)
    try:
        first = producer.get(1)
        assert engine.held.is_set() and not engine.gate.is_set()  # the slow group was running throughout
        assert len(first.trajectories) == 4 and slow not in {t.task_id for t in first.trajectories}
        assert first.stream_state["pending"][0] == slow and first.sampling.metrics()["groups_carried"] >= 1
        engine.gate.set()
        second = producer.get(2)
        assert slow in {t.task_id for t in second.trajectories} and len(second.trajectories) == 4
    finally:
        engine.gate.set()
        producer.stop()
        engine.close()
    resumed = TaskStream(tasks, seed=3)
    resumed.restore(first.stream_state)
    assert resumed.take(1)[0].id == slow  # a resume from step 1 rolls the carried group out first


def test_a_refill_starts_while_the_first_wave_is_still_running(tok):
    """Group 0 cannot end before a refill group has asked for a turn: the step still ends, with the
    groups with a signal in the order they were started (group 0 first, though it ended last)."""
    tasks = select_tasks(TASKS)
    order = [t.id for t in TaskStream(tasks, seed=3).take(4)]
    engine = HeldEngine(tok, mixed={order[0], order[2]}, first_wave=2)  # group 1 has no signal: it is refilled
    try:
        rollout = roll_out_step(1, TaskStream(tasks, seed=3), 2, [engine.url], tok, _cfg(dynamic_sampling=True),
                                run_seed=0)
    finally:
        engine.close()
    assert engine.released  # the refill's first turn came while group 0 waited for its own
    assert [t.task_id for t in rollout.trajectories] == [order[0]] * 2 + [order[2]] * 2
    assert [t.task_id for t in rollout.dropped] == [order[1]] * 2 and rollout.stream_state["position"] == 3
    m = rollout.sampling.metrics()
    assert (m["groups_generated"], m["groups_kept"], m["sampling_rounds"], rollout.sampling.refills) == (3, 2, 2, 1)


def test_a_step_starts_at_most_max_sampling_rounds_rounds_worth_of_groups(tok, scripted):
    tasks = select_tasks(TASKS)
    engine = scripted(set())  # no group ever has a signal: the step refills until the bound
    cfg = _cfg(dynamic_sampling=True, oversample=1.5, max_sampling_rounds=3)  # a round: ceil(2 x 1.5) = 3 groups
    rollout = roll_out_step(1, TaskStream(tasks, seed=3), 2, [engine.url], tok, cfg, run_seed=0)
    assert rollout.trajectories == [] and len({t.group_id for t in rollout.dropped}) == 9
    assert rollout.stream_state["position"] == 9 and (rollout.sampling.rounds, rollout.sampling.refills) == (3, 6)
    assert "9 groups rolled out" in rollout.sampling.note and "rollout.max_sampling_rounds=3" in rollout.sampling.note


def test_the_same_seeds_give_the_same_groups(engine_server, tok):
    """The real engine with the random model: no group has a signal, so the step starts its bound of
    groups, refills included. Each group's seed is the run's seed, the step and its index in the
    step: the same seeds give the same tasks and the same task instances (prompts)."""
    tasks = select_tasks(TASKS)
    cfg = _cfg(dynamic_sampling=True, max_sampling_rounds=2)

    def groups(run_seed):
        rollout = roll_out_step(1, TaskStream(tasks, seed=3), 2, [engine_server.url], tok, cfg, run_seed=run_seed)
        assert rollout.sampling.refills == 2 and rollout.trajectories == []
        return [(t.group_id, t.prompt_ids) for t in rollout.dropped[::2]]
    first = groups(0)
    stream = TaskStream(tasks, seed=3).take(4)
    assert [g for g, _ in first] == [group_key(task, step_seed(0, 1), i)[1] for i, task in enumerate(stream)]
    assert groups(0) == first
    assert [g for g, _ in groups(1)] != [g for g, _ in first]


def test_a_step_whose_refill_loses_the_engine_fails_and_leaves_nothing_running(tok):
    """The refill's engine is gone while group 0 is still waiting on it: the step fails, group 0 is
    cancelled and its sandboxes closed, and the stream is put back for the retry."""
    tasks = select_tasks(TASKS)
    order = [t.id for t in TaskStream(tasks, seed=3).take(4)]
    engine = HeldEngine(tok, mixed={order[0]}, first_wave=2, refills_fail=True)
    sandboxes = []

    def factory(**kw):
        sandboxes.append(default_sandbox(**kw))
        return sandboxes[-1]
    stream = TaskStream(tasks, seed=3)
    try:
        with pytest.raises(EngineUnavailable):
            roll_out_step(1, stream, 2, [engine.url], tok, _cfg(dynamic_sampling=True), run_seed=0,
                          sandbox_factory=factory)
    finally:
        engine.close()
    assert stream.state() == {"position": 0, "passes": {}}
    assert len(sandboxes) >= 5 and not any(os.path.exists(s.workspace) for s in sandboxes)


def test_a_step_passes_over_the_tasks_whose_last_group_had_no_signal(tok, scripted):
    tasks = select_tasks(TASKS)
    engine = scripted({"kernel_name"})  # the other three tasks' groups never have a signal
    plain = [t.id for t in TaskStream(tasks, seed=3).take(12)]
    stream = TaskStream(tasks, seed=3, pass_over=1)
    cfg = _cfg(pass_over_saturated=1)
    first = roll_out_step(1, stream, 4, [engine.url], tok, cfg, run_seed=0)
    assert first.sampling.metrics()["tasks_passed_over"] == 0
    assert first.stream_state == {"position": 4, "passes": {t: 1 for t in plain[:4] if t != "kernel_name"}}
    second = roll_out_step(2, stream, 4, [engine.url], tok, cfg, run_seed=0)
    # epoch 1 gives only kernel_name (the other three passed over once), epoch 2 the rest of the batch
    assert [g.task_id for g in second.trajectories[::2]] == ["kernel_name"] + plain[8:11]
    assert second.sampling.metrics()["tasks_passed_over"] == 3 and second.stream_state["position"] == 11


def test_a_resumed_run_passes_over_what_the_interrupted_one_would_have(tmp_path):
    """The real engine with the random model: no group has a signal, so after two steps of two tasks
    all four are passed over once; a run resumed after step 2 knows it from its checkpoint."""
    sets = ["model=tiny-random-qwen2", "rollout.max_new_tokens=8", "rollout.env.max_turns=1", "rollout.group_size=2",
            "tasks_per_step=2", f"tasks={TASKS}", "rollout.pass_over_saturated=1", "checkpoint_every=1",
            "report_to=none", f"run_dir={tmp_path / 'run'}"]
    TrainingRun(load_config(TrainConfig, None, parse_set(sets + ["steps=2"])), echo=lambda *a: None).run()
    state = json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())
    assert state["stream"]["position"] == state["data_position"] == 4 and len(state["stream"]["passes"]) == 4
    TrainingRun(load_config(TrainConfig, None, parse_set(sets + ["steps=3"])), resume_dir=str(tmp_path / "run"),
                echo=lambda *a: None).run()
    row = read_metrics(tmp_path / "run" / "metrics.jsonl")[-1]
    plain = [t.id for t in TaskStream(select_tasks(TASKS), seed=0).take(10)]
    assert row["step"] == 3 and row["tasks_passed_over"] == 4  # epoch 1 passed over whole; epoch 2 taken
    assert row["task_ids"] == [plain[8]] * 2 + [plain[9]] * 2


def test_a_run_whose_groups_never_disagree_skips_its_updates_and_says_so(tmp_path):
    """The real engine with the random model: every episode ends without an answer, all rewards are equal."""
    cfg = load_config(TrainConfig, None, parse_set([
        "model=tiny-random-qwen2", "rollout.max_new_tokens=8", "rollout.env.max_turns=1", "rollout.group_size=2",
        "tasks_per_step=2", "steps=1", "rollout.dynamic_sampling=true", "rollout.max_sampling_rounds=2",
        "report_to=none", f"run_dir={tmp_path / 'run'}"]))
    with pytest.raises(RunFailed, match="trained on nothing"):
        TrainingRun(cfg, echo=lambda *a: None).run()
    (row,) = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert (row["groups_generated"], row["groups_kept"], row["sampling_rounds"]) == (4, 0, 2)
    assert row["dropped_group_share"] == 1.0 and row["trajectories"] == 0
    assert row["update_skipped"] == row["sampling_note"] and "update skipped" in row["update_skipped"]
    assert row["reward_mean"] == pytest.approx(-0.1)  # measured on every episode rolled out, dropped ones included
    # so is a trajectory's length: 8 episodes were rolled out, none kept
    assert row["response_tokens"] > 0 and row["response_tokens_mean"] == pytest.approx(row["response_tokens"] / 8)
    # and which tasks it solved: none, of the 8 samples of the 4 groups
    by_task = row["train_by_task"]
    assert sum(n for _, n in by_task.values()) == 8 and all(solved == 0 for solved, _ in by_task.values())
    assert set(by_task) <= {t.id for t in select_tasks("train")}


def test_the_memory_plan_holds_an_oversampled_round(tiny_model_path):
    """The CPU engine's KV cache is sized for the episodes of a step's largest round."""
    mc = ModelConfig.from_pretrained(str(tiny_model_path))

    def kv(*sets):
        cfg = load_config(TrainConfig, None, parse_set(["tasks_per_step=2", "rollout.group_size=2", *sets]))
        return job_kv_cache_bytes(cfg, mc, torch.float32)
    assert kv("rollout.dynamic_sampling=true", "rollout.oversample=2") == 2 * kv("rollout.dynamic_sampling=true") \
        == 2 * kv("rollout.oversample=2")  # oversample means nothing without dynamic sampling


@pytest.mark.parametrize("sets, message", [
    (["rollout.dynamic_sampling=true", "rollout.group_size=1"],
     "rollout.dynamic_sampling needs rollout.group_size >= 2"),
    (["rollout.max_sampling_rounds=0"], "rollout.max_sampling_rounds must be >= 1, got 0"),
    (["rollout.oversample=0.5"], "rollout.oversample must be >= 1, got 0.5"),
    (["rollout.pass_over_saturated=-1"], r"rollout.pass_over_saturated must be in \[0, 100\] \(0 = off\), got -1"),
    (["rollout.carry_over=true", "mode=sync", "max_staleness=2"],
     "rollout.carry_over carries groups into the next step: it needs mode=async and max_staleness >= 2"),
    (["rollout.carry_over=true", "mode=async"], r"rollout.carry_over .* \(got mode=async, max_staleness=1\)")])
def test_settings_that_cannot_work_are_one_line(sets, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        load_config(TrainConfig, None, parse_set(sets))
