"""One HTTP request head, read with bounded memory and time and parsed strictly (the proxy's input).

parse_request(head) -> {"kind": "handshake" | "connect" | "http", ...}; anything ambiguous is refused
with BadRequest rather than guessed at (docs/network-policy.md lists what).
"""

import re
import socket
import time

from .policy import HostError, normalize_host

HANDSHAKE_PATH = "/.openshell/handshake"
PROTOCOL_HEADER = "x-openshell-protocol"
MAX_REQUEST_LINE = 8 * 1024
MAX_HEAD = 64 * 1024  # request line + headers
MAX_HEADERS = 100
CHUNK = 64 * 1024

_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")
_BARE_LF = re.compile(rb"(?<!\r)\n")  # (it looks behind the search's start too)
_HOP_BY_HOP = {"connection", "proxy-connection", "keep-alive", "proxy-authorization",
               "proxy-authenticate", "te", "trailer", "upgrade"}


class BadRequest(Exception):
    def __init__(self, status: int, reason: str, method="", host="", port=0, path=""):
        super().__init__(reason)
        self.status, self.reason = status, reason
        self.method, self.host, self.port, self.path = method, host, port, path


def read_head(conn: socket.socket, deadline: float):
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
        end = buf.find(b"\r\n\r\n", max(0, scanned - 3))
        if _BARE_LF.search(buf, scanned, end if end >= 0 else len(buf)):
            raise BadRequest(400, "malformed request: lines must end with CRLF")
        scanned = len(buf)
        if len(buf) > MAX_REQUEST_LINE and buf.find(b"\n", 0, MAX_REQUEST_LINE + 2) < 0:
            raise BadRequest(400, f"request line longer than {MAX_REQUEST_LINE} bytes")
        if end >= 0:
            if end + 2 > MAX_HEAD:
                raise BadRequest(400, f"request head larger than {MAX_HEAD} bytes")
            return bytes(buf[:end + 2]), bytes(buf[end + 4:])
        if len(buf) > MAX_HEAD:
            raise BadRequest(400, f"request head larger than {MAX_HEAD} bytes")


def parse_request(head: bytes) -> dict:
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
        name = f"[{host}]" if ":" in host else host  # an IPv6 address in brackets, port 80 left out
        out.append(f"Host: {name}" + ("" if port == 80 else f":{port}"))
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
    try:  # CONNECT's Host may leave out the port it connects to
        h_host, h_port = _authority(values[0], port if method == "CONNECT" else 80, method)
    except BadRequest as e:
        raise BadRequest(400, f"bad Host header: {e.reason}", method, host, port, path) from None
    if (h_host, h_port) != (host, port):
        raise BadRequest(400, f"Host header {values[0][:100]!r} disagrees with the request target",
                         method, host, port, path)


def _content_length(headers, method, host, port, path) -> int:
    if "transfer-encoding" in headers:
        raise BadRequest(400, "Transfer-Encoding request bodies are not supported; send Content-Length",
                         method, host, port, path)
    values = {v.strip() for raw in headers.get("content-length", []) for v in raw.split(",")}
    if not values:
        return 0
    if len(values) != 1 or not next(iter(values)).isdigit():
        raise BadRequest(400, "malformed Content-Length", method, host, port, path)
    return int(next(iter(values)))
