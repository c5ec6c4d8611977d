"""Receiving weight updates: the server's weight routes, from payload to swapped-in weights.

Weight updates follow SGLang: decode/receive the new tensors first (off the event loop; a broadcast
lands in a persistent buffer of its group) and validate them, then, unless generation is paused,
stop admitting new requests and let in-flight ones drain (abort them first with abort_all_requests),
swap all weights at once, flush every cached KV/prefix block, set weight_version (the given one, else
+1; a flush_cache=false bucket without a version keeps it, as more buckets follow), and admit what
queued meanwhile. A payload that does not fit the model is refused before anything changes (HTTP 400,
old weights and version kept). A flattened bucket laid out exactly like a run of the engine's packed
parameters is swapped in with ONE copy (flat_params.py), anything else tensor by tensor; either way
the copy is complete and the trainer's buffer released before the answer, which also carries
timings_ms per phase.
"""
from __future__ import annotations

import asyncio
import threading
import time

import torch
from aiohttp import web

from nano_miles.dtypes import dtype_name
from nano_miles.engine import weight_group as G
from nano_miles.engine import weights as W
from nano_miles.engine.http_io import json_body, weight_answer
from nano_miles.engine.model import skip_weight_name
from nano_miles.engine.protocol import DEFAULT_GROUP_NAME, RequestError


def _next_version(current: str, given) -> str:
    if given is not None:
        return str(given)
    return str(int(current) + 1) if current.isdigit() else f"{current}+1"


class _Update:
    """New weights on their way to the engine thread: a bucket matched against the packed parameters
    (flat = (start byte, buffer), applied with one copy) or validated (name, tensor) pairs. take()
    hands them over and keeps no reference, so a trainer's CUDA IPC memory is closed on the engine
    thread right after the copy, before the answer lets the trainer free it."""

    def __init__(self, named=None, flat=None, count: int | None = None):
        self.named, self.flat = named, flat
        self.fast = flat is not None
        self.count = count if count is not None else len(named)

    def take(self):
        named, flat, self.named, self.flat = self.named, self.flat, None, None
        return named, flat


# The routes that may take bodies over max_body_mb (up to max_weight_body_mb): weight payloads.
LARGE_BODY_ROUTES = ("/update_weights_from_tensor", "/update_weights_from_disk", "/update_weights_from_distributed",
                     "/init_weights_update_group", "/destroy_weights_update_group")


class WeightReceiver:
    """The weight routes of one server. `worker` owns the engine (worker.py); dist_timeout_s bounds
    every broadcast, connect_timeout_s every rendezvous (one at a time)."""

    def __init__(self, worker, dist_timeout_s: float, connect_timeout_s: float):
        self.worker = worker
        self.dist_timeout_s, self.connect_timeout_s = dist_timeout_s, connect_timeout_s
        self.forming: str | None = None  # the group whose rendezvous is under way
        self.groups: dict = {}  # group_name -> process group
        self.group_locks: dict = {}
        self.recv_buffers: dict = {}  # group_name -> persistent uint8 buffer its broadcasts land in

    def add_routes(self, router) -> None:
        router.add_post("/update_weights_from_tensor", self.update_from_tensor)
        router.add_post("/update_weights_from_disk", self.update_from_disk)
        router.add_post("/init_weights_update_group", self.init_group)
        router.add_post("/update_weights_from_distributed", self.update_from_distributed)
        router.add_post("/destroy_weights_update_group", self.destroy_group)
        router.add_route("*", "/weights_checksum", self.weights_checksum)

    @property
    def engine(self):
        return self.worker.engine

    # --- validation and the swap ---
    def _check(self, named, cast: bool = False):
        """Drop the names the engine derives itself (a tied lm_head), cast a checkpoint's floats to the
        engine's dtype if asked, and refuse anything that does not fit the model."""
        eng = self.engine
        named = [(n, t) for n, t in named if not skip_weight_name(n, eng.model_config)]
        if cast:  # checkpoints on disk may be stored in another float dtype
            named = [(n, t.to(eng.dtype) if t.is_floating_point() else t) for n, t in named]
        W.check_against(named, eng.weight_specs)
        return named

    def _bucket_update(self, bucket: W.FlattenedTensorBucket) -> _Update:
        """One copy if the bucket reproduces a run of the packed parameters byte for byte (names,
        order, shapes, dtype, offsets: see flat_params.py), else the validated per-tensor path."""
        flat = self.engine.flat_params
        span = flat.match(bucket.metadata) if flat is not None else None
        if span is not None and bucket.flattened_tensor.numel() == span[1] - span[0]:
            return _Update(flat=(span[0], bucket.flattened_tensor), count=len(bucket.metadata))
        return _Update(named=self._check(bucket.reconstruct_tensors()))

    async def _apply(self, update: _Update, body, source: str, timings: dict, t0: float) -> web.Response:
        """Swap in `update` on the engine thread once in-flight work allows; bump the version.
        Answers with per-phase timings_ms: parse (the JSON body), decode/receive, wait (hand-off to
        the engine thread and drain), copy (the copy until complete + KV flush), release (dropping
        the trainer's buffer), answer (back to the event loop), total (handler entry to answer)."""
        abort_first = body.get("abort_all_requests", False)
        if not isinstance(abort_first, bool):
            raise RequestError("abort_all_requests must be a boolean")
        given = body.get("weight_version")
        if given is not None and not isinstance(given, (str, int)):
            raise RequestError("weight_version must be a string")
        # flush_cache=false without a weight_version marks one bucket of a multi-bucket sync (more
        # follow): the version moves once, with the last bucket. The KV cache is flushed regardless,
        # so nothing computed with older weights is ever reused.
        partial = given is None and body.get("flush_cache", True) is False

        submitted = time.perf_counter()
        swapped = [0.0]

        def swap(eng):
            t = time.perf_counter()
            timings["wait"] = (t - submitted) * 1000
            old = eng.weight_version
            named, flat = update.take()
            if flat is not None:
                eng.load_flat(*flat)  # matched already: one copy, complete on return, then a KV flush
            else:
                eng.load_weights(named)  # validated already; copies in place, then flushes every KV block
            timings["copy"] = (time.perf_counter() - t) * 1000
            t = time.perf_counter()
            del named, flat  # the last references: CUDA IPC memory is closed here, before we answer
            swapped[0] = time.perf_counter()
            timings["release"] = (swapped[0] - t) * 1000
            if not partial:
                eng.weight_version = _next_version(old, given)
            return eng.weight_version

        version = await self.worker.update(swap, abort_first)
        now = time.perf_counter()
        timings["answer"] = (now - swapped[0]) * 1000  # engine thread -> event loop
        timings["total"] = (now - t0) * 1000
        return web.json_response({
            "success": True, "fast_path": update.fast,
            "message": f"Succeeded to update {update.count} tensors from {source}"
                       f"{' with one copy' if update.fast else ''}. Weight version updated to {version}.",
            "timings_ms": {k: round(v, 3) for k, v in timings.items()}})

    # --- tensor and disk ---
    async def update_from_tensor(self, request):
        t0 = time.perf_counter()
        body = await json_body(request)
        parsed = time.perf_counter()
        fmt = body.get("load_format")
        payload = body.get("serialized_named_tensors")

        def decode():
            if fmt == "flattened_bucket":
                return self._bucket_update(W.decode_bucket(payload))
            return _Update(named=self._check(W.decode_tensor_payload(payload, fmt)))

        try:
            t = time.perf_counter()
            update = await asyncio.to_thread(decode)
        except W.WeightPayloadError as e:
            return weight_answer(False, f"Failed to update weights from tensor: {e}")
        timings = {"parse": (parsed - t0) * 1000, "decode": (time.perf_counter() - t) * 1000}
        return await self._apply(update, body, "tensor", timings, t0)

    async def update_from_disk(self, request):
        t0 = time.perf_counter()
        body = await json_body(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            return weight_answer(False, "model_path (a folder of safetensors files) is required")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            return weight_answer(False, f"load_format {body.get('load_format')!r} is not supported; use safetensors")

        def load():
            named = self._check(W.load_safetensors_folder(path), cast=True)
            missing = sorted(set(self.engine.weight_specs) - {n for n, _ in named})
            if missing:
                raise W.WeightPayloadError(f"the checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")
            return named

        try:
            t = time.perf_counter()
            named = await asyncio.to_thread(load)
        except W.WeightPayloadError as e:
            return weight_answer(False, f"Failed to update weights from disk: {e}")
        timings = {"decode": (time.perf_counter() - t) * 1000}
        return await self._apply(_Update(named=named), body, f"disk ({path})", timings, t0)

    # --- distributed ---
    async def init_group(self, request):
        body = await json_body(request)
        try:
            addr, port = body["master_address"], body["master_port"]
            rank, world = body["rank_offset"], body["world_size"]
        except KeyError as e:
            return weight_answer(False, f"missing field {e.args[0]}")
        name = body.get("group_name") or DEFAULT_GROUP_NAME
        backend = body.get("backend") or "nccl"
        if not (isinstance(addr, str) and all(isinstance(x, int) and not isinstance(x, bool) for x in (port, rank, world))
                and 1 <= rank < world):
            return weight_answer(False, "need master_address (str), master_port, rank_offset >= 1, world_size > rank_offset")
        if backend not in ("gloo", "nccl"):
            return weight_answer(False, f"backend must be gloo or nccl, got {backend!r}")
        if backend == "nccl" and self.engine.device.type != "cuda":
            return weight_answer(False, "backend nccl needs a CUDA engine; this engine runs on CPU: use gloo")
        if name in self.groups:
            return weight_answer(False, f"group {name!r} already exists; destroy it first")
        if self.forming is not None:
            return weight_answer(False, f"group {self.forming!r} is being formed; one rendezvous at a time")

        def init():
            if backend == "nccl":
                torch.cuda.set_device(self.engine.device)
            return G.init_weight_update_group(addr, port, rank, world, name, backend, self.dist_timeout_s,
                                              connect_timeout_s=self.connect_timeout_s)

        self.forming = name
        try:
            self.groups[name] = await asyncio.to_thread(init)
        except TimeoutError as e:
            return weight_answer(False, f"Failed to init group {name!r}: {e} (config key dist_connect_timeout)")
        except Exception as e:
            return weight_answer(False, f"Failed to init group {name!r}: {type(e).__name__}: {e}")
        finally:
            self.forming = None
        self.group_locks[name] = asyncio.Lock()
        return weight_answer(True, f"Succeeded to initialize custom process group {name!r} "
                                   f"({backend}, rank {rank} of {world}).")

    async def update_from_distributed(self, request):
        t0 = time.perf_counter()
        body = await json_body(request)
        parsed = time.perf_counter()
        name = body.get("group_name") or DEFAULT_GROUP_NAME
        if name not in self.groups:
            return weight_answer(False, f"no weight update group {name!r}; call /init_weights_update_group first")
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        fmt = body.get("load_format")
        try:
            if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                    and len(names) == len(dtypes) == len(shapes) and names):
                raise W.WeightPayloadError("names, dtypes and shapes must be non-empty lists of one length")
            if fmt not in (None, "flattened_bucket"):
                raise W.WeightPayloadError(f"load_format must be null or 'flattened_bucket', got {fmt!r}")
            for s in shapes:
                if not (isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s)):
                    raise W.WeightPayloadError(f"bad shape {s!r}")
            dtypes = [W.parse_dtype(d) for d in dtypes]
        except W.WeightPayloadError as e:
            return weight_answer(False, f"Failed to update weights from distributed: {e}")
        # Receive first, even into a mismatching announcement, so the trainer's broadcast completes
        # and the group stays in step; then check, then swap. The lock is held until the swap is
        # done: a flattened bucket lands in the group's persistent buffer, which the next broadcast
        # overwrites.
        async with self.group_locks[name]:
            try:
                t = time.perf_counter()
                update, error = await asyncio.to_thread(self._receive, name, names, dtypes, shapes, fmt)
            except Exception as e:
                # A broken collective leaves the group in an unknown state: drop it (its teardown may
                # block until its own timeout, so in a daemon thread) and make the trainer re-init.
                pg = self.groups.pop(name)
                self.recv_buffers.pop(name, None)
                threading.Thread(target=G.destroy_weight_update_group, args=(pg,), daemon=True).start()
                return weight_answer(False, f"Failed to receive weights over {name!r}: {type(e).__name__}: {e}; "
                                            "the group was dropped, call /init_weights_update_group again")
            if error is not None:
                return weight_answer(False, f"Failed to update weights from distributed: {error}")
            timings = {"parse": (parsed - t0) * 1000, "receive": (time.perf_counter() - t) * 1000}
            return await self._apply(update, body, f"distributed group {name!r}", timings, t0)

    def _receive(self, name, names, dtypes, shapes, fmt):
        """(update, None) or, for a received payload that does not fit the model, (None, error)."""
        device, pg = self.engine.device, self.groups[name]
        if device.type == "cuda":
            torch.cuda.set_device(device)  # this pool thread's current device is what NCCL uses
        if fmt != "flattened_bucket":
            received = G.receive_weights(pg, names, dtypes, shapes, fmt, device, self.dist_timeout_s)
            try:
                return _Update(named=self._check(received)), None
            except W.WeightPayloadError as e:
                return None, e
        nbytes = sum(torch.Size(s).numel() * d.itemsize for d, s in zip(dtypes, shapes))
        buffer = self.recv_buffers.get(name)
        if buffer is None or buffer.numel() < nbytes:  # allocated once per group (grown if needed)
            self.recv_buffers[name] = buffer = None  # free the smaller one first
            self.recv_buffers[name] = buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        bucket = G.receive_bucket(pg, names, dtypes, shapes, device, self.dist_timeout_s, buffer=buffer)
        try:
            return self._bucket_update(bucket), None
        except W.WeightPayloadError as e:
            return None, e

    async def destroy_group(self, request):
        body = await json_body(request, default={})
        name = body.get("group_name") or DEFAULT_GROUP_NAME
        pg = self.groups.pop(name, None)
        if pg is None:
            return weight_answer(False, f"no weight update group {name!r}")
        self.group_locks.pop(name, None)
        self.recv_buffers.pop(name, None)
        try:
            await asyncio.to_thread(G.destroy_weight_update_group, pg)
        except Exception as e:
            return weight_answer(False, f"Failed to destroy group {name!r}: {type(e).__name__}: {e}")
        return weight_answer(True, f"Succeeded to destroy custom process group {name!r}.")

    # --- verification ---
    async def weights_checksum(self, request):
        body = await json_body(request, default={}) if request.method == "POST" else {}
        names = body.get("names")
        if names is not None:
            if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
                raise RequestError("names must be a list of parameter names")
            unknown = [n for n in names if n not in self.engine.weight_specs]
            if unknown:
                raise RequestError(f"unknown parameter names: {unknown[:5]}")

        def compute(eng):
            return eng.weight_version, W.checksums(eng.named_parameters(), names)

        version, sums = await self.worker.call(compute)
        return web.json_response({"weight_version": version, "dtype": dtype_name(self.engine.dtype),
                                  "algorithm": "sha256", "checksums": sums})
