"""The distributed weight transport, both ends: a torch.distributed process group of its own per
trainer-engines set (trainer rank 0, engines rank_offset..), one broadcast per flattened bucket.

Same rendezvous as SGLang's init_custom_process_group (a TCPStore hosted by rank 0, keys prefixed by
the group name), so either end may be SGLang. It never touches torch's default process group.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from nano_miles.engine.protocol import DEFAULT_GROUP_NAME
from nano_miles.engine.weights import FlattenedTensorBucket, FlattenedTensorMetadata, parse_dtype


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "gloo",
    timeout_s: float = 300.0,
):
    """Join (or, as rank 0, host) the group. Every member calls this at the same time."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, int(master_port), world_size, is_master=(rank == 0), timeout=timeout)
    store = dist.PrefixStore(group_name, store)
    pg = c10d._new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name, timeout=timeout)
    pg = pg[0] if isinstance(pg, tuple) else pg
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # group rank == "global" rank
    return pg


def destroy_weight_update_group(pg) -> None:
    dist.destroy_process_group(pg)


def _broadcast(tensor: torch.Tensor, pg, timeout_s: float) -> None:
    work = dist.broadcast(tensor, src=0, group=pg, async_op=True)
    work.wait(datetime.timedelta(seconds=timeout_s))


def broadcast_weights(pg, named_tensors, load_format: str | None = "flattened_bucket", timeout_s: float = 300.0,
                      out: torch.Tensor | None = None):
    """Trainer side of /update_weights_from_distributed: send these tensors, in this order.
    flattened_bucket: flattened into `out` if given (a persistent uint8 send buffer: the broadcast
    has finished reading it when this returns, on the caller's stream), else into a fresh buffer."""
    if load_format == "flattened_bucket":
        _broadcast(FlattenedTensorBucket(named_tensors=named_tensors, out=out).flattened_tensor, pg, timeout_s)
    else:
        for _, tensor in named_tensors:
            _broadcast(tensor.detach().contiguous(), pg, timeout_s)


def bucket_layout(names, dtypes, shapes) -> list[FlattenedTensorMetadata]:
    """The metadata of the flattened bucket a trainer builds from tensors of these names/dtypes/shapes."""
    metadata, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        dtype, shape = parse_dtype(dtype), torch.Size(shape)
        nbytes = shape.numel() * dtype.itemsize
        metadata.append(FlattenedTensorMetadata(name, shape, dtype, offset, offset + nbytes, nbytes))
        offset += nbytes
    return metadata


def receive_bucket(pg, names, dtypes, shapes, device, timeout_s: float, buffer: torch.Tensor | None = None):
    """Engine side of a flattened_bucket broadcast: the bucket, received into `buffer` (a persistent
    1-D uint8 tensor of at least the bucket's size) or a fresh one. Not yet cut into tensors."""
    metadata = bucket_layout(names, dtypes, shapes)
    nbytes = metadata[-1].end_idx if metadata else 0
    if buffer is None:
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    elif buffer.dtype != torch.uint8 or buffer.dim() != 1 or buffer.numel() < nbytes:
        raise ValueError(f"the receive buffer must be a 1-D uint8 tensor of at least {nbytes} bytes")
    flat = buffer[:nbytes]
    _broadcast(flat, pg, timeout_s)
    return FlattenedTensorBucket(flattened_tensor=flat, metadata=metadata)


def receive_weights(pg, names, dtypes, shapes, load_format, device, timeout_s: float):
    """Engine side: fresh buffers of the announced names/dtypes/shapes, filled by rank 0's broadcast."""
    if load_format == "flattened_bucket":
        return receive_bucket(pg, names, dtypes, shapes, device, timeout_s).reconstruct_tensors()
    empties = [(n, torch.empty(tuple(s), dtype=parse_dtype(d), device=device)) for n, d, s in zip(names, dtypes, shapes)]
    for _, tensor in empties:
        _broadcast(tensor, pg, timeout_s)
    return empties
