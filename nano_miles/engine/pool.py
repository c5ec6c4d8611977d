"""The engine replicas of a command (`EnginePool`), and how a rollout's groups are routed over them
(`GroupRouter`): docs/design.md, "Scale-out". A replica is serving; restarting (ours, died); stale
(restarted with the base weights: it serves again once the loop's next weight sync reached it); or
down (not ours, or its restart failed: left out until it answers again).
"""
from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from nano_miles.engine.client import AsyncEngineClient, EngineClient, EngineError, EngineUnavailable
from nano_miles.engine.process import EngineProcess, start_engine_process
from nano_miles.engine.protocol import API_KEY_ENV


def check_engine(url: str, timeout: float = 60.0) -> dict:
    """The /model_info of the engine at `url`, waiting up to `timeout` for one that is starting.
    RuntimeError (one line) for what answers but is not an engine; EngineUnavailable when nothing does."""
    client, deadline = EngineClient(url, timeout=10.0), time.monotonic() + timeout
    try:
        while True:
            try:
                info = client.model_info()
            except EngineUnavailable as e:  # refused, or 503 while the model loads
                if time.monotonic() > deadline:
                    raise EngineUnavailable(f"engine.url {url}: no engine answered within {timeout:.0f}s ({e})") from None
                time.sleep(0.5)
                continue
            except EngineError as e:  # its body may be a whole HTML page: the status says enough
                if e.status in (401, 403):
                    raise RuntimeError(f"engine.url {url} refused us (HTTP {e.status}): set ${API_KEY_ENV} to its "
                                       "API key") from None
                raise RuntimeError(f"engine.url {url} is not an engine: GET /model_info answered HTTP {e.status} "
                                   "(expected `nano-miles serve` or SGLang)") from None
            if not isinstance(info, dict) or "model_path" not in info:
                raise RuntimeError(f"engine.url {url} is not an engine: GET /model_info answered "
                                   f"{str(info)[:80]!r}, not an SGLang model info")
            return info
    finally:
        client.close()


@dataclass
class Replica:
    index: int
    url: str
    device: str = ""
    process: EngineProcess | None = None  # None: an engine somebody else runs
    state: str = "serving"                # serving | restarting | stale | down
    requests: int = 0                     # /generate calls sent to it over the run
    outstanding: int = 0                  # episodes routed to it that have not finished
    generation: int = 0                   # bumped by each restart: a failure of an older process is old news
    error: str = ""                       # why it is down


class EnginePool:
    def __init__(self, cfg, layout, model_path: str, run_dir: Path | None = None, ready_timeout: float = 300.0):
        """cfg: the engine.* keys (layout.EngineLaunchConfig); layout: where ours run (layout.Layout)."""
        self.layout, self.model_path, self.run_dir = layout, model_path, run_dir
        self.given_urls = list(cfg.urls) if cfg is not None else []
        self.ready_timeout = ready_timeout
        self.replicas: list[Replica] = []
        self.restarts = 0
        self._lock = threading.Lock()
        self._changed = False  # a replica came back since the last wait_restarts()
        # Engines start on these threads, which live as long as the pool: an engine gets its
        # parent-death signal when the THREAD that started it exits.
        count = len(layout.engine_devices) if layout is not None else 1
        self._threads = ThreadPoolExecutor(max_workers=max(1, count), thread_name_prefix="engine")
        self._restarting: dict[int, object] = {}  # replica index -> its restart's future
        self._stopped = False

    @classmethod
    def of(cls, urls: list[str]) -> "EnginePool":
        """A pool over engines somebody else runs, taken as they are."""
        pool = cls(None, None, "")
        pool.given_urls = list(urls)
        pool.replicas = [Replica(i, u.rstrip("/")) for i, u in enumerate(urls)]
        return pool

    def start(self) -> list[str]:
        if self.given_urls:
            self.replicas = [Replica(i, url.rstrip("/"), str(check_engine(url).get("device", "")))
                             for i, url in enumerate(self.given_urls)]
            return self.urls
        devices = self.layout.engine_devices or [self.layout.engine_device]
        starting = [self._threads.submit(self._launch, i, d) for i, d in enumerate(devices)]
        errors = []
        for i, (device, future) in enumerate(zip(devices, starting)):
            try:
                self.replicas.append(Replica(i, (process := future.result()).url, device, process))
            except Exception as e:
                errors.append(f"replica {i} on {device}: {e}")
        if errors:
            self.stop()
            raise EngineUnavailable("engine start failed: " + "; ".join(errors))
        self._write_state()
        return self.urls

    def _launch(self, i: int, device: str) -> EngineProcess:
        log = None if self.run_dir is None else self.run_dir / ("engine.log" if i == 0 else f"engine-{i}.log")
        # The user's $NANO_MILES_API_KEY, when set, so they can reach the engines too; else a fresh key.
        return start_engine_process(self.model_path, device=device, dtype=self.layout.dtype,
                                    extra_args=self.layout.args_of(i), ready_timeout=self.ready_timeout,
                                    log_path=log, api_key=os.environ.get(API_KEY_ENV) or None)

    def _write_state(self) -> None:
        """engine.json in the run directory: the replicas' pids and URLs (the first one's at the top)."""
        if self.run_dir is None or not self.replicas or self.replicas[0].process is None:
            return
        rows = [{"pid": r.process.process.pid if r.process else None, "url": r.url, "device": r.device,
                 "state": r.state} for r in self.replicas]
        tmp = self.run_dir / "engine.json.tmp"
        tmp.write_text(json.dumps({**rows[0], "replicas": rows}))
        os.replace(tmp, self.run_dir / "engine.json")  # rewritten as replicas restart: a reader never sees half of it

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            replicas, self.replicas = self.replicas, []
        for r in replicas:
            if r.process is not None:
                r.process.stop()
        # A restart under way stops the engine it started itself (_restart); not waited for.
        self._threads.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> list[str]:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def serving(self) -> list[Replica]:
        with self._lock:
            return [r for r in self.replicas if r.state == "serving"]

    def to_sync(self) -> list[Replica]:
        """The replicas a weight sync should reach: those serving and those waiting for weights."""
        with self._lock:
            return [r for r in self.replicas if r.state in ("serving", "stale")]

    def synced(self, replicas: list[Replica]) -> None:
        """These replicas now serve the trainer's weights: stale ones take rollouts again."""
        with self._lock:
            for r in replicas:
                if r.state == "stale":
                    r.state = "serving"

    def fail(self, replica: Replica, generation: int, error: Exception) -> None:
        """A request to `replica` (of that generation) found it dead: restart ours in the background,
        leave theirs down. Safe to call from any thread, any number of times."""
        with self._lock:
            if self._stopped or replica.generation != generation or replica.state not in ("serving", "stale"):
                return  # already known, or the run is over
            if replica.process is None:
                replica.state = "down"
                return
            self._restart_later(replica)

    def _restart_later(self, replica: Replica) -> None:  # under self._lock
        replica.state = "restarting"
        self._restarting[replica.index] = self._threads.submit(self._restart, replica)

    def _restart(self, replica: Replica) -> None:
        replica.process.stop()  # whatever is left of it
        try:
            process = self._launch(replica.index, replica.device)
        except Exception as e:
            with self._lock:
                replica.state, replica.error = "down", str(e)
            return
        with self._lock:
            if self._stopped:
                process.stop()
                return
            replica.process, replica.url, replica.state = process, process.url, "stale"
            replica.generation += 1
            self.restarts += 1
            self._changed = True
        self._write_state()

    def probe(self) -> None:
        """Health-check the replicas (after a failure the loop could not route around): dead ones of
        ours are restarted, again if their last restart failed; theirs are marked down, and come back
        (stale, to be synced) once they answer again."""
        for r in list(self.replicas):
            if r.state == "restarting":
                continue
            alive = EngineClient(r.url, timeout=5.0).health()
            if not alive and r.state in ("serving", "stale"):
                self.fail(r, r.generation, EngineUnavailable(f"{r.url} does not answer /health"))
            elif not alive and r.process is not None:  # ours, down after a failed restart: try again
                with self._lock:
                    self._restart_later(r)
            elif alive and r.state == "down":
                with self._lock:
                    r.state, self._changed = "stale", True

    def wait_restarts(self) -> bool:
        """Wait for the restarts under way; True when the set of live replicas changed since the last
        call (the weight sync then needs a new connection). EngineUnavailable when none is left."""
        for index, future in list(self._restarting.items()):
            future.result()
            with self._lock:
                self._restarting.pop(index, None)
        with self._lock:
            changed, self._changed = self._changed, False
        if not self.to_sync():
            why = "; ".join(f"replica {r.index}: {r.error}" for r in self.replicas if r.error)
            why = f"their restarts failed: {why}" if not self.given_urls else "not ours to restart"
            raise EngineUnavailable(f"no engine replica is left ({why}): " + ", ".join(self.urls))
        return changed


class GroupRouter:
    """Routes the episodes of one rollout over the pool's serving replicas (see the module docstring).
    Used from the rollout's event loop only: it owns that loop's async clients."""

    def __init__(self, pool: EnginePool, timeout: float):
        self.pool, self.timeout = pool, timeout
        self.groups: dict[str, Replica] = {}
        self.requests: dict[int, int] = {}  # this rollout's /generate calls per replica index
        self._clients: dict[tuple[int, int], _CountingClient] = {}

    def pick(self, group_id: str) -> tuple[Replica, int]:
        """The group's replica (and its generation); raises EngineUnavailable when none serves."""
        replica = self.groups.get(group_id)
        if replica is None or replica.state != "serving":
            serving = self.pool.serving()
            if not serving:
                raise EngineUnavailable("no engine replica is serving: " + ", ".join(self.pool.urls))
            replica = self.groups[group_id] = min(serving, key=lambda r: (r.outstanding, r.requests, r.index))
        replica.outstanding += 1
        return replica, replica.generation

    def done(self, replica: Replica) -> None:
        replica.outstanding -= 1

    def client(self, replica: Replica) -> "_CountingClient":
        key = (replica.index, replica.generation)
        if key not in self._clients:
            self._clients[key] = _CountingClient(AsyncEngineClient(replica.url, timeout=self.timeout), replica, self)
        return self._clients[key]

    def counts(self) -> list[int]:
        return [self.requests.get(r.index, 0) for r in self.pool.replicas]

    async def close(self) -> None:
        for c in self._clients.values():
            await c.client.close()


class _CountingClient:
    """The async client of one replica, counting the /generate calls sent to it."""

    def __init__(self, client: AsyncEngineClient, replica: Replica, router: GroupRouter):
        self.client, self.replica, self.router = client, replica, router

    async def generate(self, **kwargs):
        self.replica.requests += 1
        self.router.requests[self.replica.index] = self.router.requests.get(self.replica.index, 0) + 1
        return await self.client.generate(**kwargs)
