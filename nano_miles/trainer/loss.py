"""GRPO advantages and the dual-clip PPO policy loss, on plain tensors aligned to prediction positions
(`[B, T]`: position t scores token t+1; `loss_mask` marks the model's own response tokens).

Every aggregation divides by a normaliser computed ONCE over the whole batch (`loss_normalizer`), so
the micro-batch losses sum to the loss of the whole batch, whatever the micro-batch size.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

ESTIMATORS = ("grpo", "dr_grpo", "rloo")
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "constant")


@dataclass
class AdvantageConfig:
    estimator: str = "grpo"      # grpo: (R - mean) / (std + eps); dr_grpo: R - mean; rloo: R - mean of the others
    eps: float = 1e-4            # added to the std (grpo only)
    unbiased_std: bool = True    # sample std (divide by G-1), as torch.std, verl and slime do; False: population std
    filter_zero_variance: bool = False  # DAPO dynamic sampling: drop groups whose rewards are all equal

    def __post_init__(self):
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"advantage estimator must be one of {ESTIMATORS}, got {self.estimator!r}")
        if not self.eps >= 0:
            raise ValueError(f"advantage eps must be >= 0, got {self.eps}")


@dataclass
class LossConfig:
    eps_low: float = 0.2          # ratio clipped to [1 - eps_low, 1 + eps_high] (clip-higher: eps_high > eps_low)
    eps_high: float = 0.28        # upper clip of the ratio (see eps_low)
    dual_clip: float | None = 3.0  # c: for negative advantages the loss is capped at -A * c; None disables
    aggregation: str = "token-mean"  # token-mean | seq-mean-token-mean | constant (Dr. GRPO: constant_normalizer)
    constant_normalizer: float | None = None  # Dr. GRPO: tokens per sequence (e.g. max response length)
    kl_coef: float = 0.0          # k3 KL to the initial policy (a frozen copy on the trainer's device); 0 = off, no copy
    entropy_coef: float = 0.0     # subtracted from the loss; 0 = entropy is only reported
    tis_cap: float | None = 2.0   # truncated importance sampling weight min(pi_old / pi_rollout, cap); None = off
    clip_cov_ratio: float = 0.0   # Clip-Cov (Cui et al. 2025; verl's loss_mode clip_cov, 2e-4 there): this share of a micro-batch's tokens, drawn among those whose covariance term lies in [clip_cov_lb, clip_cov_ub], gets no gradient; 0 = off
    clip_cov_lb: float = 1.0      # Clip-Cov: lower bound of (A - mean A) * (logp - mean logp) for a token to be drawn
    clip_cov_ub: float = 5.0      # Clip-Cov: upper bound of it (a larger one is an outlier, left alone)

    def __post_init__(self):
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ValueError(f"need 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, {self.eps_high}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (or None), got {self.dual_clip}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"loss aggregation must be one of {AGGREGATIONS}, got {self.aggregation!r}")
        if self.aggregation == "constant" and not (self.constant_normalizer and self.constant_normalizer > 0):
            raise ValueError("aggregation 'constant' (Dr. GRPO) needs constant_normalizer > 0")
        if self.kl_coef < 0 or self.entropy_coef < 0:
            raise ValueError("kl_coef and entropy_coef must be >= 0")
        if self.tis_cap is not None and self.tis_cap <= 0:
            raise ValueError(f"tis_cap must be > 0 (or None), got {self.tis_cap}")
        if not 0 <= self.clip_cov_ratio < 1 or not self.clip_cov_lb < self.clip_cov_ub:
            raise ValueError(f"need 0 <= clip_cov_ratio < 1 and clip_cov_lb < clip_cov_ub, got {self.clip_cov_ratio}, "
                             f"{self.clip_cov_lb}, {self.clip_cov_ub}")


def group_rows(group_ids) -> list[list[int]]:
    """Row indices of each group, groups in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    return list(groups.values())


def compute_advantages(rewards, group_ids, cfg: AdvantageConfig | None = None):
    """(advantages [B] float32, keep [B] bool), relative to each sample's group. A group whose rewards
    are all equal (or of one) has advantages exactly 0, and keep=False with cfg.filter_zero_variance."""
    cfg = cfg or AdvantageConfig()
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    if rewards.dim() != 1 or len(group_ids) != rewards.numel():
        raise ValueError(f"need one group id per reward: {rewards.numel()} rewards, {len(group_ids)} ids")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite")
    adv = torch.zeros_like(rewards)
    keep = torch.ones(rewards.numel(), dtype=torch.bool)
    for idx in group_rows(group_ids):
        idx = torch.tensor(idx)
        r = rewards[idx].double()  # float64: group statistics with no cancellation error
        if len(idx) < 2 or bool((r == r[0]).all()):
            keep[idx] = not cfg.filter_zero_variance
            continue  # advantage stays exactly 0
        centred = r - r.mean()
        if cfg.estimator == "grpo":
            a = centred / (r.std(unbiased=cfg.unbiased_std) + cfg.eps)
        elif cfg.estimator == "dr_grpo":
            a = centred
        else:  # rloo: R_i - mean_{j != i} R_j == G / (G - 1) * (R_i - mean)
            a = centred * len(idx) / (len(idx) - 1)
        adv[idx] = a.float()
    return adv, keep


def parity_sums(logprobs, rollout_logprobs, sampled, stale) -> tuple:
    """|trainer - engine| log-probs over the `sampled` tokens, before the update: (sum, count, max) over
    rows sampled with the trainer's weights, (sum, count) over `stale` ones (async: it holds the drift)."""
    gap = (logprobs.detach() - rollout_logprobs).abs()
    fresh, old = gap[sampled & ~stale], gap[sampled & stale]
    return (float(fresh.double().sum()), fresh.numel(), float(fresh.max()) if fresh.numel() else 0.0,
            float(old.double().sum()), old.numel())


def parity_metrics(parts: list[tuple]) -> dict:
    """The logprob_diff_* metrics of parity_sums parts (None where no row counts)."""
    n, stale_n = sum(p[1] for p in parts), sum(p[4] for p in parts)
    return {"logprob_diff_mean": sum(p[0] for p in parts) / n if n else None,
            "logprob_diff_max": max(p[2] for p in parts if p[1]) if n else None,
            "logprob_diff_stale_mean": sum(p[3] for p in parts) / stale_n if stale_n else None}


def loss_normalizer(loss_mask: torch.Tensor, cfg: LossConfig) -> float:
    """The whole batch's denominator for cfg.aggregation."""
    if cfg.aggregation == "token-mean":
        return float(max(int(loss_mask.sum()), 1))
    if cfg.aggregation == "seq-mean-token-mean":
        return float(max(int((loss_mask.sum(-1) > 0).sum()), 1))  # rows with no response token do not count
    return float(loss_mask.shape[0] * cfg.constant_normalizer)


def aggregate(values: torch.Tensor, loss_mask: torch.Tensor, cfg: LossConfig, normalizer: float) -> torch.Tensor:
    """Per-token values [B, T] -> this micro-batch's share of the batch loss."""
    mask = loss_mask.to(values.dtype)
    if cfg.aggregation == "seq-mean-token-mean":
        per_seq = (values * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_seq.sum() / normalizer
    return (values * mask).sum() / normalizer


def _masked_mean(values, mask):
    return (values * mask).sum() / mask.sum().clamp(min=1)


def clip_cov_mask(logprobs, adv, loss_mask, clipped, cfg: LossConfig):
    """Clip-Cov's tokens (bool [B, T]), whose gradient is dropped: entropy falls where a token's log-prob
    and advantage co-vary most. A random clip_cov_ratio of the tokens the PPO clip left alone whose
    centred product lies in [lb, ub]; means over this micro-batch's tokens, as in verl. (With one update
    a step the ratio is 1 and clip-higher never acts; this still does.)"""
    mask = loss_mask.to(torch.float32)
    logp = logprobs.detach().float()
    cov = (adv - _masked_mean(adv, mask)) * (logp - _masked_mean(logp, mask))
    eligible = loss_mask & ~clipped & (cov > cfg.clip_cov_lb) & (cov < cfg.clip_cov_ub)
    chosen = torch.zeros_like(loss_mask)
    candidates = eligible.nonzero()
    if len(candidates):
        n = max(int(cfg.clip_cov_ratio * int(loss_mask.sum())), 1)
        pick = candidates[torch.randperm(len(candidates), device=candidates.device)[:n]]
        chosen[pick[:, 0], pick[:, 1]] = True
    return chosen


def policy_loss(logprobs, old_logprobs, advantages, loss_mask, cfg: LossConfig | None = None, *,
                normalizer: float | None = None, rollout_logprobs=None, ref_logprobs=None, entropy=None):
    """Dual-clip PPO loss with clip-higher, optional TIS (given the engine's rollout_logprobs), k3 KL,
    entropy bonus and Clip-Cov; advantages [B] or [B, T]. Returns (loss, metrics): "pg_loss" this call's
    share of the batch loss, "ratio_max" a max, the others means over the masked tokens, "tokens" their
    count (so callers can weight micro-batches)."""
    cfg = cfg or LossConfig()
    if logprobs.shape != loss_mask.shape or old_logprobs.shape != loss_mask.shape:
        raise ValueError(f"shape mismatch: logprobs {tuple(logprobs.shape)}, old {tuple(old_logprobs.shape)}, "
                         f"mask {tuple(loss_mask.shape)}")
    if normalizer is None:
        normalizer = loss_normalizer(loss_mask, cfg)
    mask = loss_mask.to(torch.float32)
    adv = advantages.to(torch.float32)
    if adv.dim() == 1:
        adv = adv[:, None].expand_as(logprobs)
    old = old_logprobs.detach().float()

    # Masked positions can hold anything (padding, 0.0 placeholders): zero their log-ratio so that
    # exp() stays finite there; the clamp bounds it for real tokens too (exp(20) ~ 5e8).
    log_ratio = torch.where(loss_mask, logprobs.float() - old, torch.zeros_like(old)).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    pg = torch.maximum(loss_unclipped, loss_clipped)  # pessimistic of the two (standard PPO)
    clipped = loss_clipped > loss_unclipped
    if cfg.dual_clip is not None:
        # For A < 0 a huge ratio makes -A * ratio unbounded: cap it at -A * c.
        cap = -adv * cfg.dual_clip
        dual = (adv < 0) & (pg > cap)
        pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)
    else:
        dual = torch.zeros_like(clipped)

    metrics = {}
    if cfg.clip_cov_ratio > 0:
        detached = clip_cov_mask(logprobs, adv, loss_mask, clipped, cfg)
        pg = torch.where(detached, pg.detach(), pg)  # the token still counts in the loss value, not its gradient
        metrics["clip_cov_frac"] = _masked_mean(detached.float(), mask).item()
    if rollout_logprobs is not None and cfg.tis_cap is not None:
        # Truncated importance sampling: the samples came from the engine's policy, not ours.
        tis_log = torch.where(loss_mask, old - rollout_logprobs.float(), torch.zeros_like(old)).clamp(max=20.0)
        tis = torch.exp(tis_log).clamp(max=cfg.tis_cap)
        pg = pg * tis
        metrics["tis_mean"] = _masked_mean(tis, mask).item()
        metrics["tis_clip_frac"] = _masked_mean((tis_log > math.log(cfg.tis_cap)).float(), mask).item()

    loss = aggregate(pg, loss_mask, cfg, normalizer)
    pg_loss = loss.detach()
    if cfg.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs")
        # k3 estimator of KL(pi || ref): exp(ref - logp) - (ref - logp) - 1 >= 0, unbiased, low variance.
        d = torch.where(loss_mask, ref_logprobs.float() - logprobs.float(), torch.zeros_like(old)).clamp(-20.0, 20.0)
        kl = torch.exp(d) - d - 1.0
        loss = loss + cfg.kl_coef * aggregate(kl, loss_mask, cfg, normalizer)
        metrics["kl_ref"] = _masked_mean(kl.detach(), mask).item()
    if entropy is not None:
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * aggregate(entropy, loss_mask, cfg, normalizer)
        metrics["entropy"] = _masked_mean(entropy.detach().float(), mask).item()

    ratio_d = ratio.detach()
    metrics.update(
        pg_loss=pg_loss.item(),
        clip_frac=_masked_mean(clipped.float(), mask).item(),
        dual_clip_frac=_masked_mean(dual.float(), mask).item(),
        approx_kl=_masked_mean(-log_ratio.detach(), mask).item(),  # k1 estimate of KL(pi_old || pi)
        ratio_mean=_masked_mean(ratio_d, mask).item(),
        ratio_max=ratio_d[loss_mask].max().item() if bool(loss_mask.any()) else 1.0,
        tokens=int(loss_mask.sum()),
    )
    return loss, metrics
