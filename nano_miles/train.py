"""`nano-miles train`: the closed loop. Rollout -> batch -> advantages -> update -> weight sync -> metrics.

    nano-miles train [--config FILE.toml] [--set key=value ...] [--engine-url URL] [--resume RUN_DIR]

Layout from the hardware (overridable with trainer_device / engine_device): two or more GPUs put the
trainer on cuda:0 and the engine on cuda:1; one GPU holds both; no GPU runs both on the CPU. The
engine is a separate process (`nano-miles serve`) that this loop starts, restarts when it dies, and
stops at the end; or `--engine-url` drives one somebody else runs (ours or SGLang).

Modes: `sync` (on-policy: every rollout uses the latest weights) and `async` (rollouts for step v+1
are generated while step v trains; a trajectory whose oldest token is more than `max_staleness`
weight versions behind the trained policy is dropped and counted, newer ones are corrected by
truncated importance sampling against the engine's log-probs).
"""
from __future__ import annotations

import asyncio
import json
import queue
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nano_miles.algorithms import AdvantageConfig, LossConfig
from nano_miles.checkpoint import export_model, load_checkpoint, save_checkpoint
from nano_miles.config import ConfigError, apply_dict, load_config, parse_set, to_dict, validate
from nano_miles.rollout import RolloutConfig
from nano_miles.telemetry import MetricsLog, memory_gb
from nano_miles.trainer import DTYPES, OptimConfig
from nano_miles.update import policy_update
from nano_miles.weight_sync import SyncConfig

MODES = ("sync", "async")


@dataclass
class TrainConfig:
    model: str = "qwen2.5-coder-0.5b-instruct"  # registered name, HF folder or hub id
    steps: int = 8
    run_dir: str = ""                 # "" -> runs/<UTC timestamp>
    seed: int = 0
    dtype: str = "auto"               # float32 | bfloat16 | auto (bfloat16 on GPU, float32 on CPU)
    tasks: str = "train"              # seed | train | heldout | all | comma-separated task ids
    tasks_per_step: int = 2           # groups per step; each group is rollout.group_size samples of one task
    mode: str = "sync"                # sync | async
    max_staleness: int = 1            # async: max weight versions between a trajectory's oldest token and the policy
    checkpoint_every: int = 1         # steps between checkpoints (the latest one is kept)
    engine_url: str = ""              # "" -> start our own engine process
    trainer_device: str = "auto"
    engine_device: str = "auto"
    engine_max_running_requests: int = 256
    engine_mem_fraction: float = 0.35  # one GPU shared by trainer and engine: the engine's KV share
    max_engine_restarts: int = 3      # per step, before the run stops with an error
    micro_batch_size: int = 0         # sequences per forward/backward; 0 = auto (1 on CPU, 8 on GPU)
    updates_per_step: int = 1         # optimizer steps per rollout batch (PPO mini-batches of whole groups)
    logprob_chunk: int = 1024
    gradient_checkpointing: bool = False
    rollout: RolloutConfig = field(default_factory=lambda: RolloutConfig(group_size=4))
    optim: OptimConfig = field(default_factory=OptimConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    sync: SyncConfig = field(default_factory=SyncConfig)

    def __post_init__(self):
        if self.steps < 1 or self.tasks_per_step < 1 or self.checkpoint_every < 1 or self.updates_per_step < 1:
            raise ValueError("steps, tasks_per_step, checkpoint_every and updates_per_step must be >= 1")
        if self.micro_batch_size < 0:
            raise ValueError("micro_batch_size must be >= 0 (0 = auto)")
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.max_staleness < 0 or self.max_engine_restarts < 0:
            raise ValueError("max_staleness and max_engine_restarts must be >= 0")


# ----------------------------------------------------------------------------- layout

@dataclass
class Layout:
    trainer_device: str
    engine_device: str
    dtype: str
    engine_args: list[str]


def plan_layout(cfg: TrainConfig) -> Layout:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n >= 2:
        trainer, engine = "cuda:0", "cuda:1"
    elif n == 1:
        trainer = engine = "cuda:0"
    else:
        trainer = engine = "cpu"
    trainer = trainer if cfg.trainer_device == "auto" else cfg.trainer_device
    engine = engine if cfg.engine_device == "auto" else cfg.engine_device
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if trainer.startswith("cuda") else "float32")
    args = ["--max-running-requests", str(cfg.engine_max_running_requests)]
    if engine.startswith("cuda") and engine == trainer:
        args += ["--mem-fraction-static", str(cfg.engine_mem_fraction)]
    return Layout(trainer, engine, dtype, args)


# ----------------------------------------------------------------------------- data order

class TaskStream:
    """The tasks of the run in a seeded order, epoch after epoch; `position` is all the state a
    resume needs to continue exactly where the run stopped."""

    def __init__(self, tasks: list, seed: int, position: int = 0):
        if not tasks:
            raise ValueError("no tasks selected")
        self.tasks, self.seed, self.position = list(tasks), seed, position

    def _order(self, epoch: int) -> list:
        order = list(self.tasks)
        random.Random(self.seed * 7919 + epoch).shuffle(order)
        return order

    def take(self, k: int) -> list:
        out = []
        for _ in range(k):
            epoch, i = divmod(self.position, len(self.tasks))
            out.append(self._order(epoch)[i])
            self.position += 1
        return out


# ----------------------------------------------------------------------------- the engine

class EngineHandle:
    """Our engine process (restartable) or an external URL (not ours to restart)."""

    def __init__(self, cfg: TrainConfig, layout: Layout, model_path: str, run_dir: Path):
        self.cfg, self.layout, self.model_path, self.run_dir = cfg, layout, model_path, run_dir
        self.process = None
        self.restarts = 0
        self.url = cfg.engine_url or None

    def start(self) -> str:
        if self.cfg.engine_url:
            from nano_miles.client import EngineClient

            EngineClient(self.cfg.engine_url).wait_until_ready(timeout=60)
            return self.url
        from nano_miles.client import start_engine_process

        self.process = start_engine_process(
            self.model_path, device=self.layout.engine_device, dtype=self.layout.dtype,
            extra_args=self.layout.engine_args, log_path=self.run_dir / "engine.log")
        self.url = self.process.url
        (self.run_dir / "engine.json").write_text(json.dumps({"pid": self.process.process.pid, "url": self.url}))
        return self.url

    def restart(self) -> str:
        if self.cfg.engine_url:
            raise RuntimeError(f"the engine at {self.cfg.engine_url} is unavailable and is not ours to restart")
        self.stop()
        self.restarts += 1
        return self.start()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop()
            self.process = None


# ----------------------------------------------------------------------------- the loop

def _rollout(urls, tokenizer, tasks, rollout_cfg, seed, desc="rollout", stats=None):
    """All groups of one step, with a progress bar (episodes done, ETA) on stderr."""
    from tqdm import tqdm

    from nano_miles.rollout import rollout_groups

    with tqdm(total=len(tasks) * rollout_cfg.group_size, desc=desc, unit="ep", leave=False,
              dynamic_ncols=True) as bar:
        return asyncio.run(rollout_groups(urls, tokenizer, tasks, rollout_cfg, seed=seed, stats=stats,
                                          on_episode_done=lambda: bar.update(1)))


def _episode_seed(run_seed: int, step: int) -> int:
    return run_seed * 1_000_003 + step  # fresh task instances every step, reproducible per run


def _version(v) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return -1  # an engine with non-numeric versions: treated as maximally stale


def _mean(xs) -> float:
    xs = list(xs)
    return float(sum(xs) / len(xs)) if xs else float("nan")


class TrainingRun:
    """One run directory: the trainer, the engine, the weight sync, the data position, the metrics."""

    def __init__(self, cfg: TrainConfig, resume_dir: str | None = None, echo=print):
        from transformers import AutoTokenizer

        from nano_miles.models import resolve_model
        from nano_miles.tasks import select_tasks
        from nano_miles.trainer import Trainer, TrainerConfig

        self.cfg, self.echo = cfg, echo
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        self.run_dir = Path(resume_dir or cfg.run_dir or Path("runs") / stamp)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not resume_dir:
            (self.run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
        self.layout = plan_layout(cfg)
        self.model_path = str(resolve_model(cfg.model))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        echo(f"model {self.model_path} | trainer {self.layout.trainer_device} | engine "
             f"{cfg.engine_url or self.layout.engine_device} | dtype {self.layout.dtype} | mode {cfg.mode} "
             f"| run_dir {self.run_dir}")
        torch.manual_seed(cfg.seed)
        random.seed(cfg.seed)
        # The engine starts before the trainer so that, on one shared GPU, it sizes its KV cache first.
        self.engine = EngineHandle(cfg, self.layout, self.model_path, self.run_dir)
        self.url = self.engine.start()
        self.trainer = Trainer(TrainerConfig(
            model=self.model_path, device=self.layout.trainer_device, dtype=self.layout.dtype,
            micro_batch_size=cfg.micro_batch_size or (8 if self.layout.trainer_device.startswith("cuda") else 1),
            logprob_chunk=cfg.logprob_chunk,
            gradient_checkpointing=cfg.gradient_checkpointing, optim=cfg.optim, loss=cfg.loss))
        self.stream = TaskStream(select_tasks(cfg.tasks), cfg.seed)
        self.start_step = 0
        if resume_dir:
            state = load_checkpoint(self.run_dir, self.trainer)
            if state is None:
                echo(f"{self.run_dir} has no checkpoint yet: starting from step 1")
            else:
                self.start_step, self.stream.position = state["step"], state["data_position"]
                echo(f"resumed from {self.run_dir}/checkpoint after step {self.start_step}")
        self.log = MetricsLog(self.run_dir, resume_after_step=self.start_step if resume_dir else None, echo=echo)
        self.syncer = None
        self._mutating = False
        self._stop_after_step = False
        self._connect()
        self.producer = AsyncProducer(self) if cfg.mode == "async" else None

    # -- engine ------------------------------------------------------------------------------

    def _connect(self) -> None:
        from nano_miles.weight_sync import WeightSync

        if self.syncer is not None:
            self.syncer.close()
        self.syncer = WeightSync.from_config(self.trainer, [self.url], self.cfg.sync)
        if self.trainer.step:
            self.syncer.sync(str(self.trainer.step))  # a fresh engine serves the base weights: catch it up

    def _recover(self, err: Exception, attempt: int, what: str) -> None:
        if attempt > self.cfg.max_engine_restarts:
            raise RuntimeError(f"{what}: the engine is still failing after {attempt - 1} restarts: {err}") from err
        self.echo(f"{what}: engine unavailable ({err}); restarting it and re-syncing the weights")
        self.url = self.engine.restart()
        self._connect()

    # -- one step ----------------------------------------------------------------------------

    def _collect(self, step: int):
        """This step's trajectories, retrying on a dead engine (same tasks, same seeds)."""
        from nano_miles.client import EngineUnavailable

        attempt = 0
        while True:
            try:
                if self.producer:
                    return self.producer.get(step)
                position = self.stream.position
                tasks = self.stream.take(self.cfg.tasks_per_step)
                t0 = time.perf_counter()
                try:
                    trajs = _rollout([self.url], self.tokenizer, tasks, self.cfg.rollout,
                                     _episode_seed(self.cfg.seed, step), desc=f"step {step} rollout",
                                     stats=self.rollout_stats)
                except BaseException:
                    self.stream.position = position
                    raise
                return trajs, time.perf_counter() - t0
            except EngineUnavailable as e:
                attempt += 1
                self._recover(e, attempt, f"step {step} rollout")
                if self.producer:
                    self.producer.restart(step)

    def _sync(self, step: int) -> dict:
        from nano_miles.client import EngineUnavailable
        from nano_miles.weight_sync import WeightSyncError

        attempt = 0
        while True:
            try:
                return self.syncer.sync(str(self.trainer.step))
            except (EngineUnavailable, WeightSyncError, ConnectionError) as e:
                attempt += 1
                self._recover(e, attempt, f"step {step} weight sync")

    def step(self, step: int) -> dict:
        t0 = time.perf_counter()
        self.rollout_stats = {}  # setup failures of this step's episodes (sync mode)
        trajs, rollout_s = self._collect(step)
        policy_version = self.trainer.step
        staleness = [policy_version - min(_version(v) for v in t.weight_versions) if t.weight_versions else 0
                     for t in trajs]
        # Sandbox infrastructure failures are not the policy's doing: counted, never trained on.
        infra = sum(t.finish_reason == "infra_error" for t in trajs)
        kept = [t for t, s in zip(trajs, staleness)
                if s <= self.cfg.max_staleness and t.finish_reason != "infra_error"]
        self._mutating = True  # from here until the step is logged, the trainer is between states
        train, skipped = policy_update(self.trainer, kept, self.cfg.advantage, self.pad_id, self.echo,
                                       updates=self.cfg.updates_per_step)
        if self.trainer.device.type == "cuda":
            # AdamW and the master -> bf16 copy are still queued on the GPU: let the update pay for
            # them, so that sync_ms measures the weight transfer and not the optimizer's tail.
            torch.cuda.synchronize(self.trainer.device)
        sync = self._sync(step)
        response_tokens = sum(len(t.response_ids) for t in trajs)
        return {
            "step": step, "trajectories": len(trajs), "infra_failures": infra,
            "setup_failures": self.rollout_stats.get("setup_failures", 0),
            "dropped_stale": sum(s > self.cfg.max_staleness for s in staleness),
            "staleness_max": max(staleness, default=0),
            "staleness_trained_max": max((s for s in staleness if s <= self.cfg.max_staleness), default=0),
            "task_ids": [t.task_id for t in trajs],
            "reward_mean": _mean(t.reward for t in trajs),
            "acc": _mean(1.0 if t.reward_components.get("correct", 0) > 0 else 0.0 for t in trajs),
            "turns_mean": _mean(t.num_turns for t in trajs),
            "pg_loss": train.get("pg_loss"), "clip_frac": train.get("clip_frac"),
            "approx_kl": train.get("approx_kl"), "entropy": train.get("entropy"), "grad_norm": train.get("grad_norm"),
            "parity_mean": train.get("logprob_diff_mean"), "parity_max": train.get("logprob_diff_max"),
            "update_skipped": skipped, "updates": train.get("updates", 1) if train else 0,
            "sync_ms": sync["ms"], "sync_transport": sync["transport"], "sync_verified": sync["verified"],
            "weight_version": sync["weight_version"],
            "mem_gb": memory_gb(self.layout.trainer_device),
            "rollout_s": rollout_s, "response_tokens": response_tokens,
            "tokens_per_s": response_tokens / max(rollout_s, 1e-9),
            "step_s": time.perf_counter() - t0, "engine_restarts": self.engine.restarts,
        }

    def _checkpoint(self, step: int) -> None:
        position = self.producer.position_after(step) if self.producer else self.stream.position
        save_checkpoint(self.run_dir, self.trainer, {"step": step, "data_position": position,
                                                     "weight_version": str(self.trainer.step)})
        self.checkpointed = step

    # -- the whole run -----------------------------------------------------------------------

    def _on_sigint(self, signum, frame) -> None:
        # Ctrl-C during a rollout stops at once (nothing has changed yet); during the update, sync and
        # logging of a step it lets that step finish, so the checkpoint written on the way out is that
        # step's (otherwise every step since the last periodic checkpoint would be lost). Twice: now.
        if self._mutating and not self._stop_after_step:
            self._stop_after_step = True
            self.echo("Ctrl-C: stopping after this step's update and weight sync (Ctrl-C again: stop now)")
            return
        raise KeyboardInterrupt

    def run(self) -> Path:
        cfg = self.cfg
        self.checkpointed = self.start_step
        completed = self.start_step
        in_main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, self._on_sigint) if in_main else None
        try:
            if self.producer:
                self.producer.start(self.start_step + 1)
            for step in range(self.start_step + 1, cfg.steps + 1):
                metrics = self.step(step)
                self.log.log(metrics)
                completed, self._mutating = step, False
                if step % cfg.checkpoint_every == 0 or step == cfg.steps:
                    self._checkpoint(step)
                if self._stop_after_step and step < cfg.steps:
                    raise KeyboardInterrupt
            export_model(self.trainer, self.model_path, self.run_dir / "final")
            self.echo(f"done: metrics, curves and the final policy (final/) in {self.run_dir}")
        except KeyboardInterrupt:
            # Steps are atomic: the trainer state is the one after the last completed step's sync
            # unless a second Ctrl-C hit mid-update, in which case the older checkpoint stands.
            if completed > self.checkpointed and not self._mutating:
                self._checkpoint(completed)
            self.echo(f"interrupted after step {completed}: resume with --resume {self.run_dir}")
            raise
        finally:
            if in_main:
                signal.signal(signal.SIGINT, previous)
            self.close()
        return self.run_dir

    def close(self) -> None:
        if self.producer:
            self.producer.stop()
        if self.syncer is not None:
            try:
                self.syncer.close()
            except Exception as e:  # the engine may already be gone
                self.echo(f"weight sync close: {e}")
        self.engine.stop()
        self.log.close()


def run_training(cfg: TrainConfig, resume_dir: str | None = None, echo=print) -> Path:
    return TrainingRun(cfg, resume_dir, echo).run()


class AsyncProducer:
    """Fully async mode: a background thread keeps rolling out the next step's groups while the
    current step trains. The queue holds one finished step, so rollouts run at most one step ahead
    of training; the engine's weights change under in-flight episodes, and each turn records the
    weight_version it was sampled with, which is what staleness is measured on."""

    def __init__(self, run: TrainingRun):
        self.run = run
        self.queue: queue.Queue = queue.Queue(maxsize=1)
        self.positions: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = None

    def start(self, first_step: int) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, args=(first_step,), daemon=True, name="rollout-producer")
        self._thread.start()

    def _loop(self, step: int) -> None:
        run = self.run
        while not self._stop.is_set() and step <= run.cfg.steps:
            position = run.stream.position
            tasks = run.stream.take(run.cfg.tasks_per_step)
            self.positions[step] = run.stream.position
            t0 = time.perf_counter()
            try:
                trajs = _rollout([run.url], run.tokenizer, tasks, run.cfg.rollout, _episode_seed(run.cfg.seed, step),
                                 desc=f"step {step} rollout (async)")
                item = (step, trajs, time.perf_counter() - t0, None)
            except Exception as e:  # handed to the training thread, which decides what to do
                run.stream.position = position
                item = (step, None, 0.0, e)
            while not self._stop.is_set():
                try:
                    self.queue.put(item, timeout=0.2)
                    break
                except queue.Full:
                    continue
            if item[3] is not None:
                return
            step += 1

    def get(self, step: int):
        got, trajs, seconds, err = self.queue.get()
        if err is not None:
            raise err
        if got != step:
            raise RuntimeError(f"async producer delivered step {got} while the trainer is at step {step}")
        return trajs, seconds

    def position_after(self, step: int) -> int:
        return self.positions[step]

    def restart(self, step: int) -> None:
        self.stop()
        self.queue = queue.Queue(maxsize=1)
        self.start(step)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=120)
            self._thread = None


# ----------------------------------------------------------------------------- CLI

def add_arguments(p) -> None:
    p.add_argument("--config", help="TOML file with dotted sections (e.g. [optim] lr = 1e-6)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any config key, e.g. --set optim.lr=1e-6 --set sync.transport=disk")
    p.add_argument("--engine-url", help="drive an engine somebody else started (ours or SGLang)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")


def run(args) -> int:
    import sys

    try:
        overrides = parse_set(args.set)
        if args.engine_url:
            overrides["engine_url"] = args.engine_url
        config_path = args.config
        if args.resume:
            run_dir = Path(args.resume)
            if not (run_dir / "config.json").is_file():
                raise ConfigError(f"--resume {run_dir}: not a run directory (no config.json)")
            # The run's own config, then only what this command line overrides.
            cfg = TrainConfig()
            apply_dict(cfg, json.loads((run_dir / "config.json").read_text()))
            apply_dict(cfg, overrides)
            validate(cfg)
        else:
            cfg = load_config(TrainConfig, config_path, overrides)
    except ConfigError as e:
        print(f"nano-miles train: {e}", file=sys.stderr)
        return 2
    try:
        run_training(cfg, resume_dir=args.resume)
    except KeyboardInterrupt:
        return 130
    except RuntimeError as e:
        print(f"nano-miles train: {e}", file=sys.stderr)
        return 1
    return 0
