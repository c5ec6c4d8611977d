"""The probe, the seccomp filters on their own, and the `nano-openshell` command line."""

import json
import os
import subprocess
import sys

import pytest

from nano_openshell import probe, seccomp

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = [sys.executable, "-m", "nano_openshell.cli"]


def cli(*args, **kw):
    return subprocess.run(CLI + list(args), capture_output=True, text=True, cwd=ROOT, timeout=60, **kw)


def clis(*commands: list[str], **kw) -> list[tuple[int, str, str]]:
    """Several `nano-openshell` runs side by side (each spends its time starting up and probing):
    (exit code, stdout, stderr) of each."""
    procs = [subprocess.Popen(CLI + c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, **kw)
             for c in commands]
    outputs = [p.communicate(timeout=60) for p in procs]
    return [(p.returncode, *output) for p, output in zip(procs, outputs)]


def test_probe_names_a_tier_and_says_why():
    p = probe()
    assert p["tier"] in ("namespaced", "fallback") and p["reason"]
    assert p["tiers"][p["tier"]]["ok"]
    assert p["tiers"]["none"]["ok"] and "allow_unisolated" in p["tiers"]["none"]["reason"]
    caps = p["capabilities"]
    for key in ("root", "bwrap", "namespaces", "seccomp", "landlock_abi", "cgroup", "uid_drop"):
        assert key in caps
    assert probe() is p, "the probe is cached per process"
    if p["tier"] == "fallback":
        assert "unavailable" in p["reason"]


def test_deny_list_is_well_formed_bpf():
    for prog in (seccomp.deny_list(), seccomp.deny_list(no_sockets=True), seccomp.deny_namespaces()):
        assert len(prog) % 8 == 0 and 8 < len(prog) // 8 < 4096
    for arch in ("x86_64", "aarch64"):
        assert seccomp.deny_list(arch=arch) != seccomp.deny_list(no_sockets=True, arch=arch)
    with pytest.raises(OSError):
        seccomp.deny_list(arch="mips")


def test_deny_namespaces_launcher_blocks_namespaces_only():
    code = ("import ctypes, os, socket; libc = ctypes.CDLL(None, use_errno=True)\n"
            "print('unshare', libc.unshare(0x10000000), ctypes.get_errno())\n"
            "socket.socket(socket.AF_INET, socket.SOCK_STREAM).close(); print('inet ok')\n"
            "pid = os.fork()\n"
            "if pid == 0: os._exit(7)\n"
            "print('fork', os.waitpid(pid, 0)[1] >> 8)\n")
    launcher = "import sys; from nano_openshell.seccomp import main; sys.exit(main())"
    r = subprocess.run([sys.executable, "-c", launcher, "--deny-namespaces", "--", sys.executable, "-c", code],
                       capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert r.stdout.split("\n")[:3] == ["unshare -1 1", "inet ok", "fork 7"], r.stderr
    bad = subprocess.run([sys.executable, "-c", launcher, "--bogus"], capture_output=True, cwd=ROOT, timeout=60)
    assert bad.returncode == 2


def test_cli_exec_and_probe_print_one_json_result_and_a_timeout_is_not_an_error():
    (code, out, err), (_, words, _), (timed_code, timed, _), (probe_code, probed, _) = clis(
        ["exec", "--timeout", "10", "--min-tier", "fallback", "--", "echo hi; exit 3"],
        ["exec", "--min-tier", "fallback", "--", "printf", "%s|", "a b", "c"],
        ["exec", "--timeout", "0.5", "--min-tier", "fallback", "--", "sleep 5"], ["probe"])
    assert code == 0, err
    out = json.loads(out)
    assert (out["exit_code"], out["stdout"], out["timed_out"]) == (3, "hi\n", False)
    assert out["tier"] == probe()["tier"]
    assert json.loads(words)["stdout"] == "a b|c|", "several words are quoted, not re-split"
    assert timed_code == 0 and json.loads(timed)["timed_out"] is True
    assert probe_code == 0 and json.loads(probed)["tier"] == probe()["tier"]


BAD_INPUT = [
    ["exec", "--", ""], ["exec"], ["exec", "--", "   "], ["exec", "--", "echo a\udcffb"],
    ["exec", "--timeout", "abc", "--", "true"], ["exec", "--timeout", "-1", "--", "true"],
    ["exec", "--timeout", "nan", "--", "true"], ["exec", "--workspace", "/nonexistent/ws", "--", "true"],
    ["exec", "--policy", "/nonexistent/policy.toml", "--", "true"], ["exec", "--min-tier", "best", "--", "true"],
    ["bogus"],
]


def test_cli_bad_input_exits_2_with_one_line():
    env = dict(os.environ, PYTHONIOENCODING="utf-8:surrogateescape")
    for args, (code, out, err) in zip(BAD_INPUT, clis(*BAD_INPUT, env=env)):
        assert code == 2 and out == "" and err.count("\n") == 1 and "error" in err, (args, code, out, err)


def test_cli_proxy_refuses_an_invalid_policy(tmp_path):
    bad = tmp_path / "policy.toml"
    bad.write_text("version = 1\n[[rules]]\nhost = '*.'\nbogus_key = 1\n")
    sock = tmp_path / "p.sock"
    r = cli("proxy", "--policy", str(bad), "--socket", str(sock))
    assert r.returncode == 2 and "invalid policy" in r.stderr and r.stderr.count("\n") == 1
    assert not sock.exists(), "nothing may start with an invalid policy"


def test_cli_proxy_serves_the_handshake(tmp_path):
    from nano_openshell.proxy import PROTOCOL_VERSION, handshake

    pol = tmp_path / "policy.toml"
    pol.write_text('version = 1\n[[rules]]\nhost = "example.com"\n')
    sock = str(tmp_path / "p.sock")
    p = subprocess.Popen(CLI + ["proxy", "--policy", str(pol), "--socket", sock], stdout=subprocess.PIPE,
                         text=True, cwd=ROOT)
    try:
        ready = json.loads(p.stdout.readline())
        hs = handshake(sock)
        assert hs["protocol"] == PROTOCOL_VERSION and hs["policy_sha256"] == ready["policy_sha256"]
        assert hs["tier"] == probe()["tier"]
    finally:
        p.terminate()
        assert p.wait(timeout=10) == 0
        p.stdout.close()


def test_a_broken_system_bwrap_is_passed_over_with_its_reason(tmp_path, monkeypatch):
    if not probe()["tiers"]["namespaced"]["ok"]:
        pytest.skip("the namespaced tier does not work here at all: " + probe()["tiers"]["namespaced"]["reason"])
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: Unknown option --bind-fd' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    try:
        p = probe(refresh=True)
        assert p["tier"] == "namespaced" and p["capabilities"]["bwrap"] != str(fake)
        monkeypatch.setenv("PATH", str(tmp_path))  # now only the broken one, and the wheel
        import nano_openshell.namespaced as ns
        monkeypatch.setattr(ns, "bwrap_candidates", lambda: [str(fake)])
        p = probe(refresh=True)
        assert p["tier"] == "fallback" and f"bwrap at {fake} failed" in p["reason"]
    finally:
        monkeypatch.undo()
        probe(refresh=True)
