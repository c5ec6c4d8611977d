"""Fixtures of the tests of N trainer ranks: the one-process Trainer's results on the scenarios' batches,
a one-process run's checkpoint, and one 2-rank launch (gloo, CPU) that runs every scenario and resumes
that checkpoint, shared by the trainer and the checkpoint tests."""
from __future__ import annotations

import pytest
import torch

from nano_miles.trainer.checkpoint import save_checkpoint
from nano_miles.trainer.distributed import launch
from nano_miles.trainer.trainer import Trainer
from tests.nano_miles.trainer import sharded_ranks


@pytest.fixture(scope="session")
def one_process_results(tiny_model_path, tmp_path_factory):
    """The one-process Trainer on every scenario (one torch thread, as in the ranks):
    {name: (metrics, full state + "delta": masters after - before)}; "continued": the checkpointed
    scenario after its second update; "run": a run directory whose checkpoint holds it after its first."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = {}
        for name in sharded_ranks.SCENARIOS:
            trainer = Trainer(sharded_ranks.trainer_config(str(tiny_model_path), name))
            initial = sharded_ranks.full_state(trainer)["masters"]
            metrics = sharded_ranks.update(trainer, name)
            state = sharded_ranks.full_state(trainer)
            state["delta"] = {n: m - initial[n] for n, m in state["masters"].items()}
            results[name] = (metrics, state)
            if name == sharded_ranks.CHECKPOINTED:
                results["run"] = tmp_path_factory.mktemp("one_process") / "run"
                save_checkpoint(results["run"], trainer, {"step": 1, "data_position": 2})
                sharded_ranks.update(trainer, name)
                results["continued"] = (None, sharded_ranks.full_state(trainer))
        return results
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def two_rank_run(tmp_path_factory, tiny_model_path, one_process_results):
    """The folder where 2 ranks left each scenario's result (rank 0's), their DCP checkpoint (run/) and
    what they made of the one-process checkpoint (resumed.pt)."""
    out = tmp_path_factory.mktemp("two_ranks")
    launch(2, sharded_ranks.scenarios, (str(out), str(tiny_model_path), str(one_process_results["run"])))
    return out
