"""`nano-miles rollout`: run multi-turn rollouts on a task split and write the trajectories as JSONL.

    nano-miles rollout --model qwen2.5-coder-0.5b-instruct --tasks seed --group-size 8 --out r.jsonl
    nano-miles rollout --model M --engine-url http://h1:30000 --engine-url http://h2:30000 ...

Without --engine-url an engine (`nano-miles serve`) is started for the run and stopped after it.
Prints pass rate, mean reward and mean turns.
"""
from __future__ import annotations

import asyncio
import contextlib
import datetime
import json
import os
import platform
import subprocess
import time

from nano_miles.env import EnvConfig
from nano_miles.rollout import RolloutConfig, rollout_groups


def add_common_arguments(p, default_tasks: str) -> None:
    p.add_argument("--model", required=True, help="model name (see prepare-model) or HF folder; its tokenizer is used")
    p.add_argument("--engine-url", action="append", default=[], metavar="URL",
                   help="an SGLang-protocol engine (repeat for several); none: start one for this run")
    p.add_argument("--tasks", default=default_tasks, help="seed | train | heldout | all | comma-separated task ids")
    p.add_argument("--max-turns", type=int, default=6)
    p.add_argument("--max-new-tokens", type=int, default=256, help="per model turn")
    p.add_argument("--max-total-tokens", type=int, default=4096, help="prompt + response budget per episode")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="task seed: files and ground truth of every group")
    p.add_argument("--max-concurrency", type=int, default=64, help="episodes (sandboxes) in flight")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds per engine request, queueing included (raise it for slow CPU engines)")
    p.add_argument("--device", default="cpu", help="for the engine started here: cpu | cuda | cuda:N")
    p.add_argument("--dtype", default="auto", help="for the engine started here")
    p.add_argument("--results-jsonl", default=None,
                   help="append a summary line (date, commit, machine, figures) to this file")


def add_arguments(p) -> None:
    add_common_arguments(p, default_tasks="seed")
    p.add_argument("--group-size", type=int, default=8, help="samples per task")
    p.add_argument("--out", default=None, help="write trajectories here (JSONL, one per line)")


def rollout_config(args, group_size: int) -> RolloutConfig:
    return RolloutConfig(group_size=group_size, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                         max_concurrency=args.max_concurrency, request_timeout=args.request_timeout,
                         env=EnvConfig(max_turns=args.max_turns, max_total_tokens=args.max_total_tokens))


@contextlib.contextmanager
def engine_urls(args):
    """The engines to use: the given URLs, or one started for this run (stopped on exit)."""
    if args.engine_url:
        yield list(args.engine_url)
        return
    from nano_miles.client import start_engine_process
    from nano_miles.models import resolve_model

    print(f"starting an engine for {args.model} on {args.device} ...", flush=True)
    eng = start_engine_process(str(resolve_model(args.model)), device=args.device, dtype=args.dtype,
                               ready_timeout=900)
    try:
        yield [eng.url]
    finally:
        eng.stop()


def collect(args, tasks, group_size: int):
    """Run the rollouts; returns (trajectories, seconds, setup failures)."""
    from nano_miles.models import load_tokenizer

    tok = load_tokenizer(args.model)
    cfg = rollout_config(args, group_size)
    with engine_urls(args) as urls:
        t0 = time.monotonic()
        stats = {}
        trajs = asyncio.run(rollout_groups(urls, tok, tasks, cfg, seed=args.seed, stats=stats))
        return trajs, time.monotonic() - t0, stats["setup_failures"]


def solved(t) -> bool:
    return t.reward_components.get("correct", 0.0) > 0


def summarize(trajs, setup_failures: int = 0) -> dict:
    n = len(trajs)
    finish = {}
    for t in trajs:
        finish[t.finish_reason] = finish.get(t.finish_reason, 0) + 1
    model_tokens = sum(sum(t.response_mask) for t in trajs)
    return {
        "episodes": n,
        "pass_rate": sum(solved(t) for t in trajs) / n if n else 0.0,
        "mean_reward": sum(t.reward for t in trajs) / n if n else 0.0,
        "mean_turns": sum(t.num_turns for t in trajs) / n if n else 0.0,
        "infra_failures": setup_failures + sum(int(t.reward_components.get("infra_failures", 0)) for t in trajs),
        "finish_reasons": finish,
        "model_tokens": model_tokens,
    }


def provenance() -> dict:
    # BENCH_COMMIT first, as in bench/results.py: a device machine's copy of .git can be stale.
    try:
        commit = os.environ.get("BENCH_COMMIT") or subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = ""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": commit or "unknown", "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpu"}


def append_result(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({**provenance(), **record}) + "\n")


def run(args) -> int:
    from nano_miles.tasks import select_tasks

    if args.group_size < 1 or args.max_turns < 1:
        print("nano-miles rollout: --group-size and --max-turns must be >= 1")
        return 2
    try:
        tasks = select_tasks(args.tasks)
    except KeyError as e:
        print(f"nano-miles rollout: {e.args[0]}")
        return 2
    trajs, secs, setup_failures = collect(args, tasks, args.group_size)
    if args.out:
        with open(args.out, "w") as f:
            for t in trajs:
                f.write(t.to_json() + "\n")
    s = summarize(trajs, setup_failures)
    print(f"{len(tasks)} tasks x {args.group_size} samples = {s['episodes']} episodes in {secs:.1f}s "
          f"({s['model_tokens'] / max(secs, 1e-9):.0f} model tok/s)")
    print(f"pass rate {s['pass_rate']:.3f}   mean reward {s['mean_reward']:+.3f}   mean turns {s['mean_turns']:.2f}   "
          f"infra failures {s['infra_failures']}   finish {s['finish_reasons']}")
    if args.out:
        print(f"trajectories -> {args.out}")
    if args.results_jsonl:
        append_result(args.results_jsonl, {"kind": "rollout", "model": args.model, "tasks": args.tasks,
                                           "group_size": args.group_size, "max_turns": args.max_turns,
                                           "seconds": round(secs, 1), **s})
    return 0
