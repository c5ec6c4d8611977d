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
from concurrent.futures import Future

import psutil
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from nano_miles.engine.protocol import DEFAULT_GROUP_NAME
from nano_miles.engine.weights import FlattenedTensorBucket, parse_dtype


def listen(address: str, port: int = 0) -> socket.socket:
    """A listening socket for rank 0's store on `address` only (torch's TCPStore binds every
    interface). Port 0: a free one, taken here, so nobody can take it before the store does."""
    family, _, _, _, sockaddr = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(sockaddr)
    sock.listen()
    return sock


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str = DEFAULT_GROUP_NAME, backend: str = "gloo", timeout_s: float = 300.0,
                             connect_timeout_s: float | None = None, listener: socket.socket | None = None):
    """Join (or, as rank 0, host on `listener` or a new listen()) the group; every member at once.
    Other ranks give up after connect_timeout_s if given: torch's own timeout covers neither a store
    that accepts the connection and never answers, nor its retries."""
    timeout = datetime.timedelta(seconds=timeout_s)

    def rendezvous():
        if rank == 0:
            fd = (listener or listen(master_address, master_port)).detach()  # the store owns it from here
            store = dist.TCPStore(master_address, int(master_port), world_size, is_master=True, timeout=timeout,
                                  master_listen_fd=fd)
        else:
            store = dist.TCPStore(master_address, int(master_port), world_size, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(group_name, store)
        pg, _ = c10d._new_process_group_helper(world_size, rank, [], backend, prefixed, group_name=group_name,
                                               timeout=timeout)
        c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}  # group rank == "global" rank
        return pg

    if rank == 0 or connect_timeout_s is None:
        return rendezvous()
    return _with_deadline(rendezvous, connect_timeout_s, master_address, int(master_port))


def _with_deadline(rendezvous, timeout_s: float, address: str, port: int):
    """rendezvous() in a thread; after timeout_s TimeoutError, and the thread is unblocked by shutting
    down its connections to the store (a group it still forms later is destroyed, never leaked)."""
    result = Future()

    def run():
        try:
            result.set_result(rendezvous())
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            result.set_exception(e)

    thread = threading.Thread(target=run, name="weight-group-rendezvous", daemon=True)
    thread.start()
    try:
        return result.result(timeout_s)
    except TimeoutError:
        if result.done():  # the rendezvous's own TimeoutError
            raise
        result.add_done_callback(lambda f: f.exception() is None and destroy_weight_update_group(f.result()))
        threading.Thread(target=_unblock, args=(thread, address, port), daemon=True).start()
        raise TimeoutError(f"the rendezvous at {address}:{port} did not complete within {timeout_s:g}s "
                           "(is the trainer's store there, and does it answer?)") from None


def _unblock(thread: threading.Thread, address: str, port: int) -> None:
    """Until `thread` ends, shut down this process's TCP connections to address:port: a thread
    blocked reading one returns (and each of torch's connect retries could hang again)."""
    ips = {info[4][0] for info in socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)}
    while thread.is_alive():
        for conn in psutil.Process().net_connections(kind="tcp"):
            if conn.raddr and conn.raddr.port == port and conn.raddr.ip.removeprefix("::ffff:") in ips and conn.fd >= 0:
                try:
                    with socket.socket(fileno=os.dup(conn.fd)) as s:
                        s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # closed meanwhile
        thread.join(0.5)


def destroy_weight_update_group(pg) -> None:
    dist.destroy_process_group(pg)


def _broadcast(tensor: torch.Tensor, pg, timeout_s: float) -> None:
    dist.broadcast(tensor, src=0, group=pg, async_op=True).wait(datetime.timedelta(seconds=timeout_s))


def broadcast_weights(pg, named_tensors, load_format: str | None = "flattened_bucket", timeout_s: float = 300.0,
                      out: torch.Tensor | None = None):
    """Trainer side: send these tensors, in this order. flattened_bucket: flattened into `out` if
    given (a persistent send buffer: the broadcast has read it when this returns), else a fresh one."""
    if load_format == "flattened_bucket":
        _broadcast(FlattenedTensorBucket(named_tensors=named_tensors, out=out).flattened_tensor, pg, timeout_s)
    else:
        for _, tensor in named_tensors:
            _broadcast(tensor.detach().contiguous(), pg, timeout_s)


def receive_bucket(pg, metadata, buffer: torch.Tensor, timeout_s: float) -> FlattenedTensorBucket:
    """Engine side of a flattened_bucket broadcast (the bucket_metadata of its announcement), received
    into `buffer`, a persistent 1-D uint8 tensor of at least its size. Not yet cut into tensors."""
    received = buffer[:metadata[-1].end_idx]
    _broadcast(received, pg, timeout_s)
    return FlattenedTensorBucket(flattened_tensor=received, metadata=metadata)


def receive_weights(pg, names, dtypes, shapes, device, timeout_s: float):
    """Engine side: fresh tensors of the announced names/dtypes/shapes, filled by rank 0's broadcast."""
    empties = [(n, torch.empty(tuple(s), dtype=parse_dtype(d), device=device)) for n, d, s in zip(names, dtypes, shapes)]
    for _, tensor in empties:
        _broadcast(tensor, pg, timeout_s)
    return empties
