"""`start_engine_process`, the one launcher of engine processes (EnginePool starts its replicas with
it): `nano-miles serve` as a child that never outlives its parent.

    with start_engine_process("tiny-random-qwen2", device="cpu") as eng:
        eng.client().generate([1, 2, 3], {"max_new_tokens": 8})
"""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from nano_miles.engine.client import EngineClient, EngineUnavailable, remember_api_key
from nano_miles.engine.json_parser import die_with_parent
from nano_miles.engine.protocol import API_KEY_ENV

_REPO_ROOT = Path(__file__).resolve().parents[2]


class EngineProcess:
    """A running `nano-miles serve`. stop() terminates it (then kills it); also a context manager."""

    def __init__(self, process: subprocess.Popen, url: str, log_path: Path, own_log: bool, api_key: str = ""):
        self.process, self.url, self.log_path, self.own_log = process, url, log_path, own_log
        self.api_key = api_key  # what every route but /health needs; this process's clients send it unasked
        self.port = int(url.rsplit(":", 1)[1])
        remember_api_key(url, api_key)

    def client(self, **kw) -> EngineClient:
        return EngineClient(self.url, **{"api_key": self.api_key, **kw})

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
        if self.own_log:
            self.log_path.unlink(missing_ok=True)
        remember_api_key(self.url, None)  # another server may get this port later
        return self.process.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()


def start_engine_process(model: str, device: str = "cpu", port: int | None = None, host: str = "127.0.0.1",
                         dtype: str = "auto", extra_args=(), ready_timeout: float = 300.0, env=None,
                         log_path: str | os.PathLike | None = None, api_key: str | None = None) -> EngineProcess:
    """Launch `nano-miles serve` and return once it has loaded the model and listens. port=None: a
    free port the server picks itself (read from its ready line). Its output goes to log_path (a
    temp file by default). api_key: None generates one, "" runs without; it reaches the server
    through its environment, not its command line, which every user of the machine can read.

    Call it from a thread that lives as long as the engine should: Linux sends the parent-death
    signal when the launching THREAD exits."""
    own_log = log_path is None
    if own_log:
        fd, log_path = tempfile.mkstemp(prefix="nano-miles-serve-", suffix=".log")
        os.close(fd)
    log_path = Path(log_path)
    cmd = [sys.executable, "-m", "nano_miles.cli", "serve", "--model", str(model), "--device", device,
           "--host", host, "--port", str(port or 0), "--dtype", dtype, *map(str, extra_args)]
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env[API_KEY_ENV] = api_key = secrets.token_urlsafe(32) if api_key is None else api_key
    env.setdefault("PYTHONUNBUFFERED", "1")
    with open(log_path, "wb") as log:  # its own session: a Ctrl-C reaches only us, and we stop it
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, preexec_fn=die_with_parent)
    deadline = time.monotonic() + ready_timeout
    try:
        while True:  # the ready line comes once the model is loaded: /health answers 200 from then on
            text = log_path.read_text(errors="replace")
            ready = [line for line in text.splitlines() if "ready on http://" in line]
            if ready:
                return EngineProcess(proc, ready[0].split("ready on ", 1)[1].split()[0], log_path, own_log, api_key)
            if proc.poll() is not None:
                raise EngineUnavailable(f"`nano-miles serve` exited with code {proc.returncode}:\n{text[-3000:]}")
            if time.monotonic() > deadline:
                raise EngineUnavailable(f"`nano-miles serve` not ready after {ready_timeout:.0f}s:\n{text[-3000:]}")
            time.sleep(0.1)
    except BaseException:
        EngineProcess(proc, "http://x:0", log_path, own_log).stop()
        raise
