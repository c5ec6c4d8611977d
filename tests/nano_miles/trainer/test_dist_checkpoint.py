"""Checkpoints move between N and M ranks (nano_miles/trainer/dist_checkpoint.py, checkpoint.py): the
2 ranks' DCP checkpoint, written in the background while they trained on, resumes in one process
exactly; one process's checkpoint resumes on 2 ranks exactly. Loading a DCP checkpoint runs no code
from it: crafted pickles where DCP unpickles (.metadata, object entries) are refused, and a damaged
one is one line."""
import io
import json
import pickle

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

from nano_miles.trainer import dist_checkpoint
from nano_miles.trainer.checkpoint import CheckpointError, load_checkpoint
from nano_miles.trainer.checkpoint_files import read_metadata
from nano_miles.trainer.trainer import Trainer
from tests.nano_miles.trainer import sharded_ranks
from tests.nano_miles.trainer.test_checkpoint import CreatesFile

CHECKPOINTED = sharded_ranks.CHECKPOINTED


def assert_same_state(got: dict, expected: dict, what: str):
    assert got["step"] == expected["step"], what
    worst = max(float((got["masters"][n] - m).abs().max()) for n, m in expected["masters"].items())
    assert worst <= 1e-6, f"{what}: masters differ by {worst:.2e}"
    for n, moments in expected["optim"].items():
        assert float(got["optim"][n]["step"]) == float(moments["step"]), n
        for k in ("exp_avg", "exp_avg_sq"):  # moments of ~1e-3 and ~1e-6: relative to their size
            torch.testing.assert_close(got["optim"][n][k], moments[k], rtol=1e-5,
                                       atol=1e-6 * float(moments[k].abs().max()))


def _worst(masters: dict, expected: dict) -> float:
    return max(float((m - expected[n]).abs().max()) for n, m in masters.items())


def test_two_ranks_checkpoint_resumes_in_one_process(two_rank_run, one_process_results, tiny_model_path):
    """The checkpoint holds the moment it was saved (the ranks' next update changed every master while
    it was written), and one process continues from it as one process would have."""
    ckpt = two_rank_run / "run" / "checkpoint"
    assert (ckpt / ".metadata").exists() and len(list(ckpt.glob("*.distcp"))) == 2
    assert not (two_rank_run / "run" / "checkpoint.tmp").exists()
    state = json.loads((ckpt / "state.json").read_text())  # rank 0's, beside the shards
    assert (state["step"], state["world_size"], state["sharded"]) == (1, 2, True)
    trainer = Trainer(sharded_ranks.trainer_config(str(tiny_model_path), CHECKPOINTED))
    assert load_checkpoint(two_rank_run / "run", trainer)["step"] == 1
    assert_same_state(sharded_ranks.full_state(trainer), one_process_results[CHECKPOINTED][1], "one process")
    sharded_ranks.update(trainer, CHECKPOINTED)
    assert _worst(sharded_ranks.full_state(trainer)["masters"], one_process_results["continued"][1]["masters"]) <= 1e-6


def test_a_one_process_checkpoint_resumes_on_two_ranks(two_rank_run, one_process_results):
    """checkpoint.py's files (whole safetensors, torch.save'd AdamW state): each rank reads its rows,
    and the 2 ranks continue as the one process does."""
    got = torch.load(two_rank_run / "resumed.pt", weights_only=True)
    assert_same_state(got["loaded"], one_process_results[CHECKPOINTED][1], "2 ranks from one process's checkpoint")
    assert _worst(got["continued"]["masters"], one_process_results["continued"][1]["masters"]) <= 1e-6


def test_loading_a_folder_that_is_no_checkpoint_says_so(tmp_path, tiny_model_path):
    trainer = Trainer(sharded_ranks.trainer_config(str(tiny_model_path)))
    with pytest.raises(CheckpointError, match=f"^{tmp_path / '.metadata'} cannot be loaded: FileNotFoundError"):
        dist_checkpoint.load(trainer, tmp_path)


def test_a_crafted_metadata_pickle_never_runs(tmp_path, tiny_model_path):
    """DCP's own reader unpickles .metadata with pickle.load: a crafted one would run any code."""
    marker = tmp_path / "marker"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(pickle.dumps(CreatesFile(marker)))
    trainer = Trainer(sharded_ranks.trainer_config(str(tiny_model_path)))
    with pytest.raises(CheckpointError) as refused:
        dist_checkpoint.load(trainer, ckpt)
    assert not marker.exists()
    assert str(refused.value).startswith(f"{ckpt / '.metadata'} cannot be loaded: UnpicklingError: it names ")


def test_a_crafted_object_entry_never_runs(tmp_path, tiny_model_path):
    """Genuine metadata, but the trainer's step (an object entry, not a tensor) points at a crafted
    pickle: DCP's default planner loads such entries with torch.load(weights_only=False)."""
    marker = tmp_path / "marker"
    trainer = Trainer(sharded_ranks.trainer_config(str(tiny_model_path)))
    dist_checkpoint.save(trainer, tmp_path / "ckpt").result()
    crafted = io.BytesIO()
    torch.save(CreatesFile(marker), crafted)
    (tmp_path / "ckpt" / "crafted.distcp").write_bytes(crafted.getvalue())
    metadata = read_metadata(tmp_path / "ckpt")
    metadata.storage_data[MetadataIndex("trainer.step")] = _StorageInfo("crafted.distcp", 0, len(crafted.getvalue()))
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=f"^{tmp_path / 'ckpt'} cannot be loaded: UnpicklingError: "):
        dist_checkpoint.load(Trainer(sharded_ranks.trainer_config(str(tiny_model_path))), tmp_path / "ckpt")
    assert not marker.exists()


@pytest.mark.parametrize("where", ["parent", "absolute", "symlink"])
def test_a_crafted_metadata_never_reads_a_shard_outside_its_folder(tmp_path, tiny_model_path, where):
    """Genuine metadata whose shard names lead out of the checkpoint folder (DCP's reader opens
    folder / name): resuming would load whatever checkpoint of this host they name, into the weights the
    run then serves and exports."""
    outside = Trainer(sharded_ranks.trainer_config(str(tiny_model_path)))
    with torch.no_grad():
        for m in outside.masters:
            m.fill_(7.0)
    dist_checkpoint.save(outside, tmp_path / "elsewhere").result()
    ckpt = tmp_path / "run" / "checkpoint"
    dist_checkpoint.save(Trainer(sharded_ranks.trainer_config(str(tiny_model_path))), ckpt).result()
    metadata = read_metadata(ckpt)
    for index, info in metadata.storage_data.items():
        target = tmp_path / "elsewhere" / info.relative_path
        if where == "symlink":
            (ckpt / info.relative_path).unlink(missing_ok=True)
            (ckpt / info.relative_path).symlink_to(target)
            continue
        name = f"../../elsewhere/{info.relative_path}" if where == "parent" else str(target)
        metadata.storage_data[index] = _StorageInfo(name, info.offset, info.length, info.transform_descriptors)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    trainer = Trainer(sharded_ranks.trainer_config(str(tiny_model_path)))
    with pytest.raises(CheckpointError, match=f"^{ckpt / '.metadata'} cannot be loaded: .*outside"):
        dist_checkpoint.load(trainer, ckpt)
    assert not any(bool((m == 7.0).all()) for m in trainer.masters)


def test_a_damaged_sharded_checkpoint_is_one_line_naming_it(tmp_path, tiny_model_path):
    trainer = Trainer(sharded_ranks.trainer_config(str(tiny_model_path)))
    dist_checkpoint.save(trainer, tmp_path / "ckpt").result()
    shards = next((tmp_path / "ckpt").glob("*.distcp"))
    shards.write_bytes(shards.read_bytes()[:shards.stat().st_size // 2])
    with pytest.raises(CheckpointError) as refused:
        dist_checkpoint.load(trainer, tmp_path / "ckpt")
    assert str(refused.value).startswith(f"{tmp_path / 'ckpt'} cannot be loaded: ") and "\n" not in str(refused.value)
    metadata = tmp_path / "ckpt" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"^{metadata} cannot be loaded: "):
        dist_checkpoint.load(trainer, tmp_path / "ckpt")
