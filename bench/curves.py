"""Several runs' curves on one set of axes (nano_miles.telemetry.compare_curves): the figures of
docs/benchmarks.md that compare runs differing in one setting.

  PYTHONPATH=. .venv/bin/python bench/curves.py --out DIR LABEL=RUN/metrics.jsonl [LABEL=... ...]

Writes DIR/compare_<key>.png for reward, accuracy, entropy, parity, each in-run evaluation and each
part of where a step's time went (step seconds, engine busy share, sandbox and env shares, the slowest
episode, refill rounds) that any of the runs has, and prints their paths.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nano_miles.telemetry import compare_curves  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="directory for the PNGs (made if missing)")
    ap.add_argument("runs", nargs="+", metavar="LABEL=METRICS", help="a run's label and its metrics.jsonl")
    args = ap.parse_args(argv)
    runs = {}
    for spec in args.runs:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            print(f"curves: {spec!r} is not LABEL=METRICS (e.g. c1=runs/c1/metrics.jsonl)", file=sys.stderr)
            return 2
        if not Path(path).is_file():
            print(f"curves: no metrics file at {path} (run {label!r})", file=sys.stderr)
            return 2
        runs[label] = path
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for png in compare_curves(runs, args.out):
        print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
