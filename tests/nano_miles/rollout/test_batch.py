"""build_rollout_batch: padding and the shift-by-one rule, on cases worked out by hand."""
import json

import pytest
import torch

from nano_miles.rollout.batch import Trajectory, build_rollout_batch, load_trajectories

T, F = True, False


def test_single_turn_hand_computed():
    # prompt [10, 11, 12] (P=3), response [20, 21] (R=2): sequence length 5, prediction positions 0..3.
    # Token 20 sits at position 3 and is predicted by logits at position 2; token 21 (pos 4) by pos 3.
    t = Trajectory([10, 11, 12], [20, 21], [-0.5, -1.5], [T, T], reward=1.0, group_id="g0", task_id="x")
    b = build_rollout_batch([t], pad_id=99)
    assert b.tokens.tolist() == [[10, 11, 12, 20, 21]]
    assert b.tokens.dtype == torch.long
    assert b.attention_mask.tolist() == [[T, T, T, T, T]]
    assert b.loss_mask.tolist() == [[F, F, T, T]]
    assert b.rollout_logprobs.tolist() == [[0.0, 0.0, -0.5, -1.5]]
    assert b.rollout_logprobs.dtype == torch.float32


def test_two_observations_and_padding():
    # A: prompt [1, 2] | act [3, 4] | obs [5] | act [6] | obs [7, 8] | act [9]
    #    P=2, R=7, positions 0..8; response occupies prediction positions [1, 8).
    a = Trajectory(
        prompt_ids=[1, 2],
        response_ids=[3, 4, 5, 6, 7, 8, 9],
        response_logprobs=[-0.1, -0.2, 0.0, -0.3, 0.0, 0.0, -0.4],
        response_mask=[T, T, F, T, F, F, T],
        reward=0.5, group_id="g", task_id="ta", weight_versions=["3", "3", "4"], num_turns=3,
    )
    # B: prompt [1, 2, 3, 4] | act [5]   P=4, R=1: shorter, padded with pad_id to L=9.
    b_ = Trajectory([1, 2, 3, 4], [5], [-2.0], [T], reward=-0.1, group_id="g", task_id="ta",
                    weight_versions=["4"])
    b = build_rollout_batch([a, b_], pad_id=0)
    assert b.tokens.tolist() == [
        [1, 2, 3, 4, 5, 6, 7, 8, 9],
        [1, 2, 3, 4, 5, 0, 0, 0, 0],
    ]
    assert b.attention_mask.tolist() == [
        [T, T, T, T, T, T, T, T, T],
        [T, T, T, T, T, F, F, F, F],
    ]
    # prediction position p predicts tokens[p+1]
    assert b.loss_mask.tolist() == [
        [F, T, T, F, T, F, F, T],   # predicts 3,4 (act) | 5 obs | 6 act | 7,8 obs | 9 act
        [F, F, F, T, F, F, F, F],   # only position 3 predicts the single act token 5
    ]
    assert b.rollout_logprobs.tolist() == [
        pytest.approx([0.0, -0.1, -0.2, 0.0, -0.3, 0.0, 0.0, -0.4]),
        pytest.approx([0.0, 0.0, 0.0, -2.0, 0.0, 0.0, 0.0, 0.0]),
    ]
    assert b.group_ids == ["g", "g"]
    assert b.weight_versions == [["3", "3", "4"], ["4"]]
    # The masked targets are exactly the model tokens.
    targets = b.tokens[:, 1:]
    assert targets[b.loss_mask].tolist() == [3, 4, 6, 9, 5]


def test_observation_logprobs_are_zeroed_even_if_given():
    t = Trajectory([1], [2, 3], [-1.0, -7.0], [T, F])
    b = build_rollout_batch([t])
    assert b.rollout_logprobs.tolist() == [[-1.0, 0.0]]


def test_empty_response_is_allowed_and_contributes_no_loss():
    t = Trajectory([1, 2, 3], [], [], [], reward=0.0)
    b = build_rollout_batch([t])
    assert b.tokens.tolist() == [[1, 2, 3]]
    assert not b.loss_mask.any()


def test_accepts_jsonl_dicts_and_roundtrips(tmp_path):
    t = Trajectory([1, 2], [3, 4], [-0.1, 0.0], [T, F], reward=1.1,
                   reward_components={"correct": 1.0, "exec_ok": 0.1}, num_turns=1,
                   finish_reason="answer", task_id="sha256", group_id="s0", weight_versions=["0"])
    path = tmp_path / "r.jsonl"
    path.write_text(t.to_json() + "\n\n")
    loaded = load_trajectories(str(path))
    assert loaded == [t]
    rec = json.loads(t.to_json())
    assert set(rec) == {"prompt_ids", "response_ids", "response_logprobs", "response_mask", "reward",
                        "reward_components", "num_turns", "finish_reason", "task_id", "group_id",
                        "weight_versions", "scripted"}
    b = build_rollout_batch([rec])
    assert b.loss_mask.tolist() == [[F, T, F]]  # P=2: predictions at [1, 3)


def test_bad_input_gets_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="at least one"):
        build_rollout_batch([])
    with pytest.raises(ValueError, match="all three must be equal"):
        build_rollout_batch([Trajectory([1], [2, 3], [-1.0], [T, T])])
    with pytest.raises(ValueError, match="empty prompt_ids"):
        build_rollout_batch([Trajectory([], [2], [-1.0], [T])])
    with pytest.raises(ValueError, match="lacks"):
        build_rollout_batch([{"prompt_ids": [1]}])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_ids": [1]\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_trajectories(str(bad))


def test_rows_sampled_by_older_weights_are_marked_stale():
    """policy_version is the trainer's weight version: a row with any turn from an older one is stale
    (parity leaves it out); without a version nothing is."""
    def traj(*versions):
        return Trajectory([1], [2], [-0.5], [T], weight_versions=list(versions))
    trajs = [traj("4"), traj("3", "4"), traj(), traj("4", "4")]
    assert build_rollout_batch(trajs, policy_version=4).stale.tolist() == [F, T, F, F]
    assert build_rollout_batch(trajs).stale.tolist() == [F, F, F, F]
    assert build_rollout_batch(trajs, policy_version=4).select([1, 3]).stale.tolist() == [T, F]
