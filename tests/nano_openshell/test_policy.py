"""The network policy engine: file format, host normalisation, and every decision rule."""

import json

import pytest

from nano_openshell.policy import (Decision, HostError, Policy, PolicyError, normalize_host,
                                   special_address_kind)

POLICY_TOML = """
version = 1

[[rules]]
name = "local"
host = "127.0.0.1"
ports = [8080]
methods = ["GET"]

[[rules]]
name = "example-any"
host = "*.example.com"
methods = ["GET", "HEAD", "CONNECT"]

[[rules]]
name = "api-write"
host = "api.example.com"
methods = ["POST"]
ports = [443]
paths = ["/v1/upload"]

[[rules]]
name = "lookalike"
host = "exаmple.org"   # Cyrillic 'а'
"""


@pytest.fixture
def policy(tmp_path):
    p = tmp_path / "policy.toml"
    p.write_text(POLICY_TOML, encoding="utf-8")
    return Policy.load(p)


def test_deny_by_default():
    d = Policy.from_dict({"version": 1, "rules": []}).decide("GET", "example.com", 80, "/")
    assert d == Decision(False, None, "no rule matches host example.com")


def test_exact_rule_allows_named_method_and_port(policy):
    assert policy.decide("GET", "127.0.0.1", 8080, "/x").allowed
    d = policy.decide("POST", "127.0.0.1", 8080, "/x")
    assert not d.allowed and d.rule == "local" and "method POST" in d.reason
    d = policy.decide("GET", "127.0.0.1", 8081, "/x")
    assert not d.allowed and "port 8081" in d.reason


def test_default_methods_and_ports(tmp_path):
    p = Policy.from_dict({"version": 1, "rules": [{"host": "pypi.org"}]})
    assert p.rules[0].methods == ("GET", "HEAD") and p.rules[0].ports == (80, 443)
    assert p.rules[0].name == "rules[0]"
    assert p.decide("HEAD", "pypi.org", 443, "/").allowed
    assert not p.decide("CONNECT", "pypi.org", 443, None).allowed  # CONNECT must be named


def test_wildcard_matches_subdomains_not_the_apex(policy):
    assert policy.decide("GET", "a.example.com", 443, "/").allowed
    assert policy.decide("GET", "a.b.example.com", 80, "/").allowed
    assert not policy.decide("GET", "example.com", 443, "/").allowed
    assert not policy.decide("GET", "badexample.com", 443, "/").allowed
    assert not policy.decide("GET", "example.com.evil.net", 443, "/").allowed


def test_rules_add_up_and_the_exact_rule_explains_a_denial(policy):
    # api.example.com: the exact rule allows POST to one path, the wildcard allows GET anywhere
    assert policy.decide("POST", "api.example.com", 443, "/v1/upload").allowed
    assert policy.decide("POST", "api.example.com", 443, "/v1/upload/part?x=1").allowed
    assert policy.decide("GET", "api.example.com", 443, "/anything").allowed
    d = policy.decide("POST", "api.example.com", 443, "/v1/uploadx")
    assert not d.allowed and d.rule == "api-write" and "path /v1/uploadx" in d.reason
    d = policy.decide("DELETE", "api.example.com", 443, "/v1/upload")
    assert not d.allowed and d.rule == "api-write"


def test_path_prefixes_are_segment_aware():
    p = Policy.from_dict({"version": 1, "rules": [
        {"name": "a", "host": "h.test", "paths": ["/api"]},
        {"name": "b", "host": "g.test", "paths": ["/files/"]}]})
    assert p.decide("GET", "h.test", 80, "/api").allowed
    assert p.decide("GET", "h.test", 80, "/api/v1").allowed
    assert p.decide("GET", "h.test", 80, "/api?q=1").allowed
    assert not p.decide("GET", "h.test", 80, "/apix").allowed
    assert not p.decide("GET", "h.test", 80, "/").allowed
    assert p.decide("GET", "g.test", 80, "/files/x").allowed
    assert not p.decide("GET", "g.test", 80, "/files").allowed


def test_connect_is_refused_by_a_path_restricted_rule():
    p = Policy.from_dict({"version": 1, "rules": [
        {"name": "narrow", "host": "h.test", "methods": ["CONNECT"], "paths": ["/api"]}]})
    d = p.decide("CONNECT", "h.test", 443, None)
    assert not d.allowed and "CONNECT tunnel cannot be checked" in d.reason


@pytest.mark.parametrize("raw,norm", [
    ("Example.COM", "example.com"),
    ("example.com.", "example.com"),                # one trailing dot is the same name
    ("ＥＸＡＭＰＬＥ．ｃｏｍ", "example.com"),          # full-width letters and dot (UTS 46 mapping)
    ("bücher.example", "xn--bcher-kva.example"),
    ("XN--BCHER-KVA.example", "xn--bcher-kva.example"),
    ("127.0.0.1", "127.0.0.1"),
    ("[::1]", "::1"),
    ("[0:0:0:0:0:0:0:1]", "::1"),
    ("under_score.test", "under_score.test"),
])
def test_normalize_host(raw, norm):
    assert normalize_host(raw) == norm


@pytest.mark.parametrize("raw", [
    "", "user@example.com", "example.com..", ".example.com", "a..b", "exa mple.com",
    "127.1", "0x7f000001", "2130706433", "0177.0.0.1", "1.2.3",  # inet_aton spellings of addresses
    "[fe80::1%eth0]", "[::1", "xn--zz.com", "-lead.com", "trail-.com", "a" * 64 + ".com",
    "%65xample.com", "*.example.com", "exam\x00ple.com",
])
def test_normalize_host_rejects(raw):
    with pytest.raises(HostError):
        normalize_host(raw)


def test_unicode_lookalike_and_its_punycode_are_one_name(policy):
    unicode_form, puny = "exаmple.org", "xn--exmple-4nf.org"
    assert normalize_host(unicode_form) == puny
    assert policy.decide("GET", unicode_form, 443, "/").allowed
    assert policy.decide("GET", puny, 443, "/").allowed
    assert not policy.decide("GET", "example.org", 443, "/").allowed  # the real name is not it
    # and the other way round: a rule for the ASCII name never admits the look-alike
    p = Policy.from_dict({"version": 1, "rules": [{"host": "*.example.com"}]})
    assert not p.decide("GET", "a.exаmple.com", 443, "/").allowed


def test_trailing_dot_and_case_do_not_escape_a_rule(policy):
    assert policy.decide("GET", "A.EXAMPLE.COM.", 443, "/").allowed
    assert not policy.decide("GET", "example.com.", 443, "/").allowed


def test_tricky_hosts_are_denied_with_a_reason(policy):
    for host in ("user@127.0.0.1", "127.1", "a..example.com"):
        d = policy.decide("GET", host, 8080, "/")
        assert not d.allowed and d.rule is None and d.reason
    assert not policy.decide("GET", "127.0.0.1", 0, "/").allowed
    assert not policy.decide("GET", "127.0.0.1", 65536, "/").allowed


def test_wildcard_name_resolving_to_a_special_address_is_denied(policy):
    for addr, kind in [("127.0.0.1", "loopback"), ("169.254.169.254", "link-local"),
                       ("10.1.2.3", "private"), ("192.168.0.1", "private"), ("0.0.0.0", "unspecified"),
                       ("::1", "loopback"), ("fd00::1", "unique-local"), ("fe80::1", "link-local"),
                       ("::ffff:127.0.0.1", "loopback")]:
        d = policy.decide("GET", "a.example.com", 443, "/", addresses=["93.184.216.34", addr])
        assert not d.allowed and d.rule == "example-any", addr
        assert f"{kind} address {addr}" in d.reason
    assert policy.decide("GET", "a.example.com", 443, "/", addresses=["93.184.216.34"]).allowed


def test_exact_rule_may_name_a_special_host_or_ip():
    p = Policy.from_dict({"version": 1, "rules": [
        {"name": "meta", "host": "169.254.169.254", "ports": [80]},
        {"name": "internal", "host": "db.internal.test", "ports": [80]}]})
    assert p.decide("GET", "169.254.169.254", 80, "/").allowed
    assert p.decide("GET", "db.internal.test", 80, "/", addresses=["10.0.0.5"]).allowed
    assert not p.decide("GET", "169.254.169.253", 80, "/").allowed


def test_special_address_kind():
    assert special_address_kind("8.8.8.8") is None
    assert special_address_kind("2606:4700::1111") is None
    assert special_address_kind("100.64.0.1") in ("private", "non-global")  # carrier-grade NAT
    assert special_address_kind("224.0.0.1") == "multicast"


def test_json_and_toml_give_the_same_hash(tmp_path, policy):
    j = tmp_path / "policy.json"
    j.write_text(json.dumps(policy.to_dict()))
    assert Policy.load(j).sha256 == policy.sha256
    reordered = {"rules": [dict(reversed(list(r.items()))) for r in policy.to_dict()["rules"]],
                 "version": 1}
    assert Policy.from_dict(reordered).sha256 == policy.sha256
    changed = policy.to_dict()
    changed["rules"][0]["ports"] = [8081]
    assert Policy.from_dict(changed).sha256 != policy.sha256
    assert len(policy.sha256) == 64


@pytest.mark.parametrize("bad,message", [
    ({"version": 1, "rules": [{"host": "a.test", "method": ["GET"]}]}, "unknown key"),
    ({"version": 1, "rules": [], "default": "allow"}, "unknown top-level key"),
    ({"version": 2, "rules": []}, "'version' must be 1"),
    ({"rules": []}, "'version' must be 1"),
    ({"version": True, "rules": []}, "'version' must be 1"),
    ({"version": 1, "rules": {"host": "a.test"}}, "'rules' must be a list"),
    ({"version": 1, "rules": ["a.test"]}, "a rule must be a table"),
    ({"version": 1, "rules": [{"name": "x"}]}, "'host' is required"),
    ({"version": 1, "rules": [{"host": "*"}]}, "bad"),
    ({"version": 1, "rules": [{"host": "*.com"}]}, "too broad"),
    ({"version": 1, "rules": [{"host": "a.*.example.com"}]}, "bad wildcard"),
    ({"version": 1, "rules": [{"host": "*example.com"}]}, "bad wildcard"),
    ({"version": 1, "rules": [{"host": "*.*.example.com"}]}, "bad wildcard"),
    ({"version": 1, "rules": [{"host": "*.0.0.1"}]}, "bad"),
    ({"version": 1, "rules": [{"host": "*.[::1]"}]}, "bad"),
    ({"version": 1, "rules": [{"host": "user@a.test"}]}, "userinfo"),
    ({"version": 1, "rules": [{"host": "a.test", "ports": [0]}]}, "port 0"),
    ({"version": 1, "rules": [{"host": "a.test", "ports": [65536]}]}, "port 65536"),
    ({"version": 1, "rules": [{"host": "a.test", "ports": ["80"]}]}, "port '80'"),
    ({"version": 1, "rules": [{"host": "a.test", "ports": [True]}]}, "port True"),
    ({"version": 1, "rules": [{"host": "a.test", "ports": []}]}, "non-empty list"),
    ({"version": 1, "rules": [{"host": "a.test", "methods": ["get"]}]}, "invalid method"),
    ({"version": 1, "rules": [{"host": "a.test", "methods": "GET"}]}, "list of strings"),
    ({"version": 1, "rules": [{"host": "a.test", "paths": ["api"]}]}, "invalid path prefix"),
    ({"version": 1, "rules": [{"host": "a.test", "paths": ["/a?b"]}]}, "invalid path prefix"),
    ({"version": 1, "rules": [{"host": "a.test", "name": "x"}, {"host": "b.test", "name": "x"}]},
     "duplicate rule name"),
    ({"version": 1, "rules": [{"host": "a.test", "name": "bad name\n"}]}, "'name' must match"),
    ([1, 2], "must be a table"),
])
def test_invalid_policies_raise(bad, message):
    with pytest.raises(PolicyError, match=message):
        Policy.from_dict(bad)


@pytest.mark.parametrize("name,text,message", [
    ("p.toml", "version = 1\n[[rules]\nhost = 'a.test'\n", "syntax error"),
    ("p.json", '{"version": 1, "rules": [', "syntax error"),
    ("p.toml", "version = 1\n[[rules]]\nhost = 'a.test'\nports = [99999]\n", "port 99999"),
    ("p.toml", "\xff\xfe", "cannot read|syntax"),
])
def test_invalid_policy_files_raise(tmp_path, name, text, message):
    path = tmp_path / name
    path.write_bytes(text.encode("latin-1") if "\xff" in text else text.encode())
    with pytest.raises(PolicyError, match=message):
        Policy.load(path)


def test_missing_policy_file_raises(tmp_path):
    with pytest.raises(PolicyError, match="cannot read"):
        Policy.load(tmp_path / "nope.toml")
