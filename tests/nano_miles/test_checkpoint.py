"""Checkpoints are whole or absent; RNG and data position come back exactly."""
import random

import torch

from nano_miles.checkpoint import load_checkpoint, save_checkpoint
from nano_miles.models import resolve_model
from nano_miles.trainer import Trainer, TrainerConfig


def _trainer():
    return Trainer(TrainerConfig(model=str(resolve_model("tiny-random-qwen2"))))


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


def test_a_kill_between_the_two_renames_keeps_the_previous_checkpoint(tmp_path):
    a = _trainer()
    save_checkpoint(tmp_path, a, {"step": 1, "data_position": 2})
    (tmp_path / "checkpoint").rename(tmp_path / "checkpoint.old")  # as if killed right after the first rename
    (tmp_path / "checkpoint.tmp").mkdir()                         # and a half-written new one
    state = load_checkpoint(tmp_path, _trainer())
    assert state["step"] == 1 and (tmp_path / "checkpoint" / "trainer.pt").exists()


def test_no_checkpoint_is_none(tmp_path):
    assert load_checkpoint(tmp_path, _trainer()) is None
