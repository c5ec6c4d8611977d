"""The network path end to end: forwarder prelude -> Unix-socket proxy -> a real local server.

The first part runs the prelude in a plain bash on the host (the forwarder on a free port), so
the forwarder itself is checked; the second part runs inside the Sandbox, where the forwarder is
the only way out.
"""

import http.server
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from nano_openshell.forwarder import FORWARDER_PORT, sandbox_prelude
from nano_openshell.policy import Policy
from nano_openshell.proxy import ProxyServer

CURL = shutil.which("curl")
PY = shlex.quote(sys.executable) + " -I"  # on the host; inside a sandbox, `python3` from its PATH


class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        out = f"hello from {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        self.wfile.write(out)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server_port():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def proxy(server_port):
    d = tempfile.mkdtemp(prefix="osn", dir="/tmp")
    policy = Policy.from_dict({"version": 1, "rules": [
        {"name": "local", "host": "127.0.0.1", "ports": [server_port]}]})
    p = ProxyServer(policy, os.path.join(d, "proxy.sock"), os.path.join(d, "audit.jsonl"),
                    socket_mode=0o666).start()
    yield p
    p.stop()
    shutil.rmtree(d, ignore_errors=True)


def audit(proxy) -> list[dict]:
    if not os.path.exists(proxy.audit_path):
        return []
    with open(proxy.audit_path) as f:
        return [json.loads(line) for line in f]


def free_port() -> int:
    s = socket.create_server(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def host_bash(script: str, timeout=20) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


# ---- the forwarder, on the host ----

@pytest.mark.skipif(CURL is None, reason="curl is not installed")
def test_forwarder_carries_curl_through_the_proxy(proxy, server_port):
    port = free_port()
    r = host_bash(sandbox_prelude(proxy.socket_path, port=port) +
                  f"curl -sS -w ' %{{http_code}}' http://127.0.0.1:{server_port}/ok; echo\n"
                  "curl -sS -o /dev/null -w '%{http_code}' http://denied.test/\n")
    assert r.stdout.splitlines() == ["hello from /ok 200", "403"], r.stderr
    assert [(a["decision"], a["host"]) for a in audit(proxy)] == \
        [("allow", "127.0.0.1"), ("deny", "denied.test")]


def test_forwarder_carries_python_urllib(proxy, server_port):
    port = free_port()
    code = ("import urllib.request as u, urllib.error as e\n"
            f"print(u.urlopen('http://127.0.0.1:{server_port}/py', timeout=5).read().decode())\n"
            "try:\n    u.urlopen('http://denied.test/', timeout=5)\n"
            "except e.HTTPError as err:\n    print(err.code)\n")
    r = host_bash(sandbox_prelude(proxy.socket_path, port=port) + f"{PY} -c \"{code}\"\n")
    assert r.stdout.splitlines() == ["hello from /py", "403"], r.stderr


@pytest.mark.skipif(CURL is None or shutil.which("python3") is None, reason="needs curl and python3")
def test_prelude_falls_back_to_python3_when_its_python_is_out_of_reach(proxy, server_port):
    port = free_port()
    r = host_bash(sandbox_prelude(proxy.socket_path, port=port, python="/nonexistent/bin/python") +
                  f"curl -sS http://127.0.0.1:{server_port}/fallback\n")
    assert r.stdout == "hello from /fallback" and r.stderr == ""


def test_forwarder_dies_with_the_shell_that_started_it(proxy):
    port = free_port()
    r = host_bash(sandbox_prelude(proxy.socket_path, port=port) + "echo started\n")
    assert r.stdout == "started\n" and r.stderr == ""
    deadline = time.monotonic() + 3
    while accepts(port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not accepts(port)


def test_forwarder_that_cannot_listen_is_reported_and_the_command_still_runs(proxy):
    busy = socket.create_server(("127.0.0.1", 0))
    try:
        port = busy.getsockname()[1]
        t = time.monotonic()
        r = host_bash(sandbox_prelude(proxy.socket_path, port=port) + "echo still-ran\n")
        assert r.stdout == "still-ran\n"
        assert "network forwarder did not start: error: cannot listen" in r.stderr
        assert time.monotonic() - t < 5
    finally:
        busy.close()


@pytest.mark.skipif(CURL is None, reason="curl is not installed")
def test_forwarder_without_a_proxy_closes_the_connection():
    port = free_port()
    r = host_bash(sandbox_prelude("/tmp/no-such-openshell.sock", port=port) +
                  "curl -sS -w '%{http_code}' http://example.com/\n")
    assert r.stdout == "the supervisor proxy is unreachable: [Errno 2] No such file or directory\n502"


def test_prelude_rejects_a_bad_port():
    for bad in (0, 65536, "3128", True):
        with pytest.raises(ValueError):
            sandbox_prelude("/run/proxy.sock", port=bad)
    assert FORWARDER_PORT == 3128
    assert "HTTPS_PROXY=http://127.0.0.1:3128" in sandbox_prelude("/run/proxy.sock")


# ---- inside the Sandbox: the forwarder is the only way out ----

MARK = "openshell-net-marker"  # printed first, so a sandbox that never started cannot pass


@pytest.fixture(scope="module")
def net_sandbox(server_port):
    from nano_openshell.probe import probe
    from nano_openshell.sandbox import Sandbox

    tiers = probe()["tiers"]
    if not tiers["namespaced"]["ok"]:
        pytest.skip(f"network policies need the namespaced tier: {tiers['namespaced']['reason']}")
    policy = Policy.from_dict({"version": 1, "rules": [
        {"name": "local", "host": "127.0.0.1", "ports": [server_port],
         "methods": ["GET", "HEAD", "CONNECT"]}]})
    with Sandbox(policy=policy) as sb:
        sb.policy_for_test = policy
        yield sb


def run_marked(sb, cmd: str, timeout=20):
    r = sb.exec(f"echo {MARK}; {cmd}", timeout=timeout)
    assert r.stdout.startswith(MARK + "\n"), (r.stdout, r.stderr)
    assert not r.timed_out, r
    return r, r.stdout[len(MARK) + 1:]


def sandbox_audit(sb) -> list[dict]:
    with open(sb.audit_path) as f:
        return [json.loads(line) for line in f]


def test_sandbox_handshake_carries_tier_and_policy_hash(net_sandbox):
    assert net_sandbox.handshake["protocol"] == 1
    assert net_sandbox.handshake["tier"] == "namespaced"
    assert net_sandbox.handshake["policy_sha256"] == net_sandbox.policy_for_test.sha256


@pytest.mark.skipif(CURL is None, reason="curl is not installed")
def test_sandbox_curl_reaches_the_allowed_server_and_is_denied_elsewhere(net_sandbox, server_port):
    n = len(sandbox_audit(net_sandbox)) if os.path.exists(net_sandbox.audit_path) else 0
    r, out = run_marked(net_sandbox, f"curl -sS -w ' %{{http_code}}\\n' http://127.0.0.1:{server_port}/in; "
                                     "curl -sS -o /dev/null -w '%{http_code}\\n' http://denied.test/; "
                                     f"curl -sS -o /dev/null -w '%{{http_code}}\\n' -X POST "
                                     f"http://127.0.0.1:{server_port}/in")
    assert out.splitlines() == ["hello from /in 200", "403", "403"], r.stderr
    new = sandbox_audit(net_sandbox)[n:]
    assert [(a["method"], a["host"], a["decision"]) for a in new] == \
        [("GET", "127.0.0.1", "allow"), ("GET", "denied.test", "deny"), ("POST", "127.0.0.1", "deny")]


@pytest.mark.skipif(CURL is None, reason="curl is not installed")
def test_sandbox_connect_tunnel_through_the_forwarder(net_sandbox, server_port):
    n = len(sandbox_audit(net_sandbox)) if os.path.exists(net_sandbox.audit_path) else 0
    r, out = run_marked(net_sandbox, f"curl -sS -p http://127.0.0.1:{server_port}/tunnel; echo; "
                                     "curl -sS -p http://denied.test:8443/ 2>&1; echo rc=$?")
    lines = out.splitlines()
    assert lines[0] == "hello from /tunnel", r.stderr
    assert "403" in lines[1] and lines[-1] == "rc=56"
    new = sandbox_audit(net_sandbox)[n:]
    assert [(a["method"], a["host"], a["port"], a["decision"]) for a in new] == \
        [("CONNECT", "127.0.0.1", server_port, "allow"), ("CONNECT", "denied.test", 8443, "deny")]


def test_sandbox_python_urllib_uses_the_proxy(net_sandbox, server_port):
    code = ("import urllib.request as u, urllib.error as e\n"
            f"print(u.urlopen('http://127.0.0.1:{server_port}/py', timeout=5).read().decode())\n"
            "try:\n    u.urlopen('http://denied.test/', timeout=5)\n"
            "except e.HTTPError as err:\n    print(err.code)\n")
    r, out = run_marked(net_sandbox, f"python3 -I -c \"{code}\"")
    assert out.splitlines() == ["hello from /py", "403"], r.stderr


@pytest.mark.skipif(CURL is None, reason="curl is not installed")
def test_sandbox_noproxy_curl_cannot_reach_the_host(net_sandbox, server_port):
    r, out = run_marked(net_sandbox, f"curl -sS --noproxy '*' --max-time 5 "
                                     f"http://127.0.0.1:{server_port}/direct; echo rc=$?")
    assert "hello" not in out and "rc=0" not in out and "rc=" in out


def test_sandbox_direct_tcp_udp_and_ipv6_fail(net_sandbox, server_port):
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.settimeout(0.5)
    code = f"""
import socket
def attempt(name, fn):
    try:
        fn()
        print(name, "OK")
    except OSError as e:
        print(name, "blocked", type(e).__name__)
def tcp(family, addr):
    s = socket.socket(family, socket.SOCK_STREAM); s.settimeout(3); s.connect(addr); s.close()
attempt("tcp-host", lambda: tcp(socket.AF_INET, ("127.0.0.1", {server_port})))
attempt("tcp-v6", lambda: tcp(socket.AF_INET6, ("::1", {server_port})))
attempt("tcp-out", lambda: tcp(socket.AF_INET, ("192.0.2.1", 80)))
attempt("tcp-out-v6", lambda: tcp(socket.AF_INET6, ("2001:db8::1", 80)))
attempt("udp-out", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"x", ("192.0.2.1", 53)))
try:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b"escaped", ("127.0.0.1", {udp.getsockname()[1]}))
except OSError:
    pass
"""
    r, out = run_marked(net_sandbox, f"python3 -I -c '{code}'")
    results = dict(line.split(" ", 1) for line in out.splitlines())
    assert set(results) == {"tcp-host", "tcp-v6", "tcp-out", "tcp-out-v6", "udp-out"}, r.stderr
    assert all(v.startswith("blocked") for v in results.values()), results
    with pytest.raises(socket.timeout):
        udp.recvfrom(100)  # the datagram stayed inside the sandbox's own loopback
    udp.close()


def test_sandbox_forwarder_does_not_outlive_the_command(net_sandbox):
    # a fresh forwarder starts with each command: if the last one lingered, this one could not listen
    for _ in range(2):
        r, out = run_marked(net_sandbox, "echo ok")
        assert out == "ok\n" and "did not start" not in r.stderr


def test_a_policy_below_the_namespaced_tier_is_a_clear_error(server_port):
    from nano_openshell.probe import probe
    from nano_openshell.sandbox import Sandbox, SandboxError

    if not probe()["tiers"]["fallback"]["ok"]:
        pytest.skip(f"the fallback tier does not work here: {probe()['tiers']['fallback']['reason']}")
    policy = Policy.from_dict({"version": 1, "rules": [{"host": "127.0.0.1", "ports": [server_port]}]})
    ws = tempfile.mkdtemp(prefix="osw", dir="/tmp")
    try:
        with pytest.raises(SandboxError, match="namespaced"):
            Sandbox(workspace=ws, policy=policy, tier="fallback", min_tier="fallback")
    finally:
        shutil.rmtree(ws, ignore_errors=True)


def test_sandbox_requests_beyond_its_rate_get_429(server_port):
    """Limits.proxy_requests_per_second / proxy_request_burst reach the sandbox's proxy."""
    from nano_openshell.probe import probe
    from nano_openshell.sandbox import Limits, Sandbox

    if not probe()["tiers"]["namespaced"]["ok"]:
        pytest.skip(f"network policies need the namespaced tier: {probe()['tiers']['namespaced']['reason']}")
    policy = Policy.from_dict({"version": 1, "rules": [
        {"name": "local", "host": "127.0.0.1", "ports": [server_port], "methods": ["GET"]}]})
    code = ("import urllib.request as u, urllib.error as e\n"
            "for i in range(12):\n"
            "    try:\n"
            f"        print(u.urlopen(f'http://127.0.0.1:{server_port}/r{{i}}', timeout=5).status)\n"
            "    except e.HTTPError as err:\n"
            "        print(err.code)\n")
    with Sandbox(policy=policy, limits=Limits(proxy_requests_per_second=1, proxy_request_burst=3)) as sb:
        r, out = run_marked(sb, f"python3 -I -c \"{code}\"")
    codes = out.split()
    assert len(codes) == 12 and codes[0] == "200", (out, r.stderr)
    assert codes.count("429") >= 7, codes  # the burst (less the supervisor's handshake), then 1 a second
