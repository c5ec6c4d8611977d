"""Where a step's rollout wall went (nano_miles/rollout/anatomy.py): a real step on the real engine with
tiny-random-qwen2 and the real sandbox, its breakdown read from the episodes' clocks and the engine's
own busy counters (meta_info.busy_s)."""
import asyncio

from nano_miles.models.prepare import load_tokenizer
from nano_miles.rollout.anatomy import EpisodeClock, RolloutAnatomy
from nano_miles.rollout.dynamic_sampling import TrainRolloutConfig
from nano_miles.rollout.env import EnvConfig
from nano_miles.rollout.producer import AsyncProducer, Carry, play_step_rollout, roll_out_step
from nano_miles.rollout.task_stream import TaskStream
from nano_miles.tasks import select_tasks
from nano_miles.telemetry import format_header, format_row, step_metrics


def test_a_steps_metrics_say_where_its_rollout_wall_went(engine_server, tiny_model_path):
    tok = load_tokenizer(tiny_model_path)
    reply = engine_server.client(timeout=120).generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})
    busy = reply["meta_info"]["busy_s"]
    assert set(busy) == {"prefill", "decode"} and busy["prefill"] > 0 and busy["decode"] > 0

    cfg = TrainRolloutConfig(group_size=2, max_new_tokens=8, temperature=1.0, dynamic_sampling=True,
                             max_sampling_rounds=2, env=EnvConfig(max_turns=2))
    stream = TaskStream(select_tasks("kernel_name,word_count_total"), seed=0)
    rollout = roll_out_step(1, stream, 2, [engine_server.url], tok, cfg, run_seed=0)
    m = step_metrics(1, rollout, [], 1, {}, "skipped", {"ms": 0.0, "transport": "-", "verified": None,
                                                       "weight_version": 0}, step_s=rollout.seconds)
    episodes = 2 * 2 * rollout.sampling.rounds  # a random model never answers: every round's groups are dropped
    assert rollout.sampling.rounds == 2 and m["refill_rounds"] == 1 and m["refill_s"] > 0
    assert 0 < m["engine_prefill_s"] and 0 < m["engine_decode_s"] and 0 < m["engine_busy_share"] <= 1
    assert m["engine_idle_s"] >= 0 and m["generate_s"] > 0 and m["sandbox_s"] > 0 and m["env_s"] >= 0
    assert abs(m["generate_s"] + m["sandbox_s"] + m["env_s"] - m["episode_s"]) < 1e-6 * episodes + 1e-3
    assert 0 < m["critical_path_s"] <= rollout.seconds and m["straggler_s"] <= rollout.seconds
    assert 0 < m["sandbox_share"] < 1
    assert 0 < m["critical_generate_s"] + m["critical_sandbox_s"] <= m["critical_path_s"] + 1e-6
    assert 1 <= m["critical_turns"] <= 2 and m["commands_timed_out"] == 0
    header, row = format_header().split(), format_row(m).split()
    assert {"eng%", "sbx%", "crit_s", "refill"} <= set(header) and len(row) == len(header)


def test_with_carry_over_a_step_counts_only_its_own_window(engine_server, tiny_model_path):
    """Episodes carried in from the last step count from this step's start, and the engine's busy
    seconds are those since the last step ended: nothing of the step before is counted again."""
    tok = load_tokenizer(tiny_model_path)
    cfg = TrainRolloutConfig(group_size=2, max_new_tokens=8, temperature=1.0, env=EnvConfig(max_turns=2))
    stream = TaskStream(select_tasks("kernel_name,word_count_total"), seed=0)

    def roll_out(step, desc, carry):
        return play_step_rollout(step, stream, 2, [engine_server.url], tok, cfg, run_seed=0, desc=desc, carry=carry)
    producer = AsyncProducer(roll_out, last_step=3, carry_over=True)
    producer.start(1)
    try:
        rollouts = [producer.get(step) for step in (1, 2, 3)]
    finally:
        producer.stop()
    assert any(r.sampling.carried for r in rollouts[:2])  # some step handed groups on
    for r in rollouts:
        m = r.anatomy.metrics(r.seconds)
        assert 0 < m["critical_path_s"] <= r.seconds and 0 < m["engine_busy_share"] <= 1


def test_the_slowest_episode_says_whether_it_decoded_or_waited_on_commands():
    """Its turns run one after another: the breakdown names the straggler's generate and sandbox
    seconds and turns, and counts every episode's timed-out commands."""
    start = 100.0
    quick = EpisodeClock(started=start, ended=start + 1.0, generate_s=0.8, sandbox_s=0.1, turns=1)
    slow = EpisodeClock(started=start, ended=start + 12.0, generate_s=1.5, sandbox_s=10.2, turns=3, timed_out=1)
    other = EpisodeClock(started=start, ended=start + 2.0, generate_s=1.0, sandbox_s=0.9, turns=2, timed_out=1)
    anatomy = RolloutAnatomy()
    anatomy.add_rollout([quick, slow, other], start, start + 12.0)
    m = anatomy.metrics(12.0)
    assert m["critical_path_s"] == 12.0
    assert (m["critical_generate_s"], m["critical_sandbox_s"], m["critical_turns"]) == (1.5, 10.2, 3)
    assert m["commands_timed_out"] == 2


def test_with_carry_over_an_episode_that_ends_between_two_steps_counts_in_the_next(engine_server, tiny_model_path):
    """A carried group plays on between steps: its episodes that end after one step took its clocks
    and before the next starts count in the next step's breakdown, not in none."""
    tok = load_tokenizer(tiny_model_path)
    # a random model never solves: no group has a signal, so a step ends when the bound's worth (4
    # groups) came back, the width of 2 still running (carried)
    cfg = TrainRolloutConfig(group_size=2, max_new_tokens=8, temperature=1.0, dynamic_sampling=True, oversample=2.0,
                             max_sampling_rounds=2, env=EnvConfig(max_turns=2))
    stream = TaskStream(select_tasks("kernel_name,word_count_total"), seed=0)

    async def steps():
        carry, counted = Carry(), []
        try:
            for step in range(1, 6):
                r = await play_step_rollout(step, stream, 1, [engine_server.url], tok, cfg, run_seed=0, carry=carry)
                counted.append(r.anatomy.episodes)
                if carry.running:
                    at_most = 2 * len(carry.running)  # (some may have ended within the step: counted there)
                    await asyncio.wait(list(carry.running))  # the rest end between this step and the next
                    pending = len(carry.runner.clocks)  # what the next step is to count: only those
                    r = await play_step_rollout(step + 1, stream, 1, [engine_server.url], tok, cfg, run_seed=0,
                                                carry=carry)
                    return pending, at_most, r.anatomy.episodes
        finally:
            await carry.close()
        raise AssertionError(f"no step carried a group on (episodes counted: {counted})")

    pending, at_most, counted = asyncio.run(steps())
    assert 0 < pending <= at_most and counted >= pending
