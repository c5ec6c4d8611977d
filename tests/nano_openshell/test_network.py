"""The network path end to end: forwarder prelude -> Unix-socket proxy -> a real local server.

The first part runs the prelude in a plain bash on the host (the forwarder on a free port), so
the forwarder itself is checked; the second part runs inside the Sandbox, where the forwarder is
the only way out.
"""

import http.server
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time

import pytest

from nano_openshell.forwarder import FORWARDER_PORT, sandbox_prelude
from nano_openshell.policy import Policy
from nano_openshell.proxy import ProxyServer

CURL = shutil.which("curl")


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
    r = host_bash(sandbox_prelude(proxy.socket_path, port=port) + f"python3 -c \"{code}\"\n")
    assert r.stdout.splitlines() == ["hello from /py", "403"], r.stderr


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
