"""The server against peers that do not play along, over real HTTP (a `nano-miles serve` of its own,
tiny-random-qwen2 on CPU). Weight-update rendezvous are tested on loopback only: a closed port and
a listener that accepts but never speaks; no test here sends traffic to any other address."""
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from nano_miles.client import EngineRequestError, start_engine_process
from nano_miles.engine import weight_group as G

CONNECT_TIMEOUT = 3.0


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
    assert "did not complete within 3s" in str(error) and "dist_connect_timeout" in str(error)
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
            time.sleep(0.5)
            with pytest.raises(EngineRequestError, match="one rendezvous at a time"):
                client.init_weights_update_group("127.0.0.1", silent.getsockname()[1], 1, 2, "second")
            with pytest.raises(EngineRequestError, match="did not complete"):
                first.result()
    finally:
        silent.close()
