"""Guided groups (`rollout.guide_unsolved`): a group in which no sample solved its task gets the
task's scripted solution as one of its samples.

A group whose samples all fail has a GRPO advantage of 0 everywhere: the policy never learns a task
it cannot already solve now and then. With guidance one sample of such a group (one the sandbox lost,
if any, else the last) is replaced by an episode played from the task's scripted solution
(episode.ScriptedPolicy: the commands `nano-miles tasks check` plays, in the same sandbox set-up, same
seed), tokenized and rewarded exactly as a sampled episode: it gets a positive advantage against the
failed samples beside it, and the update raises its likelihood (off-policy guidance in the spirit of
LUFFY, Yan et al., 2025, without its policy shaping). A scripted episode the verifier does not accept
is thrown away and the group stays as it was: a task without a scripted solution, with one that fails
here, or with one longer than `env.max_turns`, is never guided; it is named on stderr once a process
and counted in `groups_guide_rejected`. A training step guides each group as it comes back, before
judging its signal (guide_group, from producer.py).

A scripted sample has no sampling log-probs: the update takes the trainer's own for it (its TIS
weight is then 1) and leaves it out of the train/inference parity metrics; the step's reward,
accuracy and turn metrics are of sampled episodes only (the replaced sample counts there, as
rolled out and not trained on).
"""
from __future__ import annotations

import sys

from nano_miles.rollout.batch import Trajectory, scored

_named_rejected: set[str] = set()  # tasks whose scripted episode failed, already named on stderr


def unsolved(group: list[Trajectory]) -> bool:
    """No sample solved the task, and at least one got as far as trying (the sandbox lost none of them
    all): the groups guidance adds a scripted sample to."""
    tried = scored(group)
    return bool(tried) and not any(t.solved for t in tried)


async def guide_group(group: list[Trajectory], play) -> tuple[list[Trajectory], Trajectory | None, bool]:
    """`group` as it comes back, with one sample (one the sandbox lost, if any, else the last) replaced
    by its task's scripted episode when no sample solved it and the verifier accepts the scripted one:
    `play()` plays it (the group's task, seed and group id). Returns (the group, the sample replaced or
    None, whether the scripted episode was rejected)."""
    if not unsolved(group):
        return group, None, False
    demo = await play()
    if not demo.solved:
        name_rejected(demo)
        return group, None, True
    i = next((i for i, t in enumerate(group) if t.broken), len(group) - 1)
    return group[:i] + [demo] + group[i + 1:], group[i], False


def name_rejected(demo: Trajectory) -> None:
    """Say once a process that a task's scripted episode was not judged correct, and why. One the
    sandbox lost says nothing of the task (the next may pass): it is counted, not named."""
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
