"""The reference policy of the KL penalty (loss.kl_coef > 0): a frozen copy of the initial policy.

Its log-probs come from the trainer's own chunked FP32 path (Trainer.logprobs) run on the frozen
copy, so the KL term compares like with like: same micro-batches, same lm_head precision.
"""
from __future__ import annotations

import copy

import torch


class ReferencePolicy:
    def __init__(self, trainer):
        """Freeze the trainer's current weights (build it before any update or checkpoint load: the
        reference of a resumed run is still the initial policy)."""
        frozen = copy.deepcopy(trainer.model).requires_grad_(False)
        # A shallow copy of the trainer that sees the frozen model: Trainer.logprobs reads self.model,
        # self.cfg and self.device only, and never touches the optimizer or the masters.
        self._view = copy.copy(trainer)
        self._view.model = frozen

    @torch.no_grad()
    def logprobs(self, batch) -> torch.Tensor:
        """FP32 log-probs [B, L-1] of the batch's response tokens under the initial policy."""
        return self._view.logprobs(batch)
