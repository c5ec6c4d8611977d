"""Weight-update payloads in SGLang's wire format, both ends, so a real SGLang server takes our
trainer's payloads and our server takes slime's and verl's.

/update_weights_from_tensor: named tensors flattened into one uint8 "bucket" plus per-tensor
metadata, pickled with ForkingPickler, base64-encoded. The data does not travel in the pickle: CPU
tensors are shared through /dev/shm ("file_system" strategy: works between unrelated processes), CUDA
tensors as CUDA IPC handles whose device is the GPU's UUID (as SGLang writes it), so a receiver with
other CUDA_VISIBLE_DEVICES finds the right GPU. The receiver unpickles through an allowlist, never
arbitrary classes. The finiteness check lives here once: the engine refuses a NaN or an infinity on
every route, the trainer never sends one.
"""
from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import hashlib
import io
import os
import pickle
import sys
import threading
import types
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch
import torch.multiprocessing  # registers torch's ForkingPickler reductions
from safetensors.torch import load_file
from torch.multiprocessing import reductions

from nano_miles.dtypes import DTYPES

SGLANG_BUCKET_MODULE = "sglang.srt.weight_sync.tensor_bucket"
_CUDA_DEVICE_ARG = 6  # the device's index in torch's rebuild_cuda_tensor(...) arguments


class WeightPayloadError(ValueError):
    """A weight-update payload that cannot be decoded or does not fit the model."""


class NonFiniteWeights(RuntimeError):
    """A trainer's weights hold a NaN or an infinity: a training failure, never something to send."""


@dataclasses.dataclass
class FlattenedTensorMetadata:
    """One tensor inside a flattened bucket: bytes [start_idx, end_idx) of the uint8 buffer."""
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int  # bytes, i.e. elements of the uint8 view (SGLang's convention)


FlattenedTensorMetadata.__module__ = SGLANG_BUCKET_MODULE  # pickled under SGLang's path: its allowlist takes it


def parse_dtype(name) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16."""
    if isinstance(name, torch.dtype):
        return name
    dtype = DTYPES.get(name.removeprefix("torch.")) if isinstance(name, str) else None
    if dtype is None:
        raise WeightPayloadError(f"unknown dtype {name!r}; one of {list(DTYPES)}")
    return dtype


def bucket_metadata(names, dtypes, shapes) -> list[FlattenedTensorMetadata]:
    """The metadata of the bucket that tensors of these names, dtypes and shapes flatten into, in order."""
    metadata, offset = [], 0
    for name, dtype, shape in zip(names, dtypes, shapes):
        dtype, shape = parse_dtype(dtype), torch.Size(shape)
        nbytes = shape.numel() * dtype.itemsize
        metadata.append(FlattenedTensorMetadata(name, shape, dtype, offset, offset + nbytes, nbytes))
        offset += nbytes
    return metadata


class FlattenedTensorBucket:
    """Tensors of any dtypes concatenated as one uint8 tensor, plus the metadata to cut them out."""

    def __init__(self, named_tensors=None, flattened_tensor=None, metadata=None, out: torch.Tensor | None = None):
        """Build it from named_tensors (into `out`, a 1-D uint8 tensor of at least its size, if given:
        a persistent send buffer), or wrap a received flattened_tensor and its metadata."""
        if named_tensors is None:
            self.flattened_tensor, self.metadata = flattened_tensor, list(metadata)
            return
        names, tensors = zip(*[(n, t.detach()) for n, t in named_tensors])
        self.metadata = bucket_metadata(names, [t.dtype for t in tensors], [t.shape for t in tensors])
        nbytes = self.metadata[-1].end_idx
        if out is not None and (out.dtype != torch.uint8 or out.dim() != 1 or out.numel() < nbytes):
            raise ValueError(f"out must be a 1-D uint8 tensor of at least {nbytes} bytes")
        parts = [t.reshape(-1).view(torch.uint8) for t in tensors]  # reshape copies only if not contiguous
        self.flattened_tensor = torch.cat(parts, out=None if out is None else out[:nbytes])

    def reconstruct_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) views into the buffer, after checking every metadata entry fits it."""
        buf, out = self.flattened_tensor, []
        for meta in self.metadata:
            if not isinstance(meta, FlattenedTensorMetadata) or not isinstance(meta.dtype, torch.dtype):
                raise WeightPayloadError(f"bad metadata entry {str(meta)[:100]}")
            shape = torch.Size(meta.shape)
            nbytes = shape.numel() * meta.dtype.itemsize
            if not (0 <= meta.start_idx <= meta.end_idx <= buf.numel()) or meta.end_idx - meta.start_idx != nbytes:
                raise WeightPayloadError(f"{meta.name}: bytes [{meta.start_idx}, {meta.end_idx}) do not hold shape "
                                         f"{list(shape)} of {meta.dtype} inside a buffer of {buf.numel()} bytes")
            raw = buf[meta.start_idx:meta.end_idx]
            if meta.start_idx % meta.dtype.itemsize:  # a view needs aligned bytes; copy the odd one out
                raw = raw.clone()
            out.append((meta.name, raw.view(meta.dtype).reshape(shape)))
        return out


def bucket_by_bytes(named_tensors, bucket_bytes: int):
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


_alias_lock = threading.Lock()


@contextlib.contextmanager
def _sglang_module_alias():
    """SGLang's module path resolving to ours while pickle dumps (it checks that importing a class's
    module + name gives the class), and only then, so a later `import sglang` is not shadowed."""
    with _alias_lock:
        parts = SGLANG_BUCKET_MODULE.split(".")
        added = [m for m in (".".join(parts[:i + 1]) for i in range(len(parts))) if m not in sys.modules]
        for name in added:
            sys.modules[name] = types.ModuleType(name)
        if added:
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
        if type(obj) is FlattenedTensorMetadata:  # as SGLang's class when SGLang itself is loaded
            cls = getattr(sys.modules.get(SGLANG_BUCKET_MODULE), "FlattenedTensorMetadata", FlattenedTensorMetadata)
            return cls, (obj.name, obj.shape, obj.dtype, obj.start_idx, obj.end_idx, obj.numel)
        if isinstance(obj, torch.Tensor) and obj.is_cuda:  # torch's CUDA IPC reduction, the device as its UUID
            rebuild, args = reductions.reduce_tensor(obj.detach())
            args = list(args)
            args[_CUDA_DEVICE_ARG] = _device_uuid(args[_CUDA_DEVICE_ARG])
            return rebuild, tuple(args)
        return NotImplemented


def serialize(obj) -> str:
    """ForkingPickler + base64, like SGLang's MultiprocessingSerializer.serialize(obj, output_str=True).
    CPU tensors move to shared memory: the caller keeps them alive until the engine has answered."""
    old, buf = torch.multiprocessing.get_sharing_strategy(), io.BytesIO()
    with _sglang_module_alias():
        torch.multiprocessing.set_sharing_strategy("file_system")
        try:
            _PayloadPickler(buf).dump(obj)
        finally:
            torch.multiprocessing.set_sharing_strategy(old)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def serialize_bucket(bucket) -> tuple[str, FlattenedTensorBucket]:
    """One "flattened_bucket" payload entry of `bucket`, (name, tensor) pairs, and the bucket whose
    memory it shares: keep that alive until the engine answered."""
    with plain_cuda_segments():
        bucket = FlattenedTensorBucket(named_tensors=bucket)
    return serialize({"flattened_tensor": bucket.flattened_tensor, "metadata": bucket.metadata}), bucket


@contextlib.contextmanager
def plain_cuda_segments():
    """CUDA allocations inside come from ordinary cudaMalloc segments even where the process runs with
    expandable segments (nano-miles sets them): an engine opens and closes a CUDA IPC handle of an
    expandable segment ~2 ms slower each (bench/weight_sync.py), on every bucket of every sync."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", os.environ.get("PYTORCH_ALLOC_CONF", ""))
    if not torch.cuda.is_available() or "expandable_segments:true" not in conf.replace(" ", "").lower():
        yield
        return
    # a private torch API (torch.cuda.memory's spelling is deprecated since torch 2.10): a torch with
    # neither packs in expandable segments, only slower to open
    settings = (getattr(torch._C, "_accelerator_setAllocatorSettings", None)
                or getattr(torch.cuda.memory, "_set_allocator_settings", None))
    try:
        settings("expandable_segments:False")
    except (TypeError, RuntimeError):
        yield
        return
    try:
        yield
    finally:
        settings("expandable_segments:True")


def _rebuild_cuda_tensor(*args):
    args, device = list(args), args[_CUDA_DEVICE_ARG]
    if not isinstance(device, int):  # a GPU's UUID
        visible = [i for i in range(torch.cuda.device_count()) if _device_uuid(i) == device]
        if not visible:
            where = "no CUDA device" if not torch.cuda.is_available() else f"not the trainer's GPU {device}"
            raise WeightPayloadError(f"the payload carries CUDA IPC handles but this engine has {where}: "
                                     "use the distributed or disk transport")
        args[_CUDA_DEVICE_ARG] = visible[0]
    original = getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
    return original(*args)


@dataclasses.dataclass
class LocalSerializedTensor:
    """SGLang's per-TP-rank wrapper (verl sends it in "direct" payloads): values[rank] is itself a
    serialized tensor. Unpickled in place of sglang.srt.model_executor.model_runner's class."""
    values: list


# Not torch's file_descriptor sharing (rebuild_storage_fd, multiprocessing's DupFd): its receiver fetches
# the fd by connecting to an address the payload names, with its own multiprocessing authkey, so a
# payload could make the engine connect anywhere, and no other process's fd ever arrives that way.
_R = "torch.multiprocessing.reductions"
_FD_SHARING = {(_R, "rebuild_storage_fd"), ("multiprocessing.resource_sharer", "DupFd")}
_ALLOWED = {
    **{("builtins", n): None for n in ("list", "tuple", "dict", "set", "frozenset", "int", "float", "str", "bytes",
                                       "bool")},
    **{(_R, n): getattr(reductions, n) for n in ("rebuild_tensor", "rebuild_typed_storage", "rebuild_storage_empty",
                                                 "rebuild_typed_storage_child", "rebuild_storage_filename")},
    (_R, "rebuild_cuda_tensor"): _rebuild_cuda_tensor,
    ("collections", "OrderedDict"): None,
    ("torch", "Size"): torch.Size,
    ("torch", "Tensor"): torch.Tensor,
    ("torch._tensor", "Tensor"): torch.Tensor,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter,
    ("torch", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
    ("torch.storage", "TypedStorage"): torch.storage.TypedStorage,
    (SGLANG_BUCKET_MODULE, "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): LocalSerializedTensor,
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only the globals a weight payload needs; everything else is refused."""

    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED:
            return _ALLOWED[module, name] or super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if name == "_rebuild_cuda_tensor_modified" and module.split(".")[0] in ("sglang", "slime"):
            return _rebuild_cuda_tensor  # SGLang's (or slime's) UUID-aware rebuild: always ours
        if (module, name) in _FD_SHARING:
            raise WeightPayloadError(f"refusing to unpickle {module}.{name}: CPU tensors shared by file descriptor "
                                     "are not taken; share them with torch.multiprocessing's file_system strategy")
        raise WeightPayloadError(f"refusing to unpickle {module}.{name}: not allowed in a weight payload")


def deserialize(data: str | bytes):
    """The inverse of serialize(), through the allowlist."""
    try:
        raw = base64.b64decode(data, validate=True) if isinstance(data, str) else data
    except (binascii.Error, ValueError) as e:
        raise WeightPayloadError(f"payload is not valid base64: {e}") from None
    try:
        return _RestrictedUnpickler(io.BytesIO(raw)).load()
    except WeightPayloadError:
        raise
    except Exception as e:  # truncated pickle, a shared-memory file gone, a dead producer...
        raise WeightPayloadError(f"cannot decode the payload: {type(e).__name__}: {e}") from None


def _first_entry(serialized_named_tensors):
    """One entry per TP rank; this engine is rank 0."""
    if not isinstance(serialized_named_tensors, list) or not serialized_named_tensors:
        raise WeightPayloadError("serialized_named_tensors must be a non-empty list (one entry per TP rank)")
    if not isinstance(serialized_named_tensors[0], str):
        raise WeightPayloadError("serialized_named_tensors[0] must be a base64 string")
    return deserialize(serialized_named_tensors[0])


def decode_bucket(serialized_named_tensors) -> FlattenedTensorBucket:
    """A "flattened_bucket" payload -> the bucket, not yet cut into tensors (the engine may apply it
    whole, flat_params.py). CUDA IPC memory is opened here."""
    obj = _first_entry(serialized_named_tensors)
    if not isinstance(obj, dict) or set(obj) != {"flattened_tensor", "metadata"} or not isinstance(obj["metadata"], list):
        raise WeightPayloadError('a flattened_bucket payload must be {"flattened_tensor", "metadata": [...]}')
    buf = obj["flattened_tensor"]
    if not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
        raise WeightPayloadError("flattened_tensor must be a 1-D uint8 tensor")
    return FlattenedTensorBucket(flattened_tensor=buf, metadata=obj["metadata"])


def decode_tensor_payload(serialized_named_tensors, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """A "direct" (or null-format) /update_weights_from_tensor payload -> (name, tensor) pairs."""
    if load_format not in (None, "direct"):
        raise WeightPayloadError(f"unknown load_format {load_format!r}: use null, 'direct' or 'flattened_bucket'")
    obj = _first_entry(serialized_named_tensors)
    if not isinstance(obj, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str)
            and isinstance(p[1], (torch.Tensor, LocalSerializedTensor)) for p in obj):
        raise WeightPayloadError("a direct payload must be a list of (name, tensor) pairs")
    return [(name, t if isinstance(t, torch.Tensor) else _unwrap(name, t)) for name, t in obj]


def _unwrap(name: str, wrapped: LocalSerializedTensor) -> torch.Tensor:
    if not isinstance(getattr(wrapped, "values", None), list) or not wrapped.values:
        raise WeightPayloadError(f"{name}: LocalSerializedTensor without values")
    inner = deserialize(wrapped.values[0])
    if not isinstance(inner, torch.Tensor):
        raise WeightPayloadError(f"{name}: LocalSerializedTensor.values[0] is not a tensor")
    return inner


def load_safetensors_folder(path: str | Path) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of every *.safetensors file in a folder (an HF checkpoint)."""
    folder = Path(path)
    files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else None
    if not files:
        raise WeightPayloadError(f"model_path {str(path)!r} is not a directory" if files is None
                                 else f"no *.safetensors files in {folder}")
    out = []
    for f in files:
        try:
            out.extend(load_file(str(f)).items())
        except Exception as e:
            raise WeightPayloadError(f"cannot read {f.name}: {type(e).__name__}: {e}") from None
    return out


def check_against(named_tensors, expected: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """WeightPayloadError unless each (name, tensor) is a distinct parameter, of its shape and dtype, finite."""
    if not named_tensors:
        raise WeightPayloadError("the update holds no tensors")
    seen = set()
    for name, tensor in named_tensors:
        if name not in expected or name in seen:
            raise WeightPayloadError(f"parameter {name!r} appears twice in one update" if name in seen
                                     else f"unknown parameter name {name!r}")
        seen.add(name)
        shape, dtype = expected[name]
        if tuple(tensor.shape) != tuple(shape):
            raise WeightPayloadError(f"{name}: shape {list(tensor.shape)} != the model's {list(shape)}")
        if tensor.dtype != dtype:
            raise WeightPayloadError(f"{name}: dtype {tensor.dtype} != the model's {dtype}")
    check_finite(named_tensors)


def non_finite(named_tensors) -> str | None:
    """The name of the first floating-point tensor holding a NaN or an infinity, else None. Each
    tensor's largest magnitude (NaN propagates, an infinity is one) in one fused multi-tensor kernel
    per (device, dtype), read back with ONE host sync: no per-tensor kernels, no copy of the weights."""
    named = [(n, t.detach()) for n, t in named_tensors if t.is_floating_point() and t.numel()]
    if not named:
        return None
    groups: dict = {}
    for i, (_, t) in enumerate(named):
        groups.setdefault((t.device, t.dtype), []).append(i)
    order, peaks = [], []
    for indices in groups.values():
        norms = torch._foreach_norm([named[i][1] for i in indices], ord=float("inf"))
        peaks.append(torch.stack(norms).float().to(named[0][1].device))
        order += indices
    finite = torch.isfinite(torch.cat(peaks)).tolist()
    return next((named[i][0] for i in sorted(i for i, ok in zip(order, finite) if not ok)), None)


def check_finite(named_tensors) -> None:
    name = non_finite(named_tensors)
    if name is not None:
        raise WeightPayloadError(f"{name} holds NaN or infinite values")


def checksums(named_tensors, names=None) -> dict[str, str]:
    """{name: sha256 of its raw bytes, row-major} of the given (name, tensor) pairs, optionally only `names`."""
    wanted = None if names is None else set(names)
    return {n: hashlib.sha256(t.detach().contiguous().flatten().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
            for n, t in named_tensors if wanted is None or n in wanted}
