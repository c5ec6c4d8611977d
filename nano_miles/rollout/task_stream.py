"""The run's data order: the training tasks in a seeded order, epoch after epoch; state() is all a
resume needs to continue exactly where the run stopped.

pass_over (rollout.pass_over_saturated): a task whose last group had no learning signal is passed over
at its next `pass_over` appearances, so rollouts go to tasks that still teach something; a group with
a signal clears that (saw()). pending (rollout.carry_over): tasks taken whose groups were in no batch
yet when the state was saved; a restored stream hands them out first.
"""
from __future__ import annotations

import random


class TaskStream:

    def __init__(self, tasks: list, seed: int, pass_over: int = 0):
        if not tasks:
            raise ValueError("no tasks selected")
        self.tasks, self.seed, self.position, self.pass_over = list(tasks), seed, 0, pass_over
        self.passes: dict[str, int] = {}  # task id -> its appearances still to pass over
        self.retake: list = []  # restored pending tasks, taken before the order goes on
        self._epoch_order = (-1, [])

    def _order(self, epoch: int) -> list:
        if self._epoch_order[0] != epoch:
            order = list(self.tasks)
            random.Random(self.seed * 7919 + epoch).shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def take(self, k: int) -> list:
        out, self.retake = self.retake[:k], self.retake[k:]
        while len(out) < k:  # ends: every pass over uses one up, and none are added here
            epoch, i = divmod(self.position, len(self.tasks))
            task = self._order(epoch)[i]
            self.position += 1
            left = self.passes.pop(task.id, 0)
            if left > 1:
                self.passes[task.id] = left - 1
            elif not left:
                out.append(task)
        return out

    def saw(self, task_id: str, signal: bool) -> None:
        if self.pass_over and signal:
            self.passes.pop(task_id, None)
        elif self.pass_over:
            self.passes[task_id] = self.pass_over

    def state(self, pending: list | None = None) -> dict:
        """What a resume needs; `pending`: the tasks taken but in no batch yet (their ids)."""
        state = {"position": self.position, "passes": dict(self.passes)}
        pending = [t.id for t in self.retake] + list(pending or [])
        return {**state, "pending": pending} if pending else state

    def restore(self, state: dict | int) -> None:
        """Back to a state() (an int: a checkpoint's position from before pass_over existed). Pending
        tasks no longer in the run's task set are left out."""
        if isinstance(state, int):
            self.position, self.passes, self.retake = state, {}, []
        else:
            by_id = {t.id: t for t in self.tasks}
            self.position, self.passes = state["position"], dict(state["passes"])
            self.retake = [by_id[i] for i in state.get("pending", []) if i in by_id]
