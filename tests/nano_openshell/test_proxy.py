"""The egress proxy on a Unix socket, driven with raw bytes against real local servers.

Only 127.0.0.1 is ever contacted: rules name it exactly, and names that must resolve somewhere
are pinned with the proxy's `resolve` hook (like curl --resolve), since no DNS exists here.
"""

import http.server
import json
import os
import shutil
import socket
import tempfile
import threading
import time

import pytest

from nano_openshell.policy import Policy, PolicyError
from nano_openshell.proxy import (PROTOCOL_VERSION, HandshakeError, ProxyServer, default_resolve,
                                  handshake)

from .conftest import wait_until


class Upstream(http.server.BaseHTTPRequestHandler):
    seen: list  # (method, path, headers, body) of every request the server received

    def _answer(self):
        n = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(n) if n else b""
        self.seen.append((self.command, self.path, dict(self.headers), body))
        out = json.dumps({"method": self.command, "path": self.path, "host": self.headers["Host"],
                          "body": body.decode()}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(out)

    do_GET = do_POST = do_HEAD = do_DELETE = _answer

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def upstream():
    handler = type("H", (Upstream,), {"seen": []})
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1], handler.seen
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def echo_port():
    """A raw TCP echo server: what a CONNECT tunnel reaches."""
    ls = socket.create_server(("127.0.0.1", 0))

    def serve(c):
        with c:
            while data := c.recv(65536):
                c.sendall(data)

    def loop():
        while True:
            try:
                c, _ = ls.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(c,), daemon=True).start()
    threading.Thread(target=loop, daemon=True).start()
    yield ls.getsockname()[1]
    ls.close()


@pytest.fixture
def workdir():
    d = tempfile.mkdtemp(prefix="osp", dir="/tmp")  # AF_UNIX paths must stay under 108 bytes
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def make_proxy(workdir, upstream, echo_port):
    port, _ = upstream
    started = []

    def make(rules=None, **kw):
        rules = rules if rules is not None else [
            {"name": "local", "host": "127.0.0.1", "ports": [port], "methods": ["GET", "HEAD"]},
            {"name": "local-post", "host": "127.0.0.1", "ports": [port], "methods": ["POST"],
             "paths": ["/upload"]},
            {"name": "tunnel", "host": "127.0.0.1", "ports": [echo_port], "methods": ["CONNECT"]},
            {"name": "named", "host": "localhost", "ports": [port]},
            {"name": "idn", "host": "bücher.test", "ports": [port]},
            {"name": "nx", "host": "nxdomain.test", "ports": [port]},
            {"name": "pinned-any", "host": "*.pinned.test", "ports": [port, echo_port],
             "methods": ["GET", "CONNECT"]},
        ]
        pins = {"xn--bcher-kva.test": ["127.0.0.1"], "api.pinned.test": ["127.0.0.1"],
                "mixed.pinned.test": ["93.184.216.34", "169.254.169.254"]}
        resolved = []

        def resolve(host, p):
            resolved.append(host)
            if host == "nxdomain.test":
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            return pins[host] if host in pins else default_resolve(host, p)
        kw.setdefault("resolve", resolve)
        proxy = ProxyServer(Policy.from_dict({"version": 1, "rules": rules}),
                            os.path.join(workdir, "proxy.sock"), os.path.join(workdir, "audit.jsonl"),
                            info={"tier": "namespaced", "capabilities": {"netns": True}}, **kw).start()
        proxy.resolved = resolved
        started.append(proxy)
        return proxy
    yield make
    for p in started:
        p.stop()


def send(proxy, data: bytes, shut=True, timeout=5.0) -> bytes:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(proxy.socket_path)
    try:
        s.sendall(data)
        if shut:
            s.shutdown(socket.SHUT_WR)
    except (BrokenPipeError, ConnectionResetError):
        pass  # the proxy answered and closed before taking everything
    out = b""
    try:
        while chunk := s.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    s.close()
    return out


def status(resp: bytes) -> int:
    return int(resp.split(b" ", 2)[1])


def body(resp: bytes) -> dict:
    return json.loads(resp.split(b"\r\n\r\n", 1)[1])


def audit(proxy) -> list[dict]:
    with open(proxy.audit_path) as f:
        return [json.loads(line) for line in f]


def get(host_port, path="/", method="GET", extra=b""):
    return (f"{method} http://{host_port}{path} HTTP/1.1\r\nHost: {host_port}\r\n".encode()
            + extra + b"\r\n")


def test_allowed_get_reaches_the_named_local_server(make_proxy, upstream):
    port, seen = upstream
    proxy = make_proxy()
    resp = send(proxy, get(f"127.0.0.1:{port}", "/hello?x=1"))
    assert status(resp) == 200
    assert body(resp) == {"method": "GET", "path": "/hello?x=1", "host": f"127.0.0.1:{port}", "body": ""}
    assert seen[-1][2].get("Connection") == "close"  # one request per upstream connection
    [line] = audit(proxy)
    assert set(line) == {"ts", "client", "method", "host", "port", "path", "decision", "rule",
                         "reason", "status"}
    assert (line["method"], line["host"], line["port"], line["path"], line["decision"],
            line["rule"]) == ("GET", "127.0.0.1", port, "/hello?x=1", "allow", "local")
    assert line["client"].startswith("pid=")


def test_denied_host_gets_403_and_an_audit_line(make_proxy):
    proxy = make_proxy()
    resp = send(proxy, get("example.com"))
    assert status(resp) == 403 and "no rule matches host example.com" in body(resp)["error"]
    [line] = audit(proxy)
    assert (line["decision"], line["status"], line["rule"], line["host"]) == \
        ("deny", 403, None, "example.com")
    assert proxy.resolved == []  # a denied name is never even resolved


def test_allowed_host_with_a_forbidden_method_gets_403(make_proxy, upstream):
    port, seen = upstream
    proxy = make_proxy()
    n = len(seen)
    resp = send(proxy, get(f"127.0.0.1:{port}", "/x", "DELETE"))
    assert status(resp) == 403 and "method DELETE" in body(resp)["error"]
    resp = send(proxy, get(f"127.0.0.1:{port}", "/elsewhere", "POST", b"Content-Length: 0\r\n"))
    assert status(resp) == 403 and "path /elsewhere" in body(resp)["error"]
    assert len(seen) == n
    assert [a["rule"] for a in audit(proxy)] == ["local", "local-post"]


def test_post_body_is_forwarded_and_nothing_rides_along(make_proxy, upstream):
    port, seen = upstream
    proxy = make_proxy()
    smuggled = f"GET /admin HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode()
    resp = send(proxy, get(f"127.0.0.1:{port}", "/upload", "POST", b"Content-Length: 5\r\n")
                + b"hello" + smuggled)
    assert status(resp) == 200 and body(resp)["body"] == "hello"
    time.sleep(0.2)  # a negative check: a smuggled request forwarded late would have reached upstream by now
    assert [s[1] for s in seen].count("/admin") == 0
    assert len(audit(proxy)) == 1


@pytest.mark.parametrize("extra,why", [
    (b"Transfer-Encoding: chunked\r\n", "Transfer-Encoding"),
    (b"Content-Length: 5\r\nContent-Length: 6\r\n", "Content-Length"),
    (b"Content-Length: -1\r\n", "Content-Length"),
])
def test_ambiguous_bodies_are_refused(make_proxy, upstream, extra, why):
    port, _ = upstream
    resp = send(make_proxy(), get(f"127.0.0.1:{port}", "/upload", "POST", extra))
    assert status(resp) == 400 and why in body(resp)["error"]


@pytest.mark.parametrize("request_bytes,why", [
    (b"GET http://127.0.0.1:{port}/ HTTP/1.1\r\nHost: example.com\r\n\r\n", "disagrees"),
    (b"GET http://127.0.0.1:{port}/ HTTP/1.1\r\nHost: 127.0.0.1:1\r\n\r\n", "disagrees"),
    (b"GET http://127.0.0.1:{port}/ HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nHost: x\r\n\r\n",
     "more than one Host"),
    (b"GET http://user:pw@127.0.0.1:{port}/ HTTP/1.1\r\n\r\n", "userinfo"),
    (b"GET http://127.0.0.1:{port}/ HTTP/1.1\r\nHost: u@127.0.0.1:{port}\r\n\r\n", "userinfo"),
    (b"GET http://127.1:{port}/ HTTP/1.1\r\n\r\n", "ambiguous numeric host"),
    (b"GET http://0x7f000001:{port}/ HTTP/1.1\r\n\r\n", "ambiguous numeric host"),
    (b"GET http://127.0.0.1:0/ HTTP/1.1\r\n\r\n", "port"),
    (b"GET http://127.0.0.1:65536/ HTTP/1.1\r\n\r\n", "port"),
    (b"GET http://127.0.0.1:8o/ HTTP/1.1\r\n\r\n", "port"),
    (b"GET http://b\xc3\xbccher.test:{port}/ HTTP/1.1\r\n\r\n", "non-ASCII"),
    (b"GET http://xn--zz.test:{port}/ HTTP/1.1\r\n\r\n", "international"),
    (b"GET http://127.0.0.1:{port}/a/../admin HTTP/1.1\r\n\r\n", "dot segments"),
    (b"GET http://127.0.0.1:{port}/a/%2e%2e/admin HTTP/1.1\r\n\r\n", "ambiguous path"),
    (b"GET https://127.0.0.1:{port}/ HTTP/1.1\r\n\r\n", "use CONNECT"),
    (b"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n", "absolute-form"),
    (b"GET http://127.0.0.1:{port}/ HTTP/2.0\r\n\r\n", "malformed request line"),
    (b"GET  http://127.0.0.1:{port}/ HTTP/1.1\r\n\r\n", "malformed request line"),
    (b"GET http://127.0.0.1:{port}/ HTTP/1.1\r\nX: a\r\n b\r\n\r\n", "malformed header"),
    (b"GET http://127.0.0.1:{port}/ HTTP/1.1\r\nBad Name: a\r\n\r\n", "malformed header"),
    (b"GET http://127.0.0.1:{port}/ HTTP/1.1\nHost: x\n\n", "CRLF"),
    (b"GET http://127.0.0.1:{port}/ HTTP/1.1", "closed before the end"),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", "non-ASCII"),
    (b"\x00\x01garbage\r\n\r\n", "malformed request line"),
    (b"CONNECT 127.0.0.1 HTTP/1.1\r\n\r\n", "host:port"),
])
def test_malformed_and_tricky_requests_get_400(make_proxy, upstream, request_bytes, why):
    port, seen = upstream
    proxy = make_proxy()
    n = len(seen)
    resp = send(proxy, request_bytes.replace(b"{port}", str(port).encode()))
    assert status(resp) == 400 and why in body(resp)["error"], resp
    [line] = audit(proxy)
    assert line["decision"] == "deny" and line["status"] == 400 and why in line["reason"]
    assert len(seen) == n


def test_oversized_request_line_and_headers_get_400_quickly(make_proxy, upstream):
    port, _ = upstream
    proxy = make_proxy()
    t = time.monotonic()
    resp = send(proxy, b"GET http://127.0.0.1/" + b"a" * (1 << 20) + b" HTTP/1.1\r\n\r\n")
    assert status(resp) == 400 and "request line longer" in body(resp)["error"]
    resp = send(proxy, get(f"127.0.0.1:{port}", extra=b"X-Pad: " + b"a" * 70_000 + b"\r\n"))
    assert status(resp) == 400 and "head larger" in body(resp)["error"]
    many = b"".join(b"X-%d: a\r\n" % i for i in range(200))
    resp = send(proxy, get(f"127.0.0.1:{port}", extra=many))
    assert status(resp) == 400 and "header lines" in body(resp)["error"]
    assert time.monotonic() - t < 3
    assert len(audit(proxy)) == 3


def test_a_silent_or_slow_client_times_out(make_proxy):
    proxy = make_proxy(header_timeout=0.5)
    t = time.monotonic()
    resp = send(proxy, b"GET http://127.0.0.1/ HTTP/1.1\r\n", shut=False)
    assert status(resp) == 408 and time.monotonic() - t < 2.5
    assert audit(proxy)[0]["status"] == 408


def test_a_client_that_sends_nothing_is_not_a_decision(make_proxy):
    proxy = make_proxy()
    assert send(proxy, b"") == b""
    assert not os.path.exists(proxy.audit_path)


def test_trailing_dot_and_case_reach_the_same_exact_rule(make_proxy, upstream):
    port, _ = upstream
    proxy = make_proxy()
    resp = send(proxy, get(f"LOCALHOST.:{port}"))
    assert status(resp) == 200 and body(resp)["host"] == f"LOCALHOST.:{port}"
    assert audit(proxy)[0]["host"] == "localhost" and audit(proxy)[0]["rule"] == "named"


def test_naming_a_host_does_not_admit_its_ip_or_vice_versa(make_proxy, upstream):
    port, _ = upstream
    proxy = make_proxy(rules=[{"name": "named", "host": "localhost", "ports": [port]}])
    assert status(send(proxy, get(f"127.0.0.1:{port}"))) == 403
    assert status(send(proxy, get(f"[::1]:{port}"))) == 403


def test_punycode_and_unicode_rules_are_one_name(make_proxy, upstream):
    port, _ = upstream
    proxy = make_proxy()
    resp = send(proxy, get(f"XN--BCHER-KVA.test:{port}"))  # the rule was written as "bücher.test"
    assert status(resp) == 200 and audit(proxy)[0]["rule"] == "idn"
    assert status(send(proxy, get(f"bucher.test:{port}"))) == 403  # the look-alike is not it


def test_allowed_wildcard_name_resolving_to_loopback_is_denied(make_proxy, upstream):
    port, seen = upstream
    proxy = make_proxy()
    n = len(seen)
    resp = send(proxy, get(f"api.pinned.test:{port}"))
    assert status(resp) == 403 and "loopback address 127.0.0.1" in body(resp)["error"]
    resp = send(proxy, get(f"mixed.pinned.test:{port}"))  # one bad answer among good ones is enough
    assert status(resp) == 403 and "link-local address 169.254.169.254" in body(resp)["error"]
    assert len(seen) == n
    assert [(a["decision"], a["rule"]) for a in audit(proxy)] == [("deny", "pinned-any")] * 2


def test_connect_tunnel_allowed_and_denied(make_proxy, echo_port):
    proxy = make_proxy()
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(proxy.socket_path)
    s.sendall(f"CONNECT 127.0.0.1:{echo_port} HTTP/1.1\r\nHost: 127.0.0.1:{echo_port}\r\n\r\n"
              "early bytes|".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    assert head.startswith(b"HTTP/1.1 200")
    s.sendall(b"through the tunnel")
    got = b""
    while len(got) < len(b"early bytes|through the tunnel"):
        got += s.recv(100)
    assert got == b"early bytes|through the tunnel"
    s.close()
    # the tunnel rule allows CONNECT only; unknown hosts and wildcard-to-loopback are refused
    resp = send(proxy, get(f"127.0.0.1:{echo_port}"))
    assert status(resp) == 403 and "method GET" in body(resp)["error"]
    assert status(send(proxy, b"CONNECT example.com:443 HTTP/1.1\r\n\r\n")) == 403
    resp = send(proxy, f"CONNECT api.pinned.test:{echo_port} HTTP/1.1\r\n\r\n".encode())
    assert status(resp) == 403 and "loopback" in body(resp)["error"]
    assert [(a["method"], a["decision"]) for a in audit(proxy)] == \
        [("CONNECT", "allow"), ("GET", "deny"), ("CONNECT", "deny"), ("CONNECT", "deny")]


def test_connect_to_a_port_the_rule_does_not_name_is_denied(make_proxy, upstream):
    port, _ = upstream
    resp = send(make_proxy(), f"CONNECT 127.0.0.1:{port} HTTP/1.1\r\n\r\n".encode())
    assert status(resp) == 403 and "method CONNECT not allowed by rule 'local'" in body(resp)["error"]


def test_allowed_but_unreachable_upstream_is_502(make_proxy):
    free = socket.create_server(("127.0.0.1", 0))
    dead_port = free.getsockname()[1]
    free.close()
    proxy = make_proxy(rules=[{"name": "dead", "host": "127.0.0.1", "ports": [dead_port]}])
    resp = send(proxy, get(f"127.0.0.1:{dead_port}"))
    assert status(resp) == 502
    [line] = audit(proxy)
    assert line["decision"] == "allow" and line["status"] == 502 and "connect failed" in line["reason"]


def test_allowed_name_that_does_not_resolve_is_502(make_proxy, upstream):
    port, _ = upstream
    proxy = make_proxy()
    resp = send(proxy, get(f"nxdomain.test:{port}"))
    assert status(resp) == 502 and "cannot resolve nxdomain.test" in body(resp)["error"]
    [line] = audit(proxy)
    assert (line["decision"], line["rule"], line["status"]) == ("deny", "nx", 502)


def test_concurrent_requests_each_get_their_own_decision(make_proxy, upstream):
    port, _ = upstream
    proxy = make_proxy()
    results = [None] * 16

    def one(i):
        path = f"/c{i}"
        host = f"127.0.0.1:{port}" if i % 2 == 0 else "denied.test"
        results[i] = send(proxy, get(host, path))
    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert [status(r) for r in results] == [200, 403] * 8
    assert all(body(results[i])["path"] == f"/c{i}" for i in range(0, 16, 2))
    assert len(audit(proxy)) == 16


def test_connection_limit_answers_503(make_proxy):
    proxy = make_proxy(max_connections=2, header_timeout=2.0)
    idle = []
    for _ in range(2):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(proxy.socket_path)
        idle.append(s)
    # both idle connections hold their slots (taken before their threads start, which then record them)
    wait_until(lambda: len(proxy._conns) == 2, "the proxy serves both idle connections")
    assert status(send(proxy, get("example.com"))) == 503
    for s in idle:
        s.close()


def test_handshake_reports_protocol_tier_capabilities_and_policy_hash(make_proxy):
    proxy = make_proxy()
    info = handshake(proxy.socket_path)
    assert info == {"protocol": PROTOCOL_VERSION, "tier": "namespaced",
                    "capabilities": {"netns": True}, "policy_sha256": proxy.policy.sha256}
    assert not os.path.exists(proxy.audit_path)  # a successful handshake is not a network decision


def test_wrong_protocol_is_refused_on_both_sides(make_proxy):
    proxy = make_proxy()
    with pytest.raises(HandshakeError, match="unsupported protocol version '2'"):
        handshake(proxy.socket_path, protocol=2)
    resp = send(proxy, b"GET /.openshell/handshake HTTP/1.1\r\n\r\n")  # no version at all
    assert status(resp) == 400
    lines = audit(proxy)
    assert len(lines) == 2 and all(a["decision"] == "deny" and a["status"] == 400 for a in lines)


def test_handshake_to_nothing_raises(workdir):
    with pytest.raises(HandshakeError, match="cannot reach"):
        handshake(os.path.join(workdir, "nobody.sock"), timeout=1.0)


def test_invalid_policy_file_never_starts_a_proxy(workdir):
    bad = os.path.join(workdir, "bad.toml")
    with open(bad, "w") as f:
        f.write('version = 1\n[[rules]]\nhost = "*.*.example.com"\n')
    sock = os.path.join(workdir, "p.sock")
    with pytest.raises(PolicyError, match="bad wildcard"):
        ProxyServer(bad, sock)
    assert not os.path.exists(sock)


def test_policy_file_path_start_stop_and_context_manager(workdir, upstream):
    port, _ = upstream
    pol = os.path.join(workdir, "p.json")
    with open(pol, "w") as f:
        json.dump({"version": 1, "rules": [{"host": "127.0.0.1", "ports": [port]}]}, f)
    sock = os.path.join(workdir, "p.sock")
    with ProxyServer(pol, sock, info={"tier": "fallback"}) as proxy:
        assert os.stat(sock).st_mode & 0o777 == 0o600
        assert status(send(proxy, get(f"127.0.0.1:{port}"))) == 200
        assert handshake(sock)["tier"] == "fallback"
    assert not os.path.exists(sock)


# ---- a flood from one sandbox: bounded disk, bounded rate ----

def test_audit_log_stays_bounded_under_large_denied_requests(make_proxy):
    """Large denied requests as fast as they go (44.9 MB of log in 8 s before): every field is cut,
    the log rotates at audit_max_bytes and one old file is kept."""
    cap = 64 << 10
    proxy = make_proxy(audit_max_bytes=cap, rate=None)
    for i in range(300):
        assert status(send(proxy, get("denied.test", f"/{i}/" + "a" * 7000))) == 403
    assert os.path.getsize(proxy.audit_path) <= cap and os.path.getsize(proxy.audit_path + ".1") <= cap
    assert not os.path.exists(proxy.audit_path + ".2")
    last = audit(proxy)[-1]
    assert last["path"].startswith("/299/") and last["path"].endswith("more chars]") and len(last["path"]) < 300
    assert (last["decision"], last["status"]) == ("deny", 403)


def test_requests_beyond_the_rate_are_refused_429_and_summarised(make_proxy, upstream):
    port, _ = upstream
    proxy = make_proxy(rate=(2, 5))
    codes = [status(send(proxy, get("denied.test", f"/{i}"))) for i in range(30)]
    assert codes[:5] == [403] * 5 and codes.count(429) >= 23, codes  # a burst of 5, then 2 a second
    time.sleep(0.6)  # inherent: the bucket refills with time alone, a token every 0.5 s at 2 a second
    assert status(send(proxy, get(f"127.0.0.1:{port}", "/again"))) == 200, "the bucket refills"
    proxy.stop()  # writes the count still pending
    lines = audit(proxy)
    assert len([a for a in lines if a["status"] == 403]) == codes.count(403)
    summaries = [a for a in lines if a["status"] == 429]
    assert sum(a["count"] for a in summaries) == codes.count(429), "each refusal counted, none logged alone"
    assert len(summaries) <= 3 and all("rate limit" in a["reason"] for a in summaries)


def test_a_bad_rate_is_refused(workdir):
    for bad in ((0, 5), (1, 0), (-1, 1)):
        with pytest.raises(ValueError, match="rate"):
            ProxyServer(Policy.from_dict({"version": 1, "rules": []}), os.path.join(workdir, "p.sock"), rate=bad)
