"""The policy update of one training step: GRPO advantages, then one or several optimizer steps."""
from __future__ import annotations

import torch
from tqdm import tqdm

from nano_miles.trainer.loss import (AdvantageConfig, compute_advantages, group_rows, parity_metrics,
                                     parity_sums)
from nano_miles.rollout.batch import build_rollout_batch


def policy_update(trainer, trajs, advantage_cfg: AdvantageConfig, pad_id: int, echo=print,
                  updates: int = 1, reference=None, train_on: list[bool] | None = None) -> tuple[dict, str | None]:
    """Advantages and `updates` optimizer steps on the batch (on every rank, the same trajectories);
    returns the trainer's metrics and why the update was skipped. `reference` (a ReferencePolicy) gives
    the KL penalty's log-probs. With updates > 1, mini-batches of whole groups, one AdamW step each
    (PPO's mini-batch epoch), every ratio against the policy before the first step.

    `train_on` marks the trajectories trained on (None: all); the others (async: too stale) still
    count in their group's baseline: they are its slowest episodes, and leaving them out would bias it."""
    train_on = [True] * len(trajs) if train_on is None else train_on
    if not any(train_on):
        return {}, "no trajectory within the staleness bound"
    advantages, keep = compute_advantages([float(t.reward) for t in trajs], [t.group_id for t in trajs], advantage_cfg)
    # DAPO dynamic sampling may have dropped zero-variance groups (keep)
    if not (rows := [i for i, (k, t) in enumerate(zip(keep.tolist(), train_on)) if k and t]):
        return {}, "every group had equal rewards (filtered)"
    batch = build_rollout_batch([trajs[i] for i in rows], pad_id=pad_id, policy_version=trainer.step)  # marks the stale rows
    advantages = advantages[torch.tensor(rows)]
    minibatches = _minibatches(batch.group_ids, updates)
    old = trainer.logprobs(batch) if len(minibatches) > 1 else None
    if bool(batch.scripted.any()):
        # A scripted sample (rollout.guide_unsolved) was never sampled, so it has no sampling log-probs:
        # it takes the trainer's own, which makes its TIS weight 1 (trained on as if sampled now).
        rows = batch.scripted.nonzero().flatten()
        own = old[rows] if old is not None else trainer.logprobs(batch.select(rows.tolist()))
        batch.rollout_logprobs[rows] = own * batch.loss_mask[rows]
    ref = reference.logprobs(batch) if reference is not None else None
    results = []
    with tqdm(total=len(batch), desc="update", unit="seq", leave=False, dynamic_ncols=True,
              disable=trainer.rank != 0) as bar:  # every rank makes the update; rank 0 shows it
        for rows in minibatches:
            start = bar.n

            def advance(done, total, start=start, rows=rows):
                bar.update(start + round(done * len(rows) / total) - bar.n)

            sub = batch if len(minibatches) == 1 else batch.select(rows)
            try:
                results.append(trainer.train_step(sub, advantages[torch.tensor(rows)], on_micro_batch=advance,
                                                  old_logprobs=None if old is None else old[torch.tensor(rows)],
                                                  ref_logprobs=None if ref is None else ref[torch.tensor(rows)]))
            except FloatingPointError as e:  # NaN/inf loss or gradient: the trainer skipped the update
                echo(f"update skipped: {e}")  # (earlier mini-batches' steps stand; the sync sends them)
                return {}, str(e)
    if len(results) == 1:
        return results[0], None
    merged = _merge_update_metrics(results)
    # Parity is a property of the sampling policy: from the log-probs taken before the first step.
    merged.update(parity_metrics([parity_sums(old, batch.rollout_logprobs, batch.loss_mask & ~batch.scripted[:, None],
                                              batch.stale[:, None])]))
    return merged, None


def _minibatches(group_ids: list[str], updates: int) -> list[list[int]]:
    """Row indices of up to `updates` mini-batches of whole groups, dealt in order (sizes within a group)."""
    groups = group_rows(group_ids)
    k = max(1, min(updates, len(groups)))
    chunks = [[] for _ in range(k)]
    for n, rows in enumerate(groups):
        chunks[n * k // len(groups)].extend(rows)
    return chunks


def _merge_update_metrics(results: list[dict]) -> dict:
    merged = {}
    for key in results[0]:
        if not (values := [r[key] for r in results if r.get(key) is not None]):
            merged[key] = None
            continue
        if key in ("ratio_max", "peak_mem_gib", "logprob_diff_max"):
            merged[key] = max(values)
        elif key in ("response_tokens", "step_ms"):
            merged[key] = sum(values)
        elif key in ("step", "lr"):
            merged[key] = values[-1]
        else:
            merged[key] = sum(values) / len(values)
    merged["updates"] = len(results)
    return merged
