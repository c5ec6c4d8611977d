"""The trainer: FP32 log-probs of the sampled tokens, micro-batches, FP32 master weights, AdamW.

- Log-probs: the decoder runs on a micro-batch of right-padded sequences (causal attention means a
  real token never sees the padding after it, so no attention mask is needed); then only the hidden
  states of the positions that are scored go through lm_head, a chunk of tokens at a time, with
  log_softmax in float32 (logprob_head.py: the backward recomputes each chunk's logits), so neither
  the forward nor the backward ever holds [batch, length, vocab] logits: at most [chunk, vocab].
- Master weights: with dtype bfloat16 an lr 1e-6 AdamW step is far below a bf16 weight's spacing
  (2^-8 relative), so a bf16 parameter would never move. The optimizer therefore owns FP32 copies
  of every parameter (and FP32 moments); gradients are accumulated into them in FP32 after every
  micro-batch, and after each step the compute model receives masters.to(bfloat16). With dtype
  float32 the masters are the model's own parameters.
- True on-policy (`true_on_policy=True`): the log-probs come from the ENGINE's model code
  (nano_miles/engine/model.py) run over whole sequences on this trainer's own parameters, with every
  op from nano_miles/engine/batch_invariant.py, so they equal the engine's returned log-probs bit for bit
  (the engine must run with the same flag). Forward values are the batch-invariant ones; gradients
  come from the ordinary fast backward of each op.
- Memory: AdamW's step is the fused kernel (no temporary full-size copies of the moments, which the
  foreach step makes: +2 GB for a 0.5B model in FP32); gradients are freed (set_to_none) after it.
  lm_head's gradient is one buffer per micro-batch (logprob_head.py). A CPU trainer returns freed
  tensors' memory to the kernel (heap.py).
  On CPU, share_weights() moves the tensors an engine serves into shared memory that a CPU engine
  on this machine maps instead of holding its own copy (nano_miles/engine/shared_weights.py).
- One optimizer step per train_step. Unless old log-probs are passed in, the policy that sampled
  the batch is the current one, so the PPO ratio is exactly 1 and old = logprobs.detach().
"""
from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from nano_miles.engine import batch_invariant
from nano_miles.trainer import heap
from nano_miles.trainer.loss import LossConfig, loss_normalizer, policy_loss
from nano_miles.config import filled_in
from nano_miles.dtypes import DTYPES, TRAINABLE
from nano_miles.engine.model import CausalLM
from nano_miles.engine.weights import NonFiniteWeights, non_finite
from nano_miles.trainer.logprob_head import head_logprobs
from nano_miles.trainer.lr_schedule import SCHEDULES, set_lr
from nano_miles.engine.shared_weights import SharedWeights


@dataclass
class OptimConfig:
    lr: float = 1e-6            # AdamW learning rate
    beta1: float = 0.9          # AdamW first-moment decay
    beta2: float = 0.999        # AdamW second-moment decay
    eps: float = 1e-8           # AdamW denominator epsilon
    weight_decay: float = 0.0   # AdamW decoupled weight decay
    max_grad_norm: float = 1.0  # clip the global FP32 gradient norm; 0 disables clipping
    lr_schedule: str = "constant"  # constant | cosine | linear: the decay after warm-up (nano_miles/trainer/lr_schedule.py)
    warmup_steps: int = 0       # optimizer steps of linear warm-up from lr/warmup_steps to lr; 0 = none
    decay_steps: int = 0        # cosine | linear: optimizer steps until the decay reaches min_lr_ratio; 0 = the run's (steps x updates_per_step), as HF's schedulers count
    min_lr_ratio: float = 0.0   # cosine | linear: the final learning rate, as a fraction of lr

    def __post_init__(self):
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"optim.lr must be a positive number, got {self.lr}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"optim betas must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.eps <= 0 or self.weight_decay < 0 or self.max_grad_norm < 0:
            raise ValueError("optim.eps must be > 0, weight_decay and max_grad_norm >= 0")
        if self.lr_schedule not in SCHEDULES:
            raise ValueError(f"optim.lr_schedule must be one of {', '.join(SCHEDULES)}, got {self.lr_schedule!r}")
        if self.warmup_steps < 0 or self.decay_steps < 0:
            raise ValueError("optim.warmup_steps and optim.decay_steps must be >= 0")
        if self.decay_steps and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"optim.decay_steps ({self.decay_steps}) must be past optim.warmup_steps ({self.warmup_steps})")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")


@dataclass
class TrainerConfig:
    """The trainer's own knobs are the `trainer.*` keys of `nano-miles train`; the fields marked
    filled_in are given by whoever builds the trainer (train: from its model, trainer_device, dtype,
    optim.* and loss.* keys)."""
    model: str = field(default="", metadata=filled_in("HF folder (see nano_miles.models.prepare.resolve_model)"))
    device: str = field(default="cpu", metadata=filled_in("the trainer's device"))
    dtype: str = field(default="float32", metadata=filled_in(
        "compute dtype: float32 | bfloat16 (masters and AdamW state are FP32)"))
    micro_batch_size: int = 0     # sequences per forward/backward; 0 = auto (8 on GPU, 1 on CPU)
    logprob_chunk: int = 0        # tokens per lm_head -> float32 log_softmax chunk; 0 = auto (1024 on GPU, 128 on CPU: 0.08 GB a [chunk, vocab] tensor for Qwen)
    gradient_checkpointing: bool | None = None  # recompute decoder layers in backward; none = on for a CPU trainer (a 4096-token episode keeps ~12 GB of activations without it), off on GPU
    compute_entropy: bool = True  # report the policy entropy (one more pass over each chunk's logits)
    nproc: int = 1                # trainer ranks: FSDP2 shards, one GPU each (gloo processes on CPU); train starts them itself
    dist_timeout_s: float = 300.0  # seconds before any collective of the trainer ranks (or a silent rank 0) fails the run
    true_on_policy: bool = field(default=False, metadata=filled_in(
        "batch-invariant forward shared with the engine: log-probs equal bit for bit (train: true_on_policy)"))
    temperature: float = field(default=1.0, metadata=filled_in(
        "the rollouts' sampling temperature: log-probs are of softmax(logits / T), the distribution sampled "
        "(train: rollout.temperature)"))
    optim: OptimConfig = field(default_factory=OptimConfig, metadata=filled_in("AdamW"))
    loss: LossConfig = field(default_factory=LossConfig, metadata=filled_in("the policy loss"))

    def __post_init__(self):
        if self.dtype not in TRAINABLE:
            raise ValueError(f"trainer dtype must be one of {list(TRAINABLE)}, got {self.dtype!r}")
        if self.micro_batch_size < 0 or self.logprob_chunk < 0:
            raise ValueError("trainer.micro_batch_size and trainer.logprob_chunk must be >= 0 (0 = auto)")
        if isinstance(self.nproc, bool) or not isinstance(self.nproc, int) or self.nproc < 1:
            raise ValueError(f"trainer.nproc must be an integer >= 1, got {self.nproc!r}")
        if not self.dist_timeout_s > 0:
            raise ValueError(f"trainer.dist_timeout_s must be > 0, got {self.dist_timeout_s}")
        if not self.temperature > 0:  # greedy rollouts (T=0) have no distribution to train
            raise ValueError(f"the trainer's temperature must be > 0, got {self.temperature}")


def _exact_chunk_logprobs(hidden, targets, weight, with_entropy: bool):
    """logprob_head.chunk_logprobs with the engine's batch-invariant head (true on-policy mode)."""
    logp_all = batch_invariant.log_softmax(batch_invariant.linear(hidden, weight, out_dtype=torch.float32))
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
    if not with_entropy:
        return logp, torch.zeros_like(logp)
    return logp, -(logp_all.exp() * logp_all).sum(-1)


class Trainer:
    def __init__(self, cfg: TrainerConfig, model: torch.nn.Module | None = None):
        self.device = torch.device(cfg.device)
        on_gpu = self.device.type == "cuda"
        cfg = dataclasses.replace(  # the autos, decided here once
            cfg, micro_batch_size=cfg.micro_batch_size or (8 if on_gpu else 1),
            logprob_chunk=cfg.logprob_chunk or (1024 if on_gpu else 128),
            gradient_checkpointing=not on_gpu if cfg.gradient_checkpointing is None else cfg.gradient_checkpointing)
        self.cfg = cfg
        self.dtype = DTYPES[cfg.dtype]
        if not on_gpu:
            heap.return_large_frees()  # freed gradients and activations leave the process (heap.py)
        if model is None:
            if not cfg.model:
                raise ValueError("TrainerConfig.model must name an HF model folder")
            from transformers import AutoModelForCausalLM
            model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=self.dtype)
        # Cast parameters only: model.to(dtype) would also round float buffers such as RoPE's
        # inv_freq to bf16, turning every rotation angle at position p into p * (inv_freq +- 2^-9
        # relative): radians off at a thousand tokens, where the engine computes them in FP32.
        self.model = model.to(device=self.device)
        for p in self.model.parameters():
            if p.is_floating_point() and p.dtype != self.dtype:
                p.data = p.data.to(self.dtype)
        low = [n for n, b in self.model.named_buffers() if n.endswith("inv_freq") and b.dtype != torch.float32]
        if low:
            raise ValueError(f"{low[0]} is {dict(self.model.named_buffers())[low[0]].dtype}, not float32: the model "
                             "was cast with .to(dtype); load it with from_pretrained(dtype=...) or cast parameters only")
        self.model.config.use_cache = False
        if self.dtype != torch.float32 and self.device.type == "cuda":
            # The only FP32 matmul in a bf16 trainer is the lm_head above, whose inputs are bf16 values
            # that TF32 holds exactly: TF32 tensor cores give the FP32-accumulated logits quickly.
            torch.set_float32_matmul_precision("high")
        for key in ("final_logit_softcapping", "logit_scale"):  # lm_head -> log_softmax assumes plain logits
            if getattr(self.model.config, key, None) not in (None, 1, 1.0):
                raise ValueError(f"models with {key} are not supported by the chunked log-prob head")
        self.model.train()  # Qwen2/Llama have no dropout; train() is what enables HF checkpointing
        if cfg.gradient_checkpointing:
            kwargs = {"use_reentrant": False}
            if hasattr(self.model, "activation_checkpointing_enable"):  # its name from transformers 5.2x on
                self.model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        # True on-policy: the engine's model code over these very parameters (shared, not copied).
        self.exact_model = CausalLM.sharing_parameters(self.model).use_batch_invariant_ops() if cfg.true_on_policy else None
        # named_parameters() lists a tied weight once (embed_tokens, not lm_head).
        self.names, self.params = zip(*[(n, p) for n, p in self.model.named_parameters() if p.requires_grad])
        if self.dtype == torch.float32:
            self.masters = list(self.params)
        else:
            self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        o = cfg.optim
        kwargs = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
        try:
            self.optimizer = torch.optim.AdamW(self.masters, fused=True, **kwargs)
        except RuntimeError:  # a device without the fused kernel: the per-tensor loop, also without full-size temporaries
            self.optimizer = torch.optim.AdamW(self.masters, foreach=False, **kwargs)
        self.step = 0
        self.shared = None         # SharedWeights, once an engine maps our weights (share_weights)
        self._pending_save = None  # a checkpoint still reading our tensors (checkpoint.py): wait before writing them

    # ------------------------------------------------------------------ log-probs

    def _micro_batches(self, batch):
        """Row indices per micro-batch, sorted by length so that padding stays small."""
        lengths = batch.attention_mask.sum(-1)
        order = torch.argsort(lengths, descending=True, stable=True).tolist()
        mbs = self.cfg.micro_batch_size
        return [order[i:i + mbs] for i in range(0, len(order), mbs)], lengths

    def _logprobs(self, tokens, score_mask, need_grad: bool, with_entropy: bool):
        """Log-probs [b, l-1] (float32, 0 where score_mask is False) and entropy (or None)."""
        tokens = tokens.to(self.device, non_blocking=True)
        score_mask = score_mask.to(self.device, non_blocking=True)
        chunk = self.cfg.logprob_chunk
        if self.exact_model is not None:
            checkpoint_layers = self.cfg.gradient_checkpointing and need_grad
            hidden = self.exact_model.forward_sequences(tokens, checkpoint_layers)[:, :-1]
            weight = self.exact_model.lm_head_weight()
        else:
            hidden = self.model.base_model(input_ids=tokens).last_hidden_state[:, :-1]  # position t predicts t+1
            weight = self.model.get_output_embeddings().weight
        rows, cols = score_mask.nonzero(as_tuple=True)
        h, targets = hidden[rows, cols], tokens[:, 1:][rows, cols]
        if self.exact_model is None:
            logp, ent = head_logprobs(h, targets, weight, chunk, with_entropy, need_grad, self.cfg.temperature)
        else:  # the batch-invariant head, its logits recomputed in backward by checkpointing
            parts = [checkpoint(_exact_chunk_logprobs, h[s:s + chunk], targets[s:s + chunk], weight, with_entropy,
                                use_reentrant=False) if need_grad else
                     _exact_chunk_logprobs(h[s:s + chunk], targets[s:s + chunk], weight, with_entropy)
                     for s in range(0, h.shape[0], chunk)]
            logp = torch.cat([p[0] for p in parts]) if parts else h.new_zeros(0, dtype=torch.float32)
            ent = torch.cat([p[1] for p in parts]) if parts else h.new_zeros(0, dtype=torch.float32)
        out = torch.zeros(score_mask.shape, dtype=torch.float32, device=self.device).index_put((rows, cols), logp)
        entropy = torch.zeros_like(out).index_put((rows, cols), ent) if with_entropy else None
        return out, entropy

    def _check_batch(self, batch):
        tokens, attn, mask = batch.tokens, batch.attention_mask, batch.loss_mask
        B, L = tokens.shape
        if attn.shape != (B, L) or mask.shape != (B, L - 1) or batch.rollout_logprobs.shape != (B, L - 1):
            raise ValueError(f"batch shapes disagree: tokens {tuple(tokens.shape)}, attention_mask "
                             f"{tuple(attn.shape)}, loss_mask {tuple(mask.shape)} (need [B, L-1])")
        lengths = attn.sum(-1)
        right_padded = attn == (torch.arange(L)[None, :] < lengths[:, None])
        if not bool(right_padded.all()):
            raise ValueError("batch must be right-padded (attention_mask True then False in every row)")
        if bool((mask & ~attn[:, 1:]).any()):
            raise ValueError("loss_mask marks padding positions")

    @torch.no_grad()
    def logprobs(self, batch, mask: torch.Tensor | None = None) -> torch.Tensor:
        """FP32 log-probs [B, L-1] of tokens[:, 1:] at the positions in `mask` (default batch.loss_mask;
        pass batch.attention_mask[:, 1:] for every real token), 0.0 elsewhere."""
        self._check_batch(batch)
        mask = batch.loss_mask if mask is None else mask
        out = torch.zeros(mask.shape, dtype=torch.float32)
        groups, lengths = self._micro_batches(batch)
        for idx in groups:
            n = int(lengths[idx].max())
            lp, _ = self._logprobs(batch.tokens[idx, :n], mask[idx, :n - 1], need_grad=False, with_entropy=False)
            out[idx, :n - 1] = lp.cpu()
        return out

    # ------------------------------------------------------------------ the step

    def train_step(self, batch, advantages, old_logprobs=None, ref_logprobs=None, on_micro_batch=None) -> dict:
        """One optimizer step on the whole batch (accumulated over micro-batches). Returns metrics.
        on_micro_batch(n_done, n_total), if given, is called after each micro-batch (progress bars)."""
        self._check_batch(batch)
        self.wait_for_save()
        t0 = time.perf_counter()
        B = batch.tokens.shape[0]
        advantages = torch.as_tensor(advantages, dtype=torch.float32)
        if advantages.shape not in ((B,), tuple(batch.loss_mask.shape)):
            raise ValueError(f"advantages must be [B] or [B, L-1] for B={B}, got {tuple(advantages.shape)}")
        if not bool(torch.isfinite(advantages).all()):
            raise ValueError("advantages must be finite")
        cfg = self.cfg.loss
        normalizer = loss_normalizer(batch.loss_mask, cfg)
        with_entropy = self.cfg.compute_entropy or cfg.entropy_coef > 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

        sums, tokens, pg_loss, ratio_max = {}, 0, 0.0, 1.0
        diff_sum, diff_n, diff_max = 0.0, 0, 0.0
        groups, lengths = self._micro_batches(batch)
        for done, idx in enumerate(groups, 1):
            n = int(lengths[idx].max())
            mask = batch.loss_mask[idx, :n - 1].to(self.device)
            logp, entropy = self._logprobs(batch.tokens[idx, :n], mask, need_grad=True, with_entropy=with_entropy)
            if entropy is not None and cfg.entropy_coef == 0:
                entropy = entropy.detach()
            rollout = batch.rollout_logprobs[idx, :n - 1].to(self.device)
            adv = advantages[idx] if advantages.dim() == 1 else advantages[idx, :n - 1]
            old = logp.detach() if old_logprobs is None else old_logprobs[idx, :n - 1].to(self.device)
            ref = None if ref_logprobs is None else ref_logprobs[idx, :n - 1].to(self.device)
            loss, m = policy_loss(logp, old, adv.to(self.device), mask, cfg, normalizer=normalizer,
                                  rollout_logprobs=rollout, ref_logprobs=ref, entropy=entropy)
            loss.backward()
            self._accumulate_master_grads()

            # Train/inference parity, before the update: |trainer - engine| over response tokens.
            diff = (logp.detach() - rollout).abs()[mask & ~batch.scripted[idx, None].to(self.device)]  # sampled tokens only
            if diff.numel():
                diff_sum, diff_n = diff_sum + float(diff.double().sum()), diff_n + diff.numel()
                diff_max = max(diff_max, float(diff.max()))
            pg_loss += m.pop("pg_loss")
            ratio_max = max(ratio_max, m.pop("ratio_max"))
            n_tok = m.pop("tokens")
            tokens += n_tok
            for k, v in m.items():
                sums[k] = sums.get(k, 0.0) + v * n_tok
            if on_micro_batch is not None:
                on_micro_batch(done, len(groups))

        grad_norm = self._clip_and_step()
        if self.device.type == "cpu":
            heap.release_free_heap()
        metrics = {k: v / max(tokens, 1) for k, v in sums.items()}
        metrics.update(
            step=self.step, pg_loss=pg_loss, ratio_max=ratio_max, grad_norm=grad_norm,
            lr=self.optimizer.param_groups[0]["lr"], response_tokens=tokens,
            logprob_diff_mean=diff_sum / max(diff_n, 1), logprob_diff_max=diff_max,
            step_ms=(time.perf_counter() - t0) * 1000.0,
        )
        if self.device.type == "cuda":
            metrics["peak_mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        return metrics

    def _accumulate_master_grads(self):
        if self.masters[0] is self.params[0]:
            return  # float32: the model's own .grad is the master gradient
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if p.grad is None:
                    continue
                if m.grad is None:
                    m.grad = p.grad.float()
                else:
                    m.grad.add_(p.grad)  # FP32 += bf16: accumulation keeps FP32 precision
                p.grad = None

    def _clip_and_step(self) -> float:
        grads = [m.grad for m in self.masters if m.grad is not None]
        if not grads:
            self.step += 1
            return 0.0
        max_norm = self.cfg.optim.max_grad_norm
        if max_norm > 0:
            norm = float(torch.nn.utils.clip_grad_norm_(self.masters, max_norm))
        else:
            norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))
        if not math.isfinite(norm):
            # A NaN/inf gradient would poison the masters and the moments for good: skip the update.
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm ({norm}) at step {self.step}; update skipped")
        set_lr(self.optimizer, self.cfg.optim, self.step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._check_weights_finite()
        self._copy_masters_to_model()
        self.step += 1
        return norm

    def _check_weights_finite(self) -> None:
        """After an optimizer step. A finite gradient can still step the weights to NaN or inf (an
        absurd lr overflows AdamW's step); every later step would be lost and every engine would serve
        them: NonFiniteWeights, for the run to stop on."""
        bad = non_finite(zip(self.names, self.masters))
        if bad is not None:
            raise NonFiniteWeights(f"optimizer step {self.step + 1} left NaN or infinite values in {bad}")

    @torch.no_grad()
    def _copy_masters_to_model(self):
        if self.masters[0] is not self.params[0]:
            torch._foreach_copy_(list(self.params), self.masters)  # FP32 -> bf16, round to nearest

    # ------------------------------------------------------------------ weights and checkpoints

    def named_weights(self, dtype: torch.dtype | None = None):
        """(name, tensor) in HF names: what an inference engine of `dtype` should serve.

        A float32 engine gets the FP32 masters themselves (every small update included); any other
        dtype gets the compute model cast to it (for bfloat16 that is exactly masters.to(bfloat16)).
        """
        src = self.masters if dtype == torch.float32 else self.params
        return [(n, t.detach() if dtype is None or t.dtype == dtype else t.detach().to(dtype))
                for n, t in zip(self.names, src)]

    def shareable(self, dtype: torch.dtype) -> bool:
        """Can a `dtype` engine map our tensors (a CPU trainer, and no cast between them)?"""
        tensors = self.masters if dtype == torch.float32 else self.params
        return self.device.type == "cpu" and tensors[0].dtype == dtype

    def share_weights(self, dtype: torch.dtype) -> SharedWeights | None:
        """Move what a `dtype` engine serves (named_weights(dtype)) into shared memory, once, and return
        it; None where it cannot be shared (see shareable)."""
        if not self.shareable(dtype):
            return None
        tensors = self.masters if dtype == torch.float32 else self.params
        if self.shared is None:
            self.wait_for_save()
            self.shared = SharedWeights(zip(self.names, tensors))
        return self.shared

    def hold_until_saved(self, pending) -> None:
        """A background checkpoint reads our live tensors: no update may run until pending.wait()."""
        self._pending_save = pending

    def wait_for_save(self) -> None:
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.wait()

    def state_dict(self) -> dict:
        return {
            "masters": {n: m.detach().clone() for n, m in zip(self.names, self.masters)},
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
            "dtype": self.cfg.dtype,
        }

    def load_state_dict(self, state: dict) -> None:
        masters = state["masters"]
        missing = [n for n in self.names if n not in masters]
        unexpected = [n for n in masters if n not in set(self.names)]
        if missing or unexpected:
            raise ValueError(f"checkpoint does not fit this model: missing {missing[:5]}, unexpected {unexpected[:5]}")
        self.wait_for_save()
        with torch.no_grad():
            for n, m in zip(self.names, self.masters):
                if masters[n].shape != m.shape:
                    raise ValueError(f"checkpoint tensor {n}: shape {tuple(masters[n].shape)} != {tuple(m.shape)}")
                m.copy_(masters[n])
        if state["optimizer"] is not None:  # None: a checkpoint that kept no AdamW state (fresh moments)
            self.optimizer.load_state_dict(state["optimizer"])
        self._copy_masters_to_model()
        self.step = int(state["step"])
