"""What the trainer needs on N ranks: each rank's share of the batch (whole groups), the model sharded
by FSDP2, an AdamW that steps the local shards, the buffers a meta-device model lacks, random weights
(benchmarks), and whole tensors gathered to rank 0 a bucket at a time.

One FSDP group per decoder layer plus the root, so a rank holds one layer's gathered weights at a time
and a layer's gradients are reduce-scattered as soon as its backward is done. The root wraps the whole
log-prob pass (`Root`): the chunked FP32 lm_head uses the root's weights after the decoder has run.
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.optim.adamw import adamw

from nano_miles.trainer.loss import group_rows


def assign_groups(group_ids: list[str], lengths: list[int], world_size: int) -> list[list[int]]:
    """Row indices per rank, whole groups each: groups by token count, largest first, each to the
    rank with the fewest tokens so far (the lowest on ties). Every rank computes every rank's share."""
    load, share = [0] * world_size, [[] for _ in range(world_size)]
    for rows in sorted(group_rows(group_ids), key=lambda rows: -sum(lengths[i] for i in rows)):  # stable
        r = min(range(world_size), key=lambda k: (load[k], k))
        share[r].extend(rows)
        load[r] += sum(lengths[i] for i in rows)
    return [sorted(rows) for rows in share]


class Root(torch.nn.Module):
    """FSDP's root: its forward is Trainer._score, so the root's parameters are gathered for all of it."""

    def __init__(self, model: torch.nn.Module, owner):
        super().__init__()
        self.model = model
        self.owner = owner  # the trainer: not a Module, a plain attribute

    def forward(self, tokens, score_mask, need_grad: bool, with_entropy: bool):
        return self.owner._score(tokens, score_mask, need_grad, with_entropy)


def shard_model(model, owner, mesh, dtype: torch.dtype, device: torch.device):
    """fully_shard each decoder layer, then the root, on `device`: (root, every FSDP module). Forwards
    gather in `dtype`; gradients are reduce-scattered in FP32 and SUMMED over ranks (the loss is
    normalised over the whole batch already; FSDP would average)."""
    # cast_forward_inputs off: the activations are in the compute dtype already (the embeddings'
    # output is), and FSDP would walk every layer's arguments each forward to cast nothing.
    mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
    layers = list(model.base_model.layers)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    root = Root(model, owner)
    fully_shard(root, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
    modules = (*layers, root)
    for module in modules:
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM (else a PREMUL_SUM, which gloo lacks)
    root.to_empty(device=device)
    rebuild_buffers(model, device)
    return root, modules


class ShardAdamW(torch.optim.AdamW):
    """AdamW whose step runs on FSDP's local shards: the same arithmetic and state (DTensor moments, so
    checkpoints see a plain AdamW), but one fused kernel over plain tensors instead of DTensor's
    dispatch over each of hundreds of parameters, CPU time that the GPU would wait out."""

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardAdamW.step takes no closure")
        for group in self.param_groups:
            shards = [p for p in group["params"] if p.grad is not None]
            states = [adamw_state(self, p, group) for p in shards]
            beta1, beta2 = group["betas"]
            adamw([p.to_local() for p in shards], [p.grad.to_local() for p in shards],
                  [s["exp_avg"].to_local() for s in states], [s["exp_avg_sq"].to_local() for s in states], [],
                  [s["step"] for s in states], foreach=group["foreach"], fused=group["fused"],
                  capturable=group["capturable"], amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
                  weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])


def adamw_state(optimizer: torch.optim.AdamW, p, group: dict) -> dict:
    """p's AdamW state, created as AdamW's first step makes it where it does not exist yet (what
    ShardAdamW steps and a checkpoint is loaded into)."""
    state = optimizer.state[p]
    if not state:
        on_device = group["fused"] or group["capturable"]  # (else AdamW keeps `step` on the CPU)
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_device else "cpu")
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return state


def rebuild_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """to_empty() leaves buffers uninitialised; the only ones of a Qwen2/Llama model are RoPE's
    inverse frequencies, computed from the config: compute them again, in FP32, on the device."""
    for name, module in model.named_modules():
        if not (own := dict(module.named_buffers(recurse=False))):
            continue
        if "RotaryEmbedding" not in type(module).__name__ or not hasattr(module, "config"):
            raise ValueError(f"{name}: cannot rebuild buffers {sorted(own)} after meta-device construction")
        for key, value in type(module)(module.config).named_buffers(recurse=False):
            setattr(module, key, value.to(device))


@torch.no_grad()
def fill_shards(names, params, folder: str | None, group) -> None:
    """Each rank's rows of every tensor of the HF `folder` (DCP's reader, to FP32), or with folder None
    random weights (benchmarks: N(0, 0.02), norms 1, biases 0). No rank ever holds a full tensor."""
    if folder is not None:
        dcp.load(dict(zip(names, params)), storage_reader=HuggingFaceStorageReader(folder), process_group=group)
        return
    gen = torch.Generator(device=params[0].device).manual_seed(1234 + dist.get_rank())
    for name, p in zip(names, params):
        local = p.to_local()
        if "norm" in name:
            local.fill_(1.0)
        elif name.endswith("bias"):
            local.zero_()
        else:
            local.normal_(0.0, 0.02, generator=gen)


def split_buckets(pairs, bucket_bytes: int, dtype: torch.dtype) -> list[list]:
    """(name, tensor) pairs in order, in buckets of at most `bucket_bytes` once in `dtype` (a larger tensor alone)."""
    out, size = [[]], 0
    for name, t in pairs:
        nbytes = t.numel() * dtype.itemsize
        if out[-1] and size + nbytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append((name, t))
        size += nbytes
    return out


def gather_buckets(pairs, bucket_bytes: int, dtype: torch.dtype, device: torch.device):
    """gather_bucket of each of split_buckets' buckets in turn; closed early (a failed send), it finishes
    the gathers the other ranks are in."""
    buckets = split_buckets(pairs, bucket_bytes, dtype)
    for i, bucket in enumerate(buckets):
        gathered = gather_bucket(bucket, dtype, device)
        try:
            yield gathered
        except GeneratorExit:
            for rest in buckets[i + 1:]:
                gather_bucket(rest, dtype, device)
            raise


@torch.no_grad()
def gather_bucket(bucket, dtype: torch.dtype, device: torch.device) -> list:
    """Whole tensors of a bucket of (name, DTensor) pairs, in `dtype`, on rank 0 ([] on the others). Each
    rank sends its cast shards in one flat buffer, padded to ceil(d0 / N) rows (FSDP shards dim 0 like
    torch.chunk) so the buffers line up."""
    world, rank = dist.get_world_size(), dist.get_rank()
    pieces, layout = [], []
    for name, p in bucket:
        local = p.to_local()
        d0, inner = p.shape[0], math.prod(p.shape[1:])
        chunk = torch.zeros(-(-d0 // world) * inner, dtype=dtype, device=device)
        chunk[:local.numel()] = local.reshape(-1)
        pieces.append(chunk)
        layout.append((name, p.shape, chunk.numel(), d0 * inner))
    flat = torch.cat(pieces)
    gathered = [torch.empty_like(flat) for _ in range(world)] if rank == 0 else None
    dist.gather(flat, gathered, dst=0)
    if rank != 0:
        return []
    out, offset = [], 0
    for name, shape, n, whole in layout:
        out.append((name, torch.cat([g[offset:offset + n] for g in gathered])[:whole].view(shape)))
        offset += n
    return out
