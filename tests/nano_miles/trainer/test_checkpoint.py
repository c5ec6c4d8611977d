"""Checkpoints are whole or absent, written in the background without a copy, and resume exactly;
resuming one runs no code from it and names a damaged file in one line; a checkpoint is a model folder.

Real tiny-random-qwen2 trainers on CPU. A crash mid-write is a real one: a child process whose file
size limit (RLIMIT_FSIZE) kills it with SIGXFSZ inside the second checkpoint's weights file.
"""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from nano_miles.rollout.batch import Trajectory, build_rollout_batch
from nano_miles.trainer.checkpoint import (CheckpointError, Checkpointer, export_model, finish_checkpoint, load_checkpoint,
                                   save_checkpoint, write_safetensors)
from nano_miles.models.prepare import resolve_model
from nano_miles.trainer.trainer import OptimConfig, Trainer, TrainerConfig
from nano_miles.trainer.checkpoint_files import check_resumable, checkpoint_folder

REPO = Path(__file__).resolve().parents[3]


def _trainer(**kw):
    return Trainer(TrainerConfig(model=str(resolve_model("tiny-random-qwen2")), optim=OptimConfig(lr=1e-3), **kw))


def _batch(seed):
    g = torch.Generator().manual_seed(seed)
    trajs = [Trajectory(prompt_ids=torch.randint(3, 1024, (6,), generator=g).tolist(),
                        response_ids=torch.randint(3, 1024, (5 + i,), generator=g).tolist(),
                        response_logprobs=[-1.0] * (5 + i), response_mask=[True] * (5 + i),
                        reward=float(i % 2), group_id="g") for i in range(4)]
    return build_rollout_batch(trajs), torch.tensor([1.0, -1.0, 0.5, -0.5])


def _state_of(trainer):
    """The masters and every AdamW state tensor (moments, step counts), copied."""
    moments = {f"{i}.{key}": t.clone() for i, state in trainer.optimizer.state_dict()["state"].items()
               for key, t in state.items()}
    return [m.detach().clone() for m in trainer.masters], moments


def test_roundtrip_restores_weights_step_rng_and_position(tmp_path):
    a = _trainer()
    with torch.no_grad():
        next(a.model.parameters()).add_(0.5)
    a.step = 3
    random.seed(11)
    torch.manual_seed(11)
    save_checkpoint(tmp_path, a, {"step": 3, "data_position": 6})
    expected_py, expected_torch = random.random(), torch.rand(2)

    b = _trainer()
    state = load_checkpoint(tmp_path, b)
    assert state["step"] == 3 and state["data_position"] == 6 and b.step == 3
    assert random.random() == expected_py and torch.equal(torch.rand(2), expected_torch)
    for (n, p), (_, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert torch.equal(p, q), n


def test_resume_after_a_background_checkpoint_continues_exactly(tmp_path):
    a = _trainer(dtype="bfloat16")  # FP32 masters apart from the bf16 compute weights
    a.train_step(*_batch(1))
    pending = save_checkpoint(tmp_path, a, {"step": 1, "data_position": 2}, background=True)
    # The write reads the live tensors; the next update waits for it instead of changing them under it.
    a.train_step(*_batch(2))
    assert pending.done()
    masters_a, moments_a = _state_of(a)

    b = _trainer(dtype="bfloat16")
    assert load_checkpoint(tmp_path, b)["step"] == 1 and b.step == 1
    b.train_step(*_batch(2))
    masters_b, moments_b = _state_of(b)
    assert all(torch.equal(x, y) for x, y in zip(masters_a, masters_b))
    assert moments_a.keys() == moments_b.keys() and all(torch.equal(moments_a[k], moments_b[k]) for k in moments_a)
    assert all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(b.params, b.masters))


CRASHING_CHILD = textwrap.dedent("""
    import resource, signal, sys, torch
    from nano_miles.trainer.checkpoint import save_checkpoint
    from nano_miles.models.prepare import resolve_model
    from nano_miles.trainer.trainer import OptimConfig, Trainer, TrainerConfig
    run_dir, limit = sys.argv[1], int(sys.argv[2])
    t = Trainer(TrainerConfig(model=str(resolve_model("tiny-random-qwen2")), optim=OptimConfig(lr=1e-3)))
    save_checkpoint(run_dir, t, {"step": 1, "data_position": 2})
    with torch.no_grad():
        t.params[0].add_(1.0)
    t.step = 2
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; the kernel's default is to kill
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))  # the next write past `limit` bytes kills us
    save_checkpoint(run_dir, t, {"step": 2, "data_position": 4}, background=True).wait()
    print("not killed")
""")


def test_a_crash_mid_write_leaves_the_previous_checkpoint_valid(tmp_path):
    first = _trainer()
    half = os.path.getsize(_weights_file(tmp_path / "probe", first)) // 2
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", CRASHING_CHILD, str(tmp_path), str(half)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGXFSZ, (proc.returncode, proc.stdout, proc.stderr)
    tmp_weights = tmp_path / "checkpoint.tmp" / "model.safetensors"
    assert tmp_weights.exists() and tmp_weights.stat().st_size == half  # it died inside the new weights file
    b = _trainer()
    state = load_checkpoint(tmp_path, b)
    assert state["step"] == 1 and b.step == 0
    for p, q in zip(first.params, b.params):  # step 1's weights: the initial ones
        assert torch.equal(p, q)
    save_checkpoint(tmp_path, b, {"step": 1, "data_position": 2})  # the next save clears the leftover
    assert not (tmp_path / "checkpoint.tmp").exists()


def _weights_file(folder: Path, trainer) -> Path:
    folder.mkdir()
    write_safetensors(folder / "model.safetensors", zip(trainer.names, trainer.masters))
    return folder / "model.safetensors"


def test_a_kill_between_the_two_renames_keeps_the_previous_checkpoint(tmp_path):
    a = _trainer()
    save_checkpoint(tmp_path, a, {"step": 1, "data_position": 2})
    (tmp_path / "checkpoint").rename(tmp_path / "checkpoint.old")  # as if killed right after the first rename
    (tmp_path / "checkpoint.tmp").mkdir()                         # and a half-written new one
    state = load_checkpoint(tmp_path, _trainer())
    assert state["step"] == 1 and (tmp_path / "checkpoint" / "model.safetensors").exists()


def test_a_failed_background_write_stops_the_next_update_with_the_cause(tmp_path):
    a = _trainer()
    (tmp_path / "checkpoint.tmp").write_text("a file where the folder must go")  # rmtree cannot clear it
    save_checkpoint(tmp_path, a, {"step": 1, "data_position": 2}, background=True)
    with pytest.raises(RuntimeError, match="writing the checkpoint failed"):
        a.train_step(*_batch(1))


def test_a_checkpoint_that_does_not_fit_the_model_is_refused_naming_the_tensor(tmp_path):
    a = _trainer()
    save_checkpoint(tmp_path, a, {"step": 1, "data_position": 2})
    weights = tmp_path / "checkpoint" / "model.safetensors"
    kept = [(n, t.clone()) for n, t in load_file(weights).items() if n != "model.norm.weight"]  # (off the mmap)
    write_safetensors(weights, kept)
    b = _trainer()
    with pytest.raises(ValueError, match="missing.*model.norm.weight"):
        load_checkpoint(tmp_path, b)
    assert b.step == 0


def test_no_checkpoint_is_none(tmp_path):
    assert load_checkpoint(tmp_path, _trainer()) is None


def test_the_final_policy_shares_the_checkpoints_weights_file(tmp_path):
    a = _trainer()
    a.train_step(*_batch(3))
    save_checkpoint(tmp_path, a, {"step": 1, "data_position": 2}, background=True)
    final = export_model(a, str(resolve_model("tiny-random-qwen2")), tmp_path / "final", tmp_path / "checkpoint")
    weights = final / "model.safetensors"
    assert weights.stat().st_ino == (tmp_path / "checkpoint" / "model.safetensors").stat().st_ino
    hf = AutoModelForCausalLM.from_pretrained(final)  # a HF folder: transformers loads it as it is
    for name, master in zip(a.names, a.masters):
        assert torch.equal(dict(hf.named_parameters())[name], master), name
    assert load_file(weights).keys() == set(a.names)

    # A completed run drops AdamW's state; resuming it restarts the moments and says so.
    finish_checkpoint(tmp_path, keep_optimizer=False)
    assert not (tmp_path / "checkpoint" / "optimizer.pt").exists()
    said = []
    b = _trainer()
    assert load_checkpoint(tmp_path, b, echo=said.append)["step"] == 1 and b.step == 1
    assert "AdamW's moments restart from zero" in said[0]
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() and not s["exp_avg_sq"].any()
               for s in b.optimizer.state.values())
    assert all(torch.equal(x, y) for x, y in zip(a.masters, b.masters))
    # A trainer that moved on since the checkpoint gets its own weights file, not the stale link.
    b.train_step(*_batch(4))
    again = export_model(b, str(resolve_model("tiny-random-qwen2")), tmp_path / "final", tmp_path / "checkpoint")
    assert (again / "model.safetensors").stat().st_nlink == 1


def test_checkpoints_by_time_and_by_steps(tmp_path):
    trainer = _trainer()
    by_steps = Checkpointer(tmp_path, trainer, every_steps=3, every_minutes=10)
    assert [s for s in range(1, 10) if by_steps.due(s)] == [3, 6, 9]
    by_time = Checkpointer(tmp_path, trainer, every_steps=0, every_minutes=10)
    assert not by_time.due(1)  # 10 minutes have not passed
    by_time.last_time -= 601
    assert by_time.due(2)
    by_time.save({"step": 2, "data_position": 4})
    assert not by_time.due(3)  # the clock restarted at the save
    assert "1 checkpoint(s)" in by_time.finish()  # (it waits for the write)
    # A checkpoint that blocked the loop for 100 s pushes the next one to 1000 s: never over a tenth.
    by_time.saved[-1] = (100.0, by_time.saved[-1][1])
    by_time.last_time -= 601
    assert not by_time.due(4)
    by_time.last_time -= 400
    assert by_time.due(4)
    assert json.loads((tmp_path / "checkpoint" / "state.json").read_text())["step"] == 2


def test_a_completed_runs_last_checkpoint_keeps_no_adamw_state_unless_asked(tmp_path):
    trainer = _trainer()
    trainer.train_step(*_batch(5))
    run = Checkpointer(tmp_path / "run", trainer, every_steps=1, every_minutes=10, last_step=2, keep_optimizer=False)
    run.save({"step": 1, "data_position": 2})
    trainer.wait_for_save()
    assert (tmp_path / "run" / "checkpoint" / "optimizer.pt").exists()  # mid-run: resumable exactly
    run.save({"step": 2, "data_position": 4})
    run.finish()
    assert not (tmp_path / "run" / "checkpoint" / "optimizer.pt").exists()
    assert json.loads((tmp_path / "run" / "checkpoint" / "state.json").read_text())["optimizer"] is False
    kept = Checkpointer(tmp_path / "kept", trainer, every_steps=1, every_minutes=10, last_step=2, keep_optimizer=True)
    kept.save({"step": 2, "data_position": 4})
    kept.finish()
    assert (tmp_path / "kept" / "checkpoint" / "optimizer.pt").exists()


# ---- nothing runs from a run directory; a damaged checkpoint is one line naming its file -----------

class CreatesFile:
    """Unpickled, it creates `marker` (the pickle calls open(marker, "w")): any command could run there."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def format_1_run(run_dir: Path, marker: Path) -> Path:
    """A run directory whose checkpoint is of format 1: the trainer's state as one pickle, trainer.pt,
    here a crafted one."""
    ckpt = run_dir / "checkpoint"
    ckpt.mkdir(parents=True)
    torch.save(CreatesFile(marker), ckpt / "trainer.pt")
    (ckpt / "state.json").write_text(json.dumps({
        "format": 1, "step": 1, "data_position": 2,
        "rng": {"python": list(random.getstate()), "torch": torch.get_rng_state().tolist()}}))
    return run_dir


def test_a_format_1_checkpoint_is_refused_and_its_pickle_never_runs(tmp_path):
    marker = tmp_path / "marker"
    run_dir = format_1_run(tmp_path / "run", marker)
    trainer = _trainer()
    with pytest.raises(CheckpointError) as refused:
        load_checkpoint(run_dir, trainer)
    assert not marker.exists()
    assert str(refused.value) == (f"{run_dir / 'checkpoint'} cannot be resumed: its state.json says format 1; only "
                                  "format 2 is read (format 1 keeps the trainer's state as a pickle, trainer.pt, "
                                  "which could run any code)")
    with pytest.raises(CheckpointError, match="format 1"):
        check_resumable(checkpoint_folder(run_dir))  # what `train --resume` checks before any model loads
    assert not marker.exists() and trainer.step == 0


def damaged_copies(tmp_path: Path) -> dict:
    """A whole checkpoint, copied once per damage: {what is damaged: (run dir, the file to name)}."""
    a = _trainer()
    a.train_step(*_batch(6))
    save_checkpoint(tmp_path / "whole", a, {"step": 1, "data_position": 2})
    damage = {
        "truncated weights": ("model.safetensors", lambda f: f.write_bytes(f.read_bytes()[:f.stat().st_size // 2])),
        "weights of another format": ("model.safetensors", lambda f: f.write_bytes(b"\x00" * 64)),
        "truncated optimizer state": ("optimizer.pt", lambda f: f.write_bytes(f.read_bytes()[:1000])),
        "state.json not JSON": ("state.json", lambda f: f.write_text('{"step": 1, "data_pos')),
        "state.json without a step": ("state.json", lambda f: f.write_text('{"data_position": 2}')),
        "state.json with a broken RNG": ("state.json", lambda f: f.write_text(json.dumps(
            dict(json.loads(f.read_text()), rng={"python": [3, [1, 2], None], "torch": [0]})))),
        "state.json with pending tasks that are not ids": ("state.json", lambda f: f.write_text(json.dumps(
            dict(json.loads(f.read_text()), stream={"position": 2, "passes": {}, "pending": [{"id": 1}]})))),
        "no state.json": ("state.json", lambda f: f.unlink()),
    }
    copies = {}
    for i, (what, (name, damage_it)) in enumerate(damage.items()):
        run_dir = tmp_path / f"damaged{i}"
        shutil.copytree(tmp_path / "whole", run_dir)
        damage_it(run_dir / "checkpoint" / name)
        copies[what] = (run_dir, run_dir / "checkpoint" / name)
    return copies


def test_a_damaged_checkpoint_is_one_line_naming_its_file(tmp_path):
    for what, (run_dir, damaged) in damaged_copies(tmp_path).items():
        before = {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()}
        for load in (load_checkpoint, lambda run_dir, _: check_resumable(checkpoint_folder(run_dir))):
            with pytest.raises(CheckpointError) as refused:
                load(run_dir, _trainer())
            message = str(refused.value)
            assert str(damaged) in message and "\n" not in message, (what, message)
        assert {p: p.read_bytes() for p in run_dir.rglob("*") if p.is_file()} == before, what  # nothing lost


def test_a_checkpoint_is_a_model_folder(tmp_path):
    """A run stopped before final/ leaves checkpoint/: it holds what final/ holds (config, tokenizer,
    the FP32 masters), so whatever takes a model takes it."""
    a = _trainer()
    a.train_step(*_batch(7))
    save_checkpoint(tmp_path, a, {"step": 1, "data_position": 2}, background=True)
    a.wait_for_save()
    ckpt = tmp_path / "checkpoint"
    assert resolve_model(ckpt) == ckpt
    hf = AutoModelForCausalLM.from_pretrained(ckpt)
    assert hf.dtype == torch.float32
    for name, master in zip(a.names, a.masters):
        assert torch.equal(dict(hf.named_parameters())[name], master), name
    base = AutoTokenizer.from_pretrained(resolve_model("tiny-random-qwen2"))
    assert AutoTokenizer.from_pretrained(ckpt)("ls -la /tmp").input_ids == base("ls -la /tmp").input_ids
    assert load_checkpoint(tmp_path, _trainer())["step"] == 1  # and it still resumes
