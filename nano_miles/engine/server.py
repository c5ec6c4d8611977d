"""`nano-miles serve`: the engine behind SGLang's HTTP protocol (aiohttp).

The event loop parses requests and answers them; ONE engine thread owns the Engine (worker.py).
Weight routes live in weight_receiver.py, the OpenAI-compatible ones in openai_api.py, request
bodies and answers in http_io.py. With an api key, every route but /health needs
"Authorization: Bearer KEY".
"""
from __future__ import annotations

import argparse
import asyncio
import errno
import hmac
import ipaddress
import os
import signal
import sys
import time
import traceback
import uuid
from dataclasses import dataclass, field, replace

import torch
from aiohttp import web

from nano_miles.config import add_config_arguments, config_from_args, to_dict, to_toml
from nano_miles.dtypes import dtype_name
from nano_miles.engine.engine import Engine, EngineConfig
from nano_miles.engine.http_io import (MiB, BodyParser, check_length, error, is_large, json_body,
                                      json_response, release)
from nano_miles.engine.openai_api import OpenAIRoutes
from nano_miles.engine.protocol import API_KEY_ENV, RequestError, parse_generate
from nano_miles.engine.weight_receiver import LARGE_BODY_ROUTES, WeightReceiver
from nano_miles.engine.worker import EngineWorker
from nano_miles.models.prepare import resolve_model

PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's pause_generation modes


@dataclass
class ServerConfig:
    """The keys of `nano-miles serve` (docs/config.md); the engine's own knobs are engine.*."""
    host: str = "127.0.0.1"           # address to listen on; any but a loopback one needs api_key (or allow_unauthenticated)
    port: int = 30000                 # port to listen on; 0 picks a free one (printed in the ready line)
    served_model_name: str = ""       # the model's name in /model_info and /v1/models; "" = engine.model as given
    api_key: str = ""                 # every route but /health needs "Authorization: Bearer KEY"; "" = $NANO_MILES_API_KEY, else none
    allow_unauthenticated: bool = False  # let a server on a non-loopback host run without an api_key
    threads: int | None = None        # torch CPU threads of the engine thread; none = torch's (1 is far faster for small models on a busy machine)
    weight_version: str = "0"         # the weight_version served before the first update
    dist_timeout: float = 300.0       # seconds before a weight-update broadcast (or torch's own rendezvous) gives up
    dist_connect_timeout: float = 60.0  # seconds to reach the trainer's rendezvous and form a weight-update group
    max_body_mb: float = 64.0         # largest request body (MiB) of every route but the weight routes (413 beyond)
    max_weight_body_mb: float = 1024.0  # largest request body (MiB) of the weight-update routes
    engine: EngineConfig = field(default_factory=EngineConfig)

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if not (self.dist_timeout > 0 and self.dist_connect_timeout > 0):
            raise ValueError("dist_timeout and dist_connect_timeout must be > 0")
        if not (self.max_body_mb > 0 and self.max_weight_body_mb > 0):
            raise ValueError("max_body_mb and max_weight_body_mb must be > 0")


CONFIG = ServerConfig
# SGLang's flags and our older ones: each sets the key it names (one name and one default per knob).
FLAGS = {"--model": "engine.model", "--model-path": "engine.model", "--device": "engine.device",
         "--dtype": "engine.dtype", "--host": "host", "--port": "port",
         "--max-running-requests": "engine.max_running_requests", "--max-model-len": "engine.max_model_len",
         "--context-length": "engine.max_model_len", "--num-kv-blocks": "engine.num_kv_blocks",
         "--mem-fraction-static": "engine.kv_cache_memory_fraction", "--seed": "engine.seed",
         "--random-seed": "engine.seed", "--served-model-name": "served_model_name", "--threads": "threads",
         "--weight-version": "weight_version", "--dist-timeout": "dist_timeout", "--api-key": "api_key",
         "--num-continuous-decode-steps": "engine.num_continuous_decode_steps"}
SWITCHES = {"--no-cuda-graph": ("engine.cuda_graph", "false"), "--disable-cuda-graph": ("engine.cuda_graph", "false"),
            "--allow-unauthenticated": ("allow_unauthenticated", "true"),
            "--true-on-policy": ("engine.true_on_policy", "true"),
            "--enable-torch-compile": ("engine.enable_torch_compile", "true"),
            # SGLang's flag for it in either of its versions (opt-in, then on by default)
            "--enable-overlap-schedule": ("engine.overlap_schedule", "true"),
            "--disable-overlap-schedule": ("engine.overlap_schedule", "false")}
UNAUTHENTICATED_ROUTES = ("/health",)  # a load balancer's probe; it reveals nothing and costs nothing


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_arguments(p, ServerConfig, FLAGS, switches=SWITCHES)


class Server:
    def __init__(self, cfg: ServerConfig, model_path, api_key: str = ""):
        self.cfg, self.model_path = cfg, str(model_path)
        self.authorization = f"Bearer {api_key}".encode() if api_key else None
        self.model_name = cfg.served_model_name or cfg.engine.model
        self.started = time.time()

    def make_engine(self) -> Engine:
        if self.cfg.threads:
            torch.set_num_threads(self.cfg.threads)  # called from the engine thread, which runs every forward
        eng = Engine(replace(self.cfg.engine, model=self.model_path))
        eng.weight_version = self.cfg.weight_version
        return eng

    def app(self, loop) -> web.Application:
        self.worker = EngineWorker(self.make_engine, loop)
        app = web.Application(client_max_size=int(self.cfg.max_weight_body_mb * MiB), middlewares=[self._errors])
        app["body_parser"] = self.body_parser = BodyParser()
        r = app.router
        r.add_route("POST", "/generate", self.generate)
        r.add_route("PUT", "/generate", self.generate)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health_generate)
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/get_weight_version", self.weight_version)
        r.add_get("/get_server_info", self.server_info)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/abort_request", self.abort_request)
        WeightReceiver(self.worker, self.cfg.dist_timeout, self.cfg.dist_connect_timeout).add_routes(r)
        OpenAIRoutes(self.worker, self.model_name, self.started).add_routes(r)
        return app

    @web.middleware
    async def _errors(self, request, handler):
        request["received_at"] = time.time()  # wall clock: weight answers report it (weight_sync splits its send)
        if self.authorization is not None and request.path not in UNAUTHENTICATED_ROUTES and not hmac.compare_digest(
                request.headers.get("Authorization", "").encode(errors="surrogateescape"), self.authorization):
            return error("unauthorized: this server needs the header 'Authorization: Bearer <api key>'", 401)
        if request.path != "/health" and not self.worker.loaded.is_set():
            return error("the model is still loading", 503)
        if self.worker.error is not None and request.path != "/health":
            return error(f"the engine failed to start: {self.worker.error}", 503)
        large = request.path in LARGE_BODY_ROUTES
        request["body_limit"] = (int((self.cfg.max_weight_body_mb if large else self.cfg.max_body_mb) * MiB),
                                 "max_weight_body_mb" if large else "max_body_mb")
        try:
            check_length(request, *request["body_limit"])  # before the handler: it may not read the body
            return await handler(request)
        except RequestError as e:
            return error(str(e), e.status)
        except web.HTTPException:
            raise
        except Exception as e:  # a bug: say so, keep serving
            traceback.print_exc()
            return error(f"internal error: {type(e).__name__}: {e}", 500)

    async def generate(self, request):
        body = await json_body(request)
        try:
            args = (body, self.worker.engine.vocab_size, self.worker.engine.max_model_len)
            # A large body's checks walk every token id: in a thread, so the event loop keeps answering.
            items, batched = await asyncio.to_thread(parse_generate, *args) if is_large(request) else parse_generate(*args)
            if self.worker.engine.tokenizer is None and any(it.sampling.stop for it in items):
                raise RequestError("stop strings need a tokenizer and this model folder has none: use stop_token_ids")
            results = await self.worker.run(items)
            out = [self._response(it, *result) for it, result in zip(items, results)]
            return json_response(out if batched else out[0])
        finally:
            await release(request, body)

    def _response(self, item, fin, version, oldest_version) -> dict:
        ids = text_ids = fin.output_ids
        matched = fin.finish_reason.get("matched") if fin.finish_reason.get("type") == "stop" else None
        if isinstance(matched, int) and not item.no_stop_trim and ids:
            text_ids = ids[:-1]  # SGLang trims the matched stop token from text only
        tok, text = self.worker.engine.tokenizer, ""
        if tok is not None and text_ids:
            text = tok.decode(text_ids, skip_special_tokens=item.skip_special_tokens,
                              spaces_between_special_tokens=item.spaces_between_special_tokens)
        if isinstance(matched, str) and not item.no_stop_trim and matched in text:
            text = text[:text.index(matched)]  # a stop string is cut from the text with what follows it
        meta = {"id": fin.rid, "finish_reason": fin.finish_reason, "prompt_tokens": fin.prompt_tokens,
                "completion_tokens": fin.completion_tokens, "cached_tokens": fin.cached_tokens,
                "weight_version": version,
                "oldest_weight_version": oldest_version,  # ours: the weights its first tokens were sampled with
                "busy_s": dict(self.worker.engine.busy_s)}  # ours: the engine's step seconds per phase since it started
        if item.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(fin.output_logprobs or [], ids)]
        return {"text": text, "output_ids": list(ids), "meta_info": meta}

    async def health(self, request):
        if not self.worker.loaded.is_set() or self.worker.error is not None:
            return web.Response(status=503, text="loading" if self.worker.error is None else self.worker.error)
        return web.Response(status=200)

    async def health_generate(self, request):  # the middleware answered 503 while loading or failed
        if self.worker.paused:
            return web.Response(status=200)  # alive; generating would wait for continue_generation
        items, _ = parse_generate({"input_ids": [0], "rid": f"HEALTH_CHECK_{uuid.uuid4().hex}",
                                   "sampling_params": {"max_new_tokens": 1, "temperature": 0}},
                                  self.worker.engine.vocab_size, self.worker.engine.max_model_len)
        try:
            await asyncio.wait_for(self.worker.add(items)[0], timeout=20)
        except asyncio.TimeoutError:
            self.worker.abort(items[0].rid)
            return web.Response(status=503)
        return web.Response(status=200)

    def _info(self) -> dict:
        eng = self.worker.engine
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                "served_model_name": self.model_name, "weight_version": eng.weight_version, "device": str(eng.device),
                "dtype": dtype_name(eng.dtype), "max_model_len": eng.max_model_len, "vocab_size": eng.vocab_size,
                "eos_token_ids": list(eng.eos_token_ids)}

    async def model_info(self, request):
        return json_response(self._info())

    async def weight_version(self, request):
        return json_response({"weight_version": self.worker.engine.weight_version})

    async def server_info(self, request):
        state = await self.worker.call(lambda eng: {
            "running": len(eng.scheduler.running), "waiting": len(eng.scheduler.waiting),
            "parked": sum(len(batch) for batch in self.worker.parked),  # held by a pause, not yet admitted
            "paused": self.worker.paused, "pause_mode": self.worker.pause_mode,
            "num_kv_blocks": eng.num_kv_blocks, "block_size": eng.config.block_size})
        keys = to_dict(self.cfg)  # flat, as SGLang's server_args: the engine's keys beside the server's
        keys.pop("api_key")
        args = {**{k: v for k, v in keys.items() if not isinstance(v, dict)}, **keys["engine"]}
        return json_response({**args, **self._info(), "max_total_num_tokens": state["num_kv_blocks"] *
                              state["block_size"], "internal_states": [state], "version": "nano-miles",
                              "uptime_s": round(time.time() - self.started, 1)})

    async def flush_cache(self, request):
        def flush(eng):
            if eng.has_unfinished() or self.worker.parked:
                return False
            eng.flush_cache()
            return True

        if not await self.worker.call(flush):
            return error("cannot flush the cache while requests are running or waiting", 400)
        return json_response({"success": True, "message": "Cache flushed."})

    async def pause_generation(self, request):
        mode = (await json_body(request, default={})).get("mode") or "abort"
        if mode not in PAUSE_MODES:
            raise RequestError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        n = await self.worker.pause(mode)
        return json_response({"message": "Generation paused successfully.", "status": "ok", "mode": mode,
                              "num_aborted": n})

    async def continue_generation(self, request):
        await self.worker.resume()
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def abort_request(self, request):
        body = await json_body(request, default={})
        rid, abort_all = body.get("rid", ""), body.get("abort_all", False)
        if not isinstance(rid, str) or not isinstance(abort_all, bool):
            raise RequestError("rid must be a string and abort_all a boolean")
        if not abort_all and not rid:
            raise RequestError("give a rid, or abort_all=true")
        n = await self.worker.abort(None if abort_all else rid)
        return json_response({"success": True, "message": f"aborted {n} request(s)", "num_aborted": n})


async def _serve(cfg: ServerConfig, model_path, api_key: str) -> int:
    loop = asyncio.get_running_loop()
    server = Server(cfg, model_path, api_key)
    # a client that disconnects cancels its handler, which aborts its requests
    runner = web.AppRunner(server.app(loop), access_log=None, handler_cancellation=True, shutdown_timeout=5)
    await runner.setup()
    server.body_parser.start()
    try:
        await web.TCPSite(runner, cfg.host, cfg.port).start()
    except OSError as e:
        reason = {errno.EADDRINUSE: "the address is already in use", errno.EACCES: "permission denied",
                  errno.EADDRNOTAVAIL: "the address is not one of this machine's"}.get(e.errno, e.strerror)
        print(f"nano-miles serve: cannot listen on {cfg.host}:{cfg.port}: {reason}", file=sys.stderr)
        await runner.cleanup()
        server.body_parser.close()
        return 1
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
        eng = server.worker.engine
        print(f"nano-miles serve: ready on http://{cfg.host}:{runner.addresses[0][1]} (model {model_path}, "
              f"{eng.device}, {dtype_name(eng.dtype)}, weight_version {eng.weight_version})", flush=True)
        await stop.wait()
        await server.worker.abort(None, "the server is shutting down")  # lets open /generate calls answer
    server.worker.stop()
    await runner.cleanup()
    server.body_parser.close()
    # Exit now: a weight-sync thread may still sit in a broadcast until its timeout, and the
    # interpreter (and asyncio.run) would wait for it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def run(args) -> int:
    cfg = config_from_args(ServerConfig, args)  # a ConfigError is one line (cli.py prints it)
    if args.print_config:
        print(to_toml(cfg), end="")
        return 0
    if not cfg.engine.model:
        print("nano-miles serve: which model? give --model NAME|FOLDER (or --set engine.model=...)", file=sys.stderr)
        return 2
    api_key = cfg.api_key or os.environ.get(API_KEY_ENV, "")
    try:
        loopback = ipaddress.ip_address(cfg.host).is_loopback
    except ValueError:
        loopback = cfg.host == "localhost"
    if not api_key and not loopback and not cfg.allow_unauthenticated:
        print(f"nano-miles serve: --host {cfg.host} lets other machines in: give --api-key KEY (or ${API_KEY_ENV}), "
              "or --allow-unauthenticated if that is really meant", file=sys.stderr)
        return 2
    try:
        model_path = resolve_model(cfg.engine.model)
    except Exception as e:
        print(f"nano-miles serve: {e}", file=sys.stderr)
        return 2
    return asyncio.run(_serve(cfg, model_path, api_key))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="nano-miles serve")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
