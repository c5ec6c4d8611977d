"""The reference policy of the KL penalty (loss.kl_coef > 0): a frozen copy of the initial policy.

Its log-probs come from the trainer's own chunked FP32 path (Trainer.logprobs) run on the frozen
copy, so the KL term compares like with like: same micro-batches, same lm_head precision.

With N ranks (a ShardedTrainer) the copy is sharded as the policy is: each rank copies its own
shards, in the compute dtype (the single-process copy is the compute model too), into a second set
of FSDP modules, and ShardedTrainer.logprobs runs over them (the same split of groups and lockstep).
No rank holds the whole reference: 2 bytes a parameter / N in bf16.
"""
from __future__ import annotations

import copy

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy
from transformers import AutoModelForCausalLM

from nano_miles.trainer.sharded import ShardedTrainer, _rebuild_buffers, shard_model


class ReferencePolicy:
    def __init__(self, trainer):
        """Freeze the trainer's current weights (build it before any update or checkpoint load: the
        reference of a resumed run is still the initial policy). `trainer`: a Trainer, a ShardedTrainer,
        or rank 0's TrainerRanks (which has every rank freeze its shards)."""
        if hasattr(trainer, "reference_logprobs"):  # TrainerRanks: a collective on every rank
            trainer.freeze_reference()
            self._logprobs = trainer.reference_logprobs
            return
        if isinstance(trainer, ShardedTrainer):
            self._logprobs = _frozen_shards(trainer).logprobs
            return
        frozen = copy.deepcopy(trainer.model).requires_grad_(False)
        # A shallow copy of the trainer that sees the frozen model: Trainer.logprobs reads self.model,
        # self.cfg and self.device only, and never touches the optimizer or the masters.
        view = copy.copy(trainer)
        view.model = frozen
        self._logprobs = view.logprobs

    @torch.no_grad()
    def logprobs(self, batch) -> torch.Tensor:
        """FP32 log-probs [B, L-1] of the batch's response tokens under the initial policy."""
        return self._logprobs(batch)


@torch.no_grad()
def _frozen_shards(trainer: ShardedTrainer) -> ShardedTrainer:
    """A shallow copy of the sharded trainer whose model (and FSDP modules) hold a frozen copy of its
    current weights: ShardedTrainer.logprobs reads self.root, self.fsdp_modules, self.cfg, self.env."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(trainer.model.config), dtype=trainer.dtype)
    model.requires_grad_(False)
    view = copy.copy(trainer)
    view.model = model
    mp = MixedPrecisionPolicy(param_dtype=trainer.dtype, cast_forward_inputs=False)
    view.root, view.fsdp_modules = shard_model(model, view, trainer.params[0].device_mesh, mp,
                                               one_rank=trainer.one_rank)
    view.root.to_empty(device=trainer.device)
    _rebuild_buffers(model, trainer.device)
    frozen = dict(model.named_parameters())
    for name, p in zip(trainer.names, trainer.params):  # the same shapes on the same mesh: the same rows
        frozen[name].to_local().copy_(p.to_local())
    return view
