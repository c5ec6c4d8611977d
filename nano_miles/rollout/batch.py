"""The trajectory record and build_rollout_batch: padding plus the shift-by-one alignment.

A trajectory is one episode token by token: prompt_ids | response_ids = act_1, obs_1, ..., act_K.
Per-token fields describe response_ids only: model tokens carry the engine's log-prob and mask True,
observation tokens 0.0 and mask False. The batch puts them at PREDICTION positions: logits[:, t]
predict tokens[:, t+1], so a response of length R after a prompt of length P is predicted by
[P-1, P+R-1); loss_mask and rollout_logprobs are [B, L-1] while tokens are [B, L], lined up with
log_softmax(logits[:, :-1]).gather(tokens[:, 1:]).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

import torch


@dataclass
class Trajectory:
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    response_mask: list[bool]
    reward: float = 0.0
    reward_components: dict = field(default_factory=dict)
    num_turns: int = 0
    finish_reason: str = ""
    task_id: str = ""
    group_id: str = ""
    weight_versions: list[str] = field(default_factory=list)  # one per model turn
    scripted: bool = False  # played from the task's scripted solution (rollout.guide_unsolved), not sampled

    @property
    def solved(self) -> bool:  # the verifier accepted the answer (what accuracy and pass@k count)
        return self.reward_components.get("correct", 0) > 0

    @property
    def broken(self) -> bool:  # the sandbox or the engine failed this episode: it says nothing of the model
        return self.finish_reason == "infra_error"

    def validate(self) -> None:
        if not self.prompt_ids:
            raise ValueError(f"trajectory {self.group_id}/{self.task_id}: empty prompt_ids "
                             "(the first response token needs a prompt position to be predicted from)")
        r = len(self.response_ids)
        if len(self.response_logprobs) != r or len(self.response_mask) != r:
            raise ValueError(
                f"trajectory {self.group_id}/{self.task_id}: response_ids has {r} tokens but "
                f"response_logprobs has {len(self.response_logprobs)} and response_mask "
                f"{len(self.response_mask)}; all three must be equal")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_dict(cls, d: dict) -> "Trajectory":
        missing = [k for k in ("prompt_ids", "response_ids", "response_logprobs", "response_mask") if k not in d]
        if missing:
            raise ValueError(f"trajectory record lacks {missing}; has {sorted(d)}")
        known = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        known["response_mask"] = [bool(m) for m in known["response_mask"]]
        return cls(**known)


def _version(v) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1  # an engine with non-numeric versions: treated as maximally stale


def staleness(traj, policy_version: int) -> int:
    """Weight versions between the policy being trained and the oldest turn of `traj`."""
    return policy_version - min(_version(v) for v in traj.weight_versions) if traj.weight_versions else 0


def load_trajectories(path: str) -> list[Trajectory]:
    """A rollout JSONL file's trajectories (one per line)."""
    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(Trajectory.from_dict(json.loads(line)))
            except (json.JSONDecodeError, ValueError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a trajectory record: {e}") from e
    return out


def scored(trajs) -> list:
    """The episodes that say something about the model: not those the sandbox or the engine broke."""
    return [t for t in trajs if not t.broken]


def solved_by_task(trajs) -> dict[str, list[bool]]:
    """{task id: whether each of its scored samples was solved}, in the order the tasks first appear."""
    by_task: dict[str, list[bool]] = {}
    for t in scored(trajs):
        by_task.setdefault(t.task_id, []).append(t.solved)
    return by_task


@dataclass
class RolloutBatch:
    tokens: torch.Tensor            # [B, L] long, right-padded with pad_id
    attention_mask: torch.Tensor    # [B, L] bool, True on real tokens
    loss_mask: torch.Tensor         # [B, L-1] bool, at prediction positions; True only on model tokens
    rollout_logprobs: torch.Tensor  # [B, L-1] float32, engine log-probs at the same positions, 0 elsewhere
    group_ids: list[str]
    weight_versions: list[list[str]]
    scripted: torch.Tensor          # [B] bool: a scripted sample (no sampling log-probs; left out of parity)
    stale: torch.Tensor             # [B] bool: sampled (in part) by weights older than the policy trained

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def select(self, rows: list[int]) -> "RolloutBatch":
        """The sub-batch of these rows (same padded length: the trainer trims each micro-batch)."""
        idx = torch.tensor(rows, dtype=torch.long)

        def pick(v):  # a tensor's rows, or a list's items
            return v[idx] if isinstance(v, torch.Tensor) else [v[i] for i in rows]
        return RolloutBatch(**{f.name: pick(getattr(self, f.name)) for f in fields(self)})


def build_rollout_batch(trajectories: list, pad_id: int = 0, policy_version: int | None = None) -> RolloutBatch:
    """Pad trajectories (Trajectory objects or JSONL dicts) into one RolloutBatch. With `policy_version`
    (the trainer's weight version) rows sampled by older weights are marked `stale`."""
    if not trajectories:
        raise ValueError("build_rollout_batch needs at least one trajectory")
    trajs = [t if isinstance(t, Trajectory) else Trajectory.from_dict(t) for t in trajectories]
    for t in trajs:
        t.validate()
    B = len(trajs)
    L = max(2, *(len(t.prompt_ids) + len(t.response_ids) for t in trajs))  # [B, L-1] never empty
    tokens = torch.full((B, L), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, L), dtype=torch.bool)
    loss_mask = torch.zeros((B, L - 1), dtype=torch.bool)
    rollout_logprobs = torch.zeros((B, L - 1), dtype=torch.float32)
    for i, t in enumerate(trajs):
        P, R = len(t.prompt_ids), len(t.response_ids)
        tokens[i, :P + R] = torch.tensor(t.prompt_ids + t.response_ids, dtype=torch.long)
        attention_mask[i, :P + R] = True
        # Shift by one: the token at sequence position P+j is predicted by logits at P+j-1.
        loss_mask[i, P - 1:P + R - 1] = torch.tensor(t.response_mask, dtype=torch.bool)
        rollout_logprobs[i, P - 1:P + R - 1] = torch.tensor(t.response_logprobs, dtype=torch.float32)
    # Observation log-probs are 0.0 by contract; zero anything unmasked so stray values never leak.
    rollout_logprobs = rollout_logprobs.masked_fill(~loss_mask, 0.0)
    return RolloutBatch(
        tokens=tokens, attention_mask=attention_mask, loss_mask=loss_mask, rollout_logprobs=rollout_logprobs,
        group_ids=[t.group_id for t in trajs], weight_versions=[list(t.weight_versions) for t in trajs],
        scripted=torch.tensor([bool(t.scripted) for t in trajs], dtype=torch.bool),
        stale=torch.tensor([policy_version is not None and staleness(t, policy_version) > 0 for t in trajs],
                           dtype=torch.bool))
