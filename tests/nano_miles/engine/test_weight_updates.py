"""Every weight-update route of the engine server, over real HTTP, with the trainer's side of
nano_miles.engine.weights producing the payloads in this (separate) process:
- tensor: SGLang's flattened bucket shared through /dev/shm, and the "direct" (name, tensor) list
- disk: a safetensors folder
- distributed: a gloo group, this process as trainer rank 0 broadcasting one bucket per update
Each success bumps weight_version, flushes every cached prefix (cached_tokens 0 afterwards) and the
served log-probs match a teacher-forced HF forward of the NEW weights. (Bad payloads, each a 400 that
leaves the old weights and version in place: test_weight_update_guards.py.)"""
import base64
import os
import pickle
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file, save_file

from nano_miles.engine.client import EngineRequestError
from nano_miles.engine.protocol import API_KEY_ENV
from nano_miles.engine import weight_group as G
from nano_miles.engine import weights as W
from tests.nano_miles.engine.test_server import hf_model, teacher_forced_logprobs

pytestmark = pytest.mark.usefixtures("restore_engine_weights")

CACHED_PROMPT = [(17 * i) % 700 + 6 for i in range(40)]  # 2 full KV blocks


def direct(named) -> str:
    """A payload entry for load_format None or "direct" (what verl sends): pickled (name, tensor) pairs."""
    return W.serialize([(name, tensor.detach()) for name, tensor in named])


def folder_state(folder) -> dict:
    state = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def perturbed(folder, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=g, dtype=t.dtype) for n, t in folder_state(folder).items()}


def version(client) -> str:
    return client.model_info()["weight_version"]


def served_checksums(client) -> dict:
    return client.weights_checksum()["checksums"]


def warm_prefix(client):
    client.generate(CACHED_PROMPT, {"max_new_tokens": 1})
    assert client.generate(CACHED_PROMPT, {"max_new_tokens": 1})["meta_info"]["cached_tokens"] >= 32


def assert_serving(client, folder, state):
    """The served weights ARE `state`: checksums, no stale prefix, logprobs of an HF forward of it."""
    assert served_checksums(client) == W.checksums((n, t) for n, t in state.items() if n in served_checksums(client))
    out = client.generate(CACHED_PROMPT, {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True,
                                          "sampling_seed": 7})
    assert out["meta_info"]["cached_tokens"] == 0  # blocks computed with the old weights are never reused
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    want = teacher_forced_logprobs(hf_model(folder, state), CACHED_PROMPT, out["output_ids"])
    assert torch.allclose(got, want, atol=1e-5, rtol=0), (got - want).abs().max()


def test_flattened_bucket_through_shared_memory(engine_client, tiny_model_path):
    warm_prefix(engine_client)
    state = perturbed(tiny_model_path, 1)
    payload, bucket = W.serialize_bucket(state.items())
    r = engine_client.update_weights_from_tensor([payload], load_format="flattened_bucket", weight_version="bucket-1")
    del bucket
    assert r["success"] is True and "bucket-1" in r["message"]
    assert version(engine_client) == "bucket-1"
    assert_serving(engine_client, tiny_model_path, state)


def test_direct_named_tensors_and_version_plus_one(engine_client, tiny_model_path):
    engine_client.update_weights_from_disk(tiny_model_path, weight_version="41")
    warm_prefix(engine_client)
    state = perturbed(tiny_model_path, 2)
    r = engine_client.update_weights_from_tensor(direct(state.items()), load_format="direct")
    assert r["success"] is True
    assert version(engine_client) == "42"  # no weight_version given: +1
    assert_serving(engine_client, tiny_model_path, state)


def test_a_bucket_may_carry_a_subset_of_the_weights(engine_client, tiny_model_path):
    base = folder_state(tiny_model_path)
    state = dict(base, **{"model.norm.weight": base["model.norm.weight"] * 1.5})
    payload, bucket = W.serialize_bucket([("model.norm.weight", state["model.norm.weight"])])
    assert engine_client.update_weights_from_tensor(payload, load_format="flattened_bucket")["success"]
    assert_serving(engine_client, tiny_model_path, state)


def test_update_from_disk(engine_client, tiny_model_path, tmp_path):
    warm_prefix(engine_client)
    state = perturbed(tiny_model_path, 3)
    save_file(state, str(tmp_path / "model.safetensors"))
    r = engine_client.update_weights_from_disk(tmp_path, weight_version="disk-1")
    assert r["success"] is True and version(engine_client) == "disk-1"
    assert_serving(engine_client, tiny_model_path, state)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_gloo_broadcast_from_a_trainer_process(engine_client, tiny_model_path, load_format):
    group = f"test-group-{load_format}"
    port = free_port()
    with ThreadPoolExecutor(2) as pool:
        joined = pool.submit(engine_client.init_weights_update_group, "127.0.0.1", port, 1, 2, group, "gloo")
        pg = G.init_weight_update_group("127.0.0.1", port, 0, 2, group, "gloo", timeout_s=30)
        assert joined.result()["success"] is True
        assert not torch.distributed.is_initialized()  # a group of its own: no default group was made
        try:
            for step in (1, 2):  # the group is reused across updates
                warm_prefix(engine_client)
                state = perturbed(tiny_model_path, 10 + step)
                named = list(state.items())
                done = pool.submit(engine_client.update_weights_from_distributed, [n for n, _ in named],
                                   [t.dtype for _, t in named], [t.shape for _, t in named], group,
                                   load_format, f"gloo-{step}")
                time.sleep(0.2)  # the engine waits on the broadcast OFF its event loop: still serving
                assert engine_client.generate([1, 2, 3], {"max_new_tokens": 2})["output_ids"]
                G.broadcast_weights(pg, named, load_format, timeout_s=30)
                assert done.result()["success"] is True
                assert version(engine_client) == f"gloo-{step}"
                assert_serving(engine_client, tiny_model_path, state)
        finally:
            assert engine_client.destroy_weights_update_group(group)["success"] is True
            G.destroy_weight_update_group(pg)


ENGINE_SIDE = """
import sys, time
from nano_miles.engine import weight_group as G
pg = G.init_weight_update_group("127.0.0.1", int(sys.argv[1]), 1, 2, "timeout-group", "gloo", timeout_s=20)
t = time.monotonic()
try:
    G.receive_weights(pg, ["x"], ["float32"], [[4]], "cpu", timeout_s=1.0)
except RuntimeError as e:
    print(f"gave up after {time.monotonic() - t:.1f}s: {e}", flush=True)
import os; os._exit(0)  # skip the group's teardown handshake with a trainer that never answers
"""


def test_distributed_receive_times_out_instead_of_hanging():
    import subprocess
    import sys

    port = free_port()
    engine = subprocess.Popen([sys.executable, "-c", ENGINE_SIDE, str(port)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.getcwd()})
    pg = G.init_weight_update_group("127.0.0.1", port, 0, 2, "timeout-group", "gloo", timeout_s=20)
    try:
        out, _ = engine.communicate(timeout=30)  # the trainer never broadcasts
    finally:
        engine.kill()
        G.destroy_weight_update_group(pg)
    assert "gave up after" in out


def test_update_waits_for_in_flight_requests(engine_server, engine_client, tiny_model_path):
    before = version(engine_client)
    box = {}
    gen = threading.Thread(target=lambda: box.update(out=engine_server.client().generate(
        [3, 4, 5], {"max_new_tokens": 400, "ignore_eos": True})))
    gen.start()
    while engine_client.server_info()["internal_states"][0]["running"] == 0:
        time.sleep(0.02)
    payload, bucket = W.serialize_bucket(perturbed(tiny_model_path, 4).items())
    assert engine_client.update_weights_from_tensor(payload, load_format="flattened_bucket",
                                                    weight_version="after-drain")["success"]
    gen.join(30)
    out = box["out"]  # finished, whole, on the weights it started with
    assert out["meta_info"]["finish_reason"]["type"] == "length" and len(out["output_ids"]) == 400
    assert out["meta_info"]["weight_version"] == before


def test_abort_all_requests_aborts_in_flight_work(engine_server, engine_client, tiny_model_path):
    box = {}
    gen = threading.Thread(target=lambda: box.update(out=engine_server.client().generate(
        [3, 4, 5], {"max_new_tokens": 3000, "ignore_eos": True})))
    gen.start()
    while engine_client.server_info()["internal_states"][0]["running"] == 0:
        time.sleep(0.02)
    payload, bucket = W.serialize_bucket(perturbed(tiny_model_path, 5).items())
    assert engine_client.update_weights_from_tensor(payload, load_format="flattened_bucket",
                                                    abort_all_requests=True)["success"]
    gen.join(30)
    assert box["out"]["meta_info"]["finish_reason"]["type"] == "abort"


def test_pause_update_continue_like_slime(engine_server, engine_client, tiny_model_path):
    box = {}
    gen = threading.Thread(target=lambda: box.update(out=engine_server.client().generate(
        [3, 4, 5], {"max_new_tokens": 800, "ignore_eos": True})))
    gen.start()
    while engine_client.server_info()["internal_states"][0]["running"] == 0:
        time.sleep(0.02)
    engine_client.pause("retract")
    payload, bucket = W.serialize_bucket(perturbed(tiny_model_path, 6).items())
    assert engine_client.update_weights_from_tensor(payload, load_format="flattened_bucket",
                                                    weight_version="slime-1")["success"]  # no drain while paused
    assert "out" not in box
    engine_client.resume()
    gen.join(60)
    assert len(box["out"]["output_ids"]) == 800 and box["out"]["meta_info"]["weight_version"] == "slime-1"
    assert box["out"]["meta_info"]["oldest_weight_version"] != "slime-1"  # its first tokens: the old weights


def test_a_sync_pauses_in_place_instead_of_waiting_for_a_drain(engine_server, engine_client, tiny_model_path):
    """A sync while a long request runs (train's async mode) neither waits for it nor aborts it; the
    request then reports the weights its first tokens came from, so staleness is not understated."""
    from nano_miles.trainer.weight_sync import WeightSync

    before = version(engine_client)
    box = {}
    gen = threading.Thread(target=lambda: box.update(out=engine_server.client().generate(
        [3, 4, 5], {"max_new_tokens": 3000, "ignore_eos": True})))
    gen.start()
    while engine_client.server_info()["internal_states"][0]["running"] == 0:
        time.sleep(0.02)
    with WeightSync(list(perturbed(tiny_model_path, 8).items()), engine_server.url, transport="ipc") as sync:
        sync.sync("async-1")
    assert "out" not in box, "the sync waited for the running request to finish"
    assert version(engine_client) == "async-1"
    gen.join(120)
    meta = box["out"]["meta_info"]
    assert len(box["out"]["output_ids"]) == 3000 and meta["finish_reason"]["type"] == "length"
    assert meta["weight_version"] == "async-1" and meta["oldest_weight_version"] == before


def test_checksum_route_matches_the_trainer_side_function(engine_client, tiny_model_path):
    state = folder_state(tiny_model_path)
    r = engine_client.weights_checksum(["model.norm.weight", "model.embed_tokens.weight"])
    assert r["algorithm"] == "sha256" and r["dtype"] == "float32"
    assert r["checksums"] == W.checksums(state.items(), ["model.norm.weight", "model.embed_tokens.weight"])
    with pytest.raises(EngineRequestError, match="unknown parameter"):
        engine_client.weights_checksum(["nope"])


def pickled_globals(raw: bytes) -> set:
    """(module, name) of every global the pickle loads (recorded while loading our own payload)."""
    import io

    found = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            found.add((module, name))
            if module == "sglang.srt.weight_sync.tensor_bucket":
                return W.FlattenedTensorMetadata
            return super().find_class(module, name)

    Recorder(io.BytesIO(raw)).load()
    return found


def test_metadata_pickles_under_sglangs_module_path():
    payload, _ = W.serialize_bucket([("w", torch.ones(2, 3)), ("b", torch.ones(3, dtype=torch.bfloat16))])
    found = pickled_globals(base64.b64decode(payload))
    assert ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata") in found
    # Only modules a real SGLang server's allowlist admits (torch.*, builtins, its tensor_bucket).
    assert all(m.split(".")[0] in ("torch", "builtins") or m == "sglang.srt.weight_sync.tensor_bucket"
               for m, _ in found), found
    assert "sglang" not in __import__("sys").modules  # the alias lived only during the dump
    assert W.decode_bucket([payload]).reconstruct_tensors()[0][1].tolist() == [[1.0] * 3] * 2


def test_bucket_by_bytes_keeps_order_and_limit():
    named = [(f"t{i}", torch.zeros(i + 1, dtype=torch.float32)) for i in range(6)]  # 4..24 bytes
    buckets = list(W.bucket_by_bytes(named, 24))
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    assert all(sum(t.numel() * 4 for _, t in b) <= 24 for b in buckets)
    assert [len(b) for b in buckets] == [3, 1, 1, 1]


CUDA_TRAINER = """
import sys, torch
from nano_miles.engine.client import EngineClient
from nano_miles.engine import weight_group as G
from nano_miles.engine import weights as W
from safetensors.torch import load_file
client = EngineClient(sys.argv[1])
state = {n: (t + 0.05).to("cuda:0", torch.bfloat16) for n, t in load_file(sys.argv[2]).items()}
payload, bucket = W.serialize_bucket(state.items())
print(client.update_weights_from_tensor(payload, load_format="flattened_bucket", weight_version="ipc-1")["message"])
sums = client.weights_checksum()["checksums"]
assert sums == W.checksums((n, t) for n, t in state.items() if n in sums), "checksum mismatch"
del bucket; torch.cuda.ipc_collect()
print("OK")
"""


@pytest.mark.gpu
def test_cuda_ipc_bucket_from_another_process_on_the_same_gpu(tiny_model_path):
    """GPU only: a trainer process shares a bf16 bucket on cuda:0 with a bf16 engine on cuda:0."""
    import subprocess
    import sys

    from nano_miles.engine.process import start_engine_process

    with start_engine_process(str(tiny_model_path), device="cuda:0", dtype="bfloat16",
                              extra_args=("--num-kv-blocks", "256")) as engine:
        out = subprocess.run([sys.executable, "-c", CUDA_TRAINER, engine.url,
                              str(next(tiny_model_path.glob("*.safetensors")))],
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": os.getcwd(), API_KEY_ENV: engine.api_key})
        assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr + engine.log()


def test_verl_style_local_serialized_tensors_are_unwrapped():
    """verl wraps each tensor as sglang's LocalSerializedTensor(values=[serialized per TP rank])."""
    import dataclasses
    import io
    import sys
    import types
    from multiprocessing.reduction import ForkingPickler

    @dataclasses.dataclass
    class LocalSerializedTensor:
        values: list

    LocalSerializedTensor.__module__ = "sglang.srt.model_executor.model_runner"
    LocalSerializedTensor.__qualname__ = "LocalSerializedTensor"
    names = ["sglang", "sglang.srt", "sglang.srt.model_executor", "sglang.srt.model_executor.model_runner"]
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    sys.modules[names[-1]].LocalSerializedTensor = LocalSerializedTensor
    try:
        inner = base64.b64decode(W.serialize(torch.full((2, 2), 3.0)))
        buf = io.BytesIO()
        ForkingPickler(buf).dump([("w", LocalSerializedTensor(values=[inner]))])
    finally:
        for n in names:
            del sys.modules[n]
    [(name, tensor)] = W.decode_tensor_payload([base64.b64encode(buf.getvalue()).decode()], None)
    assert name == "w" and tensor.tolist() == [[3.0, 3.0], [3.0, 3.0]]


def test_multi_bucket_sync_moves_the_version_once(engine_client, tiny_model_path):
    """Buckets sent with flush_cache=false and no version are parts of one sync; the last names it."""
    state = perturbed(tiny_model_path, 8)
    before = version(engine_client)
    buckets = list(W.bucket_by_bytes(state.items(), 64 * 1024))
    assert len(buckets) > 2
    for i, bucket in enumerate(buckets):
        last = i == len(buckets) - 1
        payload, keep = W.serialize_bucket(bucket)
        engine_client.update_weights_from_tensor(payload, load_format="flattened_bucket", flush_cache=last,
                                                 weight_version="multi-1" if last else None)
        assert version(engine_client) == ("multi-1" if last else before)
    assert_serving(engine_client, tiny_model_path, state)


def engine_order(folder, state) -> list:
    """state's tensors in the engine's (HF named_parameters) order: the layout of its packed weights."""
    from nano_miles.engine.model import CausalLM, ModelConfig

    return [(n, state[n]) for n, _ in CausalLM(ModelConfig.from_pretrained(str(folder))).named_parameters()]


def test_a_bucket_in_the_engines_order_is_applied_with_one_copy(engine_client, tiny_model_path):
    warm_prefix(engine_client)
    state = perturbed(tiny_model_path, 21)
    payload, bucket = W.serialize_bucket(engine_order(tiny_model_path, state))
    r = engine_client.update_weights_from_tensor(payload, load_format="flattened_bucket", weight_version="flat-1")
    del bucket
    assert r["success"] and r["fast_path"] is True and "with one copy" in r["message"]
    assert set(r["timings_ms"]) == {"parse", "decode", "wait", "copy", "release", "answer", "total"}
    assert version(engine_client) == "flat-1"
    assert_serving(engine_client, tiny_model_path, state)


def test_a_bucket_in_another_order_takes_the_per_tensor_path(engine_client, tiny_model_path):
    state = perturbed(tiny_model_path, 22)
    named = engine_order(tiny_model_path, state)
    payload, bucket = W.serialize_bucket(named[1:] + named[:1] + [("lm_head.weight", state["model.embed_tokens.weight"])])
    r = engine_client.update_weights_from_tensor(payload, load_format="flattened_bucket", weight_version="slow-1")
    assert r["success"] and r["fast_path"] is False
    assert_serving(engine_client, tiny_model_path, state)


def test_an_ordered_bucket_with_one_bad_tensor_changes_nothing(engine_client, tiny_model_path):
    before_version, before = version(engine_client), served_checksums(engine_client)
    named = engine_order(tiny_model_path, perturbed(tiny_model_path, 23))
    for bad in (named + [("model.no_such.weight", torch.ones(4))],                       # an extra name
                named[:-1] + [(named[-1][0], torch.ones(65))]):                          # a wrong shape
        payload, bucket = W.serialize_bucket(bad)
        with pytest.raises(EngineRequestError, match="HTTP 400"):
            engine_client.update_weights_from_tensor(payload, load_format="flattened_bucket")
    assert version(engine_client) == before_version and served_checksums(engine_client) == before


def test_gloo_broadcasts_land_in_one_persistent_buffer_and_one_copy(engine_client, tiny_model_path):
    group, port = "flat-group", free_port()
    with ThreadPoolExecutor(2) as pool:
        joined = pool.submit(engine_client.init_weights_update_group, "127.0.0.1", port, 1, 2, group, "gloo")
        pg = G.init_weight_update_group("127.0.0.1", port, 0, 2, group, "gloo", timeout_s=30)
        assert joined.result()["success"] is True
        send = torch.empty(1 << 20, dtype=torch.uint8)  # the trainer's persistent send buffer
        try:
            for step, reorder in ((1, False), (2, False), (3, True)):
                state = perturbed(tiny_model_path, 30 + step)
                named = engine_order(tiny_model_path, state)
                if reorder:  # not the engine's layout: received all the same, then the per-tensor path
                    named = named[::-1]
                done = pool.submit(engine_client.update_weights_from_distributed, [n for n, _ in named],
                                   [t.dtype for _, t in named], [t.shape for _, t in named], group,
                                   "flattened_bucket", f"flat-gloo-{step}")
                G.broadcast_weights(pg, named, "flattened_bucket", timeout_s=30, out=send)
                r = done.result()
                assert r["success"] is True and r["fast_path"] is (not reorder)
                assert set(r["timings_ms"]) == {"parse", "receive", "wait", "copy", "release", "answer", "total"}
                assert_serving(engine_client, tiny_model_path, state)
        finally:
            assert engine_client.destroy_weights_update_group(group)["success"] is True
            G.destroy_weight_update_group(pg)


def test_a_bucket_flattened_into_a_persistent_buffer_equals_a_fresh_one():
    named = [("a", torch.arange(6.0).view(2, 3)), ("b", torch.ones(3, dtype=torch.bfloat16)), ("c", torch.zeros(1))]
    fresh = W.FlattenedTensorBucket(named_tensors=named)
    out = torch.full((64,), 7, dtype=torch.uint8)
    reused = W.FlattenedTensorBucket(named_tensors=named, out=out)
    assert torch.equal(reused.flattened_tensor, fresh.flattened_tensor)
    assert reused.flattened_tensor.data_ptr() == out.data_ptr() and reused.metadata == fresh.metadata
    assert out[fresh.flattened_tensor.numel():].eq(7).all()  # the rest of the buffer is untouched
    with pytest.raises(ValueError, match="at least 34 bytes"):
        W.FlattenedTensorBucket(named_tensors=named, out=torch.empty(33, dtype=torch.uint8))
    assert W.bucket_metadata(["a", "b", "c"], ["float32", "bfloat16", "float32"], [[2, 3], [3], [1]]) == fresh.metadata
