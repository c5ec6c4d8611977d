"""Push the trainer's weights into running inference engines, over SGLang's weight routes.

Transports (docs/design.md says which and why; payloads in engine/weights.py): `ipc` (flattened
buckets as CUDA IPC handles, shared memory on CPU), `distributed` (one NCCL or gloo broadcast per
bucket reaches every engine), `disk` (a safetensors folder), `shared` (CPU engines map a CPU
trainer's weights: a sync is a version bump and a KV flush); `auto` picks one (choose_transport).
Every sync pauses the engines in place around it; weights holding a NaN or an infinity are never
sent (NonFiniteWeights).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlparse

import torch
from safetensors.torch import save_file

from nano_miles.dtypes import dtype_name
from nano_miles.engine import weight_group as G
from nano_miles.engine import weights as W
from nano_miles.engine.client import EngineClient, EngineUnavailable
from nano_miles.trainer.config import SyncConfig

_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


class WeightSyncError(RuntimeError):
    """An engine refused an update, a transport failed, or a verified sync found different weights."""


def choose_transport(trainer_device: torch.device, engine_infos: list[dict], engine_urls: list[str],
                     shareable: bool = False) -> str:
    """The fastest transport that works for this layout. shareable: the trainer can share its weights
    and the caller allows it (no rollout runs while the trainer updates)."""
    devices = [torch.device(info.get("device", "cpu")) for info in engine_infos]
    local = all(urlparse(u).hostname in _LOCAL_HOSTS for u in engine_urls)
    if trainer_device.type != "cuda":
        return "shared" if shareable and local and all(d.type == "cpu" for d in devices) else "distributed"
    if any(d.type != "cuda" for d in devices):
        return "disk"  # a CPU engine beside a GPU trainer: no common collective backend
    d = devices[0]
    if len(devices) > 1 or not local or d.index is None or d.index >= torch.cuda.device_count():
        return "distributed"  # several engines, a remote one or a GPU not visible here: a collective
    t = trainer_device.index if trainer_device.index is not None else torch.cuda.current_device()
    return "ipc" if d.index == t or torch.cuda.can_device_access_peer(t, d.index) else "distributed"


class WeightSync:
    def __init__(self, source, engine_urls, cfg: SyncConfig | None = None, allow_shared: bool = False, **keys):
        """source: a Trainer, or (name, tensor) pairs (whatever weights a test sends); cfg with
        SyncConfig keys by name over it; allow_shared: no rollout runs during an update (mode=sync)."""
        self.cfg = cfg = dataclasses.replace(cfg or SyncConfig(), **keys)
        self.source = source
        self.urls = [engine_urls] if isinstance(engine_urls, str) else list(engine_urls)
        if not self.urls:
            raise ValueError("WeightSync needs at least one engine URL")
        self.clients = [EngineClient(u, timeout=cfg.timeout_s) for u in self.urls]
        self.infos = [c.model_info() for c in self.clients]
        dtypes = {info["dtype"] for info in self.infos}
        if len(dtypes) != 1:
            raise ValueError(f"engines disagree on dtype: {sorted(dtypes)}")
        self.engine_dtype = W.parse_dtype(dtypes.pop())
        self.device = torch.device(source.device) if getattr(source, "device", None) is not None \
            else self.named_tensors()[0][1].device
        shareable = hasattr(source, "shareable") and source.shareable(self.engine_dtype)
        self._auto = cfg.transport == "auto"
        self.transport = choose_transport(self.device, self.infos, self.urls, shareable and allow_shared) \
            if self._auto else cfg.transport
        if self.transport == "shared" and not shareable:
            raise ValueError(f"transport 'shared' needs a CPU Trainer whose tensors are the engine's dtype "
                             f"({dtype_name(self.engine_dtype)}); use 'distributed'")
        if self.transport == "distributed" and self.device.type == "cuda" and any(
                torch.device(info.get("device", "cpu")) == self.device and urlparse(u).hostname in _LOCAL_HOSTS
                for u, info in zip(self.urls, self.infos)):
            raise ValueError(f"transport 'distributed' cannot reach an engine on the trainer's own GPU ({self.device}): "
                             "NCCL refuses two ranks on one device; use 'ipc' (what 'auto' picks there)")
        self._pool = ThreadPoolExecutor(max_workers=len(self.clients) + 1, thread_name_prefix="weight-sync")
        self._group = None
        self.store_port: int | None = None  # distributed: where rank 0's store listens (on master_address)
        self._group_name = f"nano_miles_sync_{os.getpid()}_{id(self):x}"
        self._disk_dir, self._own_disk_dir = cfg.disk_dir, not cfg.disk_dir
        self._send_buf = None  # distributed: the persistent flattened send buffer
        self._phases: dict = {}
        self._answers: list = []  # the engines' answers to the last update call (the last bucket's)
        self._send_split: dict | None = None  # the last bucket's send, split (_split_send)
        self._pausing: list | None = None  # the pause calls of the running sync, until waited for

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """What the engines should serve, in their dtype."""
        src = self.source
        named = src.named_weights(self.engine_dtype) if hasattr(src, "named_weights") else src
        return [(n, t.detach().to(self.engine_dtype)) for n, t in named]

    def sync(self, weight_version) -> dict:
        """Send the current weights to every engine; return {ms, bytes, transport, verified, buckets,
        weight_version, engines, phases_ms, engine_ms, send_ms, fast_path}."""
        version, t0 = str(weight_version), time.perf_counter()
        self._phases = dict.fromkeys(("pause", "prepare", "pack", "send", "free", "resume"), 0.0)
        self._answers, sent = [], {"bytes": 0, "buckets": 0, "checksums": None}
        self._send_split = None
        # The engines finish their running forward step while the first bucket is prepared and packed;
        # each transport waits for the pause (self._paused) just before it sends.
        self._pausing = self._start_all(lambda c: c.pause("in_place"))
        try:
            if self.transport != "shared" or not self._sync_shared(version):
                sent["checksums"] = {} if self.cfg.verify else None
                send = {"ipc": self._send_tensor, "distributed": self._send_distributed, "disk": self._send_disk}
                # closing it finishes a gather from the trainer's ranks, whatever happened
                with contextlib.closing(self._lookahead(self._bucket_source(version), sent)) as buckets:
                    send[self.transport](buckets, version)
            self._paused()
        finally:
            resumed = time.perf_counter()
            pausing, self._pausing = self._pausing, None  # not None: failed before waiting for the pause
            # every engine that paused is continued, also when another could not pause (restarted by the loop)
            paused = range(len(self.clients)) if pausing is None else \
                [i for i, f in enumerate(pausing) if f.exception(timeout=self.cfg.timeout_s + 5) is None]
            self._collect([self._pool.submit(self.clients[i].resume) for i in paused], [self.urls[i] for i in paused])
            self._phase("resume", resumed)
        ms = (time.perf_counter() - t0) * 1000.0
        if self.cfg.verify:
            self.verify(version, ours=sent["checksums"])
        answers = [a for a in self._answers if isinstance(a, dict)]
        return {"ms": ms, "bytes": sent["bytes"], "transport": self.transport, "verified": self.cfg.verify,
                "buckets": sent["buckets"], "weight_version": version, "engines": len(self.urls),
                "phases_ms": {k: round(v, 3) for k, v in self._phases.items()},
                "engine_ms": answers[0].get("timings_ms") if answers else None,
                "send_ms": self._send_split,
                "fast_path": bool(answers) and all(a.get("fast_path", True) for a in answers)}

    def before_update(self) -> None:
        """Before the trainer updates: with `shared`, the idle engines drop their KV cache's memory meanwhile."""
        if self.transport == "shared":
            self._on_all(lambda c: c.release_memory_occupation(["kv_cache"]))

    def _sync_shared(self, version: str) -> bool:
        """True once the engines serve the shared weights; False when `auto` fell back to distributed."""
        t = time.perf_counter()
        _refuse_non_finite(self.named_tensors(), version)  # (the trainer's own tensors: no copy)
        shared = self.source.share_weights(self.engine_dtype)  # the first call moves them into shared memory
        self._phase("prepare", t)
        t = self._paused()
        try:
            self._answers = self._on_all(
                lambda c: c.update_weights_from_shared(shared.path, shared.manifest, weight_version=version))
        except WeightSyncError as e:
            if not self._auto:
                raise
            # `auto` chose it from URLs and devices; an engine in another container (or an SGLang
            # server, which lacks the route) cannot map our memory: copy the weights instead.
            print(f"note: the engine cannot map the trainer's shared weights ({e}); using transport 'distributed'",
                  file=sys.stderr)
            self.transport = "distributed"
            return False
        self._phase("send", t)
        return True

    def _bucket_source(self, version: str):
        """The weights in buckets of about bucket_mb, checked finite. A trainer sharded over ranks
        gathers them a bucket at a time (no rank ever holds them all, nor an FP32 copy)."""
        bucket_bytes = int(self.cfg.bucket_mb * 2**20)
        if hasattr(self.source, "iter_full_weights"):
            return _checked(self.source.iter_full_weights(self.engine_dtype, bucket_bytes), version)
        named = self.named_tensors()
        _refuse_non_finite(named, version)
        return W.bucket_by_bytes(named, bucket_bytes)

    def _lookahead(self, source, sent: dict):
        """(bucket, is_last) pairs, one bucket ahead of the sender; counts sent's bytes and buckets,
        times the gathering (prepare), and takes each tensor's checksum when sent["checksums"] is a dict."""

        def pull():
            t = time.perf_counter()
            bucket = next(source, None)
            self._phase("prepare", t)
            if bucket is not None:
                sent["buckets"] += 1
                sent["bytes"] += sum(t.numel() * t.element_size() for _, t in bucket)
                if sent["checksums"] is not None:
                    sent["checksums"].update(W.checksums(bucket))
            return bucket

        try:
            bucket = pull()
            while bucket is not None:
                following = pull()
                yield bucket, following is None
                bucket = following
        finally:
            source.close()  # a generator: finishes a gather from the trainer's ranks

    def _phase(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self._phases[name] += (now - since) * 1000.0
        return now

    def _paused(self) -> float:
        """Wait until every engine has paused (sync() asked them at its start); the time after."""
        t = time.perf_counter()
        if self._pausing is not None:
            self._collect(self._pausing)
            self._pausing = None
            t = self._phase("pause", t)
        return t

    def _start_all(self, fn) -> list:
        return [self._pool.submit(fn, c) for c in self.clients]

    def _on_all(self, fn) -> list:
        return self._collect(self._start_all(fn))

    def _collect(self, futures, urls=None) -> list:
        """The engines' answers to calls started with _start_all (or on the engines at `urls`); WeightSyncError
        naming the engines that failed (EngineUnavailable when one could not be reached: the caller restarts it)."""
        errors, answers, unreachable = [], [], False
        for url, f in zip(self.urls if urls is None else urls, futures):
            try:
                answer = f.result(timeout=self.cfg.timeout_s + 5)
            except Exception as e:  # refused update, dead engine, timeout
                errors.append(f"{url}: {type(e).__name__}: {e}")
                unreachable |= isinstance(e, EngineUnavailable)
                continue
            if isinstance(answer, dict) and answer.get("success") is False:
                errors.append(f"{url}: {answer.get('message')}")
            answers.append(answer)
        if errors:
            message = f"{self.transport} weight sync failed on {len(errors)} engine(s): " + "; ".join(errors)
            raise (EngineUnavailable if unreachable else WeightSyncError)(message)
        return answers

    def _send_tensor(self, buckets, version):
        for bucket, last in buckets:
            t = time.perf_counter()
            # A fresh buffer every sync (a server may answer before its copy of the last one is done);
            # no synchronize: the receiver's rebuild waits on the IPC event recorded after the flatten.
            payload, flat = W.serialize_bucket(bucket)
            self._phase("pack", t)
            t = self._paused()
            submitted = time.time()
            self._answers = self._on_all(lambda c: _stamped(c.update_weights_from_tensor)(
                payload, load_format="flattened_bucket", flush_cache=last, weight_version=version if last else None))
            t = self._phase("send", t)
            self._split_send(submitted)
            del flat, payload  # acknowledged: the engines copied, synchronised, closed it
            if self.device.type == "cuda":
                # Frees the buffers engines have released since (torch's IPC limbo). No empty_cache():
                # the next bucket or training step reuses the cached block, a cudaMalloc would cost ms.
                torch.cuda.ipc_collect()
            self._phase("free", t)

    def _split_send(self, submitted: float) -> None:
        """The first engine's send, split by the wall-clock stamps on both sides (one machine, one
        clock): the sending thread's wake-up, the way to the engine's handler (the HTTP request, and
        the engine's event loop getting to it), the handler, the way back."""
        a = self._answers[0] if self._answers else None
        if not (isinstance(a, dict) and a.get("received_at") and a.get("timings_ms")
                and urlparse(self.urls[0]).hostname in _LOCAL_HOSTS):
            return
        ms = lambda start, end: round((end - start) * 1000.0, 3)  # noqa: E731
        self._send_split = {"wake": ms(submitted, a["sent_at"]),
                            "to_engine": ms(a["sent_at"], a["received_at"]),
                            "engine": a["timings_ms"].get("total"),
                            "from_engine": ms(a["answered_at"], a["back_at"])}

    def _init_group(self):
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        addr, world = self.cfg.master_address, len(self.clients) + 1
        listener = G.listen(addr, self.cfg.master_port)  # on master_address only; port 0: a free one
        port = self.store_port = listener.getsockname()[1]
        if backend == "nccl":
            torch.cuda.set_device(self.device)
        futures = [self._pool.submit(c.init_weights_update_group, addr, port, rank, world, self._group_name,
                                     backend, self.cfg.timeout_s) for rank, c in enumerate(self.clients, start=1)]
        try:
            group = G.init_weight_update_group(addr, port, 0, world, self._group_name, backend, self.cfg.timeout_s,
                                               listener=listener)
        except Exception as e:
            raise WeightSyncError(f"cannot form the weight update group ({backend}, {addr}:{port}): {e}") from e
        for url, f in zip(self.urls, futures):
            answer = f.result(timeout=self.cfg.timeout_s)
            if not answer.get("success", False):
                raise WeightSyncError(f"{url} did not join the weight update group: {answer.get('message')}")
        self._group = group

    def _send_distributed(self, buckets, version):
        if self._group is None:
            self._init_group()
        for i, (bucket, last) in enumerate(buckets):
            start = self._paused()  # (waits for the pause before the first bucket: timed as pause, not send)
            names, dtypes, shapes = zip(*[(n, dtype_name(t.dtype), list(t.shape)) for n, t in bucket])
            # The persistent send buffer, grown to the largest bucket: a broadcast has read it when it
            # returns (work.wait orders our stream after it), so the next flatten may overwrite it.
            nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
            if self._send_buf is None or self._send_buf.numel() < nbytes:
                self._send_buf = None  # free the smaller one first
                self._send_buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            # The engines' HTTP calls and our broadcast run at once (each side blocks in the collective
            # until the other joins); both have timeouts, so a dead peer cannot hang us.
            http = self._pool.submit(self._on_all, lambda c: c.update_weights_from_distributed(
                names, dtypes, shapes, group_name=self._group_name, load_format="flattened_bucket",
                weight_version=version if last else None, flush_cache=last, timeout=self.cfg.timeout_s))
            try:
                G.broadcast_weights(self._group, bucket, "flattened_bucket", self.cfg.timeout_s, out=self._send_buf)
            except Exception as e:
                self._group = None  # a broken collective cannot be reused
                raise WeightSyncError(f"broadcast of bucket {i} failed: {type(e).__name__}: {e}") from e
            try:
                self._answers = http.result(timeout=self.cfg.timeout_s + 10)
            except WeightSyncError:
                self._group = None
                raise
            self._phase("send", start)  # flatten + broadcast + the engines' swap (they overlap)

    def _send_disk(self, buckets, version):
        self._disk_dir = self._disk_dir or tempfile.mkdtemp(prefix="nano-miles-weights-")
        os.makedirs(self._disk_dir, exist_ok=True)
        named = [(n, x) for bucket, _ in buckets for n, x in bucket]  # gathering them is timed as prepare
        start = time.perf_counter()
        tmp = os.path.join(self._disk_dir, ".model.safetensors.tmp")
        save_file({n: x.contiguous().cpu() for n, x in named}, tmp)
        os.replace(tmp, os.path.join(self._disk_dir, "model.safetensors"))  # engines never see half a file
        self._phase("pack", start)
        start = self._paused()
        self._answers = self._on_all(lambda c: c.update_weights_from_disk(self._disk_dir, weight_version=version))
        self._phase("send", start)

    def verify(self, weight_version=None, ours: dict | None = None) -> None:
        """Compare each engine's per-tensor checksums (and weight_version) with ours (`ours`, else of
        the source's weights now); raise WeightSyncError on any difference."""
        ours = W.checksums(self.named_tensors()) if ours is None else ours
        for url, client in zip(self.urls, self.clients):
            answer = client.weights_checksum()
            served = answer["checksums"]
            if weight_version is not None and str(answer.get("weight_version")) != str(weight_version):
                raise WeightSyncError(f"{url} serves weight_version {answer.get('weight_version')!r}, "
                                      f"expected {str(weight_version)!r}")
            # A tied lm_head is not a parameter of its own on the engine: compare what it serves.
            missing = sorted(n for n in served if n not in ours)
            differ = sorted(n for n in served if n in ours and served[n] != ours[n])
            if missing or differ:
                raise WeightSyncError(f"weight sync verification failed on {url}: {len(differ)} tensor(s) differ "
                                      f"(e.g. {differ[:3]}), {len(missing)} not sent (e.g. {missing[:3]})")

    def close(self) -> None:
        if self._group is not None:
            # Both ends tear the group down at once: NCCL's teardown on one side can wait for the other.
            local = self._pool.submit(G.destroy_weight_update_group, self._group)
            for c in self.clients:
                with contextlib.suppress(Exception):  # the engine may be gone already
                    c.destroy_weights_update_group(self._group_name)
            with contextlib.suppress(Exception):
                local.result(timeout=self.cfg.timeout_s)
            self._group = None
        self._send_buf = None
        if self._own_disk_dir and self._disk_dir:
            shutil.rmtree(self._disk_dir, ignore_errors=True)
            self._disk_dir = ""
        self._pool.shutdown(wait=False)
        for c in self.clients:
            c.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _stamped(call):
    """call, its answer (a dict) stamped with the wall-clock times it was sent and came back."""
    def stamped(*args, **kwargs):
        sent_at = time.time()
        answer = call(*args, **kwargs)
        return {**answer, "sent_at": sent_at, "back_at": time.time()} if isinstance(answer, dict) else answer
    return stamped


def _refuse_non_finite(named, version: str) -> None:
    if (bad := W.non_finite(named)) is not None:
        raise W.NonFiniteWeights(f"the weights for version {version} hold NaN or infinite values in {bad}; "
                                 "not sent to the engines")


def _checked(buckets, version: str):
    """Gathered buckets, each refused if it holds a NaN or an infinity. Closing this closes `buckets`
    (a gather stopped early must still be finished with the other ranks)."""
    try:
        for bucket in buckets:
            _refuse_non_finite(bucket, version)
            yield bucket
    finally:
        buckets.close()
