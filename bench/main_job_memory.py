"""The main job's memory, disk and time: `nano-miles train` run as a child, its process tree sampled.

Every --interval seconds it reads the proportional set size (PSS, /proc/PID/smaps_rollup) of the
train process and of every descendant: the engine (`nano-miles serve`), the sandboxes (bwrap, their
shells and commands) and anything else. PSS charges a page shared by N processes 1/N to each, so the
sum over the tree counts shared memory once (a weight file in /dev/shm mapped by the trainer and the
engine, torch's shared tensors); RSS would count it twice. It records the peak of that sum (and each
role's own peak and RSS), the run directory's size at the end, the wall time, and the phase the peak
fell in (from the run's own output lines).

  PYTHONPATH=. .venv/bin/python bench/main_job_memory.py                       # the default job, 1 step
  PYTHONPATH=. .venv/bin/python bench/main_job_memory.py --steps 8             # the whole default job
  PYTHONPATH=. .venv/bin/python bench/main_job_memory.py --set model=tiny-random-qwen2 --dry-run  # a rehearsal

One line goes to bench/results.jsonl (bench/results.py), unless --dry-run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.results import add_dry_run, git_commit, save, utc_now  # noqa: E402

GB = 1e9


def pss_bytes(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of one process in bytes; (0, 0) if it is gone."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line and not line.startswith(" "))
        kb = {k: int(v.split()[0]) for k, v in fields.items() if v.strip().endswith("kB")}
        return kb.get("Pss", 0) * 1024, kb.get("Rss", 0) * 1024
    except (OSError, ValueError):
        return 0, 0


def role(proc: psutil.Process, root_pid: int) -> str:
    if proc.pid == root_pid:
        return "trainer"
    try:
        cmd = " ".join(proc.cmdline())
    except psutil.Error:
        return "other"
    if "nano_miles.cli serve" in cmd or "nano-miles serve" in cmd:
        return "engine"
    return "sandboxes"  # bwrap, the sandbox inits and launchers, the policy's commands


def dir_bytes(path: Path) -> int:
    """Disk the directory takes, as `du` counts it: a hard-linked file (final/ shares checkpoint/'s
    weights) once, by its allocated blocks."""
    total, seen = 0, set()
    for p in path.rglob("*"):
        try:
            st = p.lstat()
        except OSError:
            continue
        if p.is_file() and not p.is_symlink() and (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


class Sampler(threading.Thread):
    def __init__(self, root_pid: int, interval: float, min_available: float):
        super().__init__(daemon=True)
        self.root_pid, self.interval, self.min_available = root_pid, interval, min_available
        self.aborted = ""
        self.timeline: list[dict] = []
        self.stop = threading.Event()
        self.peak = {"total_pss": 0}
        self.role_peak_pss: dict[str, int] = {}
        self.role_peak_rss: dict[str, int] = {}
        self.samples = 0

    def sample(self) -> None:
        try:
            root = psutil.Process(self.root_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return
        by_role: dict[str, list[int]] = {}
        for p in procs:
            pss, rss = pss_bytes(p.pid)
            acc = by_role.setdefault(role(p, self.root_pid), [0, 0])
            acc[0] += pss
            acc[1] += rss
        total = sum(v[0] for v in by_role.values())
        self.samples += 1
        self.timeline.append({"t": time.monotonic(), **{r: v[0] for r, v in by_role.items()}})
        available = psutil.virtual_memory().available
        if available < self.min_available and not self.aborted:
            # A shared machine: stop the run before the kernel's OOM killer picks somebody else's process.
            self.aborted = f"stopped: MemAvailable {available / GB:.1f} GB < {self.min_available / GB:.1f} GB"
            for p in reversed(procs):
                try:
                    p.kill()
                except psutil.Error:
                    pass
        for r, (pss, rss) in by_role.items():
            self.role_peak_pss[r] = max(self.role_peak_pss.get(r, 0), pss)
            self.role_peak_rss[r] = max(self.role_peak_rss.get(r, 0), rss)
        if total > self.peak["total_pss"]:
            self.peak = {"total_pss": total, "t": time.monotonic(),
                         "by_role_pss": {r: v[0] for r, v in by_role.items()}}

    def run(self) -> None:
        while not self.stop.is_set():
            self.sample()
            self.stop.wait(self.interval)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="passed to nano-miles train")
    ap.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    ap.add_argument("--run-dir", default="", help="default: a temporary folder, removed afterwards")
    ap.add_argument("--min-available-gb", type=float, default=1.5,
                    help="kill the run if the machine's MemAvailable falls below this (a shared machine)")
    ap.add_argument("--label", default="", help="what this run measures (kept in the record)")
    ap.add_argument("--timeline", default="", help="write every sample (seconds, PSS per role) and the output lines here")
    add_dry_run(ap)
    args = ap.parse_args()

    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="main-job-", dir=os.environ.get("BENCH_TMP")))
    cmd = [sys.executable, "-m", "nano_miles.cli", "train", "--set", f"steps={args.steps}",
           "--set", f"run_dir={run_dir}"]
    for kv in args.set:
        cmd += ["--set", kv]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    sampler = Sampler(proc.pid, args.interval, args.min_available_gb * GB)
    sampler.start()
    lines: list[tuple[float, str]] = []
    for line in proc.stdout:  # the run's own output, with the time each line came
        lines.append((time.monotonic(), line.rstrip()))
        print(f"[{time.monotonic() - t0:7.1f}s] {line.rstrip()}", flush=True)
    rc = proc.wait()
    wall = time.monotonic() - t0
    sampler.stop.set()
    sampler.join()
    size = dir_bytes(run_dir)
    listing = sorted(str(p.relative_to(run_dir)) for p in run_dir.iterdir()) if run_dir.exists() else []
    if not args.run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)

    peak = sampler.peak
    if args.timeline:
        with open(args.timeline, "w") as f:
            for row in sampler.timeline:
                f.write(json.dumps({"s": round(row.pop("t") - t0, 2), **{k: round(v / GB, 3) for k, v in row.items()}}) + "\n")
            for t, text in lines:
                f.write(json.dumps({"s": round(t - t0, 2), "line": text[:200]}) + "\n")
    before = [text for t, text in lines if "t" in peak and t <= peak["t"]]
    record = {
        "bench": "main_job_memory", "date": utc_now(), "commit": git_commit(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpu, {psutil.virtual_memory().total / 2**30:.0f} GiB",
        "label": args.label, "steps": args.steps, "sets": args.set, "rc": rc, "aborted": sampler.aborted,
        "wall_s": round(wall, 1),
        "peak_pss_gb": round(peak["total_pss"] / GB, 3),
        "peak_by_role_pss_gb": {r: round(v / GB, 3) for r, v in peak.get("by_role_pss", {}).items()},
        "role_peak_pss_gb": {r: round(v / GB, 3) for r, v in sampler.role_peak_pss.items()},
        "role_peak_rss_gb": {r: round(v / GB, 3) for r, v in sampler.role_peak_rss.items()},
        "peak_at_s": round(peak["t"] - t0, 1) if "t" in peak else None,
        "peak_after_line": before[-1][:160] if before else "",
        "run_dir_gb": round(size / GB, 3), "run_dir_entries": listing,
        "samples": sampler.samples,
    }
    print(f"peak PSS of the whole tree {record['peak_pss_gb']} GB at {record['peak_at_s']} s "
          f"({record['peak_by_role_pss_gb']}); run dir {record['run_dir_gb']} GB {listing}; "
          f"wall {record['wall_s']} s; exit {rc}")
    save(record, "main_job_memory.json", dry_run=args.dry_run)
    return rc


if __name__ == "__main__":
    sys.exit(main())
