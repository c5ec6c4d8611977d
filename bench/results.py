"""Provenance and the results file shared by every benchmark in bench/.

Each run appends one JSON line to bench/results.jsonl carrying its date, commit and machine, and,
on the device machine (where $OUT is set), also writes that line to $OUT/<name> so it comes back.
"""
from __future__ import annotations

import datetime
import json
import os
import subprocess
import tempfile

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results.jsonl")


def git_commit() -> str:
    """BENCH_COMMIT when set (the device machine's copy of the tree has no .git), else git's HEAD."""
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(RESULTS)).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


_scratch: list[tempfile.TemporaryDirectory] = []


def scratch_dir(prefix: str) -> str:
    """A temporary folder (random weights a bench writes for its engines to load), removed with
    everything in it when the bench's process exits."""
    _scratch.append(tempfile.TemporaryDirectory(prefix=prefix))
    return _scratch[-1].name


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def add_dry_run(parser) -> None:
    """Every bench that records takes --dry-run (a rehearsal: its line printed, nothing recorded)."""
    parser.add_argument("--dry-run", action="store_true", help="print only; do not append to bench/results.jsonl")


def save(record: dict, out_name: str | None = None, extra_text: str | None = None, dry_run: bool = False) -> str:
    """Append the record to bench/results.jsonl; with $OUT set also write it (and extra_text, e.g. the
    printed table) to $OUT/out_name. Returns the JSON line. dry_run: record nothing, only return it."""
    line = json.dumps(record)
    if dry_run:
        return line
    with open(RESULTS, "a") as f:
        f.write(line + "\n")
    if out_name and os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], out_name), "w") as f:
            f.write((extra_text + "\n" if extra_text else "") + line + "\n")
    return line
