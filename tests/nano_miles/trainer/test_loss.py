"""Advantages and the policy loss on small hand-made tensors, with hand-computed expected values."""
import math

import pytest
import torch

from nano_miles.trainer.loss import (AdvantageConfig, LossConfig, compute_advantages, loss_normalizer,
                                   policy_loss)


def close(a, b, tol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                          atol=tol, rtol=0)


# ------------------------------------------------------------------------------------ advantages

def test_grpo_whitening_uses_the_unbiased_std_by_default():
    adv, keep = compute_advantages([1.0, 0.0, 0.0, 1.0], ["a"] * 4)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # sample std of {1,0,0,1} = sqrt(1/3)
    assert close(adv, [a, -a, -a, a])
    assert keep.all()


def test_grpo_population_std_option():
    adv, _ = compute_advantages([1.0, 0.0, 0.0, 1.0], ["a"] * 4, AdvantageConfig(unbiased_std=False))
    a = 0.5 / (0.5 + 1e-4)
    assert close(adv, [a, -a, -a, a])


def test_groups_are_independent_interleaved_and_of_different_sizes():
    rewards = [3.0, 1.0, 0.0, 2.0, 1.0]
    ids = ["x", "y", "y", "x", "y"]
    adv, _ = compute_advantages(rewards, ids, AdvantageConfig(estimator="dr_grpo"))
    # x: {3, 2} mean 2.5; y: {1, 0, 1} mean 2/3
    assert close(adv, [0.5, 1 / 3, -2 / 3, -0.5, 1 / 3])


def test_dr_grpo_has_no_std_scaling():
    adv, _ = compute_advantages([1.0, 0.0, 0.0], ["g"] * 3, AdvantageConfig(estimator="dr_grpo"))
    assert close(adv, [2 / 3, -1 / 3, -1 / 3])


def test_rloo_subtracts_the_mean_of_the_others():
    adv, _ = compute_advantages([1.0, 0.0, 0.0], ["g"] * 3, AdvantageConfig(estimator="rloo"))
    assert close(adv, [1.0 - 0.0, 0.0 - 0.5, 0.0 - 0.5])


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_zero_variance_group_gets_exactly_zero_and_can_be_filtered(estimator):
    rewards = [1.0, 1.0, 1.0, 0.0, 1.0, 0.5]
    ids = ["same"] * 3 + ["mixed"] * 2 + ["alone"]
    adv, keep = compute_advantages(rewards, ids, AdvantageConfig(estimator=estimator))
    assert torch.isfinite(adv).all()
    assert adv[[0, 1, 2, 5]].eq(0).all()          # all-equal group and group of one: exactly 0
    assert adv[3] < 0 < adv[4]
    assert keep.all()
    _, keep = compute_advantages(rewards, ids, AdvantageConfig(estimator=estimator, filter_zero_variance=True))
    assert keep.tolist() == [False, False, False, True, True, False]


def test_advantage_bad_input_is_rejected():
    with pytest.raises(ValueError, match="one group id per reward"):
        compute_advantages([1.0, 0.0], ["a"])
    with pytest.raises(ValueError, match="finite"):
        compute_advantages([1.0, float("nan")], ["a", "a"])
    with pytest.raises(ValueError, match="estimator"):
        AdvantageConfig(estimator="ppo")


# ------------------------------------------------------------------------------------ policy loss
# Two rows, three prediction positions. old log-probs are 0, so ratio = exp(logprobs).
# Row 0, A = +1, ratios [0.5, 1.1, 1.5]       -> per-token loss max(-r, -clip(r, 0.8, 1.28))
#   = [-0.5, -1.1, -1.28]                        (1.5 clipped to 1.28)
# Row 1, A = -1, ratios [0.5, 4.0, 10.0 masked] -> max(r, clip(r)) then min(., c = 3)
#   = [0.8, 3.0, masked]                         (0.5 clipped up to 0.8; 4.0 dual-clipped to 3)
RATIOS = torch.tensor([[0.5, 1.1, 1.5], [0.5, 4.0, 10.0]], dtype=torch.float64)
MASK = torch.tensor([[True, True, True], [True, True, False]])
ADV = torch.tensor([1.0, -1.0])
CFG = LossConfig(eps_low=0.2, eps_high=0.28, dual_clip=3.0, tis_cap=None)


def _loss(cfg=CFG, **kw):
    logprobs = RATIOS.log().float().requires_grad_(True)
    loss, m = policy_loss(logprobs, torch.zeros(2, 3), ADV, MASK, cfg, **kw)
    return logprobs, loss, m


def test_token_mean_loss_clip_higher_and_dual_clip_exact():
    logprobs, loss, m = _loss()
    assert close(loss.item(), (-0.5 - 1.1 - 1.28 + 0.8 + 3.0) / 5)
    assert close(m["pg_loss"], 0.184)
    assert close(m["clip_frac"], 2 / 5)       # row0 r=1.5 (upper), row1 r=0.5 (lower)
    assert close(m["dual_clip_frac"], 1 / 5)  # row1 r=4.0
    assert close(m["ratio_mean"], (0.5 + 1.1 + 1.5 + 0.5 + 4.0) / 5, 1e-6)
    assert close(m["ratio_max"], 4.0, 1e-5)   # the masked 10.0 is ignored
    assert close(m["approx_kl"], -sum(math.log(r) for r in [0.5, 1.1, 1.5, 0.5, 4.0]) / 5, 1e-6)
    assert m["tokens"] == 5
    loss.backward()
    # d/dlogp of -A*r is -A*r where the ratio is not clipped; clipped and dual-clipped tokens have none.
    expected = torch.tensor([[-0.5, -1.1, 0.0], [0.0, 0.0, 0.0]]) / 5
    assert close(logprobs.grad, expected)


def test_seq_mean_token_mean_and_constant_aggregation():
    _, loss, _ = _loss(LossConfig(tis_cap=None, aggregation="seq-mean-token-mean"))
    assert close(loss.item(), ((-0.5 - 1.1 - 1.28) / 3 + (0.8 + 3.0) / 2) / 2)
    _, loss, _ = _loss(LossConfig(tis_cap=None, aggregation="constant", constant_normalizer=4))
    assert close(loss.item(), 0.92 / (2 * 4))


def test_without_dual_clip_the_negative_advantage_loss_is_unbounded():
    _, loss, m = _loss(LossConfig(tis_cap=None, dual_clip=None))
    assert close(loss.item(), (-0.5 - 1.1 - 1.28 + 0.8 + 4.0) / 5)
    assert m["dual_clip_frac"] == 0


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "constant"])
def test_micro_batches_sum_to_the_batch_loss(aggregation):
    cfg = LossConfig(tis_cap=None, aggregation=aggregation, constant_normalizer=3)
    mask = MASK.clone()
    norm = loss_normalizer(mask, cfg)
    full, _ = policy_loss(RATIOS.log().float(), torch.zeros(2, 3), ADV, mask, cfg)
    parts = [policy_loss(RATIOS[i:i + 1].log().float(), torch.zeros(1, 3), ADV[i:i + 1], mask[i:i + 1], cfg,
                         normalizer=norm)[0] for i in range(2)]
    assert close(full.item(), sum(p.item() for p in parts))


def test_truncated_importance_sampling_weights_are_capped():
    # Trainer old log-probs 0; the engine's rollout log-probs differ by log 3 (capped to 2) on the
    # first token of each row and by log 1.5 on the others.
    rollout = torch.full((2, 3), -math.log(1.5))
    rollout[:, 0] = -math.log(3.0)
    _, loss, m = _loss(LossConfig(tis_cap=2.0), rollout_logprobs=rollout)
    expected = (2.0 * -0.5 + 1.5 * -1.1 + 1.5 * -1.28 + 2.0 * 0.8 + 1.5 * 3.0) / 5
    assert close(loss.item(), expected, 1e-5)
    assert close(m["tis_mean"], (2.0 + 1.5 + 1.5 + 2.0 + 1.5) / 5, 1e-5)
    assert close(m["tis_clip_frac"], 2 / 5)


def test_k3_kl_to_reference():
    d = torch.tensor([[0.1, -0.2, 0.3], [0.0, 0.5, 9.0]])
    ref = RATIOS.log().float() + d  # ref - logp = d
    _, loss, m = _loss(LossConfig(tis_cap=None, kl_coef=0.1), ref_logprobs=ref)
    k3 = [math.exp(x) - x - 1 for x in [0.1, -0.2, 0.3, 0.0, 0.5]]
    assert close(m["kl_ref"], sum(k3) / 5, 1e-6)
    assert close(loss.item(), 0.184 + 0.1 * sum(k3) / 5, 1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        _loss(LossConfig(tis_cap=None, kl_coef=0.1))


def test_entropy_is_reported_and_optionally_rewarded():
    ent = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 100.0]])
    _, loss, m = _loss(entropy=ent)
    assert close(m["entropy"], 3.0) and close(loss.item(), 0.184)
    _, loss, _ = _loss(LossConfig(tis_cap=None, entropy_coef=0.01), entropy=ent)
    assert close(loss.item(), 0.184 - 0.01 * 3.0)


def test_all_masked_rows_and_zero_advantages_give_finite_zero_loss():
    # Masked positions hold placeholders (0.0 from the batch, extreme values from padding).
    logprobs = torch.tensor([[-50.0, 30.0, 0.0], [0.0, 0.0, 0.0]], requires_grad=True)
    rollout = torch.tensor([[0.0, -80.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for agg in ["token-mean", "seq-mean-token-mean"]:
        loss, m = policy_loss(logprobs, torch.zeros(2, 3), torch.tensor([1.0, -1.0]), mask,
                              LossConfig(aggregation=agg), rollout_logprobs=rollout,
                              entropy=torch.ones(2, 3))
        loss.backward()
        assert loss.item() == 0.0 and torch.isfinite(logprobs.grad).all() and logprobs.grad.eq(0).all()
        assert all(math.isfinite(v) for v in m.values()) and m["tokens"] == 0 and m["ratio_max"] == 1.0
    # One all-masked row next to a real one: the real row alone decides the loss.
    mask = torch.tensor([[False, False, False], [True, True, False]])
    adv, _ = compute_advantages([1.0, 1.0], ["g", "g"])  # zero-variance group -> A = 0
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, m = policy_loss(lp, torch.zeros(2, 3), adv, mask, LossConfig(aggregation="seq-mean-token-mean"))
    loss.backward()
    assert loss.item() == 0.0 and lp.grad.eq(0).all() and m["tokens"] == 2


def test_loss_config_validation_and_shape_errors():
    with pytest.raises(ValueError, match="aggregation"):
        LossConfig(aggregation="sum")
    with pytest.raises(ValueError, match="constant_normalizer"):
        LossConfig(aggregation="constant")
    with pytest.raises(ValueError, match="dual_clip"):
        LossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match="eps_low"):
        LossConfig(eps_low=1.5)
    with pytest.raises(ValueError, match="shape mismatch"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 4), ADV, MASK)


# ------------------------------------------------------------------------------------ Clip-Cov

def _on_policy(logp_values, adv, mask, cfg):
    """One on-policy update (old = logp: ratio 1, so clip-higher never acts): the loss and d loss / d logp."""
    logprobs = torch.tensor(logp_values, requires_grad=True)
    loss, m = policy_loss(logprobs, logprobs.detach(), torch.tensor(adv), mask, cfg)
    loss.backward()
    return logprobs.grad, loss, m


def test_clip_cov_drops_the_gradient_of_tokens_whose_logp_and_advantage_covary_within_the_bounds():
    """Row 0 (A=+1) has a likely token (-0.1) and an unlikely one (-6.0); row 1 (A=-1) the same. The
    centred product (A - mean A)(logp - mean logp) is +2.93 for the likely token of the good row, +2.97
    for the unlikely token of the bad row, about -2.95 for the other two and +-0.03 for the middle ones:
    only two lie in [1, 5], and a ratio that asks for more than them still takes those two alone."""
    logp = [[-0.1, -3.0, -6.0], [-0.1, -3.0, -6.0]]
    adv, mask = [1.0, -1.0], torch.ones(2, 3, dtype=torch.bool)
    plain, plain_loss, _ = _on_policy(logp, adv, mask, LossConfig(tis_cap=None))
    grad, loss, m = _on_policy(logp, adv, mask, LossConfig(tis_cap=None, clip_cov_ratio=0.5))
    assert grad[0, 0] == 0 and grad[1, 2] == 0          # the entropy-collapsing pair: no gradient
    assert plain[0, 0] != 0 and plain[1, 2] != 0
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[0, 0] = keep[1, 2] = False
    assert torch.equal(grad[keep], plain[keep])          # every other token's gradient is unchanged
    assert close(loss.item(), plain_loss.item())         # the loss value is unchanged: only gradients go
    assert close(m["clip_cov_frac"], 2 / 6)


def test_clip_cov_takes_its_share_of_the_tokens_and_only_unmasked_ones():
    torch.manual_seed(0)
    logp = torch.linspace(-8.0, -0.01, 400).reshape(4, 100)
    adv, mask = [-2.0, -2.0, 2.0, 2.0], torch.ones(4, 100, dtype=torch.bool)
    mask[:, 90:] = False
    grad, _, m = _on_policy(logp.tolist(), adv, mask, LossConfig(tis_cap=None, clip_cov_ratio=0.01))
    dropped = (grad == 0) & mask
    assert int(dropped.sum()) == 3 and close(m["clip_cov_frac"], 3 / 360)  # int(0.01 * 360) tokens
    assert m["tokens"] == 360
    _, _, off = _on_policy(logp.tolist(), adv, mask, LossConfig(tis_cap=None))
    assert "clip_cov_frac" not in off


def test_clip_cov_config_is_validated():
    with pytest.raises(ValueError, match="clip_cov_ratio"):
        LossConfig(clip_cov_ratio=1.0)
    with pytest.raises(ValueError, match="clip_cov_lb < clip_cov_ub"):
        LossConfig(clip_cov_ratio=1e-3, clip_cov_lb=5.0, clip_cov_ub=1.0)
