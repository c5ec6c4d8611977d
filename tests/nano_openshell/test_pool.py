"""SandboxPool: fresh Sandboxes booted ahead of need, handed out once, as isolated as any new Sandbox.

Real sandboxes in every tier the probe finds working here (the `tier` fixture); what only the
namespaced tier has (an init that boots, mounts) is tested where that tier works.
"""

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from nano_openshell import SandboxError, SandboxPool

from .conftest import ISOLATED

needs_namespaces = pytest.mark.skipif("namespaced" not in ISOLATED, reason="the namespaced tier does not work here")


def _pool(tier, size, **kwargs) -> SandboxPool:
    pool = SandboxPool(size, tier=tier, min_tier="fallback", **kwargs)
    assert pool.wait_filled(30), "the pool did not fill"
    return pool


@needs_namespaces
def test_a_taken_sandbox_is_booted_so_its_first_exec_does_not_wait_for_the_init():
    # The boot's speed is a benchmark's (bench/sandbox_throughput.py); this is about state: what take()
    # hands out has its init up already (a fresh Sandbox's first exec waits ~10 ms for bwrap's mounts
    # and the init's Python start-up).
    with _pool("namespaced", 1) as pool:
        for _ in range(3):
            assert pool.wait_filled(30)
            with pool.take() as sb:
                assert sb.wait_ready(0), "taken before its init booted"
                assert sb.exec("true", timeout=30).exit_code == 0


def test_take_gives_a_working_sandbox_in_which_no_command_ever_ran(tier):
    with _pool(tier, 2) as pool:
        with pool.take() as sb:
            assert sb.tier == tier
            r = sb.exec("echo $TMPDIR; ls -A", timeout=30)
            assert r.exit_code == 0, r
            tmpdir, *listing = r.stdout.split()
            assert listing == [], "a fresh, empty workspace"
            if tier == "namespaced":  # the init names each command's TMPDIR after its number: 1 is its first
                assert tmpdir.endswith("-1"), tmpdir


def test_two_taken_sandboxes_are_distinct(tier):
    with _pool(tier, 2) as pool, pool.take() as a, pool.take() as b:
        assert a.workspace != b.workspace
        assert a.exec("echo secret > mine", timeout=30).exit_code == 0
        assert os.path.exists(os.path.join(a.workspace, "mine"))
        r = b.exec("ls -A; test ! -e mine", timeout=30)
        assert (r.exit_code, r.stdout) == (0, ""), r


def test_take_with_mounts_makes_a_new_sandbox_and_leaves_the_pool_alone(tier):
    with _pool(tier, 1) as pool:
        ready = list(pool._idle.sandboxes)  # the pool's own, to see that none of them is handed out
        if tier != "namespaced":  # as Sandbox(mounts=...) there: no mount namespace, said clearly
            with pytest.raises(SandboxError, match="need the namespaced tier"):
                pool.take(mounts={"/data": None})
            return
        with pool.take(mounts={"/data": None}) as sb:
            assert sb not in ready and list(pool._idle.sandboxes) == ready
            r = sb.exec("touch /data/x && ls /data", timeout=30)
            assert (r.exit_code, r.stdout) == (0, "x\n"), r
            assert os.path.exists(os.path.join(sb.path_of("/data"), "x"))


def _children() -> set[int]:
    """Our child processes (a namespaced Sandbox's bwrap is one; its init is bwrap's)."""
    out = set()
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except (OSError, ValueError):
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == os.getpid():
            out.add(int(name))
    return out


def test_close_leaves_no_process_workspace_or_cgroup_of_the_idle_sandboxes(tier):
    before = _children()
    pool = _pool(tier, 3)
    idle = list(pool._idle.sandboxes)
    assert len(idle) == 3
    workspaces = [sb.workspace for sb in idle]
    cgroups = [d for sb in idle if sb.cgroup is not None for d in (sb.cgroup.path, *sb.cgroup.v1_dirs.values())]
    processes = _children() - before
    assert all(os.path.isdir(d) for d in workspaces + cgroups)
    if tier == "namespaced":
        assert len(processes) >= 3, "each idle sandbox's bwrap runs"
    pool.close()
    end = time.monotonic() + 5
    while time.monotonic() < end and any(os.path.exists(f"/proc/{p}") for p in processes):
        time.sleep(0.05)
    assert not [p for p in processes if os.path.exists(f"/proc/{p}")], "no process left"
    assert not [d for d in workspaces + cgroups if os.path.exists(d)], "no workspace or cgroup left"
    with pytest.raises(SandboxError, match="pool is closed"):
        pool.take()
    pool.close()  # idempotent


def test_idle_sandboxes_are_closed_at_interpreter_exit_without_close(tier):
    code = ("import json; from nano_openshell import SandboxPool\n"
            f"pool = SandboxPool(2, tier={tier!r}, min_tier='fallback'); assert pool.wait_filled(30)\n"
            "idle = list(pool._idle.sandboxes)\n"
            "print(json.dumps([sb.workspace for sb in idle] + [d for sb in idle if sb.cgroup is not None "
            "for d in (sb.cgroup.path, *sb.cgroup.v1_dirs.values())]))\n")  # and exits, the pool still open
    r = subprocess.run([sys.executable, "-c", code], cwd=os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    left = json.loads(r.stdout)
    assert len(left) >= 2 and not [d for d in left if os.path.exists(d)], "no workspace or cgroup left"


def test_concurrent_takes_from_8_threads_give_8_distinct_working_sandboxes(tier):
    results, start = {}, threading.Barrier(8)

    def episode(i):
        start.wait()
        with pool.take() as sb:
            r = sb.exec(f"touch mine-{i} && ls", timeout=60)
            results[i] = (sb.workspace, r.exit_code, r.stdout)

    with _pool(tier, 4) as pool:  # fewer than 8 ready: the others are made the normal way
        threads = [threading.Thread(target=episode, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert sorted(results) == list(range(8))
    assert len({ws for ws, _, _ in results.values()}) == 8
    for i, (_, code, out) in results.items():
        assert (code, out) == (0, f"mine-{i}\n"), "each sees only its own workspace"


@needs_namespaces
def test_a_sandbox_that_died_while_idle_is_closed_and_never_handed_out():
    with _pool("namespaced", 1) as pool:
        [dead] = list(pool._idle.sandboxes)
        dead._namespaces.get().abort("killed by the test")  # its bwrap, and the init with it
        with pool.take() as sb:
            assert sb is not dead
            assert sb.exec("true", timeout=30).exit_code == 0
        assert not os.path.exists(dead.workspace), "the dead one was closed"


def test_a_pool_of_size_0_makes_every_sandbox_the_normal_way(tier):
    with SandboxPool(0, tier=tier, min_tier="fallback") as pool, pool.take() as sb:
        assert pool.idle() == 0 and sb.exec("true", timeout=30).exit_code == 0


@pytest.mark.parametrize("args, kwargs, message", [
    ((-1,), {}, "SandboxPool size must be an int >= 0, got -1"),
    ((2,), {"boots": 0}, "SandboxPool boots must be an int >= 1, got 0"),
    ((2,), {"mounts": {"/data": None}}, "SandboxPool takes no mounts"),
    ((2,), {"workspace": "/tmp"}, "SandboxPool takes no workspace"),
])
def test_bad_arguments_are_refused_in_one_line(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        SandboxPool(*args, **kwargs)
