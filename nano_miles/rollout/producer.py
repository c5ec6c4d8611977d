"""Where a training step's trajectories come from.

`TaskStream` is the run's data order; `roll_out_step` is the one way a step gets its trajectories
(take the step's tasks from the stream, roll them out, and put the stream back if that fails).
`SyncProducer` calls it when the trainer asks (on-policy); `AsyncProducer` calls it ahead of the
trainer on a background thread (rollouts for step v+1 while step v trains).
"""
from __future__ import annotations

import asyncio
import queue
import random
import sys
import threading
import time
from dataclasses import dataclass, field
from itertools import zip_longest

from tqdm import tqdm

from nano_miles.rollout.anatomy import RolloutAnatomy
from nano_miles.rollout.dynamic_sampling import SamplingTally, TrainRolloutConfig, has_signal, split_groups
from nano_miles.rollout.episode import rollout_groups
from nano_miles.rollout.guidance import guide_unsolved


class TaskStream:
    """The tasks of the run in a seeded order, epoch after epoch; state() is all a resume needs to
    continue exactly where the run stopped.

    pass_over (rollout.pass_over_saturated): a task whose last group had no learning signal (every
    sample solved it, or none did) is passed over at its next `pass_over` appearances, so rollouts
    go to tasks that still teach something; a group with a signal clears that (saw())."""

    def __init__(self, tasks: list, seed: int, position: int = 0, pass_over: int = 0):
        if not tasks:
            raise ValueError("no tasks selected")
        self.tasks, self.seed, self.position, self.pass_over = list(tasks), seed, position, pass_over
        self.passes: dict[str, int] = {}  # task id -> its appearances still to pass over
        self._epoch_order = (-1, [])

    def _order(self, epoch: int) -> list:
        if self._epoch_order[0] != epoch:
            order = list(self.tasks)
            random.Random(self.seed * 7919 + epoch).shuffle(order)
            self._epoch_order = (epoch, order)
        return self._epoch_order[1]

    def take(self, k: int) -> list:
        out = []
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
        """The outcome of a group of task_id: with a learning signal or without (see pass_over)."""
        if self.pass_over and signal:
            self.passes.pop(task_id, None)
        elif self.pass_over:
            self.passes[task_id] = self.pass_over

    def state(self) -> dict:
        return {"position": self.position, "passes": dict(self.passes)}

    def restore(self, state: dict | int) -> None:
        """Back to a state() (an int: a checkpoint's position from before pass_over existed)."""
        if isinstance(state, int):
            self.position, self.passes = state, {}
        else:
            self.position, self.passes = state["position"], dict(state["passes"])


@dataclass
class StepRollout:
    step: int
    trajectories: list    # what the update trains on
    seconds: float
    setup_failures: int   # episodes lost before their first turn (sandbox setup): counted, not trained on
    data_position: int    # the stream's position after this step's tasks
    stream_state: dict = field(default_factory=dict)  # the stream's whole state after them (what a checkpoint stores)
    setup_errors: list[str] = field(default_factory=list)  # the first few setup failures' messages
    engine_requests: list[int] = field(default_factory=list)  # /generate calls per engine replica
    dropped: list = field(default_factory=list)  # rolled out, not trained on (dynamic sampling: no signal, surplus)
    sampling: SamplingTally | None = None
    anatomy: RolloutAnatomy = field(default_factory=RolloutAnatomy)  # where `seconds` went

    @property
    def generated(self) -> list:
        """Every trajectory the step sampled (what its reward and accuracy are measured on); scripted
        samples (rollout.guide_unsolved) are trained on but are not the policy's."""
        return [t for t in self.trajectories + self.dropped if not t.scripted]

    @property
    def lost(self) -> list:
        """Trajectories cut short by a sandbox failure (setup failures have none: they are counted)."""
        return [t for t in self.generated if t.finish_reason == "infra_error"]

    @property
    def infra_errors(self) -> list[str]:
        """Why episodes were lost to the infrastructure (sandbox): setup failures first, a few of each."""
        return self.setup_errors + [t.reward_components.get("error", "") for t in self.lost[:3]]

    @property
    def all_lost(self) -> bool:
        """Every episode failed for infrastructure reasons: nothing the policy did is in this step."""
        episodes = len(self.generated) + self.setup_failures
        return episodes > 0 and self.setup_failures + len(self.lost) == episodes

    @property
    def skip_reason(self) -> str | None:
        """Why this step cannot update the policy whatever the trainer does (None: it can try)."""
        if self.all_lost:
            return "every episode failed for infrastructure reasons (sandbox)"
        if not self.trajectories and self.sampling is not None and self.sampling.enabled:
            return self.sampling.note
        return None


def round_seed(run_seed: int, step: int, round_index: int) -> int:
    """The episode seed of a step's rollout round: fresh task instances every step and round,
    reproducible per run."""
    return run_seed * 1_000_003 + step + round_index * 7_919_000_003


def roll_out_step(step: int, stream: TaskStream, tasks_per_step: int, engines, tokenizer,
                  cfg: TrainRolloutConfig, run_seed: int, desc: str = "rollout", sandbox_factory=None) -> StepRollout:
    """Take the step's tasks from `stream` and roll out a group of each on `engines` (URLs or an
    EnginePool), with a progress bar (episodes done, ETA) on stderr. With cfg.dynamic_sampling, groups
    without a learning signal are dropped and more tasks taken, round after round, until the batch has
    `tasks_per_step` groups or cfg.max_sampling_rounds rounds ran (dynamic_sampling.py).
    On any failure the stream is put back, so that a retry takes the same tasks with the same seeds."""
    before = stream.state()
    tally = SamplingTally(cfg.dynamic_sampling, tasks_per_step, max_rounds=cfg.max_sampling_rounds)
    kept, dropped, setup_errors, requests, setup_failures = [], [], [], [], 0  # kept: groups, in order
    anatomy = RolloutAnatomy()
    t0 = time.perf_counter()
    try:
        while True:
            start = stream.position
            tasks = stream.take(cfg.round_size(tasks_per_step - len(kept)))
            tally.passed_over += stream.position - start - len(tasks)
            stats = {}
            label = desc if tally.rounds == 0 else f"{desc} (round {tally.rounds + 1}, refill)"
            seed = round_seed(run_seed, step, tally.rounds)
            clocks, round_started = [], time.perf_counter()
            with tqdm(total=len(tasks) * cfg.group_size, desc=label, unit="ep", leave=False, dynamic_ncols=True) as bar:
                trajs = asyncio.run(rollout_groups(engines, tokenizer, tasks, cfg, seed=seed,
                                                   sandbox_factory=sandbox_factory, stats=stats,
                                                   on_episode_done=lambda: bar.update(1), clocks=clocks))
            anatomy.add_round(clocks, round_started, time.perf_counter(), refill=tally.rounds > 0)
            if cfg.guide_unsolved:  # before the signal split: a guided group has one
                guide_started = time.perf_counter()
                trajs, replaced, rejected = guide_unsolved(trajs, tasks, seed, tokenizer, cfg, sandbox_factory)
                anatomy.guide_s += time.perf_counter() - guide_started
                tally.guided += len(replaced)
                tally.guide_rejected += rejected
                dropped += replaced
            tally.rounds += 1
            tally.generated += len(tasks)
            setup_failures += stats.get("setup_failures", 0)
            setup_errors += stats.get("setup_errors", [])
            requests = [a + b for a, b in zip_longest(requests, stats.get("engine_requests", []), fillvalue=0)]
            with_signal, without = split_groups(trajs)
            for group in with_signal + without:  # pass_over: groups the sandbox lost say nothing of the task
                if any(t.finish_reason != "infra_error" for t in group):
                    stream.saw(group[0].task_id, has_signal(group))
            tally.without_signal += len(tasks) - len(with_signal)  # groups lost to setup failures have none either
            if not cfg.dynamic_sampling:  # every group is trained on, in the order it came
                kept = [trajs]
                tally.kept = len(with_signal) + len(without)
                break
            kept += with_signal
            dropped += [t for g in without for t in g]
            lost = all(t.finish_reason == "infra_error" for t in trajs)  # (also when setup lost them all)
            if len(kept) >= tasks_per_step or tally.rounds >= cfg.max_sampling_rounds or lost:
                break  # full; or bounded; or the sandbox lost a whole round: more rounds would lose theirs too
    except BaseException:
        stream.restore(before)
        raise
    if cfg.dynamic_sampling:
        dropped += [t for g in kept[tasks_per_step:] for t in g]  # an oversampled round's surplus groups
        kept = kept[:tasks_per_step]
        tally.kept = len(kept)
        if tally.note:
            print(f"step {step}: {tally.note}", file=sys.stderr)
    return StepRollout(step, [t for g in kept for t in g], time.perf_counter() - t0, setup_failures, stream.position,
                       stream.state(), setup_errors[:3], engine_requests=requests, dropped=dropped, sampling=tally,
                       anatomy=anatomy)


class SyncProducer:
    """On-policy: a step's rollouts start when the trainer asks for them, with the latest weights."""

    def __init__(self, roll_out):
        self.roll_out = roll_out  # roll_out(step, desc) -> StepRollout

    def get(self, step: int) -> StepRollout:
        return self.roll_out(step, f"step {step} rollout")

    # nothing runs between steps: nothing to start, restart or stop
    def start(self, first_step: int) -> None: pass
    def restart(self, step: int) -> None: pass
    def stop(self) -> None: pass


class AsyncProducer:
    """Fully async: a background thread keeps rolling out the next step's groups while the current
    step trains. The queue holds one finished step, so rollouts run at most one step ahead of
    training; the engine's weights change under in-flight episodes, and each turn records the
    weight_version it was sampled with, which is what staleness is measured on. A failed step is
    handed to the trainer as its error (the stream already put back), and the thread stops."""

    def __init__(self, roll_out, last_step: int):
        self.roll_out, self.last_step = roll_out, last_step
        self.queue: queue.Queue = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread = None

    def start(self, first_step: int) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, args=(first_step,), daemon=True, name="rollout-producer")
        self._thread.start()

    def _loop(self, step: int) -> None:
        while not self._stop.is_set() and step <= self.last_step:
            try:
                item = self.roll_out(step, f"step {step} rollout (async)")
            except Exception as e:  # handed to the training thread, which decides what to do
                item = e
            while not self._stop.is_set():
                try:
                    self.queue.put((step, item), timeout=0.2)
                    break
                except queue.Full:
                    continue
            if isinstance(item, Exception):
                return
            step += 1

    def get(self, step: int) -> StepRollout:
        got, item = self.queue.get()
        if isinstance(item, Exception):
            raise item
        if got != step:
            raise RuntimeError(f"async producer delivered step {got} while the trainer is at step {step}")
        return item

    def restart(self, step: int) -> None:
        self.stop()
        self.queue = queue.Queue(maxsize=1)
        self.start(step)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=120)
            self._thread = None
