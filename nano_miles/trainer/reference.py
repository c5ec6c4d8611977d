"""The reference policy of the KL penalty (loss.kl_coef > 0): a frozen copy of the initial policy, in
the compute dtype, scored by the trainer's own chunked FP32 path (Trainer.logprobs), so the KL term
compares like with like. With N ranks each rank copies its own shards into a second set of FSDP
modules, so no rank holds the whole reference.
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
        """Freeze the trainer's current weights: build it before any update or checkpoint load (the
        reference of a resumed run is still the initial policy), on every rank."""
        # A shallow copy of the trainer that sees the frozen model: Trainer.logprobs reads only the model.
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
