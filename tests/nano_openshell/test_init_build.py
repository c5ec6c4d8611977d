"""The C init is compiled once per machine into a cache only this user can write, checked, and exec'd
from the file it checked; without a compiler sandboxes run the Python init and say so."""

import os
import stat

import pytest

from nano_openshell import init_build
from nano_openshell.probe import _init as init_report


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty cache directory and no build remembered by this process."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(init_build, "_BUILT", {})
    monkeypatch.setattr(init_build, "_WHY", {})
    if init_build.shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler here")
    return tmp_path / "cache" / "nano-openshell"


def test_the_init_is_built_once_into_a_directory_only_we_can_write(fresh_cache):
    fresh_cache.mkdir(parents=True, mode=0o700)
    (fresh_cache / "nsinit-x86_64-0123456789abcdef").write_bytes(b"an older source's build")
    path = init_build.binary()
    assert os.listdir(fresh_cache) == [os.path.basename(path)]  # the older build is gone
    assert path is not None and os.path.dirname(path) == str(fresh_cache)
    st, dir_st = os.stat(path), os.stat(fresh_cache)
    assert st.st_uid == os.geteuid() and not st.st_mode & 0o022 and st.st_mode & stat.S_IXOTH
    assert dir_st.st_uid == os.geteuid() and stat.S_IMODE(dir_st.st_mode) == 0o700
    with open(path, "rb") as f:
        assert f.read(4) == b"\x7fELF"
    built_at = st.st_mtime_ns
    init_build._BUILT.clear()  # a new process: found in the cache, not compiled again
    assert init_build.binary() == path and os.stat(path).st_mtime_ns == built_at
    assert init_build.kind() == "c"


def test_a_planted_binary_that_others_can_write_is_rebuilt_not_run(fresh_cache):
    key = init_build._key()
    fresh_cache.mkdir(parents=True, mode=0o700)
    planted = fresh_cache / f"nsinit-{key}"
    planted.write_bytes(b"#!/bin/sh\ntouch /tmp/pwned-by-planted-init\n")
    planted.chmod(0o777)
    path = init_build.binary()
    assert path == str(planted)
    with open(path, "rb") as f:
        assert f.read(4) == b"\x7fELF"  # compiled over it
    assert not os.stat(path).st_mode & 0o022


def test_every_sandbox_execs_the_file_that_was_checked_not_the_path(fresh_cache):
    path = init_build.binary()
    fd = init_build.open_binary()
    try:
        os.replace(path, path + ".moved")
        with open(path, "wb") as f:  # someone swaps the path afterwards
            f.write(b"#!/bin/sh\nexit 0\n")
        with open(f"/proc/self/fd/{fd}", "rb") as f:
            assert f.read(4) == b"\x7fELF"
    finally:
        os.close(fd)


def test_without_a_compiler_sandboxes_get_the_python_init_and_say_why(fresh_cache, monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert init_build.binary() is None and init_build.kind() == "python"
    assert "no C compiler" in init_build.why_not()
    assert init_report().startswith("python (nsinit.py") and "no C compiler" in init_report()
    monkeypatch.setenv("NANO_OPENSHELL_INIT", "c")
    with pytest.raises(RuntimeError, match="NANO_OPENSHELL_INIT=c, but the C init cannot be built here: no C compiler"):
        init_build.kind()


def test_a_compiler_error_is_reported_not_raised(fresh_cache, tmp_path, monkeypatch):
    broken = tmp_path / "cc"
    broken.write_text("#!/bin/sh\necho 'cc: internal error' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    assert init_build.binary() is None and "internal error" in init_build.why_not()


def test_an_unknown_init_choice_is_one_clear_error(monkeypatch):
    monkeypatch.setenv("NANO_OPENSHELL_INIT", "rust")
    with pytest.raises(ValueError, match="NANO_OPENSHELL_INIT must be auto, c or python, got 'rust'"):
        init_build.kind()


def test_a_sandbox_without_a_compiler_runs_on_the_python_init(fresh_cache, monkeypatch, make_sandbox, tier):
    if tier != "namespaced":
        pytest.skip("the per-Sandbox init is the namespaced tier's")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    sandbox = make_sandbox()
    assert sandbox._namespaces.init_binary is None
    r = sandbox.exec("echo $PPID; tr '\\0' ' ' < /proc/1/cmdline", timeout=10)
    assert r.exit_code == 0 and r.stdout.startswith("1\n") and " -I -S -c " in r.stdout
