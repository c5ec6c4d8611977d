"""The shortcuts that make a command cheap keep every guarantee they stand in for.

- the uid drop (util-linux unshare -S -G, or setpriv) leaves no root id, group or capability;
- the workspace handover skips its walk only while no directory changed: whatever the host writes
  between two commands, however soon after the last one, is the sandbox uid's before the next runs;
- the namespaced tier's mount layout hides /root and /home and keeps / read-only (test_init.py has
  the per-Sandbox init, test_host_sockets.py what the layout shows of the host).
"""

import os
import subprocess
import threading
import time

import pytest

from nano_openshell import namespaced
from nano_openshell.workspace import FRESH_NS

from .conftest import MARK, processes_with, sleep_arg, started, token, wait_until

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="only a root supervisor drops to another uid")


def _ids_line(status: str) -> dict[str, str]:
    return {k: v.strip() for k, v in (line.split(":", 1) for line in status.splitlines())
            if k in ("Uid", "Gid", "Groups", "CapEff", "CapPrm")}


@as_root
@pytest.mark.parametrize("tool", ["unshare", "setpriv"])
def test_uid_drop_leaves_no_root_id_group_or_capability(tool, monkeypatch):
    from shutil import which

    path = which(tool, path="/usr/bin:/bin:/usr/sbin:/sbin")
    if path is None:
        pytest.skip(f"{tool} is not installed")
    monkeypatch.delitem(namespaced._CACHE, "uid_drop", raising=False)
    if tool == "unshare" and namespaced.uid_drop_argv(1)[0] != path:
        # the detection's trial failed: no --setuid, or unshare(0) denied (CI leg 2's seccomp filter)
        pytest.skip("unshare cannot drop the uid here; the Sandbox uses setpriv")
    monkeypatch.setitem(namespaced._CACHE, "uid_drop", (tool, path))
    uid = 123457
    out = subprocess.run(namespaced.uid_drop_argv(uid) + ["cat", "/proc/self/status"],
                         capture_output=True, text=True, check=True).stdout
    ids = _ids_line(out)
    assert ids["Uid"].split() == [str(uid)] * 4 and ids["Gid"].split() == [str(uid)] * 4
    assert ids["Groups"] == "" and int(ids["CapEff"], 16) == 0 and int(ids["CapPrm"], 16) == 0


def test_sandbox_command_runs_under_the_sandbox_uid(sandbox):
    """Read from the host: the fallback tier hides /proc from the command, its own entries too."""
    if sandbox.uid is None:
        pytest.skip("a non-root supervisor's commands keep its uid")
    arg = sleep_arg(token())
    running = threading.Thread(target=sandbox.exec, args=(f"exec sleep {arg}",), kwargs={"timeout": 10})
    arg = f"sleep\0{arg}"  # the command itself, not bwrap's command line naming it
    running.start()
    try:
        end = time.monotonic() + 5
        while not processes_with(arg) and time.monotonic() < end:
            time.sleep(0.02)
        [pid] = processes_with(arg)
        with open(f"/proc/{pid}/status") as f:
            ids = _ids_line(f.read())
    finally:
        sandbox.close()  # kills the command
        running.join()
    assert ids["Uid"].split() == [str(sandbox.uid)] * 4 and ids["Groups"] == "" and int(ids["CapEff"], 16) == 0


def _owner(sb, rel):
    return os.stat(os.path.join(sb.workspace, rel), follow_symlinks=False).st_uid


def test_host_writes_between_commands_are_handed_over(sandbox):
    if sandbox.uid is None:
        pytest.skip("only a root supervisor hands the workspace to another uid")
    ws = sandbox.workspace
    assert sandbox.exec("echo 1 > made_by_command", timeout=10).exit_code == 0
    # written right after the command ends: within one timestamp tick of the last handover
    with open(os.path.join(ws, "right_after"), "w") as f:
        f.write("host\n")
    assert sandbox.exec("echo more >> right_after && echo ok", timeout=10).stdout == "ok\n"
    # until the handover trusts the directory state, so that read-only commands take the short path
    wait_until(lambda: _settled(ws), "the workspace's mtimes grow old enough to trust")
    for _ in range(3):
        assert sandbox.exec("cat right_after > /dev/null", timeout=10).exit_code == 0
    os.makedirs(os.path.join(ws, "new/deeper"))
    with open(os.path.join(ws, "new/deeper/file"), "w") as f:
        f.write("host\n")
    os.replace(_host_file(ws, "replaced"), os.path.join(ws, "right_after"))  # atomic replace over
    r = sandbox.exec("echo x >> new/deeper/file && echo x >> right_after && mkdir new/deeper/d && echo ok",
                     timeout=10)
    assert r.stdout == "ok\n", r.stderr
    for rel in ("made_by_command", "right_after", "new", "new/deeper", "new/deeper/file", "new/deeper/d"):
        assert _owner(sandbox, rel) == sandbox.uid, rel


def _settled(root):
    """Every directory under root has an mtime the handover trusts (older than FRESH_NS, by the clock it
    reads): the next handover records the tree, and those after it skip the walk while nothing changes."""
    newest = max(os.stat(d).st_mtime_ns for d, _, _ in os.walk(root))
    return time.time_ns() - newest > FRESH_NS


def _host_file(ws, name):
    path = os.path.join(ws, "." + name + ".tmp")
    with open(path, "w") as f:
        f.write("host\n")
    return path


def test_handover_walk_is_skipped_only_while_no_directory_changed(sandbox):
    """The documented limit shows the skip is real: a file chowned back to root IN PLACE (no directory
    change) stays root's; the next file the host creates triggers the walk, which fixes both."""
    if sandbox.uid is None:
        pytest.skip("only a root supervisor hands the workspace to another uid")
    path = os.path.join(sandbox.workspace, "f")
    with open(path, "w") as f:
        f.write("host\n")
    sandbox.exec("true", timeout=10)
    wait_until(lambda: _settled(sandbox.workspace), "the workspace's mtimes grow old enough to trust")
    sandbox.exec("true", timeout=10)  # settled: this handover records the directory state
    os.chown(path, 0, 0)
    sandbox.exec("true", timeout=10)
    assert _owner(sandbox, "f") == 0
    _host_file(sandbox.workspace, "g")
    sandbox.exec("true", timeout=10)
    assert _owner(sandbox, "f") == sandbox.uid and _owner(sandbox, ".g.tmp") == sandbox.uid


def test_root_and_home_are_empty_and_the_root_is_read_only(make_sandbox, tier):
    if tier != "namespaced":
        pytest.skip("the mount layout is the namespaced tier's")
    sb = make_sandbox()
    r = started(sb.exec(f"echo {MARK}; ls -A /home; for d in / /root /home /run; do touch $d/x 2>/dev/null "
                        "&& echo WROTE $d; done; echo end", timeout=10))
    assert r.stdout.endswith("end\n") and "WROTE" not in r.stdout, r.stdout
    assert r.stdout.split("\n")[1:-2] == [], r.stdout  # /home lists nothing
    empty = [p for p in ("/srv", "/media", "/boot", "/mnt") if os.path.isdir(p) and not os.listdir(p)]
    if empty:
        r = sb.exec(f"ls -A {empty[0]}; touch {empty[0]}/x || echo refused", timeout=10)
        assert r.stdout == "refused\n", (r.stdout, r.stderr)
