"""What a command must not reach: supervisor secrets, the network, the host filesystem, the kernel."""

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from nano_openshell import probe

from .conftest import MARK, started

SECRETS = {"HF_TOKEN": "hf_s3cr3t", "OPENAI_API_KEY": "sk-s3cr3t", "GITHUB_TOKEN": "ghp_s3cr3t",
           "AWS_SECRET_ACCESS_KEY": "aws-s3cr3t", "AWS_ACCESS_KEY_ID": "AKIAS3CR3T"}


def test_secrets_unreadable_via_env_and_every_proc_environ(make_sandbox, monkeypatch):
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v + "-value")
    sb = make_sandbox()
    r = started(sb.exec(
        f"echo {MARK}; env; cat /proc/1/environ /proc/$PPID/environ /proc/{os.getpid()}/environ; "
        "for f in /proc/[0-9]*/environ /proc/[0-9]*/task/*/environ; do cat $f; done; "
        "ps eww -A 2>/dev/null; echo end", timeout=10))
    seen = r.stdout + r.stderr
    assert "end" in r.stdout and "PATH=" in r.stdout
    for k, v in SECRETS.items():
        assert v not in seen, f"{k} leaked into the sandbox"


def test_host_command_lines_are_unreadable(shared_sandbox):
    """A host process (the trainer, another sandbox's command) with a secret in its argv: no command
    in the sandbox reads it, whichever way it looks. Where the host gives us no way to hide /proc,
    the Sandbox must say so in its gaps instead."""
    secret = "hf_" + os.urandom(8).hex()
    host = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"--hf-token={secret}"])
    try:
        r = started(shared_sandbox.exec(
            f"echo {MARK}; cat /proc/{host.pid}/cmdline; cat /proc/[0-9]*/cmdline /proc/[0-9]*/task/*/cmdline; "
            f"tr '\\0' ' ' < /proc/{host.pid}/cmdline; ps -eo args 2>/dev/null; "
            f"python3 -I -c 'print(open(\"/proc/{host.pid}/cmdline\").read())'; "
            "head -1 /proc/meminfo; echo end", timeout=20))
    finally:
        host.kill()
        host.wait()
    assert r.stdout.endswith("end\n"), r.stderr
    assert r.stdout.split("\n")[-3].startswith("MemTotal:"), "system-wide figures stay readable"
    hidden = not any("command lines" in g for g in shared_sandbox.gaps)
    assert hidden == (secret not in r.stdout + r.stderr), (shared_sandbox.gaps, r.stdout[-300:])
    assert hidden or (shared_sandbox.tier == "fallback" and probe()["capabilities"]["landlock_abi"] == 0)


def test_environment_is_an_allowlist(shared_sandbox, monkeypatch):
    monkeypatch.setenv("SOME_SUPERVISOR_SETTING", "x")
    r = started(shared_sandbox.exec(f"echo {MARK}; env -0", timeout=10))
    names = {kv.split("=", 1)[0] for kv in r.stdout[len(MARK) + 1:].split("\0") if kv}
    assert names <= {"PATH", "HOME", "PWD", "TMPDIR", "SHELL", "USER", "LOGNAME", "LANG", "LC_ALL", "TERM",
                     "TZ", "SHLVL", "_", "OLDPWD"}, names
    home = shared_sandbox.exec('echo "$HOME"; pwd', timeout=10).stdout.split()
    assert home[0] == home[1]


class _Listeners:
    """TCP on 127.0.0.1 and ::1 and UDP on 127.0.0.1 in the supervisor's network; records contacts."""

    def __init__(self):
        self.contacts = []
        self.socks = []
        for family, kind, addr in ((socket.AF_INET, socket.SOCK_STREAM, "127.0.0.1"),
                                   (socket.AF_INET6, socket.SOCK_STREAM, "::1"),
                                   (socket.AF_INET, socket.SOCK_DGRAM, "127.0.0.1")):
            s = socket.socket(family, kind)
            s.bind((addr, 0))
            if kind == socket.SOCK_STREAM:
                s.listen()
            s.settimeout(0.1)
            self.socks.append(s)
        self.tcp4, self.tcp6, self.udp4 = (s.getsockname()[1] for s in self.socks)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            for s in self.socks:
                try:
                    if s.type == socket.SOCK_STREAM:
                        conn, peer = s.accept()
                        self.contacts.append(("tcp", peer))
                        conn.close()
                    else:
                        self.contacts.append(("udp", s.recvfrom(100)))
                except (socket.timeout, OSError):
                    pass

    def close(self):
        self.stop.set()
        self.thread.join()
        for s in self.socks:
            s.close()


def test_no_network_without_a_policy(shared_sandbox):
    lis = _Listeners()
    try:
        py = ("import socket\n"
              "for fam, kind, addr in ((socket.AF_INET, socket.SOCK_STREAM, ('127.0.0.1', %d)),"
              " (socket.AF_INET6, socket.SOCK_STREAM, ('::1', %d)), (socket.AF_INET, socket.SOCK_DGRAM, ('127.0.0.1', %d))):\n"
              "  try:\n"
              "    s = socket.socket(fam, kind); s.settimeout(1); s.connect(addr); s.send(b'x'); print('CONNECTED' if kind == socket.SOCK_STREAM else 'sent', addr)\n"
              "  except OSError as e: print('blocked', addr, e)\n") % (lis.tcp4, lis.tcp6, lis.udp4)
        r = started(shared_sandbox.exec(
            f"echo {MARK}\n"
            f"(exec 3<>/dev/tcp/127.0.0.1/{lis.tcp4}) && echo TCP4-OPEN\n"
            f"(exec 3<>/dev/tcp/::1/{lis.tcp6}) && echo TCP6-OPEN\n"
            f"echo x > /dev/udp/127.0.0.1/{lis.udp4}\n"
            f"curl -s --max-time 2 --noproxy '*' http://127.0.0.1:{lis.tcp4}/ && echo CURL-OK\n"
            f"python3 -I -c \"{py}\"\n"
            "echo end", timeout=20))
        assert "end" in r.stdout
        for opened in ("TCP4-OPEN", "TCP6-OPEN", "CURL-OK", "CONNECTED"):
            assert opened not in r.stdout
        time.sleep(0.3)  # a datagram may only count once it had time to arrive
        assert lis.contacts == [], lis.contacts
    finally:
        lis.close()


def test_writes_outside_the_workspace_fail(sandbox):
    outside = tempfile.mkdtemp(dir="/var/tmp", prefix="nano-openshell-outside-")
    os.chmod(outside, 0o777)  # writable by anyone on the host: only the sandbox can stop the write
    try:
        r = started(sandbox.exec(
            f"echo {MARK}; for p in {outside}/f /etc/f /usr/f /f /var/tmp/f /run/f /dev/f /root/f /home/f; do "
            "echo x > $p && echo WROTE $p; done; echo ok > inside && cat inside", timeout=10))
        assert "WROTE" not in r.stdout and r.stdout.endswith("ok\n")
        assert os.listdir(outside) == []
        assert not os.path.exists("/etc/f") and not os.path.exists("/f")
        assert open(os.path.join(sandbox.workspace, "inside")).read() == "ok\n"
    finally:
        os.rmdir(outside)


def test_private_tmp_is_private(shared_sandbox):
    tok = os.urandom(6).hex()
    r = started(shared_sandbox.exec(f'echo {MARK}; echo {tok} > "${{TMPDIR:-/tmp}}/mine"; echo stored', timeout=10))
    assert r.stdout.endswith("stored\n")
    r2 = shared_sandbox.exec(f'cat "${{TMPDIR:-/tmp}}/mine" 2>/dev/null || echo gone; echo {tok} > /tmp/{tok}', timeout=10)
    assert r2.stdout == "gone\n"
    assert not os.path.exists(f"/tmp/{tok}"), "the host's /tmp is not the sandbox's"


def test_workspace_symlinks_do_not_reach_host_files(sandbox):
    shadow = os.stat("/etc/shadow")
    r = started(sandbox.exec(
        f"echo {MARK}; ln -s /etc/shadow s; ln -s /etc s_etc; ln /etc/shadow hard && echo HARDLINKED; "
        "cat s && echo READ; echo x >> s && echo WROTE; echo x > s_etc/owned && echo WROTE2; "
        "chmod 666 s 2>/dev/null && echo CHMOD; echo end", timeout=10))
    assert r.stdout.endswith("end\n")
    for bad in ("HARDLINKED", "READ", "WROTE", "CHMOD"):
        assert bad not in r.stdout
    sandbox.exec("true", timeout=10)  # the next exec re-walks the workspace (and its links)
    after = os.stat("/etc/shadow")
    assert (after.st_uid, after.st_gid, after.st_mode) == (shadow.st_uid, shadow.st_gid, shadow.st_mode)
    assert not os.path.exists("/etc/owned")


@pytest.mark.parametrize("attempt,command", [
    ("mount", "mount -t tmpfs none /mnt && echo ESCAPED"),
    ("unshare", "unshare -U -r true && echo ESCAPED; unshare -m true && echo ESCAPED"),
    ("ptrace", "python3 -I -c 'import ctypes; r = ctypes.CDLL(None).ptrace(0, 0, 0, 0); print(\"ESCAPED\" if r == 0 else \"denied\")'"),
    ("ptrace_sibling", "sleep 5 & python3 -I -c 'import ctypes,sys; r = ctypes.CDLL(None).ptrace(16, int(sys.argv[1]), 0, 0); print(\"ESCAPED\" if r == 0 else \"denied\")' $!"),
])
def test_kernel_attack_surface_is_denied(shared_sandbox, attempt, command):
    r = started(shared_sandbox.exec(f"echo {MARK}; {command}; echo end", timeout=10))
    assert r.stdout.endswith("end\n") and "ESCAPED" not in r.stdout, (r.stdout, r.stderr)


def test_workspace_handover_never_chowns_a_hard_linked_host_file(sandbox):
    if sandbox.uid is None:
        pytest.skip("only a root supervisor hands the workspace to another uid")
    host = tempfile.mktemp(dir="/var/tmp", prefix="nano-openshell-host-")
    with open(host, "w") as f:
        f.write("host file\n")
    try:
        os.link(host, os.path.join(sandbox.workspace, "linked"))  # what protected_hardlinks=0 would allow
        with open(os.path.join(sandbox.workspace, "mine"), "w") as f:
            f.write("task file\n")
        assert sandbox.exec("cat mine", timeout=10).stdout == "task file\n"
        assert os.stat(host).st_uid == 0
        assert os.stat(os.path.join(sandbox.workspace, "mine")).st_uid == sandbox.uid
    finally:
        os.unlink(host)
