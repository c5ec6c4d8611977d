"""True on-policy mode against normal mode on CPU: the same 1-step run of the tiny model (fp32,
group 4, 2 tasks, up to 256 tokens a turn over 6 turns), --repeats times each (3), the modes in turn.

A step is its rollout plus its update (`step_s` in metrics.jsonl); the row gives both modes' median runs,
the ratio (goal: true on-policy within 2x of normal mode) and the parity true on-policy kept (0.0).

  PYTHONPATH=. .venv/bin/python bench/true_on_policy_cpu.py            # --dry-run: a rehearsal, nothing recorded
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.results import add_dry_run, git_commit, save, utc_now  # noqa: E402

SETS = ["model=tiny-random-qwen2", "steps=1", "dtype=float32", "report_to=none"]


def one_run(true_on_policy: bool, run_dir: str) -> dict:
    sets = SETS + [f"run_dir={run_dir}", f"true_on_policy={str(true_on_policy).lower()}"]
    cmd = [sys.executable, "-m", "nano_miles.cli", "train"] + [a for s in sets for a in ("--set", s)]
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if done.returncode != 0:  # its last line says why (nano-miles prints one line for bad input)
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        sys.exit(f"true_on_policy_cpu: nano-miles train (true_on_policy={true_on_policy}) failed: {last}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        row = json.loads(f.readline())
    return {"step_s": round(row["step_s"], 2), "rollout_s": round(row["rollout_s"], 2),
            "update_s": round(row["step_s"] - row["rollout_s"], 2), "response_tokens": row["response_tokens"],
            "parity_max": row["parity_max"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3,
                    help="runs of each mode, taken in turn; the row gives each mode's median run (default 3)")
    add_dry_run(ap)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats must be at least 1, got {args.repeats}")
    runs = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):  # in turn, so a slow spell of the machine falls on both modes
            for exact in (False, True):
                runs[exact].append(one_run(exact, os.path.join(tmp, f"{exact}-{i}")))
    # each mode's median run (the lower middle one for an even count), whole: its rollout and update stay together
    normal, exact = (sorted(runs[m], key=lambda r: r["step_s"])[(len(runs[m]) - 1) // 2] for m in (False, True))
    record = {"bench": "true_on_policy_cpu", "normal": normal, "true_on_policy": exact,
              "slower_x": round(exact["step_s"] / normal["step_s"], 2), "repeats": args.repeats,
              "step_s_runs": {"normal": [r["step_s"] for r in runs[False]],
                              "true_on_policy": [r["step_s"] for r in runs[True]]},
              "parity_max_true_on_policy": max(r["parity_max"] for r in runs[True]),
              "date": utc_now(), "commit": git_commit(), "machine": f"{platform.machine()}, {os.cpu_count()} cores, no GPU"}
    print(save(record, dry_run=args.dry_run))


if __name__ == "__main__":
    main()
