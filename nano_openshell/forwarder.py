"""In-sandbox forwarder: 127.0.0.1:PORT -> the supervisor proxy's Unix socket, started by the bash
that sandbox_prelude() returns as `<python> -I -S -c <this file's text> SOCKET PORT` (the sandbox may see
neither this package nor this Python). It imports only C modules (socket and threading would double
its start-up, the network's cost per command), prints "ready" or "error: ..." once listening, and
dies with the shell that started it.
"""

import _socket
import _thread
import os
import select
import sys
import time

FORWARDER_PORT = 3128
READY_TIMEOUT_S = 2
MAX_CONNECTIONS = 64
CHUNK = 64 * 1024


def sandbox_prelude(socket_path_inside_sandbox, port=FORWARDER_PORT, python=None) -> str:
    """Bash to put before the agent's command: starts the forwarder (`python`, else the sandbox's python3),
    waits up to READY_TIMEOUT_S until it listens, and points the usual proxy variables at it."""
    import shlex  # host side only: not in the forwarder's start-up

    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError(f"port must be an integer in 1..65535, got {port!r}")
    py = shlex.quote(python or sys.executable)
    sock = shlex.quote(str(socket_path_inside_sandbox))
    with open(os.path.abspath(__file__), encoding="utf-8") as f:  # all of it, run by `python -c`
        source = f.read()
    url = f"http://127.0.0.1:{port}"
    return "\n".join([
        f"__openshell_py={py}",
        '[ -x "$__openshell_py" ] || __openshell_py=$(command -v python3) || __openshell_py=python3',
        "__openshell_fwd=",
        # the process substitution's python is a child of this shell: the watchdog ties it to us
        f'{{ read -r -t {READY_TIMEOUT_S} __openshell_fwd < <(exec "$__openshell_py" -I -S -c '
        f"{shlex.quote(source)} {sock} {port} </dev/null 2>/dev/null); }} 2>/dev/null",
        'if [ "$__openshell_fwd" != ready ]; then',
        '  echo "nano-openshell: network forwarder did not start: ${__openshell_fwd:-no answer}" >&2',
        "fi",
        "unset __openshell_py __openshell_fwd NO_PROXY no_proxy",
        f"export HTTP_PROXY={url} http_proxy={url} HTTPS_PROXY={url} https_proxy={url} "
        f"ALL_PROXY={url} all_proxy={url}",
        "",
    ])


# the forwarder process itself

def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.1)
    os._exit(0)


def _pipe(a, b) -> None:
    peer = {a.fileno(): (a, b), b.fileno(): (b, a)}
    poller = select.poll()
    for fd in peer:
        poller.register(fd, select.POLLIN)
    try:
        while peer:
            for fd, _ in poller.poll():
                src, dst = peer[fd]
                data = src.recv(CHUNK)
                if not data:  # half-close: pass the EOF on, keep the other direction going
                    poller.unregister(fd)
                    del peer[fd]
                    try:
                        dst.shutdown(_socket.SHUT_WR)
                    except OSError:
                        pass
                    continue
                dst.sendall(data)
    except OSError:
        pass
    finally:
        a.close()
        b.close()


def _refuse(conn, reason: str) -> None:
    body = (reason + "\n").encode()
    try:
        conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        conn.shutdown(_socket.SHUT_WR)
        conn.settimeout(1.0)
        while conn.recv(CHUNK):  # drain what the client sent, so closing does not reset
            pass
    except OSError:
        pass
    finally:
        conn.close()


def _serve(fd: int, socket_path: str, slots) -> None:
    conn = _socket.socket(fileno=fd)
    try:
        up = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
        try:
            up.connect(socket_path)
        except OSError as e:
            up.close()
            _refuse(conn, f"the supervisor proxy is unreachable: {e}")
            return
        _pipe(conn, up)
    finally:
        slots.append(None)


def main(argv) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        print("error: usage: forwarder.py SOCKET PORT", flush=True)
        return 2
    socket_path, port = argv[0], int(argv[1])
    _thread.start_new_thread(_watch_parent, (os.getppid(),))
    try:
        ls = _socket.socket(_socket.AF_INET, _socket.SOCK_STREAM)
        ls.setsockopt(_socket.SOL_SOCKET, _socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", port))
        ls.listen(64)
    except OSError as e:
        print(f"error: cannot listen on 127.0.0.1:{port}: {e}", flush=True)
        return 1
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # release the readiness pipe
    os.close(devnull)
    slots = [None] * MAX_CONNECTIONS  # list.pop and append are atomic: a semaphore without threading's start-up
    while True:
        fd, _ = ls._accept()
        try:
            slots.pop()
        except IndexError:
            os.close(fd)
            continue
        _thread.start_new_thread(_serve, (fd, socket_path, slots))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
