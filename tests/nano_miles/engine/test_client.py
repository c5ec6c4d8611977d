"""The engine clients and the engine launcher: clear errors (400 -> EngineRequestError with the
server's message, no server -> EngineUnavailable), and `nano-miles serve` subprocesses that stop
cleanly and never outlive their parent."""
import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from nano_miles.engine.client import (
    AsyncEngineClient,
    EngineClient,
    EngineRequestError,
    EngineUnavailable,
    Routes,
)
from nano_miles.engine.pool import check_engine
from nano_miles.engine.process import start_engine_process

SMALL = ("--num-kv-blocks", "256", "--max-running-requests", "8")


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_no_server_raises_engine_unavailable():
    client = EngineClient(closed_port_url(), timeout=5)
    assert client.health() is False
    with pytest.raises(EngineUnavailable, match="unavailable"):
        client.generate([1, 2, 3], {"max_new_tokens": 1})
    with pytest.raises(EngineUnavailable):
        client.model_info()
    with pytest.raises(EngineUnavailable, match="no engine answered"):  # waiting for one to start
        check_engine(client.url, timeout=0.5)


def test_async_no_server_raises_engine_unavailable():
    async def go():
        client = AsyncEngineClient(closed_port_url(), timeout=5)
        try:
            assert await client.health() is False
            with pytest.raises(EngineUnavailable):
                await client.generate([1, 2, 3])
        finally:
            await client.close()

    asyncio.run(go())


ROUTE_METHODS = sorted(n for n, v in vars(Routes).items() if callable(v) and not n.startswith("_"))


def test_both_clients_share_one_definition_of_every_route():
    assert len(ROUTE_METHODS) >= 17
    for name in ROUTE_METHODS:  # inherited, never redefined: the two cannot drift apart
        assert getattr(EngineClient, name) is getattr(AsyncEngineClient, name) is getattr(Routes, name), name


def test_both_clients_get_the_same_answers(engine_server):
    sync = EngineClient(engine_server.url)

    async def ask():
        client = AsyncEngineClient(engine_server.url)
        try:
            return [await client.health(), await client.model_info(), await client.weight_version(),
                    await client.weights_checksum(["model.norm.weight"]),
                    await client.generate([1, 2, 3], {"max_new_tokens": 3, "temperature": 0})]
        finally:
            await client.close()

    answers = asyncio.run(ask())
    assert answers[:4] == [sync.health(), sync.model_info(), sync.weight_version(),
                           sync.weights_checksum(["model.norm.weight"])]
    assert answers[4]["output_ids"] == sync.generate([1, 2, 3], {"max_new_tokens": 3, "temperature": 0})["output_ids"]


def test_400_carries_the_servers_message(engine_client):
    with pytest.raises(EngineRequestError, match="unknown sampling_params keys: bogus") as e:
        engine_client.generate([1, 2], {"bogus": 1})
    assert e.value.status == 400
    assert engine_client.generate([1, 2], {"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1


def test_async_client_generate_batch_and_errors(engine_server):
    async def go():
        client = AsyncEngineClient(engine_server.url)
        try:
            assert await client.health()
            one = await client.generate([1, 2, 3], {"max_new_tokens": 3, "temperature": 0}, rid="async-1")
            batch = await client.generate_batch([[1, 2, 3], [4, 5]], {"max_new_tokens": 2, "temperature": 0})
            with pytest.raises(EngineRequestError, match="positive"):
                await client.generate([1, 2], {"max_new_tokens": 0})
            info = await client.model_info()
            return one, batch, info
        finally:
            await client.close()

    one, batch, info = asyncio.run(go())
    assert one["meta_info"]["id"] == "async-1" and len(one["output_ids"]) == 3
    assert batch[0]["output_ids"] == one["output_ids"][:2] and len(batch) == 2  # greedy: a prefix
    assert info["vocab_size"] == 1024


def test_start_engine_process_serves_and_stops(tiny_model_path):
    with start_engine_process(str(tiny_model_path), extra_args=SMALL) as engine:
        client = engine.client()
        assert client.health() and engine.alive()
        assert len(client.generate([1, 2, 3], {"max_new_tokens": 4, "ignore_eos": True})["output_ids"]) == 4
        assert "ready on http://127.0.0.1:" in engine.log()
        box = {}
        t = threading.Thread(target=lambda: box.update(out=engine.client().generate(
            [3, 4, 5], {"max_new_tokens": 3000, "ignore_eos": True})))
        t.start()
        while not client.server_info()["internal_states"][0]["running"]:  # the request is in the engine
            time.sleep(0.01)
        assert engine.stop() == 0  # SIGTERM: a clean exit, not a kill, even with a request running
        t.join(10)
        assert box["out"]["meta_info"]["finish_reason"]["type"] == "abort"  # it got an answer
    with pytest.raises(EngineUnavailable):
        client.generate([1, 2, 3], {"max_new_tokens": 1})


def test_bad_model_fails_fast_with_the_reason():
    with pytest.raises(EngineUnavailable, match="exited with code 2"):
        start_engine_process("/no/such/model/folder", ready_timeout=60)


PARENT = """
import sys
from nano_miles.engine.pool import check_engine
from nano_miles.engine.process import start_engine_process
engine = start_engine_process(sys.argv[1], extra_args=sys.argv[2:])
print(engine.process.pid, engine.url, flush=True)
sys.stdin.read()  # until the test kills us
"""


def test_engine_dies_with_a_killed_parent(tiny_model_path):
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tiny_model_path), *SMALL], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        pid, url = parent.stdout.readline().split()
        assert EngineClient(url).health()
        os.kill(parent.pid, signal.SIGKILL)  # no chance to clean up
        parent.wait(10)
        deadline = time.time() + 20
        while time.time() < deadline:
            try:
                if psutil.Process(int(pid)).status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.1)
        else:
            os.kill(int(pid), signal.SIGKILL)
            pytest.fail("the engine outlived its parent")
    finally:
        parent.kill()
