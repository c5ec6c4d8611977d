"""The engine thread (EngineWorker) and the server around it when a step fails: a real Engine on
tiny-random-qwen2, one step made to raise what a GPU that runs out of memory raises."""
import asyncio
import contextlib

import aiohttp
import pytest
import torch
from aiohttp.test_utils import TestServer

from nano_miles.engine.engine import Engine, EngineConfig
from nano_miles.engine.sampling import SamplingParams
from nano_miles.engine.server import Server, ServerConfig
from nano_miles.engine.worker import EngineWorker

OOM = "CUDA out of memory. Tried to allocate 40.00 MiB"


def fail_next_step(engine):
    """The engine's next step raises torch.OutOfMemoryError in the model's forward, where a GPU runs
    out (the step has scheduled its batch and allocated its KV blocks); later forwards run as before."""
    forward, failed = engine.model.forward, []

    def forward_once_out_of_memory(*args, **kwargs):
        if not failed:
            failed.append(True)
            raise torch.OutOfMemoryError(OOM)
        return forward(*args, **kwargs)
    engine.model.forward = forward_once_out_of_memory


@contextlib.asynccontextmanager
async def serving(model_path):
    """A real server (HTTP on 127.0.0.1, the engine thread) in this event loop; yields (url, server)."""
    cfg = ServerConfig(engine=EngineConfig(model="tiny", device="cpu", dtype="float32", num_kv_blocks=64))
    server = Server(cfg, model_path)
    http = TestServer(server.app(asyncio.get_running_loop()), host="127.0.0.1")
    await http.start_server()
    server.body_parser.start()
    server.worker.thread.start()
    await asyncio.to_thread(server.worker.loaded.wait)
    try:
        yield f"http://127.0.0.1:{http.port}", server
    finally:
        server.worker.stop()
        await http.close()
        server.body_parser.close()


class Item:  # what the server queues for one /generate request
    def __init__(self, rid, input_ids, sampling):
        self.rid, self.input_ids, self.sampling, self.return_logprob = rid, input_ids, sampling, True


def test_a_step_that_fails_aborts_its_requests_with_status_500_and_the_engine_serves_on(tiny_model_path):
    async def scenario():
        worker = EngineWorker(lambda: Engine(EngineConfig(model=str(tiny_model_path), device="cpu",
                                                          dtype="float32", num_kv_blocks=64)),
                              asyncio.get_running_loop())
        worker.thread.start()
        await asyncio.to_thread(worker.loaded.wait)
        fail_next_step(worker.engine)
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        lost = await asyncio.gather(*worker.add([Item(f"r{i}", [5, 6, 7], params) for i in range(3)]))
        served = await asyncio.gather(*worker.add([Item("after", [5, 6, 7], params)]))
        worker.stop()
        await asyncio.to_thread(worker.thread.join, 30)
        return [fin for fin, *_ in lost], served[0][0], worker.engine

    lost, after, engine = asyncio.run(scenario())
    assert engine.blocks.num_free == engine.num_kv_blocks and not engine.has_unfinished()  # nothing leaked
    assert [f.finish_reason["type"] for f in lost] == ["abort"] * 3
    assert all(f.finish_reason["status_code"] == 500 for f in lost)
    assert lost[0].finish_reason["message"] == f"engine error: OutOfMemoryError: {OOM}"
    assert after.finish_reason == {"type": "length", "length": 8} and len(after.output_ids) == 8


def test_generate_answers_http_500_with_the_reason_as_sglang_does_and_serves_on(tiny_model_path):
    """SGLang answers a non-streaming request that its scheduler aborted with 500 or 503 with that HTTP
    status and the message (tokenizer_manager); a 200 with finish_reason abort would read as the
    model's doing."""
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}

    async def scenario():
        async with serving(tiny_model_path) as (url, server), aiohttp.ClientSession() as http:
            fail_next_step(server.worker.engine)
            async with http.post(url + "/generate", json=body) as r:
                failed = r.status, await r.json()
            async with http.post(url + "/generate", json=body) as r:
                return failed, (r.status, await r.json())

    (status, answer), (status_after, after) = asyncio.run(scenario())
    assert status == 500 and answer == {"error": {"message": f"engine error: OutOfMemoryError: {OOM}"}}
    assert status_after == 200 and len(after["output_ids"]) == 4


def test_the_openai_route_answers_http_500_too(tiny_model_path):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    async def scenario():
        async with serving(tiny_model_path) as (url, server), aiohttp.ClientSession() as http:
            fail_next_step(server.worker.engine)
            async with http.post(url + "/v1/chat/completions", json=body) as r:
                failed = r.status, await r.json()
            async with http.post(url + "/v1/chat/completions", json=body) as r:
                return failed, (r.status, await r.json())

    (status, answer), (status_after, after) = asyncio.run(scenario())
    assert status == 500 and answer["error"]["message"] == f"engine error: OutOfMemoryError: {OOM}"
    assert status_after == 200 and after["usage"]["completion_tokens"] == 4


@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_an_overlapped_engine_pauses_takes_an_update_and_finishes_every_request(tiny_model_path, mode):
    """engine.overlap_schedule: a pause takes the step in flight in first, so that an update while
    paused finds every token known (retract recomputes each sequence's cache from its tokens), and
    every request finishes whole after the continue."""
    async def scenario():
        worker = EngineWorker(lambda: Engine(EngineConfig(model=str(tiny_model_path), device="cpu", dtype="float32",
                                                          num_kv_blocks=64, overlap_schedule=True)),
                              asyncio.get_running_loop())
        worker.thread.start()
        await asyncio.to_thread(worker.loaded.wait)
        params = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
        futs = worker.add([Item(f"r{i}", [5, 6, 7 + i], params) for i in range(4)])
        while await worker.call(lambda e: min((len(s.output_ids) for s in e.seqs.values()), default=0)) < 3:
            pass  # each call runs between two steps: no sleep
        await worker.pause(mode)
        paused = await worker.call(lambda e: (e._inflight, [list(s.token_ids) for s in e.seqs.values()]))
        norm = await worker.call(lambda e: e.model.model.norm.weight.clone())
        await worker.update(lambda e: e.load_weights([("model.norm.weight", norm * 1.5)]), abort_first=False)
        await worker.resume()
        done = await asyncio.gather(*futs)
        worker.stop()
        await asyncio.to_thread(worker.thread.join, 30)
        return paused, [fin for fin, *_ in done], worker.engine

    (inflight, tokens), done, engine = asyncio.run(scenario())
    assert inflight is None and tokens and all(-1 not in t for t in tokens)
    assert all(f.finish_reason == {"type": "length", "length": 40} and len(f.output_ids) == 40 and
               -1 not in f.output_ids and len(f.output_logprobs) == 40 for f in done)
    assert engine.blocks.num_free == engine.num_kv_blocks and not engine.has_unfinished()
