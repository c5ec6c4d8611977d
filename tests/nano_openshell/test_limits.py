"""Limits hold in every tier: memory, file size, CPU time, output kept."""

import os
import time

from nano_openshell import probe
from nano_openshell.output import Capped

from .conftest import MARK, Limits, started


def test_memory_bomb_is_stopped(make_sandbox):
    sb = make_sandbox(limits=Limits(address_space_bytes=256 << 20))
    r = started(sb.exec(f"echo {MARK}; x=$(head -c 600000000 /dev/zero | tr '\\0' a); echo survived ${{#x}}",
                        timeout=20))
    assert "survived 600000000" not in r.stdout
    assert not r.timed_out


HOLD_150_MIB = ("python3 -I -c \"import time; b = b'x' * (150 << 20); print('held', flush=True); "
                "time.sleep(1.5); print('done', flush=True)\"")


def test_memory_is_capped_for_the_sandbox_as_a_whole(make_sandbox):
    """Three children of 150 MiB each against a 256 MiB sandbox: each is under every per-process
    limit, together they are not. With a cgroup one of them is killed; without, the probe and the
    Sandbox say that memory is capped per process only."""
    sb = make_sandbox(limits=Limits(memory_bytes=256 << 20))
    r = started(sb.exec(f"echo {MARK}; {HOLD_150_MIB} & {HOLD_150_MIB} & {HOLD_150_MIB} & wait; echo end",
                        timeout=30))
    assert r.stdout.endswith("end\n") and not r.timed_out
    memory_gaps = [g for g in r.gaps if g.startswith("memory")]
    if probe()["capabilities"]["cgroup"]["usable"] and os.geteuid() == 0:
        assert memory_gaps == [], "as root with a usable cgroup, every tier's processes start in it"
    if memory_gaps:  # the hole is there, and reported
        assert r.stdout.count("done") == 3 and "not per sandbox" in memory_gaps[0]
    else:
        assert r.stdout.count("done") < 3, r.stdout


def test_file_size_bomb_is_capped(make_sandbox):
    sb = make_sandbox(limits=Limits(file_size_bytes=1 << 20))
    r = started(sb.exec(f"echo {MARK}; head -c 10000000 /dev/zero > big; echo rc=$?; echo after", timeout=10))
    assert "rc=0" not in r.stdout and r.stdout.endswith("after\n")
    assert os.path.getsize(os.path.join(sb.workspace, "big")) <= 1 << 20


def test_cpu_spin_is_killed_by_cpu_time(make_sandbox):
    sb = make_sandbox(limits=Limits(cpu_seconds=1))
    t0 = time.monotonic()
    r = started(sb.exec(f"echo {MARK}; while :; do :; done", timeout=20))
    assert not r.timed_out and r.exit_code != 0
    assert time.monotonic() - t0 < 8


def test_endless_output_is_capped_and_drained(make_sandbox):
    cap = 4096
    sb = make_sandbox(limits=Limits(output_bytes=cap))
    t0 = time.monotonic()
    r = started(sb.exec(f"echo {MARK}; yes; ", timeout=1.0))
    assert r.timed_out and r.truncated and time.monotonic() - t0 < 1.5
    assert len(r.stdout.encode()) < cap + 100
    assert "bytes truncated" in r.stdout and r.stdout.endswith("y\n")


def test_output_keeps_head_and_tail(make_sandbox):
    sb = make_sandbox(limits=Limits(output_bytes=1000))
    r = sb.exec("echo FIRST; seq 1 100000; echo LAST >&2; echo LAST", timeout=10)
    assert r.truncated and not r.timed_out and r.exit_code == 0
    assert r.stdout.startswith("FIRST\n1\n2\n") and r.stdout.endswith("100000\nLAST\n")
    assert r.stderr == "LAST\n"


def test_capped_buffer_stays_bounded():
    c = Capped(100)
    for _ in range(10000):
        c.add(b"x" * 1000)
    assert len(c.head) == 50 and len(c.tail) <= 100 and c.total == 10_000_000
    text = c.text()
    assert text.startswith("x" * 50) and text.endswith("x" * 50) and "9999900 bytes truncated" in text


def test_invalid_limits_are_refused():
    import pytest

    for bad in (dict(processes=0), dict(cpu_seconds=-1), dict(output_bytes=10), dict(file_size_bytes=1.5),
                dict(address_space_bytes=True), dict(disk_bytes=0)):
        with pytest.raises(ValueError):
            Limits(**bad)
