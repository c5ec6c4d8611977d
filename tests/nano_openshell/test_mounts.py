"""Sandbox(mounts={path: None | host dir}): writable directories of the Sandbox's own at fixed paths.

A task may need its files at an absolute path (a repository at /testbed). In the namespaced tier each
mount is a private temporary directory of that Sandbox, bound read-write at the path, empty or a copy
of a host directory, gone at close; path_of(path) is where the host reads and writes it. The fallback
tier runs commands in the host's filesystem and cannot mount: it refuses clearly.
"""

import os
import tempfile

import pytest

from nano_openshell import Sandbox, SandboxError

from .conftest import MARK, started


def _namespaced_only(tier):
    if tier != "namespaced":
        pytest.skip("mounts exist only in the namespaced tier (the fallback tier's refusal is tested below)")


def test_an_empty_mount_is_writable_private_and_removed_at_close(make_sandbox, tier):
    _namespaced_only(tier)
    a, b = make_sandbox(mounts={"/testbed": None}), make_sandbox(mounts={"/testbed": None})
    r = started(a.exec(f"echo {MARK}; ls -A /testbed; echo from-a > /testbed/f; cat /testbed/f; pwd", timeout=10))
    assert r.stdout == f"{MARK}\nfrom-a\n/workspace\n", r.stderr
    assert a.exec("cat /testbed/f", timeout=10).stdout == "from-a\n"  # it persists between commands
    host = a.path_of("/testbed")
    assert open(os.path.join(host, "f")).read() == "from-a\n"
    assert b.exec("ls -A /testbed", timeout=10).stdout == ""  # another Sandbox has its own
    assert b.path_of("/testbed") != host
    a.close()
    assert not os.path.exists(host)


def test_a_mount_copies_a_host_directory_and_leaves_the_original_alone(make_sandbox, tier):
    _namespaced_only(tier)
    src = tempfile.mkdtemp(prefix="nano-openshell-src-")
    try:
        os.makedirs(os.path.join(src, "pkg"))
        with open(os.path.join(src, "pkg", "mod.py"), "w") as f:
            f.write("X = 1\n")
        os.symlink("pkg/mod.py", os.path.join(src, "link"))
        sb = make_sandbox(mounts={"/testbed": src, "/data/out": None})
        r = sb.exec("cat /testbed/pkg/mod.py /testbed/link && echo 'X = 2' > /testbed/pkg/mod.py && "
                    "touch /data/out/f && echo ok", timeout=10)
        assert r.stdout == "X = 1\nX = 1\nok\n", r.stderr
        assert open(os.path.join(src, "pkg", "mod.py")).read() == "X = 1\n"
        assert open(os.path.join(sb.path_of("/testbed"), "pkg", "mod.py")).read() == "X = 2\n"
        assert os.path.exists(os.path.join(sb.path_of("/data/out"), "f"))
    finally:
        import shutil
        shutil.rmtree(src)


def test_host_writes_into_a_mount_are_handed_to_the_sandbox(make_sandbox, tier):
    _namespaced_only(tier)
    sb = make_sandbox(mounts={"/testbed": None})
    with open(os.path.join(sb.path_of("/testbed"), "task.txt"), "w") as f:
        f.write("from the host\n")
    r = sb.exec("cat /testbed/task.txt && echo more >> /testbed/task.txt && echo ok", timeout=10)
    assert r.stdout == "from the host\nok\n", r.stderr
    if sb.uid is not None:
        assert os.stat(os.path.join(sb.path_of("/testbed"), "task.txt")).st_uid == sb.uid


def test_path_of_names_the_workspace_and_refuses_other_paths(make_sandbox, tier):
    _namespaced_only(tier)
    sb = make_sandbox(mounts={"/testbed": None})
    assert sb.path_of("/workspace") == sb.workspace
    with pytest.raises(ValueError, match="not a directory of this sandbox"):
        sb.path_of("/elsewhere")


@pytest.mark.parametrize("mounts,error", [
    ({"testbed": None}, ValueError), ({"/": None}, ValueError), ({"/a/../testbed": None}, ValueError),
    ({"/testbed/": None}, ValueError), ({"/usr/local/x": None}, ValueError), ({"/workspace": None}, ValueError),
    ({"/tmp/x": None}, ValueError), ({"/etc": None}, ValueError), ({"/a": None, "/a/b": None}, ValueError),
    ({"/testbed": "/nonexistent-nano-openshell"}, ValueError), ({1: None}, TypeError), (["/testbed"], TypeError),
])
def test_bad_mounts_are_refused_clearly(mounts, error):
    with pytest.raises(error):
        Sandbox(mounts=mounts, min_tier="fallback")


def test_the_fallback_tier_refuses_mounts_and_says_why(tier):
    if tier != "fallback":
        pytest.skip("the refusal is the fallback tier's")
    with pytest.raises(SandboxError, match="need the namespaced tier"):
        Sandbox(tier="fallback", min_tier="fallback", mounts={"/testbed": None})
