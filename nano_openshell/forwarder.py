"""In-sandbox forwarder: 127.0.0.1:PORT -> the supervisor proxy's Unix socket.

Inside the sandbox only a read-only view of the host filesystem exists, so this file is run
directly as `<python> -I -S forwarder.py SOCKET PORT` and imports nothing but the standard
library. It prints one line ("ready" or "error: ...") on stdout once listening, closes stdout,
and dies with the shell that started it (PR_SET_PDEATHSIG, plus a parent watchdog).

On the host side, sandbox_prelude() returns the bash snippet that starts it.
"""

import os
import selectors
import shlex
import socket
import sys
import threading
import time

FORWARDER_PORT = 3128
READY_TIMEOUT_S = 2
MAX_CONNECTIONS = 64
CHUNK = 64 * 1024


def sandbox_prelude(socket_path_inside_sandbox, port=FORWARDER_PORT, python=None) -> str:
    """Bash that starts the forwarder in the background, waits (at most ~2 s) until it listens,
    and points the usual proxy variables at it. Put it before the agent's command."""
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ValueError(f"port must be an integer in 1..65535, got {port!r}")
    py = shlex.quote(python or sys.executable)
    script = shlex.quote(os.path.abspath(__file__))
    sock = shlex.quote(str(socket_path_inside_sandbox))
    url = f"http://127.0.0.1:{port}"
    return "\n".join([
        "__openshell_fwd=",
        # the process substitution's python is a child of this shell, so PDEATHSIG ties it to us
        f"{{ read -r -t {READY_TIMEOUT_S} __openshell_fwd < <(exec {py} -I -S {script} {sock} {port} "
        "</dev/null 2>/dev/null); } 2>/dev/null",
        'if [ "$__openshell_fwd" != ready ]; then',
        '  echo "nano-openshell: network forwarder did not start: ${__openshell_fwd:-no answer}" >&2',
        "fi",
        "unset __openshell_fwd NO_PROXY no_proxy",
        f"export HTTP_PROXY={url} http_proxy={url} HTTPS_PROXY={url} https_proxy={url} "
        f"ALL_PROXY={url} all_proxy={url}",
        "",
    ])


# ---- the forwarder process itself (stdlib only from here on) ----

def _die_with_parent() -> None:
    parent = os.getppid()
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL
    except Exception:
        pass  # the watchdog below still covers it
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(0)

    def watchdog():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(0)
    threading.Thread(target=watchdog, daemon=True).start()


def _pipe(a: socket.socket, b: socket.socket) -> None:
    sel = selectors.DefaultSelector()
    sel.register(a, selectors.EVENT_READ, b)
    sel.register(b, selectors.EVENT_READ, a)
    try:
        while sel.get_map():
            for key, _ in sel.select():
                src, dst = key.fileobj, key.data
                data = src.recv(CHUNK)
                if not data:
                    sel.unregister(src)
                    try:
                        dst.shutdown(socket.SHUT_WR)
                    except OSError:
                        pass
                    continue
                dst.sendall(data)
    except OSError:
        pass
    finally:
        sel.close()
        a.close()
        b.close()


def _refuse(conn: socket.socket, reason: str) -> None:
    body = (reason + "\n").encode()
    try:
        conn.sendall(b"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(1.0)
        while conn.recv(CHUNK):  # drain what the client sent, so closing does not reset
            pass
    except OSError:
        pass
    finally:
        conn.close()


def _serve(conn: socket.socket, socket_path: str, slots: threading.BoundedSemaphore) -> None:
    try:
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.connect(socket_path)
        except OSError as e:
            up.close()
            _refuse(conn, f"the supervisor proxy is unreachable: {e}")
            return
        _pipe(conn, up)
    finally:
        slots.release()


def main(argv) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        print("error: usage: forwarder.py SOCKET PORT", flush=True)
        return 2
    socket_path, port = argv[0], int(argv[1])
    _die_with_parent()
    try:
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind(("127.0.0.1", port))
        ls.listen(64)
    except OSError as e:
        print(f"error: cannot listen on 127.0.0.1:{port}: {e}", flush=True)
        return 1
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # release the readiness pipe
    os.close(devnull)
    slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
    while True:
        conn, _ = ls.accept()
        if not slots.acquire(blocking=False):
            conn.close()
            continue
        threading.Thread(target=_serve, args=(conn, socket_path, slots), daemon=True).start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
