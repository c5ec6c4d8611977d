"""The trainer's state through torch.distributed.checkpoint (DCP): sharded, written in the background,
loadable by any number of ranks.

What is saved: the FP32 masters, AdamW's state per parameter (step, exp_avg, exp_avg_sq) and the
step count, keyed by HF parameter names. A sharded trainer's masters and moments are DTensors, so
each rank writes only its own shards (plus DCP's metadata of where every shard lives); loading
reads whatever slices the loading ranks own, whichever N saved it. The single-process Trainer's
plain tensors go through the same functions, so a run saved with 2 ranks resumes in 1 and back; and a
single-process checkpoint (nano_miles.trainer.checkpoint's files) loads into N ranks, each reading its rows.

A save is atomic like nano_miles.trainer.checkpoint's: DCP writes into `<dir>.tmp` and rank 0 renames it
over `<dir>` once every rank has written (DCP's coordinator only finishes after all of them).
With background=True the state is first copied to CPU memory (so the next step may change the
parameters at once) and the files are written by a thread; call `.wait()` on the returned handle
before the next save and at the end of the run. The RNG and data position stay with the loop's
own state.json (nano_miles.trainer.checkpoint).

Loading runs no code from the folder. DCP's own reader unpickles `.metadata` with `pickle.load` and
its default planner `torch.load(..., weights_only=False)`s every non-tensor entry: a crafted
checkpoint would run any command. Here the metadata goes through an allowlist of DCP's metadata
classes (read_metadata) and non-tensor entries through `torch.load(weights_only=True)`; a file that
fails either is a CheckpointError naming it (docs/design.md, "Nothing runs from a run directory").
"""
from __future__ import annotations

import pathlib
import pickle
import shutil
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.tensor import DTensor, Shard

from nano_miles.trainer.checkpoint import CheckpointError, check_single_process, load_optimizer, one_line, read_json


def trainer_state(trainer) -> dict:
    """The state DCP saves and loads in place. AdamW's state is created (zeros, step 0) where it
    does not exist yet, so a fresh trainer has every tensor a checkpoint will be loaded into."""
    optim = trainer.optimizer
    group = optim.param_groups[0]
    step_on_device = group.get("fused") or group.get("capturable")  # (else AdamW keeps `step` on the CPU)
    moments = {}
    for name, master in zip(trainer.names, trainer.masters):
        state = optim.state[master]
        if not state:  # what AdamW's first step would create (a float32 step, zero moments)
            state["step"] = torch.zeros((), dtype=torch.float32, device=master.device if step_on_device else "cpu")
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        moments[name] = {k: state[k] for k in ("step", "exp_avg", "exp_avg_sq")}
    return {"masters": dict(zip(trainer.names, trainer.masters)), "optim": moments,
            "trainer": {"step": trainer.step}}


class PendingSave:
    """A checkpoint being written in the background; wait() finishes it (every rank must call it)."""

    def __init__(self, future, tmp: Path, final: Path, group):
        self.future, self.tmp, self.final, self.group = future, tmp, final, group

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def wait(self) -> Path:
        if self.future is not None:
            self.future.result()
            self.future = None
            if _is_main():
                _replace(self.tmp, self.final)
            if dist.is_initialized():
                dist.barrier(group=self.group)  # the checkpoint is in place when any rank returns
        return self.final


def _group(trainer):
    env = getattr(trainer, "env", None)
    return env.cpu_group if env is not None else None


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _replace(tmp: Path, final: Path) -> None:
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def save(trainer, path, background: bool = True) -> PendingSave:
    """Write the trainer's state to the folder `path` (collective: every rank calls it)."""
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    group = _group(trainer)
    if _is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier(group=group)  # nobody writes into tmp before rank 0 has cleared it
    state = trainer_state(trainer)
    single = not dist.is_initialized()
    if background:
        future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=group, no_dist=single)
    else:
        future = Future()
        future.set_result(dcp.save(state, checkpoint_id=str(tmp), process_group=group, no_dist=single))
    pending = PendingSave(future, tmp, final, group)
    if not background:
        pending.wait()
    return pending


def load(trainer, path) -> None:
    """Load a checkpoint written by `save` with any number of ranks, or one written by a single process
    (nano_miles.trainer.checkpoint: model.safetensors, optimizer.pt, state.json); collective: every rank calls it.
    A folder that cannot be loaded is a CheckpointError naming it."""
    path = Path(path)
    if not (path / ".metadata").exists():
        if (path / "model.safetensors").exists() and (path / "state.json").exists():
            return load_single_process(trainer, path)
        raise FileNotFoundError(f"{path} is not a distributed checkpoint (no .metadata)")
    state, reader = trainer_state(trainer), _CheckedReader(path, read_metadata(path))
    try:
        dcp.load(state, storage_reader=reader, planner=_CheckedPlanner(), process_group=_group(trainer),
                 no_dist=not dist.is_initialized())
    except dcp.CheckpointException as e:  # a rank's failure (a bad plan or read), its traceback as text
        error = next(iter(e.failures.values()))[0]
        raise CheckpointError(f"{path} cannot be loaded: {type(error).__name__}: {one_line(error)}") from None
    step = state["trainer"]["step"]
    if not isinstance(step, int):
        raise CheckpointError(f"{path} cannot be loaded: the trainer's step is a {type(step).__name__}, not an int")
    trainer.step = step
    trainer._copy_masters_to_model()  # the single-process trainer's bf16 compute copy follows its masters


# What DCP's .metadata pickle may name: its metadata dataclasses and the torch types inside them. The
# classes are rebuilt field by field; none of them runs code of the file's choosing.
_METADATA_GLOBALS = {
    **{("torch.distributed.checkpoint.metadata", cls.__name__): cls for cls in (
        dcp_metadata.Metadata, dcp_metadata.MetadataIndex, dcp_metadata.StorageMeta,
        dcp_metadata.TensorProperties, dcp_metadata.TensorStorageMetadata, dcp_metadata.ChunkStorageMetadata,
        dcp_metadata.BytesStorageMetadata, dcp_metadata._MEM_FORMAT_ENCODING)},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a layout by its name
    ("pathlib", "PosixPath"): pathlib.PosixPath,  # the checkpoint id the saver wrote into
    ("pathlib._local", "PosixPath"): pathlib.PosixPath,  # (its module from Python 3.13)
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) not in _METADATA_GLOBALS:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a checkpoint's metadata never holds")
        return _METADATA_GLOBALS[(module, name)]


def read_metadata(path) -> dcp_metadata.Metadata:
    """The DCP checkpoint's `.metadata` (where every shard lives), unpickled through the allowlist above;
    anything else there is a CheckpointError naming the file."""
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # a crafted or truncated pickle, an unreadable file
        raise CheckpointError(f"{file} cannot be loaded: {type(e).__name__}: {one_line(e)}") from None
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{file} cannot be loaded: it holds a {type(metadata).__name__}, not DCP's metadata")
    return metadata


class _CheckedReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata already read through the allowlist (read_metadata)."""

    def __init__(self, path: Path, metadata: dcp_metadata.Metadata):
        super().__init__(path)
        self.metadata = metadata

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = dcp_metadata.StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata


class _CheckedPlanner(DefaultLoadPlanner):
    """DCP's planner, reading a non-tensor entry with torch.load(weights_only=True) (the default one
    unpickles it with weights_only=False), and only where the state holds no tensor."""

    def load_bytes(self, read_item, value) -> None:
        fqn = read_item.dest_index.fqn
        if isinstance(self.state_dict.get(fqn), torch.Tensor):
            raise ValueError(f"{fqn} is saved as an object where the trainer holds a tensor")
        keys = self.mappings[fqn] if self.flatten_state_dict else (fqn,)  # its place in the nested state
        parent = self.original_state_dict
        for key in keys[:-1]:
            parent = parent[key]
        parent[keys[-1]] = torch.load(value, weights_only=True)


@torch.no_grad()
def load_single_process(trainer, path) -> None:
    """Load a single-process checkpoint (nano_miles.trainer.checkpoint's format 2) into a trainer of any number
    of ranks. Each rank reads only its own rows of every tensor: the masters through safetensors' slices,
    AdamW's moments from the memory-mapped optimizer.pt (no rank holds the whole state). Without
    optimizer.pt (a completed run's last checkpoint) AdamW's moments start from zero."""
    path = Path(path)
    meta = read_json(path)
    check_single_process(path, meta)
    state = trainer_state(trainer)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        missing = sorted(set(trainer.names) - set(f.keys()))
        if missing:
            raise ValueError(f"{path} does not fit this model: no {missing[:3]}")
        for name, master in state["masters"].items():
            local, rows = _own_rows(master)
            if f.get_slice(name).get_shape() != list(master.shape):
                raise ValueError(f"checkpoint tensor {name}: shape {f.get_slice(name).get_shape()} != "
                                 f"{list(master.shape)}")
            local.copy_(f.get_slice(name)[rows.start:rows.stop])
    optim_file = path / "optimizer.pt"
    if meta.get("optimizer") and optim_file.exists():
        saved = load_optimizer(optim_file, "cpu", mmap=True)
        ids = saved["param_groups"][0]["params"]  # AdamW's ids, in the order of the trainer's names
        if len(ids) != len(trainer.names):
            raise CheckpointError(f"{optim_file} holds {len(ids)} parameters' state, this model has "
                                  f"{len(trainer.names)}")
        for name, i in zip(trainer.names, ids):
            if i not in saved["state"]:
                continue  # a parameter AdamW never stepped: zeros, as the fresh state is
            moments = state["optim"][name]
            moments["step"].copy_(saved["state"][i]["step"])
            for key in ("exp_avg", "exp_avg_sq"):
                local, rows = _own_rows(moments[key])
                local.copy_(saved["state"][i][key][rows])
    trainer.step = int(meta["trainer_step"])
    trainer._copy_masters_to_model()


def _own_rows(t: torch.Tensor) -> tuple[torch.Tensor, slice]:
    """This rank's part of `t` and the rows of the whole tensor it holds: FSDP shards dim 0 as
    torch.chunk does (ceil(d0 / N) rows per rank, the last ones shorter or empty); a plain tensor is all."""
    if not isinstance(t, DTensor):
        return t, slice(0, t.shape[0] if t.dim() else None)
    if t.placements != (Shard(0),):
        raise ValueError(f"expected a tensor sharded on dim 0, got {t.placements}")
    local = t.to_local()
    per_rank = -(-t.shape[0] // t.device_mesh.size())
    start = min(t.device_mesh.get_local_rank() * per_rank, t.shape[0])
    return local, slice(start, start + local.shape[0])
