"""The engine's parameters as views into ONE flat buffer, so a weight update can be ONE copy.

A trainer's flattened bucket concatenates its tensors' bytes in HF named_parameters order; packed
in that same order, a bucket describing exactly a run of the buffer is applied with one `copy_`
(one cross-GPU copy for a CUDA IPC bucket) instead of one copy per tensor. Packed once, at load, the
storage never moves, so captured CUDA graphs stay valid; all parameters share the buffer's version
counter, so any weight write moves every param._version.
"""
from __future__ import annotations

import torch

from nano_miles.engine.weights import bucket_metadata

# On CUDA every packed parameter must start at a multiple of this many bytes: kernels pick their fast
# vectorised paths from pointer alignment. A model whose offsets would not be aligned stays unpacked.
CUDA_ALIGN_BYTES = 16


class FlatParameters:
    def __init__(self, model: torch.nn.Module):
        if not self.packable(model):
            raise ValueError("cannot pack parameters of several dtypes/devices (or none, or unaligned on CUDA)")
        named = list(model.named_parameters())
        self.dtype, self.device = named[0][1].dtype, named[0][1].device
        # Laid out as the bucket of all parameters: a trainer's bucket of a run of them is a slice of it.
        self.slots = bucket_metadata([n for n, _ in named], [self.dtype] * len(named), [p.shape for _, p in named])
        size = self.dtype.itemsize
        flat = torch.empty(self.slots[-1].end_idx // size, dtype=self.dtype, device=self.device)
        packed = {}
        with torch.no_grad():
            for (_, p), slot in zip(named, self.slots):
                view = flat[slot.start_idx // size: slot.end_idx // size].view(p.shape)
                view.copy_(p)
                # A new Parameter of the view, not `p.data = view`: only a view shares the buffer's
                # version counter, which caches of derived weights (the FP32 lm_head) watch.
                packed[id(p)] = torch.nn.Parameter(view, requires_grad=p.requires_grad)
        for module in model.modules():  # every module holding one (a shared parameter stays shared)
            for key, p in list(module._parameters.items()):
                if p is not None and id(p) in packed:
                    module._parameters[key] = packed[id(p)]
        self.bytes = flat.view(torch.uint8)
        self.index = {slot.name: i for i, slot in enumerate(self.slots)}

    @staticmethod
    def packable(model: torch.nn.Module) -> bool:
        """One dtype, one device, and (on CUDA) every packed offset aligned."""
        params = list(model.parameters())
        if not params or len({p.dtype for p in params}) != 1 or len({p.device for p in params}) != 1:
            return False
        offsets = torch.tensor([0] + [p.numel() * p.element_size() for p in params[:-1]]).cumsum(0)
        return params[0].device.type != "cuda" or bool((offsets % CUDA_ALIGN_BYTES == 0).all())

    def match(self, metadata) -> tuple[int, int] | None:
        """Bytes [start, end) of the packed buffer that a bucket with this metadata (a list of
        FlattenedTensorMetadata) reproduces exactly, or None (another order, shape, dtype, offset, a gap...)."""
        try:
            first = self.index.get(metadata[0].name) if metadata else None
            if first is None or first + len(metadata) > len(self.slots):
                return None
            base = self.slots[first].start_idx
            for slot, meta in zip(self.slots[first:first + len(metadata)], metadata):
                if (meta.name != slot.name or meta.dtype != self.dtype or tuple(meta.shape) != slot.shape
                        or (meta.start_idx, meta.end_idx, meta.numel)
                        != (slot.start_idx - base, slot.end_idx - base, slot.numel)):
                    return None
            return base, self.slots[first + len(metadata) - 1].end_idx
        except (AttributeError, TypeError):  # malformed metadata: the per-tensor path reports it
            return None

    def load(self, start: int, buffer: torch.Tensor) -> None:
        """Copy `buffer` (1-D uint8, e.g. another GPU's memory) into bytes [start, start + len); return
        once it is complete: the buffer may be another process's, freed as soon as we answer."""
        if buffer.dtype != torch.uint8 or buffer.dim() != 1 or start + buffer.numel() > self.bytes.numel():
            raise ValueError("the buffer does not fit the packed parameters")
        with torch.no_grad():
            self.bytes[start:start + buffer.numel()].copy_(buffer)
        wait_for_copies(self.device, [buffer])


def wait_for_copies(device: torch.device, sources) -> None:
    """Block until copies into `device` from `sources` are done. A cross-GPU copy_ runs on the SOURCE
    device's stream, so both ends are synchronised; CPU copies are synchronous already."""
    for d in {device} | {t.device for t in sources}:
        if d.type == "cuda":
            torch.cuda.synchronize(d)
