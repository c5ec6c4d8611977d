"""Bad weight updates: every malformed, mismatched, non-finite or hostile payload on each route is a 400 that
leaves the served weights and weight_version as they were (and runs nothing: an evil pickle)."""
import base64
import math
import os
import pickle
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import resource_sharer

import pytest
import torch
from safetensors.torch import save_file
from torch.multiprocessing import reductions

from nano_miles.engine import weight_group as G
from nano_miles.engine.client import EngineRequestError
from nano_miles.engine import weights as W
from tests.nano_miles.engine.test_weight_updates import (direct, engine_order, folder_state, free_port,
                                                       served_checksums, version)

pytestmark = pytest.mark.usefixtures("restore_engine_weights")


class Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/nano-miles-pwned",))


def _b64(obj) -> str:
    return base64.b64encode(pickle.dumps(obj)).decode()


class CudaHandle:
    """Pickles like a CUDA tensor shared by a trainer on the GPU with this UUID (SGLang's format)."""

    def __reduce__(self):
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor, (torch.Tensor, (64,), (1,), 0, torch.storage.TypedStorage, torch.float32,
                                     "GPU-00000000-1111-2222-3333-444444444444", b"handle", 256, 0, False,
                                     b"", 0, b"", False)


def _bad_tensor_payloads():
    norm = torch.ones(64)
    good, bad = ("model.norm.weight", norm), ("model.norm.weight", torch.ones(63))
    return {
        "unknown name": ([direct([("model.no_such.weight", norm)])], None, "unknown parameter"),
        "wrong shape": ([direct([bad])], "direct", "shape"),
        "wrong dtype": ([direct([("model.norm.weight", norm.to(torch.bfloat16))])], None, "dtype"),
        "half good half bad": ([W.serialize_bucket([good, ("model.layers.0.mlp.up_proj.weight", norm)])[0]],
                               "flattened_bucket", "shape"),
        "not base64": (["!!!not base64!!!"], None, "base64"),
        "evil pickle": ([_b64(Evil())], None, "refusing to unpickle"),
        "CUDA IPC on a CPU engine": ([_b64([("model.norm.weight", CudaHandle())])], None, "no CUDA device"),
        "empty list": ([], None, "non-empty list"),
        "bucket as direct": ([W.serialize_bucket([good])[0]], None, "(name, tensor) pairs"),
        "direct as bucket": ([direct([good])], "flattened_bucket", "flattened_bucket payload"),
        "unknown load_format": ([direct([good])], "pickle", "load_format"),
    }


@pytest.mark.parametrize("case", list(_bad_tensor_payloads()))
def test_bad_tensor_payload_is_400_and_changes_nothing(engine_server, engine_client, case):
    payload, fmt, needle = _bad_tensor_payloads()[case]
    before_version, before = version(engine_client), served_checksums(engine_client)
    with pytest.raises(EngineRequestError, match="HTTP 400") as e:
        engine_client.update_weights_from_tensor(payload, load_format=fmt)
    assert needle in str(e.value) and e.value.body["success"] is False
    assert version(engine_client) == before_version and served_checksums(engine_client) == before
    assert not os.path.exists("/tmp/nano-miles-pwned")
    assert engine_client.generate([1, 2], {"max_new_tokens": 1})["output_ids"]


def test_bad_disk_and_distributed_requests_are_400(engine_client, tiny_model_path, tmp_path):
    before_version, before = version(engine_client), served_checksums(engine_client)
    with pytest.raises(EngineRequestError, match="not a directory"):
        engine_client.update_weights_from_disk(tmp_path / "missing")
    state = folder_state(tiny_model_path)
    state["model.norm.weight"] = torch.ones(65)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(EngineRequestError, match="shape"):
        engine_client.update_weights_from_disk(tmp_path)
    save_file({"model.norm.weight": torch.ones(64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(EngineRequestError, match="lacks"):
        engine_client.update_weights_from_disk(tmp_path)
    with pytest.raises(EngineRequestError, match="no weight update group"):
        engine_client.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]], "nope")
    with pytest.raises(EngineRequestError, match="nccl needs a CUDA engine"):
        engine_client.init_weights_update_group("127.0.0.1", free_port(), 1, 2, "g", backend="nccl")
    with pytest.raises(EngineRequestError, match="rank_offset"):
        engine_client.init_weights_update_group("127.0.0.1", free_port(), 0, 2, "g")
    assert version(engine_client) == before_version and served_checksums(engine_client) == before


POISONED = "model.layers.0.mlp.up_proj.weight"  # a tensor in the middle of the engine's packed layout


def poisoned_state(folder, value: float) -> dict:
    """The tiny model's weights, finite but for ONE element of POISONED."""
    state = {n: t.clone() for n, t in folder_state(folder).items()}
    state[POISONED][3, 5] = value
    return state


def _send_tensor_route(client, folder, state, how):
    if how == "direct":
        return client.update_weights_from_tensor(direct(state.items()), load_format="direct")
    named = engine_order(folder, state)
    if how == "per-tensor bucket":  # another order than the engine's: validated tensor by tensor
        named = named[::-1]
    payload, bucket = W.serialize_bucket(named)  # "one-copy bucket": the engine's own layout
    return client.update_weights_from_tensor(payload, load_format="flattened_bucket", weight_version="poisoned")


def assert_unchanged(client, before_version, before):
    assert version(client) == before_version and served_checksums(client) == before
    out = client.generate([1, 2, 3], {"max_new_tokens": 4, "temperature": 0}, return_logprob=True)
    assert all(math.isfinite(lp) for lp, _, _ in out["meta_info"]["output_token_logprobs"])


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("how", ["disk", "direct", "one-copy bucket", "per-tensor bucket"])
def test_non_finite_weights_are_refused_on_the_tensor_and_disk_routes(engine_client, tiny_model_path, tmp_path,
                                                                      how, value):
    before_version, before = version(engine_client), served_checksums(engine_client)
    state = poisoned_state(tiny_model_path, value)
    with pytest.raises(EngineRequestError, match="HTTP 400") as e:
        if how == "disk":
            save_file(state, str(tmp_path / "model.safetensors"))
            engine_client.update_weights_from_disk(tmp_path, weight_version="poisoned")
        else:
            _send_tensor_route(engine_client, tiny_model_path, state, how)
    assert f"{POISONED} holds NaN or infinite values" in str(e.value) and e.value.body["success"] is False
    assert_unchanged(engine_client, before_version, before)


def test_a_checkpoint_beyond_the_engines_dtype_is_refused(engine_client, tiny_model_path, tmp_path):
    """Disk checkpoints are cast to the engine's dtype: float64 values past float32's range become inf."""
    before_version, before = version(engine_client), served_checksums(engine_client)
    state = {n: t.double() for n, t in folder_state(tiny_model_path).items()}
    state[POISONED][0, 0] = 1e300
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(EngineRequestError, match=f"{POISONED} holds NaN or infinite values"):
        engine_client.update_weights_from_disk(tmp_path)
    assert_unchanged(engine_client, before_version, before)


@pytest.mark.parametrize("load_format", ["flattened_bucket", None])
def test_non_finite_weights_are_refused_on_the_distributed_route(engine_client, tiny_model_path, load_format):
    """The broadcast completes (the group stays in step and usable), the update is refused."""
    before_version, before = version(engine_client), served_checksums(engine_client)
    group, port = f"nan-group-{load_format}", free_port()
    with ThreadPoolExecutor(2) as pool:
        joined = pool.submit(engine_client.init_weights_update_group, "127.0.0.1", port, 1, 2, group, "gloo")
        pg = G.init_weight_update_group("127.0.0.1", port, 0, 2, group, "gloo", timeout_s=30)
        assert joined.result()["success"] is True
        try:
            for state in (poisoned_state(tiny_model_path, float("nan")), folder_state(tiny_model_path)):
                named = engine_order(tiny_model_path, state)
                done = pool.submit(engine_client.update_weights_from_distributed, [n for n, _ in named],
                                   [t.dtype for _, t in named], [t.shape for _, t in named], group,
                                   load_format, "gloo-after")
                G.broadcast_weights(pg, named, load_format, timeout_s=30)
                if torch.isnan(state[POISONED]).any():
                    with pytest.raises(EngineRequestError, match=f"{POISONED} holds NaN or infinite values"):
                        done.result()
                    assert_unchanged(engine_client, before_version, before)
                else:  # the same group takes the next (finite) update
                    assert done.result()["success"] is True and version(engine_client) == "gloo-after"
        finally:
            assert engine_client.destroy_weights_update_group(group)["success"] is True
            G.destroy_weight_update_group(pg)
class SharedByFd:
    """Pickles like a CPU tensor shared by torch's file_descriptor strategy (torch.multiprocessing's
    default on Linux): the receiver fetches the fd by connecting to the address the payload names."""

    def __init__(self, address: str):
        self.fd = resource_sharer.DupFd.__new__(resource_sharer.DupFd)
        self.fd._id = (address, 1)

    def __reduce__(self):
        return reductions.rebuild_storage_fd, (torch.UntypedStorage, self.fd, 256)


def test_a_payload_cannot_make_the_engine_connect_where_it_says(engine_client, tmp_path):
    """An fd shared by file descriptor is fetched from the sending process's address, which the payload
    names: the engine would connect wherever a payload said (and to no producer of ours: another process's
    fds never reach it that way). Refused before any connection."""
    connections, answered = [], threading.Event()
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(tmp_path / "l"))
        listener.listen()
        listener.settimeout(0.05)

        def accept():  # records who connects, and hangs up at once, until the engine has answered
            while not answered.is_set():
                try:
                    conn, _ = listener.accept()
                except OSError:  # nobody yet (a timeout is an OSError)
                    continue
                connections.append(conn)
                conn.close()

        watcher = threading.Thread(target=accept, daemon=True)
        watcher.start()
        before_version, before = version(engine_client), served_checksums(engine_client)
        with pytest.raises(EngineRequestError, match="HTTP 400") as e:
            engine_client.update_weights_from_tensor([_b64([("model.norm.weight", SharedByFd(str(tmp_path / "l")))])])
        assert ("refusing to unpickle torch.multiprocessing.reductions.rebuild_storage_fd: CPU tensors shared by "
                "file descriptor are not taken; share them with torch.multiprocessing's file_system strategy"
                in str(e.value))
        assert version(engine_client) == before_version and served_checksums(engine_client) == before
        answered.set()
        watcher.join()
    assert connections == []


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_names_the_first_bad_tensor_across_dtypes(bad):
    """The fused check (one multi-tensor kernel per dtype) still names the first bad tensor in the
    caller's order, whatever dtype group it sits in, and passes finite weights and integer buffers."""
    named = [("a", torch.ones(3, dtype=torch.bfloat16)), ("b", torch.ones(4)), ("ids", torch.arange(3)),
             ("c", torch.ones(2, 2, dtype=torch.bfloat16)), ("d", torch.ones(5)), ("empty", torch.ones(0))]
    assert W.non_finite(named) is None
    named[4][1][2] = bad
    assert W.non_finite(named) == "d"
    named[3][1][1, 0] = bad
    assert W.non_finite(named) == "c"  # before d in order, though in the other dtype group
    named[1][1][0] = bad
    assert W.non_finite(named) == "b"
