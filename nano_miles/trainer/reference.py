"""The reference policy of the KL penalty (loss.kl_coef > 0): a frozen copy of the initial policy.

Its log-probs come from the trainer's own chunked FP32 path (Trainer.logprobs) run on the frozen copy,
so the KL term compares like with like: same micro-batches, same lm_head precision. The copy is in
the compute dtype, as the trainer's compute model is. With N ranks it is sharded as the policy is:
each rank copies its own shards into a second set of FSDP modules, and Trainer.logprobs runs over them
(the same split of groups, the same lockstep), so no rank holds the whole reference.
"""
from __future__ import annotations

import copy

import torch
from transformers import AutoModelForCausalLM

from nano_miles.engine.model import CausalLM
from nano_miles.trainer import fsdp


class ReferencePolicy:
    @torch.no_grad()
    def __init__(self, trainer):
        """Freeze the trainer's current weights (build it before any update or checkpoint load: the
        reference of a resumed run is still the initial policy). Every rank builds it."""
        # A shallow copy of the trainer that sees the frozen model: Trainer.logprobs reads the model
        # (through FSDP's root with N ranks), never the optimizer or the masters.
        self.view = view = copy.copy(trainer)
        if trainer.env is None:
            view.model = copy.deepcopy(trainer.model).requires_grad_(False)
            if trainer.exact_model is not None:
                view.exact_model = CausalLM.sharing_parameters(view.model).use_batch_invariant_ops()
            return
        with torch.device("meta"):
            view.model = AutoModelForCausalLM.from_config(copy.deepcopy(trainer.model.config), dtype=trainer.dtype)
        view.model.requires_grad_(False)
        view.root, view.fsdp_modules = fsdp.shard_model(view.model, view, trainer.params[0].device_mesh,
                                                         trainer.dtype, trainer.device)
        frozen = dict(view.model.named_parameters())
        for name, p in zip(trainer.names, trainer.params):  # the same shapes on the same mesh: the same rows
            frozen[name].to_local().copy_(p.to_local())

    def logprobs(self, batch) -> torch.Tensor:
        """FP32 log-probs [B, L-1] of the batch's response tokens under the initial policy (collective)."""
        return self.view.logprobs(batch)
