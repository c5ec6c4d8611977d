"""True on-policy mode (issue 15) on CPU: the trainer's log-prob of every response token equals the
engine's returned log-prob EXACTLY, in float32 and bfloat16, whatever the engine's batch (1, 3 or 8
requests at once), with chunked prefill and prefix-cache hits (a second turn re-reads the first), and
after a weight update; the first PPO step then has ratio exactly 1 and clips nothing.

Real components: tiny-random-qwen2, the in-process Engine, the real `nano-miles serve` for one test,
the real Trainer."""
import pytest
import torch

from nano_miles.rollout.batch import Trajectory, build_rollout_batch
from nano_miles.engine.process import start_engine_process
from nano_miles.config import ConfigError, load_config, parse_set
from nano_miles.engine.engine import Engine, EngineConfig, SamplingParams
from nano_miles.train_config import TrainConfig, train_layout
from nano_miles.trainer.trainer import Trainer, TrainerConfig

PREFIX = [1, 77, 301, 5, 912, 44, 610, 23, 9, 450, 99, 17]  # shared by every prompt: prefix-cache hits
OBSERVATION = [2, 1, 88, 420, 7, 2, 1, 300]                  # a tool turn between two model turns


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # CI's two cores: far faster for the tiny model
    yield
    torch.set_num_threads(threads)


def prompt(i: int) -> list:
    g = torch.Generator().manual_seed(100 + i)
    return PREFIX + torch.randint(3, 1000, (1 + (7 * i) % 23,), generator=g).tolist()


def params(i: int, n: int = 0) -> SamplingParams:
    return SamplingParams(max_new_tokens=3 + (5 * i + n) % 11, temperature=1.0, ignore_eos=True, sampling_seed=i)


def serve(engine, prompts_and_params) -> list:
    """All requests admitted together (the engine's batch), run to completion; results in order."""
    for i, (ids, sp) in enumerate(prompts_and_params):
        engine.add_request(f"q{i}", ids, sp)
    done = {}
    while engine.has_unfinished():
        done.update({r.rid: r for r in engine.step()})
    return [done[f"q{i}"] for i in range(len(prompts_and_params))]


def single_turn(ids, out, group) -> Trajectory:
    return Trajectory(prompt_ids=ids, response_ids=out.output_ids, response_logprobs=out.output_logprobs,
                      response_mask=[True] * len(out.output_ids), reward=float(len(out.output_ids) % 2), group_id=group)


def rollouts(engine) -> list:
    """Concurrency 1, 3 and 8, then second turns of the 3 (their first turn + an observation is a
    cached prefix). Returns the trajectories, as the RL loop would build them."""
    trajs, first_turns, n = [], [], 0
    for concurrency in (1, 3, 8):
        batch = [(prompt(n + j), params(n + j)) for j in range(concurrency)]
        outs = serve(engine, batch)
        if concurrency == 3:
            first_turns = list(zip(batch, outs))
        else:
            trajs += [single_turn(ids, out, f"c{concurrency}") for (ids, _), out in zip(batch, outs)]
        n += concurrency
    second = serve(engine, [(ids + out.output_ids + OBSERVATION, params(i, 1))
                            for i, ((ids, _), out) in enumerate(first_turns)])
    assert sum(out.cached_tokens for out in second) >= 3 * len(PREFIX)  # the prefix cache was hit
    for ((ids, _), out1), out2 in zip(first_turns, second):
        trajs.append(Trajectory(
            prompt_ids=ids, response_ids=out1.output_ids + OBSERVATION + out2.output_ids,
            response_logprobs=out1.output_logprobs + [0.0] * len(OBSERVATION) + out2.output_logprobs,
            response_mask=[True] * len(out1.output_ids) + [False] * len(OBSERVATION) + [True] * len(out2.output_ids),
            reward=1.0, group_id="turns"))
    return trajs


def assert_exact(trainer, trajs):
    batch = build_rollout_batch(trajs)
    mine = trainer.logprobs(batch)
    mask = batch.loss_mask
    assert torch.equal(mine[mask], batch.rollout_logprobs[mask]), (mine[mask] - batch.rollout_logprobs[mask]).abs().max()
    return batch


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_trainer_logprobs_equal_the_engines_at_any_batch_and_the_first_ppo_step_is_exactly_on_policy(tiny_model_path, dtype):
    engine = Engine(EngineConfig(model=str(tiny_model_path), dtype=dtype, true_on_policy=True, block_size=4,
                                 num_kv_blocks=512, max_num_batched_tokens=16))  # 16: long prompts are chunked
    trainer = Trainer(TrainerConfig(model=str(tiny_model_path), dtype=dtype, true_on_policy=True, micro_batch_size=4))
    assert trainer.cfg.gradient_checkpointing is False  # by default: a recomputed layer would rerun the exact ops
    trajs = rollouts(engine)
    batch = assert_exact(trainer, trajs)
    assert int(batch.loss_mask.sum()) > 80

    # The batch-invariant forward is the model's forward, not merely a consistent one: close to HF's.
    if dtype == "float32":
        with torch.no_grad():
            logits = trainer.model(batch.tokens).logits[:, :-1].float()
        hf = torch.log_softmax(logits, -1).gather(-1, batch.tokens[:, 1:, None]).squeeze(-1)
        assert torch.allclose(hf[batch.loss_mask], batch.rollout_logprobs[batch.loss_mask], atol=1e-4)

    # slime's and miles' CI gate: the first PPO step against the engine's log-probs is exactly on policy.
    adv = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(batch))])
    m = trainer.train_step(batch, adv, old_logprobs=batch.rollout_logprobs)
    assert m["ratio_max"] == 1.0 and m["ratio_mean"] == 1.0
    assert m["clip_frac"] == 0.0 and m["approx_kl"] == 0.0
    assert m["logprob_diff_max"] == 0.0 and m["tis_mean"] == 1.0
    assert m["grad_norm"] > 0

    # After the update is synced, the engine and the trainer still agree bit for bit.
    engine.load_weights(trainer.named_weights(engine.dtype))
    outs = serve(engine, [(prompt(40 + j), params(40 + j)) for j in range(3)])
    assert_exact(trainer, [single_turn(prompt(40 + j), out, "after") for j, out in enumerate(outs)])


def test_through_the_http_server(tiny_model_path):
    args = ("--true-on-policy", "--threads", "1", "--num-kv-blocks", "512", "--max-running-requests", "16")
    trainer = Trainer(TrainerConfig(model=str(tiny_model_path), dtype="bfloat16", true_on_policy=True, micro_batch_size=3))
    with start_engine_process(str(tiny_model_path), dtype="bfloat16", extra_args=args, ready_timeout=180) as server:
        client = server.client(timeout=120)
        assert client.server_info()["true_on_policy"] is True
        trajs = []
        for n in (1, 5):  # a lone request, then five at once that hit its cached prefix
            prompts = [prompt(60 + n + j) for j in range(n)]
            replies = client.generate_batch(prompts, {"max_new_tokens": 9, "temperature": 1.0, "ignore_eos": True})
            for ids, reply in zip(prompts, replies):
                lps = [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]
                trajs.append(Trajectory(prompt_ids=ids, response_ids=reply["output_ids"], response_logprobs=lps,
                                        response_mask=[True] * len(lps)))
        client.close()
    assert_exact(trainer, trajs)


def test_the_train_key_turns_on_both_sides_and_refuses_a_tempered_rollout():
    cfg = load_config(TrainConfig, None, parse_set(["true_on_policy=true"]))
    assert "--true-on-policy" in train_layout(cfg).engine_args
    assert "--true-on-policy" not in train_layout(TrainConfig()).engine_args
    with pytest.raises(ConfigError, match="temperature"):
        load_config(TrainConfig, None, parse_set(["true_on_policy=true", "rollout.temperature=0.7"]))


def test_a_micro_batch_without_a_response_token_trains_as_nothing(tiny_model_path):
    # An episode whose prompt is over rollout.env.max_total_tokens ends before its first turn
    # ("token_budget", rollout/episode.py): no response token, but not broken, so it is trained on.
    # With one row a micro-batch (the CPU default) its micro-batch scores nothing; the step must still
    # run, and leave the weights as the batch without that row would.
    scored = Trajectory(prompt_ids=prompt(0), response_ids=[5, 6, 7, 8], response_logprobs=[-1.0] * 4,
                        response_mask=[True] * 4, reward=1.0, group_id="g")
    over_budget = Trajectory(prompt_ids=prompt(1), response_ids=[], response_logprobs=[], response_mask=[],
                             reward=0.0, group_id="g")
    weights = []
    for trajs, adv in (([scored, over_budget], [1.0, -1.0]), ([scored], [1.0])):
        trainer = Trainer(TrainerConfig(model=str(tiny_model_path), true_on_policy=True, micro_batch_size=1))
        m = trainer.train_step(build_rollout_batch(trajs), torch.tensor(adv))
        assert trainer.step == 1 and m["response_tokens"] == 4
        weights.append([p.detach().clone() for p in trainer.masters])
    assert all(torch.equal(a, b) for a, b in zip(*weights))
