"""The distributed weight transport, both ends: a torch.distributed process group of its own per
trainer-engines set (trainer rank 0, engines rank_offset..), one broadcast per flattened bucket.

Same rendezvous as SGLang's init_custom_process_group (a TCPStore hosted by rank 0, keys prefixed by
the group name), so either end may be SGLang. It never touches torch's default process group.
"""
from __future__ import annotations

import datetime
import os
import socket
import threading

import psutil
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from nano_miles.engine.protocol import DEFAULT_GROUP_NAME
from nano_miles.engine.weights import FlattenedTensorBucket, FlattenedTensorMetadata, parse_dtype


def listen(address: str, port: int = 0) -> socket.socket:
    """A listening socket for rank 0's store, bound to `address` only (torch's TCPStore binds every
    interface). Port 0: a free one, taken here, so nobody can take it before the store does."""
    family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(sockaddr)
    sock.listen()
    return sock


def init_weight_update_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    group_name: str = DEFAULT_GROUP_NAME,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    connect_timeout_s: float | None = None,
    listener: socket.socket | None = None,
):
    """Join (or, as rank 0, host) the group. Every member calls this at the same time.

    Rank 0's store listens on master_address only (on `listener` if given, see listen()). Other ranks
    give up after connect_timeout_s if given: torch's own timeout does not cover a store that accepts
    the connection and then never answers (it waits forever), nor its retries (~3x the timeout)."""
    timeout = datetime.timedelta(seconds=timeout_s)

    def rendezvous():
        if rank == 0:
            fd = (listener or listen(master_address, master_port)).detach()  # the store owns it from here
            store = dist.TCPStore(master_address, int(master_port), world_size, is_master=True, timeout=timeout,
                                  master_listen_fd=fd)
        else:
            store = dist.TCPStore(master_address, int(master_port), world_size, is_master=False, timeout=timeout)
        store = dist.PrefixStore(group_name, store)
        pg = c10d._new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
                                            timeout=timeout)
        pg = pg[0] if isinstance(pg, tuple) else pg
        c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # group rank == "global" rank
        return pg

    if rank == 0 or connect_timeout_s is None:
        return rendezvous()
    return _with_deadline(rendezvous, connect_timeout_s, master_address, int(master_port))


def _with_deadline(rendezvous, timeout_s: float, address: str, port: int):
    """rendezvous() in a thread; after timeout_s, TimeoutError, and the thread is unblocked by shutting
    down its connections to the store (a group it still forms later is destroyed, never leaked)."""
    lock, box = threading.Lock(), {}

    def run():
        try:
            result = ("group", rendezvous())
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            result = ("error", e)
        with lock:
            abandoned = box.get("abandoned", False)
            box["result"] = result
        if abandoned and result[0] == "group":
            destroy_weight_update_group(result[1])

    thread = threading.Thread(target=run, name="weight-group-rendezvous", daemon=True)
    thread.start()
    thread.join(timeout_s)
    with lock:
        result = box.get("result")
        if result is None:
            box["abandoned"] = True
    if result is None:
        threading.Thread(target=_unblock, args=(thread, address, port), daemon=True).start()
        raise TimeoutError(f"the rendezvous at {address}:{port} did not complete within {timeout_s:g}s "
                           "(is the trainer's store there, and does it answer?)")
    if result[0] == "error":
        raise result[1]
    return result[1]


def _unblock(thread: threading.Thread, address: str, port: int) -> None:
    """Until `thread` ends: shut down its connections to the store. torch retries a failed connect
    (until its own timeout), and each retry could hang again on a store that never answers."""
    while thread.is_alive():
        _shut_down_connections_to(address, port)
        thread.join(0.5)


def _shut_down_connections_to(address: str, port: int) -> None:
    """Shut down this process's TCP connections to address:port: a thread blocked reading one returns."""
    ips = {info[4][0] for info in socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)}
    for conn in psutil.Process().net_connections(kind="tcp"):
        if conn.raddr and conn.raddr.port == port and conn.raddr.ip.removeprefix("::ffff:") in ips and conn.fd >= 0:
            try:
                with socket.socket(fileno=os.dup(conn.fd)) as s:
                    s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass  # closed meanwhile


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
