"""Weight-update payloads, both ends: what the trainer sends and what the engine server decodes.

Three transports, all in SGLang's wire format so a real SGLang server accepts our trainer's
payloads and our server accepts SGLang-style producers (slime, verl):

- tensor (/update_weights_from_tensor): named tensors flattened into one uint8 "bucket" plus
  per-tensor metadata, pickled with ForkingPickler and base64-encoded. The tensor data itself does
  not travel in the pickle: CPU tensors are shared through /dev/shm (the "file_system" sharing
  strategy, which works between unrelated processes), CUDA tensors as CUDA IPC handles whose device
  is written as the GPU's UUID (as SGLang does) so that a receiver with another CUDA_VISIBLE_DEVICES
  still finds the right GPU. The receiver unpickles with an allowlist, never arbitrary classes.
- distributed (/update_weights_from_distributed): a separate torch.distributed process group
  (trainer rank 0, engine rank_offset); one broadcast per flattened bucket (weight_group.py).
- disk (/update_weights_from_disk): a folder of safetensors files.

The per-tensor checksum and the finiteness check (non_finite: the engine refuses a NaN or an infinity
on every route, the trainer refuses to send one) are defined here once, for both ends.
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import hashlib
import io
import pickle
import sys
import threading
import types
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Iterable, Iterator

import torch
import torch.multiprocessing  # registers torch's ForkingPickler reductions
from torch.multiprocessing import reductions

from nano_miles.dtypes import DTYPES

SGLANG_BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"
# SGLang's index of the device argument in torch's rebuild_cuda_tensor(...) arguments.
_CUDA_DEVICE_ARG = 6


class WeightPayloadError(ValueError):
    """A weight-update payload that cannot be decoded or does not fit the model."""


# ----------------------------------------------------------------------------- the bucket


@dataclasses.dataclass
class FlattenedTensorMetadata:
    """One tensor inside a flattened bucket: bytes [start_idx, end_idx) of the uint8 buffer."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int  # bytes, i.e. elements of the uint8 view (SGLang's convention)


# Pickled under SGLang's module path, so a real SGLang server's allowlist accepts our payloads.
FlattenedTensorMetadata.__module__ = SGLANG_BUCKET_MODULE


class FlattenedTensorBucket:
    """Tensors of any dtypes concatenated as one uint8 tensor, plus the metadata to cut them out."""

    def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None, out: torch.Tensor | None = None):
        """named_tensors: build the bucket (a fresh buffer, or into `out`, a 1-D uint8 tensor of at
        least the bucket's size, e.g. a persistent send buffer). Or wrap a received flattened_tensor
        and its metadata."""
        if named_tensors is not None:
            named_tensors = list(named_tensors)
            if not named_tensors:
                raise ValueError("cannot create an empty tensor bucket")
            tensors = [t.detach() if t.requires_grad else t for _, t in named_tensors]
            self.metadata, offset = [], 0
            for (name, _), t in zip(named_tensors, tensors):
                nbytes = t.numel() * t.element_size()
                self.metadata.append(FlattenedTensorMetadata(name, t.shape, t.dtype, offset, offset + nbytes, nbytes))
                offset += nbytes
            if out is None and len(tensors) > 1 and len({t.dtype for t in tensors}) == 1:
                # One C++ call flattens and concatenates (a model's ~300 tensors: no Python loop of
                # views); with a single tensor it would return a view, not a fresh buffer.
                self.flattened_tensor = torch._utils._flatten_dense_tensors(tensors).view(torch.uint8)
                return
            parts = [t.reshape(-1).view(torch.uint8) for t in tensors]  # reshape copies only if not contiguous
            if out is None:
                self.flattened_tensor = torch.cat(parts)
            else:
                if out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < offset:
                    raise ValueError(f"out must be a 1-D uint8 tensor of at least {offset} bytes")
                self.flattened_tensor = torch.cat(parts, out=out[:offset])
        else:
            if flattened_tensor is None or metadata is None:
                raise ValueError("give named_tensors, or both flattened_tensor and metadata")
            self.flattened_tensor, self.metadata = flattened_tensor, list(metadata)

    def reconstruct_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) views into the buffer, after checking every metadata entry fits it."""
        buf = self.flattened_tensor
        if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
            raise WeightPayloadError("flattened_tensor must be a 1-D uint8 tensor")
        out = []
        for meta in self.metadata:
            if not isinstance(meta, FlattenedTensorMetadata):
                raise WeightPayloadError(f"bad metadata entry of type {type(meta).__name__}")
            if not isinstance(meta.dtype, torch.dtype):
                raise WeightPayloadError(f"{meta.name}: dtype {meta.dtype!r} is not a torch.dtype")
            shape = torch.Size(meta.shape)
            nbytes = shape.numel() * meta.dtype.itemsize
            if not (0 <= meta.start_idx <= meta.end_idx <= buf.numel()) or meta.end_idx - meta.start_idx != nbytes:
                raise WeightPayloadError(
                    f"{meta.name}: bytes [{meta.start_idx}, {meta.end_idx}) do not hold shape {list(shape)} "
                    f"of {meta.dtype} inside a buffer of {buf.numel()} bytes"
                )
            raw = buf[meta.start_idx : meta.end_idx]
            if meta.start_idx % meta.dtype.itemsize:  # a view needs aligned bytes; copy the odd one out
                raw = raw.clone()
            out.append((meta.name, raw.view(meta.dtype).reshape(shape)))
        return out


def bucket_by_bytes(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list]:
    """Split (name, tensor) pairs, in order, into lists of at most `bucket_bytes` (a larger tensor alone)."""
    bucket, size = [], 0
    for name, tensor in named_tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


# ----------------------------------------------------------------------------- producer side

_alias_lock = threading.Lock()


@contextlib.contextmanager
def _sglang_module_alias():
    """Make SGLang's module path resolve to our metadata class while pickling.

    pickle writes a class as module + name and checks that importing the module gives back the same
    class (importing a dotted name also imports its parents). When SGLang itself is not loaded, the
    modules exist only for the duration of the dump, so a later real `import sglang` is not shadowed.
    """
    with _alias_lock:
        if SGLANG_BUCKET_MODULE in sys.modules:
            yield
            return
        parts = SGLANG_BUCKET_MODULE.split(".")
        added = [".".join(parts[: i + 1]) for i in range(len(parts)) if ".".join(parts[: i + 1]) not in sys.modules]
        for name in added:
            sys.modules[name] = types.ModuleType(name)
        sys.modules[SGLANG_BUCKET_MODULE].FlattenedTensorMetadata = FlattenedTensorMetadata
        try:
            yield
        finally:
            for name in added:
                sys.modules.pop(name, None)


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


class _PayloadPickler(ForkingPickler):
    def reducer_override(self, obj):
        if type(obj) is FlattenedTensorMetadata:
            cls = getattr(sys.modules.get(SGLANG_BUCKET_MODULE), "FlattenedTensorMetadata", FlattenedTensorMetadata)
            return cls, (obj.name, obj.shape, obj.dtype, obj.start_idx, obj.end_idx, obj.numel)
        if isinstance(obj, torch.Tensor) and obj.is_cuda:
            # torch's CUDA IPC reduction, with the device index replaced by the GPU's UUID (SGLang does
            # the same): the index means another GPU in a process with different CUDA_VISIBLE_DEVICES.
            rebuild, args = reductions.reduce_tensor(obj.detach())
            args = list(args)
            args[_CUDA_DEVICE_ARG] = _device_uuid(args[_CUDA_DEVICE_ARG])
            return rebuild, tuple(args)
        return NotImplemented


def serialize(obj) -> str:
    """ForkingPickler + base64, like SGLang's MultiprocessingSerializer.serialize(obj, output_str=True).

    CPU tensors are moved to shared memory with the file_system strategy; the caller must keep them
    alive until the engine has answered.
    """
    old = torch.multiprocessing.get_sharing_strategy()
    buf = io.BytesIO()
    with _sglang_module_alias():
        torch.multiprocessing.set_sharing_strategy("file_system")
        try:
            _PayloadPickler(buf).dump(obj)
        finally:
            torch.multiprocessing.set_sharing_strategy(old)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_bucket(bucket, device: torch.device | None = None) -> tuple[str, FlattenedTensorBucket]:
    """One "flattened_bucket" payload entry: `bucket` (a FlattenedTensorBucket, or (name, tensor)
    pairs to flatten), its buffer first copied to `device` if given (the staged transport). Returns
    the payload and the bucket whose memory it shares: keep that alive until the engine answered."""
    if not isinstance(bucket, FlattenedTensorBucket):
        bucket = FlattenedTensorBucket(named_tensors=bucket)
    if device is not None and bucket.flattened_tensor.device != device:
        bucket = FlattenedTensorBucket(flattened_tensor=bucket.flattened_tensor.to(device), metadata=bucket.metadata)
    return serialize({"flattened_tensor": bucket.flattened_tensor, "metadata": bucket.metadata}), bucket


# ----------------------------------------------------------------------------- consumer side


def _device_index_from_uuid(device) -> int:
    if isinstance(device, int):
        return device
    if not torch.cuda.is_available():
        raise WeightPayloadError(
            "the payload carries CUDA IPC handles but this engine has no CUDA device; "
            "use the distributed or disk transport"
        )
    for index in range(torch.cuda.device_count()):
        if _device_uuid(index) == device:
            return index
    raise WeightPayloadError(
        f"the trainer's GPU {device} is not visible to this engine (CUDA_VISIBLE_DEVICES); "
        "CUDA IPC needs the trainer's GPU in the engine process: use the distributed or disk transport"
    )


def _rebuild_cuda_tensor(*args):
    args = list(args)
    args[_CUDA_DEVICE_ARG] = _device_index_from_uuid(args[_CUDA_DEVICE_ARG])
    original = getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
    return original(*args)


def _torch_dtype_global(name: str):
    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None


@dataclasses.dataclass
class LocalSerializedTensor:
    """SGLang's per-TP-rank wrapper (verl sends it in "direct" payloads): values[rank] is itself a
    serialized tensor. Unpickled in place of sglang.srt.model_executor.model_runner's class."""

    values: list


# Not torch's file_descriptor sharing (rebuild_storage_fd, multiprocessing's DupFd): its receiver fetches
# the fd by connecting to an address the payload names, with its own multiprocessing authkey, so a
# payload could make the engine connect anywhere, and no other process's fd ever arrives that way.
_FD_SHARING = {("torch.multiprocessing.reductions", "rebuild_storage_fd"), ("multiprocessing.resource_sharer", "DupFd")}
_ALLOWED = {
    ("builtins", n): None
    for n in ("list", "tuple", "dict", "set", "frozenset", "int", "float", "str", "bytes", "bool")
}
_ALLOWED.update(
    {
        ("collections", "OrderedDict"): None,
        ("torch", "Size"): torch.Size,
        ("torch", "Tensor"): torch.Tensor,
        ("torch._tensor", "Tensor"): torch.Tensor,
        ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
        ("torch", "UntypedStorage"): torch.UntypedStorage,
        ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
        ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
        ("torch.multiprocessing.reductions", "rebuild_tensor"): reductions.rebuild_tensor,
        ("torch.multiprocessing.reductions", "rebuild_typed_storage"): reductions.rebuild_typed_storage,
        ("torch.multiprocessing.reductions", "rebuild_typed_storage_child"): reductions.rebuild_typed_storage_child,
        ("torch.multiprocessing.reductions", "rebuild_storage_filename"): reductions.rebuild_storage_filename,
        ("torch.multiprocessing.reductions", "rebuild_storage_empty"): reductions.rebuild_storage_empty,
        ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
        (SGLANG_BUCKET_MODULE, "FlattenedTensorMetadata"): FlattenedTensorMetadata,
        ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): LocalSerializedTensor,
    }
)


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the globals a weight payload needs; everything else is refused."""

    def find_class(self, module: str, name: str):
        key = (module, name)
        if key in _ALLOWED:
            return _ALLOWED[key] if _ALLOWED[key] is not None else super().find_class(module, name)
        if module == "torch" and _torch_dtype_global(name) is not None:
            return _torch_dtype_global(name)
        # SGLang's (or a slime copy's) UUID-aware CUDA rebuild: always resolved to OUR version.
        if name == "_rebuild_cuda_tensor_modified" and module.split(".")[0] in ("sglang", "slime"):
            return _rebuild_cuda_tensor
        if key in _FD_SHARING:
            raise WeightPayloadError(f"refusing to unpickle {module}.{name}: CPU tensors shared by file descriptor "
                                     "are not taken; share them with torch.multiprocessing's file_system strategy")
        raise WeightPayloadError(f"refusing to unpickle {module}.{name}: not allowed in a weight payload")


def deserialize(data: str | bytes):
    """The inverse of serialize(), through the allowlist."""
    if isinstance(data, str):
        try:
            data = base64.b64decode(data, validate=True)
        except (binascii.Error, ValueError) as e:
            raise WeightPayloadError(f"payload is not valid base64: {e}") from None
    try:
        return _RestrictedUnpickler(io.BytesIO(data)).load()
    except WeightPayloadError:
        raise
    except Exception as e:  # truncated pickle, a shared-memory file gone, a dead producer...
        raise WeightPayloadError(f"cannot decode the payload: {type(e).__name__}: {e}") from None


def _payload_entry(serialized_named_tensors):
    if not isinstance(serialized_named_tensors, list) or not serialized_named_tensors:
        raise WeightPayloadError("serialized_named_tensors must be a non-empty list (one entry per TP rank)")
    entry = serialized_named_tensors[0]
    if not isinstance(entry, str):
        raise WeightPayloadError("serialized_named_tensors[0] must be a base64 string")
    return deserialize(entry)


def decode_bucket(serialized_named_tensors) -> FlattenedTensorBucket:
    """A "flattened_bucket" payload -> the bucket, not yet cut into tensors (the engine may apply
    it whole, see flat_params.py). CUDA IPC memory is opened here."""
    obj = _payload_entry(serialized_named_tensors)
    if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"}:
        raise WeightPayloadError('a flattened_bucket payload must be {"flattened_tensor", "metadata"}')
    if not isinstance(obj["metadata"], list):
        raise WeightPayloadError("metadata must be a list")
    buf = obj["flattened_tensor"]
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
        raise WeightPayloadError("flattened_tensor must be a 1-D uint8 tensor")
    return FlattenedTensorBucket(flattened_tensor=buf, metadata=obj["metadata"])


def decode_tensor_payload(serialized_named_tensors, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """/update_weights_from_tensor's payload -> (name, tensor) list. One entry per TP rank; we are rank 0."""
    if load_format == "flattened_bucket":
        return decode_bucket(serialized_named_tensors).reconstruct_tensors()
    obj = _payload_entry(serialized_named_tensors)
    if load_format in (None, "direct"):
        if not isinstance(obj, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str)
            and isinstance(p[1], (torch.Tensor, LocalSerializedTensor)) for p in obj
        ):
            raise WeightPayloadError("a direct payload must be a list of (name, tensor) pairs")
        return [(name, _unwrap(name, tensor)) for name, tensor in obj]
    raise WeightPayloadError(f"unknown load_format {load_format!r}: use null, 'direct' or 'flattened_bucket'")


def _unwrap(name: str, tensor) -> torch.Tensor:
    if isinstance(tensor, torch.Tensor):
        return tensor
    if not isinstance(getattr(tensor, "values", None), list) or not tensor.values:
        raise WeightPayloadError(f"{name}: LocalSerializedTensor without values")
    inner = deserialize(tensor.values[0])  # this engine is TP rank 0
    if not isinstance(inner, torch.Tensor):
        raise WeightPayloadError(f"{name}: LocalSerializedTensor.values[0] is not a tensor")
    return inner


def load_safetensors_folder(path: str | Path) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of every *.safetensors file in a folder (an HF checkpoint)."""
    from safetensors.torch import load_file

    folder = Path(path)
    if not folder.is_dir():
        raise WeightPayloadError(f"model_path {str(path)!r} is not a directory")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise WeightPayloadError(f"no *.safetensors files in {folder}")
    out = []
    for f in files:
        try:
            out.extend(load_file(str(f)).items())
        except Exception as e:
            raise WeightPayloadError(f"cannot read {f.name}: {type(e).__name__}: {e}") from None
    return out


def parse_dtype(name) -> torch.dtype:
    """A payload's dtype: 'bfloat16' or 'torch.bfloat16' -> torch.bfloat16 (nano_miles.dtypes' table)."""
    if isinstance(name, torch.dtype):
        return name
    dtype = DTYPES.get(name.removeprefix("torch.")) if isinstance(name, str) else None
    if dtype is None:
        raise WeightPayloadError(f"unknown dtype {name!r}; one of {list(DTYPES)}")
    return dtype


def check_against(named_tensors, expected: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """Raise WeightPayloadError unless every (name, tensor) names a parameter with its shape and dtype."""
    if not named_tensors:
        raise WeightPayloadError("the update holds no tensors")
    seen = set()
    for name, tensor in named_tensors:
        if name not in expected:
            raise WeightPayloadError(f"unknown parameter name {name!r}")
        if name in seen:
            raise WeightPayloadError(f"parameter {name!r} appears twice in one update")
        seen.add(name)
        shape, dtype = expected[name]
        if tuple(tensor.shape) != tuple(shape):
            raise WeightPayloadError(f"{name}: shape {list(tensor.shape)} != the model's {list(shape)}")
        if tensor.dtype != dtype:
            raise WeightPayloadError(f"{name}: dtype {tensor.dtype} != the model's {dtype}")


class NonFiniteWeights(RuntimeError):
    """A trainer's weights hold a NaN or an infinity: a training failure, never something to send."""


def non_finite(named_tensors) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity, else None.

    Per tensor one min/max reduction on its own device (a NaN propagates through both, an infinity
    is the min or the max), all read back with ONE host sync: no copy of the weights and no mask as
    large as them (isfinite(t).all() allocates one; the max-abs norm has a slow CPU kernel)."""
    named = [(n, t.detach()) for n, t in named_tensors if t.is_floating_point() and t.numel()]
    if not named:
        return None
    device = named[0][1].device
    extremes = [x.float().to(device) for _, t in named for x in torch.aminmax(t)]
    finite = torch.isfinite(torch.stack(extremes)).view(-1, 2).all(dim=1).tolist()
    return next((n for (n, _), ok in zip(named, finite) if not ok), None)


def check_finite(named_tensors) -> None:
    """Raise WeightPayloadError naming the first tensor that holds a NaN or an infinity."""
    name = non_finite(named_tensors)
    if name is not None:
        raise WeightPayloadError(f"{name} holds NaN or infinite values")


# ----------------------------------------------------------------------------- checksums


def tensor_checksum(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> str:
    """sha256 of the tensor's raw bytes (after casting to `dtype`, e.g. the engine's), row-major."""
    t = tensor.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    raw = t.contiguous().flatten().view(torch.uint8).cpu().numpy().tobytes()
    return hashlib.sha256(raw).hexdigest()


def checksums(named_tensors, names=None, dtype: torch.dtype | None = None) -> dict[str, str]:
    """{name: tensor_checksum} for the given (name, tensor) pairs, optionally only `names`."""
    wanted = None if names is None else set(names)
    return {n: tensor_checksum(t, dtype) for n, t in named_tensors if wanted is None or n in wanted}
