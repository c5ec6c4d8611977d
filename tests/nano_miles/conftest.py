"""Fixtures of the sharded-trainer tests: one 2-rank run (gloo, CPU) shared by the trainer and the
checkpoint tests, the single-process Trainer's results on the same batches to compare it with, and
this process as a world of one rank."""
from __future__ import annotations

import socket

import pytest
import torch

from nano_miles.trainer.distributed import destroy_distributed, init_distributed, launch
from nano_miles.trainer.trainer import Trainer
from tests.nano_miles.trainer import sharded_ranks


@pytest.fixture(scope="session")
def two_rank_run(tmp_path_factory, tiny_model_path):
    """The folder where 2 ranks left each scenario's result (rank 0's) and a DCP checkpoint."""
    out = tmp_path_factory.mktemp("two_ranks")
    launch(2, sharded_ranks.scenarios, (str(out), str(tiny_model_path)))
    return out


@pytest.fixture(scope="session")
def one_process_results(tiny_model_path):
    """The single-process Trainer on every scenario (one torch thread, as in the ranks):
    {name: (metrics, full state + "delta": masters after - before)}, and "continued": the
    checkpointed scenario after its second update."""
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
                sharded_ranks.update(trainer, name)
                results["continued"] = (None, sharded_ranks.full_state(trainer))
        return results
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def world_of_one(monkeypatch):
    """This process as rank 0 of a real 1-rank gloo group, set up as torchrun's environment would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK=0, WORLD_SIZE=1, LOCAL_RANK=0, MASTER_ADDR="127.0.0.1", MASTER_PORT=port).items():
        monkeypatch.setenv(key, str(value))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks and the reference ran
    env = init_distributed("cpu", timeout_s=60)
    try:
        yield env
    finally:
        destroy_distributed()
        torch.set_num_threads(threads)
