"""Sharded checkpoints through torch.distributed.checkpoint (nano_miles/trainer/dist_checkpoint.py): saved by
2 ranks in the background, resumed by 1 rank (sharded or the single-process Trainer) exactly; and a
single-process checkpoint resumed by 2 ranks exactly. Loading one runs no code from it: crafted
pickles where DCP unpickles (.metadata, object entries) are refused, and a damaged one is one line."""
import io
import pickle

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

from nano_miles.trainer import dist_checkpoint
from nano_miles.trainer.checkpoint import CheckpointError, save_checkpoint
from nano_miles.trainer.distributed import launch
from nano_miles.trainer.sharded import ShardedTrainer
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


def test_two_ranks_checkpoint_resumes_on_one_sharded_rank(two_rank_run, one_process_results, tiny_model_path,
                                                          world_of_one):
    """The checkpoint was written in the background while the ranks took another step: it holds the
    state of the moment it was saved, and one rank continues from it as one process would."""
    trainer = ShardedTrainer(sharded_ranks.trainer_config(str(tiny_model_path), CHECKPOINTED), world_of_one)
    dist_checkpoint.load(trainer, two_rank_run / "ckpt")
    assert_same_state(sharded_ranks.full_state(trainer), one_process_results[CHECKPOINTED][1], "1 sharded rank")
    sharded_ranks.update(trainer, CHECKPOINTED)
    continued = one_process_results["continued"][1]["masters"]
    worst = max(float((m.full_tensor() - continued[n]).abs().max()) for n, m in zip(trainer.names, trainer.masters))
    assert worst <= 1e-6


def test_the_single_process_trainer_loads_a_sharded_checkpoint(two_rank_run, one_process_results, tiny_model_path):
    trainer = Trainer(sharded_ranks.trainer_config(str(tiny_model_path), CHECKPOINTED))
    dist_checkpoint.load(trainer, two_rank_run / "ckpt")
    assert_same_state(sharded_ranks.full_state(trainer), one_process_results[CHECKPOINTED][1], "the Trainer")


def test_a_single_process_checkpoint_resumes_on_two_ranks(tmp_path, one_process_results, tiny_model_path):
    """checkpoint.py's files (whole safetensors, torch.save'd AdamW state): each rank reads its rows,
    and the 2 ranks continue as the one process does."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the fixture's one process ran
    try:
        trainer = Trainer(sharded_ranks.trainer_config(str(tiny_model_path), CHECKPOINTED))
        sharded_ranks.update(trainer, CHECKPOINTED)
    finally:
        torch.set_num_threads(threads)
    save_checkpoint(tmp_path / "run", trainer, {"step": 1})
    launch(2, sharded_ranks.resume_single_process,
           (str(tmp_path / "run" / "checkpoint"), str(tmp_path), str(tiny_model_path)))
    got = torch.load(tmp_path / "resumed.pt")
    assert_same_state(got["loaded"], sharded_ranks.full_state(trainer), "2 ranks from one process's checkpoint")
    continued = one_process_results["continued"][1]["masters"]
    worst = max(float((m - continued[n]).abs().max()) for n, m in got["continued"]["masters"].items())
    assert worst <= 1e-6


def test_a_background_save_keeps_the_saved_moment_and_replaces_the_old_one(tmp_path, tiny_model_path):
    trainer = Trainer(sharded_ranks.trainer_config(str(tiny_model_path)))
    sharded_ranks.update(trainer, "even")
    dist_checkpoint.save(trainer, tmp_path / "ckpt", background=False)  # an older checkpoint to replace
    sharded_ranks.update(trainer, "even")
    saved = sharded_ranks.full_state(trainer)
    pending = dist_checkpoint.save(trainer, tmp_path / "ckpt")
    with torch.no_grad():
        for m in trainer.masters:
            m.add_(1.0)  # what the next step would do while the files are written
    pending.wait()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no .tmp / .old left behind
    fresh = Trainer(sharded_ranks.trainer_config(str(tiny_model_path)))
    dist_checkpoint.load(fresh, tmp_path / "ckpt")
    assert fresh.step == 2
    got = sharded_ranks.full_state(fresh)
    for n, m in saved["masters"].items():
        assert torch.equal(got["masters"][n], m), n
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(got["optim"][n][k], saved["optim"][n][k]), (n, k)


def test_loading_a_folder_that_is_no_checkpoint_says_so(tmp_path, tiny_model_path):
    trainer = Trainer(sharded_ranks.trainer_config(str(tiny_model_path)))
    with pytest.raises(FileNotFoundError, match="not a distributed checkpoint"):
        dist_checkpoint.load(trainer, tmp_path)


def test_a_crafted_metadata_pickle_never_runs(tmp_path, tiny_model_path):
    """DCP's own reader unpickles .metadata with pickle.load: a crafted one ran any code."""
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
    dist_checkpoint.save(trainer, tmp_path / "ckpt", background=False)
    crafted = io.BytesIO()
    torch.save(CreatesFile(marker), crafted)
    (tmp_path / "ckpt" / "crafted.distcp").write_bytes(crafted.getvalue())
    metadata = dist_checkpoint.read_metadata(tmp_path / "ckpt")
    metadata.storage_data[MetadataIndex("trainer.step")] = _StorageInfo("crafted.distcp", 0, len(crafted.getvalue()))
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(CheckpointError, match=f"^{tmp_path / 'ckpt'} cannot be loaded: UnpicklingError: "):
        dist_checkpoint.load(Trainer(sharded_ranks.trainer_config(str(tiny_model_path))), tmp_path / "ckpt")
    assert not marker.exists()


def test_a_damaged_sharded_checkpoint_is_one_line_naming_it(tmp_path, tiny_model_path):
    trainer = Trainer(sharded_ranks.trainer_config(str(tiny_model_path)))
    dist_checkpoint.save(trainer, tmp_path / "ckpt", background=False)
    shards = next((tmp_path / "ckpt").glob("*.distcp"))
    shards.write_bytes(shards.read_bytes()[:shards.stat().st_size // 2])
    with pytest.raises(CheckpointError) as refused:
        dist_checkpoint.load(trainer, tmp_path / "ckpt")
    assert str(refused.value).startswith(f"{tmp_path / 'ckpt'} cannot be loaded: ") and "\n" not in str(refused.value)
    metadata = tmp_path / "ckpt" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"^{metadata} cannot be loaded: "):
        dist_checkpoint.load(trainer, tmp_path / "ckpt")
