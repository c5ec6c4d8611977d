"""`nano-miles serve`: the engine behind SGLang's HTTP protocol (aiohttp).

Threads: the aiohttp event loop parses requests and answers them; ONE engine thread owns the Engine
and loops step(). Handlers talk to it through a queue of commands and await futures that the engine
thread resolves with loop.call_soon_threadsafe. Weight updates, cache flushes and checksums run ON the
engine thread between two steps, so the engine is never touched by two threads.

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

Errors: /generate and control routes answer 400 with {"error": {"message": ...}}; weight routes
answer {"success": false, "message": ...} with 400, both as SGLang does.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import threading
import time
import traceback
import uuid

from aiohttp import web

from nano_miles.engine import weights as W
from nano_miles.engine.protocol import RequestError, parse_generate
from nano_miles.engine.worker import EngineWorker

PAUSE_MODES = ("abort", "retract", "in_place")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="model name (see prepare-model), HF folder or hub id")
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="0 picks a free port (printed in the ready line)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--mem-fraction-static", type=float, default=0.85,
                   help="share of the GPU's free memory for the KV cache (SGLang's name; ignored on CPU)")
    p.add_argument("--no-cuda-graph", action="store_true", help="run decode eagerly on GPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads of the engine thread (default: torch's); 1 is far faster for small "
                        "models on a busy machine")
    p.add_argument("--weight-version", default="0", help="initial weight_version")
    p.add_argument("--dist-timeout", type=float, default=300.0,
                   help="seconds before a weight-update group rendezvous or broadcast gives up")


# ----------------------------------------------------------------------------- HTTP


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


def _weight_answer(success: bool, message: str) -> web.Response:
    return web.json_response({"success": success, "message": message}, status=200 if success else 400)


async def _json_body(request: web.Request, default=None):
    raw = await request.read()
    if not raw.strip():
        if default is not None:
            return default
        raise RequestError("the request body is empty; send a JSON object")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"invalid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    return body


def _next_version(current: str, given) -> str:
    if given is not None:
        return str(given)
    return str(int(current) + 1) if current.isdigit() else f"{current}+1"


class Server:
    def __init__(self, args, model_path):
        self.args = args
        self.model_path = str(model_path)
        self.groups: dict = {}  # group_name -> process group
        self.group_locks: dict = {}
        self.recv_buffers: dict = {}  # group_name -> persistent uint8 buffer its broadcasts land in
        self.started = time.time()

    # --- setup ---
    def make_engine(self):
        from nano_miles.engine.engine import Engine, EngineConfig

        a = self.args
        if a.threads:
            import torch
            torch.set_num_threads(a.threads)  # called from the engine thread, which runs every forward
        eng = Engine(EngineConfig(model=self.model_path, device=a.device, dtype=a.dtype,
                                  max_running_requests=a.max_running_requests, max_model_len=a.max_model_len,
                                  num_kv_blocks=a.num_kv_blocks, kv_cache_memory_fraction=a.mem_fraction_static,
                                  cuda_graph=not a.no_cuda_graph, seed=a.seed))
        eng.weight_version = str(a.weight_version)
        self.expected = {n: (tuple(p.shape), p.dtype) for n, p in eng.named_parameters()}
        return eng

    def app(self, loop) -> web.Application:
        self.worker = EngineWorker(self.make_engine, loop)
        app = web.Application(client_max_size=1 << 30, middlewares=[self._errors])
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_put("/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        for path in ("/model_info", "/get_model_info"):
            r.add_get(path, self.model_info)
        r.add_get("/get_weight_version", self.weight_version)
        r.add_get("/get_server_info", self.server_info)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/abort_request", self.abort_request)
        r.add_post("/update_weights_from_tensor", self.update_from_tensor)
        r.add_post("/update_weights_from_disk", self.update_from_disk)
        r.add_post("/init_weights_update_group", self.init_group)
        r.add_post("/update_weights_from_distributed", self.update_from_distributed)
        r.add_post("/destroy_weights_update_group", self.destroy_group)
        r.add_route("*", "/weights_checksum", self.weights_checksum)
        return app

    @web.middleware
    async def _errors(self, request, handler):
        if request.path not in ("/health", "/health_generate") and not self.worker.loaded.is_set():
            return _error("the model is still loading", 503)
        if self.worker.error is not None and request.path != "/health":
            return _error(f"the engine failed to start: {self.worker.error}", 503)
        try:
            return await handler(request)
        except RequestError as e:
            return _error(str(e))
        except web.HTTPException:
            raise
        except Exception as e:  # a bug: say so, keep serving
            traceback.print_exc()
            return _error(f"internal error: {type(e).__name__}: {e}", 500)

    @property
    def engine(self):
        return self.worker.engine

    # --- generation ---
    async def generate(self, request):
        body = await _json_body(request)
        items, batched = parse_generate(body, self.engine.vocab_size, self.engine.max_model_len)
        futs = self.worker.add(items)
        try:
            results = await asyncio.gather(*futs)
        except asyncio.CancelledError:  # the client went away: free the engine
            for it in items:
                self.worker.abort(it.rid, "client disconnected")
            raise
        out = [self._response(it, fin, version) for it, (fin, version) in zip(items, results)]
        return web.json_response(out if batched else out[0])

    def _response(self, item, fin, version) -> dict:
        ids = fin.output_ids
        text_ids = ids
        if fin.finish_reason.get("type") == "stop" and not item.no_stop_trim and ids:
            text_ids = ids[:-1]  # SGLang trims the matched stop token from text only
        tok = self.engine.tokenizer
        text = ""
        if tok is not None and text_ids:
            try:
                text = tok.decode(text_ids, skip_special_tokens=item.skip_special_tokens,
                                  spaces_between_special_tokens=item.spaces_between_special_tokens)
            except TypeError:  # a tokenizer class without that option
                text = tok.decode(text_ids, skip_special_tokens=item.skip_special_tokens)
        meta = {
            "id": fin.rid,
            "finish_reason": fin.finish_reason,
            "prompt_tokens": fin.prompt_tokens,
            "completion_tokens": fin.completion_tokens,
            "cached_tokens": fin.cached_tokens,
            "weight_version": version,
        }
        if item.return_logprob:
            lps = fin.output_logprobs or []
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids)]
        return {"text": text, "output_ids": list(ids), "meta_info": meta}

    # --- health and info ---
    async def health(self, request):
        if not self.worker.loaded.is_set() or self.worker.error is not None:
            return web.Response(status=503, text="loading" if self.worker.error is None else self.worker.error)
        return web.Response(status=200)

    async def health_generate(self, request):
        if not self.worker.loaded.is_set() or self.worker.error is not None:
            return web.Response(status=503)
        if self.worker.paused:
            return web.Response(status=200)  # alive; generating would wait for continue_generation
        items, _ = parse_generate({"input_ids": [0], "rid": f"HEALTH_CHECK_{uuid.uuid4().hex}",
                                   "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
                                  self.engine.vocab_size, self.engine.max_model_len)
        try:
            await asyncio.wait_for(self.worker.add(items)[0], timeout=20)
        except asyncio.TimeoutError:
            self.worker.abort(items[0].rid)
            return web.Response(status=503)
        return web.Response(status=200)

    def _info(self) -> dict:
        eng = self.engine
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path,
            "is_generation": True,
            "served_model_name": self.args.model,
            "weight_version": eng.weight_version,
            "device": str(eng.device),
            "dtype": str(eng.dtype).removeprefix("torch."),
            "max_model_len": eng.max_model_len,
            "vocab_size": eng.vocab_size,
            "eos_token_ids": list(eng.eos_token_ids),
        }

    async def model_info(self, request):
        return web.json_response(self._info())

    async def weight_version(self, request):
        return web.json_response({"weight_version": self.engine.weight_version})

    async def server_info(self, request):
        def state(eng):
            return {"running": len(eng.scheduler.running), "waiting": len(eng.scheduler.waiting),
                    "paused": self.worker.paused, "pause_mode": self.worker.pause_mode,
                    "num_kv_blocks": eng.num_kv_blocks, "block_size": eng.config.block_size}

        internal = await self.worker.call(state)
        args = {k: v for k, v in vars(self.args).items() if k != "func" and not callable(v)}
        return web.json_response({**args, **self._info(), "max_total_num_tokens": internal["num_kv_blocks"] *
                                  internal["block_size"], "internal_states": [internal],
                                  "version": "nano-miles", "uptime_s": round(time.time() - self.started, 1)})

    # --- control ---
    async def flush_cache(self, request):
        def flush(eng):
            if eng.has_unfinished() or self.worker.parked:
                return False
            eng.flush_cache()
            return True

        ok = await self.worker.call(flush)
        if not ok:
            return _error("cannot flush the cache while requests are running or waiting", 400)
        return web.json_response({"success": True, "message": "Cache flushed."})

    async def pause_generation(self, request):
        body = await _json_body(request, default={})
        mode = body.get("mode", "abort") or "abort"
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        n = await self.worker.pause(mode)
        return web.json_response({"message": "Generation paused successfully.", "status": "ok",
                                  "mode": mode, "num_aborted": n})

    async def continue_generation(self, request):
        await self.worker.resume()
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request):
        body = await _json_body(request, default={})
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            raise RequestError("rid must be a string and abort_all a boolean")
        if not abort_all and not rid:
            raise RequestError("give a rid, or abort_all=true")
        n = await self.worker.abort(None if abort_all else rid)
        return web.json_response({"success": True, "message": f"aborted {n} request(s)", "num_aborted": n})

    # --- weights ---
    async def _apply(self, update: "_Update", body, source: str, timings: dict, t0: float) -> web.Response:
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

        swapped = [0.0]
        version = await self.worker.update(swap, abort_first)
        now = time.perf_counter()
        timings["answer"] = (now - swapped[0]) * 1000  # engine thread -> event loop
        timings["total"] = (now - t0) * 1000
        return web.json_response({
            "success": True, "fast_path": update.fast,
            "message": f"Succeeded to update {update.count} tensors from {source}"
                       f"{' with one copy' if update.fast else ''}. Weight version updated to {version}.",
            "timings_ms": {k: round(v, 3) for k, v in timings.items()}})

    def _check(self, named, cast: bool = False):
        from nano_miles.engine.model import skip_weight_name

        named = [(n, t) for n, t in named if not skip_weight_name(n, self.engine.model_config)]
        if cast:  # checkpoints on disk may be stored in another float dtype: cast to the engine's
            named = [(n, t.to(self.expected[n][1]) if n in self.expected and t.is_floating_point() else t)
                     for n, t in named]
        W.check_against(named, self.expected)
        return named

    def _bucket_update(self, bucket: W.FlattenedTensorBucket) -> "_Update":
        """One copy if the bucket reproduces a run of the packed parameters byte for byte (names,
        order, shapes, dtype, offsets: see flat_params.py), else the validated per-tensor path."""
        flat = self.engine.flat_params
        span = flat.match(bucket.metadata) if flat is not None else None
        if span is not None and bucket.flattened_tensor.numel() == span[1] - span[0]:
            return _Update(flat=(span[0], bucket.flattened_tensor), count=len(bucket.metadata))
        return _Update(named=self._check(bucket.reconstruct_tensors()))

    async def update_from_tensor(self, request):
        t0 = time.perf_counter()
        body = await _json_body(request)
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
            return _weight_answer(False, f"Failed to update weights from tensor: {e}")
        timings = {"parse": (parsed - t0) * 1000, "decode": (time.perf_counter() - t) * 1000}
        return await self._apply(update, body, "tensor", timings, t0)

    async def update_from_disk(self, request):
        t0 = time.perf_counter()
        body = await _json_body(request)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            return _weight_answer(False, "model_path (a folder of safetensors files) is required")
        if body.get("load_format") not in (None, "auto", "safetensors"):
            return _weight_answer(False, f"load_format {body.get('load_format')!r} is not supported; use safetensors")

        def load():
            named = self._check(W.load_safetensors_folder(path), cast=True)
            missing = sorted(set(self.expected) - {n for n, _ in named})
            if missing:
                raise W.WeightPayloadError(f"the checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")
            return named

        try:
            t = time.perf_counter()
            named = await asyncio.to_thread(load)
        except W.WeightPayloadError as e:
            return _weight_answer(False, f"Failed to update weights from disk: {e}")
        timings = {"decode": (time.perf_counter() - t) * 1000}
        return await self._apply(_Update(named=named), body, f"disk ({path})", timings, t0)

    async def init_group(self, request):
        body = await _json_body(request)
        try:
            addr, port = body["master_address"], body["master_port"]
            rank, world = body["rank_offset"], body["world_size"]
        except KeyError as e:
            return _weight_answer(False, f"missing field {e.args[0]}")
        name = body.get("group_name") or W.DEFAULT_GROUP_NAME
        backend = body.get("backend") or "nccl"
        if not (isinstance(addr, str) and all(isinstance(x, int) and not isinstance(x, bool) for x in (port, rank, world))
                and 1 <= rank < world):
            return _weight_answer(False, "need master_address (str), master_port, rank_offset >= 1, world_size > rank_offset")
        if backend not in ("gloo", "nccl"):
            return _weight_answer(False, f"backend must be gloo or nccl, got {backend!r}")
        if backend == "nccl" and self.engine.device.type != "cuda":
            return _weight_answer(False, "backend nccl needs a CUDA engine; this engine runs on CPU: use gloo")
        if name in self.groups:
            return _weight_answer(False, f"group {name!r} already exists; destroy it first")

        def init():
            if backend == "nccl":
                import torch
                torch.cuda.set_device(self.engine.device)
            return W.init_weight_update_group(addr, port, rank, world, name, backend, self.args.dist_timeout)

        try:
            self.groups[name] = await asyncio.to_thread(init)
        except Exception as e:
            return _weight_answer(False, f"Failed to init group {name!r}: {type(e).__name__}: {e}")
        self.group_locks[name] = asyncio.Lock()
        return _weight_answer(True, f"Succeeded to initialize custom process group {name!r} "
                                    f"({backend}, rank {rank} of {world}).")

    async def update_from_distributed(self, request):
        t0 = time.perf_counter()
        body = await _json_body(request)
        parsed = time.perf_counter()
        name = body.get("group_name") or W.DEFAULT_GROUP_NAME
        if name not in self.groups:
            return _weight_answer(False, f"no weight update group {name!r}; call /init_weights_update_group first")
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
            return _weight_answer(False, f"Failed to update weights from distributed: {e}")
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
                threading.Thread(target=W.destroy_weight_update_group, args=(pg,), daemon=True).start()
                return _weight_answer(False, f"Failed to receive weights over {name!r}: {type(e).__name__}: {e}; "
                                             "the group was dropped, call /init_weights_update_group again")
            if error is not None:
                return _weight_answer(False, f"Failed to update weights from distributed: {error}")
            timings = {"parse": (parsed - t0) * 1000, "receive": (time.perf_counter() - t) * 1000}
            return await self._apply(update, body, f"distributed group {name!r}", timings, t0)

    def _receive(self, name, names, dtypes, shapes, fmt):
        """(update, None) or, for a received payload that does not fit the model, (None, error)."""
        import torch

        device, pg = self.engine.device, self.groups[name]
        if device.type == "cuda":
            torch.cuda.set_device(device)  # this pool thread's current device is what NCCL uses
        if fmt != "flattened_bucket":
            received = W.receive_weights(pg, names, dtypes, shapes, fmt, device, self.args.dist_timeout)
            try:
                return _Update(named=self._check(received)), None
            except W.WeightPayloadError as e:
                return None, e
        nbytes = sum(torch.Size(s).numel() * d.itemsize for d, s in zip(dtypes, shapes))
        buffer = self.recv_buffers.get(name)
        if buffer is None or buffer.numel() < nbytes:  # allocated once per group (grown if needed)
            self.recv_buffers[name] = buffer = None  # free the smaller one first
            self.recv_buffers[name] = buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        bucket = W.receive_bucket(pg, names, dtypes, shapes, device, self.args.dist_timeout, buffer=buffer)
        try:
            return self._bucket_update(bucket), None
        except W.WeightPayloadError as e:
            return None, e

    async def destroy_group(self, request):
        body = await _json_body(request, default={})
        name = body.get("group_name") or W.DEFAULT_GROUP_NAME
        pg = self.groups.pop(name, None)
        if pg is None:
            return _weight_answer(False, f"no weight update group {name!r}")
        self.group_locks.pop(name, None)
        self.recv_buffers.pop(name, None)
        try:
            await asyncio.to_thread(W.destroy_weight_update_group, pg)
        except Exception as e:
            return _weight_answer(False, f"Failed to destroy group {name!r}: {type(e).__name__}: {e}")
        return _weight_answer(True, f"Succeeded to destroy custom process group {name!r}.")

    async def weights_checksum(self, request):
        body = await _json_body(request, default={}) if request.method == "POST" else {}
        names = body.get("names")
        if names is not None:
            if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
                raise RequestError("names must be a list of parameter names")
            unknown = [n for n in names if n not in self.expected]
            if unknown:
                raise RequestError(f"unknown parameter names: {unknown[:5]}")

        def compute(eng):
            return eng.weight_version, W.checksums(eng.named_parameters(), names)

        version, sums = await self.worker.call(compute)
        return web.json_response({"weight_version": version, "dtype": str(self.engine.dtype).removeprefix("torch."),
                                  "algorithm": "sha256", "checksums": sums})


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


# ----------------------------------------------------------------------------- main


async def _serve(args, model_path) -> int:
    loop = asyncio.get_running_loop()
    server = Server(args, model_path)
    app = server.app(loop)
    try:  # a client that disconnects cancels its handler, which aborts its requests (aiohttp >= 3.9)
        runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=5)
    except TypeError:
        runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = runner.addresses[0][1]
    server.worker.thread.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await asyncio.to_thread(server.worker.loaded.wait)
    rc = 0
    if server.worker.error is not None:
        print(f"nano-miles serve: the engine failed to start: {server.worker.error}", file=sys.stderr, flush=True)
        rc = 1
    else:
        eng = server.engine
        print(f"nano-miles serve: ready on http://{args.host}:{port} (model {model_path}, {eng.device}, "
              f"{str(eng.dtype).removeprefix('torch.')}, weight_version {eng.weight_version})", flush=True)
        await stop.wait()
        await server.worker.abort(None, "the server is shutting down")  # lets open /generate calls answer
    server.worker.stop()
    await runner.cleanup()
    # Exit now: a weight-sync thread may still sit in a broadcast until its timeout, and the
    # interpreter (and asyncio.run) would wait for it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def run(args) -> int:
    from nano_miles.models import resolve_model

    try:
        model_path = resolve_model(args.model)
    except Exception as e:
        print(f"nano-miles serve: {e}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(args, model_path))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="nano-miles serve")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
