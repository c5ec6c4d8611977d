"""Nothing outlives a command: timeouts kill the whole tree, fast, whatever it does to hide."""

import contextlib
import glob
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from nano_openshell import SandboxError, probe

from .conftest import MARK, Limits, exec_held_past_its_deadline, processes_with, sleep_arg, started, token, wait_gone

ESCAPES = {
    "background": "sleep {s} &",
    "setsid": "setsid sleep {s} &",
    "nohup": "nohup sleep {s} > /dev/null 2>&1 &",
    "trap_ignoring": "( trap '' TERM INT HUP; sleep {s} ) &",
    "double_fork": "( ( sleep {s} & ) & )",
    "setsid_fork": "setsid -f sleep {s}",
    "holds_stdout": "( setsid sleep {s} & )",  # the escapee keeps our stdout pipe open
}


def test_timeout_kills_escapees_and_returns_in_time(shared_sandbox):
    """Every way of hiding at once, each with its own token: the timeout kills them all, in time."""
    toks = {escape: token() for escape in ESCAPES}
    cmd = f"echo {MARK}\n" + "".join(ESCAPES[e].format(s=sleep_arg(t)) + "\n" for e, t in toks.items())
    t0 = time.monotonic()
    r = started(shared_sandbox.exec(cmd + f"sleep {sleep_arg(token())}", timeout=0.7))
    elapsed = time.monotonic() - t0
    assert r.timed_out and r.exit_code < 0
    assert elapsed < 0.7 + 0.5, f"returned after {elapsed:.2f}s"
    assert [e for e, t in toks.items() if wait_gone(sleep_arg(t))] == [], "escaped the timeout"


@pytest.mark.parametrize("escape", ["setsid", "holds_stdout", "trap_ignoring"])
def test_escapees_die_when_the_command_exits_normally(shared_sandbox, escape):
    tok = token()
    cmd = f"echo {MARK}\n" + ESCAPES[escape].format(s=sleep_arg(tok)) + "\necho done"
    t0 = time.monotonic()
    r = started(shared_sandbox.exec(cmd, timeout=5.0))
    assert r.exit_code == 0 and not r.timed_out and r.stdout.endswith("done\n")
    assert time.monotonic() - t0 < 2.0, "an escapee holding stdout must not keep exec waiting"
    assert wait_gone(sleep_arg(tok)) == []


def test_sigterm_ignoring_main_process_is_killed(shared_sandbox):
    r = started(shared_sandbox.exec(f"echo {MARK}; trap '' TERM INT HUP; while :; do sleep 0.05; done", timeout=0.5))
    assert r.timed_out and r.duration_ms < 1000


def test_kill_all_from_inside_spares_the_supervisor(sandbox):
    """`kill -9 -1` inside reaches only the sandbox's own processes, never us or its init."""
    tok = token()
    r = started(sandbox.exec(f"echo {MARK}; sleep {sleep_arg(tok)} & kill -9 -1; echo after=$?", timeout=5))
    assert not r.timed_out
    assert os.getppid() > 1  # we are alive (this line runs) and so is our parent
    assert wait_gone(sleep_arg(tok)) == []
    assert sandbox.exec("echo still-works", timeout=5).stdout == "still-works\n"


def test_fork_bomb_is_bounded_and_killed(make_sandbox):
    limit = 64
    sb = make_sandbox(limits=Limits(processes=limit))
    tok = token()
    # every bomb process is a bash fork, so its cmdline carries the token
    cmd = f"echo {MARK}; b{tok}() {{ b{tok} | b{tok} & }}; b{tok}; sleep 30"
    peak, done = 0, threading.Event()

    def sample():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, len(processes_with(f"b{tok}")))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        t0 = time.monotonic()
        r = sb.exec(cmd, timeout=1.0)
        elapsed = time.monotonic() - t0
    finally:
        done.set()
        sampler.join()
    assert r.stdout.startswith(MARK)
    assert r.timed_out and elapsed < 1.5
    assert 2 < peak <= limit + 4, f"peak {peak} processes with limit {limit}"
    assert wait_gone(f"b{tok}", within=3.0) == []


SUPERVISOR = textwrap.dedent("""
    import sys
    sys.path.insert(0, {root!r})
    from nano_openshell import Sandbox
    sb = Sandbox(tier={tier!r}, min_tier="fallback")
    print("ready", sb.workspace, sb.uid, flush=True)
    sb.exec({cmd!r}, timeout=60)
""")


def _uid_gone(uid: int, within: float) -> list[int]:
    end = time.monotonic() + within
    while True:
        left = []
        for name in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{name}/status") as f:
                    if any(line.split()[1:2] == [str(uid)] for line in f if line.startswith("Uid:")):
                        left.append(int(name))
            except OSError:
                pass
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.05)


def test_killed_supervisor_leaves_nothing_behind(tier):
    tok = token()
    s = sleep_arg(tok)
    cmd = f"setsid sleep {s} & nohup sleep {s} >/dev/null 2>&1 & ( trap '' TERM; sleep {s} ) & sleep {s}"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    before = set(glob.glob("/tmp/nano-openshell-tmp-*"))
    sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR.format(root=root, tier=tier, cmd=cmd)],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        ready, workspace, uid = sup.stdout.readline().decode().split()
        assert ready == "ready"
        end = time.monotonic() + 10
        while len(processes_with(s)) < 4 and time.monotonic() < end:
            time.sleep(0.05)
        assert len(processes_with(s)) >= 4, "the command never started"
    finally:
        sup.send_signal(signal.SIGKILL)
        sup.wait()
        sup.stdout.close()
    assert wait_gone(s, within=3.0) == []
    if uid != "None":  # nothing at all of the sandbox's uid is left: its launcher (root, namespaced) neither
        assert _uid_gone(int(uid), within=3.0) == []
    # a killed supervisor cannot tidy up: remove its workspace and (fallback) the command's tmp dir,
    # unless a later process's first Sandbox removed them already (owned.py)
    shutil.rmtree(workspace, ignore_errors=True)
    owner = int(uid) if uid != "None" else os.geteuid()  # no uid drop (not root): the sandbox runs as us
    for left in set(glob.glob("/tmp/nano-openshell-tmp-*")) - before:
        with contextlib.suppress(FileNotFoundError):
            if os.stat(left).st_uid == owner:
                shutil.rmtree(left, ignore_errors=True)


# ---- the sandbox's cgroup (cgroup.kill) and, without one, the scan of /proc ------------------------

@pytest.fixture(params=["cgroup", "scan"])
def kill_path_sandbox(request, make_sandbox):
    """A Sandbox killing by cgroup.kill where the host lets us make a cgroup, and one that never does
    (the kill by scanning /proc for the init's descendants: what a host without cgroups gets)."""
    sb = make_sandbox(use_cgroup=request.param == "cgroup")
    usable = probe()["capabilities"]["cgroup"]["usable"]
    assert (sb.cgroup is not None) == (request.param == "cgroup" and usable), sb.cgroup_reason
    return sb


DEEP_FORK_CHAIN = ("python3 -I -c \"import os\nfor i in range({depth}):\n    if os.fork(): break\n"
                   "os.execvp('sleep', ['sleep', '{s}'])\"")


def test_deep_fork_chain_is_killed_at_the_timeout(kill_path_sandbox):
    """Each process of a 150-deep chain is its child's parent: a level-by-level kill took longer
    than the init was given, and the rest of the chain went to PID 1 alive."""
    tok = token()
    cmd = f"echo {MARK}; " + DEEP_FORK_CHAIN.format(depth=150, s=sleep_arg(tok))
    r = started(kill_path_sandbox.exec(cmd, timeout=1.5))
    assert r.timed_out and r.exit_code < 0
    assert wait_gone(sleep_arg(tok), within=1.0) == []


# Left behind by a command that exits at once: a chain whose every link forks the next and exits
# (a link lives ~1 ms, less than a pass over /proc takes), and a loop of double forks.
RACING_TREE = ("c() {{ [ $1 -lt 5000 ] && ( c $(( $1 + 1 )) & ); }}; ( c 0 & ); "
               "( while :; do ( ( sleep {s} & ) & ); done & ) # {tok}")


def test_a_racing_tree_left_behind_dies_with_its_command(sandbox):
    """The command ends at once; what it leaves reparents as fast as it forks. The kill at its end
    must catch it all then: a command that ended is not reported timed out, nor waited on."""
    tok = token()
    cmd = f"echo {MARK}; " + RACING_TREE.format(s=sleep_arg(tok), tok=tok)
    for run in range(15):
        t0 = time.monotonic()
        r = started(sandbox.exec(cmd, timeout=5))
        elapsed = time.monotonic() - t0
        assert (r.exit_code, r.timed_out) == (0, False), f"run {run}: {r.exit_code}, {r.timed_out} after {elapsed:.2f}s"
        assert elapsed < 2.5, f"run {run} returned after {elapsed:.2f}s"
        assert wait_gone(tok, within=1.0) == [], f"run {run}"


def test_a_command_that_ended_in_time_is_not_reported_timed_out(kill_path_sandbox):
    """The command exits 3 long before its deadline, but the init's end of command (kill and reap
    what it left) is held past the deadline (exec_held_past_its_deadline). The deadline then passes
    with the command over: the result is its own exit code, not a timeout."""
    r = exec_held_past_its_deadline(kill_path_sandbox)
    assert r.duration_ms >= 1500  # the init was held past the deadline
    assert (started(r).exit_code, r.timed_out) == (3, False)


# An init's end of command, on a kernel without /proc/PID/task/TID/children: kill_tree must take the
# tree's children from a pass over /proc, and still return only once nothing is left.
SUBREAPER = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {root!r})
    from nano_openshell import initproc
    initproc._CHILDREN_FILES = False
    initproc.prctl(initproc.PR_SET_CHILD_SUBREAPER, 1)
    for run in range(5):
        command = os.fork()
        if command == 0:
            os.execv("/bin/bash", ["bash", "-c", {cmd!r}])
        os.waitpid(command, 0)
        initproc.kill_tree()
        print("killed", run, flush=True)
""")


def test_a_racing_tree_dies_without_children_files():
    tok = token()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = RACING_TREE.format(s=sleep_arg(tok), tok=tok)
    r = subprocess.run([sys.executable, "-c", SUBREAPER.format(root=root, cmd=cmd)],
                       capture_output=True, text=True, timeout=20)
    assert r.stdout.split("\n")[:5] == [f"killed {run}" for run in range(5)], (r.stdout, r.stderr)
    assert wait_gone(tok, within=1.0) == []


def test_close_kills_a_command_another_thread_runs(kill_path_sandbox):
    """close() while exec runs in another thread: the command dies then, not at its own timeout."""
    tok = token()
    results = []
    runner = threading.Thread(target=lambda: results.append(kill_path_sandbox.exec(
        f"echo {MARK}; setsid sleep {sleep_arg(tok)} & sleep {sleep_arg(tok)}", timeout=60)))
    runner.start()
    sleeping = f"sleep\0{sleep_arg(tok)}"  # the sleeps themselves, not the shell or bwrap naming them
    end = time.monotonic() + 10
    while len(processes_with(sleeping)) < 2 and time.monotonic() < end:
        time.sleep(0.02)
    assert len(processes_with(sleeping)) == 2, "the command never started"
    t0 = time.monotonic()
    kill_path_sandbox.close()
    runner.join(timeout=5)
    assert not runner.is_alive() and time.monotonic() - t0 < 5
    assert wait_gone(sleep_arg(tok), within=1.0) == []
    [r] = results
    assert started(r).exit_code < 0 and not r.timed_out
    with pytest.raises(SandboxError):
        kill_path_sandbox.exec("true", timeout=5)
