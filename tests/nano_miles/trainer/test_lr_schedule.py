"""The learning-rate schedule (nano_miles/trainer/lr_schedule.py): warm-up, then constant, cosine or linear
decay to min_lr_ratio; the trainer steps on it (on N ranks too: test_trainer_ranks.py's minibatches), and
train ends a decay with the run."""
import math

import pytest
import torch

from nano_miles.config import ConfigError, load_config, parse_set
from nano_miles.trainer.lr_schedule import lr_at
from nano_miles.train import TrainConfig
from nano_miles.trainer.trainer import OptimConfig
from tests.nano_miles.trainer.test_trainer import make_batch, make_trainer, model_path  # noqa: F401 (fixture)


def test_constant_is_the_default_and_warm_up_ramps_linearly():
    assert [lr_at(OptimConfig(lr=1.0), s) for s in (0, 5, 500)] == [1.0, 1.0, 1.0]
    warm = OptimConfig(lr=1.0, warmup_steps=4)
    assert [lr_at(warm, s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_goes_from_lr_to_the_floor_by_decay_steps_and_stays_there():
    cos = OptimConfig(lr=2.0, lr_schedule="cosine", warmup_steps=2, decay_steps=12, min_lr_ratio=0.1)
    assert lr_at(cos, 1) == 2.0                        # the last warm-up step reaches lr
    assert lr_at(cos, 2) == pytest.approx(2.0)         # decay starts at lr
    assert lr_at(cos, 7) == pytest.approx(2.0 * (0.1 + 0.9 * 0.5))  # half way: the mean of lr and the floor
    assert lr_at(cos, 12) == pytest.approx(0.2) and lr_at(cos, 100) == pytest.approx(0.2)
    values = [lr_at(cos, s) for s in range(2, 13)]
    assert all(a > b for a, b in zip(values, values[1:]))


def test_linear_decays_in_equal_steps():
    lin = OptimConfig(lr=1.0, lr_schedule="linear", decay_steps=4)
    assert [lr_at(lin, s) for s in range(6)] == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])


def test_a_decay_without_a_horizon_is_refused_not_guessed():
    with pytest.raises(ValueError, match="needs optim.decay_steps"):
        lr_at(OptimConfig(lr=1.0, lr_schedule="cosine"), 3)


@pytest.mark.parametrize("fields, message", [
    ({"lr_schedule": "step"}, "optim.lr_schedule must be one of constant, cosine, linear"),
    ({"warmup_steps": -1}, "must be >= 0"),
    ({"min_lr_ratio": 1.5}, "optim.min_lr_ratio must be in"),
    ({"warmup_steps": 10, "decay_steps": 10}, "must be past optim.warmup_steps"),
])
def test_bad_schedules_are_one_line_errors(fields, message):
    with pytest.raises(ValueError, match=message):
        OptimConfig(**fields)


def test_train_refuses_a_warm_up_as_long_as_the_run():
    items = ["steps=2", "updates_per_step=2", "optim.lr_schedule=cosine", "optim.warmup_steps=4"]
    with pytest.raises(ConfigError, match="the run has only 4 optimizer steps"):
        load_config(TrainConfig, overrides=parse_set(items))
    assert load_config(TrainConfig, overrides=parse_set(items[:-1])).optim.lr_schedule == "cosine"


def test_the_trainer_steps_on_the_schedule(model_path):  # noqa: F811
    optim = OptimConfig(lr=1e-3, lr_schedule="cosine", warmup_steps=1, decay_steps=3, min_lr_ratio=0.5)
    trainer = make_trainer(model_path, optim=optim)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    used = [trainer.train_step(make_batch(seed=s), torch.tensor([1.0, -1.0, 1.0, -1.0]))["lr"] for s in range(4)]
    assert used == pytest.approx([lr_at(optim, s) for s in range(4)])
    assert used == pytest.approx([1e-3, 1e-3, 1e-3 * (0.5 + 0.5 * 0.5 * (1 + math.cos(math.pi / 2))), 5e-4])
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))
