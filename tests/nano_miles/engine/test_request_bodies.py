"""Request bodies against the real server (the session's `nano-miles serve`): a body nested too deeply
is a 400; a body over the cap is refused before it is read (413), except on the weight routes; a large
body is parsed away from the event loop, so /health answers within 100 ms while one is sent (and within
half the time a blocking parse would take while one is parsed)."""
import json
import socket
import threading
import time

import requests

MiB = 1 << 20


class HealthProbe:
    """Polls /health every 10 ms from a thread of its own and records each answer's latency."""

    def __init__(self, url):
        self.url, self.latencies, self.failures = url, [], []
        self._stop, self._ready = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        session = requests.Session()
        session.get(self.url + "/health", timeout=5)  # connected before measuring
        self._ready.set()
        while not self._stop.is_set():
            t = time.perf_counter()
            try:
                ok = session.get(self.url + "/health", timeout=5).status_code == 200
            except requests.RequestException as e:
                ok = False
                self.failures.append(repr(e))
            self.latencies.append(time.perf_counter() - t)
            if not ok:
                self.failures.append("not 200")
            time.sleep(0.01)

    def __enter__(self):
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)


def slow_upload(port: int, path: str, headers: dict, total: int, piece: bytes, pause: float = 0.01) -> int:
    """POST `total` bytes (`piece` repeated) with Content-Length, a piece at a time; the answer's status."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        head = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json",
                f"Content-Length: {total}", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
        s.sendall("\r\n".join(head).encode())
        sent = 0
        try:
            while sent < total:
                chunk = piece[: total - sent]
                s.sendall(chunk)
                sent += len(chunk)
                time.sleep(pause)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered early and stopped reading: fine, read its answer
        answer = b""
        try:
            while b"\r\n" not in answer:
                data = s.recv(4096)
                if not data:
                    break
                answer += data
        except ConnectionResetError:
            pass
    return int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else -1


def auth(engine_server) -> dict:
    return {"Authorization": f"Bearer {engine_server.api_key}"}


def still_serving(engine_server):
    r = requests.post(engine_server.url + "/generate", headers=auth(engine_server), timeout=60,
                      json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text


def test_deeply_nested_json_is_400(engine_server):
    for raw in (b"[" * 100_000 + b"]" * 100_000, b'{"input_ids": ' + b"[" * 5_000 + b"]" * 5_000 + b"}"):
        r = requests.post(engine_server.url + "/generate", data=raw, headers=auth(engine_server), timeout=60)
        assert r.status_code == 400, r.text
        assert "nested too deeply" in r.json()["error"]["message"]
    still_serving(engine_server)


def test_a_200_mib_body_is_refused_before_it_is_read_and_health_stays_fast(engine_server):
    with HealthProbe(engine_server.url) as probe:
        t = time.monotonic()
        status = slow_upload(engine_server.port, "/generate", auth(engine_server), 200 * MiB,
                             b'{"input_ids": [' + b"1234567," * (MiB // 2))
        took = time.monotonic() - t
    assert status == 413
    assert probe.latencies and not probe.failures, probe.failures
    assert max(probe.latencies) < 0.1, f"/health took {max(probe.latencies) * 1000:.0f} ms during the upload"
    assert took < 30
    still_serving(engine_server)


def test_a_large_body_under_the_cap_is_parsed_off_the_event_loop(engine_server):
    body = b'{"input_ids": [' + b"123," * (12 * MiB) + b'1], "sampling_params": {"max_new_tokens": 1}}'  # 48 MiB
    box = {}
    with HealthProbe(engine_server.url) as probe:
        sender = threading.Thread(target=lambda: box.update(r=requests.post(
            engine_server.url + "/generate", data=body, headers=auth(engine_server), timeout=120)))
        sender.start()
        sender.join(120)
    r = box["r"]
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]  # parsed, then refused: too long
    assert len(probe.latencies) > 20 and not probe.failures, probe.failures
    # What a parse ON the event loop would stall /health for, on this machine now: json.loads alone
    # (the token walk would add to it). On the loaded 2-core VM, where the parsing child, the token
    # walk and pytest share two cores, a fixed 0.1 s failed once in CI (250 ms) and half the blocking
    # parse once too (464 ms against 650). A stall below 0.8 of json.loads alone is scheduling, not a
    # parse on the loop.
    t = time.monotonic()
    json.loads(body)
    blocking = time.monotonic() - t
    bound = max(0.1, 0.8 * blocking)
    assert max(probe.latencies) < bound, (f"/health took {max(probe.latencies) * 1000:.0f} ms during the parse "
                                          f"(a blocking parse takes {blocking * 1000:.0f} ms here)")


def test_only_the_weight_routes_take_bodies_over_the_cap(engine_server):
    payload = b'{"serialized_named_tensors": ["' + b"A" * (70 * MiB) + b'"], "load_format": "flattened_bucket"}'
    for path in ("/generate", "/abort_request", "/pause_generation"):
        r = requests.post(engine_server.url + path, data=payload, headers=auth(engine_server), timeout=60)
        assert r.status_code == 413 and "max_body_mb" in r.json()["error"]["message"], (path, r.text)
    r = requests.post(engine_server.url + "/update_weights_from_tensor", data=payload, headers=auth(engine_server),
                      timeout=120)
    assert r.status_code == 400 and r.json()["success"] is False  # read and decoded: not a valid payload
    still_serving(engine_server)
