"""Weight sync end to end: trainer (this process, cuda:0) -> engine server process (cuda:1).

Random-init Qwen2.5-0.5B shapes in bf16 (~0.92 GiB). For each transport: the time from the
trainer's sync() call until the engine has swapped in the new weights and answered (it serves the
new weight_version from then on), median of --repeats after two warm-ups, checksums verified once.
Against, in the same run: a raw device-to-device copy of the same bytes (one flat buffer, and one
copy per tensor). Also the train/inference log-prob parity of the bf16 trainer against the bf16
engine on rollouts it sampled.

With --engines M (M engine processes, on --engine-devices), every transport is measured twice in the
same run: the sync to the first engine alone, and the sync to all M (what `engine.replicas=M` does each
step); the table gives their ratio (goal: M=2 within 1.3x of M=1, since a broadcast is one-to-many).

  PYTHONPATH=. python3 bench/weight_sync.py                               # 2 GPUs
  PYTHONPATH=. python3 bench/weight_sync.py --engines 2 --engine-devices cuda:1,cuda:2 \
      --transports distributed,ipc --label replicas                       # 3 GPUs: 1 trainer, 2 engines
  NCCL_P2P_DISABLE=1 PYTHONPATH=. python3 bench/weight_sync.py --transports distributed --label nccl-no-p2p
  PYTHONPATH=. python3 bench/weight_sync.py --shapes tiny --trainer-device cpu --engine-device cpu \
      --transports distributed,disk,ipc                                   # CPU smoke run
  PYTHONPATH=. python3 bench/weight_sync.py --trainer-device cuda:0 --engine-device cuda:0 \
      --transports ipc --busy-requests 64 --label in-loop       # one GPU, syncs during rollouts
  PYTHONPATH=. python3 bench/weight_sync.py --shapes tiny --trainer-device cpu --engine-device cpu \
      --engines 2 --transports distributed,ipc --dry-run                  # CPU rehearsal of --engines
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import platform
import statistics
import sys
import threading
import time

import torch

from bench.results import add_dry_run, git_commit, save, scratch_dir, utc_now
from bench.train_step import SHAPES, make_model
from nano_miles.rollout.batch import Trajectory, build_rollout_batch
from nano_miles.engine.process import start_engine_process
from nano_miles.trainer.trainer import Trainer, TrainerConfig
from nano_miles.trainer.weight_sync import WeightSync


T0 = time.perf_counter()


def progress(msg):
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def watchdog(seconds, engine_holder):
    """After `seconds`, print every thread's stack and the engine's log tail, then exit: a hang in
    CI-less GPU runs must say where it is."""
    def fire():
        progress(f"WATCHDOG: no result after {seconds:.0f}s; stacks and engine log follow")
        faulthandler.dump_traceback(file=sys.stdout, all_threads=True)
        for engine in engine_holder:
            print(f"---- engine {engine.url} log (tail) ----\n" + engine.log()[-4000:], flush=True)
            engine.stop()
        os._exit(3)
    t = threading.Timer(seconds, fire)
    t.daemon = True
    t.start()
    return t


def sync_devices(*devices):
    for d in devices:
        if d.type == "cuda":
            torch.cuda.synchronize(d)


def time_ms(fn, devices, warmup=3, repeats=10):
    out = []
    for i in range(warmup + repeats):
        sync_devices(*devices)
        t0 = time.perf_counter()
        fn()
        sync_devices(*devices)
        if i >= warmup:
            out.append((time.perf_counter() - t0) * 1000)
    return statistics.median(out)


def raw_copies(named, src_dev, dst_dev):
    """Device-to-device copy of the same bytes: one flat buffer, and one copy per tensor."""
    flat = torch.cat([t.flatten().view(torch.uint8) for _, t in named])
    dst = torch.empty_like(flat, device=dst_dev)
    one = time_ms(lambda: dst.copy_(flat, non_blocking=True), [src_dev, dst_dev])
    dsts = [torch.empty_like(t, device=dst_dev) for _, t in named]

    def per_tensor():
        for d, (_, t) in zip(dsts, named):
            d.copy_(t, non_blocking=True)
    many = time_ms(per_tensor, [src_dev, dst_dev])
    del flat, dst, dsts
    return one, many


def parity(trainer, client, n=8, new_tokens=64, vocab=1000):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (32,), generator=g).tolist() for _ in range(n)]
    outs = client.generate_batch(prompts, {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True})
    trajs = [Trajectory(prompt_ids=p, response_ids=o["output_ids"],
                        response_logprobs=[lp for lp, _, _ in o["meta_info"]["output_token_logprobs"]],
                        response_mask=[True] * len(o["output_ids"])) for p, o in zip(prompts, outs)]
    batch = build_rollout_batch(trajs)
    diff = (trainer.logprobs(batch) - batch.rollout_logprobs)[batch.loss_mask].abs()
    return diff.mean().item(), diff.max().item()


def median_phases(dicts) -> dict:
    """{phase: median ms} over the timed syncs (phases missing from a sync are skipped)."""
    keys = [k for k in (dicts[0] or {})] if dicts else []
    return {k: round(statistics.median(d[k] for d in dicts if d and k in d), 3) for k in keys}


def keep_busy(client, requests: int, vocab: int, stop: threading.Event) -> threading.Thread:
    """Rollouts running on the engine while it is synced, as in train.py's async mode: each sync then
    pauses them in place (waiting out the running forward step), swaps and continues them."""
    prompts = [[(7 * i + j) % vocab for j in range(32)] for i in range(requests)]

    def run():
        while not stop.is_set():
            client.generate_batch(prompts, {"max_new_tokens": 256, "temperature": 0.7, "ignore_eos": True})
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def measure(trainer, clients, urls, transport, args, nbytes, raw_one) -> dict:
    """Median sync time of `transport` to the engines at `urls` (each checked: version and checksums)."""
    stop = threading.Event()
    busy = [keep_busy(c, args.busy_requests, min(1000, SHAPES[args.shapes]["vocab_size"]), stop)
            for c in clients] if args.busy_requests else []
    try:
        return _measure(trainer, clients, urls, transport, args, nbytes, raw_one)
    finally:
        stop.set()
        for thread in busy:
            thread.join(timeout=args.timeout_s)


def _measure(trainer, clients, urls, transport, args, nbytes, raw_one) -> dict:
    with WeightSync(trainer, urls, transport=transport, bucket_mb=args.bucket_mb, timeout_s=args.timeout_s) as ws:
        times, phases, engine_ms, fast = [], [], [], []
        for i in range(2 + args.repeats):
            with torch.no_grad():  # a real update each time, so no stale state can pass
                trainer.params[0].add_(1e-2 if i % 2 else -1e-2)
            sync_devices(trainer.device)  # as train.py: the update's queued kernels are not the sync's
            stats = ws.sync(f"{transport}-{len(urls)}-{i}")
            progress(f"{transport} sync {i} to {len(urls)} engine(s): {stats['ms']:.1f} ms ({ws.transport})")
            if i >= 2:
                times.append(stats["ms"])
                phases.append(stats["phases_ms"])
                engine_ms.append(stats["engine_ms"])
                fast.append(stats["fast_path"])
        for client in clients:
            assert client.weight_version() == f"{transport}-{len(urls)}-{i}"
        ws.verify(f"{transport}-{len(urls)}-{i}")  # sha256 of every tensor on every engine (not timed)
        name = transport if transport != "auto" else f"auto={ws.transport}"
    ms = statistics.median(times)
    return dict(transport=name, engines=len(urls), ms=ms, gib_per_s=nbytes / 2**30 / (ms / 1000),
                vs_raw=ms / raw_one if raw_one == raw_one else None, buckets=stats["buckets"],
                verified=True, min_ms=min(times), max_ms=max(times), fast_path=all(fast),
                phases_ms=median_phases(phases), engine_ms=median_phases(engine_ms))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--trainer-device", default="cuda:0")
    ap.add_argument("--engine-device", default="cuda:1" if torch.cuda.device_count() > 1 else "cuda:0",
                    help="default: the second GPU, the trainer's own on a one-GPU machine")
    ap.add_argument("--engines", type=int, default=1, help="engine processes; M > 1 also measures the sync to all M")
    ap.add_argument("--engine-devices", default="", help="comma-separated, one per engine (cycled); "
                    "default: --engine-device for every engine")
    ap.add_argument("--transports", default="disk,distributed,auto,ipc")
    ap.add_argument("--bucket-mb", type=float, default=1024.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--label", default="")
    ap.add_argument("--watchdog-s", type=float, default=240.0)
    ap.add_argument("--timeout-s", type=float, default=60.0, help="per HTTP call / broadcast / rendezvous")
    add_dry_run(ap)
    ap.add_argument("--busy-requests", type=int, default=0, help="requests each engine decodes during "
                    "the syncs (train.py's async mode: the in-loop sync); 0: idle engines")
    ap.add_argument("--parity-tokens", type=int, default=64, help="new tokens per parity rollout (0: skip)")
    args = ap.parse_args()
    engine_holder = []
    watchdog(args.watchdog_s, engine_holder)
    tdev, edev = torch.device(args.trainer_device), torch.device(args.engine_device)
    dtype = "bfloat16" if tdev.type == "cuda" else "float32"

    progress(f"building the model on {tdev}")
    model = make_model(args.shapes, tdev)
    for p in model.parameters():  # parameters only (RoPE buffers stay float32)
        p.data = p.data.to(getattr(torch, dtype))
    folder = scratch_dir("bench-weight-sync-")
    model.save_pretrained(folder)  # the engine starts from these weights (no tokenizer needed)
    trainer = Trainer(TrainerConfig(device=str(tdev), dtype=dtype, micro_batch_size=8), model=model)
    named = trainer.named_weights()
    nbytes = sum(t.numel() * t.element_size() for _, t in named)

    raw_one = raw_many = float("nan")
    if tdev.type == "cuda" and edev.type == "cuda":
        progress("raw device-to-device copies")
        raw_one, raw_many = raw_copies(named, tdev, edev)
    if args.engines < 1:
        ap.error(f"--engines must be >= 1, got {args.engines}")
    devices = args.engine_devices.split(",") if args.engine_devices else [args.engine_device]
    devices = [devices[i % len(devices)] for i in range(args.engines)]
    progress(f"starting {args.engines} engine process(es) on {', '.join(devices)}")
    rows, parity_row, engines = [], None, []
    try:
        for device in devices:  # one at a time: each sizes its KV cache with the others already loaded
            engines.append(start_engine_process(
                folder, device=device, dtype=dtype, ready_timeout=600,
                # With requests decoding, the engine steps as in a training run (CUDA graphs): a sync's
                # pause waits out one such step, not an eager one.
                extra_args=([] if args.busy_requests else ["--no-cuda-graph"]) + [
                            "--num-kv-blocks", str(max(512, 24 * args.busy_requests)),
                            "--max-running-requests", str(max(16, args.busy_requests)),
                            "--dist-timeout", str(args.timeout_s)]))
            engine_holder.append(engines[-1])
            progress(f"engine ready at {engines[-1].url} ({device})")
        clients = [e.client(timeout=600) for e in engines]
        urls = [e.url for e in engines]
        try:
            if args.parity_tokens:
                parity_row = parity(trainer, clients[0], new_tokens=args.parity_tokens,
                                    vocab=min(1000, SHAPES[args.shapes]["vocab_size"]))
        except Exception as e:
            print(f"parity: FAILED: {type(e).__name__}: {e}", flush=True)
        progress(f"parity: {parity_row}")
        # The same run syncs to one engine, then (--engines M) to all M: their ratio is the cost of a replica.
        for transport in [t for t in args.transports.split(",") if t]:
            for k in sorted({1, args.engines}):
                try:
                    rows.append(measure(trainer, clients[:k], urls[:k], transport, args, nbytes, raw_one))
                except Exception as e:  # one broken transport must not hide the others' figures
                    progress(f"{transport} to {k} engine(s): FAILED: {type(e).__name__}: {e}")
                    rows.append(dict(transport=transport, engines=k, error=f"{type(e).__name__}: {e}"[:500]))
        for c in clients:
            c.close()
    finally:
        for e in engines:
            e.stop()

    name = torch.cuda.get_device_name(tdev) if tdev.type == "cuda" else platform.processor() or "cpu"
    label = f" [{args.label}]" if args.label else ""
    print(f"\nWeight sync{label}: {args.shapes} shapes, {nbytes / 2**30:.3f} GiB {dtype}, trainer {tdev} -> "
          f"engine process(es) {', '.join(devices)}, on {torch.cuda.device_count()} x {name}")
    print(f"raw device-to-device copy of the same bytes: one buffer {raw_one:.2f} ms, "
          f"{len(named)} separate copies {raw_many:.2f} ms")
    print(f"{'transport':12s} {'engines':>7s} {'ms (median)':>12s} {'GiB/s':>8s} {'x raw copy':>11s} "
          f"{'min..max ms':>16s} {'verified':>9s} {'x 1 engine':>10s}")
    one = {r["transport"]: r["ms"] for r in rows if r.get("engines") == 1 and "error" not in r}
    for r in rows:
        if "error" in r:
            print(f"{r['transport']:12s} {r['engines']:7d} failed: {r['error']}")
            continue
        vs = f"{r['vs_raw']:.1f}" if r["vs_raw"] is not None else "-"
        r["vs_one_engine"] = r["ms"] / one[r["transport"]] if r["transport"] in one else None
        ratio = f"{r['vs_one_engine']:.2f}" if r["vs_one_engine"] is not None else "-"
        print(f"{r['transport']:12s} {r['engines']:7d} {r['ms']:12.1f} {r['gib_per_s']:8.1f} {vs:>11s} "
              f"{r['min_ms']:7.1f}..{r['max_ms']:<8.1f} {str(r['verified']):>9s} {ratio:>10s}")
    if args.engines > 1:
        print(f"goal: {args.engines} engines within 1.3x of one (x 1 engine column)")
    print("\nwhere the time goes (CPU wall ms, medians). trainer: pause = waiting, after the first bucket "
          "is packed, for the engines to pause in place (their running step finished), resume = continued; prepare = named tensors + bucket split, "
          "pack = flatten + serialize (+ wait for the GPU), send = HTTP/broadcast until every engine answered, "
          "free = release the bucket. engine: parse = JSON body, decode (incl. CUDA IPC open) or receive (the "
          "broadcast), wait = hand-off to the engine thread + drain, copy = the copy until complete + KV flush, "
          "release = IPC close, answer = back to the event loop; http = send - engine total")
    for r in rows:
        if "error" in r:
            continue
        ph, en = r["phases_ms"], r["engine_ms"] or {}
        http = ph.get("send", 0.0) - en.get("total", 0.0) if en else float("nan")
        eng = " ".join(f"{k} {v:.2f}" for k, v in en.items())
        print(f"{r['transport']:12s} {r['engines']} engine(s), one copy: {str(r['fast_path']):5s} | trainer: "
              + " ".join(f"{k} {v:.2f}" for k, v in ph.items()) + f" | engine: {eng} | http {http:.2f}")
    if parity_row:
        print(f"log-prob parity, trainer vs engine ({dtype}, 8 x {args.parity_tokens} sampled tokens): "
              f"mean {parity_row[0]:.2e}, max {parity_row[1]:.2e}")
    record = dict(bench="weight_sync", label=args.label, date=utc_now(), commit=git_commit(), machine=f"{torch.cuda.device_count()} x {name}", torch=torch.__version__,
                  config=vars(args), bytes=nbytes, raw_copy_ms=raw_one, raw_per_tensor_ms=raw_many,
                  parity_mean=parity_row and parity_row[0], parity_max=parity_row and parity_row[1],
                  nccl_p2p_disable=os.environ.get("NCCL_P2P_DISABLE"), results=rows)
    save(record, f"weight_sync{('_' + args.label) if args.label else ''}.json", dry_run=args.dry_run)


if __name__ == "__main__":
    main()
