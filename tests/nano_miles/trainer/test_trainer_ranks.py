"""The trainer on N ranks (FSDP2, nano_miles/trainer/fsdp.py): 2 ranks on gloo make exactly the update
that one process makes on the same batch, whatever the split of the groups; and one process applies
no FSDP at all."""
import pytest
import torch
from safetensors.torch import load_file

from nano_miles.trainer.distributed import launch
from nano_miles.trainer.fsdp import assign_groups
from nano_miles.trainer.trainer import Trainer
from tests.nano_miles.trainer import sharded_ranks
from tests.nano_miles.trainer.sharded_ranks import SCENARIOS


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_make_the_update_of_one_process(two_rank_run, one_process_results, tiny_model_path, name):
    """even groups; groups that do not split evenly (one rank runs filler passes to keep step); one
    group that all goes to rank 0; PPO mini-batches (updates_per_step=2); bf16 compute; the KL penalty
    to a frozen reference (sharded on the ranks, a whole copy in one process); rollouts at T=0.7.

    With micro-batches of one row both sides compute every row alike and the FP32 weights agree to
    1e-6. With two rows per micro-batch the ranks pair other rows than one process does, and padding
    changes the float rounding; Adam's first step (lr * g / (|g| + eps)) amplifies that where |g| is
    near eps: one process alone moves by ~1e-5 between micro-batch sizes 1 and 2, so that is the
    bound there. In bf16 the updates are compared: the sharded masters start from the checkpoint's
    FP32 values, one process's from their bf16 rounding (it loads the model in bf16)."""
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
    assert m["lr"] == metrics["lr"]
    if name == "minibatches":  # the second optimizer step's, on the linear decay
        assert m["lr"] == pytest.approx(0.625e-4)
    assert m.get("updates") == metrics.get("updates") and (m["world_size"], metrics["world_size"]) == (2, 1)
    for key in ("pg_loss", "grad_norm", "entropy", "clip_frac", "ratio_mean", "ratio_max",
                "logprob_diff_mean", "logprob_diff_max", "tis_mean"):
        # kl: step 2's KL gradient carries step 1's rounding (sharded_ranks.OPTIM): its grad_norm
        # agrees to ~1e-5, the weights to the bound above
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


def test_rollouts_sampled_at_a_temperature_are_scored_at_it_on_the_ranks(one_process_results):
    """The ranks' log-probs are of softmax(logits / T) as one process's are (above): scored at T=1
    instead, every token of the tempered scenario would look off-policy."""
    (tempered, _), (plain, _) = one_process_results["tempered"], one_process_results["even"]
    assert tempered["logprob_diff_mean"] != pytest.approx(plain["logprob_diff_mean"], rel=1e-3)


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


def test_one_process_is_plain_parameters_and_masters_without_fsdp(tiny_model_path):
    """World size 1 (no process group, or torchrun's one rank) applies no FSDP: the compute model holds
    plain bf16 tensors, the FP32 masters are separate tensors that AdamW (fused) owns."""
    trainer = Trainer(sharded_ranks.trainer_config(str(tiny_model_path), "bf16"))
    assert trainer.root is None and trainer.env is None and trainer.world_size == 1
    assert all(type(p) is torch.nn.Parameter and p.dtype == torch.bfloat16 for p in trainer.params)
    assert all(m.dtype == torch.float32 and m is not p for m, p in zip(trainer.masters, trainer.params))
    assert trainer.optimizer.param_groups[0]["fused"]


@pytest.mark.gpu
def test_two_gpus_over_nccl_make_the_update_of_one_gpu(tmp_path, tiny_model_path):
    """The same scenarios with NCCL, one GPU per rank, against one process on cuda:0. The updates are
    compared (bf16: the masters start apart, see above); GPU kernels sum in orders of their own
    (atomics in the embedding's backward), hence the micro-batch bound of 2e-5."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    launch(2, sharded_ranks.scenarios, (str(tmp_path), str(tiny_model_path), None, "cuda"), device_type="cuda")
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
