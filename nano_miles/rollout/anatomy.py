"""Where a step's rollout wall went: each episode's clock, and the step's breakdown built from them.

An episode's wall splits into waiting on /generate (engine work and queueing), sandbox work (setup,
commands, close) and the env's own work (parsing, judging, tokenizing observations: the rest). The
engines' own busy seconds per phase come from the counters our engine puts in every answer
(meta_info.busy_s); a real SGLang server has none, and those keys are then absent.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field


@dataclass
class EpisodeClock:
    started: float = field(default_factory=time.perf_counter)
    ended: float = 0.0
    generate_s: float = 0.0   # awaiting /generate: the engine's work on it plus its queueing there
    sandbox_s: float = 0.0    # sandbox setup, commands and close
    turns: int = 0            # /generate calls
    timed_out: int = 0        # commands that ran to the env's command_timeout
    busy_first: dict | None = None  # the engine's busy_s counters in its first and last answers
    busy_last: dict | None = None
    replica: str = ""  # the engine URL it ran on

    def answered(self, meta: dict) -> None:
        busy = meta.get("busy_s")
        if isinstance(busy, dict):
            self.busy_first = self.busy_first or busy
            self.busy_last = busy

    @property
    def wall(self) -> float:
        return self.ended - self.started


@dataclass
class RolloutAnatomy:
    """A step's breakdown. Episode sums are episode-seconds (episodes run concurrently); walls and
    engine busy are seconds."""
    generate_s: float = 0.0
    sandbox_s: float = 0.0
    env_s: float = 0.0
    episode_s: float = 0.0
    critical_path_s: float = 0.0  # the step's slowest episode: what its rollout could not beat
    # ...and where that episode's wall went: its turns run one after another, so a straggler is
    # either long decodes (many turns, long replies) or slow commands (a timeout costs command_timeout).
    # Over its whole life: one carried in from the last step brings its seconds from before this step.
    critical_generate_s: float = 0.0
    critical_sandbox_s: float = 0.0
    critical_turns: int = 0
    commands_timed_out: int = 0   # over all the step's episodes
    episodes: int = 0             # the episodes counted (with carry: those that ended since the last step)
    straggler_s: float = 0.0      # wall after half the step's episodes had ended (waiting on the slowest)
    refill_s: float = 0.0         # wall after the step's first wave of groups ended: what refills added
    guide_s: float = 0.0          # scripted episodes of guided groups, summed over the groups (they overlap)
    engine_busy: dict = field(default_factory=dict)  # phase -> engine seconds, summed over replicas
    replicas: set = field(default_factory=set)

    def add_rollout(self, clocks: list[EpisodeClock], started: float, ended: float,
                    busy_seen: dict | None = None) -> None:
        """The episodes of a step's rollout, which ran from `started` to `ended` (one carried in from the
        last step counts from `started`). busy_seen, if given, holds each (replica, phase) counter at the
        last step's end (updated here), so the engines' busy seconds are the step's own."""
        done = [c for c in clocks if c.ended]
        if done:
            slowest = max(done, key=lambda c: c.ended - max(c.started, started))
            self.critical_path_s += slowest.ended - max(slowest.started, started)
            self.critical_generate_s += slowest.generate_s
            self.critical_sandbox_s += slowest.sandbox_s
            self.critical_turns += slowest.turns
            self.straggler_s += max(0.0, ended - statistics.median(c.ended for c in done))
        first: dict = {}  # per (replica, phase): its counter's span over the rollout
        last: dict = {}
        self.episodes += len(done)
        for c in done:
            self.commands_timed_out += c.timed_out
            self.generate_s += c.generate_s
            self.sandbox_s += c.sandbox_s
            self.episode_s += c.wall
            self.env_s += max(0.0, c.wall - c.generate_s - c.sandbox_s)
            if c.busy_first is None:
                continue
            self.replicas.add(c.replica)
            for phase in c.busy_last:
                key = (c.replica, phase)
                first[key] = min(first.get(key, float("inf")), c.busy_first.get(phase, 0.0))
                last[key] = max(last.get(key, 0.0), c.busy_last[phase])
        if busy_seen is not None:
            first = {key: busy_seen.get(key, v) for key, v in first.items()}
            busy_seen.update(last)
        for key, end in last.items():  # (a restarted engine's counters start again: its span counts as 0)
            self.engine_busy[key[1]] = self.engine_busy.get(key[1], 0.0) + max(0.0, end - first[key])

    def metrics(self, wall: float) -> dict:
        out = {"generate_s": self.generate_s, "sandbox_s": self.sandbox_s, "env_s": self.env_s,
               "episode_s": self.episode_s, "critical_path_s": self.critical_path_s,
               "critical_generate_s": self.critical_generate_s, "critical_sandbox_s": self.critical_sandbox_s,
               "critical_turns": self.critical_turns, "commands_timed_out": self.commands_timed_out,
               "episodes_timed": self.episodes,
               "straggler_s": self.straggler_s, "refill_s": self.refill_s, "guide_s": self.guide_s,
               "sandbox_share": self.sandbox_s / self.episode_s if self.episode_s else None,
               "env_share": self.env_s / self.episode_s if self.episode_s else None}
        if self.engine_busy:
            busy = sum(self.engine_busy.values())
            out.update({f"engine_{phase}_s": s for phase, s in sorted(self.engine_busy.items())})
            out["engine_busy_share"] = busy / max(wall * max(len(self.replicas), 1), 1e-9)
            out["engine_idle_s"] = max(0.0, wall * max(len(self.replicas), 1) - busy)  # queueing/idle
        return out
