"""bench/results.py: every bench records one line in bench/results.jsonl, or, with --dry-run, none."""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from bench import results


def test_a_dry_run_records_nothing_and_a_run_appends_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(results, "RESULTS", str(tmp_path / "results.jsonl"))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    (tmp_path / "out").mkdir()
    ap = argparse.ArgumentParser()
    results.add_dry_run(ap)
    record = {"bench": "x", "value": 1}

    line = results.save(record, "x.json", dry_run=ap.parse_args(["--dry-run"]).dry_run)
    assert json.loads(line) == record
    assert not (tmp_path / "results.jsonl").exists() and not list((tmp_path / "out").iterdir())

    results.save(record, "x.json", dry_run=ap.parse_args([]).dry_run)
    assert [json.loads(x) for x in (tmp_path / "results.jsonl").read_text().splitlines()] == [record]
    assert json.loads((tmp_path / "out" / "x.json").read_text()) == record


def test_a_scratch_folder_lives_as_long_as_the_bench_process(tmp_path):
    """Random weights a bench writes for its engines are gone once it exits, files and all."""
    repo = Path(__file__).resolve().parents[2]
    child = ("from bench.results import scratch_dir; import os; d = scratch_dir('bench_test_');"
             "open(os.path.join(d, 'model.safetensors'), 'w').write('x'); print(d, os.path.isfile(os.path.join(d, 'model.safetensors')))")
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(repo), TMPDIR=str(tmp_path)))
    folder, existed = done.stdout.split()
    assert existed == "True" and Path(folder).parent == tmp_path
    assert not Path(folder).exists()
