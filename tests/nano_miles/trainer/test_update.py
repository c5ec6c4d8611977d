"""The policy update of a training step (nano_miles/trainer/update.py): one optimizer step or PPO mini-batches,
NaN updates skipped, parity measured before any step, the KL penalty to the frozen initial policy. Real trainer on tiny-random-qwen2, CPU."""
import pytest
import torch

from nano_miles.trainer.loss import AdvantageConfig, LossConfig, compute_advantages
from nano_miles.rollout.batch import Trajectory, build_rollout_batch
from nano_miles.models.prepare import resolve_model
from nano_miles.trainer.reference import ReferencePolicy
from nano_miles.trainer.trainer import OptimConfig, Trainer, TrainerConfig
from nano_miles.trainer.update import _minibatches, policy_update


def test_a_nan_loss_skips_the_update_and_says_so():
    trainer = Trainer(TrainerConfig(model=str(resolve_model("tiny-random-qwen2"))))
    trajs = [Trajectory(prompt_ids=[1, 2, 3], response_ids=[4, 5], response_logprobs=[-1.0, -1.0],
                        response_mask=[True, True], reward=r, group_id="g") for r in (0.0, 1.0)]
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    poisoned = "model.norm.weight"
    with torch.no_grad():
        dict(trainer.model.named_parameters())[poisoned].fill_(float("nan"))
    logged = []
    metrics, skipped = policy_update(trainer, trajs, AdvantageConfig(), pad_id=0, echo=logged.append)
    assert metrics == {} and "non-finite" in skipped and logged
    assert trainer.step == 0 and not trainer.optimizer.state  # no optimizer step was taken
    for n, p in trainer.model.named_parameters():
        if n != poisoned:
            assert torch.equal(p, before[n]), n


def test_several_updates_per_step_clip_against_the_sampling_policy():
    """updates=2: two AdamW steps on two mini-batches of whole groups. Both ratios are taken against
    the log-probs of the policy that sampled (computed once, before the first step), so the second
    mini-batch's ratio has moved off 1 and the clipping engages; parity is measured before any step."""
    trajs = [Trajectory(prompt_ids=[1, 2, 3], response_ids=[4 + i, 5, 6], response_logprobs=[-1.0] * 3,
                        response_mask=[True] * 3, reward=float(i % 2), group_id=f"g{i // 2}") for i in range(8)]
    model = str(resolve_model("tiny-random-qwen2"))
    runs = {}
    for updates in (1, 2):
        trainer = Trainer(TrainerConfig(model=model, optim=OptimConfig(lr=1e-3)))
        batch = build_rollout_batch(trajs)
        parity = (trainer.logprobs(batch) - batch.rollout_logprobs).abs()[batch.loss_mask].mean()
        metrics, skipped = policy_update(trainer, trajs, AdvantageConfig(), pad_id=0, updates=updates)
        assert skipped is None and trainer.step == updates
        assert metrics["logprob_diff_mean"] == pytest.approx(float(parity), abs=1e-5)
        runs[updates] = metrics
    assert runs[1]["ratio_max"] == 1.0 and runs[1]["clip_frac"] == 0.0  # one step: ratio 1 by construction
    assert runs[2]["updates"] == 2 and runs[2]["clip_frac"] > 0.0 and runs[2]["ratio_max"] > 1.0


@pytest.mark.parametrize("updates", [1, 2])
def test_parity_counts_only_tokens_sampled_with_the_trainers_weights(updates):
    """Async rollouts hold rows sampled by older weights: their gap to the trainer is the policy's drift
    since, not a train/inference mismatch. parity (logprob_diff_mean/max) is measured on the rows whose
    every turn came from the trainer's own version; the stale rows' mean is reported apart."""
    trainer = Trainer(TrainerConfig(model=str(resolve_model("tiny-random-qwen2")), optim=OptimConfig(lr=1e-3)))
    trainer.step = 3  # the weight version the engines serve
    trajs = [Trajectory(prompt_ids=[1, 2, 3], response_ids=[4 + i, 5, 6], response_logprobs=[-1.0 - i] * 3,
                        response_mask=[True] * 3, reward=float(i % 2), group_id=f"g{i // 2}",
                        weight_versions=["3"] if i < 4 else ["2", "3"]) for i in range(8)]
    batch = build_rollout_batch(trajs, policy_version=3)
    assert batch.stale.tolist() == [False] * 4 + [True] * 4
    gap = (trainer.logprobs(batch) - batch.rollout_logprobs).abs()
    fresh, stale = gap[:4][batch.loss_mask[:4]], gap[4:][batch.loss_mask[4:]]
    metrics, skipped = policy_update(trainer, trajs, AdvantageConfig(), pad_id=0, updates=updates)
    assert skipped is None
    assert metrics["logprob_diff_mean"] == pytest.approx(float(fresh.mean()), abs=1e-5)
    assert metrics["logprob_diff_max"] == pytest.approx(float(fresh.max()), abs=1e-5)
    assert metrics["logprob_diff_stale_mean"] == pytest.approx(float(stale.mean()), abs=1e-5)
    # Every row one version back (async mode's usual step): no parity to report, rather than a 0.0.
    trainer.step = 4
    metrics, _ = policy_update(trainer, trajs, AdvantageConfig(), pad_id=0, updates=updates)
    assert metrics["logprob_diff_mean"] is None and metrics["logprob_diff_max"] is None
    assert metrics["logprob_diff_stale_mean"] > 0


def test_a_trajectory_too_stale_to_train_on_still_counts_in_its_groups_baseline():
    """Async trains on no trajectory sampled more than max_staleness versions back: a group's slowest
    episodes. Their rewards stay in their group's mean and std, so the rows trained on get the
    advantages of the whole group: the update equals a train step on those rows with those advantages."""
    trajs = [Trajectory(prompt_ids=[1, 2, 3], response_ids=[4 + i, 5, 6], response_logprobs=[-1.0] * 3,
                        response_mask=[True] * 3, reward=r, group_id="g") for i, r in enumerate((1.0, 1.0, 0.0, 0.0))]
    model = str(resolve_model("tiny-random-qwen2"))
    update = Trainer(TrainerConfig(model=model, optim=OptimConfig(lr=1e-3)))
    metrics, skipped = policy_update(update, trajs, AdvantageConfig(), pad_id=0, train_on=[True, True, True, False])
    assert skipped is None and metrics["response_tokens"] == 9   # three rows trained on

    whole_group, _ = compute_advantages([1.0, 1.0, 0.0, 0.0], ["g"] * 4)
    without_it, _ = compute_advantages([1.0, 1.0, 0.0], ["g"] * 3)
    assert not torch.allclose(whole_group[:3], without_it)      # leaving it out would move every advantage
    expected = Trainer(TrainerConfig(model=model, optim=OptimConfig(lr=1e-3)))
    expected.train_step(build_rollout_batch(trajs[:3]), whole_group[:3])
    for (name, p), q in zip(update.model.named_parameters(), expected.model.parameters()):
        assert torch.equal(p, q), name

    none_fresh, why = policy_update(update, trajs, AdvantageConfig(), pad_id=0, train_on=[False] * 4)
    assert none_fresh == {} and why == "no trajectory within the staleness bound"


def test_minibatches_keep_groups_whole_and_balanced():
    ids = ["a", "a", "b", "b", "c", "c", "d", "d"]
    assert _minibatches(ids, 1) == [list(range(8))]
    assert _minibatches(ids, 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert _minibatches(["a", "b", "a", "c"], 2) == [[0, 2, 1], [3]]  # groups, not rows, are dealt
    assert len(_minibatches(ids, 10)) == 4  # never more mini-batches than groups


def test_kl_to_the_frozen_initial_policy_is_zero_then_grows_and_pulls_back():
    """loss.kl_coef > 0: the reference is a frozen copy of the initial policy. Before the first step
    the policy is the reference (KL 0, and its gradient 0); after a step the KL is positive, the
    reference has not moved, and the penalty changes the next update."""
    trajs = [Trajectory(prompt_ids=[1, 2, 3], response_ids=[4 + i, 5, 6], response_logprobs=[-1.0] * 3,
                        response_mask=[True] * 3, reward=float(i % 2), group_id=f"g{i // 2}") for i in range(4)]
    model = str(resolve_model("tiny-random-qwen2"))
    batch = build_rollout_batch(trajs)
    weights = {}
    for kl_coef in (0.0, 1.0):
        trainer = Trainer(TrainerConfig(model=model, optim=OptimConfig(lr=1e-3), loss=LossConfig(kl_coef=kl_coef)))
        reference = ReferencePolicy(trainer)
        initial = reference.logprobs(batch)
        first, skipped = policy_update(trainer, trajs, AdvantageConfig(), pad_id=0, reference=reference)
        second, _ = policy_update(trainer, trajs, AdvantageConfig(), pad_id=0, reference=reference)
        assert skipped is None and trainer.step == 2
        assert torch.equal(reference.logprobs(batch), initial)  # frozen
        assert not torch.equal(trainer.logprobs(batch), initial)  # the policy moved
        if kl_coef:
            assert first["kl_ref"] == 0.0 and second["kl_ref"] > 0.0
        weights[kl_coef] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    assert any(not torch.equal(weights[0.0][n], weights[1.0][n]) for n in weights[0.0])
