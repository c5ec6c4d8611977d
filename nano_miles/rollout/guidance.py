"""Guided groups (rollout.guide_unsolved): a group no sample solved (a GRPO advantage of 0 everywhere:
the policy never learns a task it cannot already solve now and then) gets the task's scripted episode
(episode.ScriptedPolicy, same sandbox set-up and seed) as one of its samples, tokenized and rewarded as
a sampled one: off-policy guidance in the spirit of LUFFY (Yan et al., 2025) without its policy shaping.
One the verifier rejects is thrown away, named on stderr once and counted. A scripted sample has no
sampling log-probs: the update uses the trainer's own (TIS weight 1) and leaves it out of the parity
metrics; the step's reward and accuracy are of sampled episodes only.
"""
from __future__ import annotations

import sys

from nano_miles.rollout.batch import Trajectory, scored

_named_rejected: set[str] = set()  # tasks whose scripted episode failed, already named on stderr


def unsolved(group: list[Trajectory]) -> bool:
    """No sample solved the task, and the sandbox did not lose them all."""
    tried = scored(group)
    return bool(tried) and not any(t.solved for t in tried)


async def guide_group(group: list[Trajectory], play) -> tuple[list[Trajectory], Trajectory | None, bool]:
    """(group, the sample replaced or None, whether the scripted episode was rejected): an unsolved
    group's sample the sandbox lost, if any, else its last, replaced by `play()`'s scripted episode."""
    if not unsolved(group):
        return group, None, False
    demo = await play()
    if not demo.solved:
        name_rejected(demo)
        return group, None, True
    i = next((i for i, t in enumerate(group) if t.broken), len(group) - 1)
    return group[:i] + [demo] + group[i + 1:], group[i], False


def name_rejected(demo: Trajectory) -> None:
    """Say once a process why a task's scripted episode was not judged correct (not when the sandbox
    lost it: that says nothing of the task)."""
    if demo.task_id in _named_rejected or demo.broken:
        return
    _named_rejected.add(demo.task_id)
    if demo.num_turns <= 1:  # the one turn was the answer
        why = "it has no scripted commands"
    elif demo.finish_reason == "max_turns":
        why = f"its scripted solution takes more than the {demo.num_turns} turns env.max_turns allows"
    else:
        why = "its scripted solution fails here"
    print(f"guidance: task {demo.task_id}'s scripted episode was not judged correct ({why}); "
          "its unsolved groups stay unguided", file=sys.stderr)
