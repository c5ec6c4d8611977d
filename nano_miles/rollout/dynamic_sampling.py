"""DAPO's dynamic sampling: train only on groups whose samples disagree, and keep the batch full.

A group whose samples all got the same reward has a GRPO advantage of 0 for every sample: it costs an
update and teaches nothing. With rollout.dynamic_sampling a step starts round_size(tasks_per_step)
groups and drops each that comes back without a signal, starting a group of the stream's next task
when those kept and those running cannot fill the batch (producer.py), up to max_sampling_rounds x
round_size groups (verl: algorithm.filter_groups, max_num_gen_batches). A step at the bound trains on
what it has, or skips its update (sampling_note); surplus groups with a signal are not trained on.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from nano_miles.rollout.episode import RolloutConfig


@dataclass
class TrainRolloutConfig(RolloutConfig):
    """rollout.* of `nano-miles train`: every command's rollout keys, and how training fills its groups."""
    dynamic_sampling: bool = False   # DAPO: drop groups whose rewards are all equal (no signal) and refill the step's batch from the task stream
    max_sampling_rounds: int = 3     # dynamic sampling: a step starts at most this many rounds' worth of groups (the first wave included); then it trains on the groups it has
    oversample: float = 1.0          # dynamic sampling: a round (the first wave) is this many times tasks_per_step groups (verl's gen_batch_size / train_batch_size)
    pass_over_saturated: int = 0     # a task whose last group had equal rewards (all solved, or none) is passed over at its next N appearances in the task stream; 0 = off
    guide_unsolved: bool = False     # a group no sample solved gets the task's scripted solution as one of its samples (nano_miles/rollout/guidance.py)
    carry_over: bool = False         # mode=async: a step ends once the groups that came back fill its batch; groups still running go on into the next step (needs max_staleness >= 2; 3 drops fewer as stale)

    def __post_init__(self):
        super().__post_init__()
        if self.max_sampling_rounds < 1:
            raise ValueError(f"rollout.max_sampling_rounds must be >= 1, got {self.max_sampling_rounds}")
        if not 0 <= self.pass_over_saturated <= 100:
            raise ValueError(f"rollout.pass_over_saturated must be in [0, 100] (0 = off), got {self.pass_over_saturated}")
        if not self.oversample >= 1.0:
            raise ValueError(f"rollout.oversample must be >= 1, got {self.oversample}")
        if self.dynamic_sampling and self.group_size < 2:
            raise ValueError("rollout.dynamic_sampling needs rollout.group_size >= 2: a group of one sample never "
                             "has a learning signal, so every group would be dropped")

    def round_size(self, missing: int) -> int:
        """Groups to roll out when `missing` are needed: a step's first wave, and its unit of work."""
        return math.ceil(missing * self.oversample) if self.dynamic_sampling else missing


def has_signal(group: list) -> bool:
    """At least two samples that training would use (not lost to the sandbox) with different rewards."""
    rewards = {t.reward for t in group if not t.broken}
    return len(rewards) > 1


@dataclass
class SamplingTally:
    """What a step rolled out and what it kept (its metrics)."""
    enabled: bool
    target: int                 # tasks_per_step
    generated: int = 0          # groups rolled out (tasks taken from the stream), refills included
    kept: int = 0               # groups handed to the update
    without_signal: int = 0     # groups whose rewards were all equal (or lost): dropped when enabled
    rounds: int = 0             # rounds' worth of groups started: ceil(generated / round_size(target))
    max_rounds: int = 1
    refills: int = 0            # groups started after the first wave (each when a group came back without a signal)
    passed_over: int = 0        # task appearances the stream passed over (rollout.pass_over_saturated)
    guided: int = 0             # groups given a scripted sample (rollout.guide_unsolved)
    guide_rejected: int = 0     # unsolved groups left unguided: their scripted episode was not judged correct
    carried: int = 0            # rollout.carry_over: groups left to the next step (still running, or beyond the batch)

    @property
    def note(self) -> str | None:
        """Why the batch is not full, when dynamic sampling could not fill it."""
        if not self.enabled or self.kept >= self.target:
            return None
        return (f"dynamic sampling: {self.kept} of {self.target} groups with a learning signal after "
                f"{self.rounds} round(s) ({self.generated} groups rolled out, {self.without_signal} with equal "
                f"rewards; rollout.max_sampling_rounds={self.max_rounds}): "
                + ("trained on those" if self.kept else "nothing to train on, update skipped"))

    def metrics(self) -> dict:
        share = self.generated and 1 / self.generated
        dropped = self.without_signal if self.enabled else 0
        return {"groups_generated": self.generated, "groups_kept": self.kept, "groups_dropped": dropped,
                "dropped_group_share": dropped * share, "zero_variance_share": self.without_signal * share,
                "sampling_rounds": self.rounds, "sampling_note": self.note, "tasks_passed_over": self.passed_over,
                "groups_guided": self.guided, "groups_guide_rejected": self.guide_rejected,
                "groups_carried": self.carried}
