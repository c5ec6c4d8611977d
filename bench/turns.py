"""Agentic turns on one engine, in process: what a step's rollout asks of it, without the sandbox.

M episodes of K turns. A turn's context is prefilled (the first: a system prefix all episodes share
plus a task of its own; each later one: everything so far plus an observation), D/4 to 2D tokens are
decoded (as a policy stops where it stops), then the tool "runs" for 0.5-1.5 T ms off the engine
(both seeded) before the next turn arrives. Random-initialised weights of the real shapes. Reports
the wall until every episode ended, the engine's prefill and decode busy seconds, and its prefill
and decode steps, for each
--continuous-decode-steps value (engine.num_continuous_decode_steps: decode steps run back to back
before a waiting prefill is taken), one after the other on the same engine; with --overlap-schedule,
then again on an engine with engine.overlap_schedule.

  PYTHONPATH=. python3 bench/turns.py --continuous-decode-steps 1,2,4,8       # GPU: 0.5B shapes, bf16
  PYTHONPATH=. python3 bench/turns.py --device cpu --shapes tiny --episodes 8 --turns 2 --decode 8 --dry-run
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.results import add_dry_run, git_commit, save, utc_now  # noqa: E402
from bench.train_step import SHAPES, model_config  # noqa: E402
from nano_miles.engine.engine import Engine, EngineConfig  # noqa: E402
from nano_miles.engine.sampling import SamplingParams  # noqa: E402
from transformers import Qwen2ForCausalLM  # noqa: E402


def run(engine: Engine, args, vocab: int) -> dict:
    """Every episode to its end; the wall, busy seconds and steps by kind."""
    rng = random.Random(1)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    system = tokens(args.system)
    context = [system + tokens(args.task) for _ in range(args.episodes)]
    turn, ready, running = [0] * args.episodes, [0.0] * args.episodes, {}
    busy, steps, ended = dict(engine.busy_s), {"prefill": 0, "decode": 0}, 0
    started = time.perf_counter()
    while ended < args.episodes:
        now = time.perf_counter()
        for i in range(args.episodes):
            if ready[i] is not None and ready[i] <= now:
                rid = f"e{i}-t{turn[i]}"
                engine.add_request(rid, context[i], SamplingParams(
                    max_new_tokens=rng.randint(max(1, args.decode // 4), 2 * args.decode), ignore_eos=True))
                running[rid], ready[i] = i, None
        if not engine.has_unfinished():
            time.sleep(0.0002)  # every episode is in its tool
            continue
        before = dict(engine.busy_s)
        finished = engine.step()
        kind = max(engine.busy_s, key=lambda k: engine.busy_s[k] - before.get(k, 0.0))
        steps[kind] = steps.get(kind, 0) + 1
        for out in finished:
            i = running.pop(out.rid)
            turn[i] += 1
            if turn[i] == args.turns:
                ended += 1
                continue
            context[i] = context[i] + out.output_ids + tokens(args.observation)
            ready[i] = time.perf_counter() + args.tool_ms / 1000 * rng.uniform(0.5, 1.5)
    wall = time.perf_counter() - started
    return {"wall_s": wall, "prefill_s": engine.busy_s["prefill"] - busy["prefill"],
            "decode_s": engine.busy_s["decode"] - busy["decode"], "prefill_steps": steps["prefill"],
            "decode_steps": steps["decode"], "turns_per_s": args.episodes * args.turns / wall}


def step_counts(value: str) -> list[int]:
    """--continuous-decode-steps: comma-separated integers >= 1 (argparse's one-line error otherwise)."""
    try:
        values = [int(v) for v in value.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {value!r}")
    return values


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--system", type=int, default=400, help="tokens of the shared system prefix")
    ap.add_argument("--task", type=int, default=120, help="tokens of each episode's task")
    ap.add_argument("--decode", type=int, default=130, help="mean tokens decoded a turn (D/4 to 2D)")
    ap.add_argument("--observation", type=int, default=60, help="tokens of each tool observation")
    ap.add_argument("--tool-ms", type=float, default=150.0, help="mean time a tool call keeps an episode off the engine")
    ap.add_argument("--continuous-decode-steps", type=step_counts, default="1,4",
                    help="comma-separated values to measure")
    ap.add_argument("--enable-torch-compile", action="store_true", help="engine.enable_torch_compile on every engine")
    ap.add_argument("--overlap-schedule", action="store_true",
                    help="then the same runs on a second engine with engine.overlap_schedule")
    add_dry_run(ap)
    args = ap.parse_args(argv)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    vocab, rows, engines = SHAPES[args.shapes]["vocab_size"], [], []
    with tempfile.TemporaryDirectory(prefix="bench_turns_") as folder:  # the weights, loaded once
        torch.manual_seed(0)
        Qwen2ForCausalLM(model_config(args.shapes)).save_pretrained(folder)
        for overlap in [False] + [True] * args.overlap_schedule:
            engines.append(Engine(EngineConfig(model=folder, device=args.device, dtype=dtype, num_kv_blocks=8192,
                                               enable_torch_compile=args.enable_torch_compile,
                                               overlap_schedule=overlap)))
    for engine in engines:
        overlap = engine.config.overlap_schedule
        run(engine, args, vocab)  # warm-up: CUDA graphs, kernels, allocator
        for n in args.continuous_decode_steps:
            engine.flush_cache()
            engine.scheduler.continuous_decode_steps = n
            r = {"continuous_decode_steps": n, "overlap_schedule": overlap, **run(engine, args, vocab)}
            rows.append(r)
            print(f"{'overlapped, ' if overlap else ''}continuous decode steps {n}: {r['wall_s']:.2f} s wall, prefill "
                  f"{r['prefill_s']:.2f} s in {r['prefill_steps']} steps, decode {r['decode_s']:.2f} s in "
                  f"{r['decode_steps']} steps, {r['turns_per_s']:.1f} turns/s")
    record = {"bench": "turns", "shapes": args.shapes, "dtype": dtype, "packed": engine.packed_prefill,
              "torch_compile": args.enable_torch_compile,
              "episodes": args.episodes, "turns": args.turns, "system": args.system, "task": args.task,
              "decode": args.decode, "observation": args.observation, "tool_ms": args.tool_ms,
              "runs": rows, "date": utc_now(), "commit": git_commit(),
              "machine": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else f"cpu x{os.cpu_count()}"}
    print(save(record, "turns.json", dry_run=args.dry_run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
