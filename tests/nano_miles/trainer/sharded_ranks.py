"""What the trainer's ranks run in the tests of N ranks (started by nano_miles.trainer.distributed.launch
as functions, or as `python -m tests.nano_miles.trainer.sharded_ranks kill|hang OUT_DIR [MODEL]`), and
the batches the tests and the ranks share. Rank 0 writes what it saw to OUT_DIR; the tests compare it
with the one-process Trainer on the same batches."""
from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from nano_miles.engine.weights import NonFiniteWeights
from nano_miles.rollout.batch import Trajectory
from nano_miles.trainer import fsdp
from nano_miles.trainer.checkpoint import load_checkpoint, save_checkpoint
from nano_miles.trainer.distributed import main_guard, run_rank
from nano_miles.trainer.loss import AdvantageConfig, LossConfig
from nano_miles.trainer.reference import ReferencePolicy
from nano_miles.trainer.trainer import OptimConfig, Trainer, TrainerConfig
from nano_miles.trainer.update import policy_update

# name -> (group sizes, micro_batch_size, updates_per_step, compute dtype)
SCENARIOS = {
    "even": ((2, 2, 2, 2), 1, 1, "float32"),
    "uneven": ((3, 2, 3), 1, 1, "float32"),          # 3 groups on 2 ranks: 5 micro-batches vs 3 (+ 2 fillers)
    "uneven_mb2": ((3, 2, 3), 2, 1, "float32"),      # rows padded together differ from one process's pairs
    "one_group": ((3,), 1, 1, "float32"),            # rank 1 has no row: it only keeps step with rank 0
    "minibatches": ((2, 3, 2, 1), 1, 2, "float32"),  # PPO: two optimizer steps of whole groups, lr decaying
    "bf16": ((3, 2, 3), 1, 1, "bfloat16"),           # bf16 compute, FP32 gradients and masters
    "kl": ((2, 3, 2, 1), 1, 2, "float32"),           # KL to the frozen initial policy (moved from on step 2)
    "tempered": ((2, 2, 2, 2), 1, 1, "float32"),     # even's batch sampled at T=0.7: log-probs of softmax(logits / T)
}
KL_COEF = {"kl": 1.0}
TEMPERATURE = {"tempered": 0.7}
# The KL's gradient at step 2 is proportional to how far step 1 moved the policy, so it carries step
# 1's differences (Adam's lr * g / (|g| + eps), amplified where |g| ~ eps) into step 2. With eps at
# the gradients' scale Adam's step is ~ lr * g / eps, and the two sides agree to rounding again.
OPTIM = {"kl": OptimConfig(lr=1e-2, eps=1e-2),
         "minibatches": OptimConfig(lr=1e-4, lr_schedule="linear", decay_steps=2, min_lr_ratio=0.25)}
CHECKPOINTED = "minibatches"  # saved (in the background) after its update, then trained on once more


def make_trajs(sizes, seed: int = 0, vocab: int = 1024) -> list[Trajectory]:
    """Groups of the given sizes; lengths differ, odd rows have a masked observation, rewards vary."""
    g = torch.Generator().manual_seed(seed)
    trajs, k = [], 0
    for gi, size in enumerate(sizes):
        for _ in range(size):
            P, R = 4 + 3 * (k % 4), 5 + 2 * k
            mask = [True] * R
            if k % 2:
                mask[2:4] = [False, False]
            trajs.append(Trajectory(prompt_ids=torch.randint(3, vocab, (P,), generator=g).tolist(),
                                    response_ids=torch.randint(3, vocab, (R,), generator=g).tolist(),
                                    response_logprobs=[-1.0] * R, response_mask=mask,
                                    reward=float((k * 7) % 3), group_id=f"g{gi}"))
            k += 1
    return trajs


def trainer_config(model: str, name: str = "even", device: str = "cpu") -> TrainerConfig:
    _, micro_batch_size, _, dtype = SCENARIOS[name]
    if dtype == "float32":  # a bf16 trainer on a GPU turns on TF32 for the whole process: not for FP32 ones
        torch.set_float32_matmul_precision("highest")
    return TrainerConfig(model=model, device=device, optim=OPTIM.get(name, OptimConfig(lr=1e-4)),
                         micro_batch_size=micro_batch_size, dtype=dtype, temperature=TEMPERATURE.get(name, 1.0),
                         loss=LossConfig(kl_coef=KL_COEF.get(name, 0.0)))


def update(trainer, name: str) -> dict:
    sizes, _, updates, _ = SCENARIOS[name]
    reference = ReferencePolicy(trainer) if trainer.cfg.loss.kl_coef > 0 else None  # the policy before this update
    metrics, skipped = policy_update(trainer, make_trajs(sizes), AdvantageConfig(), pad_id=0,
                                     echo=lambda *_: None, updates=updates, reference=reference)
    assert skipped is None, skipped
    return metrics


def full_state(trainer) -> dict:
    """Masters and AdamW moments as whole FP32 tensors (with N ranks a collective: every rank gathers)."""
    def whole(t):
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
    return {"masters": {n: whole(m) for n, m in zip(trainer.names, trainer.masters)}, "step": trainer.step,
            "optim": {n: {k: whole(v) for k, v in trainer.optimizer.state[m].items()}
                      for n, m in zip(trainer.names, trainer.masters)}}


# ----------------------------------------------------------------------------- what the ranks run

def _scenarios(env, out: str, model: str, single_process_run: str | None) -> None:
    """Every scenario's update on the ranks; a DCP checkpoint written in the background while the ranks
    train on; then a one-process run's checkpoint (checkpoint.py's files) resumed on the ranks."""
    torch.set_num_threads(1)
    for name in SCENARIOS:
        trainer = Trainer(trainer_config(model, name), env)
        metrics = update(trainer, name)
        fp32 = dict(trainer.named_weights(torch.float32))
        # small buckets: several gathers, and tensors that fill a bucket on their own
        bf16 = {n: t for bucket in trainer.iter_full_weights(torch.bfloat16, bucket_bytes=40_000) for n, t in bucket}
        if env.rank == 0:
            torch.save({"metrics": metrics, "fp32": fp32, "bf16": bf16}, Path(out) / f"{name}.pt")
        else:
            assert fp32 == {} and bf16 == {}
        if name == "even":  # rows that do not split evenly, or fewer rows than ranks (rank 1 holds none)
            odd = [(f"odd{i}", distribute_tensor(torch.arange(float(d0 * 3)).view(d0, 3), trainer.params[0].device_mesh,
                                                 [Shard(0)])) for i, d0 in enumerate((5, 1))]
            gathered = fsdp.gather_bucket(odd, torch.float32, trainer.device)
            if env.rank == 0:
                torch.save(dict(gathered), Path(out) / "odd_shapes.pt")
        if name == CHECKPOINTED:
            save_checkpoint(Path(out) / "run", trainer, {"step": 1, "data_position": 2}, background=True)
            update(trainer, name)  # changes every master while the checkpoint is being written
            trainer.wait_for_save()
    if single_process_run:
        trainer = Trainer(trainer_config(model, CHECKPOINTED), env)
        load_checkpoint(Path(single_process_run), trainer, echo=lambda *_: None)
        loaded = full_state(trainer)
        update(trainer, CHECKPOINTED)
        continued = full_state(trainer)
        if env.rank == 0:
            torch.save({"loaded": loaded, "continued": continued}, Path(out) / "resumed.pt")
    _nan_on_one_rank(env, out, model)


def _nan_on_one_rank(env, out: str, model: str) -> None:
    """Rank 1's second optimizer step alone turns weights NaN (a negative second moment in its shard of
    the first tensor); each rank writes whether it stopped there, and with which message."""
    trainer = Trainer(trainer_config(model), env)
    update(trainer, "even")
    if env.rank == 1:
        state = trainer.optimizer.state[trainer.masters[0]]
        state["exp_avg_sq"].to_local().view(-1)[0] = -1.0  # (to_local() is the shard's own storage)
    try:
        update(trainer, "even")
        outcome = "went on"
    except NonFiniteWeights as e:
        outcome = str(e)
    (Path(out) / f"nan_rank{env.rank}.txt").write_text(outcome)


def scenarios(out: str, model: str, single_process_run: str | None = None, device_type: str = "cpu") -> None:
    run_rank(_scenarios, out, model, single_process_run, device_type=device_type, timeout_s=60)


def _kill(env, out: str, model: str) -> None:
    """Rank 1 dies inside the second decoder layer's forward of its first micro-batch; rank 0 is then
    in the middle of the same step, in FSDP's collectives."""
    torch.set_num_threads(1)
    trainer = Trainer(trainer_config(model), env)
    if env.rank == 1:
        def die(*_):
            Path(out, "kill_at").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        trainer.model.base_model.layers[1].register_forward_hook(die)
    update(trainer, "even")
    Path(out, f"finished_{env.rank}").write_text("")


def _hang(env, out: str) -> None:
    """Rank 1 stops answering; rank 0 waits for it in a collective."""
    if env.rank == 1:
        Path(out, "hang_at").write_text(str(time.time()))
        time.sleep(3600)
    torch.distributed.all_reduce(torch.ones(1))
    Path(out, f"finished_{env.rank}").write_text("")


@main_guard
def main(argv: list[str]) -> None:
    mode, out, *model = argv
    timeout_s = float(os.environ.get("TEST_TIMEOUT_S", 30))
    if mode == "kill":
        run_rank(_kill, out, *model, device_type="cpu", timeout_s=timeout_s)
    elif mode == "hang":
        run_rank(_hang, out, device_type="cpu", timeout_s=timeout_s)
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
