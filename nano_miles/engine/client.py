"""Clients of an SGLang-protocol engine (ours or a real SGLang server): EngineClient (blocking,
requests) and AsyncEngineClient (aiohttp, awaited), whose routes are both defined ONCE, in `Routes`.

The api key sent: the one given, else that of the engine this process started at that URL (process.py
remembers it: rollouts and weight sync pass only URLs around), else $NANO_MILES_API_KEY. HTTP 400
raises EngineRequestError with the server's message, other statuses EngineError; no answer (refused,
dropped, timed out) or 503 raises EngineUnavailable: how callers notice a dead engine.
"""
from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass

import aiohttp
import requests

from nano_miles.engine.protocol import API_KEY_ENV, DEFAULT_GROUP_NAME

DEFAULT_TIMEOUT = 600.0
HEALTH_TIMEOUT = 5.0
_launched_keys: dict[str, str] = {}  # url -> api key of an engine this process started


def remember_api_key(url: str, api_key: str | None) -> None:
    """Record (or, with None, forget) the key of the engine this process runs at `url`."""
    if api_key is None:
        _launched_keys.pop(url.rstrip("/"), None)
    else:
        _launched_keys[url.rstrip("/")] = api_key


def auth_headers(url: str, api_key: str | None = None) -> dict:
    key = api_key if api_key is not None else _launched_keys.get(url.rstrip("/")) or os.environ.get(API_KEY_ENV, "")
    return {"Authorization": f"Bearer {key}"} if key else {}


class EngineError(RuntimeError):
    """The engine answered with an error status."""

    def __init__(self, message: str, status: int | None = None, body=None):
        super().__init__(message)
        self.status, self.body = status, body


class EngineRequestError(EngineError):
    """HTTP 400: the request was refused (bad input, a weight payload that does not fit...)."""


class EngineUnavailable(EngineError):
    """No answer: connection refused or dropped, or a timeout."""


@dataclass
class Call:
    """One HTTP call of a route method, whichever client sends it."""
    method: str
    path: str
    body: dict | list | None = None
    timeout: float | None = None  # None: the client's
    probe: bool = False           # answer True/False (is it 200?) instead of raising (health)
    pick: str | None = None       # return only this key of the JSON answer

    def answer(self, status: int | None, text: str):
        """What the route method returns for this answer (status None: none came, text says why), or raises."""
        if self.probe:
            return status == 200
        if status is None:
            raise EngineUnavailable(f"{self.path}: {text}") from None
        try:
            data = json.loads(text) if text else None
        except ValueError:
            data = None
        if status == 200:
            return text if data is None else data[self.pick] if self.pick else data
        message = text.strip() or "(empty body)"
        if isinstance(data, dict):  # ours and SGLang's error shapes; "detail": FastAPI's
            error = data.get("error")
            message = str(error["message"] if isinstance(error, dict) and "message" in error
                          else data.get("message", data.get("detail", message)))
        raise {400: EngineRequestError, 503: EngineUnavailable}.get(status, EngineError)(
            f"{self.path}: HTTP {status}: {message}", status, data)


class Routes:
    """Every route of the engine, once. `_send(call)` is defined by each client."""

    def _post(self, path: str, timeout: float | None = None, /, **body):
        return self._send(Call("POST", path, body, timeout=timeout))

    def generate(self, input_ids, sampling_params=None, rid=None, return_logprob=True, **extra):
        """One request (input_ids: list[int]) -> SGLang's response dict; a batch (list of lists) -> list."""
        body = {"input_ids": input_ids, "sampling_params": sampling_params or {}, "return_logprob": return_logprob}
        return self._send(Call("POST", "/generate", {**body, **({} if rid is None else {"rid": rid}), **extra}))

    def generate_batch(self, batch_input_ids, sampling_params=None, rids=None, return_logprob=True):
        return self.generate(list(batch_input_ids), sampling_params, rids, return_logprob)

    def health(self):
        """True when /health answers 200; False otherwise, also when nothing answers."""
        return self._send(Call("GET", "/health", timeout=HEALTH_TIMEOUT, probe=True))

    def model_info(self):
        return self._send(Call("GET", "/model_info"))

    def server_info(self):
        return self._send(Call("GET", "/get_server_info"))

    def weight_version(self):
        return self._send(Call("GET", "/model_info", pick="weight_version"))

    def pause(self, mode: str = "abort"):
        return self._post("/pause_generation", mode=mode)

    def resume(self):
        return self._post("/continue_generation")

    def abort(self, rid: str = "", abort_all: bool = False):
        return self._post("/abort_request", rid=rid, abort_all=abort_all)

    def flush_cache(self):
        return self._send(Call("POST", "/flush_cache"))

    # Weight routes: each answers {"success", "message", ...}; a refused update raises EngineRequestError.
    def update_weights_from_tensor(self, serialized_named_tensors, load_format=None, weight_version=None,
                                   abort_all_requests=False, flush_cache=True):
        if isinstance(serialized_named_tensors, str):
            serialized_named_tensors = [serialized_named_tensors]
        return self._post("/update_weights_from_tensor", serialized_named_tensors=serialized_named_tensors,
                          load_format=load_format, weight_version=weight_version,
                          abort_all_requests=abort_all_requests, flush_cache=flush_cache)

    def update_weights_from_disk(self, model_path, weight_version=None, abort_all_requests=False):
        return self._post("/update_weights_from_disk", model_path=str(model_path), weight_version=weight_version,
                          abort_all_requests=abort_all_requests)

    def update_weights_from_shared(self, path, manifest, weight_version=None, abort_all_requests=False):
        """nano-miles extension: serve a CPU trainer's shared-memory weights (shared_weights.py)."""
        return self._post("/update_weights_from_shared", path=path, manifest=manifest, weight_version=weight_version,
                          abort_all_requests=abort_all_requests)

    def release_memory_occupation(self, tags=None):
        """SGLang's route: free the engine's memory while a colocated trainer updates (ours: a CPU KV cache)."""
        return self._send(Call("POST", "/release_memory_occupation", {} if tags is None else {"tags": list(tags)}))

    def resume_memory_occupation(self, tags=None):
        return self._send(Call("POST", "/resume_memory_occupation", {} if tags is None else {"tags": list(tags)}))

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name=DEFAULT_GROUP_NAME, backend="gloo", timeout=None):
        return self._post("/init_weights_update_group", timeout, master_address=master_address,
                          master_port=master_port, rank_offset=rank_offset, world_size=world_size,
                          group_name=group_name, backend=backend)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name=DEFAULT_GROUP_NAME,
                                        load_format=None, weight_version=None, abort_all_requests=False,
                                        flush_cache=True, timeout=None):
        return self._post("/update_weights_from_distributed", timeout, names=list(names),
                          dtypes=[str(d).removeprefix("torch.") for d in dtypes], shapes=[list(s) for s in shapes],
                          group_name=group_name, load_format=load_format, weight_version=weight_version,
                          abort_all_requests=abort_all_requests, flush_cache=flush_cache)

    def destroy_weights_update_group(self, group_name=DEFAULT_GROUP_NAME):
        return self._post("/destroy_weights_update_group", group_name=group_name)

    def weights_checksum(self, names=None):
        """{"weight_version", "dtype", "algorithm", "checksums": {name: sha256}} (nano-miles extension)."""
        return self._send(Call("POST", "/weights_checksum", {} if names is None else {"names": list(names)}))


class EngineClient(Routes):
    """Blocking client (requests); one thread per client."""

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT, api_key: str | None = None):
        self.url, self.timeout = url.rstrip("/"), timeout
        self.session = requests.Session()
        self.session.headers.update(auth_headers(self.url, api_key))

    def _send(self, call: Call):
        try:
            r = self.session.request(call.method, self.url + call.path, json=call.body,
                                     timeout=call.timeout or self.timeout)
        except (requests.ConnectionError, requests.Timeout) as e:
            return call.answer(None, f"engine at {self.url} unavailable: {type(e).__name__}: {e}")
        return call.answer(r.status_code, r.text)

    def close(self):
        self.session.close()


class AsyncEngineClient(Routes):
    """asyncio client (aiohttp), made inside the running event loop; `await close()` when done."""

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT, api_key: str | None = None):
        self.url, self.timeout = url.rstrip("/"), timeout
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1024),
                                             timeout=aiohttp.ClientTimeout(total=timeout),
                                             headers=auth_headers(self.url, api_key))

    async def _send(self, call: Call):
        timeout = {"timeout": aiohttp.ClientTimeout(total=call.timeout)} if call.timeout else {}
        try:
            async with self.session.request(call.method, self.url + call.path, json=call.body, **timeout) as r:
                text, status = await r.text(), r.status
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            return call.answer(None, f"engine at {self.url} unavailable: {type(e).__name__}: {e}")
        return call.answer(status, text)

    async def close(self):
        await self.session.close()
