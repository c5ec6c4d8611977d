"""The trainer: FP32 log-probs of the sampled tokens, micro-batches, FP32 master weights, AdamW; in one
process or on each of N ranks (SPMD: every rank builds it alike and makes the same calls with the same
whole batch, which rank 0 has broadcast). docs/design.md tells the why of each; in short:

- Log-probs: the decoder runs on right-padded micro-batches (causal: no attention mask needed), then
  only the scored positions go through lm_head, a chunk at a time, in float32 (logprob_head.py).
- Master weights: an lr 1e-6 step is far below a bf16 weight's spacing, so AdamW owns FP32 masters and
  moments, gradients accumulate in FP32, and the compute model gets masters.to(bfloat16) after a step.
- N ranks (fsdp.py): the sharded parameters ARE the masters; gradients are SUMMED over ranks, whole
  groups go to each rank and the loss is normalised by the whole batch, so N ranks make the update of
  one; a rank with fewer micro-batches runs zero-loss fillers (FSDP needs the same passes everywhere).
- True on-policy (one process): the log-probs come from the ENGINE's model code with its
  batch-invariant ops: the engine's, bit for bit.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoConfig, AutoModelForCausalLM

from nano_miles.dtypes import DTYPES
from nano_miles.engine import heap
from nano_miles.engine.model import CausalLM
from nano_miles.engine.shared_weights import SharedWeights
from nano_miles.engine.weights import NonFiniteWeights, non_finite
from nano_miles.trainer import fsdp
from nano_miles.trainer.config import OptimConfig, TrainerConfig, checkpoints_layers  # noqa: F401 (also imported from here)
from nano_miles.trainer.logprob_head import head_logprobs
from nano_miles.trainer.loss import loss_normalizer, parity_metrics, parity_sums, policy_loss
from nano_miles.trainer.lr_schedule import lr_at

BUCKET_BYTES = 512 * 2**20


class Trainer:
    def __init__(self, cfg: TrainerConfig, env=None, model: torch.nn.Module | None = None, config=None):
        """env: this rank's DistEnv (None, or a world of one: one process). The weights: `model` (one
        process), random ones of a transformers `config` (benchmarks), or cfg.model's."""
        self.env = env if env is not None and env.world_size > 1 else None
        self.world_size, self.rank = (env.world_size, env.rank) if self.env else (1, 0)
        self.device = env.device if env is not None else torch.device(cfg.device)
        on_gpu = self.device.type == "cuda"
        cfg = dataclasses.replace(  # the autos, decided here once
            cfg, micro_batch_size=cfg.micro_batch_size or (8 if on_gpu else 1),
            logprob_chunk=cfg.logprob_chunk or (1024 if on_gpu else 128),
            gradient_checkpointing=checkpoints_layers(cfg.gradient_checkpointing, on_gpu, cfg.true_on_policy))
        self.cfg, self.dtype = cfg, DTYPES[cfg.dtype]
        if self.env and cfg.true_on_policy:
            raise ValueError("true on-policy mode runs the engine's model over unsharded parameters: it needs "
                             "one process (trainer.nproc=1)")
        if model is None and config is None and not cfg.model:
            raise ValueError("TrainerConfig.model must name an HF model folder")
        if not on_gpu:
            heap.return_large_frees()  # freed gradients and activations leave the process (heap.py)
        if self.env:  # no rank ever holds the whole model: built on the meta device, then sharded
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config or AutoConfig.from_pretrained(cfg.model),
                                                         dtype=torch.float32)
        elif model is None:
            model = (AutoModelForCausalLM.from_pretrained(cfg.model, dtype=self.dtype) if config is None
                     else AutoModelForCausalLM.from_config(config, dtype=self.dtype))
        for key in ("final_logit_softcapping", "logit_scale"):  # lm_head -> log_softmax assumes plain logits
            if getattr(model.config, key, None) not in (None, 1, 1.0):
                raise ValueError(f"models with {key} are not supported by the chunked log-prob head")
        model.config.use_cache = False
        model.train()  # Qwen2/Llama have no dropout; train() is what enables HF checkpointing
        if cfg.gradient_checkpointing:
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):  # its name from transformers 5.2x on
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if on_gpu and self.dtype != torch.float32:  # the FP32 lm_head's bf16 inputs are exact in TF32
            torch.set_float32_matmul_precision("high")
        self.model, self.root, self.exact_model = model, None, None  # root: FSDP's, with N ranks
        o = cfg.optim
        adamw = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, fused=True)
        if self.env:
            mesh = init_device_mesh(self.device.type, (self.world_size,))
            self.root, self.fsdp_modules = fsdp.shard_model(model, self, mesh, self.dtype, self.device)
            # named_parameters() lists a tied weight once (embed_tokens, not lm_head)
            self.names, self.params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
            fsdp.fill_shards(self.names, self.params, None if config is not None else cfg.model, self.env.cpu_group)
            self.masters = list(self.params)
            self.optimizer = fsdp.ShardAdamW(self.masters, **adamw)
        else:
            self._place(model)
            self.names, self.params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
            self.masters = (list(self.params) if self.dtype == torch.float32 else
                            [p.detach().float().clone().requires_grad_(True) for p in self.params])
            try:
                self.optimizer = torch.optim.AdamW(self.masters, **adamw)
            except RuntimeError:  # a device without the fused kernel: the per-tensor loop, no full-size temporaries
                self.optimizer = torch.optim.AdamW(self.masters, **{**adamw, "fused": None}, foreach=False)
        self.step = 0
        self.shared = None         # SharedWeights, once an engine maps our weights (share_weights)
        self.pending_save = None   # a checkpoint still reading our tensors (checkpoint.py): wait before writing them
        self.on_gather = None      # N ranks: called with iter_full_weights' arguments as each gather starts

    def _place(self, model) -> None:
        """One process: the model on the device, its parameters (and only they) in the compute dtype:
        model.to(dtype) would also round RoPE's inv_freq to bf16, radians off at a thousand tokens."""
        model.to(device=self.device)
        for p in model.parameters():
            if p.is_floating_point() and p.dtype != self.dtype:
                p.data = p.data.to(self.dtype)
        buffers = dict(model.named_buffers())
        if low := [n for n, b in buffers.items() if n.endswith("inv_freq") and b.dtype != torch.float32]:
            raise ValueError(f"{low[0]} is {buffers[low[0]].dtype}, not float32: the model was cast with "
                             ".to(dtype); load it with from_pretrained(dtype=...) or cast parameters only")
        if self.cfg.true_on_policy:  # the engine's model code over these very parameters (shared, not copied)
            self.exact_model = CausalLM.sharing_parameters(model).use_batch_invariant_ops()

    def _score(self, tokens, score_mask, need_grad: bool, with_entropy: bool):
        """Log-probs [b, l-1] (float32, 0 where score_mask is False) and entropy (or None)."""
        tokens = tokens.to(self.device, non_blocking=True)
        score_mask = score_mask.to(self.device, non_blocking=True)
        exact = self.exact_model
        if exact is not None:
            hidden = exact.forward_sequences(tokens, self.cfg.gradient_checkpointing and need_grad)[:, :-1]
            weight = exact.lm_head_weight()
        else:
            hidden = self.model.base_model(input_ids=tokens).last_hidden_state[:, :-1]  # position t predicts t+1
            weight = self.model.get_output_embeddings().weight
        rows, cols = score_mask.nonzero(as_tuple=True)
        logp, ent = head_logprobs(hidden[rows, cols], tokens[:, 1:][rows, cols], weight,
                                  self.cfg.logprob_chunk, with_entropy, need_grad, self.cfg.temperature,
                                  exact=exact is not None)
        out = torch.zeros(score_mask.shape, dtype=torch.float32, device=self.device).index_put((rows, cols), logp)
        entropy = torch.zeros_like(out).index_put((rows, cols), ent) if with_entropy else None
        return out, entropy

    def _logprobs(self, tokens, score_mask, need_grad: bool, with_entropy: bool):
        score = self.root if self.root is not None else self._score  # N ranks: through FSDP's root
        return score(tokens, score_mask, need_grad, with_entropy)

    def _check_batch(self, batch):
        tokens, attn, mask = batch.tokens, batch.attention_mask, batch.loss_mask
        B, L = tokens.shape
        if attn.shape != (B, L) or mask.shape != (B, L - 1) or batch.rollout_logprobs.shape != (B, L - 1):
            raise ValueError(f"batch shapes disagree: tokens {tuple(tokens.shape)}, attention_mask "
                             f"{tuple(attn.shape)}, loss_mask {tuple(mask.shape)} (need [B, L-1])")
        lengths = attn.sum(-1)
        if not bool((attn == (torch.arange(L)[None, :] < lengths[:, None])).all()):
            raise ValueError("batch must be right-padded (attention_mask True then False in every row)")
        if bool((mask & ~attn[:, 1:]).any()):
            raise ValueError("loss_mask marks padding positions")

    def _plan(self, batch) -> list:
        """This rank's micro-batches as (rows, length), longest rows first (little padding), then a None
        for each filler pass it makes to keep up with the rank that has the most."""
        lengths = batch.attention_mask.sum(-1).tolist()
        shares = fsdp.assign_groups(batch.group_ids, lengths, self.world_size) if self.env else [range(len(lengths))]
        mbs = self.cfg.micro_batch_size
        order = sorted(shares[self.rank], key=lambda i: -lengths[i])  # stable: ties keep row order
        mine = [(order[i:i + mbs], max(lengths[j] for j in order[i:i + mbs])) for i in range(0, len(order), mbs)]
        return mine + [None] * (max(-(-len(rows) // mbs) for rows in shares) - len(mine))

    def _filler_pass(self, batch, need_grad: bool) -> None:
        """A 2-token forward and a zero-loss backward (FSDP needs the same passes on every rank)."""
        mask = torch.ones((1, 1), dtype=torch.bool, device=self.device)
        logp, _ = self._logprobs(batch.tokens[:1, :2], mask, need_grad=need_grad, with_entropy=False)
        if need_grad:
            (logp.sum() * 0.0).backward()

    @torch.no_grad()
    def logprobs(self, batch, mask: torch.Tensor | None = None) -> torch.Tensor:
        """FP32 log-probs [B, L-1] of tokens[:, 1:] at the positions in `mask` (default batch.loss_mask;
        pass batch.attention_mask[:, 1:] for every real token), 0.0 elsewhere; on every rank."""
        self._check_batch(batch)
        mask = batch.loss_mask if mask is None else mask
        out = torch.zeros(mask.shape, dtype=torch.float32, device=self.device)
        for micro in self._plan(batch):
            if micro is None:
                self._filler_pass(batch, need_grad=False)
                continue
            idx, n = micro
            lp, _ = self._logprobs(batch.tokens[idx, :n], mask[idx, :n - 1], need_grad=False, with_entropy=False)
            out[idx, :n - 1] = lp
        if self.env:
            for module in self.fsdp_modules:  # a no-grad forward leaves them gathered
                module.reshard()
            dist.all_reduce(out)  # each row from the rank that has it, exact zeros from the others
        return out.cpu()

    def train_step(self, batch, advantages, old_logprobs=None, ref_logprobs=None, on_micro_batch=None) -> dict:
        """One optimizer step on the whole batch; returns metrics. on_micro_batch(n_done, n_total) is
        called after each micro-batch."""
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
        normalizer = loss_normalizer(batch.loss_mask, cfg)  # of the whole batch: the same on every rank
        with_entropy = self.cfg.compute_entropy or cfg.entropy_coef > 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

        sums, tokens, pg_loss, ratio_max, parity = Counter(), 0, 0.0, 1.0, []  # sums: metric x tokens
        plan = self._plan(batch)
        for done, micro in enumerate(plan, start=1):
            if micro is None:
                self._filler_pass(batch, need_grad=True)
            else:
                idx, n = micro
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
                parity.append(parity_sums(logp, rollout, mask & ~batch.scripted[idx, None].to(self.device),
                                          batch.stale[idx, None].to(self.device)))
                pg_loss += m.pop("pg_loss")
                ratio_max = max(ratio_max, m.pop("ratio_max"))
                n_tok = m.pop("tokens")
                tokens += n_tok
                sums.update({k: v * n_tok for k, v in m.items()})
            if on_micro_batch is not None:
                on_micro_batch(done, len(plan))

        grad_norm = self._clip_and_step()
        if self.device.type == "cpu":
            heap.release_free_heap()
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        parts = [(sums, tokens, pg_loss, ratio_max, parity, peak)]
        if self.env:
            mine, parts = parts[0], [None] * self.world_size
            dist.all_gather_object(parts, mine, group=self.env.cpu_group)
        sums, tokens = Counter(), sum(p[1] for p in parts)
        for part in parts:
            sums.update(part[0])  # adds (keeping zeros and negatives, unlike Counter's +)
        metrics = {k: v / max(tokens, 1) for k, v in sums.items()}
        metrics.update(
            parity_metrics([s for p in parts for s in p[4]]),
            step=self.step, pg_loss=sum(p[2] for p in parts), ratio_max=max(p[3] for p in parts),
            grad_norm=grad_norm, lr=self.optimizer.param_groups[0]["lr"], response_tokens=tokens,
            step_ms=(time.perf_counter() - t0) * 1000.0, world_size=self.world_size)
        if peak is not None:
            metrics["peak_mem_gib"] = max(p[5] for p in parts)  # the largest rank's
        return metrics

    def _accumulate_master_grads(self):
        """FP32 masters apart from the model: each micro-batch's gradients move into them."""
        if self.masters[0] is self.params[0]:
            return
        with torch.no_grad():
            for p, m in zip(self.params, self.masters):
                if p.grad is None:
                    continue
                if m.grad is None:
                    m.grad = p.grad.float()
                else:
                    m.grad.add_(p.grad)  # FP32 += bf16: accumulation keeps FP32 precision
                p.grad = None

    @torch.no_grad()  # (DTensor.to_local() of every gradient outside it: an autograd Function each)
    def _clip_and_step(self) -> float:
        """Clip on the global gradient norm, then one AdamW step."""
        grads = [m.grad.to_local() if self.env else m.grad for m in self.masters if m.grad is not None]
        square = torch.stack(torch._foreach_norm(grads)).square().sum() if grads else torch.zeros((), device=self.device)
        if self.env:
            dist.all_reduce(square)
        norm = float(square.sqrt())
        if not math.isfinite(norm):  # it would poison the masters and the moments for good: skip the update
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm ({norm}) at step {self.step}; update skipped")
        max_norm = self.cfg.optim.max_grad_norm
        if max_norm > 0 and grads and max_norm / (norm + 1e-6) < 1.0:  # torch's clip_grad_norm_ formula
            torch._foreach_mul_(grads, max_norm / (norm + 1e-6))
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.cfg.optim, self.step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._check_weights_finite()
        self._copy_masters_to_model()
        self.step += 1
        return norm

    def _check_weights_finite(self) -> None:
        """A finite gradient can still step the weights to NaN or inf (an absurd lr), which every engine
        would then serve. With N ranks a flag's all_reduce makes every rank raise at once, so no rank goes
        on alone into collectives the others never join."""
        bad = non_finite(zip(self.names, (m.to_local() if self.env else m for m in self.masters)))
        if self.env:
            flag = torch.tensor(float(bad is not None), device=self.device)
            dist.all_reduce(flag)
            bad = bad or ("the weights (on another rank)" if flag.item() else None)
        if bad is not None:
            raise NonFiniteWeights(f"optimizer step {self.step + 1} left NaN or infinite values in {bad}")

    @torch.no_grad()
    def _copy_masters_to_model(self):
        if self.masters[0] is not self.params[0]:
            torch._foreach_copy_(list(self.params), self.masters)  # FP32 -> bf16, round to nearest

    def _local_weights(self, dtype: torch.dtype) -> list:
        """One process: a float32 engine serves the FP32 masters, any other the compute model cast."""
        src = self.masters if dtype == torch.float32 else self.params
        return [(n, t.detach() if t.dtype == dtype else t.detach().to(dtype)) for n, t in zip(self.names, src)]

    def iter_full_weights(self, dtype: torch.dtype | None = None, bucket_bytes: int = BUCKET_BYTES):
        """What a weight sync sends: whole tensors by HF name in `dtype` (default: the compute dtype), in
        buckets of at most `bucket_bytes`. N ranks: gathered to rank 0 ([] per bucket on the others),
        every rank iterating to the end. on_gather(dtype, bucket_bytes) is called as it starts (so
        train's rank 0 calls the others in)."""
        dtype = dtype or self.dtype
        if self.on_gather is not None:
            self.on_gather(dtype, bucket_bytes)
        if not self.env:
            yield from fsdp.split_buckets(self._local_weights(dtype), bucket_bytes, dtype)
        else:
            yield from fsdp.gather_buckets(zip(self.names, self.params), bucket_bytes, dtype, self.device)

    def named_weights(self, dtype: torch.dtype | None = None) -> list:
        """(name, tensor) by HF name, what a `dtype` engine serves; N ranks: on rank 0's CPU, [] elsewhere."""
        dtype = dtype or self.dtype
        if not self.env:
            return self._local_weights(dtype)
        buckets = fsdp.gather_buckets(zip(self.names, self.params), BUCKET_BYTES, dtype, self.device)
        return [(n, t.cpu()) for bucket in buckets for n, t in bucket]

    def shareable(self, dtype: torch.dtype) -> bool:
        """Can a `dtype` engine map our tensors (one CPU process, and no cast between them)?"""
        tensors = self.masters if dtype == torch.float32 else self.params
        return not self.env and self.device.type == "cpu" and tensors[0].dtype == dtype

    def share_weights(self, dtype: torch.dtype) -> SharedWeights | None:
        """Move what a `dtype` engine serves into shared memory, once; None where not shareable."""
        if not self.shareable(dtype):
            return None
        if self.shared is None:
            self.wait_for_save()
            self.shared = SharedWeights(zip(self.names, self.masters if dtype == torch.float32 else self.params))
        return self.shared

    def wait_for_save(self) -> None:
        pending, self.pending_save = self.pending_save, None
        if pending is not None:
            pending.wait()
