"""Push the trainer's weights into running inference engines, over SGLang's weight routes.

One interface, five transports (payload formats in nano_miles/engine/weights.py):
  ipc          flattened bucket(s) on the trainer's device -> /update_weights_from_tensor. On GPU the
               engine opens a CUDA IPC handle (same GPU, or another with P2P); on CPU the bucket
               travels through shared memory.
  staged       no P2P: ONE contiguous copy of each bucket onto the engine's GPU, then a local IPC handle.
  distributed  /init_weights_update_group once, then per bucket /update_weights_from_distributed while
               rank 0 broadcasts it (NCCL on GPU, gloo on CPU); one broadcast reaches every engine.
  disk         a safetensors folder -> /update_weights_from_disk; works everywhere.
  shared       CPU trainer and CPU engines on one machine: the engines map the trainer's weights
               (nano_miles/engine/shared_weights.py); a sync sends no bytes, it bumps the version and flushes
               the KV cache. Only when no rollout runs during an update (train's mode=sync).
`auto` picks from the layout: CPU trainer -> shared where the caller allows it (allow_shared) and the
trainer can share, else distributed; several engines or a remote one ->
distributed; engine on the trainer's GPU or on a P2P peer -> ipc; a visible GPU without P2P -> staged.
(CUDA device indices are compared as the engines report them, so trainer and engines are assumed to
run with the same CUDA_VISIBLE_DEVICES, as `nano-miles train` starts them.)

ipc/staged build a fresh bucket every sync (a server such as SGLang may answer before its copy of the
previous one finished) and free it after the engines acknowledge; distributed flattens into a
persistent send buffer (the broadcast has finished reading it when it returns). An engine whose
parameters are packed in the trainer's order applies a whole bucket with one copy (see
nano_miles/engine/flat_params.py). With verify=True each engine's per-tensor sha256 is compared with
the trainer's own; any difference raises WeightSyncError. Weights holding a NaN or an infinity are
never sent: sync() raises NonFiniteWeights (a training failure, not a transport one) before the
first byte goes out; a sharded trainer's weights, gathered a bucket at a time, are checked as each
bucket arrives (its trainer checks them after every step already, sharded_trainer.py).

sync() reports where the time went (CPU wall time per phase, ms; GPU work still queued when a phase
ends is waited for in a later one): prepare (the named tensors and the bucket split), pack (flatten
each bucket into one buffer + serialize, or the disk write), send (HTTP
calls / broadcasts until every engine answered), free; and each engine's own timings_ms of its last
answer (parse, decode or receive, wait, copy, release, answer, total), so send - engine total is the
HTTP overhead.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from urllib.parse import urlparse

import torch

from nano_miles.engine.client import EngineClient, EngineUnavailable
from nano_miles.dtypes import dtype_name
from nano_miles.engine import weight_group as G
from nano_miles.engine import weights as W

TRANSPORTS = ("auto", "ipc", "staged", "distributed", "disk", "shared")
PAUSE_MODES = ("auto", "drain", "in_place", "retract", "abort")
_LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "0.0.0.0"}


@dataclass
class SyncConfig:
    transport: str = "auto"        # auto | ipc | staged | distributed | disk | shared (CPU, mode=sync: one copy of the weights)
    verify: bool = False           # compare per-tensor checksums with every engine after each sync
    bucket_mb: float = 1024.0      # MiB per flattened bucket (one HTTP call / broadcast each)
    timeout_s: float = 300.0       # per HTTP call and per broadcast
    master_address: str = "127.0.0.1"  # distributed: the address this (rank 0) process's store listens on, and only it
    master_port: int = 0           # 0: a free port
    disk_dir: str = ""             # disk: the folder written each sync ("" = a temporary folder)
    # What the engines do with requests in flight during a sync: "drain" waits until none is running
    # (nothing runs in sync mode); "in_place" pauses them with their KV and continues them under the
    # new weights (async mode: waiting for a drain cost 0.5-1 s a sync); "retract" recomputes their
    # KV under the new weights; "abort" ends them. "auto": in_place in train's async mode, else drain.
    pause_mode: str = "auto"       # requests in flight during a sync: auto | drain | in_place | retract | abort

    def __post_init__(self):
        if self.transport not in TRANSPORTS:
            raise ValueError(f"sync.transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if not self.bucket_mb > 0:
            raise ValueError(f"sync.bucket_mb must be > 0, got {self.bucket_mb}")
        if self.timeout_s <= 0:
            raise ValueError("sync.timeout_s must be > 0")
        if self.pause_mode not in PAUSE_MODES:
            raise ValueError(f"sync.pause_mode must be one of {PAUSE_MODES}, got {self.pause_mode!r}")


class WeightSyncError(RuntimeError):
    """An engine refused an update, a transport failed, or a verified sync found different weights."""


def choose_transport(trainer_device: torch.device, engine_infos: list[dict], engine_urls: list[str],
                     shareable: bool = False) -> str:
    """The fastest transport that works for this layout (see the module docstring). shareable: the
    trainer can share its weights and the caller allows it."""
    if trainer_device.type != "cuda":
        local_cpu = all(torch.device(info.get("device", "cpu")).type == "cpu" for info in engine_infos) and all(
            urlparse(u).hostname in _LOCAL_HOSTS for u in engine_urls)
        return "shared" if shareable and local_cpu else "distributed"
    devices = [torch.device(info.get("device", "cpu")) for info in engine_infos]
    if any(d.type != "cuda" for d in devices):
        return "disk"  # a CPU engine next to a GPU trainer: no common collective backend
    if len(devices) > 1 or any(urlparse(u).hostname not in _LOCAL_HOSTS for u in engine_urls):
        return "distributed"
    d, t = devices[0], trainer_device.index if trainer_device.index is not None else torch.cuda.current_device()
    if d.index is None or d.index >= torch.cuda.device_count():
        return "distributed"  # not visible from here: only a collective can reach it
    if d.index == t or torch.cuda.can_device_access_peer(t, d.index):
        return "ipc"
    return "staged"


class WeightSync:
    def __init__(self, source, engine_urls, transport: str = "auto", bucket_mb: float = 1024.0, verify: bool = False,
                 timeout_s: float = 300.0, master_address: str = "127.0.0.1", master_port: int = 0,
                 disk_dir: str = "", api_key: str | None = None, pause_mode: str = "auto",
                 allow_shared: bool = False):
        """source: a Trainer (its named_weights), an nn.Module, a callable returning (name, tensor)
        pairs, or such a list. engine_urls: one URL or a list. api_key: the engines' (None: as
        nano_miles.engine.client resolves it, e.g. that of an engine this process started). allow_shared:
        the engines never generate while the trainer updates (train's mode=sync), so `auto` may pick
        the shared transport."""
        self.cfg = SyncConfig(transport, verify, bucket_mb, timeout_s, master_address, master_port, disk_dir, pause_mode)
        self.source = source
        self.urls = [engine_urls] if isinstance(engine_urls, str) else list(engine_urls)
        if not self.urls:
            raise ValueError("WeightSync needs at least one engine URL")
        self.clients = [EngineClient(u, timeout=timeout_s, api_key=api_key) for u in self.urls]
        self.infos = [c.model_info() for c in self.clients]
        dtypes = {info["dtype"] for info in self.infos}
        if len(dtypes) != 1:
            raise ValueError(f"engines disagree on dtype: {sorted(dtypes)}")
        self.engine_dtype = W.parse_dtype(dtypes.pop())
        self.device = self._source_device()
        shareable = hasattr(source, "shareable") and source.shareable(self.engine_dtype)
        self._auto = transport == "auto"
        self.transport = transport if transport != "auto" else choose_transport(
            self.device, self.infos, self.urls, shareable and allow_shared)
        if self.transport == "shared" and not shareable:
            raise ValueError(f"transport 'shared' needs a CPU Trainer whose tensors are the engine's dtype "
                             f"({dtype_name(self.engine_dtype)}); use 'distributed'")
        if self.transport == "distributed" and self.device.type == "cuda" and any(
                torch.device(info.get("device", "cpu")) == self.device and urlparse(u).hostname in _LOCAL_HOSTS
                for u, info in zip(self.urls, self.infos)):
            raise ValueError(f"transport 'distributed' cannot reach an engine on the trainer's own GPU ({self.device}): "
                             "NCCL refuses two ranks on one device; use 'ipc' (what 'auto' picks there)")
        if self.transport == "staged" and self.device.type != "cuda":
            raise ValueError("transport 'staged' copies to the engine's GPU: it needs a CUDA trainer")
        self._pool = ThreadPoolExecutor(max_workers=len(self.clients) + 1, thread_name_prefix="weight-sync")
        self._group = None
        self.store_port: int | None = None  # distributed: where rank 0's store listens (on master_address)
        self._group_name = f"nano_miles_sync_{os.getpid()}_{id(self):x}"
        self._disk_dir, self._own_disk_dir = disk_dir, not disk_dir
        self._send_buf = None  # distributed: the persistent flattened send buffer
        self._phases: dict = {}
        self._engine_timings: list = []

    @classmethod
    def from_config(cls, source, engine_urls, cfg: SyncConfig, api_key: str | None = None,
                    allow_shared: bool = False) -> "WeightSync":
        return cls(source, engine_urls, cfg.transport, cfg.bucket_mb, cfg.verify, cfg.timeout_s,
                   cfg.master_address, cfg.master_port, cfg.disk_dir, api_key, cfg.pause_mode, allow_shared)

    # ------------------------------------------------------------------ the weights

    def named_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """What the engines should serve, in their dtype."""
        src = self.source
        if hasattr(src, "named_weights"):
            named = src.named_weights(self.engine_dtype)
        elif isinstance(src, torch.nn.Module):
            named = [(n, p.detach()) for n, p in src.named_parameters()]
        else:
            named = src() if callable(src) else src
        dtype = self.engine_dtype
        return [(n, (t.detach() if t.requires_grad else t) if t.dtype == dtype else t.detach().to(dtype))
                for n, t in named]

    def _source_device(self) -> torch.device:
        src = self.source
        if hasattr(src, "named_weights") and getattr(src, "device", None) is not None:
            return torch.device(src.device)  # (a sharded trainer's named_weights would gather them all)
        if hasattr(src, "named_weights"):
            return src.named_weights()[0][1].device
        if isinstance(src, torch.nn.Module):
            return next(src.parameters()).device
        named = src() if callable(src) else src
        return named[0][1].device

    # ------------------------------------------------------------------ sync

    def sync(self, weight_version) -> dict:
        """Send the current weights to every engine; return {ms, bytes, transport, verified, buckets,
        phases_ms, engine_ms, fast_path} (see the module docstring for the phases)."""
        version = str(weight_version)
        t0 = time.perf_counter()
        self._phases = {"prepare": 0.0, "pack": 0.0, "send": 0.0, "free": 0.0}
        self._engine_timings = []
        if self.transport == "shared":
            return self._sync_shared(version, t0)
        buckets = _Buckets(self._bucket_source(version), self._phases, checksum=self.cfg.verify)
        self._phases["prepare"] += (time.perf_counter() - t0) * 1000.0
        send = {"ipc": self._send_tensor, "staged": self._send_tensor,
                "distributed": self._send_distributed, "disk": self._send_disk}[self.transport]
        try:
            if self.cfg.pause_mode not in ("auto", "drain"):
                self._on_all(lambda c: c.pause(self.cfg.pause_mode))
                try:
                    send(buckets, version)
                finally:
                    self._on_all(lambda c: c.resume())
            else:
                send(buckets, version)
        finally:
            buckets.close()  # a source gathering from the trainer's ranks finishes the gather with them
        ms = (time.perf_counter() - t0) * 1000.0
        verified = False
        if self.cfg.verify:
            self.verify(version, ours=buckets.checksums)
            verified = True
        answers = [a for a in self._engine_timings if isinstance(a, dict)]
        return {"ms": ms, "bytes": buckets.nbytes, "transport": self.transport, "verified": verified,
                "buckets": buckets.count, "weight_version": version, "engines": len(self.urls),
                "phases_ms": {k: round(v, 3) for k, v in self._phases.items()},
                "engine_ms": answers[0].get("timings_ms") if answers else None,
                "fast_path": bool(answers) and all(a.get("fast_path") for a in answers)}

    def before_update(self) -> None:
        """Call before the trainer updates. With the shared transport (colocated, mode=sync) the idle
        engines drop their KV cache's memory meanwhile, so the trainer's peak and theirs do not add up."""
        if self.transport == "shared":
            self._on_all(lambda c: c.release_memory_occupation(["kv_cache"]))

    def _sync_shared(self, version: str, t0: float) -> dict:
        _refuse_non_finite(self.named_tensors(), version)  # (the trainer's own tensors: no copy)
        shared = self.source.share_weights(self.engine_dtype)  # the first call moves them into shared memory
        t = self._phase("prepare", t0)
        try:
            self._on_all(lambda c: c.update_weights_from_shared(shared.path, shared.manifest, weight_version=version))
        except WeightSyncError as e:
            if not self._auto:
                raise
            # `auto` chose it from URLs and devices; an engine in another container (or an SGLang
            # server, which lacks the route) cannot map our memory: copy the weights instead.
            print(f"note: the engine cannot map the trainer's shared weights ({e}); using transport 'distributed'",
                  file=sys.stderr)
            self.transport = "distributed"
            return self.sync(version)
        self._phase("send", t)
        ms = (time.perf_counter() - t0) * 1000.0
        if self.cfg.verify:
            self.verify(version)
        answer = self._engine_timings[0] if self._engine_timings else {}
        return {"ms": ms, "bytes": 0, "transport": "shared", "verified": self.cfg.verify, "buckets": 0,
                "weight_version": version, "engines": len(self.urls), "phases_ms": {k: round(v, 3) for k, v in self._phases.items()},
                "engine_ms": answer.get("timings_ms"), "fast_path": True}

    def _bucket_source(self, version: str):
        """The weights in buckets of about bucket_mb, checked finite. A trainer sharded over ranks
        gathers them a bucket at a time (iter_full_weights: no rank ever holds them all, nor an FP32
        copy); a whole model is checked whole, then split here."""
        bucket_bytes = int(self.cfg.bucket_mb * 2**20)
        if hasattr(self.source, "iter_full_weights"):
            return _checked(self.source.iter_full_weights(self.engine_dtype, bucket_bytes), version)
        named = self.named_tensors()
        _refuse_non_finite(named, version)
        return W.bucket_by_bytes(named, bucket_bytes)

    def _phase(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self._phases[name] += (now - since) * 1000.0
        return now

    def _on_all(self, fn):
        """fn(client) on every engine concurrently; raise WeightSyncError naming the engines that failed
        (EngineUnavailable when one of them could not be reached)."""
        futures = [self._pool.submit(fn, c) for c in self.clients]
        errors, answers, unreachable = [], [], False
        for url, f in zip(self.urls, futures):
            try:
                answer = f.result(timeout=self.cfg.timeout_s + 5)
            except Exception as e:  # refused update, dead engine, timeout
                errors.append(f"{url}: {type(e).__name__}: {e}")
                unreachable |= isinstance(e, EngineUnavailable)
                continue
            if isinstance(answer, dict) and answer.get("success") is False:
                errors.append(f"{url}: {answer.get('message')}")
            answers.append(answer)
        self._engine_timings = answers  # the last call's answers (the last bucket's)
        if errors:
            message = f"{self.transport} weight sync failed on {len(errors)} engine(s): " + "; ".join(errors)
            # a dead engine is the caller's to restart (train's loop does), not a reason to change transport
            raise (EngineUnavailable if unreachable else WeightSyncError)(message)

    def _send_tensor(self, buckets, version):
        for bucket, last in buckets:
            t = time.perf_counter()
            flat = W.FlattenedTensorBucket(named_tensors=bucket)  # a fresh buffer for every sync
            # staged: one contiguous copy onto each engine's own GPU
            payloads = [W.serialize_bucket(flat, torch.device(info["device"]) if self.transport == "staged" else None)
                        for info in self.infos]
            # No synchronize: sharing a CUDA storage records an IPC event on its stream after the
            # flatten (and the staged copy), and the receiver's rebuild makes its stream wait on it
            # (torch skips that wait only for a storage it still holds, i.e. memory that was never
            # freed and reused). So the HTTP call overlaps the flatten.
            by_client = {id(c): p for c, (p, _) in zip(self.clients, payloads)}
            t = self._phase("pack", t)
            self._on_all(lambda c: c.update_weights_from_tensor(
                by_client[id(c)], load_format="flattened_bucket", flush_cache=last,
                weight_version=version if last else None))
            t = self._phase("send", t)
            del flat, payloads, by_client  # acknowledged: the engines copied, synchronised, closed it
            if self.device.type == "cuda":
                # Buffers an engine still holds stay in torch's IPC limbo until released; this frees
                # those released since. No empty_cache(): the freed block stays in the caching
                # allocator and the next sync's bucket (or a training step) reuses it, whereas
                # cudaFree + cudaMalloc of ~1 GB would cost milliseconds every sync.
                torch.cuda.ipc_collect()
            self._phase("free", t)
        if self.transport == "staged":
            # Except for the staged copy: it lives on the ENGINE's GPU, whose memory the engine
            # budgeted for itself at startup; give it back (this is the no-P2P fallback anyway).
            torch.cuda.empty_cache()

    def _init_group(self):
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        addr = self.cfg.master_address
        listener = G.listen(addr, self.cfg.master_port)  # on master_address only; port 0: a free one
        port = self.store_port = listener.getsockname()[1]
        world = len(self.clients) + 1
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

    def _send_buffer(self, bucket) -> torch.Tensor:
        """The persistent uint8 send buffer on our device, grown to the largest bucket. Reusing it is
        safe: a broadcast has read it completely when it returns (work.wait orders our stream after
        the collective, so the next flatten into it cannot start earlier)."""
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        if self._send_buf is None or self._send_buf.numel() < nbytes:
            self._send_buf = None  # free the smaller one first
            self._send_buf = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._send_buf

    def _send_distributed(self, buckets, version):
        if self._group is None:
            self._init_group()
        for i, (bucket, last) in enumerate(buckets):
            start = time.perf_counter()
            names = [n for n, _ in bucket]
            dtypes = [dtype_name(t.dtype) for _, t in bucket]
            shapes = [list(t.shape) for _, t in bucket]
            # The engines' HTTP calls and our broadcast run at the same time (each side blocks in the
            # collective until the other joins); both have timeouts, so a dead peer cannot hang us.
            http = self._pool.submit(self._on_all, lambda c: c.update_weights_from_distributed(
                names, dtypes, shapes, group_name=self._group_name, load_format="flattened_bucket",
                weight_version=version if last else None, flush_cache=last, timeout=self.cfg.timeout_s))
            try:
                G.broadcast_weights(self._group, bucket, "flattened_bucket", self.cfg.timeout_s,
                                    out=self._send_buffer(bucket))
            except Exception as e:
                self._group = None  # a broken collective cannot be reused
                raise WeightSyncError(f"broadcast of bucket {i} failed: {type(e).__name__}: {e}") from e
            try:
                http.result(timeout=self.cfg.timeout_s + 10)
            except WeightSyncError:
                self._group = None
                raise
            self._phase("send", start)  # flatten + broadcast + the engines' swap (they overlap)

    def _send_disk(self, buckets, version):
        from safetensors.torch import save_file

        if not self._disk_dir:
            self._disk_dir = tempfile.mkdtemp(prefix="nano-miles-weights-")
        os.makedirs(self._disk_dir, exist_ok=True)
        start = time.perf_counter()
        tensors = {n: x.contiguous().cpu() for bucket, _ in buckets for n, x in bucket}
        tmp = os.path.join(self._disk_dir, ".model.safetensors.tmp")
        save_file(tensors, tmp)
        os.replace(tmp, os.path.join(self._disk_dir, "model.safetensors"))  # engines never see half a file
        start = self._phase("pack", start)
        self._on_all(lambda c: c.update_weights_from_disk(self._disk_dir, weight_version=version))
        self._phase("send", start)

    # ------------------------------------------------------------------ verify and close

    def verify(self, weight_version=None, named=None, ours: dict | None = None) -> None:
        """Compare each engine's per-tensor checksums (and weight_version) with ours (`ours`, else of
        `named`, else of the source's weights now); raise on any difference."""
        if ours is None:
            ours = W.checksums(self.named_tensors() if named is None else named)
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
            # Both ends tear the group down at once: NCCL's teardown on one side can wait for the other
            # (seen on 2 x H200: a sequential close stalled for the whole 60 s timeout).
            local = self._pool.submit(G.destroy_weight_update_group, self._group)
            for c in self.clients:
                try:
                    c.destroy_weights_update_group(self._group_name)
                except Exception:
                    pass  # the engine may be gone already
            try:
                local.result(timeout=self.cfg.timeout_s)
            except Exception:
                pass
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


def _refuse_non_finite(named, version: str) -> None:
    bad = W.non_finite(named)
    if bad is not None:
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


class _Buckets:
    """The buckets of one sync as (bucket, is_last) pairs, one ahead of the sender (the last one is
    known when it is sent). Counts bytes and buckets, times the gathering (the `prepare` phase) and,
    for verify, takes each tensor's checksum as it passes."""

    def __init__(self, source, phases: dict, checksum: bool):
        self.source, self.phases, self.checksum = iter(source), phases, checksum
        self.nbytes, self.count, self.checksums = 0, 0, {}

    def _next(self):
        t = time.perf_counter()
        bucket = next(self.source, None)
        self.phases["prepare"] += (time.perf_counter() - t) * 1000.0
        if bucket is not None:
            self.count += 1
            self.nbytes += sum(t.numel() * t.element_size() for _, t in bucket)
            if self.checksum:
                self.checksums.update(W.checksums(bucket))
        return bucket

    def __iter__(self):
        bucket = self._next()
        while bucket is not None:
            following = self._next()
            yield bucket, following is None
            bucket = following

    def close(self) -> None:
        close = getattr(self.source, "close", None)
        if close is not None:
            close()
