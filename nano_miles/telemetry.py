"""Run telemetry: the live per-step table, metrics.jsonl, TensorBoard scalars, Weights & Biases
(optional), the PNG curves and the end-of-run summary.

metrics.jsonl is the source of truth (one JSON object per step, flushed as it is written); the others
are views of the same numbers. `report_to` (as TRL's and verl's option) names the views besides it:
tensorboard, wandb (WANDB_MODE=offline writes under run_dir/wandb/, `wandb sync` uploads later), none.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import uuid
from pathlib import Path

import psutil
import torch

from nano_miles.config import ConfigError
from nano_miles.rollout.batch import solved_by_task

REQUIRED_KEYS = ("step", "reward_mean", "acc", "pg_loss", "clip_frac", "parity_mean", "parity_max",
                 "sync_ms", "mem_gb", "step_s", "weight_version")
# The live table: (metrics key, column title, format).
COLUMNS = (("step", "step", "{:>4d}"), ("reward_mean", "reward", "{:>+7.3f}"), ("acc", "acc", "{:>6.1%}"),
           ("pg_loss", "pg_loss", "{:>+8.4f}"), ("clip_frac", "clip", "{:>5.2f}"),
           ("parity_mean", "parity", "{:>8.2e}"), ("sync_ms", "sync_ms", "{:>8.1f}"), ("mem_gb", "mem_GB", "{:>6.2f}"),
           ("step_s", "step_s", "{:>6.1f}"), ("tokens_per_s", "tok/s", "{:>7.0f}"), ("turns_mean", "turns", "{:>5.2f}"),
           ("staleness_max", "stale", "{:>5d}"),
           # where the rollout's wall went: engine busy, episodes' time in the sandbox, slowest episode, refills
           ("engine_busy_share", "eng%", "{:>5.0%}"), ("sandbox_share", "sbx%", "{:>5.0%}"),
           ("critical_path_s", "crit_s", "{:>6.1f}"), ("refill_s", "refill", "{:>6.1f}"),
           ("zero_variance_share", "0-var", "{:>5.2f}"),  # groups whose samples all got the same reward: no signal
           ("eval_pass_at_1", "eval", "{:>5.2f}"),        # eval_every steps: pass@1 on eval_tasks
           ("elapsed_s", "elapsed", "duration"), ("eta_s", "ETA", "duration"))  # the run so far, and what is left
REPORTERS = ("tensorboard", "wandb")
TRAIN_CURVES = (("reward_mean", "mean reward"), ("acc", "accuracy"), ("entropy", "policy entropy (nats a token)"),
                ("parity_mean", "log-prob parity (mean |diff|)"))
EVAL_CURVES = (("eval_pass_at_1", "eval_tasks"), ("eval_alfa_pass_at_1", "ALFA subset"))
# Where a step's time went (nano_miles/rollout/anatomy.py): compared across runs, drawn where a run has them.
STEP_CURVES = (("step_s", "step seconds"), ("engine_busy_share", "engine busy share of the rollout wall"),
               ("engine_decode_s", "engine decode seconds a step"), ("sandbox_share", "sandbox share of episode time"),
               ("env_share", "env's own share of episode time"), ("critical_path_s", "slowest episode a step (s)"),
               ("critical_sandbox_s", "the slowest episode's sandbox seconds"),
               ("straggler_s", "wait on the slowest half of a step's episodes (s)"),
               ("refill_s", "wall refills added after the first wave (s)"))


def parse_report_to(value: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip() not in ("", "none")]
    if unknown := [n for n in names if n not in REPORTERS]:
        raise ValueError(f"report_to: unknown {unknown[0]!r}; comma-separated names of {', '.join(REPORTERS)}, or none")
    return names


def check_report_to(value: str) -> list[str]:
    """parse_report_to, and each reporter usable here (checked before a run loads anything)."""
    names = parse_report_to(value)
    if "wandb" in names and importlib.util.find_spec("wandb") is None:
        raise ConfigError("report_to=wandb needs the wandb package: `pip install wandb` (WANDB_MODE=offline "
                          "needs no account or network), or leave it out: --set report_to=tensorboard")
    return names


def duration(seconds: float) -> str:
    """12:34 or 1:02:03."""
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else float("nan")


def step_metrics(step: int, rollout, staleness: list[int], max_staleness: int, train: dict, skipped: str | None,
                 sync: dict, **extra) -> dict:
    """The metrics.jsonl row of one training step (`rollout`: a StepRollout; `train`: the trainer's
    metrics, {} if `skipped`; `extra` added as is). Reward, accuracy and throughput are of every
    trajectory rolled out (the policy's, dynamic sampling's drops included); `trajectories` and
    `task_ids` are what was trained on (a trajectory's length is response_tokens_mean, not the ratio)."""
    trajs = rollout.generated
    response_tokens = sum(len(t.response_ids) for t in trajs)
    return {
        "step": step, "trajectories": len(rollout.trajectories), "task_ids": [t.task_id for t in rollout.trajectories],
        "infra_failures": sum(t.broken for t in trajs),
        "setup_failures": rollout.setup_failures, "all_lost": rollout.all_lost,
        "engine_requests": rollout.engine_requests,  # /generate calls per engine replica
        "infra_errors": list(dict.fromkeys(rollout.infra_errors))[:3],  # why, in the sandbox's words
        "dropped_stale": sum(s > max_staleness for s in staleness), "staleness_max": max(staleness, default=0),
        "staleness_trained_max": max((s for s in staleness if s <= max_staleness), default=0),
        "reward_mean": _mean(t.reward for t in trajs),
        "acc": _mean(float(t.solved) for t in trajs),
        # [solved, samples] of each training task (metrics.jsonl only: not a scalar)
        "train_by_task": {task: [sum(s), len(s)] for task, s in sorted(solved_by_task(trajs).items())},
        "turns_mean": _mean(t.num_turns for t in trajs),
        **{key: train.get(key) for key in ("pg_loss", "clip_frac", "clip_cov_frac", "approx_kl", "kl_ref", "entropy",
                                          "grad_norm", "lr")},
        # parity: tokens sampled with the trainer's own weights; stale: by older ones (async), drift included
        "parity_mean": train.get("logprob_diff_mean"), "parity_max": train.get("logprob_diff_max"),
        "parity_stale_mean": train.get("logprob_diff_stale_mean"),
        "update_skipped": skipped, "updates": train.get("updates", 1) if train else 0,
        "sync_ms": sync["ms"], "sync_transport": sync["transport"], "sync_verified": sync["verified"],
        "sync_engines": sync.get("engines"),  # the replicas the sync reached
        # where the sync's milliseconds went: trainer/weight_sync.py, engine/weight_receiver.py
        **{f"sync_{phase}_ms": ms for phase, ms in (sync.get("phases_ms") or {}).items()},
        **{f"sync_engine_{phase}_ms": ms for phase, ms in (sync.get("engine_ms") or {}).items()},
        **{f"sync_send_{part}_ms": ms for part, ms in (sync.get("send_ms") or {}).items()},
        "weight_version": sync["weight_version"], "rollout_s": rollout.seconds, "response_tokens": response_tokens,
        "response_tokens_mean": response_tokens / len(trajs) if trajs else None,
        "tokens_per_s": response_tokens / max(rollout.seconds, 1e-9),
        "refill_rounds": max(0, rollout.sampling.rounds - 1) if rollout.sampling else 0,  # rounds' worth of refills
        "refill_groups": rollout.sampling.refills if rollout.sampling else 0,
        **rollout.anatomy.metrics(rollout.seconds),
        **(rollout.sampling.metrics() if rollout.sampling else {}), **extra}


def memory_gb(device: torch.device | str) -> float:
    """Peak trainer memory: CUDA max allocated on GPU, resident set size on CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return psutil.Process().memory_info().rss / 2**30


def parity_error(metrics: dict) -> str | None:
    """The error line when a true on-policy step's parity_max is not exactly 0.0 (even 1e-9 is a bug)."""
    value = metrics.get("parity_max")
    if not metrics.get("true_on_policy") or value is None or value == 0.0:
        return None
    return (f"ERROR step {metrics.get('step')}: true_on_policy but parity_max = {float(value):.3e} "
            "(the engine's log-probs differ from the trainer's; they must be equal bit for bit)")


def _cell(fmt: str, value) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return duration(value) if fmt == "duration" else fmt.format(int(value) if "d" in fmt else float(value))


def _width(title: str, fmt: str) -> int:
    return max(len(title), len(_cell(fmt, 0)), 7 if fmt == "duration" else 0)


def format_row(metrics: dict) -> str:
    return " ".join(_cell(fmt, metrics.get(key)).rjust(_width(title, fmt)) for key, title, fmt in COLUMNS)


def format_header() -> str:
    return " ".join(title.rjust(_width(title, fmt)) for _, title, fmt in COLUMNS)


class MetricsLog:
    """run_dir/metrics.jsonl, a line a step, its scalars mirrored to the `report_to` reporters."""

    def __init__(self, run_dir: str | Path, resume_after_step: int | None = None, echo=print,
                 report_to: str = "tensorboard", config: dict | None = None):
        reporters = check_report_to(report_to)
        self.run_dir, self.echo, self._header_printed = Path(run_dir), echo, False
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        if resume_after_step is not None and self.path.exists():
            # A run killed after logging step k but before checkpointing it will redo step k: drop the
            # lines past the checkpoint (with none at all, the run starts over from its step 0 evaluation).
            kept = [line for line in self.path.read_text().splitlines()
                    if line.strip() and resume_after_step and json.loads(line)["step"] <= resume_after_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self._file = open(self.path, "a", buffering=1)
        self._tb = self._wandb = None
        if "tensorboard" in reporters:
            from torch.utils.tensorboard import SummaryWriter  # a slow import: deferred until a run logs

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if "wandb" in reporters:
            self._wandb = start_wandb(self.run_dir, config or {})

    def log(self, metrics: dict) -> None:
        if missing := [k for k in REQUIRED_KEYS if k not in metrics]:
            raise ValueError(f"metrics for step {metrics.get('step')} lack keys {missing}")
        error = parity_error(metrics)
        self._write({**metrics, "parity_error": error is not None} if metrics.get("true_on_policy") else metrics)
        if not self._header_printed:
            self.echo(format_header())
            self._header_printed = True
        self.echo(format_row(metrics))
        if error is not None:
            self.echo(error)

    def log_eval(self, metrics: dict) -> None:
        """A row of evaluation alone (eval_* keys): the base policy's, at step 0, before any training."""
        if metrics:
            self._write({"step": 0, **metrics})

    def _write(self, metrics: dict) -> None:
        self._file.write(json.dumps(metrics, sort_keys=True) + "\n")
        step = int(metrics["step"])
        scalars = {key: value for key, value in metrics.items()
                   if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)}
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        write_curves(self.path, self.run_dir)


def start_wandb(run_dir: Path, config: dict):
    """A W&B run named after run_dir (project $WANDB_PROJECT or nano-miles), the same one after --resume."""
    import wandb  # optional: imported only when report_to names it

    id_file = run_dir / "wandb_id"
    run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
    id_file.write_text(run_id)
    try:
        return wandb.init(project=os.environ.get("WANDB_PROJECT", "nano-miles"), name=run_dir.name, id=run_id,
                          resume="allow", dir=str(run_dir), config=config)
    except Exception as e:  # no API key, no network...: say what to do instead of a wandb traceback
        raise RuntimeError(f"wandb could not start a run ({type(e).__name__}: {e}); WANDB_MODE=offline "
                           "logs without an account or network (`wandb sync` uploads later)") from None


def read_metrics(path: str | Path) -> list[dict]:
    path = Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def _points(rows: list[dict], key: str) -> list[tuple]:
    """(step, value) of one curve: every training step (None: no value), or the steps that evaluated."""
    if key in dict(EVAL_CURVES):
        return [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [(r["step"], r.get(key)) for r in rows if "reward_mean" in r]


def _plot(out_dir: str | Path, name: str, title: str, series: dict[str, list[tuple]], log: bool = False) -> Path:
    import matplotlib  # a slow import, and the Agg backend must be chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for label, points in series.items():
        ax.plot([s for s, _ in points], [float("nan") if v is None else v for _, v in points], marker="o",
                markersize=3 if len(points) > 30 else 6, label=label)
    ax.set_yscale("log" if log else "linear")
    if len(series) > 1:
        ax.legend()
    ax.set(xlabel="step", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path := Path(out_dir) / f"{name}.png", dpi=100)
    plt.close(fig)
    return path


def write_curves(metrics_path: str | Path, out_dir: str | Path) -> None:
    """PNG curves of TRAIN_CURVES and the evaluations. Entropy is drawn because its collapse is what
    ends learning in GRPO runs: once it nears 0, every group's samples agree and carry no signal."""
    if not (rows := read_metrics(metrics_path)):
        return
    for key, title in TRAIN_CURVES:
        points = _points(rows, key)
        log = key == "parity_mean" and any(v is not None and v > 0 for _, v in points)  # true on-policy: all 0.0
        _plot(out_dir, key, title, {key: points}, log)
    if evals := {label: p for key, label in EVAL_CURVES if (p := _points(rows, key))}:  # the steps that evaluated
        _plot(out_dir, "eval_pass_at_1", "pass@1 during training (eval_every)", evals)


def compare_curves(runs: dict[str, str | Path], out_dir: str | Path) -> list[Path]:
    """Several runs on one set of axes, a line a run: compare_<key>.png for each curve any run has."""
    rows = {label: read_metrics(path) for label, path in runs.items()}
    written = []
    evals = tuple((key, f"{label} pass@1 during training") for key, label in EVAL_CURVES)
    for key, title in TRAIN_CURVES + evals + STEP_CURVES:
        series = {label: _points(run_rows, key) for label, run_rows in rows.items()}
        if series := {label: points for label, points in series.items() if any(v is not None for _, v in points)}:
            written.append(_plot(out_dir, f"compare_{key}", title, series))
    return written


def task_split(rows: list[dict]) -> str | None:
    """Over the last 10 steps, how many tasks were always, never or sometimes solved (only those still
    teach the policy anything)."""
    rows, counts = rows[-10:], {}
    for row in rows:
        for task_id, (solved, samples) in (row.get("train_by_task") or {}).items():
            counts[task_id] = [a + b for a, b in zip(counts.get(task_id, [0, 0]), (solved, samples))]
    if not counts:
        return None
    always = sum(solved == samples for solved, samples in counts.values())
    never = sum(solved == 0 for solved, _ in counts.values())
    return (f"  tasks     steps {rows[0]['step']}-{rows[-1]['step']}: of {len(counts)} training tasks rolled out, "
            f"{always} always solved, {never} never, {len(counts) - always - never} sometimes")


def run_summary(rows: list[dict], wall_s: float, run_dir: Path) -> list[str]:
    run_dir = Path(run_dir)
    evaluations, rows = rows, [r for r in rows if "reward_mean" in r]  # training steps, without step 0's eval
    if not rows:
        return [f"no step completed in {duration(wall_s)}; run directory {run_dir}"]

    def change(key: str, fmt: str) -> str:
        show = [("-" if r.get(key) is None or not math.isfinite(r[key]) else fmt.format(r[key]), r["step"])
                for r in (rows[0], rows[-1])]
        return "{} (step {}) -> {} (step {})".format(*show[0], *show[1])

    files = [name for name in ("metrics.jsonl", "tensorboard/", "wandb/", "reward_mean.png", "acc.png", "entropy.png",
                               "parity_mean.png", "eval_pass_at_1.png", "checkpoint/", "final/", "best/")
             if (run_dir / name).exists()]
    lines = [f"summary: {len(rows)} step{'s' if len(rows) != 1 else ''}, {duration(wall_s)} wall time",
             f"  reward    {change('reward_mean', '{:+.3f}')}", f"  accuracy  {change('acc', '{:.1%}')}"]
    for key, label in EVAL_CURVES:
        if evaluated := [r for r in evaluations if r.get(key) is not None]:
            a, b = evaluated[0], evaluated[-1]
            lines.append(f"  eval      pass@1 on {label}: {a[key]:.3f} (step {a['step']}) -> "
                         f"{b[key]:.3f} (step {b['step']})")
    if split := task_split(rows):
        lines.append(split)
    lines.append(f"  files     {run_dir}/: {', '.join(files)}")
    if (run_dir / "final").is_dir():
        lines.append(f"  policy    nano-miles eval --model {run_dir / 'final'}   "
                     f"(or: nano-miles serve --model {run_dir / 'final'})")
    return lines
