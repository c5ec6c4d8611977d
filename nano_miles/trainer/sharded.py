"""The trainer sharded over the ranks of a process group with FSDP2 (`fully_shard`).

Every rank calls the same methods with the same whole batch (rank 0 broadcasts it); each takes its
share, and the ranks produce the update one process would:

- Sharding (N ranks): one FSDP group per decoder layer plus the root (embeddings, final norm,
  lm_head). The sharded parameters are the FP32 masters and AdamW's moments are sharded with them; a
  forward all-gathers a layer's parameters cast to the compute dtype (bf16 on GPU) and frees them
  after it, and gradients are reduce-scattered in FP32 after every micro-batch, so they accumulate
  in FP32 as in the single-process trainer. FSDP's root wraps the whole log-prob computation
  (`_Root`), because the chunked FP32 lm_head of `Trainer._logprobs` uses the root's weights.
  AdamW steps on the local shards (ShardAdamW: one fused kernel).
- One rank (N=1) holds every parameter anyway, so it skips what only sharing needs: the root is the
  one FSDP group (per-layer groups would save no memory, only add hooks), the model is gathered once
  and stays gathered, taking the shards' values in one foreach copy before each pass (as Trainer
  copies its masters into its bf16 model); gradients accumulate in FP32 on it and reach the shards
  once per step; no collective of one rank is run. This keeps the N=1 step close to the
  single-process Trainer's (bench/train_step.py --nproc 1 --baseline). The parameters are the same
  DTensors under the same names as with N ranks: checkpoints move between N and M ranks.
- Data: whole groups of a step go to ranks (largest first to the rank with the fewest tokens),
  advantages having been computed over the whole batch before. The loss is normalised by the whole
  batch's count (`loss_normalizer` of every row) and gradients are SUMMED over ranks (FSDP would
  average them), so N ranks give the gradient of one. Clipping uses the global norm.
- Lockstep: FSDP's collectives need every rank to run the same number of forwards and backwards,
  so a rank with fewer micro-batches runs zero-loss ones on a 2-token row until it has as many.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.optim.adamw import adamw
from transformers import AutoConfig, AutoModelForCausalLM

from nano_miles.trainer import heap
from nano_miles.trainer.loss import loss_normalizer, policy_loss
from nano_miles.trainer.distributed import DistEnv
from nano_miles.dtypes import DTYPES
from nano_miles.engine.weights import NonFiniteWeights, non_finite
from nano_miles.trainer.lr_schedule import set_lr
from nano_miles.trainer.trainer import Trainer, TrainerConfig


class _Root(torch.nn.Module):
    """FSDP's root module: its forward is the trainer's log-prob pass, so the root's parameters
    (embeddings, final norm, the tied or untied lm_head) are gathered for all of it."""

    def __init__(self, model: torch.nn.Module, trainer: "ShardedTrainer"):
        super().__init__()
        self.model = model
        self.trainer = trainer  # not a Module: a plain attribute
        self.gathered = None  # one rank: (the gathered parameters, the shards they copy)

    def forward(self, tokens, score_mask, need_grad: bool, with_entropy: bool):
        return Trainer._logprobs(self.trainer, tokens, score_mask, need_grad, with_entropy)


class ShardAdamW(torch.optim.AdamW):
    """AdamW over FSDP's sharded parameters whose step runs on the local shards: the same arithmetic
    and the same state (exp_avg and exp_avg_sq are DTensors like the parameters, so checkpoints see
    a plain AdamW), but one fused kernel over plain tensors instead of DTensor's dispatch over each of
    ~300 (milliseconds of CPU time a step, which the GPU waits out: the step follows the norm's sync)."""

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardAdamW.step takes no closure")
        for group in self.param_groups:
            shards = [p for p in group["params"] if p.grad is not None]
            for p in shards:
                state = self.state[p]
                if not state:  # as AdamW's own first step makes it
                    on_device = group["fused"] or group["capturable"]
                    state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
            states = [self.state[p] for p in shards]
            beta1, beta2 = group["betas"]
            adamw([p.to_local() for p in shards], [p.grad.to_local() for p in shards],
                  [s["exp_avg"].to_local() for s in states], [s["exp_avg_sq"].to_local() for s in states], [],
                  [s["step"] for s in states], foreach=group["foreach"], fused=group["fused"],
                  capturable=group["capturable"], amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                  weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])


def shard_model(model, owner, mesh, mp: MixedPrecisionPolicy, one_rank: bool):
    """fully_shard the root (_Root: the log-prob pass of `owner`) and, with N ranks, each decoder layer
    first; returns the root and every FSDP module (layers first).

    N ranks: one group per decoder layer, so a rank holds one layer's gathered bf16 weights at a time
    (gathered for its forward, freed after it, gathered again for its backward) and the layer's
    gradients are reduce-scattered as soon as its backward is done: the peak is the sharded state plus
    a layer, which is what sharding is for. One rank: everything stays gathered from forward to
    backward anyway (nothing to share), so per-layer groups would save no memory and only cost a set
    of FSDP hooks per layer (pre/post forward and backward, events, a gradient copy-out each), CPU
    time that the GPU waits out. So the root alone is the one group: one gather of the whole model,
    one set of hooks, one gradient hand-off. (The parameters are the same DTensors under the same
    names either way: checkpoints move between N and M ranks unchanged.)"""
    layers = [] if one_rank else list(model.base_model.layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    root = _Root(model, owner)
    fully_shard(root, mesh=mesh, mp_policy=mp, reshard_after_forward=not one_rank)
    return root, (*layers, root)


def assign_groups(group_ids: list[str], lengths: list[int], world_size: int) -> list[list[int]]:
    """Row indices per rank, whole groups each: groups by token count, largest first, each to the
    rank with the fewest tokens so far (the lowest rank on ties). Deterministic: every rank computes
    every rank's share."""
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    sized = sorted(groups.values(), key=lambda rows: -sum(lengths[i] for i in rows))  # stable
    load, share = [0] * world_size, [[] for _ in range(world_size)]
    for rows in sized:
        r = min(range(world_size), key=lambda k: (load[k], k))
        share[r].extend(rows)
        load[r] += sum(lengths[i] for i in rows)
    return [sorted(rows) for rows in share]


class ShardedTrainer(Trainer):
    def __init__(self, cfg: TrainerConfig, env: DistEnv, config=None):
        """cfg.model: an HF folder whose safetensors every rank reads its own slices of; or `config`
        (a transformers config): random weights of that architecture (benchmarks)."""
        if cfg.true_on_policy:
            raise ValueError("true on-policy mode needs the engine's model over the trainer's parameters; "
                             "it is single-process only for now (trainer.nproc=1)")
        on_gpu = env.device.type == "cuda"  # the autos, as Trainer's
        cfg = dataclasses.replace(cfg, micro_batch_size=cfg.micro_batch_size or (8 if on_gpu else 1),
                                  logprob_chunk=cfg.logprob_chunk or (1024 if on_gpu else 128),
                                  gradient_checkpointing=not on_gpu if cfg.gradient_checkpointing is None
                                  else cfg.gradient_checkpointing)
        self.cfg, self.env = cfg, env
        self.device, self.dtype = env.device, DTYPES[cfg.dtype]
        self.exact_model = None  # Trainer._logprobs' true on-policy branch stays off
        if not on_gpu:
            heap.return_large_frees()  # as Trainer's (heap.py)
        if config is None:
            if not cfg.model:
                raise ValueError("TrainerConfig.model must name an HF model folder")
            config = AutoConfig.from_pretrained(cfg.model)
        with torch.device("meta"):  # no rank ever holds the whole model
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        for key in ("final_logit_softcapping", "logit_scale"):
            if getattr(model.config, key, None) not in (None, 1, 1.0):
                raise ValueError(f"models with {key} are not supported by the chunked log-prob head")
        model.config.use_cache = False
        model.train()
        if cfg.gradient_checkpointing:
            kwargs = {"use_reentrant": False}
            if hasattr(model, "activation_checkpointing_enable"):
                model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        self.model = model

        mesh = init_device_mesh(self.device.type, (env.world_size,))
        # FP32 sharded masters; gathered in the compute dtype; gradients reduced in FP32.
        # (cast_forward_inputs off: the activations are already in the compute dtype, the embeddings'
        # output being; FSDP would walk every layer's arguments each forward to cast nothing.)
        mp = MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
        # One rank holds every parameter anyway: the model, once gathered, stays gathered (no gather
        # per pass, see _refresh_gathered), as the single-process Trainer keeps its bf16 model.
        self.one_rank = env.world_size == 1
        self.root, self.fsdp_modules = shard_model(model, self, mesh, mp, one_rank=self.one_rank)
        self._gradient_sync = True  # FSDP's default: every backward hands its gradients to the shards
        if self.one_rank:  # the model stays gathered across steps (see _refresh_gathered)
            self.root.set_reshard_after_backward(False, recurse=False)
        for module in self.fsdp_modules if not self.one_rank else ():
            # A plain SUM over ranks: the loss is over the whole batch already. (One rank: no division
            # to undo, and no extra pass over the gradients dividing by 1.)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # (else a PREMUL_SUM, which gloo lacks)
        self.root.to_empty(device=self.device)
        _rebuild_buffers(model, self.device)
        if self.device.type == "cuda" and self.dtype != torch.float32:
            torch.set_float32_matmul_precision("high")  # the FP32 lm_head over bf16 inputs (see Trainer)

        self.names, self.params = zip(*[(n, p) for n, p in model.named_parameters() if p.requires_grad])
        if cfg.model:
            self._load_hf_weights(cfg.model)
        else:
            _random_init(self.names, self.params, env.rank)
        self.masters = list(self.params)  # the sharded FP32 parameters ARE the masters
        o = cfg.optim
        kwargs = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
        self.optimizer = ShardAdamW(self.masters, fused=True, **kwargs)  # CUDA and CPU both have the kernel
        self.step = 0

    def _load_hf_weights(self, folder: str) -> None:
        """Each rank reads only its rows of every tensor from the safetensors (DCP's HF reader),
        converting to FP32 on the way (a bf16 checkpoint loads exactly)."""
        state = dict(zip(self.names, self.params))
        dcp.load(state, storage_reader=HuggingFaceStorageReader(folder), process_group=self.env.cpu_group)

    # ------------------------------------------------------------------ the split and lockstep

    def _plan(self, batch) -> tuple[list[list[int]], int, torch.Tensor]:
        """This rank's micro-batches (row indices, longest first), the most any rank has, lengths."""
        lengths = batch.attention_mask.sum(-1)
        shares = assign_groups(batch.group_ids, lengths.tolist(), self.env.world_size)
        mbs = self.cfg.micro_batch_size

        def micro(rows):
            order = sorted(rows, key=lambda i: -int(lengths[i]))  # stable: ties keep row order
            return [order[i:i + mbs] for i in range(0, len(order), mbs)]

        counts = [len(micro(rows)) for rows in shares]
        return micro(shares[self.env.rank]), max(counts), lengths

    def _filler_pass(self, batch, need_grad: bool) -> None:
        """A micro-batch that changes nothing: a 2-token forward (and a zero-loss backward)."""
        tokens = batch.tokens[:1, :2]
        mask = torch.ones((1, 1), dtype=torch.bool, device=self.device)
        logp, _ = self._logprobs(tokens, mask, need_grad=need_grad, with_entropy=False)
        if need_grad:
            (logp.sum() * 0.0).backward()

    def _logprobs(self, tokens, score_mask, need_grad: bool, with_entropy: bool):
        return self.root(tokens, score_mask, need_grad, with_entropy)

    @torch.no_grad()
    def _refresh_gathered(self) -> None:
        """One rank, before each pass: the model stays gathered in the compute dtype from step to step
        (there is nothing to share) and takes the shards' current values in one foreach copy, as Trainer
        copies its masters into its bf16 model, instead of FSDP's unshard (a cast and a copy per
        parameter, ~600 launches for 24 layers) and reshard (a free per parameter) every step. Every
        pass copies: whatever wrote the shards since (the optimizer, a checkpoint load) is seen.
        (Not by version counters: the fused AdamW kernel writes the shards without bumping them.)"""
        root = self.root
        if root.gathered is None:
            shards = dict(self.model.named_parameters())  # the sharded DTensors, before the gather
            root.unshard()  # FSDP's own gather; the modules now hold plain gathered parameters
            gathered = dict(self.model.named_parameters())
            root.gathered = (list(gathered.values()), [shards[name].to_local() for name in gathered])
            return
        params, local = root.gathered
        torch._foreach_copy_(params, local)  # FP32 -> compute dtype, rounded to nearest as FSDP's cast

    # ------------------------------------------------------------------ log-probs and the step

    @torch.no_grad()
    def logprobs(self, batch, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Trainer.logprobs over the ranks: each computes its groups' rows, a sum assembles them
        (the other ranks contribute exact zeros). Every rank gets the whole [B, L-1] result."""
        self._check_batch(batch)
        mask = batch.loss_mask if mask is None else mask
        out = torch.zeros(mask.shape, dtype=torch.float32, device=self.device)
        mine, n_micro, lengths = self._plan(batch)
        if self.one_rank:
            self._refresh_gathered()
        for i in range(n_micro):
            if i >= len(mine):
                self._filler_pass(batch, need_grad=False)
                continue
            idx = mine[i]
            n = int(lengths[idx].max())
            lp, _ = self._logprobs(batch.tokens[idx, :n], mask[idx, :n - 1], need_grad=False, with_entropy=False)
            out[idx, :n - 1] = lp
        if not self.one_rank:
            self._reshard()  # a no-grad forward leaves modules gathered; the next step must gather afresh
        dist.all_reduce(out)
        return out.cpu()

    def train_step(self, batch, advantages, old_logprobs=None, ref_logprobs=None, on_micro_batch=None) -> dict:
        """Trainer.train_step over the ranks (call it on every rank with the same whole batch)."""
        self._check_batch(batch)
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

        sums, tokens, pg_loss, ratio_max, diff_sum, diff_max, diff_n = {}, 0, 0.0, 1.0, 0.0, 0.0, 0
        mine, n_micro, lengths = self._plan(batch)
        if self.one_rank:
            self._refresh_gathered()
        for done in range(1, n_micro + 1):
            if self.one_rank:
                # Nothing to reduce across ranks: the gradient accumulates in FP32 on the gathered layers
                # (FSDP upcasts it, as Trainer's master gradients) and is handed to the shards once, after
                # the last micro-batch (the model stays gathered). (With N ranks each
                # micro-batch is reduce-scattered: whole FP32 gradients on every rank would undo sharding.)
                self._sync_gradients(done == n_micro)
            if done > len(mine):
                self._filler_pass(batch, need_grad=True)
            else:
                idx = mine[done - 1]
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
                on_micro_batch(done, n_micro)

        grad_norm = self._clip_and_step()
        if self.device.type == "cpu":
            heap.release_free_heap()
        peak = torch.cuda.max_memory_allocated(self.device) / 2**30 if self.device.type == "cuda" else None
        mine = (sums, tokens, pg_loss, ratio_max, diff_sum, diff_max, peak, diff_n)
        parts = [mine]
        if not self.one_rank:  # (collectives of one rank still cost a launch and, here, a pickle)
            parts = [None] * self.env.world_size
            dist.all_gather_object(parts, mine, group=self.env.cpu_group)
        sums, tokens = {}, sum(p[1] for p in parts)
        for part in parts:
            for k, v in part[0].items():
                sums[k] = sums.get(k, 0.0) + v
        metrics = {k: v / max(tokens, 1) for k, v in sums.items()}
        metrics.update(
            step=self.step, pg_loss=sum(p[2] for p in parts), ratio_max=max(p[3] for p in parts),
            grad_norm=grad_norm, lr=self.optimizer.param_groups[0]["lr"], response_tokens=tokens,
            logprob_diff_mean=sum(p[4] for p in parts) / max(sum(p[7] for p in parts), 1), logprob_diff_max=max(p[5] for p in parts),
            step_ms=(time.perf_counter() - t0) * 1000.0, world_size=self.env.world_size,
        )
        if peak is not None:
            metrics["peak_mem_gib"] = max(p[6] for p in parts)  # the largest rank's
        return metrics

    def _sync_gradients(self, on: bool) -> None:
        if on != self._gradient_sync:  # (FSDP's setters walk every submodule: only on a change)
            for module in self.fsdp_modules:
                module.set_requires_gradient_sync(on, recurse=False)
            self._gradient_sync = on

    def _reshard(self) -> None:
        for module in self.fsdp_modules:
            module.reshard()

    def _accumulate_master_grads(self):
        pass  # FSDP reduce-scatters FP32 gradients straight into the sharded masters

    @torch.no_grad()  # (DTensor.to_local() of 300 gradients outside it: an autograd Function each)
    def _clip_and_step(self) -> float:
        """Clip on the norm of the whole gradient (every rank's shards), then one AdamW step."""
        grads = [m.grad.to_local() for m in self.masters if m.grad is not None]
        square = torch.zeros((), dtype=torch.float32, device=self.device)
        if grads:
            square = torch.stack(torch._foreach_norm(grads)).square().sum()  # this rank's part of |g|^2
        if not self.one_rank:
            dist.all_reduce(square)
        norm = float(square.sqrt())
        if not math.isfinite(norm):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm ({norm}) at step {self.step}; update skipped")
        max_norm = self.cfg.optim.max_grad_norm
        if max_norm > 0 and grads:
            coef = max_norm / (norm + 1e-6)  # torch's clip_grad_norm_ formula
            if coef < 1.0:
                torch._foreach_mul_(grads, coef)
        set_lr(self.optimizer, self.cfg.optim, self.step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._check_weights_finite()
        self.step += 1
        return norm

    def _check_weights_finite(self) -> None:
        """Trainer's check over this rank's shards; one all-reduce of a flag makes every rank raise
        together (a NaN may sit in one rank's shards only)."""
        bad = non_finite(zip(self.names, (m.to_local() for m in self.masters)))
        flag = torch.tensor(float(bad is not None), device=self.device)
        if not self.one_rank:
            dist.all_reduce(flag)
        if flag.item():
            raise NonFiniteWeights(f"optimizer step {self.step + 1} left NaN or infinite values in "
                                   f"{bad or 'the weights (on another rank)'}")

    # ------------------------------------------------------------------ weights

    def iter_full_weights(self, dtype: torch.dtype | None = None,
                          bucket_bytes: int = 512 * 2**20) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """Whole tensors in HF names, `dtype` (default: the compute dtype), a bucket at a time, on
        rank 0 (the other ranks get [] per bucket). Collective: every rank must iterate it to the end.

        Each rank casts its shards to `dtype` and sends them in one flat buffer per bucket to rank 0,
        so no rank ever holds a full FP32 copy (nor more than one bucket of gathered weights)."""
        dtype = dtype or self.dtype
        W, rank = self.env.world_size, self.env.rank
        bucket, size = [], 0
        for name, p in zip(self.names, self.params):
            bucket.append((name, p))
            size += p.numel() * dtype.itemsize
            if size >= bucket_bytes:
                yield self._gather_bucket(bucket, dtype, W, rank)
                bucket, size = [], 0
        if bucket:
            yield self._gather_bucket(bucket, dtype, W, rank)

    @torch.no_grad()
    def _gather_bucket(self, bucket, dtype, W, rank):
        # FSDP shards dim 0 like torch.chunk: ceil(d0 / W) rows per rank, the last ones shorter or
        # empty. Each rank pads its rows to that, so the flat buffers line up.
        pieces, layout = [], []
        for name, p in bucket:
            local = p.to_local()
            d0, inner = p.shape[0], math.prod(p.shape[1:])
            rows = -(-d0 // W)
            chunk = torch.zeros(rows * inner, dtype=dtype, device=self.device)
            chunk[:local.numel()] = local.reshape(-1)
            pieces.append(chunk)
            layout.append((name, p.shape, rows * inner, d0, inner))
        flat = torch.cat(pieces)
        gathered = [torch.empty_like(flat) for _ in range(W)] if rank == 0 else None
        dist.gather(flat, gathered, dst=0)
        if rank != 0:
            return []
        out, offset = [], 0
        for name, shape, n, d0, inner in layout:
            whole = torch.cat([g[offset:offset + n] for g in gathered])[:d0 * inner]
            out.append((name, whole.view(shape)))
            offset += n
        return out

    def named_weights(self, dtype: torch.dtype | None = None):
        """Trainer.named_weights, gathered: the list on rank 0, [] on the others (collective)."""
        return [pair for bucket in self.iter_full_weights(dtype) for pair in bucket]

    def state_dict(self) -> dict:
        raise NotImplementedError("a sharded trainer's state is saved with nano_miles.trainer.dist_checkpoint")

    def load_state_dict(self, state: dict) -> None:
        raise NotImplementedError("a sharded trainer's state is loaded with nano_miles.trainer.dist_checkpoint")


def _rebuild_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """to_empty() leaves buffers uninitialised; the only ones of a Qwen2/Llama model are RoPE's
    inverse frequencies, computed from the config: compute them again, in FP32, on the device."""
    for name, module in model.named_modules():
        own = dict(module.named_buffers(recurse=False))
        if not own:
            continue
        if "RotaryEmbedding" not in type(module).__name__ or not hasattr(module, "config"):
            raise ValueError(f"{name}: cannot rebuild buffers {sorted(own)} after meta-device construction")
        fresh = type(module)(module.config)
        for key, value in fresh.named_buffers(recurse=False):
            setattr(module, key, value.to(device))
        low = [k for k, v in fresh.named_buffers(recurse=False) if v.dtype != torch.float32]
        if low:
            raise ValueError(f"{name}.{low[0]} is not float32")


@torch.no_grad()
def _random_init(names, params, rank: int) -> None:
    """Random weights of the architecture (benchmarks): N(0, 0.02), norms 1, biases 0. Each rank
    fills its own shards (seeded by rank), so no full tensor is ever made."""
    gen = torch.Generator(device=params[0].device).manual_seed(1234 + rank)
    for name, p in zip(names, params):
        local = p.to_local()
        if "norm" in name:
            local.fill_(1.0)
        elif name.endswith("bias"):
            local.zero_()
        else:
            local.normal_(0.0, 0.02, generator=gen)
