"""The server's weight routes, from payload to swapped-in weights.

As SGLang: decode or receive and validate the new tensors first (off the event loop), then, unless
generation is paused, let in-flight requests drain (or abort them: abort_all_requests), swap all
weights at once, flush the KV cache, set weight_version and admit what queued meanwhile. A payload
that does not fit the model, or holds a NaN or an infinity, is refused (400) before anything changes.
A bucket laid out like a run of the packed parameters goes in with ONE copy (flat_params.py); the
copy is complete and the trainer's buffer released before the answer.

/update_weights_from_shared (shared_weights.py) maps the trainer's weights in place of the engine's
own copy once, then only flushes and bumps the version; any other update first gives the engine a
private copy again. /release_memory_occupation hands a CPU engine's KV pages back to the kernel.
"""
from __future__ import annotations

import asyncio
import functools
import json
import threading
import time

import torch

from nano_miles.dtypes import dtype_name
from nano_miles.engine import shared_weights as S
from nano_miles.engine import weight_group as G
from nano_miles.engine import weights as W
from nano_miles.engine.flat_params import FlatParameters
from nano_miles.engine.http_io import json_body, json_response, weight_answer
from nano_miles.engine.model import skip_weight_name
from nano_miles.engine.protocol import DEFAULT_GROUP_NAME, RequestError

# The routes that may take bodies over max_body_mb (up to max_weight_body_mb): weight payloads.
LARGE_BODY_ROUTES = ("/update_weights_from_tensor", "/update_weights_from_disk", "/update_weights_from_distributed",
                     "/init_weights_update_group", "/destroy_weights_update_group")


def _ms(start: float, end: float | None = None) -> float:
    return round(((end or time.perf_counter()) - start) * 1000, 3)


def _next_version(current: str, given) -> str:
    if given is not None:
        return str(given)
    return str(int(current) + 1) if current.isdigit() else f"{current}+1"


class _Update:
    """New weights on their way to the engine thread: a bucket matched against the packed parameters
    (flat = (start byte, buffer), one copy) or validated (name, tensor) pairs. take() hands them over
    and keeps no reference, so a trainer's CUDA IPC memory is closed on the engine thread right after
    the copy, before the answer lets the trainer free it."""

    def __init__(self, named=None, flat=None, count: int | None = None):
        self.named, self.flat, self.fast = named, flat, flat is not None
        self.count = count if count is not None else len(named)

    def take(self):
        named, flat, self.named, self.flat = self.named, self.flat, None, None
        return named, flat


class WeightReceiver:
    """The weight routes of one server. `worker` owns the engine (worker.py); dist_timeout_s bounds
    every broadcast, connect_timeout_s every rendezvous (one at a time)."""

    def __init__(self, worker, dist_timeout_s: float, connect_timeout_s: float):
        self.worker = worker
        self.dist_timeout_s, self.connect_timeout_s = dist_timeout_s, connect_timeout_s
        self.forming: str | None = None  # the group whose rendezvous is under way
        self.groups: dict = {}        # group_name -> process group
        self.group_locks: dict = {}
        self.recv_buffers: dict = {}  # group_name -> persistent uint8 buffer its broadcasts land in
        self.shared_key = None        # (path, manifest) of the shared weights the parameters map, or None

    def add_routes(self, router) -> None:
        for path, handler, what in (
                ("/update_weights_from_tensor", self.update_from_tensor, "update weights from tensor"),
                ("/update_weights_from_disk", self.update_from_disk, "update weights from disk"),
                ("/update_weights_from_shared", self.update_from_shared, "update weights from shared memory"),
                ("/init_weights_update_group", self.init_group, "init the weight update group"),
                ("/update_weights_from_distributed", self.update_from_distributed,
                 "update weights from distributed"),
                ("/destroy_weights_update_group", self.destroy_group, "destroy the weight update group"),
                ("/release_memory_occupation", self.release_memory, "release memory"),
                ("/resume_memory_occupation", self.resume_memory, "resume memory")):
            router.add_post(path, self._refusing(handler, what))
        router.add_route("*", "/weights_checksum", self.weights_checksum)

    @staticmethod
    def _refusing(handler, what: str):
        """A refused update is SGLang's {"success": false, "message"} with HTTP 400."""
        @functools.wraps(handler)
        async def route(request):
            try:
                return await handler(request)
            except (W.WeightPayloadError, S.SharedWeightsError) as e:
                return weight_answer(False, f"Failed to {what}: {e}")
        return route

    def _check(self, named, cast: bool = False):
        """Validated pairs, less the names the engine derives itself (a tied lm_head), cast if asked."""
        eng = self.worker.engine
        named = [(n, t) for n, t in named if not skip_weight_name(n, eng.model_config)]
        if cast:  # checkpoints on disk may be stored in another float dtype
            named = [(n, t.to(eng.dtype) if t.is_floating_point() else t) for n, t in named]
        W.check_against(named, eng.weight_specs)
        return named

    def _bucket_update(self, bucket: W.FlattenedTensorBucket) -> _Update:
        """One copy if the bucket reproduces a run of the packed parameters byte for byte (names,
        order, shapes, dtype, offsets), else the validated per-tensor path."""
        flat = self.worker.engine.flat_params
        span = flat.match(bucket.metadata) if flat is not None else None
        buffer = bucket.flattened_tensor
        if span is None or buffer.numel() != span[1] - span[0]:
            return _Update(named=self._check(bucket.reconstruct_tensors()))
        # checked whole, as one tensor; cut into its tensors only to name the culprit (or when unaligned)
        if buffer.storage_offset() % flat.dtype.itemsize or W.non_finite([("", buffer.view(flat.dtype))]) is not None:
            W.check_finite(bucket.reconstruct_tensors())
        return _Update(flat=(span[0], buffer), count=len(bucket.metadata))

    @staticmethod
    def _update_fields(body):
        """(abort_all_requests, weight_version) of an update body, checked."""
        abort_first, given = body.get("abort_all_requests", False), body.get("weight_version")
        if not isinstance(abort_first, bool):
            raise RequestError("abort_all_requests must be a boolean")
        if given is not None and not isinstance(given, (str, int)):
            raise RequestError("weight_version must be a string")
        return abort_first, given

    def _detach(self, eng) -> None:
        """Private weights again (a copy of the shared ones), before an update of another kind writes them."""
        if self.shared_key is None:
            return
        if FlatParameters.packable(eng.model):
            eng.flat_params = FlatParameters(eng.model)  # packs (copies) into a new buffer of its own
        else:
            for p in eng.model.parameters():
                p.data = p.data.clone()
        self.shared_key = None

    async def _apply(self, request, update: _Update, body, source: str, timings: dict, t0: float):
        """Swap `update` in on the engine thread once in-flight work allows; bump the version. Answers
        with timings_ms: parse, decode or receive, wait (hand-off to the engine thread and drain), copy
        (until complete, and the KV flush), release (of the trainer's buffer), answer, total; and the
        wall-clock times the request reached the server and its answer left the handler (a sender on
        this machine tells its time in transit from its own clock)."""
        abort_first, given = self._update_fields(body)
        # one bucket of several: the version moves with the last one (the KV cache is flushed regardless)
        partial = body.get("flush_cache") is False and given is None
        submitted, marks = time.perf_counter(), []

        def swap(eng):
            marks.append(time.perf_counter())
            old = eng.weight_version
            self._detach(eng)
            named, flat = update.take()
            eng.load_flat(*flat) if flat is not None else eng.load_weights(named)  # then a KV flush
            marks.append(time.perf_counter())
            del named, flat  # the last references: CUDA IPC memory is closed here, before we answer
            marks.append(time.perf_counter())
            if not partial:
                eng.weight_version = _next_version(old, given)
            return eng.weight_version

        version = await self.worker.update(swap, abort_first)
        start, copied, released = marks
        timings.update(wait=_ms(submitted, start), copy=_ms(start, copied), release=_ms(copied, released),
                       answer=_ms(released), total=_ms(t0))
        return json_response({
            "success": True, "fast_path": update.fast, "timings_ms": timings,
            "received_at": request.get("received_at"), "answered_at": time.time(),
            "message": f"Succeeded to update {update.count} tensors from {source}"
                       f"{' with one copy' if update.fast else ''}. Weight version updated to {version}."})

    async def update_from_tensor(self, request):
        t0 = time.perf_counter()
        body = await json_body(request)
        parsed, fmt, payload = time.perf_counter(), body.get("load_format"), body.get("serialized_named_tensors")

        def decode():
            if fmt == "flattened_bucket":
                return self._bucket_update(W.decode_bucket(payload))
            return _Update(named=self._check(W.decode_tensor_payload(payload, fmt)))

        update = await asyncio.to_thread(decode)
        timings = {"parse": _ms(t0, parsed), "decode": _ms(parsed)}
        return await self._apply(request, update, body, "tensor", timings, t0)

    async def update_from_disk(self, request):
        t0 = time.perf_counter()
        body = await json_body(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise W.WeightPayloadError("model_path (a folder of safetensors files) is required")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            raise W.WeightPayloadError(f"load_format {body.get('load_format')!r} is not supported; use safetensors")

        def load():
            named = self._check(W.load_safetensors_folder(path), cast=True)
            missing = sorted(set(self.worker.engine.weight_specs) - {n for n, _ in named})
            if missing:
                raise W.WeightPayloadError(f"the checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")
            return named

        t = time.perf_counter()
        named = await asyncio.to_thread(load)
        return await self._apply(request, _Update(named=named), body, f"disk ({path})", {"decode": _ms(t)}, t0)

    async def update_from_shared(self, request):
        t0 = time.perf_counter()
        body = await json_body(request)
        abort_first, given = self._update_fields(body)
        path, manifest = body.get("path"), body.get("manifest")
        key, views, engine = (path, json.dumps(manifest)), None, self.worker.engine
        if key != self.shared_key:
            views = await asyncio.to_thread(S.map_shared, path, manifest, engine.weight_specs,
                                            lambda name: skip_weight_name(name, engine.model_config))
        # Once mapped, the trainer's weights ARE the parameters (no older copy to go back to): a
        # non-finite one keeps the version where it was.
        bad = await asyncio.to_thread(W.non_finite, views.items() if views else engine.model.named_parameters())
        if bad is not None:
            kept = "the engine keeps its own weights" if views is not None else "weight_version stays"
            raise W.WeightPayloadError(f"{bad} holds NaN or infinite values ({kept})")

        def swap(eng):
            if views is not None:
                params = dict(eng.model.named_parameters())
                for name, view in views.items():
                    params[name].data = view
                eng.flat_params = None  # its private buffer is behind no parameter now: freed
                S.release_free_heap()  # and what the load left on the heap
                self.shared_key = key
            # The trainer wrote the weights in place: caches derived from them (the FP32 lm_head of a
            # bf16 engine) watch the version counter, which another process's writes do not move.
            torch.autograd.graph.increment_version(eng.model.lm_head_weight())
            eng.flush_cache()
            eng.weight_version = _next_version(eng.weight_version, given)
            return eng.weight_version

        version = await self.worker.update(swap, abort_first)
        return json_response({
            "success": True, "attached": views is not None, "bytes_copied": 0, "timings_ms": {"total": _ms(t0)},
            "message": f"Serving the trainer's shared weights ({path}){' (mapped now)' if views is not None else ''}. "
                       f"Weight version updated to {version}."})

    async def release_memory(self, request):
        body = await json_body(request, default={})
        tags = body.get("tags") or ["kv_cache", "weights"]
        if not (isinstance(tags, list) and set(tags) <= {"kv_cache", "weights"}):
            raise RequestError('tags must be a list of "kv_cache" and "weights"')
        if self.worker.engine.device.type != "cpu":
            raise W.WeightPayloadError(f"it frees CPU memory only; this engine runs on {self.worker.engine.device}")
        if "kv_cache" not in tags:
            return weight_answer(True, "Nothing released: weights stay resident (shared with the trainer, or ours)")

        def release(eng):
            if any(eng.blocks.ref_count):  # runs at once while paused: requests paused in place keep their KV
                raise W.WeightPayloadError("requests paused in place hold KV blocks; continue them first "
                                           "(or pause with mode retract)")
            eng.flush_cache()  # every cached prefix is forgotten before its pages are
            return eng.kv.drop_pages()

        freed = await self.worker.update(release, False)  # once nothing runs
        return weight_answer(True, f"Released the KV cache's memory ({freed / 2**20:.0f} MiB); weights stay resident")

    async def resume_memory(self, request):
        await json_body(request, default={})
        return weight_answer(True, "Nothing to resume: released KV pages come back as generation uses them")

    async def init_group(self, request):
        body = await json_body(request)
        addr, port, rank, world = (body.get(k) for k in ("master_address", "master_port", "rank_offset", "world_size"))
        name, backend = body.get("group_name") or DEFAULT_GROUP_NAME, body.get("backend") or "nccl"
        if not (isinstance(addr, str) and all(isinstance(x, int) and not isinstance(x, bool) for x in (port, rank, world))
                and 1 <= rank < world):
            raise W.WeightPayloadError("need master_address (str), master_port, rank_offset >= 1, "
                                       "world_size > rank_offset")
        if backend not in ("gloo", "nccl"):
            raise W.WeightPayloadError(f"backend must be gloo or nccl, got {backend!r}")
        if backend == "nccl" and self.worker.engine.device.type != "cuda":
            raise W.WeightPayloadError("backend nccl needs a CUDA engine; this engine runs on CPU: use gloo")
        if name in self.groups or self.forming is not None:
            raise W.WeightPayloadError(f"group {name!r} already exists; destroy it first" if name in self.groups else
                                       f"group {self.forming!r} is being formed; one rendezvous at a time")

        def init():
            if backend == "nccl":
                torch.cuda.set_device(self.worker.engine.device)
            return G.init_weight_update_group(addr, port, rank, world, name, backend, self.dist_timeout_s,
                                              connect_timeout_s=self.connect_timeout_s)

        self.forming = name
        try:
            self.groups[name] = await asyncio.to_thread(init)
        except TimeoutError as e:
            raise W.WeightPayloadError(f"{name!r}: {e} (config key dist_connect_timeout)") from None
        except Exception as e:
            raise W.WeightPayloadError(f"{name!r}: {type(e).__name__}: {e}") from None
        finally:
            self.forming = None
        self.group_locks[name] = asyncio.Lock()
        return weight_answer(True, f"Succeeded to initialize custom process group {name!r} "
                                   f"({backend}, rank {rank} of {world}).")

    async def update_from_distributed(self, request):
        t0 = time.perf_counter()
        body = await json_body(request)
        parsed = time.perf_counter()
        name, fmt = body.get("group_name") or DEFAULT_GROUP_NAME, body.get("load_format")
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if name not in self.groups:
            raise W.WeightPayloadError(f"no weight update group {name!r}; call /init_weights_update_group first")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes) and names):
            raise W.WeightPayloadError("names, dtypes and shapes must be non-empty lists of one length")
        if fmt not in (None, "flattened_bucket"):
            raise W.WeightPayloadError(f"load_format must be null or 'flattened_bucket', got {fmt!r}")
        bad = [s for s in shapes if not (isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s))]
        if bad:
            raise W.WeightPayloadError(f"bad shape {bad[0]!r}")
        dtypes = [W.parse_dtype(d) for d in dtypes]
        # Receive first, even into a mismatching announcement, so the broadcast completes and the group
        # stays in step; then check, then swap. The lock is held until the swap is done: a flattened
        # bucket lands in the group's persistent buffer, which the next broadcast overwrites.
        async with self.group_locks[name]:
            try:
                update = await asyncio.to_thread(self._receive, name, names, dtypes, shapes, fmt)
            except W.WeightPayloadError:  # received, but it does not fit the model: the group is fine
                raise
            except Exception as e:
                # A broken collective leaves the group in an unknown state: drop it (its teardown may
                # block until its own timeout, so in a daemon thread) and make the trainer re-init.
                pg = self.groups.pop(name)
                self.recv_buffers.pop(name, None)
                threading.Thread(target=G.destroy_weight_update_group, args=(pg,), daemon=True).start()
                raise W.WeightPayloadError(f"receiving over {name!r}: {type(e).__name__}: {e}; the group was "
                                           "dropped, call /init_weights_update_group again") from None
            timings = {"parse": _ms(t0, parsed), "receive": _ms(parsed)}
            return await self._apply(request, update, body, f"distributed group {name!r}", timings, t0)

    def _receive(self, name, names, dtypes, shapes, fmt):
        device, pg = self.worker.engine.device, self.groups[name]
        if device.type == "cuda":
            torch.cuda.set_device(device)  # this pool thread's current device is what NCCL uses
        if fmt != "flattened_bucket":
            return _Update(named=self._check(G.receive_weights(pg, names, dtypes, shapes, device, self.dist_timeout_s)))
        metadata = W.bucket_metadata(names, dtypes, shapes)
        nbytes = metadata[-1].end_idx
        if name not in self.recv_buffers or self.recv_buffers[name].numel() < nbytes:  # one per group, grown
            self.recv_buffers.pop(name, None)  # free the smaller one first
            self.recv_buffers[name] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._bucket_update(G.receive_bucket(pg, metadata, self.recv_buffers[name], self.dist_timeout_s))

    async def destroy_group(self, request):
        name = (await json_body(request, default={})).get("group_name") or DEFAULT_GROUP_NAME
        pg = self.groups.pop(name, None)
        if pg is None:
            raise W.WeightPayloadError(f"no weight update group {name!r}")
        self.group_locks.pop(name, None)
        self.recv_buffers.pop(name, None)
        try:
            await asyncio.to_thread(G.destroy_weight_update_group, pg)
        except Exception as e:
            raise W.WeightPayloadError(f"{name!r}: {type(e).__name__}: {e}") from None
        return weight_answer(True, f"Succeeded to destroy custom process group {name!r}.")

    async def weights_checksum(self, request):
        names = (await json_body(request, default={}) if request.method == "POST" else {}).get("names")
        if names is not None:
            if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
                raise RequestError("names must be a list of parameter names")
            unknown = [n for n in names if n not in self.worker.engine.weight_specs]
            if unknown:
                raise RequestError(f"unknown parameter names: {unknown[:5]}")
        version, sums = await self.worker.call(
            lambda eng: (eng.weight_version, W.checksums(eng.model.named_parameters(), names)))
        return json_response({"weight_version": version, "dtype": dtype_name(self.worker.engine.dtype),
                              "algorithm": "sha256", "checksums": sums})
