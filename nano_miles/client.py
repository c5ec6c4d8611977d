"""Clients of an SGLang-protocol engine (ours or a real SGLang server), and a launcher for ours.

    eng = start_engine_process("tiny-random-qwen2", device="cpu")   # `nano-miles serve` subprocess
    c = EngineClient(eng.url)
    out = c.generate([1, 2, 3], {"max_new_tokens": 8})               # SGLang's response dict
    eng.stop()

Errors: HTTP 400 raises EngineRequestError carrying the server's message (the server keeps serving);
other HTTP errors raise EngineError; a refused or dropped connection raises EngineUnavailable, which
is how rollouts and training notice a dead engine.
"""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

DEFAULT_TIMEOUT = 600.0


class EngineError(RuntimeError):
    """The engine answered with an error status."""

    def __init__(self, message: str, status: int | None = None, body=None):
        super().__init__(message)
        self.status, self.body = status, body


class EngineRequestError(EngineError):
    """HTTP 400: the request was refused (bad input, a weight payload that does not fit...)."""


class EngineUnavailable(EngineError):
    """No answer: connection refused or dropped, or a timeout."""


def _message(body, text: str) -> str:
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict) and "message" in body["error"]:
            return str(body["error"]["message"])
        if "message" in body:
            return str(body["message"])
    return text.strip() or "(empty body)"


def _raise_for(status: int, body, text: str, path: str):
    msg = f"{path}: HTTP {status}: {_message(body, text)}"
    if status == 400:
        raise EngineRequestError(msg, status, body)
    if status == 503:
        raise EngineUnavailable(msg, status, body)
    raise EngineError(msg, status, body)


def _generate_body(input_ids, sampling_params, rid, return_logprob) -> dict:
    body = {"input_ids": input_ids, "sampling_params": sampling_params or {}, "return_logprob": return_logprob}
    if rid is not None:
        body["rid"] = rid
    return body


class EngineClient:
    """Synchronous client (requests). Thread-safe enough for one thread per client."""

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT):
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.session = requests.Session()

    def _call(self, method: str, path: str, body=None, timeout=None, check: bool = True):
        try:
            r = self.session.request(method, self.url + path, json=body, timeout=timeout or self.timeout)
        except (requests.ConnectionError, requests.Timeout) as e:
            raise EngineUnavailable(f"{path}: engine at {self.url} unavailable: {type(e).__name__}: {e}") from None
        try:
            data = r.json()
        except ValueError:
            data = None
        if check and r.status_code != 200:
            _raise_for(r.status_code, data, r.text, path)
        return data if data is not None else r.text

    # --- generation ---
    def generate(self, input_ids, sampling_params=None, rid=None, return_logprob=True, **extra) -> dict:
        """One request (input_ids: list[int]) -> SGLang's response dict; a batch (list of lists) -> list."""
        return self._call("POST", "/generate", {**_generate_body(input_ids, sampling_params, rid, return_logprob), **extra})

    def generate_batch(self, batch_input_ids, sampling_params=None, rids=None, return_logprob=True) -> list[dict]:
        return self.generate(list(batch_input_ids), sampling_params, rids, return_logprob)

    # --- health and info ---
    def health(self) -> bool:
        try:
            r = self.session.get(self.url + "/health", timeout=5)
        except (requests.ConnectionError, requests.Timeout):
            return False
        return r.status_code == 200

    def wait_until_ready(self, timeout: float = 300.0, poll: float = 0.2, process=None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.health():
                return
            if process is not None and process.poll() is not None:
                raise EngineUnavailable(f"engine process exited with code {process.returncode} before ready")
            time.sleep(poll)
        raise EngineUnavailable(f"engine at {self.url} not ready after {timeout:.0f}s")

    def model_info(self) -> dict:
        return self._call("GET", "/model_info")

    def server_info(self) -> dict:
        return self._call("GET", "/get_server_info")

    def weight_version(self) -> str:
        return self.model_info()["weight_version"]

    # --- control ---
    def pause(self, mode: str = "abort") -> dict:
        return self._call("POST", "/pause_generation", {"mode": mode})

    def resume(self) -> dict:
        return self._call("POST", "/continue_generation", {})

    pause_generation, continue_generation = pause, resume  # SGLang's route names

    def abort(self, rid: str = "", abort_all: bool = False) -> dict:
        return self._call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    def flush_cache(self) -> dict:
        return self._call("POST", "/flush_cache")

    # --- weights (each returns {"success", "message"}; a refused update raises EngineRequestError) ---
    def update_weights_from_tensor(self, serialized_named_tensors, load_format=None, weight_version=None,
                                   abort_all_requests=False, flush_cache=True) -> dict:
        if isinstance(serialized_named_tensors, str):
            serialized_named_tensors = [serialized_named_tensors]
        return self._call("POST", "/update_weights_from_tensor", {
            "serialized_named_tensors": serialized_named_tensors, "load_format": load_format,
            "weight_version": weight_version, "abort_all_requests": abort_all_requests, "flush_cache": flush_cache})

    def update_weights_from_disk(self, model_path, weight_version=None, abort_all_requests=False) -> dict:
        return self._call("POST", "/update_weights_from_disk", {
            "model_path": str(model_path), "weight_version": weight_version, "abort_all_requests": abort_all_requests})

    def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                  group_name="weight_update_group", backend="gloo", timeout=None) -> dict:
        return self._call("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}, timeout=timeout)

    def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                        load_format=None, weight_version=None, abort_all_requests=False,
                                        flush_cache=True, timeout=None) -> dict:
        dtypes = [str(d).removeprefix("torch.") for d in dtypes]
        shapes = [list(s) for s in shapes]
        return self._call("POST", "/update_weights_from_distributed", {
            "names": list(names), "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
            "load_format": load_format, "weight_version": weight_version,
            "abort_all_requests": abort_all_requests, "flush_cache": flush_cache}, timeout=timeout)

    def destroy_weights_update_group(self, group_name="weight_update_group") -> dict:
        return self._call("POST", "/destroy_weights_update_group", {"group_name": group_name})

    def weights_checksum(self, names=None) -> dict:
        """{"weight_version", "dtype", "algorithm", "checksums": {name: sha256}} (nano-miles extension)."""
        return self._call("POST", "/weights_checksum", {} if names is None else {"names": list(names)})

    def close(self):
        self.session.close()


class AsyncEngineClient:
    """asyncio client (aiohttp); create it inside the running event loop, `await close()` when done."""

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT, max_connections: int = 1024):
        import aiohttp

        self.url = url.rstrip("/")
        self._aiohttp = aiohttp
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max_connections),
                                             timeout=self.timeout)

    async def _call(self, method: str, path: str, body=None):
        aiohttp = self._aiohttp
        try:
            async with self.session.request(method, self.url + path, json=body) as r:
                text = await r.text()
                status = r.status
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
            raise EngineUnavailable(f"{path}: engine at {self.url} unavailable: {type(e).__name__}: {e}") from None
        import json

        try:
            data = json.loads(text) if text else None
        except ValueError:
            data = None
        if status != 200:
            _raise_for(status, data, text, path)
        return data if data is not None else text

    async def generate(self, input_ids, sampling_params=None, rid=None, return_logprob=True, **extra) -> dict:
        return await self._call("POST", "/generate",
                                {**_generate_body(input_ids, sampling_params, rid, return_logprob), **extra})

    async def generate_batch(self, batch_input_ids, sampling_params=None, rids=None, return_logprob=True):
        return await self.generate(list(batch_input_ids), sampling_params, rids, return_logprob)

    async def health(self) -> bool:
        try:
            async with self.session.get(self.url + "/health") as r:
                return r.status == 200
        except (self._aiohttp.ClientConnectionError, asyncio.TimeoutError):
            return False

    async def wait_until_ready(self, timeout: float = 300.0, poll: float = 0.2) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self.health():
                return
            await asyncio.sleep(poll)
        raise EngineUnavailable(f"engine at {self.url} not ready after {timeout:.0f}s")

    async def model_info(self) -> dict:
        return await self._call("GET", "/model_info")

    async def pause(self, mode: str = "abort") -> dict:
        return await self._call("POST", "/pause_generation", {"mode": mode})

    async def resume(self) -> dict:
        return await self._call("POST", "/continue_generation", {})

    pause_generation, continue_generation = pause, resume  # SGLang's route names

    async def abort(self, rid: str = "", abort_all: bool = False) -> dict:
        return await self._call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def flush_cache(self) -> dict:
        return await self._call("POST", "/flush_cache")

    async def update_weights_from_tensor(self, serialized_named_tensors, load_format=None, weight_version=None,
                                         abort_all_requests=False) -> dict:
        if isinstance(serialized_named_tensors, str):
            serialized_named_tensors = [serialized_named_tensors]
        return await self._call("POST", "/update_weights_from_tensor", {
            "serialized_named_tensors": serialized_named_tensors, "load_format": load_format,
            "weight_version": weight_version, "abort_all_requests": abort_all_requests})

    async def update_weights_from_disk(self, model_path, weight_version=None, abort_all_requests=False) -> dict:
        return await self._call("POST", "/update_weights_from_disk", {
            "model_path": str(model_path), "weight_version": weight_version, "abort_all_requests": abort_all_requests})

    async def init_weights_update_group(self, master_address, master_port, rank_offset, world_size,
                                        group_name="weight_update_group", backend="gloo") -> dict:
        return await self._call("POST", "/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    async def update_weights_from_distributed(self, names, dtypes, shapes, group_name="weight_update_group",
                                              load_format=None, weight_version=None, abort_all_requests=False,
                                              flush_cache=True) -> dict:
        return await self._call("POST", "/update_weights_from_distributed", {
            "names": list(names), "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
            "shapes": [list(s) for s in shapes], "group_name": group_name, "load_format": load_format,
            "weight_version": weight_version, "abort_all_requests": abort_all_requests, "flush_cache": flush_cache})

    async def destroy_weights_update_group(self, group_name="weight_update_group") -> dict:
        return await self._call("POST", "/destroy_weights_update_group", {"group_name": group_name})

    async def weights_checksum(self, names=None) -> dict:
        return await self._call("POST", "/weights_checksum", {} if names is None else {"names": list(names)})

    async def close(self):
        await self.session.close()


# ----------------------------------------------------------------------------- the subprocess

_REPO_ROOT = Path(__file__).resolve().parent.parent


def _die_with_parent():
    """In the child before exec: get SIGTERM when the launching thread's process dies (no orphans,
    even if the parent is SIGKILLed). Own session: a Ctrl-C in the terminal reaches only the parent,
    which then stops the engine itself."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class EngineProcess:
    """A running `nano-miles serve`. stop() terminates it (then kills it); also a context manager."""

    def __init__(self, process: subprocess.Popen, url: str, log_path: Path, own_log: bool = False):
        self.process, self.url, self.log_path, self.own_log = process, url, log_path, own_log
        self.port = int(url.rsplit(":", 1)[1])

    def client(self, **kw) -> EngineClient:
        return EngineClient(self.url, **kw)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.own_log:  # a temp file we made: gone with the engine
            self.log_path.unlink(missing_ok=True)
        return self.process.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_engine_process(model: str, device: str = "cpu", port: int | None = None, host: str = "127.0.0.1",
                         dtype: str = "auto", extra_args=(), ready_timeout: float = 300.0, env=None,
                         log_path: str | os.PathLike | None = None) -> EngineProcess:
    """Launch `nano-miles serve` and return once /health answers 200. port=None: a free port the server
    picks itself (no race with other processes), read from its ready line. The server's output goes to
    log_path (a temp file by default; EngineProcess.log() reads it).

    Call it from a thread that lives as long as the engine should (normally the main thread): Linux
    sends the parent-death signal when the launching THREAD exits."""
    own_log = log_path is None
    if own_log:
        fd, log_path = tempfile.mkstemp(prefix="nano-miles-serve-", suffix=".log")
        os.close(fd)
    log_path = Path(log_path)
    cmd = [sys.executable, "-m", "nano_miles.cli", "serve", "--model", str(model), "--device", device,
           "--host", host, "--port", str(port or 0), "--dtype", dtype, *map(str, extra_args)]
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, preexec_fn=_die_with_parent)
    deadline = time.monotonic() + ready_timeout
    url = None
    try:
        while url is None:
            text = log_path.read_text(errors="replace")
            for line in text.splitlines():
                if "ready on http://" in line:
                    url = line.split("ready on ", 1)[1].split()[0]
            if url is None:
                if proc.poll() is not None:
                    raise EngineUnavailable(f"`nano-miles serve` exited with code {proc.returncode}:\n{text[-3000:]}")
                if time.monotonic() > deadline:
                    raise EngineUnavailable(f"`nano-miles serve` not ready after {ready_timeout:.0f}s:\n{text[-3000:]}")
                time.sleep(0.1)
        EngineClient(url).wait_until_ready(max(1.0, deadline - time.monotonic()), process=proc)
    except BaseException:
        EngineProcess(proc, url or "http://x:0", log_path, own_log).stop()
        raise
    return EngineProcess(proc, url, log_path, own_log)
