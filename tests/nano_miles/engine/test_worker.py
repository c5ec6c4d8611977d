"""The engine thread (EngineWorker) when a step fails: a real Engine on tiny-random-qwen2, one step
made to raise what a GPU that runs out of memory raises."""
import asyncio

import torch

from nano_miles.engine.engine import Engine, EngineConfig
from nano_miles.engine.sampling import SamplingParams
from nano_miles.engine.worker import EngineWorker


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
        step, failures = worker.engine.step, []

        def step_once_out_of_memory():
            if not failures:
                failures.append(1)
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 MiB")
            return step()

        worker.engine.step = step_once_out_of_memory
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        lost = await asyncio.gather(*worker.add([Item(f"r{i}", [5, 6, 7], params) for i in range(3)]))
        served = await asyncio.gather(*worker.add([Item("after", [5, 6, 7], params)]))
        worker.stop()
        return [fin for fin, *_ in lost], served[0][0]

    lost, after = asyncio.run(scenario())
    assert [f.finish_reason["type"] for f in lost] == ["abort"] * 3
    assert all(f.finish_reason["status_code"] == 500 for f in lost)
    assert lost[0].finish_reason["message"].startswith("engine error: OutOfMemoryError: CUDA out of memory")
    assert after.finish_reason == {"type": "length", "length": 8} and len(after.output_ids) == 8
