"""The figures of bench/side_by_side.sh's arms: one {"bench": "side_by_side", ...} row per arm.

  python bench/side_by_side.py DIR --arm new=<commit> --arm old=f4cd568 --device "one NVIDIA H100" \
      [--extra new="rollout.carry_over=true max_staleness=3"] [--dry-run]

DIR holds what `side_by_side.sh watch` brought back: ARM_metrics.jsonl and ARM_evals.jsonl. Steps an
hour are counted twice: over the steps' own seconds, and over the run's wall clock to its last step
(start-up, engine launch and the first CUDA graph captures included).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.loop_step import summarise  # noqa: E402
from bench.results import add_dry_run, save, utc_now  # noqa: E402


def arm_row(directory: Path, arm: str, commit: str, device: str, extra: str = "") -> dict:
    metrics = directory / f"{arm}_metrics.jsonl"
    if not metrics.is_file():
        raise SystemExit(f"side_by_side: no {metrics} (did `side_by_side.sh watch` bring it back?)")
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "step_s" in r]
    if not steps:
        raise SystemExit(f"side_by_side: {arm} has no step rows in {directory}")
    evals = directory / f"{arm}_evals.jsonl"
    heldout = [json.loads(line) for line in evals.read_text().splitlines() if line.strip()] if evals.is_file() else []
    parity = [r["parity_mean"] for r in steps if r.get("parity_mean") is not None]
    return {"bench": "side_by_side", "arm": arm, "date": utc_now(), "commit": commit, "machine": device,
            "recipe": "ninth", "extra": extra, "steps": len(steps), **summarise(steps),
            "steps_per_hour": round(3600 * len(steps) / sum(r["step_s"] for r in steps), 1),
            "steps_per_hour_wall": round(3600 * len(steps) / steps[-1]["elapsed_s"], 1),
            "parity_mean": statistics.mean(parity) if parity else None,
            "acc_first_last": [steps[0].get("acc"), steps[-1].get("acc")],
            "heldout_pass_at_1": _pass_at_1(heldout[-1]) if heldout else None,
            "heldout_protocol": ({k: heldout[-1].get(k) for k in ("samples", "instances", "temperature", "seed")}
                                 if heldout else None)}


def _pass_at_1(record: dict) -> float:
    """All tasks' pass@1, weighted by each family's task count (the eval's `all` line)."""
    families = record["per_family"].values()
    return round(sum(f["tasks"] * f["pass@1"] for f in families) / sum(f["tasks"] for f in families), 4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir", type=Path)
    p.add_argument("--arm", action="append", required=True, help="NAME=COMMIT, in the order they ran")
    p.add_argument("--device", required=True, help="the machine the arms ran on, in words")
    p.add_argument("--extra", action="append", default=[], help='NAME="key=value ...": the --set pairs an arm added')
    add_dry_run(p)
    args = p.parse_args()
    extras = dict(spec.partition("=")[::2] for spec in args.extra)
    for spec in args.arm:
        arm, _, commit = spec.partition("=")
        print(save(arm_row(args.dir, arm, commit, args.device, extras.get(arm, "")), dry_run=args.dry_run))


if __name__ == "__main__":
    main()
