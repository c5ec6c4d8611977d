"""The namespaced tier keeps one set of namespaces per Sandbox: one bwrap, with our init as its pid 1.

A command costs a posix_spawn inside, not a sandbox start; every per-command guarantee stays: its
whole tree dies at its end and at its timeout (even while other commands of the same Sandbox run),
a fresh TMPDIR, cwd /workspace, exit codes. The init cannot be signalled from inside; if it dies
anyway, that command fails with a clear SandboxError and the next one gets a new init (close()
ends a running command the way a timeout does: test_escapes.py); an init
that stops answering gets the whole sandbox killed soon after the command's deadline (the command
times out), never a hang.

Every test here runs on both inits: nsinit.c (compiled, the default where a C compiler works) and
nsinit.py (the fallback), which speak the same protocol (launcher.encode).
"""

import array
import os
import select
import signal
import socket
import struct
import threading
import time

import pytest

from nano_openshell import SandboxError
from nano_openshell import init_build, launcher

from .conftest import MARK, exec_held_past_its_deadline, processes_with, sleep_arg, started, token, wait_gone


@pytest.fixture(params=["c", "python"])
def init_kind(request, monkeypatch):
    if request.param == "c" and init_build.binary() is None:
        pytest.skip(f"the C init cannot be built here: {init_build.why_not()}")
    monkeypatch.setenv("NANO_OPENSHELL_INIT", request.param)
    return request.param


@pytest.fixture
def ns(make_sandbox, tier, init_kind):
    if tier != "namespaced":
        pytest.skip("the per-Sandbox init is the namespaced tier's (the fallback tier starts one per command)")
    sandbox = make_sandbox()
    assert (sandbox._namespaces.init_binary is not None) == (init_kind == "c")
    return sandbox


def _init_pid(sb) -> int:
    """The host pid of the Sandbox's init: the child of its bwrap."""
    bwrap = sb._namespaces._init._proc.pid
    with open(f"/proc/{bwrap}/task/{bwrap}/children") as f:
        return int(f.read().split()[0])


def _status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return {k: v.strip() for k, v in (line.split(":", 1) for line in f)}


def test_one_bwrap_and_one_init_serve_every_command(ns):
    replies = [started(ns.exec(f"echo {MARK}; echo $PPID; cat /proc/1/cmdline | tr '\\0' ' '", timeout=10))
               for _ in range(3)]
    assert {r.stdout for r in replies} == {replies[0].stdout}
    ppid, init_cmdline = replies[0].stdout.splitlines()[1:3]
    assert ppid == "1"  # our init is pid 1, every command its child
    if ns._namespaces.init_binary is not None:  # the C init, exec'd from the file the supervisor passed
        assert init_cmdline.startswith("/proc/self/fd/")
    else:
        assert " -I -S -c " in init_cmdline
    bwrap, init = ns._namespaces._init._proc.pid, _init_pid(ns)
    for _ in range(3):
        ns.exec("true", timeout=10)
    assert (ns._namespaces._init._proc.pid, _init_pid(ns)) == (bwrap, init)


def test_the_init_runs_as_the_sandbox_uid_without_capabilities_and_ends_with_close(ns):
    ns.exec("true", timeout=10)
    bwrap, init = ns._namespaces._init._proc.pid, _init_pid(ns)
    for pid in (bwrap, init):
        ids = _status(pid)
        assert int(ids["CapEff"], 16) == 0
        if ns.uid is not None:
            assert ids["Uid"].split() == [str(ns.uid)] * 4 and ids["Groups"] == ""
    ns.close()
    assert not os.path.exists(f"/proc/{bwrap}") and not os.path.exists(f"/proc/{init}")


def test_a_malformed_message_gets_an_error_line_and_the_init_serves_on(ns):
    ns.exec("true", timeout=10)
    init = ns._namespaces._init
    run_true = launcher.encode(("run", 99, ["/bin/true"], {}))
    for data, n_fds in ((b"r\x01", 3),                                              # cut short
                        (b"z", 1),                                                  # unknown
                        (run_true, 1),                                              # no stdout/stderr fds
                        (b"r" + struct.pack("<QII", 7, 2, 0) + b"/bin/true\0", 3),  # argc says 2, has 1
                        (launcher.encode(("run", 8, ["/nonexistent/x"], {})), 3)):  # cannot start
        pipes = [os.pipe() for _ in range(n_fds)]
        init._sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [w for _, w in pipes]))])
        for r, w in pipes:
            os.close(w)
        assert select.select([pipes[0][0]], [], [], 5)[0], data
        assert os.read(pipes[0][0], 200).startswith(b"E"), data
        for r, _ in pipes:
            os.close(r)
    assert ns.exec("echo still serving", timeout=10).stdout == "still serving\n"


def test_commands_cannot_signal_the_init(ns):
    tok = token()
    r = started(ns.exec(f"echo {MARK}; sleep {sleep_arg(tok)} & kill -9 1; kill -STOP 1; kill -TERM 1; "
                        "kill -9 -1; echo survived", timeout=10))
    assert not r.timed_out and r.stdout.endswith("survived\n")  # kill -9 -1 spares pid 1 and the caller
    assert wait_gone(sleep_arg(tok)) == []
    assert ns.exec("echo $PPID", timeout=10).stdout == "1\n"


def test_exit_codes_cwd_and_a_fresh_tmpdir_per_command(ns):
    assert ns.exec("kill -TERM $$", timeout=10).exit_code == 128 + 15
    assert ns.exec("exit 42", timeout=10).exit_code == 42
    r = ns.exec('cd /tmp; echo "$TMPDIR"; touch "$TMPDIR/mine" /tmp/shared', timeout=10)
    first = r.stdout.strip()
    r2 = ns.exec('pwd; echo "$TMPDIR"; ls -A /tmp', timeout=10)
    cwd, second, listing = r2.stdout.split("\n", 2)
    assert cwd == "/workspace" and second != first and first.startswith("/tmp/")
    assert "shared" in listing.split()  # /tmp itself is the Sandbox's, for its whole life
    assert os.path.basename(first) not in listing  # the last command's TMPDIR is gone
    big = "x" * (200 << 10)  # a command too large for argv travels as a file descriptor
    assert ns.exec(f": '{big}'; echo big-ok", timeout=10).stdout == "big-ok\n"


class _Running:
    """A command of the Sandbox that runs, in a thread, until the test releases it (a file it waits for)."""

    def __init__(self, sb):
        self.sb, self.result = sb, None
        self.thread = threading.Thread(target=self._run)
        self.thread.start()
        end = time.monotonic() + 10
        while not os.path.exists(os.path.join(sb.workspace, "running")) and time.monotonic() < end:
            time.sleep(0.01)
        assert os.path.exists(os.path.join(sb.workspace, "running")), "the command never started"

    def _run(self):
        self.result = self.sb.exec("touch running; while [ ! -e release ]; do sleep 0.01; done; echo released",
                                   timeout=30)

    def release(self):
        open(os.path.join(self.sb.workspace, "release"), "w").close()
        self.thread.join(30)
        return self.result


def test_a_timeout_kills_only_that_command_while_others_run(ns):
    tok = token()
    other = _Running(ns)
    r = ns.exec(f"setsid sleep {sleep_arg(tok)} & ( sleep {sleep_arg(tok)} & ) ; sleep {sleep_arg(tok)}", timeout=0.5)
    assert r.timed_out and r.exit_code == -9
    assert wait_gone(sleep_arg(tok)) == []
    r = other.release()
    assert r.stdout == "released\n" and not r.timed_out, r


def test_a_command_that_ended_in_time_is_not_timed_out_while_its_leftovers_are_killed(ns):
    """The init tells when it reaps a command (its code, and the time), before it kills what the
    command left: a deadline passing during that kill is not the command's (test_escapes.py runs
    the same on every tier). The init held meanwhile costs the sandbox; the next command gets one."""
    r = exec_held_past_its_deadline(ns)
    assert r.duration_ms >= 1500  # the init was held past the deadline
    assert (started(r).exit_code, r.timed_out) == (3, False)
    assert "did not stop a command in time" in ns._namespaces._init.dead
    assert ns.exec("echo back", timeout=10).stdout == "back\n"


def test_the_supervisor_reads_when_a_command_ended_and_ignores_a_garbled_report():
    """What the init says of a command's end is untrusted: lines that are not its format change
    nothing, and the status line after them still counts."""
    for said, ended in [(b"D3 1500000000\n", (3, 1.5)), (b"D3\nD 7\nDx y\nD1 " + b"9" * 400 + b"\n", None)]:
        r, w = os.pipe()
        os.write(w, said + b"X0\n")
        os.close(w)
        command = launcher.Command(None, 1, r)
        assert (command.wait(timeout=5), command.ended) == (0, ended)


def test_escapees_die_when_their_command_ends_while_others_run(ns):
    tok = token()
    other = _Running(ns)
    r = started(ns.exec(f"echo {MARK}; setsid sleep {sleep_arg(tok)} & nohup sleep {sleep_arg(tok)} >/dev/null 2>&1 &",
                        timeout=10))
    assert r.exit_code == 0
    assert wait_gone(sleep_arg(tok)) == []
    assert other.release().stdout == "released\n"


def test_a_dead_init_fails_that_command_clearly_and_the_next_one_restarts_it(ns):
    tok = token()
    result = {}

    def run():
        try:
            result["r"] = ns.exec(f"sleep {sleep_arg(tok)}", timeout=30)
        except SandboxError as e:
            result["e"] = e

    t = threading.Thread(target=run)
    t.start()
    end = time.monotonic() + 10
    while not processes_with(sleep_arg(tok)) and time.monotonic() < end:
        time.sleep(0.02)
    os.kill(_init_pid(ns), signal.SIGKILL)  # from the host: nothing inside can do this
    t.join(10)
    assert not t.is_alive() and "init died" in str(result.get("e")), result
    assert wait_gone(sleep_arg(tok)) == []
    assert ns.exec("echo back", timeout=10).stdout == "back\n"


def test_an_init_that_stops_answering_costs_the_sandbox_not_a_hang(ns, monkeypatch):
    monkeypatch.setattr(launcher, "KILL_WAIT", 0.5)
    ns.exec("true", timeout=10)
    os.kill(_init_pid(ns), signal.SIGSTOP)  # from the host: the init can neither spawn nor kill now
    t0 = time.monotonic()
    r = ns.exec("sleep 30", timeout=0.5)  # never started: the init is stopped
    assert r.timed_out and r.exit_code == -9
    assert time.monotonic() - t0 < 0.5 + 0.5 + 1.0
    assert ns._namespaces._init.dead and "did not stop a command in time" in ns._namespaces._init.dead
    assert ns.exec("echo back", timeout=10).stdout == "back\n"  # a new init


def test_commands_run_under_the_seccomp_filter_without_capabilities(ns):
    r = started(ns.exec(f"echo {MARK}; grep -E '^(Seccomp|NoNewPrivs|CapEff|CapBnd):' /proc/self/status", timeout=10))
    fields = dict(line.split(":\t") for line in r.stdout.splitlines()[1:])
    assert fields == {"Seccomp": "2", "NoNewPrivs": "1", "CapEff": "0000000000000000", "CapBnd": "0000000000000000"}


def test_a_full_tmpdir_does_not_hold_up_the_next_command(ns):
    """The init removes a finished command's TMPDIR for a bounded time (what is left stays in the
    Sandbox's /tmp): a command leaving 100,000 files there does not stall the next one."""
    r = ns.exec('cd "$TMPDIR" && seq 1 100000 | xargs touch && echo made', timeout=60)
    assert r.stdout == "made\n" and not r.timed_out, r
    t0 = time.monotonic()
    assert ns.exec("echo next", timeout=10).stdout == "next\n"
    assert time.monotonic() - t0 < 0.6


def test_a_forked_supervisor_starts_sandboxes_of_its_own(ns):
    """Every bwrap starts from one thread of ours: a forked child (multiprocessing's fork) has none
    of its parent's threads, and must not wait on one."""
    assert ns.exec("true", timeout=10).exit_code == 0  # the parent's thread exists now
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            from nano_openshell import Sandbox

            with Sandbox(tier="namespaced", min_tier="fallback") as sb:
                code = 0 if sb.exec("echo child", timeout=10).stdout == "child\n" else 2
        finally:
            os._exit(code)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's Sandbox never started")
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_bwrap_that_cannot_start_fails_the_command_clearly(ns):
    """bwrap is started on the spawner thread after Sandbox() returned: a bwrap that cannot start is
    that init's death, said by the command (a SandboxError naming why), never a hang."""
    assert ns.exec("true", timeout=10).exit_code == 0
    ns._namespaces.argv = ["/nonexistent/nano-openshell-bwrap"]  # the next init cannot start
    ns._namespaces._init.abort("test: the next command needs a new init")
    t0 = time.monotonic()
    with pytest.raises(SandboxError, match="init died.*bwrap could not be started.*FileNotFoundError"):
        ns.exec("true", timeout=10)
    assert time.monotonic() - t0 < 5
