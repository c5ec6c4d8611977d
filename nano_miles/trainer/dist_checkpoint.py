"""The trainer's state through torch.distributed.checkpoint (DCP): the FP32 masters, AdamW's state
and the step, by HF name, as N ranks checkpoint them (each its own shards, staged to CPU and written in
a thread), loaded into any number of ranks whichever N saved it. A one-process checkpoint
(checkpoint.py's files) loads into any number of ranks too, each reading only its own rows. Loading
runs no code from the folder (checkpoint_files.read_metadata, _CheckedPlanner).
"""
from __future__ import annotations

import warnings
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors import safe_open
from torch.distributed.checkpoint import HuggingFaceStorageReader
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.tensor import DTensor, Shard

from nano_miles.trainer import fsdp
from nano_miles.trainer.checkpoint_files import CheckpointError, load_optimizer, one_line, read_metadata


def trainer_state(trainer) -> dict:
    """The state DCP saves and loads in place (AdamW's created where it does not exist yet, so a fresh
    trainer has every tensor a checkpoint will be loaded into)."""
    optim = trainer.optimizer
    moments = {name: dict(fsdp.adamw_state(optim, master, optim.param_groups[0]))  # step, exp_avg, exp_avg_sq
               for name, master in zip(trainer.names, trainer.masters)}
    return {"masters": dict(zip(trainer.names, trainer.masters)), "optim": moments,
            "trainer": {"step": trainer.step}}


def _group(trainer):
    return trainer.env.cpu_group if trainer.env is not None else None


def _load(state: dict, trainer, **where) -> None:
    with warnings.catch_warnings():  # DCP's note that it loads in one process: that is the point there
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, process_group=_group(trainer), no_dist=trainer.env is None, **where)


def save(trainer, folder: Path) -> Future:
    """Every rank writes its shards into `folder` in the background; every rank waits on the Future
    before the next save."""
    return dcp.async_save(trainer_state(trainer), checkpoint_id=str(folder), process_group=_group(trainer),
                          no_dist=trainer.env is None)


def load(trainer, folder: Path) -> None:
    """Load a DCP checkpoint written by any number of ranks (collective: every rank calls it)."""
    state = trainer_state(trainer)
    try:
        _load(state, trainer, storage_reader=_CheckedReader(folder, read_metadata(folder)), planner=_CheckedPlanner())
    except dcp.CheckpointException as e:  # a rank's failure (a bad plan or read), its traceback as text
        error = next(iter(e.failures.values()))[0]
        raise CheckpointError(f"{folder} cannot be loaded: {type(error).__name__}: {one_line(error)}") from None
    step = state["trainer"]["step"]
    if not isinstance(step, int):
        raise CheckpointError(f"{folder} cannot be loaded: the trainer's step is a {type(step).__name__}, not an int")
    trainer.step = step
    trainer._copy_masters_to_model()  # one process: the bf16 compute copy follows its masters


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
    """DCP's planner, reading a non-tensor entry with torch.load(weights_only=True) (DCP's own unpickles
    it with weights_only=False), and only where the state holds no tensor."""

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
def load_files(trainer, folder: Path, step: int, with_optimizer: bool) -> None:
    """Load a one-process checkpoint into any number of ranks, each reading only its own rows: the
    masters through DCP's safetensors reader, AdamW's moments from the memory-mapped optimizer.pt (with
    with_optimizer; else they start from zero)."""
    state = trainer_state(trainer)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        missing = [n for n in trainer.names if n not in set(f.keys())]
    if missing:
        raise CheckpointError(f"{folder} cannot be resumed: it does not fit this model: missing {missing[:3]}")
    try:
        _load(state["masters"], trainer, storage_reader=HuggingFaceStorageReader(str(folder)))
        if with_optimizer:
            saved = load_optimizer(folder / "optimizer.pt")
            ids = saved["param_groups"][0]["params"]  # AdamW's ids, in the order of the trainer's names
            if len(ids) != len(trainer.names):
                raise ValueError(f"optimizer.pt holds {len(ids)} parameters' state, this model has {len(trainer.names)}")
            for name, i in zip(trainer.names, ids):
                if i not in saved["state"]:
                    continue  # a parameter AdamW never stepped: zeros, as the fresh state is
                moments = state["optim"][name]
                moments["step"].copy_(saved["state"][i]["step"])
                for key in ("exp_avg", "exp_avg_sq"):
                    local, rows = _own_rows(moments[key])
                    local.copy_(saved["state"][i][key][rows])
    except CheckpointError:
        raise
    except (dcp.CheckpointException, KeyError, TypeError, ValueError, RuntimeError) as e:  # not this model's
        raise CheckpointError(f"{folder} cannot be resumed: {type(e).__name__}: {one_line(e)}") from None
    trainer.step = step
    trainer._copy_masters_to_model()


def _own_rows(t: torch.Tensor) -> tuple[torch.Tensor, slice]:
    """This rank's part of `t` and the rows of the whole tensor it holds: FSDP shards dim 0 as
    torch.chunk does (ceil(d0 / N) rows per rank, the last ones shorter or empty); a plain tensor is all."""
    if not isinstance(t, DTensor):
        return t, slice(None)
    if t.placements != (Shard(0),):
        raise ValueError(f"expected a tensor sharded on dim 0, got {t.placements}")
    local = t.to_local()
    per_rank = -(-t.shape[0] // t.device_mesh.size())
    start = min(t.device_mesh.get_local_rank() * per_rank, t.shape[0])
    return local, slice(start, start + local.shape[0])
