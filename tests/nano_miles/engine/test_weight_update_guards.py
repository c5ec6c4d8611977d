"""Bad weight updates: every malformed, mismatched or hostile payload on each route is a 400 that
leaves the served weights and weight_version as they were (and runs nothing: an evil pickle)."""
import base64
import os
import pickle
import socket
import threading
from multiprocessing import resource_sharer

import pytest
import torch
from safetensors.torch import save_file
from torch.multiprocessing import reductions

from nano_miles.client import EngineRequestError
from nano_miles.engine import weights as W
from tests.nano_miles.engine.test_weight_updates import direct, folder_state, free_port, served_checksums, version

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
    connections = []
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(tmp_path / "l"))
        listener.listen()

        def accept():  # records who connects, and hangs up at once
            try:
                conn, _ = listener.accept()
                connections.append(conn)
                conn.close()
            except OSError:  # the listener closed: nobody came
                pass

        watcher = threading.Thread(target=accept, daemon=True)
        watcher.start()
        before_version, before = version(engine_client), served_checksums(engine_client)
        with pytest.raises(EngineRequestError, match="HTTP 400") as e:
            engine_client.update_weights_from_tensor([_b64([("model.norm.weight", SharedByFd(str(tmp_path / "l")))])])
        assert ("refusing to unpickle torch.multiprocessing.reductions.rebuild_storage_fd: CPU tensors shared by "
                "file descriptor are not taken; share them with torch.multiprocessing's file_system strategy"
                in str(e.value))
        assert version(engine_client) == before_version and served_checksums(engine_client) == before
    watcher.join(timeout=10)
    assert connections == []
