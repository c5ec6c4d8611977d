"""One copy of the weights for a CPU trainer and a CPU engine on one machine, in shared memory.

As in slime's colocated mode, the tensors the engine serves live in ONE memfd that the engine maps
read-only in place of its own copy: the trainer's in-place optimizer step IS the weight update (the
`shared` transport), right only while the engine never generates during the trainer's writes
(mode=sync). The memory goes with the last process holding it; an engine bug writing into it faults.
"""
from __future__ import annotations

import mmap
import os
import warnings

import torch

from nano_miles.dtypes import DTYPES, dtype_name
from nano_miles.engine.heap import release_free_heap  # the copies freed once weights move here

ALIGN_BYTES = 64  # every tensor starts on a cache line (and any dtype's alignment)


class SharedWeightsError(ValueError):
    """A manifest or file that cannot be mapped as the engine's weights."""


class SharedWeights:
    """The trainer side: (name, tensor) pairs moved into one memfd-backed buffer, in place (each
    tensor's `.data` is rebound: Parameters, optimizer state and tied weights stay as they are)."""

    def __init__(self, named_tensors):
        named = list(named_tensors)
        if not named or any(t.device.type != "cpu" for _, t in named):
            raise ValueError("shared weights are for CPU tensors (a GPU trainer syncs over CUDA IPC)")
        self.manifest, offset = [], 0
        for name, t in named:
            offset = -(-offset // ALIGN_BYTES) * ALIGN_BYTES
            self.manifest.append([name, dtype_name(t.dtype), list(t.shape), offset])
            offset += t.numel() * t.element_size()
        self.fd = os.memfd_create("nano-miles-weights", os.MFD_CLOEXEC)
        os.ftruncate(self.fd, max(offset, 1))
        self.buffer = torch.from_file(f"/proc/self/fd/{self.fd}", shared=True, size=max(offset, 1), dtype=torch.uint8)
        with torch.no_grad():
            for (name, t), (_, _, shape, start) in zip(named, self.manifest):
                view = self.buffer[start:start + t.numel() * t.element_size()].view(t.dtype).view(shape)
                view.copy_(t)
                t.data = view  # the same tensor object, now backed by the shared buffer
        release_free_heap()
        self.path = f"/proc/{os.getpid()}/fd/{self.fd}"  # what an engine opens, while this process lives

    def close(self) -> None:
        """Close our descriptor; the memory lives on while tensors (or an engine) still map it."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def map_shared(path: str, manifest, expected: dict[str, tuple[tuple[int, ...], torch.dtype]],
               skip=lambda name: False) -> dict[str, torch.Tensor]:
    """The engine side: {name: read-only view} of the file at `path`, laid out as `manifest` ([name,
    dtype, shape, byte offset] per tensor). Every name of `expected` (the engine's parameters: name ->
    (shape, dtype)) must be there with its shape and dtype; names skip(name) accepts (a tied lm_head)
    are left out; anything else is refused."""
    if not isinstance(path, str) or not path:
        raise SharedWeightsError("path (the trainer's shared weights file) is required")
    if not isinstance(manifest, list) or not manifest:
        raise SharedWeightsError("manifest must be a non-empty list of [name, dtype, shape, offset]")
    entries, seen = [], set()
    for entry in manifest:
        if not (isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str) and isinstance(entry[1], str)
                and isinstance(entry[2], list) and all(isinstance(d, int) and d >= 0 for d in entry[2])
                and isinstance(entry[3], int) and not isinstance(entry[3], bool) and entry[3] >= 0):
            raise SharedWeightsError(f"bad manifest entry {str(entry)[:120]}: need [name, dtype, shape, offset]")
        name, dtype, shape, start = entry
        if name in seen:
            raise SharedWeightsError(f"{name} appears twice in the manifest")
        seen.add(name)
        if name not in expected and skip(name):
            continue
        if name not in expected:
            raise SharedWeightsError(f"unknown parameter name {name!r}")
        want_shape, want_dtype = expected[name]
        if tuple(shape) != tuple(want_shape) or DTYPES.get(dtype) != want_dtype:
            raise SharedWeightsError(f"{name}: {dtype} {shape} in the manifest, the engine has "
                                     f"{dtype_name(want_dtype)} {list(want_shape)}")
        if start % want_dtype.itemsize:
            raise SharedWeightsError(f"{name}: offset {start} is not aligned to its dtype")
        entries.append((name, want_dtype, shape, start, start + torch.Size(shape).numel() * want_dtype.itemsize))
    missing = sorted(set(expected) - seen)
    if missing:
        raise SharedWeightsError(f"the manifest lacks {len(missing)} parameters, e.g. {missing[:3]}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise SharedWeightsError(f"cannot open {path}: {e.strerror} (trainer and engine must share a machine)") from None
    try:
        size, need = os.fstat(fd).st_size, max(end for *_, end in entries)
        if size < need:
            raise SharedWeightsError(f"{path} holds {size} bytes; the manifest needs {need}")
        mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    with warnings.catch_warnings():  # "not writable": read-only is the point
        warnings.simplefilter("ignore", UserWarning)
        buffer = torch.frombuffer(mapping, dtype=torch.uint8)  # keeps the mapping alive
    return {name: buffer[start:end].view(dtype).view(shape) for name, dtype, shape, start, end in entries}
