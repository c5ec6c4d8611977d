"""Where a training step's trajectories come from: play_step_rollout takes the step's tasks from the
run's TaskStream and rolls them out (the stream is put back if that fails); SyncProducer calls it when
the trainer asks, AsyncProducer ahead of it on a background thread.

The index-th group started in a step plays with group_key(task, step_seed, index), so the tasks a step
takes and the groups it keeps depend on the run's seed and the groups' outcomes only, never on which
group ended first. With rollout.carry_over a step instead ends once the groups back fill its batch, the
rest going on into the next step (Carry): faster steps, a batch that depends on timing.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import queue
import sys
import threading
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from nano_miles.rollout.anatomy import RolloutAnatomy
from nano_miles.rollout.batch import Trajectory
from nano_miles.rollout.dynamic_sampling import SamplingTally, TrainRolloutConfig, has_signal
from nano_miles.rollout.episode import GroupRunner, cancel_all, group_key
from nano_miles.rollout.guidance import guide_group
from nano_miles.rollout.task_stream import TaskStream
from nano_miles.tasks.api import Task


@dataclass
class StepRollout:
    step: int
    trajectories: list    # what the update trains on
    seconds: float
    setup_failures: int   # episodes lost before their first turn (sandbox setup): counted, not trained on
    stream_state: dict = field(default_factory=dict)  # the stream's state after this step's tasks (checkpointed)
    setup_errors: list[str] = field(default_factory=list)  # the first few setup failures' messages
    engine_requests: list[int] = field(default_factory=list)  # /generate calls per engine replica
    dropped: list = field(default_factory=list)  # rolled out, not trained on (dynamic sampling: no signal, surplus)
    sampling: SamplingTally | None = None
    anatomy: RolloutAnatomy = field(default_factory=RolloutAnatomy)  # where `seconds` went

    @property
    def generated(self) -> list:
        """Every trajectory the policy sampled (scripted ones are trained on, but not the policy's)."""
        return [t for t in self.trajectories + self.dropped if not t.scripted]

    @property
    def lost(self) -> list:
        """Trajectories cut short by a sandbox failure (setup failures have none: they are counted)."""
        return [t for t in self.generated if t.broken]

    @property
    def infra_errors(self) -> list[str]:
        return self.setup_errors + [t.reward_components.get("error", "") for t in self.lost[:3]]

    @property
    def all_lost(self) -> bool:
        episodes = len(self.generated) + self.setup_failures
        return episodes > 0 and self.setup_failures + len(self.lost) == episodes

    @property
    def skip_reason(self) -> str | None:
        """Why this step cannot update the policy whatever the trainer does (None: it can try)."""
        if self.all_lost:
            return "every episode failed for infrastructure reasons (sandbox)"
        return self.sampling.note if not self.trajectories and self.sampling else None  # (None if disabled)


def step_seed(run_seed: int, step: int) -> int:
    return run_seed * 1_000_003 + step


@dataclass
class _Played:
    task: Task
    episodes: list[Trajectory]   # every episode, those without a prompt (setup failed, task unavailable) included
    group: list[Trajectory]      # what training could use: the episodes with a prompt, a scripted one swapped in
    replaced: Trajectory | None  # the sample a scripted episode replaced (rollout.guide_unsolved)
    guide_rejected: bool

    @property
    def signal(self) -> bool:
        return has_signal(self.group)

    @property
    def got_through(self) -> bool:  # some episode of it was not lost to the infrastructure
        return any(not t.broken for t in self.group)


@dataclass
class Carry:
    """rollout.carry_over: what a step leaves to the next (its groups still running, finished groups
    beyond its batch) and the runner they play on, on the async producer's loop; close() cancels it."""
    running: dict = field(default_factory=dict)  # group job -> its task, in the order they were started
    ready: list = field(default_factory=list)    # _Played groups that came back beyond a batch
    runner: GroupRunner | None = None
    requests: list = field(default_factory=list)  # the runner's /generate calls per replica at the last step's end
    busy_seen: dict = field(default_factory=dict)  # the engines' busy counters at the last step's end (anatomy.py)

    def task_ids(self) -> list[str]:
        return [t.id for t in self.running.values()] + [g.task.id for g in self.ready]

    async def close(self) -> None:
        await cancel_all(self.running)
        self.running, self.ready = {}, []
        if self.runner is not None:
            await self.runner.close()
            self.runner = None


async def _play_step(runner: GroupRunner, stream: TaskStream, target: int, cfg: TrainRolloutConfig, seed: int,
                     tally: SamplingTally, anatomy: RolloutAnatomy, on_start, carry: Carry | None) -> list[_Played]:
    """The step's groups that came back, in start order: a first wave of round_size(target), then, with
    dynamic sampling, one more each time a group comes back without a signal while the groups with one
    and those running cannot fill the batch, up to the bound; it ends when all have come back.

    Surplus groups are not cancelled: they finish and are dropped, as verl does. Cancelling would keep
    the groups that ended first (short episodes: a length bias) and make the batch depend on timing.

    With `carry` the step starts with the last step's leftovers, keeps round_size(target) groups
    running and ends once the groups back fill the batch (or the bound's worth came back); the rest go
    on into the next step, so long episodes are trained on a step later (within max_staleness)."""
    first_wave = cfg.round_size(target)
    bound = first_wave * cfg.max_sampling_rounds if cfg.dynamic_sampling else first_wave
    played: dict[int, _Played] = {}
    running: dict[asyncio.Task, int] = {}  # group job -> its index in the step
    started_tasks: list = []
    with_signal, came_back, first_wave_done = 0, 0, None
    if carry is not None:  # the last step's leftovers first, in the order they were started
        for job, task in carry.running.items():
            running[job] = len(started_tasks)
            started_tasks.append(task)
        for g in carry.ready:
            played[len(started_tasks)] = g
            started_tasks.append(g.task)
            with_signal += g.signal
        carry.running, carry.ready = {}, []

    async def play(index: int, task) -> _Played:
        task_seed, group_id = group_key(task, seed, index)
        episodes = await runner.group(task, task_seed, group_id)
        group, replaced, rejected = [t for t in episodes if t.prompt_ids], None, False
        if cfg.guide_unsolved:  # before the signal is judged: a guided group has one
            guide_started = time.perf_counter()
            group, replaced, rejected = await guide_group(group, functools.partial(runner.scripted, task, task_seed,
                                                                                   group_id))
            anatomy.guide_s += time.perf_counter() - guide_started
        return _Played(task, episodes, group, replaced, rejected)

    def start() -> None:
        position = stream.position
        (task,) = stream.take(1)
        tally.passed_over += max(0, stream.position - position - 1)
        running[asyncio.ensure_future(play(len(started_tasks), task))] = len(started_tasks)
        started_tasks.append(task)
        on_start(len(started_tasks) - first_wave)  # groups started after the first wave (refills)

    def batch_full() -> bool:  # carry: the groups that came back fill the batch, or the bound's worth did
        return (with_signal if cfg.dynamic_sampling else len(played)) >= target or came_back >= bound

    try:
        for _ in range(first_wave - len(running)):
            start()
        while running and not (carry is not None and batch_full()):
            done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            for job in done:
                index = running.pop(job)
                played[index] = job.result()  # a group's error (no engine left) fails the step
                with_signal += played[index].signal
                came_back += 1
            if first_wave_done is None and all(i in played for i in range(first_wave)):
                first_wave_done = time.perf_counter()
            if carry is not None:  # keep the width in flight: what the batch does not need goes on
                while len(running) < first_wave and not batch_full():
                    start()
                continue
            # Refill: a group came back without a signal and the groups kept or still running cannot
            # fill the batch. Not while every group so far was lost to the sandbox: more would be too.
            while (cfg.dynamic_sampling and len(started_tasks) < bound and with_signal + len(running) < target
                   and any(g.got_through for g in played.values())):
                start()
        if carry is not None:
            carry.running, running = {job: started_tasks[i] for job, i in running.items()}, {}
    finally:
        await cancel_all(running)  # only on an error (or our own cancellation): what still runs
    if first_wave_done is not None and len(played) > first_wave:
        anatomy.refill_s += time.perf_counter() - first_wave_done
    return [played[i] for i in sorted(played)]


async def play_step_rollout(step: int, stream: TaskStream, tasks_per_step: int, engines, tokenizer,
                            cfg: TrainRolloutConfig, run_seed: int, desc: str = "rollout", sandbox_factory=None,
                            carry: Carry | None = None) -> StepRollout:
    """roll_out_step on a running event loop; with `carry` (rollout.carry_over), the step takes what
    the last one left and leaves it what its batch does not need (see _play_step)."""
    before = stream.state(carry.task_ids() if carry else None)
    tally = SamplingTally(cfg.dynamic_sampling, tasks_per_step, max_rounds=cfg.max_sampling_rounds)
    anatomy = RolloutAnatomy()
    t0 = time.perf_counter()
    runner = (carry.runner if carry is not None else None) or GroupRunner(engines, tokenizer, cfg, sandbox_factory)
    if carry is not None:  # it plays on across steps: Carry.close() closes it
        carry.runner = runner
    try:
        with tqdm(total=0, desc=desc, unit="ep", leave=False, dynamic_ncols=True) as bar:
            def on_start(refills: int):
                bar.total += cfg.group_size
                bar.set_description(f"{desc} ({refills} refill(s))" if refills > 0 and carry is None else desc)

            runner.on_episode_done = lambda: bar.update(1)
            try:
                groups = await _play_step(runner, stream, tasks_per_step, cfg, step_seed(run_seed, step), tally,
                                          anatomy, on_start, carry)
            finally:
                if carry is None:
                    await runner.close()
    except BaseException:
        stream.restore(before)
        raise
    # The episodes that ended since the last step took its clocks: with carry, those of groups that
    # finished between two steps count in this one (the runner plays on in between)
    clocks, runner.clocks = runner.clocks, []
    anatomy.add_rollout(clocks, t0, time.perf_counter(), carry.busy_seen if carry is not None else None)
    if carry is not None:  # usable groups beyond the batch are the next step's, not dropped
        surplus = set(_usable(groups, cfg.dynamic_sampling)[tasks_per_step:])
        carry.ready = [g for i, g in enumerate(groups) if i in surplus]
        groups = [g for i, g in enumerate(groups) if i not in surplus]
    stats = runner.stats([g.task for g in groups], [t for g in groups for t in g.episodes])
    if carry is not None:  # the runner's counts run on across steps: this step's share
        counts = stats["engine_requests"]
        stats["engine_requests"] = [n - (carry.requests[i] if i < len(carry.requests) else 0)
                                    for i, n in enumerate(counts)]
        carry.requests = counts
    # The stream learns the groups' outcomes (pass_over) once the step is done, in the order they were
    # started: what the step took from it then never depends on which group happened to end first.
    for g in groups:
        if g.got_through:  # a group the sandbox lost says nothing of the task
            stream.saw(g.task.id, g.signal)
    kept = _usable(groups, cfg.dynamic_sampling)[:tasks_per_step]
    tally.generated, tally.kept = len(groups), len(kept)
    tally.rounds = math.ceil(len(groups) / cfg.round_size(tasks_per_step))  # rounds' worth of groups started
    tally.refills = max(0, len(groups) - cfg.round_size(tasks_per_step))
    tally.without_signal = sum(not g.signal for g in groups)  # groups lost to setup failures have none either
    tally.guided = sum(g.replaced is not None for g in groups)
    tally.guide_rejected = sum(g.guide_rejected for g in groups)
    tally.carried = len(carry.task_ids()) if carry is not None else 0
    # rolled out, not trained on: the samples scripted ones replaced; with dynamic sampling, groups without a
    # signal and the surplus of an oversampled step
    dropped = [g.replaced for g in groups if g.replaced is not None]
    dropped += [t for i, g in enumerate(groups) if i not in kept for t in g.group]
    if tally.note:
        print(f"step {step}: {tally.note}", file=sys.stderr)
    return StepRollout(step, [t for i in kept for t in groups[i].group], time.perf_counter() - t0,
                       stats["setup_failures"], stream.state(carry.task_ids() if carry else None),
                       stats["setup_errors"], engine_requests=stats["engine_requests"], dropped=dropped,
                       sampling=tally, anatomy=anatomy)


def _usable(groups: list, dynamic_sampling: bool) -> list[int]:
    """The groups a batch can take: with dynamic sampling those with a signal, else any with a sample."""
    return [i for i, g in enumerate(groups) if (g.signal if dynamic_sampling else g.group)]


def roll_out_step(step: int, stream: TaskStream, tasks_per_step: int, engines, tokenizer,
                  cfg: TrainRolloutConfig, run_seed: int, desc: str = "rollout", sandbox_factory=None) -> StepRollout:
    """Roll out a group of each of the step's tasks from `stream` on `engines` (URLs or an EnginePool),
    with a progress bar on stderr; on any failure the stream is put back, so a retry takes the same
    tasks with the same seeds."""
    return asyncio.run(play_step_rollout(step, stream, tasks_per_step, engines, tokenizer, cfg, run_seed, desc,
                                         sandbox_factory))


class SyncProducer:
    """On-policy: a step's rollouts start when the trainer asks for them, with the latest weights."""

    def __init__(self, roll_out):
        self.roll_out = roll_out  # async roll_out(step, desc, carry) -> StepRollout (play_step_rollout)

    def get(self, step: int) -> StepRollout:
        return asyncio.run(self.roll_out(step, f"step {step} rollout", None))

    # nothing runs between steps: nothing to start, restart or stop
    def start(self, first_step: int) -> None: pass
    def restart(self, step: int) -> None: pass
    def stop(self) -> None: pass


class AsyncProducer:
    """A background thread rolls out the next step while the current one trains, at most one step
    ahead (the queue holds one); each turn records the weight_version it was sampled with (staleness).
    A failed step is handed to the trainer as its error, and the thread stops."""

    def __init__(self, roll_out, last_step: int, carry_over: bool = False):
        self.roll_out, self.last_step, self.carry_over = roll_out, last_step, carry_over
        self.queue: queue.Queue = queue.Queue(maxsize=1)
        self._stop = threading.Event()
        self._thread = None

    def start(self, first_step: int) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._produce(first_step)), daemon=True,
                                        name="rollout-producer")
        self._thread.start()

    async def _produce(self, step: int) -> None:
        carry = Carry() if self.carry_over else None
        try:
            while not self._stop.is_set() and step <= self.last_step:
                try:
                    item = await self.roll_out(step, f"step {step} rollout (async)", carry)
                except Exception as e:  # handed to the training thread, which decides what to do
                    item = e
                await asyncio.to_thread(self._hand_over, step, item)  # the carried groups play on meanwhile
                if isinstance(item, Exception):
                    return
                step += 1
        finally:
            if carry is not None:
                await carry.close()

    def _hand_over(self, step: int, item) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(queue.Full):
                return self.queue.put((step, item), timeout=0.2)

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
