"""The Sandbox's cgroup: made where the host lets us, capped from Limits, gone with close().

Where no cgroup can be made (a non-root user without a delegated tree), the Sandbox runs without
one and says so: cgroup_reason, and the memory gap in probe() and Sandbox.gaps.
"""

import os
import select
import subprocess
import sys
import threading
import time

from nano_openshell import Limits, Sandbox, probe
from nano_openshell.cgroup import _hierarchies

from .conftest import processes_with, sleep_arg, token


def _read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def _memory_and_pids_caps(sb) -> tuple[int, int]:
    """The caps the kernel holds for this Sandbox: v2 files, or v1 ones on a hybrid host."""
    cg = sb.cgroup
    if "memory" in cg.v1_dirs:
        memory = _read(os.path.join(cg.v1_dirs["memory"], "memory.limit_in_bytes"))
    else:
        memory = _read(os.path.join(cg.path, "memory.max"))
    pids = _read(os.path.join(cg.v1_dirs.get("pids", cg.path), "pids.max"))
    return int(memory), int(pids)


def test_root_with_a_writable_cgroup_tree_gets_a_cgroup():
    """As root here, a Sandbox must not quietly run without its cgroup."""
    v2, _ = _hierarchies()
    if os.geteuid() == 0 and v2 is not None and os.access(v2, os.W_OK):
        assert probe()["capabilities"]["cgroup"]["usable"], probe()["capabilities"]["cgroup"]["reason"]
    cg = probe()["capabilities"]["cgroup"]
    assert cg["reason"] and set(cg["capped"]) <= {"memory", "pids"}
    memory_gap = [g for g in probe()["tiers"]["fallback"]["gaps"] if g.startswith("memory")]
    assert bool(memory_gap) == ("memory" not in cg["capped"])


def test_command_runs_inside_the_capped_cgroup_and_close_removes_it(tier):
    sb = Sandbox(tier=tier, min_tier="fallback", limits=Limits(memory_bytes=300 << 20, processes=77))
    try:
        if sb.cgroup is None:
            assert not probe()["capabilities"]["cgroup"]["usable"] and sb.cgroup_reason
            assert any(g.startswith("memory") for g in sb.gaps)
            return
        made = [sb.cgroup.path, *sb.cgroup.v1_dirs.values()]
        assert all(os.path.isdir(d) for d in made)
        caps = _memory_and_pids_caps(sb)
        assert caps == ((300 << 20) if "memory" in sb.cgroup.capped else caps[0],
                        77 if "pids" in sb.cgroup.capped else caps[1])
        arg = sleep_arg(token())
        running = threading.Thread(target=sb.exec, args=(f"exec sleep {arg}",), kwargs={"timeout": 10})
        arg = f"sleep\0{arg}"  # the command itself, not bwrap's command line naming it
        running.start()
        end = time.monotonic() + 5
        while not processes_with(arg) and time.monotonic() < end:
            time.sleep(0.02)
        [pid] = processes_with(arg)
        with open(f"/proc/{pid}/cgroup") as f:
            where = f.read()
        name = os.path.basename(sb.cgroup.path)
        assert where.count(f"/{name}") == 1 + len(sb.cgroup.v1_dirs), where  # v2, and each v1 controller
        sb.close()  # kills it
        running.join()
    finally:
        sb.close()
    assert not any(os.path.exists(d) for d in made), "close() removes the sandbox's cgroups"


def test_a_sandbox_without_a_cgroup_says_so():
    with Sandbox(min_tier="fallback", use_cgroup=False) as sb:
        assert sb.cgroup is None and "use_cgroup=False" in sb.cgroup_reason
        r = sb.exec("true", timeout=10)
        assert any(g.startswith("memory is capped per process") for g in r.gaps)


def test_a_frozen_leaf_stops_its_processes_where_they_are_until_thawed():
    """The disk check freezes a command near the limit while it counts (docs/design.md, Disk): frozen,
    a writer adds nothing; thawed, it goes on; killed frozen, it dies."""
    from nano_openshell.cgroup import SandboxCgroup

    cg, why = SandboxCgroup.create(1 << 30, 64)
    if cg is None:
        assert not probe()["capabilities"]["cgroup"]["usable"] and why
        return
    leaf = cg.leaf()
    writer = subprocess.Popen([sys.executable, "-c", "import sys\nwhile True: print('x', flush=True)"],
                              stdout=subprocess.PIPE)
    try:
        leaf.add(writer.pid)
        assert leaf.can_freeze()
        assert leaf.freeze(timeout=5)
        os.set_blocking(writer.stdout.fileno(), False)
        while writer.stdout.read(1 << 16):  # what it wrote before it froze
            pass
        assert select.select([writer.stdout], [], [], 0.3)[0] == [], "a frozen process wrote on"
        leaf.thaw()
        assert select.select([writer.stdout], [], [], 5)[0] == [writer.stdout], "a thawed process goes on"
        leaf.freeze(timeout=5)
        leaf.kill()
        assert writer.wait(timeout=5) == -9
    finally:
        writer.kill()
        writer.wait()
        writer.stdout.close()
        leaf.close()
        cg.close()
