"""No host Unix socket is reachable from any tier (issue 12, item 1; issue 31, item 6).

Namespaced tier: a read-only bind still lets connect() reach a listening pathname socket, and a net
namespace does not stop it either: any daemon socket under a host directory the sandbox sees is an
exit (docker, X11, D-Bus, an engine's own socket). So the sandbox sees only what commands need: /usr
(and /bin, /lib* where they are not links into it), a copy of a curated /etc, the interpreter it runs;
every one of those host directories is writable by root alone (where the host lets a non-root user
write under /usr, that directory is hidden), so no one but root can plant a socket there. Everything
else is the sandbox's own: a tmpfs root, /tmp, /dev/shm, /proc, the workspace and the Sandbox's mounts.
The first tests list every directory the sandbox can see, from inside, and find the host directories
among them (same path, same device and inode); then they plant a listening socket (mode 0777) in each
of those that a non-root host user could write, and in every place daemons keep sockets, and connect
from inside.

Fallback tier: the host's filesystem is in view and Landlock scopes pathname connects only from ABI 9,
so its seccomp filter lets a command create no socket but connected stream socketpairs. The last tests
plant stream, seqpacket and datagram sockets in /tmp, /var/tmp, /dev/shm, /run and the abstract
namespace, and try every way in (socket() then connect/sendto, a socketpair's socket reconnected or
sending to an address), in both tiers, with and without a network policy.
"""
import http.server
import os
import select
import socket
import threading
import uuid

import pytest

from .conftest import MARK, started

WELL_KNOWN = ("/", "/tmp", "/var/tmp", "/run", "/var/run", "/run/user", "/dev/shm", "/etc", "/root",
              "/home", "/var", "/var/lib", "/opt", "/mnt", "/srv", "/media", "/work")
OWN = ("/proc", "/sys", "/dev", "/workspace")  # the sandbox's own mounts; not host directories

LIST_DIRS = r"""
import os, sys
out = open(sys.argv[1], "w")
for top, dirs, _ in os.walk("/"):
    dirs[:] = [d for d in dirs if os.path.join(top, d) not in {own}]
    try:
        st = os.stat(top, follow_symlinks=False)
    except OSError:
        continue
    out.write(f"{{st.st_dev}} {{st.st_ino}} {{top}}\n")
""".format(own=repr(set(OWN)))

CONNECT_ALL = r"""
import socket, sys
for line in open(sys.argv[1]):
    path = line.rstrip("\n")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2)
    try:
        s.connect(path if not path.startswith("@") else "\0" + path[1:])
        print("CONNECTED", path)
    except OSError as e:
        print("refused", path, e.errno)
    s.close()
print("end")
"""


def _namespaced(tier):
    if tier != "namespaced":
        pytest.skip("the fallback tier shares the host's filesystem: the tests below cover it")


def _host_dirs_seen(sb) -> list[tuple[str, os.stat_result]]:
    with open(os.path.join(sb.workspace, "list.py"), "w") as f:
        f.write(LIST_DIRS)
    r = started(sb.exec(f"echo {MARK}; python3 -I list.py dirs.txt && echo listed", timeout=120))
    assert r.stdout.endswith("listed\n"), r.stderr
    seen = []
    mounts = [sb.workspace] + [sb.path_of(p) for p in getattr(sb, "_mounts", {})]
    with open(os.path.join(sb.workspace, "dirs.txt")) as f:
        for line in f:
            dev, ino, path = line.rstrip("\n").split(" ", 2)
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (int(dev), int(ino)) and not any(
                    os.path.realpath(path).startswith(m) for m in mounts):
                seen.append((path, st))
    assert len(seen) > 10, "the listing found too few host directories: it did not run as meant"
    return seen


def _writable_by_non_root(st: os.stat_result) -> bool:
    return st.st_uid != 0 or bool(st.st_mode & 0o002) or bool(st.st_mode & 0o020 and st.st_gid != 0)


def test_every_host_directory_the_sandbox_sees_is_writable_by_root_alone(make_sandbox, tier):
    _namespaced(tier)
    seen = _host_dirs_seen(make_sandbox())
    open_to_others = [path for path, st in seen if _writable_by_non_root(st)]
    assert open_to_others == [], f"host directories a non-root user could plant a socket in: {open_to_others[:20]}"
    tops = {path.split("/")[1] for path, _ in seen if path != "/"}
    assert not tops & {"tmp", "var", "run", "home", "root", "mnt", "opt", "srv", "work"}, sorted(tops)


class _Listeners:
    """Listening 0777 Unix sockets at many host paths; counts the connections they accept."""

    def __init__(self):
        self.paths, self.socks, self.accepted = [], [], []
        self.tok = uuid.uuid4().hex[:10]

    def plant(self, directory: str) -> None:
        path = os.path.join(directory, f".nano-openshell-test-{self.tok}.sock")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(path)
        except OSError:  # not writable by us (leg 3 runs as a non-root user), or not a directory
            s.close()
            return
        os.chmod(path, 0o777)
        s.listen()
        self.paths.append(path)
        self.socks.append(s)
        threading.Thread(target=self._accept, args=(s, path), daemon=True).start()

    def plant_abstract(self) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(f"\0nano-openshell-test-{self.tok}")
        s.listen()
        self.paths.append(f"@nano-openshell-test-{self.tok}")
        self.socks.append(s)
        threading.Thread(target=self._accept, args=(s, self.paths[-1]), daemon=True).start()

    def _accept(self, s, path):
        try:
            conn, _ = s.accept()
            self.accepted.append(path)
            conn.close()
        except OSError:
            pass

    def close(self):
        for s in self.socks:
            s.close()
        for path in self.paths:
            if not path.startswith("@"):
                try:
                    os.unlink(path)
                except OSError:
                    pass


def test_host_unix_sockets_are_unreachable(make_sandbox, tier):
    _namespaced(tier)
    sb = make_sandbox()
    seen = _host_dirs_seen(sb)
    lis = _Listeners()
    try:
        for d in WELL_KNOWN + tuple(path for path, st in seen if _writable_by_non_root(st)):
            lis.plant(d)
        lis.plant_abstract()
        planted = set(lis.paths)
        # a socket a daemon of the same user could have made: in /tmp and /var/tmp (world-writable)
        assert {f"/tmp/.nano-openshell-test-{lis.tok}.sock", f"/var/tmp/.nano-openshell-test-{lis.tok}.sock"} <= planted
        with open(os.path.join(sb.workspace, "socks.txt"), "w") as f:
            f.write("".join(p + "\n" for p in lis.paths))
        with open(os.path.join(sb.workspace, "connect.py"), "w") as f:
            f.write(CONNECT_ALL)
        r = started(sb.exec(f"echo {MARK}; python3 -I connect.py socks.txt", timeout=120))
        assert r.stdout.endswith("end\n"), r.stderr
        connected = [line for line in r.stdout.splitlines() if line.startswith("CONNECTED")]
        assert connected == [] and lis.accepted == [], (connected, lis.accepted)
        assert r.stdout.count("refused") == len(lis.paths)
    finally:
        lis.close()


def test_a_view_left_by_a_dead_process_is_removed_by_the_next():
    """Each process copies the curated /etc once, into a directory of its own; one that died without
    removing it (SIGKILL, os._exit) has it removed by the next process that makes one."""
    import subprocess
    import sys

    from nano_openshell import namespaced

    child = ("import os, sys; sys.path.insert(0, sys.argv[1]); from nano_openshell import namespaced; "
             "print(namespaced.view_dir(), flush=True); os._exit(0)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    left = subprocess.run([sys.executable, "-c", child, root], capture_output=True, text=True, check=True).stdout.strip()
    assert os.path.isdir(os.path.join(left, "etc")), "os._exit skipped the atexit removal: it is left"
    namespaced._VIEW.clear()  # as a new process would, make a view of our own
    mine = namespaced.view_dir()
    assert not os.path.exists(left) and os.path.isdir(mine)


# ---- every tier, with and without a network: a host socket where the command can see it ----------

ATTACKS = r"""
import socket, sys
U = socket.AF_UNIX

def attempt(how, path, fn):
    try:
        fn(path if not path.startswith("@") else "\0" + path[1:])
        print("REACHED", how, path)
    except OSError as e:
        print("refused", how, path, e.errno)

def connect(kind):
    def go(path):
        s = socket.socket(U, kind); s.settimeout(2); s.connect(path); s.send(b"x")
    return go

def sendto(path):
    socket.socket(U, socket.SOCK_DGRAM).sendto(b"x", path)

def pair_connect(kind):  # a socketpair's socket, its peer gone, connected elsewhere
    def go(path):
        a, b = socket.socketpair(U, kind); b.close(); a.settimeout(2); a.connect(path); a.send(b"x")
    return go

def pair_sendto(path):  # a datagram pair's socket can send to any address
    a, b = socket.socketpair(U, socket.SOCK_DGRAM); a.sendto(b"x", path)

STREAM, SEQ = socket.SOCK_STREAM, socket.SOCK_SEQPACKET
for line in open(sys.argv[1]):
    kind, path = line.split()
    if kind == "dgram":
        attempt("sendto", path, sendto); attempt("pair-sendto", path, pair_sendto)
    else:
        k = STREAM if kind == "stream" else SEQ
        attempt("connect", path, connect(k)); attempt("pair-connect", path, pair_connect(k))
print("end")
"""
PROXIED_GET = r"""
import urllib.request
print(urllib.request.urlopen("http://127.0.0.1:%d/through-the-proxy", timeout=10).read().decode())
"""
SOCKET_KINDS = {"stream": socket.SOCK_STREAM, "seqpacket": socket.SOCK_SEQPACKET, "dgram": socket.SOCK_DGRAM}


class _Planted:
    """Unix sockets of every kind (mode 0777) at host paths; after the command, a poll tells which
    of them a connection or a datagram reached (the kernel queued it before connect/sendto returned)."""

    def __init__(self):
        self.tok, self.socks = uuid.uuid4().hex[:10], {}  # "kind path" -> listening socket

    def plant(self, directory: str) -> None:
        for kind, type_ in SOCKET_KINDS.items():
            path = os.path.join(directory, f".nano-openshell-test-{self.tok}-{kind}.sock")
            s = socket.socket(socket.AF_UNIX, type_)
            try:
                s.bind(path)
            except OSError:  # a directory this user cannot write (leg 3 is not root)
                s.close()
                return
            os.chmod(path, 0o777)
            if kind != "dgram":
                s.listen()
            self.socks[f"{kind} {path}"] = s

    def plant_abstract(self) -> None:
        for kind, type_ in SOCKET_KINDS.items():
            s = socket.socket(socket.AF_UNIX, type_)
            s.bind(f"\0nano-openshell-test-{self.tok}-{kind}")
            if kind != "dgram":
                s.listen()
            self.socks[f"{kind} @nano-openshell-test-{self.tok}-{kind}"] = s

    def reached(self) -> list[str]:
        return [name for name, s in self.socks.items() if select.select([s], [], [], 0)[0]]

    def close(self) -> None:
        for name, s in self.socks.items():
            s.close()
            path = name.split(" ", 1)[1]
            if not path.startswith("@"):
                os.unlink(path)


def _attack(sb, extra: str = "") -> tuple[list[str], list[str], str]:
    """Plant host sockets in /tmp, /var/tmp, /dev/shm, /run (as root) and the abstract namespace, run
    ATTACKS (then `extra`) in the sandbox: (what the command says it reached, what the host saw
    reached, the command's output after the attacks)."""
    planted = _Planted()
    try:
        for d in ("/tmp", "/var/tmp", "/dev/shm", "/run"):
            planted.plant(d)
        planted.plant_abstract()
        assert any(name.startswith(f"stream /tmp/.nano-openshell-test-{planted.tok}") for name in planted.socks)
        with open(os.path.join(sb.workspace, "socks.txt"), "w") as f:
            f.write("".join(name + "\n" for name in planted.socks))
        with open(os.path.join(sb.workspace, "attacks.py"), "w") as f:
            f.write(ATTACKS)
        r = started(sb.exec(f"echo {MARK}; python3 -I attacks.py socks.txt{extra}", timeout=120))
        assert "end\n" in r.stdout, (r.stdout[-500:], r.stderr[-500:])
        said, after = r.stdout.split("end\n", 1)
        assert said.count("refused") + said.count("REACHED") == 2 * len(planted.socks), said
        return [line for line in said.splitlines() if line.startswith("REACHED")], planted.reached(), after
    finally:
        planted.close()


def _gap_says_open(sb) -> bool:
    return any("Unix sockets" in g for g in sb.gaps)


def test_no_host_unix_socket_is_reachable_without_a_network(make_sandbox, tier):
    """The fallback tier sees the host's filesystem, where these sockets are: its seccomp filter
    keeps them out of reach. Where it cannot (no seccomp), the gaps must say so."""
    from nano_openshell import probe

    sb = make_sandbox()
    said, seen, _ = _attack(sb)
    listed = _gap_says_open(sb)
    assert bool(said or seen) == listed, (said, seen, sb.gaps)  # open exactly where the gaps say so
    assert not listed or (tier == "fallback" and not probe()["capabilities"]["seccomp"]), (said, seen)


def test_no_host_unix_socket_is_reachable_with_a_network_and_the_proxy_still_works(make_sandbox, tier):
    from nano_openshell import SandboxError
    from nano_openshell.policy import Policy

    from .test_network import Hello

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        policy = Policy.from_dict({"version": 1, "rules": [
            {"name": "local", "host": "127.0.0.1", "ports": [srv.server_address[1]]}]})
        if tier == "fallback":  # no network there at all, and no proxy socket to reach
            with pytest.raises(SandboxError, match="needs the namespaced tier"):
                make_sandbox(policy=policy)
            return
        sb = make_sandbox(policy=policy)
        with open(os.path.join(sb.workspace, "get.py"), "w") as f:
            f.write(PROXIED_GET % srv.server_address[1])
        said, seen, after = _attack(sb, "; python3 -I get.py")
        assert said == [] and seen == [], (said, seen)
        assert after == "hello from /through-the-proxy\n"
    finally:
        srv.shutdown()
        srv.server_close()
