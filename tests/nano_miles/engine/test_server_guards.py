"""The server against peers that do not play along, over real HTTP (a `nano-miles serve` of its own,
tiny-random-qwen2 on CPU, started with an api key as start_engine_process does by default): every
route but /health needs the key; weight-update rendezvous that nobody answers fail in time. Those are
tested on loopback only (a closed port, a listener that accepts but never speaks): no test here sends
traffic to any other address."""
import asyncio
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
import requests
import torch
from safetensors.torch import load_file, save_file

from nano_miles.engine.client import AsyncEngineClient, EngineClient, EngineError, EngineRequestError
from nano_miles.engine.process import start_engine_process
from nano_miles.engine import weight_group as G
from nano_miles.engine.protocol import API_KEY_ENV
from nano_miles.engine.server import Server, ServerConfig

CONNECT_TIMEOUT = 1.5  # what a rendezvous nobody answers costs each test below: short


@pytest.fixture(scope="module")
def server(tiny_model_path):
    with start_engine_process(str(tiny_model_path), dtype="float32", ready_timeout=180,
                              extra_args=("--num-kv-blocks", "256", "--threads", "1", "--dist-timeout", "20",
                                          "--set", f"dist_connect_timeout={CONNECT_TIMEOUT}")) as proc:
        yield proc


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy_throughout(server, during):
    """Run during() in a thread while polling /health; every poll answers 200 (within 1 s)."""
    box, polls = {}, []
    worker = threading.Thread(target=lambda: box.update(result=during()))
    worker.start()
    while worker.is_alive():
        t = time.monotonic()
        polls.append((requests.get(server.url + "/health", timeout=1).status_code, time.monotonic() - t))
        time.sleep(0.1)
    worker.join()
    assert polls and all(status == 200 for status, _ in polls), polls
    return box["result"]


@pytest.mark.parametrize("peer", ["closed port", "silent listener"])
def test_a_rendezvous_nobody_answers_fails_in_time_and_the_server_stays_healthy(server, peer):
    client = server.client()
    silent = None
    if peer == "closed port":
        port = closed_port()
    else:  # accepts connections (the kernel's backlog) and never says a word
        silent = socket.create_server(("127.0.0.1", 0))
        port = silent.getsockname()[1]
    try:
        t = time.monotonic()

        def init():
            with pytest.raises(EngineRequestError) as e:
                client.init_weights_update_group("127.0.0.1", port, 1, 2, f"g-{port}", "gloo", timeout=60)
            return e.value

        error = healthy_throughout(server, init)
        took = time.monotonic() - t
    finally:
        if silent is not None:
            silent.close()
    assert took < CONNECT_TIMEOUT + 3, f"answered after {took:.1f}s"
    assert f"did not complete within {CONNECT_TIMEOUT:g}s" in str(error) and "dist_connect_timeout" in str(error)
    assert client.generate([1, 2, 3], {"max_new_tokens": 2})["output_ids"]
    # nothing is left half-formed: a real trainer can form a group right after
    listener = G.listen("127.0.0.1")
    port = listener.getsockname()[1]
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(client.init_weights_update_group, "127.0.0.1", port, 1, 2, "after", "gloo")
        pg = G.init_weight_update_group("127.0.0.1", port, 0, 2, "after", "gloo", timeout_s=20, listener=listener)
        assert joined.result()["success"] is True
    client.destroy_weights_update_group("after")
    G.destroy_weight_update_group(pg)


def test_one_rendezvous_at_a_time(server):
    client = server.client()
    silent = socket.create_server(("127.0.0.1", 0))
    try:
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(client.init_weights_update_group, "127.0.0.1", silent.getsockname()[1], 1, 2, "slow")
            silent.settimeout(30)
            engine_side, _ = silent.accept()  # the engine connected: the first group is being formed
            try:  # (taken out of the backlog, and still never a word said on it)
                with pytest.raises(EngineRequestError, match="one rendezvous at a time"):
                    client.init_weights_update_group("127.0.0.1", silent.getsockname()[1], 1, 2, "second")
                with pytest.raises(EngineRequestError, match="did not complete"):
                    first.result()
            finally:
                engine_side.close()
    finally:
        silent.close()


# ----------------------------------------------------------------------------- the api key

def server_routes() -> list[tuple[str, str]]:
    """(method, path) of every route the server registers, read from its own router."""
    loop = asyncio.new_event_loop()
    try:
        app = Server(ServerConfig(), "unused").app(loop)
    finally:
        loop.close()
    routes = {(r.method if r.method != "*" else "POST", r.resource.canonical) for r in app.router.routes()}
    return sorted((m, p) for m, p in routes if m != "HEAD")


def test_every_route_but_health_needs_the_api_key(server):
    routes = server_routes()
    assert ("POST", "/update_weights_from_disk") in routes and len(routes) >= 18
    for method, path in routes:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": server.api_key}):
            r = requests.request(method, server.url + path, json={}, headers=headers, timeout=30)
            if path == "/health":
                assert r.status_code == 200
            else:
                assert r.status_code == 401, (method, path, headers, r.status_code)
                assert "Authorization: Bearer" in r.json()["error"]["message"]


def test_a_key_that_is_not_utf8_is_refused_with_401(server):
    """Header bytes are not text: a key of bytes invalid in UTF-8 is a wrong key (401), not a 500."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"GET /model_info HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                  b"Connection: close\r\n\r\n")
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 401 "), answer[:200]
    assert b"Authorization: Bearer" in answer


def test_unauthenticated_weights_from_disk_change_nothing(server, tiny_model_path, tmp_path):
    """The attack: zeroed weights loaded through /update_weights_from_disk changed every later answer."""
    client = server.client()
    before = client.weights_checksum()
    save_file({n: torch.zeros_like(t) for n, t in load_file(str(next(tiny_model_path.glob("*.safetensors")))).items()},
              str(tmp_path / "model.safetensors"))
    r = requests.post(server.url + "/update_weights_from_disk", json={"model_path": str(tmp_path)}, timeout=60)
    assert r.status_code == 401
    assert client.weights_checksum() == before


def test_clients_send_the_key(server):
    assert EngineClient(server.url, api_key=server.api_key).model_info()["vocab_size"] == 1024
    assert EngineClient(server.url).model_info()["vocab_size"] == 1024  # an engine this process started
    with pytest.raises(EngineError, match="HTTP 401"):
        EngineClient(server.url, api_key="wrong").model_info()
    assert EngineClient(server.url, api_key="wrong").health() is True  # /health stays open

    async def ask():
        client = AsyncEngineClient(server.url)
        try:
            return await client.model_info()
        finally:
            await client.close()

    assert asyncio.run(ask())["vocab_size"] == 1024


def test_the_generated_key_stays_off_the_command_line(server):
    assert len(server.api_key) >= 32
    assert not any(server.api_key in arg for arg in psutil.Process(server.process.pid).cmdline())


def serve(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nano_miles.cli", "serve", *argv], capture_output=True, text=True,
                          timeout=120, env={k: v for k, v in os.environ.items() if k != API_KEY_ENV})


def test_a_server_others_can_reach_needs_a_key(tiny_model_path):
    # 192.0.2.1 (TEST-NET-1) is no address of this machine: a server that got past the check fails to
    # bind there, so nothing here ever listens beyond loopback or sends a packet.
    # the three command lines side by side: each spends its time importing torch
    with ThreadPoolExecutor(3) as pool:
        refused, *allowed = pool.map(lambda extra: serve("--model", str(tiny_model_path), "--host", "192.0.2.1",
                                                         "--port", "0", *extra),
                                     ([], ["--allow-unauthenticated"], ["--api-key", "k"]))
    assert refused.returncode == 2
    assert refused.stderr.strip().splitlines() == [
        "nano-miles serve: --host 192.0.2.1 lets other machines in: give --api-key KEY (or $NANO_MILES_API_KEY), "
        "or --allow-unauthenticated if that is really meant"]
    for run in allowed:
        assert run.stderr.strip().splitlines()[-1].startswith("nano-miles serve: cannot listen on 192.0.2.1"), run.stderr
