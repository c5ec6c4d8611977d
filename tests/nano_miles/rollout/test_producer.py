"""Where a training step's trajectories come from (nano_miles/rollout/producer.py): the one
roll-out-a-step function both modes share, and what each producer hands the trainer. Real sandbox
and tokenizer; the engine is a closed port where a test needs it dead."""
import functools

import pytest

from nano_miles.rollout.batch import Trajectory
from nano_miles.engine.client import EngineUnavailable
from nano_miles.rollout.dynamic_sampling import TrainRolloutConfig
from nano_miles.models.prepare import load_tokenizer
from nano_miles.rollout.batch import staleness
from nano_miles.rollout.producer import AsyncProducer, SyncProducer, play_step_rollout
from nano_miles.rollout.task_stream import TaskStream
from nano_miles.tasks import select_tasks
from nano_openshell import Sandbox

DEAD_ENGINE = ["http://127.0.0.1:9"]


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return load_tokenizer(tiny_model_path)


def _producer(mode, stream, tok, **kw):
    def roll_out(step, desc, carry):
        return play_step_rollout(step, stream, 2, DEAD_ENGINE, tok, TrainRolloutConfig(group_size=2, max_new_tokens=8),
                                 run_seed=0, desc=desc, carry=carry, **kw)
    return (SyncProducer(roll_out) if mode == "sync"
            else AsyncProducer(roll_out, last_step=3, carry_over=mode == "async+carry"))


@pytest.mark.parametrize("mode", ["sync", "async", "async+carry"])
def test_setup_failures_are_counted_in_both_modes(mode, tok):
    """Episodes whose sandbox setup failed are counted on the step."""
    stream = TaskStream(select_tasks("kernel_name,md5_file"), seed=0)
    broken = functools.partial(Sandbox, workspace="/nonexistent/workspace")  # a real sandbox that fails to start
    producer = _producer(mode, stream, tok, sandbox_factory=broken)
    producer.start(1)
    try:
        for step in (1, 2):
            got = producer.get(step)
            assert (got.step, got.trajectories) == (step, [])
            assert got.setup_failures == 2 * got.sampling.generated  # both episodes of each group that came back
            if mode == "async+carry":  # the tasks taken beyond the batch are pending, the next step's
                assert got.stream_state["position"] - len(got.stream_state.get("pending", [])) >= 2 * step
            else:
                assert (got.sampling.generated, got.stream_state["position"]) == (2, 2 * step)
    finally:
        producer.stop()


@pytest.mark.parametrize("mode", ["sync", "async", "async+carry"])
def test_a_failed_step_puts_the_stream_back(mode, tok):
    """A dead engine fails the step; the stream is where it was, so the retry takes the same tasks."""
    stream = TaskStream(select_tasks("kernel_name,md5_file,nth_line"), seed=0)
    producer = _producer(mode, stream, tok)
    producer.start(1)
    try:
        with pytest.raises(EngineUnavailable):
            producer.get(1)
    finally:
        producer.stop()
    assert stream.position == 0


def test_staleness_is_measured_on_the_oldest_turn():
    def traj(*versions):
        return Trajectory([1], [2], [0.0], [True], reward=0.0, weight_versions=list(versions))
    assert staleness(traj("3", "5"), policy_version=5) == 2
    assert staleness(traj(), policy_version=5) == 0
    assert staleness(traj("5", "sglang-v1"), policy_version=5) == 6  # a non-numeric version: maximally stale
