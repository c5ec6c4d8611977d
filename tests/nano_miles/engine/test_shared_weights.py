"""One copy of the weights: a CPU engine server maps the CPU trainer's weights (tiny-random-qwen2, fp32).

What must hold: after a train step and a `shared` sync (no bytes sent) the engine serves exactly the
trainer's weights (checksums equal, parity ~0); it is the SAME memory (a write on the trainer is seen
by the engine without any sync); any other weight update gives the engine a private copy first, so
nothing the engine loads can change the trainer's weights; a manifest that does not fit is refused.
"""
import threading
import time

import pytest
import torch

from nano_miles.engine.client import EngineRequestError
from nano_miles.engine.weights import checksums
from nano_miles.engine.shared_weights import SharedWeights, SharedWeightsError, map_shared
from nano_miles.trainer.trainer import OptimConfig, Trainer, TrainerConfig
from nano_miles.trainer.weight_sync import WeightSync, choose_transport

from tests.nano_miles.trainer.test_weight_sync import engine_rollouts, max_diff

ADV = torch.tensor([-1.0, 1.0, -1.0, 1.0])


def make_trainer(path):
    return Trainer(TrainerConfig(model=str(path), micro_batch_size=2, optim=OptimConfig(lr=1e-3)))


def test_the_engine_serves_the_trainers_updated_weights_without_a_copy(engine_server, engine_client, tiny_model_path,
                                                                        restore_engine_weights):
    trainer = make_trainer(tiny_model_path)
    with WeightSync(trainer, engine_server.url, transport="shared", verify=True) as ws:
        for step in range(2):
            batch = engine_rollouts(engine_client, seed=step)
            m = trainer.train_step(batch, ADV)
            assert m["logprob_diff_max"] <= 1e-5, (step, m["logprob_diff_max"])
            stats = ws.sync(f"shared-{step}")  # verify=True: every checksum compared
            assert stats["transport"] == "shared" and stats["bytes"] == 0 and stats["verified"]
            assert engine_client.weight_version() == f"shared-{step}"
        batch = engine_rollouts(engine_client, seed=99)
        assert batch.weight_versions[0] == ["shared-1"]
        assert max_diff(trainer, batch) <= 1e-5

        # The same memory: a write on the trainer is what the engine serves, with no sync at all.
        name = trainer.names[-1]
        with torch.no_grad():
            trainer.params[-1].add_(0.25)
        served = engine_client.weights_checksum([name])["checksums"][name]
        assert served == checksums([(name, trainer.params[-1])])[name]


def test_another_update_gives_the_engine_a_private_copy_first(engine_server, engine_client, tiny_model_path,
                                                             restore_engine_weights):
    trainer = make_trainer(tiny_model_path)
    with WeightSync(trainer, engine_server.url, transport="shared") as ws:
        trainer.train_step(engine_rollouts(engine_client, seed=4), ADV)
        ws.sync("shared-a")
        trained = [p.detach().clone() for p in trainer.params]
        engine_client.update_weights_from_disk(tiny_model_path)  # writes the engine's weights: detaches first
        for p, t in zip(trainer.params, trained):
            assert torch.equal(p, t)  # the trainer's weights were not written by the engine's load
        name = trainer.names[0]
        before = engine_client.weights_checksum([name])["checksums"][name]
        with torch.no_grad():
            trainer.params[0].add_(1.0)
        assert engine_client.weights_checksum([name])["checksums"][name] == before  # no longer shared
        ws.sync("shared-b")  # maps again
        assert engine_client.weights_checksum([name])["checksums"][name] == checksums([(name, trainer.params[0])])[name]


def test_a_manifest_that_does_not_fit_is_refused_and_changes_nothing(engine_client, tiny_model_path):
    trainer = make_trainer(tiny_model_path)
    shared = trainer.share_weights(torch.float32)
    before = engine_client.weights_checksum()
    bad_shape = [list(e) for e in shared.manifest]
    bad_shape[0][2] = [bad_shape[0][2][0] + 1, *bad_shape[0][2][1:]]
    with pytest.raises(EngineRequestError, match="manifest"):
        engine_client.update_weights_from_shared(shared.path, bad_shape)
    with pytest.raises(EngineRequestError, match="lacks 1 parameters"):
        engine_client.update_weights_from_shared(shared.path, shared.manifest[1:])
    with pytest.raises(EngineRequestError, match="cannot open"):
        engine_client.update_weights_from_shared("/proc/1/fd/999999", shared.manifest)
    assert engine_client.weights_checksum() == before


def test_shared_weights_holding_nan_are_refused(engine_client, tiny_model_path, restore_engine_weights):
    """Mapped for the first time, NaN weights are refused and the engine keeps its own copy. Once
    mapped, the trainer's in-place writes are served as they are (there is no older copy to keep):
    the version then stays where it was and the engine says why."""
    trainer = make_trainer(tiny_model_path)
    shared = trainer.share_weights(torch.float32)
    name = trainer.names[1]
    before, version = engine_client.weights_checksum(), engine_client.weight_version()
    with torch.no_grad():
        trainer.params[1].view(-1)[0] = float("nan")
    with pytest.raises(EngineRequestError, match=f"{name} holds NaN or infinite values"):
        engine_client.update_weights_from_shared(shared.path, shared.manifest, weight_version="nan-1")
    assert engine_client.weights_checksum() == before and engine_client.weight_version() == version
    with torch.no_grad():
        trainer.params[1].view(-1)[0] = 0.0
    engine_client.update_weights_from_shared(shared.path, shared.manifest, weight_version="mapped")
    with torch.no_grad():
        trainer.params[1].view(-1)[0] = float("inf")
    with pytest.raises(EngineRequestError, match=f"{name} holds NaN or infinite values"):
        engine_client.update_weights_from_shared(shared.path, shared.manifest, weight_version="inf-1")
    assert engine_client.weight_version() == "mapped"


def test_sharing_moves_the_tensors_in_place_and_the_views_are_read_only(tiny_model_path):
    trainer = make_trainer(tiny_model_path)
    params = list(trainer.params)
    values = [p.detach().clone() for p in params]
    shared = trainer.share_weights(torch.float32)
    assert all(a is b for a, b in zip(trainer.params, params))  # the optimizer's objects, tied weights kept
    assert all(torch.equal(p, v) for p, v in zip(trainer.params, values))
    specs = {n: (tuple(p.shape), p.dtype) for n, p in zip(trainer.names, trainer.params)}
    views = map_shared(shared.path, shared.manifest, specs)
    with torch.no_grad():
        trainer.params[1].mul_(2)
    assert torch.equal(views[trainer.names[1]], trainer.params[1])
    with pytest.raises(SharedWeightsError, match="unknown parameter"):
        map_shared(shared.path, shared.manifest, dict(list(specs.items())[1:]))
    # A bf16 engine cannot map FP32 masters (that would need a cast): the trainer says so.
    assert trainer.share_weights(torch.bfloat16) is None and not trainer.shareable(torch.bfloat16)
    with pytest.raises(ValueError, match="CPU tensors"):
        SharedWeights([("w", torch.zeros(2, device="meta"))])


def test_auto_picks_shared_only_where_the_caller_allows_it(engine_server, tiny_model_path):
    local = ["http://127.0.0.1:1"]
    cpu = torch.device("cpu")
    assert choose_transport(cpu, [{"device": "cpu"}], local, shareable=True) == "shared"
    assert choose_transport(cpu, [{"device": "cpu"}], local, shareable=False) == "distributed"
    assert choose_transport(cpu, [{"device": "cpu"}], ["http://10.0.0.7:30000"], shareable=True) == "distributed"
    trainer = make_trainer(tiny_model_path)
    with WeightSync(trainer, engine_server.url) as ws:
        assert ws.transport == "distributed"  # async mode: the engine generates during updates
    with WeightSync(trainer, engine_server.url, allow_shared=True) as ws:
        assert ws.transport == "shared"


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) * 1024


def test_a_cpu_engine_releases_its_kv_cache_memory_and_still_answers_the_same(engine_server, engine_client):
    prompt, params = [5, 6, 7, 8, 9], {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    expected = engine_client.generate(prompt, params)["output_ids"]
    # Touch every KV page (the test server has 2048 blocks of 16 tokens: 1 MiB for the tiny model).
    engine_client.generate_batch([[3 + i] * 200 for i in range(128)], {"max_new_tokens": 1, "temperature": 0})
    before = _rss(engine_server.process.pid)
    answer = engine_client.release_memory_occupation(["kv_cache"])
    assert answer["success"] and "Released the KV cache's memory" in answer["message"]
    assert _rss(engine_server.process.pid) < before - 512 * 1024
    assert engine_client.generate(prompt, params)["output_ids"] == expected  # zeros are a valid empty cache
    assert engine_client.resume_memory_occupation()["success"]
    with pytest.raises(EngineRequestError, match="tags"):
        engine_client.release_memory_occupation(["everything"])


def test_releasing_the_kv_cache_while_paused_in_place_keeps_the_paused_requests_kv(engine_server, engine_client):
    """A request paused in place keeps its KV to go on from it: releasing the cache's pages then
    (which runs at once while paused) must not zero them under it, which changed its later tokens."""
    prompt, params = [5, 6, 7, 8, 9], {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}
    expected = engine_client.generate(prompt, params)["output_ids"]
    box = {}
    t = threading.Thread(target=lambda: box.update(out=engine_server.client().generate(prompt, params, rid="kept")))
    t.start()
    deadline = time.time() + 30
    while engine_client.server_info()["internal_states"][0]["running"] < 1:
        assert time.time() < deadline, "the request never started"
        time.sleep(0.02)
    engine_client.pause("in_place")
    try:
        try:
            engine_client.release_memory_occupation(["kv_cache"])
        except EngineRequestError as e:  # refused is fine too: what it must not do is drop the pages
            assert "paused" in str(e), e
    finally:
        engine_client.resume()
    t.join(60)
    assert box["out"]["output_ids"] == expected
