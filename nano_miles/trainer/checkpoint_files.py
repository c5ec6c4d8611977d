"""A checkpoint folder's files read back, checked, and nothing in them unpickled: a run directory may
come from anyone (a shared disk, a download). optimizer.pt goes through torch.load(weights_only=True),
DCP's `.metadata` through an allowlist of its metadata classes (DCP's own reader unpickles it with
pickle.load, which would run any command a crafted file names). A file that fails is a CheckpointError
naming it (`nano-miles train` prints it and exits 2). Format 1 (trainer.pt, a pickle) is refused.
"""
from __future__ import annotations

import json
import pathlib
import pickle
import random
import zipfile
from pathlib import Path

import torch
from safetensors import safe_open
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.filesystem import _StorageInfo

from nano_miles.config import ConfigError

FORMAT = 2  # a one-process checkpoint's; 1 (a single trainer.pt, a pickle) is never read: it could run any code


class CheckpointError(ConfigError):
    """A checkpoint that cannot be resumed (corrupt, or of a format that is not read); one line naming the file."""


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def checkpoint_folder(run_dir: Path) -> Path | None:
    """run_dir's checkpoint folder, None when it has none yet (a checkpoint.old left by a kill between the
    two renames of a save is taken back first)."""
    ckpt, old = Path(run_dir) / "checkpoint", Path(run_dir) / "checkpoint.old"
    if not ckpt.exists() and (old / "state.json").exists():
        old.rename(ckpt)
    if not ckpt.exists():
        return None
    if not (ckpt / "state.json").is_file():  # a checkpoint is renamed into place with it: a damaged one
        raise CheckpointError(f"{ckpt}/state.json is missing: {ckpt} cannot be resumed")
    return ckpt


def read_json(path: Path, what: str = "a checkpoint's state") -> dict:
    """A JSON object file (a checkpoint's state.json, a run's config.json)."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read: {type(e).__name__}: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} is not {what}: a JSON {type(value).__name__}")
    return value


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_position(value) -> bool:
    """The task stream's state() ({"position", "passes"[, "pending"]}), or a bare position."""
    if isinstance(value, dict):
        pending = value.get("pending", [])
        return (_is_count(value.get("position")) and isinstance(value.get("passes"), dict)
                and isinstance(pending, list) and all(isinstance(i, str) for i in pending))
    return _is_count(value)


def rng_states(path: Path, state: dict) -> tuple:
    """state.json's RNG states, as random.setstate and torch.set_rng_state take them (checked)."""
    try:
        py = state["rng"]["python"]
        py_state = (py[0], tuple(py[1]), py[2])
        random.Random().setstate(py_state)  # refuses a malformed state, leaving ours alone
        torch_state = torch.tensor(state["rng"]["torch"], dtype=torch.uint8)
        if torch_state.shape != torch.get_rng_state().shape:
            raise ValueError(f"{torch_state.numel()} bytes of torch RNG state")
    except (KeyError, IndexError, TypeError, ValueError, OverflowError, RuntimeError) as e:
        raise CheckpointError(f"{path} is not a checkpoint's state: its RNG states do not restore "
                              f"({type(e).__name__}: {e})") from None
    return py_state, torch_state


def restore_rng(ckpt: Path, state: dict) -> None:
    py_state, torch_state = rng_states(Path(ckpt) / "state.json", state)
    random.setstate(py_state)
    torch.set_rng_state(torch_state)


def check_resumable(ckpt: Path) -> dict:
    """What resuming from `ckpt` reads, checked without reading its tensors (so a bad one is refused
    before any model loads): its state.json (returned), the weights' header and index, the optimizer's
    container."""
    path = Path(ckpt) / "state.json"
    state = read_json(path)
    if not (_is_count(state.get("step")) and _is_position(state.get("stream", state.get("data_position")))):
        raise CheckpointError(f"{path} is not a checkpoint's state: no step and data position")
    rng_states(path, state)
    if (ckpt / ".metadata").exists():
        read_metadata(ckpt)
        return state
    if state.get("sharded"):  # N ranks' checkpoint: its shards are indexed by .metadata
        raise CheckpointError(f"{ckpt}/.metadata is missing: {ckpt} cannot be resumed")
    if (fmt := state.get("format", 1)) != FORMAT:
        raise CheckpointError(f"{ckpt} cannot be resumed: its state.json says format {fmt!r}; only format {FORMAT} "
                              "is read (format 1 keeps the trainer's state as a pickle, trainer.pt, which could run "
                              "any code)")
    if not _is_count(state.get("trainer_step")):
        raise CheckpointError(f"{ckpt}/state.json is not a checkpoint's state: no trainer_step")
    weights = ckpt / "model.safetensors"
    try:
        with safe_open(str(weights), framework="pt"):
            pass
    except Exception as e:  # truncated, not safetensors, missing
        raise CheckpointError(f"{weights} cannot be read: {one_line(e)}") from None
    optimizer = ckpt / "optimizer.pt"
    if state.get("optimizer") and optimizer.exists() and not zipfile.is_zipfile(optimizer):
        raise CheckpointError(f"{optimizer} cannot be read: not a whole torch.save file (truncated?)")
    return state


def load_optimizer(path: Path) -> dict:
    """optimizer.pt, memory-mapped: tensors and plain containers only (torch.load's weights_only)."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # truncated, or naming something that is not a tensor or a container
        raise CheckpointError(f"{path} cannot be read: {type(e).__name__}: {one_line(e)}") from None
    if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict) and saved.get("param_groups")):
        raise CheckpointError(f"{path} is not an optimizer's state")
    return saved


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
    """The DCP checkpoint's `.metadata` (where every shard lives), unpickled through the allowlist above."""
    file = Path(path) / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except Exception as e:  # a crafted or truncated pickle, an unreadable file
        raise CheckpointError(f"{file} cannot be loaded: {type(e).__name__}: {one_line(e)}") from None
    if not isinstance(metadata, dcp_metadata.Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(f"{file} cannot be loaded: it holds a {type(metadata).__name__}, not DCP's metadata")
    # DCP's reader opens folder / each shard's name: a name with a separator, an absolute one or a
    # symlink would read a file outside the checkpoint (another run's weights) into this one.
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if not (isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name
                and not (Path(path) / name).is_symlink()):
            raise CheckpointError(f"{file} cannot be loaded: it names a shard outside its folder: {name!r}")
    return metadata
