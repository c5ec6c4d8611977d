"""A loop step of a named recipe, run alone: N steps of `nano-miles train`, then one row of step
seconds (median, p90), where the rollout's wall went, tokens per step, sync ms (its phases, the engine's side
of its send) and parity.

  PYTHONPATH=. .venv/bin/python bench/loop_step.py --recipe ninth --steps 30          (one GPU)
  PYTHONPATH=. .venv/bin/python bench/loop_step.py --recipe tiny --steps 4            (CPU rehearsal)

Appends {"bench": "loop_step", ...} to bench/results.jsonl (and $OUT/loop_step.json on the device
machine). --skip N leaves the first N steps out of the figures (engine warm-up, CUDA graph capture);
--set key=value adds to the recipe.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.results import add_dry_run, git_commit, save, utc_now  # noqa: E402

# The ninth round's recipe (docs/headline/LOG.md), without its evaluations and checkpoints.
NINTH = ["model=qwen2.5-coder-0.5b-instruct", "mode=async", "tasks=train", "tasks_per_step=8",
         "rollout.group_size=8", "optim.lr=3e-6", "rollout.dynamic_sampling=true",
         "tasks_module=nano_miles.tasks.catalog_skills", "rollout.temperature=0.7", "rollout.guide_unsolved=true",
         "optim.lr_schedule=cosine", "optim.min_lr_ratio=0.1", "engine.num_kv_blocks=24576",
         "trainer_device=cuda:0", "engine.device=cuda:0", "seed=1"]
# The same loop on the tiny random model, on CPU: a rehearsal of the bench, not a figure of the GPU's.
TINY = ["model=tiny-random-qwen2", "mode=async", "tasks=kernel_name,word_count_total,nth_line,md5_file",
        "tasks_per_step=2", "rollout.group_size=4", "rollout.max_new_tokens=32", "rollout.dynamic_sampling=true",
        "rollout.guide_unsolved=true", "rollout.temperature=0.7", "optim.lr_schedule=cosine",
        "optim.min_lr_ratio=0.1", "trainer_device=cpu", "engine.device=cpu", "dtype=float32", "seed=1"]
RECIPES = {"ninth": NINTH, "tiny": TINY}
BREAKDOWN = ("rollout_s", "engine_prefill_s", "engine_decode_s", "engine_idle_s", "engine_busy_share",
             "generate_s", "sandbox_s", "env_s", "episode_s", "critical_path_s", "critical_generate_s",
             "critical_sandbox_s", "critical_turns", "commands_timed_out", "straggler_s", "refill_rounds",
             "refill_groups", "refill_s", "guide_s")


def median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def p90(values: list) -> float | None:
    values = sorted(v for v in values if v is not None)
    return values[min(len(values) - 1, int(0.9 * len(values)))] if values else None


def summarise(rows: list[dict]) -> dict:
    """The figures of a run's step rows: medians, and the step seconds' p90."""
    sync_keys = [k for k in (rows[0] if rows else {}) if k.startswith("sync_") and k.endswith("_ms") and k != "sync_ms"]
    # the send phase's parts (sync_send_ms is the phase itself)
    send_parts = [k for k in sync_keys if k.startswith("sync_send_") and k != "sync_send_ms"]
    engine_phases = [k for k in sync_keys if k.startswith("sync_engine_")]
    sync_phases = [k for k in sync_keys if k not in send_parts and k not in engine_phases]
    return {"steps_measured": len(rows),
            "step_s_median": median([r.get("step_s") for r in rows]), "step_s_p90": p90([r.get("step_s") for r in rows]),
            "breakdown_median": {k: median([r.get(k) for r in rows]) for k in BREAKDOWN},
            "response_tokens_per_step": median([r.get("response_tokens") for r in rows]),
            "trajectories_per_step": median([r.get("trajectories") for r in rows]),
            # async: trajectories too stale to train on, and (rollout.carry_over) groups handed to the next step
            "dropped_stale_per_step": median([r.get("dropped_stale") for r in rows]),
            "groups_carried_per_step": median([r.get("groups_carried") for r in rows]),
            "sync_ms_median": median([r.get("sync_ms") for r in rows]),
            "sync_phases_ms_median": {k[len("sync_"):-len("_ms")]: median([r.get(k) for r in rows]) for k in sync_phases},
            # the engine's side of the send phase
            "sync_engine_ms_median": {k[len("sync_engine_"):-len("_ms")]: median([r.get(k) for r in rows])
                                      for k in engine_phases},
            # the send phase split by wall-clock stamps: wake, to_engine, engine, from_engine
            "sync_send_ms_median": {k[len("sync_send_"):-len("_ms")]: median([r.get(k) for r in rows])
                                    for k in send_parts},
            "parity_mean_median": median([r.get("parity_mean") for r in rows]),
            "parity_stale_mean_median": median([r.get("parity_stale_mean") for r in rows]),
            "parity_max": max((r["parity_max"] for r in rows if r.get("parity_max") is not None), default=None)}


def machine() -> str:
    try:
        import torch
        if torch.cuda.is_available():
            return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    except ImportError:
        pass
    return f"{platform.machine()} cpu x{os.cpu_count()}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="ninth")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--skip", type=int, default=1, help="first steps left out of the figures (warm-up)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--run-dir", help="keep the run here (default: a temporary directory)")
    add_dry_run(ap)
    args = ap.parse_args(argv)
    if args.steps <= args.skip:
        print(f"loop_step: --steps ({args.steps}) must be more than --skip ({args.skip})", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="loop_step_") as tmp:
        run_dir = Path(args.run_dir or Path(tmp) / "run")
        sets = RECIPES[args.recipe] + [f"steps={args.steps}", "checkpoint_every=1000000", "eval_every=0",
                                       f"run_dir={run_dir}"] + args.sets
        cmd = [sys.executable, "-m", "nano_miles.cli", "train"] + [a for kv in sets for a in ("--set", kv)]
        print(" ".join(cmd), file=sys.stderr)
        path = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")]))
        done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": path})  # keeps the device's /tmp/site
        metrics = run_dir / "metrics.jsonl"
        if done.returncode != 0 or not metrics.is_file():
            print(f"loop_step: the run failed (exit {done.returncode})", file=sys.stderr)
            return 1
        rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("step", 0) > args.skip]
    record = {"bench": "loop_step", "recipe": args.recipe, "steps": args.steps, "skipped": args.skip,
              "extra_sets": args.sets, **summarise(rows), "date": utc_now(), "commit": git_commit(),
              "machine": machine()}
    print(save(record, "loop_step.json", dry_run=args.dry_run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
