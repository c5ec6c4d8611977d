"""The deterministic network policy engine and its file format (docs/network-policy.md).

A policy is a list of allow rules; anything no rule allows is denied. A name that resolves to a
non-global address (loopback, private...) is only allowed by a rule that names that host exactly.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import re
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

import idna

POLICY_VERSION = 1
DEFAULT_METHODS = ("GET", "HEAD")
DEFAULT_PORTS = (80, 443)
DEFAULT_PATHS = ("/",)
RULE_KEYS = {"name", "host", "methods", "ports", "paths"}
TOP_KEYS = {"version", "rules"}

_LABEL = re.compile(r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?")
_NUMERIC_LABEL = re.compile(r"(?:0x[0-9a-f]*|[0-9]+)")  # what inet_aton would read as a number
_METHOD = re.compile(r"[A-Z][A-Z0-9_-]{0,31}")
_UNIQUE_LOCAL = ipaddress.IPv6Network("fc00::/7")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@/+\[\]-]{0,99}")


class PolicyError(ValueError):
    """An invalid policy file or policy dict; the proxy must not start with it."""


class HostError(ValueError):
    """A host name that cannot be normalised (bad syntax, userinfo, bad IDNA, odd IP form)."""


@dataclass(frozen=True)
class Decision:
    allowed: bool
    rule: str | None  # the name of the rule that allowed (or most specifically denied) it
    reason: str


@dataclass(frozen=True)
class Rule:
    name: str
    host: str  # normalised; "*.example.com" for a wildcard
    methods: tuple[str, ...]
    ports: tuple[int, ...]
    paths: tuple[str, ...]

    @property
    def wildcard(self) -> bool:
        return self.host.startswith("*.")

    def matches_host(self, host: str) -> bool:
        if self.wildcard:  # "*.example.com" matches a.example.com, a.b.example.com, not example.com
            return host.endswith(self.host[1:]) and len(host) > len(self.host) - 1
        return host == self.host

    def path_allowed(self, path: str) -> bool:
        """"/api" allows "/api", "/api/x" and "/api?q" but not "/apix"; "/api/" allows "/api/..." only."""
        return any(path.startswith(p) if p.endswith("/") else path == p or path.startswith((p + "/", p + "?"))
                   for p in self.paths)

    def to_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def normalize_host(raw: str) -> str:
    """Lower-case, strip one trailing dot, IDNA (UTS 46) to ASCII; IP literals to canonical form.
    HostError for anything ambiguous: userinfo, empty labels, non-canonical numeric IPv4 forms such as
    127.1 or 0x7f000001 (inet_aton would read them as loopback), zone ids."""
    if not isinstance(raw, str) or not raw:
        raise HostError("empty host")
    if "@" in raw:
        raise HostError(f"userinfo is not allowed in a host: {raw!r}")
    if raw.startswith("[") and raw.endswith("]"):
        return _ipv6(raw[1:-1], raw)
    if ":" in raw:
        return _ipv6(raw, raw)
    h = raw
    if not h.isascii():
        try:  # maps full-width letters, ideographic full stops, case, and so on
            h = idna.uts46_remap(h, std3_rules=False, transitional=False)
        except (idna.IDNAError, UnicodeError) as e:
            raise HostError(f"invalid international host {raw!r}: {e}") from None
    h = h.lower().removesuffix(".")
    if len(h) > 253:
        raise HostError(f"host too long ({len(h)} > 253 characters)")
    labels = h.split(".")
    if _NUMERIC_LABEL.fullmatch(labels[-1]):
        try:
            ip = ipaddress.IPv4Address(h)
        except ValueError:
            raise HostError(f"ambiguous numeric host {raw!r}: only dotted-quad IPv4 is accepted") from None
        return str(ip)
    out = []
    for label in labels:
        if not label:
            raise HostError(f"empty label in host {raw!r}")
        if not label.isascii() or label.startswith("xn--"):
            try:
                a = idna.alabel(label).decode("ascii")
                if label.startswith("xn--") and a != label:  # a non-canonical punycode spelling
                    raise idna.IDNAError(f"{label!r} is not canonical punycode")
            except (idna.IDNAError, UnicodeError) as e:
                raise HostError(f"invalid international label in {raw!r}: {e}") from None
            label = a
        if not _LABEL.fullmatch(label):
            raise HostError(f"invalid label {label!r} in host {raw!r}")
        out.append(label)
    return ".".join(out)


def _ipv6(text: str, raw: str) -> str:
    if "%" in text:
        raise HostError(f"IPv6 zone ids are not allowed: {raw!r}")
    try:
        return ipaddress.IPv6Address(text).compressed
    except ValueError:
        raise HostError(f"invalid IPv6 address {raw!r}") from None


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return False


def special_address_kind(addr: str) -> str | None:
    """Why an address is not a public destination ("loopback", "private"...), or None if it is."""
    try:
        ip = ipaddress.ip_address(addr)
    except ValueError:
        return "unparsable"
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for kind, flag in (("unspecified", ip.is_unspecified), ("loopback", ip.is_loopback),
                       ("link-local", ip.is_link_local), ("multicast", ip.is_multicast),
                       ("unique-local", ip.version == 6 and ip in _UNIQUE_LOCAL), ("private", ip.is_private),
                       ("non-global", not ip.is_global)):
        if flag:
            return kind
    return None


class Policy:
    def __init__(self, rules: list[Rule]):
        self.rules = list(rules)
        self._exact = [r for r in self.rules if not r.wildcard]
        # most specific wildcard first; file order breaks ties (sorted is stable)
        self._wild = sorted((r for r in self.rules if r.wildcard), key=lambda r: -len(r.host))
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        self.sha256 = hashlib.sha256(canonical.encode()).hexdigest()

    @classmethod
    def load(cls, path) -> "Policy":
        p = Path(path)
        try:
            text = p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise PolicyError(f"cannot read policy file {p}: {e}") from None
        try:
            d = json.loads(text) if p.suffix.lower() == ".json" else tomllib.loads(text)
        except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
            raise PolicyError(f"syntax error in policy file {p}: {e}") from None
        try:
            return cls.from_dict(d)
        except PolicyError as e:
            raise PolicyError(f"{p}: {e}") from None

    @classmethod
    def from_dict(cls, d) -> "Policy":
        if not isinstance(d, dict):
            raise PolicyError("a policy must be a table/object")
        unknown = set(d) - TOP_KEYS
        if unknown:
            raise PolicyError(f"unknown top-level key(s): {', '.join(sorted(unknown))}")
        if d.get("version") != POLICY_VERSION or isinstance(d.get("version"), bool):
            raise PolicyError(f"'version' must be {POLICY_VERSION}, got {d.get('version')!r}")
        raw_rules = d.get("rules", [])
        if not isinstance(raw_rules, list):
            raise PolicyError("'rules' must be a list of tables")
        rules, names = [], set()
        for i, r in enumerate(raw_rules):
            rule = _parse_rule(r, i)
            if rule.name in names:
                raise PolicyError(f"rules[{i}]: duplicate rule name {rule.name!r}")
            names.add(rule.name)
            rules.append(rule)
        return cls(rules)

    def to_dict(self) -> dict:
        return {"version": POLICY_VERSION, "rules": [r.to_dict() for r in self.rules]}

    def decide(self, method: str, host: str, port: int, path: str | None = "/",
               addresses: list[str] | None = None) -> Decision:
        """Decide one request. path=None for a CONNECT tunnel (its paths cannot be seen). addresses: what
        the proxy resolved the host to (None before resolution)."""
        try:
            h = normalize_host(host)
        except HostError as e:
            return Decision(False, None, str(e))
        if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
            return Decision(False, None, f"port out of range: {port!r}")
        if path is not None and not path.startswith("/"):
            return Decision(False, None, f"path must start with '/': {path!r}")
        candidates = [r for r in self._exact if r.matches_host(h)] + \
                     [r for r in self._wild if r.matches_host(h) and not is_ip(h)]
        if not candidates:
            return Decision(False, None, f"no rule matches host {h}")
        best = None  # the refusal from the rule that came closest (port, then method, then path)
        for r in candidates:
            refusal = _refusal(r, method, port, path)
            if refusal is None:  # a wildcard rule (never an IP host's) may not reach a special address
                for a in (addresses or ()) if r.wildcard else ():
                    if kind := special_address_kind(a):
                        return Decision(False, r.name, f"{h} resolves to {kind} address {a}; "
                                        f"only a rule naming the host or IP exactly may allow it")
                return Decision(True, r.name, f"allowed by rule {r.name!r}")
            if best is None or refusal[0] > best[0]:
                best = (refusal[0], Decision(False, r.name, refusal[1]))
        return best[1]


def _refusal(r: Rule, method: str, port: int, path: str | None) -> tuple[int, str] | None:
    """None if the rule allows it, else (how far it got: 0 port, 1 method, 2 path, reason)."""
    if port not in r.ports:
        return 0, f"port {port} not allowed by rule {r.name!r} (allows {', '.join(map(str, r.ports))})"
    if method not in r.methods:
        return 1, f"method {method} not allowed by rule {r.name!r} (allows {', '.join(r.methods)})"
    if path is None:
        if r.paths != DEFAULT_PATHS:
            return 2, f"rule {r.name!r} restricts paths, which a CONNECT tunnel cannot be checked against"
    elif not r.path_allowed(path):
        return 2, f"path {path} not allowed by rule {r.name!r} (allows {', '.join(r.paths)})"
    return None


def _parse_rule(r, i: int) -> Rule:
    where = f"rules[{i}]"
    if not isinstance(r, dict):
        raise PolicyError(f"{where}: a rule must be a table/object")
    unknown = set(r) - RULE_KEYS
    if unknown:
        raise PolicyError(f"{where}: unknown key(s): {', '.join(sorted(unknown))}")
    name = r.get("name", where)
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise PolicyError(f"{where}: 'name' must match {_NAME.pattern}, got {name!r}")
    if "host" not in r:
        raise PolicyError(f"{where}: 'host' is required")
    host = _parse_rule_host(r["host"], where)
    methods = _str_list(r, "methods", DEFAULT_METHODS, where)
    for m in methods:
        if not _METHOD.fullmatch(m):
            raise PolicyError(f"{where}: invalid method {m!r} (upper-case HTTP method names)")
    ports = r.get("ports", list(DEFAULT_PORTS))
    if not isinstance(ports, list) or not ports:
        raise PolicyError(f"{where}: 'ports' must be a non-empty list of integers")
    for p in ports:
        if isinstance(p, bool) or not isinstance(p, int) or not 1 <= p <= 65535:
            raise PolicyError(f"{where}: port {p!r} is not an integer in 1..65535")
    paths = _str_list(r, "paths", DEFAULT_PATHS, where)
    for p in paths:
        if not p.startswith("/") or any(c in p for c in " ?#\\") or not p.isprintable() \
                or not p.isascii():
            raise PolicyError(f"{where}: invalid path prefix {p!r} (must start with '/', "
                              "printable ASCII, no spaces, '?', '#' or '\\')")
    return Rule(name, host, tuple(sorted(set(methods))), tuple(sorted(set(ports))),
                tuple(sorted(set(paths))))


def _parse_rule_host(host, where: str) -> str:
    if not isinstance(host, str) or not host:
        raise PolicyError(f"{where}: 'host' must be a non-empty string")
    wildcard = host.startswith("*.")
    rest = host[2:] if wildcard else host
    if "*" in rest:
        raise PolicyError(f"{where}: bad wildcard {host!r}: only a leading '*.' is allowed")
    try:
        norm = normalize_host(rest)
    except HostError as e:
        raise PolicyError(f"{where}: bad host {host!r}: {e}") from None
    if wildcard:
        if is_ip(norm):
            raise PolicyError(f"{where}: bad wildcard {host!r}: wildcards cannot cover IP addresses")
        if "." not in norm:
            raise PolicyError(f"{where}: bad wildcard {host!r}: too broad (covers a whole top-level domain)")
        return "*." + norm
    return norm


def _str_list(r: dict, key: str, default, where: str) -> list[str]:
    v = r.get(key, list(default))
    if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
        raise PolicyError(f"{where}: {key!r} must be a non-empty list of strings")
    return v
