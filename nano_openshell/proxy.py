"""The egress proxy: HTTP on a Unix-domain socket, every request decided by a Policy and audited
(docs/network-policy.md). One request per connection, so none rides along unchecked; the name is
resolved once and only the addresses checked are connected to (no DNS rebinding between check and
use). The audit log stays bounded whatever a sandbox sends: fields cut to FIELD_CHARS, the file
rotated at max_bytes (one old file kept), refusals beyond the rate (a token bucket) summarised.
"""

from __future__ import annotations

import contextlib
import http
import json
import os
import selectors
import socket
import struct
import threading
import time

from .policy import Policy
from .request import CHUNK, HANDSHAKE_PATH, MAX_HEAD, BadRequest, parse_request, read_head

PROTOCOL_VERSION = 1
FIELD_CHARS = 256
SUMMARY_EVERY = 1.0


class HandshakeError(RuntimeError):
    """The proxy refused the handshake, or did not answer it properly."""


def default_resolve(host: str, port: int) -> list[str]:
    return list(dict.fromkeys(info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)))


class ProxyServer:
    def __init__(self, policy, socket_path, audit_path=None, info=None, *, resolve=None,
                 socket_mode=0o600, header_timeout=10.0, connect_timeout=10.0,
                 idle_timeout=60.0, max_connections=256, rate=(50, 200), audit_max_bytes=4 << 20):
        """policy: a Policy or its file (PolicyError if invalid: nothing starts). resolve(host, port) -> [ip,
        ...] replaces DNS (like curl --resolve). rate: (per second, burst) for the whole socket; None: no limit."""
        self.policy = policy if isinstance(policy, Policy) else Policy.load(policy)
        self.socket_path = str(socket_path)
        self.audit_path = str(audit_path) if audit_path is not None else None
        self._log = AuditLog(self.audit_path, audit_max_bytes) if audit_path is not None else None
        self._bucket = _TokenBucket(*rate) if rate is not None else None
        self.info, self.resolve, self.socket_mode = dict(info or {}), resolve or default_resolve, socket_mode
        self.header_timeout, self.connect_timeout, self.idle_timeout = header_timeout, connect_timeout, idle_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    def start(self) -> "ProxyServer":
        if self._listener is not None:
            raise RuntimeError("proxy already started")
        if len(os.fsencode(self.socket_path)) >= 108:
            raise ValueError(f"socket path too long for AF_UNIX: {self.socket_path}")
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)  # a stale socket from a previous run
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(self.socket_path)
        os.chmod(self.socket_path, self.socket_mode)
        s.listen(128)
        self._listener = s
        self._stopping.clear()
        self._thread = threading.Thread(target=self._accept_loop, name="openshell-proxy", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._listener is None:
            return
        self._stopping.set()
        _quiet(self._listener.shutdown, socket.SHUT_RDWR)  # wakes accept()
        self._listener.close()
        self._thread.join(timeout=5)
        with self._conns_lock:
            for c in list(self._conns):
                _quiet(c.shutdown, socket.SHUT_RDWR)
        _quiet(os.unlink, self.socket_path)
        if self._log is not None:
            self._log.close()
        self._listener = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._stopping.is_set():
                    return
                time.sleep(0.01)
                continue
            limited = self._bucket is not None and not self._bucket.take()
            if not self._slots.acquire(blocking=False):
                _quiet(conn.sendall, _response(503, "too many connections"))
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, limited), daemon=True).start()

    def _serve(self, conn: socket.socket, limited: bool) -> None:
        """One connection. limited (over the rate): the head is read, so that the client's send
        completes and the answer reaches it, then 429: not parsed, not decided, not logged alone."""
        upstream = None
        with self._conns_lock:
            self._conns.add(conn)
        try:
            client = _peer(conn)
            try:
                head, rest = read_head(conn, time.monotonic() + self.header_timeout)
                req = parse_request(head) if head is not None and not limited else None
            except BadRequest as e:
                if not limited:
                    self._audit(client, e.method, e.host, e.port, e.path, "deny", None, e.reason, e.status)
                    _quiet(conn.sendall, _response(e.status, e.reason))
                    return
            if limited:
                if self._log is not None:
                    self._log.refused()
                _quiet(conn.sendall, _response(429, "rate limit: too many requests from this sandbox"))
                return
            if req is None:
                return  # connected and left without sending anything: nothing to decide
            if req["kind"] == "handshake":
                return self._handshake(conn, client, req)
            upstream = self._decide_and_connect(conn, client, req)
            if upstream is None:
                return
            with self._conns_lock:
                self._conns.add(upstream)
            if req["kind"] == "connect":
                conn.sendall(b"HTTP/1.1 200 Connection Established\r\n\r\n")
                if rest:
                    upstream.sendall(rest)
                _relay(conn, upstream, self.idle_timeout, limit=None)
            else:
                body = rest[:req["length"]]
                upstream.sendall(req["upstream_head"] + body)
                _relay(conn, upstream, self.idle_timeout, limit=req["length"] - len(body))
        except OSError:
            pass  # the client or upstream went away mid-stream; the decision is already logged
        finally:
            for s in (conn, upstream):
                if s is not None:
                    with self._conns_lock:
                        self._conns.discard(s)
                    s.close()
            self._slots.release()

    def _decide_and_connect(self, conn, client, req):
        """Decide on the name, then on its addresses; a connection to one of those, or None (answered)."""
        m, host, port, path = req["method"], req["host"], req["port"], req["path"]
        policy_path = None if req["kind"] == "connect" else path

        def refuse(rule, reason, status, decision="deny"):
            self._audit(client, m, host, port, path, decision, rule, reason, status)
            _quiet(conn.sendall, _response(status, reason))

        d = self.policy.decide(m, host, port, policy_path)
        if not d.allowed:
            return refuse(d.rule, d.reason, 403)
        try:
            addresses = list(self.resolve(host, port))
        except Exception as e:  # noqa: BLE001 - any resolver failure is this request's 502, not a crash
            return refuse(d.rule, f"cannot resolve {host}: {e}", 502)
        d = self.policy.decide(m, host, port, policy_path, addresses=addresses)
        if not d.allowed:
            return refuse(d.rule, d.reason, 403)
        errors = []
        for a in addresses:  # exactly the addresses that were checked
            s = socket.socket(socket.AF_INET6 if ":" in a else socket.AF_INET, socket.SOCK_STREAM)
            s.settimeout(self.connect_timeout)
            try:
                s.connect((a, port))
                s.settimeout(self.idle_timeout)
                self._audit(client, m, host, port, path, "allow", d.rule, f"{d.reason}; via {a}",
                            200 if req["kind"] == "connect" else None)
                return s
            except OSError as e:
                s.close()
                errors.append(f"{a}: {e}")
        return refuse(d.rule, f"{d.reason}; upstream connect failed: {'; '.join(errors) or 'no address'}", 502, "allow")

    def _handshake(self, conn, client, req) -> None:
        if req["protocol"] != str(PROTOCOL_VERSION):
            reason = f"unsupported protocol version {req['protocol']!r}; this supervisor speaks {PROTOCOL_VERSION}"
            self._audit(client, "GET", "", 0, HANDSHAKE_PATH, "deny", None, reason, 400)
            return _quiet(conn.sendall, _response(400, reason))
        body = json.dumps({"protocol": PROTOCOL_VERSION, "tier": self.info.get("tier"), "policy_sha256":
                           self.policy.sha256, "capabilities": self.info.get("capabilities", {})}).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)

    def _audit(self, client, method, host, port, path, decision, rule, reason, status) -> None:
        if self._log is not None:
            self._log.write({"client": client, "method": method, "host": host, "port": port, "path": path,
                             "decision": decision, "rule": rule, "reason": reason, "status": status})


class AuditLog:
    def __init__(self, path: str, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes
        self._lock = threading.Lock()
        self._size = os.path.getsize(path) if os.path.exists(path) else 0
        self._refused, self._refused_since, self._last_summary = 0, 0.0, 0.0

    def write(self, record: dict) -> None:
        with self._lock:
            self._flush_refused()
            cut = {k: v[:FIELD_CHARS] + f"...[{len(v) - FIELD_CHARS} more chars]"
                   if isinstance(v, str) and len(v) > FIELD_CHARS else v for k, v in record.items()}
            self._append({"ts": round(time.time(), 6), **cut})

    def refused(self) -> None:
        """One request refused by the rate limit: counted, summarised at most once a SUMMARY_EVERY."""
        with self._lock:
            if not self._refused:
                self._refused_since = time.time()
            self._refused += 1
            if time.monotonic() - self._last_summary >= SUMMARY_EVERY:
                self._flush_refused()

    def close(self) -> None:
        with self._lock:
            self._flush_refused()

    def _flush_refused(self) -> None:
        if self._refused:
            self._append({"ts": round(time.time(), 6), "since": round(self._refused_since, 6),
                          "decision": "deny", "status": 429, "count": self._refused,
                          "reason": f"{self._refused} more requests refused: rate limit"})
            self._refused, self._last_summary = 0, time.monotonic()

    def _append(self, record: dict) -> None:
        line = (json.dumps(record) + "\n").encode()
        if self._size and self._size + len(line) > self.max_bytes:
            os.replace(self.path, self.path + ".1")
            self._size = 0
        with open(self.path, "ab") as f:
            f.write(line)
        self._size += len(line)


class _TokenBucket:
    """`burst` requests at once, then `per_second` on average (only the accept loop takes: no lock)."""

    def __init__(self, per_second: float, burst: int):
        if per_second <= 0 or burst < 1:
            raise ValueError(f"rate must be (per_second > 0, burst >= 1), got ({per_second}, {burst})")
        self.per_second, self.burst = per_second, burst
        self.tokens, self.at = float(burst), time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self.tokens, self.at = min(self.burst, self.tokens + (now - self.at) * self.per_second), now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


def _relay(client: socket.socket, upstream: socket.socket, idle: float, limit: int | None) -> None:
    """Pipe both ways until done. limit: request-body bytes still owed upstream (HTTP: the client is
    read only that far, and the exchange ends when upstream closes); None: a tunnel."""
    sel = selectors.DefaultSelector()
    if limit is None or limit > 0:
        sel.register(client, selectors.EVENT_READ, upstream)
    sel.register(upstream, selectors.EVENT_READ, client)
    client.settimeout(idle)
    upstream.settimeout(idle)
    try:
        while sel.get_map():
            events = sel.select(idle)
            if not events:
                return  # idle timeout
            for key, _ in events:
                src, dst = key.fileobj, key.data
                data = src.recv(CHUNK if (src is upstream or limit is None) else min(CHUNK, limit))
                if not data:
                    if src is upstream and limit is not None:
                        return
                    sel.unregister(src)
                    _quiet(dst.shutdown, socket.SHUT_WR)
                    continue
                dst.sendall(data)
                if src is client and limit is not None:
                    limit -= len(data)
                    if limit == 0:
                        sel.unregister(client)  # anything more from the client is not forwarded
    finally:
        sel.close()


def _response(status: int, reason: str) -> bytes:
    body = (json.dumps({"error": reason}) + "\n").encode()
    safe = "".join(c if c.isascii() and c.isprintable() else "?" for c in reason)[:300]
    return (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\nX-OpenShell-Reason: {safe}\r\n\r\n").encode() + body


def _peer(conn: socket.socket) -> str:
    try:
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return f"pid={pid} uid={uid}"
    except OSError:
        return "unknown"


def _quiet(fn, *args) -> None:
    with contextlib.suppress(OSError):
        fn(*args)


def handshake(socket_path, protocol=PROTOCOL_VERSION, timeout: float = 5.0) -> dict:
    """Ask the supervisor's proxy who it is. Raises HandshakeError if refused or garbled."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(socket_path))
        s.sendall(f"GET {HANDSHAKE_PATH} HTTP/1.1\r\nHost: openshell\r\n"
                  f"X-OpenShell-Protocol: {protocol}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while len(data) < MAX_HEAD and (chunk := s.recv(CHUNK)):
            data += chunk
    except OSError as e:
        raise HandshakeError(f"cannot reach the supervisor at {socket_path}: {e}") from None
    finally:
        s.close()
    head, _, body = data.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].decode("latin-1")
    try:
        payload = json.loads(body)
    except ValueError:
        raise HandshakeError(f"garbled handshake answer: {status_line!r}") from None
    if not status_line.startswith("HTTP/1.1 200"):
        raise HandshakeError(f"handshake refused ({status_line}): {payload.get('error')}")
    if payload.get("protocol") != protocol:
        raise HandshakeError(f"supervisor speaks protocol {payload.get('protocol')!r}, not {protocol!r}")
    return payload
