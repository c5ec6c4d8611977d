"""The sharded trainer (FSDP2, nano_miles/trainer/sharded.py): 2 ranks on gloo make exactly the update
that the single-process Trainer makes on the same batch, whatever the split of the groups."""
import pytest
import torch
from safetensors.torch import load_file

from nano_miles.trainer import dist_checkpoint
from nano_miles.trainer.distributed import launch
from nano_miles.trainer.sharded import ShardedTrainer, assign_groups
from nano_miles.trainer.trainer import Trainer
from tests.nano_miles.trainer import sharded_ranks
from tests.nano_miles.trainer.sharded_ranks import CHECKPOINTED, SCENARIOS
from tests.nano_miles.trainer.test_dist_checkpoint import assert_same_state


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_make_the_update_of_one_process(two_rank_run, one_process_results, tiny_model_path, name):
    """even groups; groups that do not split evenly (one rank runs filler passes to keep step); one
    group that all goes to rank 0; PPO mini-batches (updates_per_step=2); bf16 compute; the KL penalty
    to a frozen reference (sharded on the ranks, a whole copy in one process).

    With micro-batches of one row both sides compute every row alike and the FP32 weights agree to
    1e-6. With two rows per micro-batch the ranks pair other rows than one process does, and padding
    changes the float rounding; Adam's first step (lr * g / (|g| + eps)) amplifies that where |g| is
    near eps: one process alone moves by ~1e-5 between micro-batch sizes 1 and 2, so that is the
    bound there. In bf16 the updates are compared: the sharded masters start from the checkpoint's
    FP32 values, the single-process Trainer's from their bf16 rounding (it loads the model in bf16)."""
    got = torch.load(two_rank_run / f"{name}.pt")
    metrics, state = one_process_results[name]
    _, micro_batch_size, _, dtype = SCENARIOS[name]
    initial = load_file(str(tiny_model_path / "model.safetensors"))
    assert got["fp32"].keys() == state["masters"].keys()
    if dtype == "float32":
        worst = max(float((got["fp32"][n] - m).abs().max()) for n, m in state["masters"].items())
    else:
        worst = max(float((got["fp32"][n] - initial[n] - d).abs().max()) for n, d in state["delta"].items())
    bound = 1e-6 if micro_batch_size == 1 else 2e-5
    assert worst <= bound, f"{name}: the update differs from one process's by {worst:.2e}"
    moved = max(float((got["fp32"][n] - initial[n]).abs().max()) for n in state["masters"])
    assert moved > 5e-5  # the step did move the weights (lr 1e-4)
    for n, w in got["fp32"].items():  # the engine's bf16 weights: the FP32 masters rounded once
        assert got["bf16"][n].dtype == torch.bfloat16 and torch.equal(got["bf16"][n], w.to(torch.bfloat16)), n

    m = got["metrics"]
    assert m["response_tokens"] == metrics["response_tokens"] and m["step"] == metrics["step"]
    assert m.get("updates") == metrics.get("updates") and m["world_size"] == 2
    for key in ("pg_loss", "grad_norm", "entropy", "clip_frac", "ratio_mean", "ratio_max",
                "logprob_diff_mean", "logprob_diff_max", "tis_mean"):
        # kl: step 2's KL gradient carries step 1's rounding (sharded_ranks.OPTIM): its grad_norm agrees
        # to 1.3e-5 under torch 2.13 and transformers 5.24 (2026-12-03), the weights to the bound above
        rel = 1e-4 if name in sharded_ranks.KL_COEF and key == "grad_norm" else 1e-5
        assert m[key] == pytest.approx(metrics[key], rel=rel, abs=1e-7), key
    if name in sharded_ranks.KL_COEF:  # the second mini-batch's policy had moved from the reference
        # k3 = exp(d) - d - 1 ~ d^2 / 2 cancels in FP32: each token's value is off by up to ~6e-8
        assert m["kl_ref"] > 1e-6 and m["kl_ref"] == pytest.approx(metrics["kl_ref"], abs=1e-8)


def test_a_nan_in_one_ranks_shards_stops_every_rank_at_that_step(two_rank_run):
    """Only rank 1's shards went NaN (sharded_ranks._nan_on_one_rank); rank 0 stops too (the check
    ends in an all-reduce), so no rank goes on alone into collectives the other never joins."""
    assert (two_rank_run / "nan_rank0.txt").read_text() == \
        "optimizer step 2 left NaN or infinite values in the weights (on another rank)"
    assert (two_rank_run / "nan_rank1.txt").read_text() == \
        "optimizer step 2 left NaN or infinite values in model.embed_tokens.weight"


@pytest.mark.parametrize("name", ["uneven_mb2", "minibatches", "bf16", "kl"])
def test_one_sharded_rank_makes_the_update_of_one_process(world_of_one, one_process_results, tiny_model_path, name):
    """With one rank the sharded trainer skips what only sharing needs (one FSDP group; the model stays
    gathered from step to step and takes the new weights in one copy; FP32 gradients accumulate over the
    micro-batches and reach the shards once): the update is still the one process's, micro-batch for
    micro-batch, also with two optimizer steps in an update (minibatches) and with a frozen reference,
    whose gathered copy must not follow the policy's (kl)."""
    trainer = ShardedTrainer(sharded_ranks.trainer_config(str(tiny_model_path), name), world_of_one)
    initial = sharded_ranks.full_state(trainer)["masters"]
    metrics = sharded_ranks.update(trainer, name)
    got = sharded_ranks.full_state(trainer)["masters"]
    expected, state = one_process_results[name]
    worst = max(float((got[n] - initial[n] - d).abs().max()) for n, d in state["delta"].items())
    assert worst <= 1e-6, f"{name}: the update differs from one process's by {worst:.2e}"
    assert metrics["world_size"] == 1 and metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)


def test_one_sharded_rank_checkpoint_resumes_on_two_ranks(tmp_path, world_of_one, one_process_results,
                                                          tiny_model_path):
    """One rank shards the model as one FSDP group, N ranks as a group per decoder layer: the parameters
    are the same DTensors under the same names, so a checkpoint of one rank resumes on two exactly (and
    two ranks' on one: tests/nano_miles/trainer/test_dist_checkpoint.py)."""
    trainer = ShardedTrainer(sharded_ranks.trainer_config(str(tiny_model_path), CHECKPOINTED), world_of_one)
    assert len(trainer.fsdp_modules) == 1  # the root alone
    sharded_ranks.update(trainer, CHECKPOINTED)
    dist_checkpoint.save(trainer, tmp_path / "ckpt", background=False)
    launch(2, sharded_ranks.resume_single_process, (str(tmp_path / "ckpt"), str(tmp_path), str(tiny_model_path)))
    got = torch.load(tmp_path / "resumed.pt")
    assert_same_state(got["loaded"], one_process_results[CHECKPOINTED][1], "2 ranks from one sharded rank's checkpoint")
    continued = one_process_results["continued"][1]["masters"]
    worst = max(float((m - continued[n]).abs().max()) for n, m in got["continued"]["masters"].items())
    assert worst <= 1e-6

    # The one rank keeps its model gathered between steps: loading the checkpoint back must reach it too.
    sharded_ranks.update(trainer, CHECKPOINTED)
    dist_checkpoint.load(trainer, tmp_path / "ckpt")
    sharded_ranks.update(trainer, CHECKPOINTED)
    worst = max(float((m.full_tensor() - continued[n]).abs().max()) for n, m in zip(trainer.names, trainer.masters))
    assert worst <= 1e-6


@pytest.mark.gpu
def test_two_gpus_over_nccl_make_the_update_of_one_gpu(tmp_path, tiny_model_path):
    """The same scenarios with NCCL, one GPU per rank, against the single-process Trainer on cuda:0.
    The updates are compared (bf16: the masters start apart, see above); GPU kernels sum in orders
    of their own (atomics in the embedding's backward), hence the micro-batch bound of 2e-5."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    launch(2, sharded_ranks.scenarios, (str(tmp_path), str(tiny_model_path), "cuda"), device_type="cuda")
    initial = load_file(str(tiny_model_path / "model.safetensors"))
    for name in SCENARIOS:
        trainer = Trainer(sharded_ranks.trainer_config(str(tiny_model_path), name, device="cuda:0"))
        before = {n: m.detach().float().cpu() for n, m in zip(trainer.names, trainer.masters)}
        metrics = sharded_ranks.update(trainer, name)
        got = torch.load(tmp_path / f"{name}.pt", map_location="cpu")
        worst = max(float((got["fp32"][n] - initial[n] - (m.detach().float().cpu() - before[n])).abs().max())
                    for n, m in zip(trainer.names, trainer.masters))
        assert worst <= 2e-5, f"{name}: the update differs from one GPU's by {worst:.2e}"
        assert got["metrics"]["response_tokens"] == metrics["response_tokens"]
        assert got["metrics"]["pg_loss"] == pytest.approx(metrics["pg_loss"], rel=1e-3, abs=1e-6)


def test_weights_are_gathered_whole_from_uneven_shards(two_rank_run):
    """dim 0 of 5 rows on 2 ranks is 3 + 2; of 1 row, 1 + nothing: rank 0 gets the whole tensors."""
    got = torch.load(two_rank_run / "odd_shapes.pt")
    assert torch.equal(got["odd0"], torch.arange(15.0).view(5, 3))
    assert torch.equal(got["odd1"], torch.arange(3.0).view(1, 3))


def test_groups_go_whole_to_the_least_loaded_rank():
    ids = ["a", "a", "b", "b", "b", "c", "c"]
    lengths = [10, 10, 3, 3, 3, 8, 8]  # a: 20 tokens, c: 16, b: 9
    assert assign_groups(ids, lengths, 2) == [[0, 1], [2, 3, 4, 5, 6]]
    assert assign_groups(ids, lengths, 3) == [[0, 1], [5, 6], [2, 3, 4]]
    assert assign_groups(ids, lengths, 1) == [list(range(7))]
    assert assign_groups(["a", "a"], [5, 5], 3) == [[0, 1], [], []]  # more ranks than groups


def test_a_sharded_rank_scores_at_the_rollout_temperature_like_one_process(world_of_one, tiny_model_path):
    """train hands rollout.temperature to the ranks' TrainerConfig: their log-probs are of softmax(logits / T)."""
    from nano_miles.rollout.batch import build_rollout_batch
    from nano_miles.trainer.trainer import TrainerConfig
    batch = build_rollout_batch(sharded_ranks.make_trajs((2, 2)))
    cfg = TrainerConfig(model=str(tiny_model_path), micro_batch_size=1, temperature=0.7)
    sharded = ShardedTrainer(cfg, world_of_one).logprobs(batch)
    one = Trainer(cfg).logprobs(batch)
    plain = Trainer(TrainerConfig(model=str(tiny_model_path), micro_batch_size=1)).logprobs(batch)
    mask = batch.loss_mask
    assert (sharded[mask] - one[mask]).abs().max() <= 1e-5
    assert (plain[mask] - one[mask]).abs().max() > 1e-2
