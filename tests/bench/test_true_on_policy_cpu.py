"""bench/true_on_policy_cpu.py: bad input gets one line before anything runs or is recorded."""
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_fewer_than_one_repeat_is_refused_in_one_line_and_nothing_is_recorded():
    results = REPO / "bench" / "results.jsonl"
    before = results.read_bytes()
    done = subprocess.run([sys.executable, str(REPO / "bench" / "true_on_policy_cpu.py"), "--repeats", "0"],
                          env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == "true_on_policy_cpu.py: error: --repeats must be at least 1, got 0"
    assert "Traceback" not in done.stderr
    assert results.read_bytes() == before
