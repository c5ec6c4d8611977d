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
judging its signal (guide_group, from producer.py); guide_unsolved guides a whole rollout at once.

A scripted sample has no sampling log-probs: the update takes the trainer's own for it (its TIS
weight is then 1) and leaves it out of the train/inference parity metrics; the step's reward,
accuracy and turn metrics are of sampled episodes only (the replaced sample counts there, as
rolled out and not trained on).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import sys

from nano_miles.rollout.batch import Trajectory
from nano_miles.rollout.chat_format import ChatFormat
from nano_miles.rollout.episode import RolloutConfig, group_key, run_episode

_named_rejected: set[str] = set()  # tasks whose scripted episode failed, already named on stderr


def unsolved(group: list[Trajectory]) -> bool:
    """No sample solved the task, and at least one got as far as trying (the sandbox lost none of them
    all): the groups guidance adds a scripted sample to."""
    tried = [t for t in group if t.finish_reason != "infra_error"]
    return bool(tried) and not any(t.reward_components.get("correct", 0) > 0 for t in tried)


async def play_scripted(tasks_and_keys: list, fmt: ChatFormat, cfg: RolloutConfig,
                        sandbox_factory=None) -> list[Trajectory]:
    """The scripted episode of each (task, task_seed, group_id), concurrently."""
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(cfg.max_concurrency, len(tasks_and_keys))),
                                                 thread_name_prefix="scripted")
    try:
        return await asyncio.gather(*(run_episode(None, fmt, task, task_seed, group_id, cfg, sandbox_factory,
                                                  pool, scripted=True)
                                      for task, task_seed, group_id in tasks_and_keys))
    finally:
        pool.shutdown(wait=False)


def take_scripted(group: list[Trajectory], demo: Trajectory) -> tuple[list[Trajectory], Trajectory | None, bool]:
    """`group` with one sample (one the sandbox lost, if any, else the last) replaced by `demo`, its
    task's scripted episode, when the verifier accepted it. Returns (the group, the sample replaced or
    None, whether `demo` was rejected)."""
    if demo.reward_components.get("correct", 0) <= 0:
        name_rejected(demo)
        return group, None, True
    i = next((i for i, t in enumerate(group) if t.finish_reason == "infra_error"), len(group) - 1)
    return group[:i] + [demo] + group[i + 1:], group[i], False


async def guide_group(group: list[Trajectory], play) -> tuple[list[Trajectory], Trajectory | None, bool]:
    """take_scripted() for one group as it comes back, when no sample solved it: `play()` plays its
    scripted episode (the group's task, seed and group id)."""
    if not unsolved(group):
        return group, None, False
    return take_scripted(group, await play())


def name_rejected(demo: Trajectory) -> None:
    """Say once a process that a task's scripted episode was not judged correct, and why. One the
    sandbox lost says nothing of the task (the next may pass): it is counted, not named."""
    if demo.task_id in _named_rejected or demo.finish_reason == "infra_error":
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


def guide_unsolved(trajs: list[Trajectory], tasks: list, seed: int, tokenizer, cfg: RolloutConfig,
                   sandbox_factory=None) -> tuple[list[Trajectory], list[Trajectory], int]:
    """`trajs` (rollout_groups' output for `tasks` and `seed`) with one sample of every unsolved group
    replaced by its scripted episode; returns (trajectories, the samples replaced, the scripted
    episodes rejected)."""
    groups: dict[str, list[Trajectory]] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t)
    wanted = []
    for index, task in enumerate(tasks):
        task_seed, group_id = group_key(task, seed, index)
        if group_id in groups and unsolved(groups[group_id]):
            wanted.append((task, task_seed, group_id))
    if not wanted:
        return trajs, [], 0
    fmt = tokenizer if isinstance(tokenizer, ChatFormat) else ChatFormat(tokenizer)
    replaced, rejected = [], 0
    for (_, _, group_id), demo in zip(wanted, asyncio.run(play_scripted(wanted, fmt, cfg, sandbox_factory))):
        groups[group_id], lost, was_rejected = take_scripted(groups[group_id], demo)
        replaced += [] if lost is None else [lost]
        rejected += was_rejected
    return [t for g in groups.values() for t in g], replaced, rejected
