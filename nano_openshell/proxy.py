"""The egress proxy: HTTP on a Unix-domain socket, deciding every request with a Policy.

Clients (the in-sandbox forwarder) send absolute-form HTTP requests (`GET http://host/path`) or
`CONNECT host:port` for TLS. Each request is decided once, logged as one JSONL audit line, and
served on its own connection: one request per connection, then the connection is closed, so no
second request can ride along unchecked. The name is resolved once and the proxy connects only to
the addresses it checked (no DNS rebinding between check and use).

The supervisor handshake is an origin-form request on the same socket:
    GET /.openshell/handshake HTTP/1.1  +  X-OpenShell-Protocol: 1
answered with JSON {"protocol", "tier", "capabilities", "policy_sha256"}; any other protocol
version is refused with 400 (and an audit line).
"""

from __future__ import annotations

import json
import os
import re
import selectors
import socket
import struct
import threading
import time
from pathlib import Path

from .policy import HostError, Policy, normalize_host

PROTOCOL_VERSION = 1
HANDSHAKE_PATH = "/.openshell/handshake"
PROTOCOL_HEADER = "x-openshell-protocol"
MAX_REQUEST_LINE = 8 * 1024
MAX_HEAD = 64 * 1024  # request line + headers
MAX_HEADERS = 100
CHUNK = 64 * 1024

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_HOP_BY_HOP = {"connection", "proxy-connection", "keep-alive", "proxy-authorization",
               "proxy-authenticate", "te", "trailer", "upgrade"}


class HandshakeError(RuntimeError):
    """The proxy refused the handshake, or did not answer it properly."""


class BadRequest(Exception):
    def __init__(self, status: int, reason: str, method="", host="", port=0, path=""):
        super().__init__(reason)
        self.status, self.reason = status, reason
        self.method, self.host, self.port, self.path = method, host, port, path


def default_resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(info[4][0] for info in infos))


class ProxyServer:
    def __init__(self, policy, socket_path, audit_path=None, info=None, *, resolve=None,
                 socket_mode=0o600, header_timeout=10.0, connect_timeout=10.0,
                 idle_timeout=60.0, max_connections=256):
        """policy: a Policy or a policy file path (PolicyError if invalid: nothing starts).

        resolve(host, port) -> [ip, ...] replaces DNS (pinned names, like curl --resolve).
        """
        self.policy = policy if isinstance(policy, Policy) else Policy.load(policy)
        self.socket_path = str(socket_path)
        self.audit_path = str(audit_path) if audit_path is not None else None
        self.info = dict(info or {})
        self.resolve = resolve or default_resolve
        self.socket_mode = socket_mode
        self.header_timeout = header_timeout
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self._slots = threading.BoundedSemaphore(max_connections)
        self._audit_lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # ---- lifecycle ----
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
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept() on Linux
        except OSError:
            pass
        self._listener.close()
        self._thread.join(timeout=5)
        with self._conns_lock:
            for c in list(self._conns):
                _quiet(c.shutdown, socket.SHUT_RDWR)
        try:
            os.unlink(self.socket_path)
        except FileNotFoundError:
            pass
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
            if not self._slots.acquire(blocking=False):
                _quiet(conn.sendall, _response(503, "too many connections"))
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    # ---- one connection ----
    def _serve(self, conn: socket.socket) -> None:
        upstream = None
        with self._conns_lock:
            self._conns.add(conn)
        try:
            client = _peer(conn)
            try:
                head, rest = _read_head(conn, time.monotonic() + self.header_timeout)
                if head is None:
                    return  # connected and left without sending anything: nothing to decide
                req = _parse_request(head)
            except BadRequest as e:
                self._audit(client, e.method, e.host, e.port, e.path, "deny", None, e.reason, e.status)
                _quiet(conn.sendall, _response(e.status, e.reason))
                return
            if req["kind"] == "handshake":
                self._handshake(conn, client, req)
                return
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
        m, host, port, path = req["method"], req["host"], req["port"], req["path"]
        policy_path = None if req["kind"] == "connect" else path
        d = self.policy.decide(m, host, port, policy_path)
        if not d.allowed:
            self._audit(client, m, host, port, path, "deny", d.rule, d.reason, 403)
            _quiet(conn.sendall, _response(403, d.reason))
            return None
        try:
            addresses = list(self.resolve(host, port))
        except Exception as e:  # noqa: BLE001 - any resolver failure is this request's 502, not a crash
            reason = f"cannot resolve {host}: {e}"
            self._audit(client, m, host, port, path, "deny", d.rule, reason, 502)
            _quiet(conn.sendall, _response(502, reason))
            return None
        d = self.policy.decide(m, host, port, policy_path, addresses=addresses)
        if not d.allowed:
            self._audit(client, m, host, port, path, "deny", d.rule, d.reason, 403)
            _quiet(conn.sendall, _response(403, d.reason))
            return None
        errors = []
        for a in addresses:  # connect to exactly the addresses that were checked
            family = socket.AF_INET6 if ":" in a else socket.AF_INET
            s = socket.socket(family, socket.SOCK_STREAM)
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
        reason = f"{d.reason}; upstream connect failed: {'; '.join(errors) or 'no address'}"
        self._audit(client, m, host, port, path, "allow", d.rule, reason, 502)
        _quiet(conn.sendall, _response(502, reason))
        return None

    def _handshake(self, conn, client, req) -> None:
        want = req["protocol"]
        if want != str(PROTOCOL_VERSION):
            reason = f"unsupported protocol version {want!r}; this supervisor speaks {PROTOCOL_VERSION}"
            self._audit(client, "GET", "", 0, HANDSHAKE_PATH, "deny", None, reason, 400)
            _quiet(conn.sendall, _response(400, reason))
            return
        body = json.dumps(self.handshake_info()).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)

    def handshake_info(self) -> dict:
        return {"protocol": PROTOCOL_VERSION, "tier": self.info.get("tier"),
                "capabilities": self.info.get("capabilities", {}),
                "policy_sha256": self.policy.sha256}

    def _audit(self, client, method, host, port, path, decision, rule, reason, status) -> None:
        if self.audit_path is None:
            return
        line = json.dumps({"ts": round(time.time(), 6), "client": client, "method": method,
                           "host": host, "port": port, "path": path, "decision": decision,
                           "rule": rule, "reason": reason, "status": status}) + "\n"
        with self._audit_lock, open(self.audit_path, "a", encoding="utf-8") as f:
            f.write(line)


# ---- reading and parsing a request head ----

def _read_head(conn: socket.socket, deadline: float):
    """Read until the blank line, with bounded memory and work; returns (head, bytes after it)."""
    buf = bytearray()
    scanned = 0  # bytes of buf already checked for bare LF and the end of the head
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BadRequest(408, "timed out reading the request head")
        conn.settimeout(left)
        try:
            data = conn.recv(CHUNK)
        except socket.timeout:
            raise BadRequest(408, "timed out reading the request head") from None
        if not data:
            if not buf:
                return None, b""
            raise BadRequest(400, "malformed request: connection closed before the end of the head")
        buf += data
        start = max(0, scanned - 3)
        end = buf.find(b"\r\n\r\n", start)
        limit = end if end >= 0 else len(buf)
        i = buf.find(b"\n", scanned, limit)
        while i >= 0:
            if i == 0 or buf[i - 1] != 13:
                raise BadRequest(400, "malformed request: lines must end with CRLF")
            i = buf.find(b"\n", i + 1, limit)
        scanned = len(buf)
        first_nl = buf.find(b"\n", 0, MAX_REQUEST_LINE + 2)
        if first_nl < 0 and len(buf) > MAX_REQUEST_LINE:
            raise BadRequest(400, f"request line longer than {MAX_REQUEST_LINE} bytes")
        if end >= 0:
            if end + 2 > MAX_HEAD:
                raise BadRequest(400, f"request head larger than {MAX_HEAD} bytes")
            return bytes(buf[:end + 2]), bytes(buf[end + 4:])
        if len(buf) > MAX_HEAD:
            raise BadRequest(400, f"request head larger than {MAX_HEAD} bytes")


def _parse_request(head: bytes) -> dict:
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError:
        raise BadRequest(400, "malformed request: non-ASCII bytes in the request head") from None
    lines = text.split("\r\n")[:-1]  # head ends with CRLF
    parts = lines[0].split(" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or parts[2] not in ("HTTP/1.1", "HTTP/1.0"):
        raise BadRequest(400, "malformed request line")
    method, target, version = parts
    if not target.isprintable():
        raise BadRequest(400, "malformed request target", method)
    headers, raw_headers = _parse_headers(lines[1:], method)

    if target.startswith("/"):  # origin-form: only the supervisor handshake is served this way
        if method == "GET" and target == HANDSHAKE_PATH:
            return {"kind": "handshake", "protocol": headers.get(PROTOCOL_HEADER, [""])[0]}
        raise BadRequest(400, "this is a proxy: send absolute-form (http://host/path) or CONNECT",
                         method, path=target)
    if method == "CONNECT":
        host, port = _authority(target, None, method)
        path = ""
    else:
        scheme, sep, after = target.partition("://")
        if not sep or scheme.lower() != "http":
            raise BadRequest(400, "only http:// targets are proxied; use CONNECT for https",
                             method, path=target[:200])
        cut = min([i for i in (after.find("/"), after.find("?"), after.find("#")) if i >= 0],
                  default=len(after))
        authority, path = after[:cut], after[cut:] or "/"
        if path.startswith("?"):
            path = "/" + path
        host, port = _authority(authority, 80, method)
        _check_path(path, method, host, port)
    _check_host_header(headers, host, port, method, path)

    if method == "CONNECT":
        return {"kind": "connect", "method": method, "host": host, "port": port, "path": path}
    length = _content_length(headers, method, host, port, path)
    out = [f"{method} {path} {version}"]
    drop = set(_HOP_BY_HOP)
    for v in headers.get("connection", []):
        drop |= {t.strip().lower() for t in v.split(",")}
    out += [f"{name}: {v}" for name, v in raw_headers if name.lower() not in drop]
    if "host" not in headers:
        out.append(f"Host: {_hostport(host, port, 80)}")
    out.append("Connection: close")
    upstream_head = ("\r\n".join(out) + "\r\n\r\n").encode("ascii")
    return {"kind": "http", "method": method, "host": host, "port": port, "path": path,
            "length": length, "upstream_head": upstream_head}


def _parse_headers(lines: list[str], method: str):
    """-> ({lower-case name: [values]}, [(name as sent, value)])."""
    if len(lines) > MAX_HEADERS:
        raise BadRequest(400, f"more than {MAX_HEADERS} header lines", method)
    headers: dict[str, list[str]] = {}
    raw: list[tuple[str, str]] = []
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not _TOKEN.fullmatch(name):  # also refuses obs-fold and "Name :" forms
            raise BadRequest(400, f"malformed header line {line[:80]!r}", method)
        value = value.strip(" \t")
        if not value.isprintable():
            raise BadRequest(400, f"control characters in header {name}", method)
        headers.setdefault(name.lower(), []).append(value)
        raw.append((name, value))
    return headers, raw


def _authority(text: str, default_port, method: str) -> tuple[str, int]:
    if "@" in text:
        raise BadRequest(400, "userinfo (user@host) is not allowed", method, text[:200])
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise BadRequest(400, "malformed IPv6 authority", method, text[:200])
        raw_host, rest = text[:close + 1], text[close + 1:]
        if rest and not rest.startswith(":"):
            raise BadRequest(400, "malformed authority", method, text[:200])
        port_text = rest[1:] if rest else None
    else:
        raw_host, sep, port_text = text.rpartition(":")
        if not sep:
            raw_host, port_text = text, None
    if port_text is None:
        if default_port is None:
            raise BadRequest(400, "CONNECT needs host:port", method, text[:200])
        port = default_port
    elif not port_text.isdigit() or len(port_text) > 5 or not 1 <= int(port_text) <= 65535:
        raise BadRequest(400, f"port out of range or malformed: {port_text[:20]!r}", method, text[:200])
    else:
        port = int(port_text)
    try:
        return normalize_host(raw_host), port
    except HostError as e:
        raise BadRequest(400, str(e), method, raw_host[:200], port) from None


def _check_path(path: str, method: str, host: str, port: int) -> None:
    # Prefix rules must see the path the server will act on: refuse dot segments, encoded
    # dots/slashes/backslashes and fragments rather than guess how the server decodes them.
    p = path.split("?", 1)[0]
    low = p.lower()
    if "#" in path or "\\" in p or any(x in low for x in ("%2e", "%2f", "%5c")):
        raise BadRequest(400, "ambiguous path (fragment, backslash or encoded '.', '/', '\\')",
                         method, host, port, path[:200])
    if any(seg in (".", "..") for seg in p.split("/")):
        raise BadRequest(400, "dot segments are not allowed in the path", method, host, port, path[:200])


def _check_host_header(headers, host: str, port: int, method: str, path: str) -> None:
    values = headers.get("host", [])
    if len(values) > 1:
        raise BadRequest(400, "more than one Host header", method, host, port, path)
    if not values:
        return
    default = None if method == "CONNECT" else 80
    try:
        h_host, h_port = _authority(values[0], default if default else port, method)
    except BadRequest as e:
        raise BadRequest(400, f"bad Host header: {e.reason}", method, host, port, path) from None
    if (h_host, h_port) != (host, port):
        raise BadRequest(400, f"Host header {values[0][:100]!r} disagrees with the request target",
                         method, host, port, path)


def _content_length(headers, method, host, port, path) -> int:
    if "transfer-encoding" in headers:
        raise BadRequest(400, "Transfer-Encoding request bodies are not supported; send Content-Length",
                         method, host, port, path)
    values = {v for raw in headers.get("content-length", []) for v in raw.split(",")}
    values = {v.strip() for v in values}
    if not values:
        return 0
    if len(values) != 1 or not next(iter(values)).isdigit():
        raise BadRequest(400, "malformed Content-Length", method, host, port, path)
    return int(next(iter(values)))


def _hostport(host: str, port: int, default: int) -> str:
    h = f"[{host}]" if ":" in host else host
    return h if port == default else f"{h}:{port}"


# ---- moving bytes ----

def _relay(client: socket.socket, upstream: socket.socket, idle: float, limit: int | None) -> None:
    """Pipe both ways until done. limit: request-body bytes still owed upstream (HTTP mode: the
    client is read only that far and the exchange ends when upstream closes); None: a tunnel."""
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
                n = CHUNK if (src is upstream or limit is None) else min(CHUNK, limit)
                data = src.recv(n)
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
    phrase = {400: "Bad Request", 403: "Forbidden", 408: "Request Timeout", 502: "Bad Gateway",
              503: "Service Unavailable"}.get(status, "Error")
    body = (json.dumps({"error": reason}) + "\n").encode()
    return (f"HTTP/1.1 {status} {phrase}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n"
            f"X-OpenShell-Reason: {_header_safe(reason)}\r\n\r\n").encode() + body


def _header_safe(text: str) -> str:
    return "".join(c if c.isascii() and c.isprintable() else "?" for c in text)[:300]


def _peer(conn: socket.socket) -> str:
    try:
        pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        return f"pid={pid} uid={uid}"
    except OSError:
        return "unknown"


def _quiet(fn, *args) -> None:
    try:
        fn(*args)
    except OSError:
        pass


def handshake(socket_path, protocol=PROTOCOL_VERSION, timeout: float = 5.0) -> dict:
    """Ask the supervisor's proxy who it is. Raises HandshakeError if refused or garbled."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    try:
        s.connect(str(socket_path))
        s.sendall(f"GET {HANDSHAKE_PATH} HTTP/1.1\r\nHost: openshell\r\n"
                  f"X-OpenShell-Protocol: {protocol}\r\nConnection: close\r\n\r\n".encode())
        data = b""
        while len(data) < MAX_HEAD:
            chunk = s.recv(CHUNK)
            if not chunk:
                break
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
