"""The trainer on the real tiny Qwen2 model (CPU): FP32 log-probs, micro-batching, master weights."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from nano_miles.trainer.loss import LossConfig
from nano_miles.rollout.batch import Trajectory, build_rollout_batch
from nano_miles.engine.weights import NonFiniteWeights
from nano_miles.models.prepare import resolve_model
from nano_miles.trainer.trainer import OptimConfig, Trainer, TrainerConfig


@pytest.fixture(scope="module")
def model_path():
    return str(resolve_model("tiny-random-qwen2"))


def make_batch(seed=0, n=4, vocab=1024):
    """n trajectories of different lengths; the odd ones are two turns with a masked observation."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(n):
        P, R = 5 + 3 * i, 6 + 2 * i
        prompt = torch.randint(3, vocab, (P,), generator=g).tolist()
        resp = torch.randint(3, vocab, (R,), generator=g).tolist()
        mask = [True] * R
        if i % 2:
            mask[2:4] = [False, False]  # an observation inside the response
        trajs.append(Trajectory(prompt_ids=prompt, response_ids=resp, response_logprobs=[-1.0] * R,
                                response_mask=mask, reward=float(i % 2), group_id=f"g{i // 2}"))
    return build_rollout_batch(trajs)


def make_trainer(path, **kw):
    optim = kw.pop("optim", OptimConfig(lr=1e-3))
    loss = kw.pop("loss", LossConfig())
    return Trainer(TrainerConfig(model=path, optim=optim, loss=loss, **kw))


def reference_logprobs(model, batch):
    """Full-vocabulary log-softmax of one unpadded sequence at a time, in float64."""
    out = torch.zeros(batch.loss_mask.shape, dtype=torch.float64)
    with torch.no_grad():
        for i in range(len(batch)):
            n = int(batch.attention_mask[i].sum())
            logits = model(batch.tokens[i:i + 1, :n]).logits[0, :-1].double()
            out[i, :n - 1] = logits.log_softmax(-1).gather(-1, batch.tokens[i, 1:n, None]).squeeze(-1)
    return out


@pytest.mark.parametrize("micro_batch_size,chunk", [(1, 1024), (3, 4), (4, 1)])
def test_logprobs_equal_a_full_vocab_reference(model_path, micro_batch_size, chunk):
    batch = make_batch()
    trainer = make_trainer(model_path, micro_batch_size=micro_batch_size, logprob_chunk=chunk)
    ref = reference_logprobs(trainer.model, batch)
    lp = trainer.logprobs(batch)
    assert lp.dtype == torch.float32 and lp.shape == batch.loss_mask.shape
    assert (lp[batch.loss_mask].double() - ref[batch.loss_mask]).abs().max() <= 1e-5
    assert lp[~batch.loss_mask].eq(0).all()  # only the scored positions are computed
    every = batch.attention_mask[:, 1:]
    lp_all = trainer.logprobs(batch, mask=every)
    assert (lp_all[every].double() - ref[every]).abs().max() <= 1e-5


def test_parity_metrics_and_entropy(model_path):
    batch = make_batch()
    trainer = make_trainer(model_path, micro_batch_size=2, logprob_chunk=3)
    ref = reference_logprobs(trainer.model, batch)
    batch.rollout_logprobs = ref.float() * batch.loss_mask
    r, c = batch.loss_mask.nonzero()[5]
    batch.rollout_logprobs[r, c] += 0.25  # one token where the "engine" disagreed
    # Expected entropy over the response tokens, full vocab, unpadded.
    ents = []
    with torch.no_grad():
        for i in range(len(batch)):
            n = int(batch.attention_mask[i].sum())
            logp = trainer.model(batch.tokens[i:i + 1, :n]).logits[0, :-1].double().log_softmax(-1)
            ents.append((-(logp.exp() * logp).sum(-1))[batch.loss_mask[i, :n - 1]])
    m = trainer.train_step(batch, torch.zeros(len(batch)))
    assert abs(m["logprob_diff_max"] - 0.25) < 1e-5
    assert abs(m["logprob_diff_mean"] - 0.25 / int(batch.loss_mask.sum())) < 1e-6
    assert abs(m["entropy"] - torch.cat(ents).mean().item()) < 1e-5
    assert m["response_tokens"] == int(batch.loss_mask.sum())
    for key in ["pg_loss", "clip_frac", "approx_kl", "ratio_mean", "ratio_max", "grad_norm", "step_ms"]:
        assert key in m


def test_update_does_not_depend_on_micro_batching_chunking_or_checkpointing(model_path):
    batch = make_batch(seed=1)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    results = []
    for kw in [dict(micro_batch_size=4), dict(micro_batch_size=1, logprob_chunk=2),
               dict(micro_batch_size=3, gradient_checkpointing=True, logprob_chunk=5)]:
        trainer = make_trainer(model_path, **kw)
        m = trainer.train_step(batch, adv)
        results.append((m, [p.detach().clone() for p in trainer.params]))
    (m0, p0) = results[0]
    for m, p in results[1:]:
        assert abs(m["pg_loss"] - m0["pg_loss"]) < 1e-6
        assert abs(m["grad_norm"] - m0["grad_norm"]) < 1e-5 * max(1.0, m0["grad_norm"])
        # Adam's first step is lr * g / (|g| + eps): elements with |g| near eps amplify float noise,
        # so compare the weights to 1% of one step (lr 1e-3).
        assert max((a - b).abs().max().item() for a, b in zip(p, p0)) < 1e-5
    assert max((a - b).abs().max().item() for a, b in zip(p0, Trainer(TrainerConfig(model=model_path)).params)) > 1e-4


def test_steps_move_log_probs_in_the_direction_of_the_advantage(model_path):
    batch = make_batch(seed=2)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    trainer = make_trainer(model_path, micro_batch_size=2, optim=OptimConfig(lr=3e-3))
    before = trainer.logprobs(batch)
    for _ in range(3):
        trainer.train_step(batch, adv)
    delta = ((trainer.logprobs(batch) - before) * batch.loss_mask).sum(-1) / batch.loss_mask.sum(-1)
    assert (delta[[0, 2]] > 0).all() and (delta[[1, 3]] < 0).all()


def test_loss_and_grad_norm_equal_a_hand_written_reference(model_path):
    batch = make_batch(seed=3)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    trainer = make_trainer(model_path, optim=OptimConfig(lr=1e-3, max_grad_norm=0.0))
    model = copy.deepcopy(trainer.model)
    m = trainer.train_step(batch, adv)
    # The same loss by hand: ratio 1, no TIS (rollout == old), token-mean over response tokens.
    lp = torch.zeros(batch.loss_mask.shape)
    for i in range(len(batch)):
        n = int(batch.attention_mask[i].sum())
        logits = model(batch.tokens[i:i + 1, :n]).logits[0, :-1].float()
        lp[i, :n - 1] = logits.log_softmax(-1).gather(-1, batch.tokens[i, 1:n, None]).squeeze(-1)
    tis = torch.exp(lp.detach() - batch.rollout_logprobs).clamp(max=2.0)
    loss = -(adv[:, None] * tis * torch.exp(lp - lp.detach()) * batch.loss_mask).sum() / batch.loss_mask.sum()
    loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None]))
    assert abs(m["grad_norm"] - norm.item()) < 1e-4 * norm.item()
    assert abs(m["pg_loss"] - loss.item()) < 1e-5


def test_bf16_small_steps_accumulate_in_fp32_masters(model_path):
    """lr 1e-6: a bare bf16 AdamW loses almost every update to rounding; the masters keep them all
    and the bf16 compute model is always exactly masters.to(bfloat16)."""
    batch = make_batch(seed=4)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    trainer = make_trainer(model_path, dtype="bfloat16", optim=OptimConfig(lr=1e-6, max_grad_norm=0.0))
    init = [m.detach().clone() for m in trainer.masters]
    naive = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
    naive_init = [p.detach().clone() for p in naive.parameters()]
    naive_opt = torch.optim.AdamW(naive.parameters(), lr=1e-6, weight_decay=0.0)
    naive_trainer = Trainer(TrainerConfig(model=model_path, dtype="bfloat16"), model=naive)

    trainer.train_step(batch, adv)
    moved = sum(int((m != i).sum()) for m, i in zip(trainer.masters, init)) / sum(i.numel() for i in init)
    assert moved > 0.9  # one 1e-6 step reaches nearly every FP32 master
    for p, m in zip(trainer.params, trainer.masters):
        assert p.dtype == torch.bfloat16 and torch.equal(p, m.to(torch.bfloat16))

    for _ in range(9):
        trainer.train_step(batch, adv)
    for _ in range(10):  # the naive loop: the same loss and gradients, AdamW straight on bf16 weights
        naive_opt.zero_grad()
        naive_trainer.masters = list(naive_trainer.params)  # grads stay on the bf16 params
        lp, _ = naive_trainer._logprobs(batch.tokens, batch.loss_mask, need_grad=True, with_entropy=False)
        (-(adv[:, None] * torch.exp(lp - lp.detach()) * batch.loss_mask).sum() / batch.loss_mask.sum()).backward()
        naive_opt.step()
    changed = sum(int((p != i.to(torch.bfloat16)).sum()) for p, i in zip(trainer.params, init))
    naive_changed = sum(int((p != i).sum()) for p, i in zip(naive.parameters(), naive_init))
    print("bf16 elements changed after 10 steps: masters", changed, "naive", naive_changed)
    assert changed > 5 * naive_changed, (changed, naive_changed)
    for p, m in zip(trainer.params, trainer.masters):
        assert torch.equal(p, m.to(torch.bfloat16))


def test_bad_input_is_rejected_and_changes_nothing(model_path):
    batch = make_batch()
    trainer = make_trainer(model_path)
    before = [p.detach().clone() for p in trainer.params]
    with pytest.raises(ValueError, match="advantages"):
        trainer.train_step(batch, torch.zeros(3))
    with pytest.raises(ValueError, match="finite"):
        trainer.train_step(batch, torch.tensor([1.0, float("nan"), 0.0, 0.0]))
    left = copy.deepcopy(batch)
    left.attention_mask = left.attention_mask.flip(-1)
    with pytest.raises(ValueError, match="right-padded"):
        trainer.train_step(left, torch.zeros(4))
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.params)) and trainer.step == 0
    with pytest.raises(ValueError, match="dtype"):
        TrainerConfig(dtype="float16")
    with pytest.raises(ValueError, match="optim.lr"):
        OptimConfig(lr=0)
    with pytest.raises(ValueError, match="model folder"):
        Trainer(TrainerConfig())


def test_logits_exist_only_one_chunk_at_a_time(model_path, monkeypatch):
    """The lm_head -> float32 log_softmax step sees at most logprob_chunk tokens per call, in the
    forward and in the backward's recomputation, and only the scored positions at all."""
    import nano_miles.trainer.logprob_head as head

    forward, backward = [], []
    original_forward, original_backward = head.chunk_logprobs, head.chunk_logit_grads

    def recording_forward(hidden, *args):
        forward.append(hidden.shape[0])
        return original_forward(hidden, *args)

    def recording_backward(hidden, *args):
        backward.append(hidden.shape[0])
        return original_backward(hidden, *args)

    monkeypatch.setattr(head, "chunk_logprobs", recording_forward)
    monkeypatch.setattr(head, "chunk_logit_grads", recording_backward)
    batch = make_batch()
    trainer = make_trainer(model_path, micro_batch_size=4, logprob_chunk=5)
    trainer.train_step(batch, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    scored = int(batch.loss_mask.sum())
    assert max(forward + backward) <= 5
    # Every scored token goes through twice: the forward keeps no [chunk, vocab] logits for the
    # backward, which recomputes them chunk by chunk.
    assert sum(forward) == sum(backward) == scored


def test_a_non_finite_gradient_skips_the_update_with_a_clear_error(model_path):
    batch = make_batch(seed=6)
    trainer = make_trainer(model_path, dtype="bfloat16")
    with torch.no_grad():
        trainer.params[0][5].fill_(float("inf"))  # poison the embedding row of token 5...
        trainer.masters[0][5].fill_(float("inf"))
        batch.tokens[0, 1] = 5  # ...and feed it: the loss and the gradient become NaN
    before = [m.detach().clone() for m in trainer.masters]
    with pytest.raises(FloatingPointError, match="non-finite gradient norm"):
        trainer.train_step(batch, torch.tensor([1.0, -1.0, 0.5, -0.5]))
    assert trainer.step == 0 and not trainer.optimizer.state  # no moment was touched
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.masters))
    assert all(m.grad is None for m in trainer.masters)


def test_a_step_that_leaves_non_finite_weights_is_a_clear_error(model_path):
    """A finite gradient, an absurd lr (1e38: AdamW's step overflows float32): the weights become
    inf/NaN. The trainer says which and does not count the step; the run stops on it (test_train.py)."""
    trainer = make_trainer(model_path, optim=OptimConfig(lr=1e38))
    with pytest.raises(NonFiniteWeights, match=r"^optimizer step 1 left NaN or infinite values in model\."):
        trainer.train_step(make_batch(seed=6), torch.tensor([1.0, -1.0, 0.5, -0.5]))
    assert trainer.step == 0


@pytest.mark.parametrize("temperature", [0.6, 1.4])
def test_rollouts_sampled_at_a_temperature_are_scored_at_it(model_path, temperature):
    """The engine returns log softmax(logits / T) of the tokens it sampled at T (SGLang's meaning); a
    trainer given rollout.temperature scores the same distribution, so the PPO ratio and TIS compare
    like with like. Scored at T=1 instead, every token would look off-policy."""
    from nano_miles.engine.engine import Engine, EngineConfig, SamplingParams
    engine = Engine(EngineConfig(model=model_path, dtype="float32", num_kv_blocks=256))
    trajs = []
    for i in range(3):
        ids = torch.randint(3, 1000, (6 + 4 * i,), generator=torch.Generator().manual_seed(i)).tolist()
        engine.add_request(f"r{i}", ids, SamplingParams(max_new_tokens=12, temperature=temperature,
                                                        ignore_eos=True, sampling_seed=i))
        out = None
        while engine.has_unfinished():
            out = engine.step() or out
        trajs.append(Trajectory(prompt_ids=ids, response_ids=out[0].output_ids, response_logprobs=out[0].output_logprobs,
                                response_mask=[True] * 12, reward=float(i % 2), group_id="g"))
    batch = build_rollout_batch(trajs)
    mask = batch.loss_mask
    tempered = make_trainer(model_path, temperature=temperature).logprobs(batch)
    assert (tempered[mask] - batch.rollout_logprobs[mask]).abs().max() < 1e-4
    plain = make_trainer(model_path).logprobs(batch)
    assert (plain[mask] - batch.rollout_logprobs[mask]).abs().max() > 1e-2
    m = make_trainer(model_path, temperature=temperature).train_step(
        batch, torch.tensor([1.0, -1.0, 1.0]), old_logprobs=batch.rollout_logprobs)
    assert m["logprob_diff_max"] < 1e-4 and abs(m["ratio_max"] - 1.0) < 1e-3


def test_a_trainer_without_a_distribution_to_score_is_refused(model_path):
    with pytest.raises(ValueError, match="temperature must be > 0"):
        TrainerConfig(model=model_path, temperature=0.0)


def test_clip_cov_reaches_the_update_and_its_metrics(model_path):
    """loss.clip_cov_ratio acts inside the trainer's micro-batches (one on-policy update: ratio 1, so the
    PPO clip never would), and the step says on how many tokens."""
    batch = make_batch(n=4)
    adv = torch.tensor([1.5, -1.5, 1.5, -1.5])
    torch.manual_seed(0)
    m = make_trainer(model_path, loss=LossConfig(clip_cov_ratio=0.05, clip_cov_lb=0.1),
                     micro_batch_size=4).train_step(batch, adv)
    assert 0 < m["clip_cov_frac"] <= 0.1 and m["clip_frac"] == 0
    plain = make_trainer(model_path, micro_batch_size=4).train_step(batch, adv)
    assert "clip_cov_frac" not in plain and m["grad_norm"] != plain["grad_norm"]
