"""Shared fixtures, used by the engine, rollout and training tests.

engine_server (session scope)
    A real `nano-miles serve` subprocess: tiny-random-qwen2 on CPU, float32, on a free port, started
    once per test session and stopped (terminate, then kill) at the end. It is an EngineProcess:
    `.url`, `.port`, `.client()`, `.log()`, `.alive()`.
    Rules for tests that use it: leave it as you found it. Weight updates must be undone (use the
    `restore_engine_weights` fixture), pauses continued, no request left running. weight_version is
    NOT fixed (other tests bump it): read it from /model_info when you need it.
engine_client (function scope)
    An EngineClient on engine_server (timeout 120 s); generation is continued after each test.
tiny_model_path (session scope)
    The local HF folder of tiny-random-qwen2 (the same folder the server loads).
restore_engine_weights (function scope)
    After the test, reloads the tiny model's weights from disk into engine_server and checks every
    checksum matches the folder again.
"""
from __future__ import annotations

import glob
import os
import tempfile

import pytest

# One torch thread: on CI's 2 shared cores the tiny model runs ~10x faster than with 2 (no OpenMP
# barriers fighting the test process for the cores).
ENGINE_ARGS = ("--num-kv-blocks", "2048", "--max-running-requests", "128", "--dist-timeout", "30", "--threads", "1")


@pytest.fixture(scope="session")
def tiny_model_path():
    from nano_miles.models.prepare import resolve_model

    return resolve_model("tiny-random-qwen2")


@pytest.fixture(scope="session")
def engine_server(tiny_model_path):
    from nano_miles.engine.process import start_engine_process

    proc = start_engine_process(str(tiny_model_path), device="cpu", dtype="float32", extra_args=ENGINE_ARGS,
                                ready_timeout=180)
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def engine_client(engine_server):
    client = engine_server.client(timeout=120)
    yield client
    client.resume()  # a test that failed while generation was paused must not stall the next ones
    client.close()


@pytest.fixture
def restore_engine_weights(engine_server, tiny_model_path):
    yield
    from safetensors.torch import load_file

    from nano_miles.engine.weights import checksums

    client = engine_server.client()
    client.resume()
    client.update_weights_from_disk(tiny_model_path)
    folder = {}
    for f in sorted(tiny_model_path.glob("*.safetensors")):
        folder.update(load_file(str(f)))
    served = client.weights_checksum()["checksums"]
    assert served == checksums((n, t) for n, t in folder.items() if n in served)
    client.close()


# A sandbox removes its workspace; one a test leaves in the temp dir is a leak. CI runs have left a
# few nano-openshell-ws-* dirs now and then, and no test run alone does, so the run's summary names
# the tests after which new ones appeared (a report, not a failure: it depends on timing). Only those
# still there at the end of the run count: a module-scoped fixture's sandbox (test_network.py's
# net_sandbox) appears during the first test that uses it and goes at the fixture's teardown.
_WORKSPACES = os.path.join(tempfile.gettempdir(), "nano-openshell-ws-*")
_APPEARED: list[tuple[str, set[str]]] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    before = set(glob.glob(_WORKSPACES))
    yield
    new = set(glob.glob(_WORKSPACES)) - before
    if new:
        _APPEARED.append((item.nodeid, new))


def pytest_terminal_summary(terminalreporter):
    left = [(nodeid, [p for p in paths if os.path.exists(p)]) for nodeid, paths in _APPEARED]
    left = [(nodeid, paths) for nodeid, paths in left if paths]
    if left:
        terminalreporter.section("sandbox workspaces left in the temp dir")
        for nodeid, paths in left:
            terminalreporter.line(f"{nodeid}: {len(paths)}")


def pytest_collection_finish(session):
    """Every process a test starts (`nano-miles train`, its engines and ranks, `serve`, `eval`, bench
    scripts) runs one torch thread: on CI's two cores a trainer's or an engine's second OpenMP thread
    spins against the other process (and the test), and a subprocess test burned 30-40% more CPU.
    The code paths are the same; only the thread count differs (a test that needs another sets it).
    Set after collection, when the test modules have loaded torch (and OpenMP with it): this process
    keeps its own threads for the models it runs itself."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
