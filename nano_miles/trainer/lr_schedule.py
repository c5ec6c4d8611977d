"""The learning rate of each optimizer step: linear warm-up, then constant, cosine or linear decay.

The schedule is a pure function of the optimizer step, which the trainer keeps and checkpoints, so a
resumed run continues on the same curve.

    lr_schedule = "cosine", warmup_steps = W, decay_steps = D, min_lr_ratio = m:
    step s < W:      lr * (s + 1) / W
    W <= s < D:      lr * (m + (1 - m) * (1 + cos(pi * (s - W) / (D - W))) / 2)
    s >= D:          lr * m
"""
from __future__ import annotations

import math

SCHEDULES = ("constant", "cosine", "linear")


def lr_at(optim, step: int) -> float:
    """The learning rate of optimizer step `step` (0-based: the number of steps taken before it)
    under `optim` (an OptimConfig whose decay_steps is resolved, > 0 when the schedule decays)."""
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    if optim.lr_schedule == "constant":
        return optim.lr
    if optim.decay_steps <= optim.warmup_steps:
        raise ValueError(f"optim.lr_schedule={optim.lr_schedule} needs optim.decay_steps past the warm-up "
                         f"(train sets it to the run's optimizer steps when it is 0)")
    progress = min(1.0, (step - optim.warmup_steps) / (optim.decay_steps - optim.warmup_steps))
    if optim.lr_schedule == "cosine":
        left = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        left = 1.0 - progress
    return optim.lr * (optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * left)
