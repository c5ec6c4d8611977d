"""`nano-miles train`: the closed loop. Rollout -> filter -> update -> weight sync -> log -> checkpoint -> eval.

    nano-miles train [--config FILE.toml] [--set key=value ...] [--engine-url URL ...] [--resume RUN_DIR]
    nano-miles train --set trainer.nproc=N ...           the trainer on N ranks of this host
    torchrun --nproc-per-node N -m nano_miles.train ...  the same ranks, started by torchrun

Every rank runs this loop. Rank 0 owns the engines, rollouts, telemetry and evaluation and hands each
step's trajectories and decisions to the others (Run.share, nano_miles/train_setup.py); every rank makes
the same update, weight sync and checkpoint. mode=async rolls out step v+1 while step v trains; a
trajectory over `max_staleness` versions behind is not trained on but stays in its group's baseline.
"""
from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import time
from pathlib import Path

import torch

from nano_miles.config import ConfigError, add_config_arguments, config_from_args, to_toml
from nano_miles.engine.client import EngineUnavailable
from nano_miles.engine.weights import NonFiniteWeights
from nano_miles.telemetry import memory_gb, read_metrics, run_summary, step_metrics
from nano_miles.train_config import TrainConfig, check_world
from nano_miles.train_setup import Run, RunFailed, Stopped
from nano_miles.trainer.checkpoint import check_resumable, checkpoint_folder, export_model
from nano_miles.trainer.checkpoint_files import read_json
from nano_miles.trainer.distributed import (DistError, check_nproc, is_collective_failure, launch_ranks, main_guard,
                                            rank_device_type, rank_env, run_rank)
from nano_miles.trainer.update import policy_update
from nano_miles.trainer.weight_sync import WeightSyncError


class TrainingRun(Run):
    def run(self) -> Path:
        """The loop, on every rank; returns the run directory."""
        cfg, completed, together = self.cfg, self.start_step, False
        with self.stop_signals():
            try:
                loop_started = self.begin()
                for step in range(self.start_step + 1, cfg.steps + 1):
                    try:
                        metrics = self.step(step)  # rollout, filter, update, weight sync
                    except NonFiniteWeights as e:  # a training failure: neither skipped nor retried
                        raise RunFailed(f"stopped at step {step}: {e}. The engines keep the weights they had; lower "
                                        f"optim.lr (or find what diverged) and continue with --resume {self.run_dir} "
                                        f"(from step {self.checkpointed + 1})") from None
                    if self.lead:  # rank 0: the evaluation, the metrics row, what every rank does next
                        metrics.update(self.evaluation.after_step(step, self.engines, self.tokenizer, self.make_sandbox))
                        now = time.monotonic()  # the run so far, and the rest at this process's pace
                        per_step = (now - loop_started) / (step - self.start_step)
                        metrics.update(elapsed_s=now - self.started, eta_s=per_step * (cfg.steps - step))
                        self.log.log(metrics)
                    plan = self.share(self.plan(step, metrics) if self.lead else None)
                    completed = step
                    if plan["best"]:
                        export_model(self.trainer, self.model_path, self.run_dir / "best", self.run_dir / "checkpoint",
                                     best=self.evaluation.best if self.lead else None)
                    if plan["checkpoint"]:
                        self.checkpoint(plan["checkpoint"])
                    self.mid_step = False
                    if plan["failed"]:
                        together = True
                        raise RunFailed(plan["failed"])
                    if plan["stop"]:
                        raise Stopped
                # trainer.step counts optimizer steps: 0 means the policy is still the base model.
                if self.trainer.step > 0:
                    export_model(self.trainer, self.model_path, self.run_dir / "final", self.run_dir / "checkpoint")
                self.echo(self.checkpointer.finish())
                together = True
            except (KeyboardInterrupt, RunFailed) as e:
                # Rank 0's decisions reach every rank; a second Ctrl-C mid-step is rank 0's alone, and
                # the older checkpoint stands (steps are atomic).
                together = together or isinstance(e, Stopped) or (self.world == 1 and not self.mid_step)
                if isinstance(e, KeyboardInterrupt):
                    if completed > self.checkpointed and together:
                        self.checkpoint(completed, background=False)
                    self.echo(f"interrupted after step {completed}: resume with --resume {self.run_dir}")
                raise
            finally:
                self.close(together)
        rows = read_metrics(self.log.path) if self.lead else []
        if self.lead:
            for line in run_summary(rows, time.monotonic() - self.started, self.run_dir):
                self.echo(line)
        if self.trainer.step == 0:
            reasons = sorted({r["update_skipped"] for r in rows if r.get("update_skipped")})
            raise RunFailed(f"trained on nothing: no step updated the policy ({'; '.join(reasons) or 'no step ran'}), "
                            f"so it is still the base model and no final/ was written; metrics in {self.run_dir}")
        return self.run_dir

    def step(self, step: int) -> dict | None:
        """One step's update and weight sync, on every rank; rank 0's metrics (None on the others)."""
        t0 = time.perf_counter()
        rollout, stale, trajs, train_on, skipped = self.collect(step)
        self.mid_step = True  # until the step is checkpointed, the trainer is between states
        if self.lead:
            try:  # colocated (shared weights): the idle engine drops its KV memory during the update
                self.syncer.before_update()
            except (EngineUnavailable, WeightSyncError) as e:  # only memory: the sync finds a dead engine
                self.echo(f"engine memory release: {e}")
        train = {}
        if skipped is None:  # (skipped: every episode lost to the sandbox, or no learning signal)
            train, skipped = policy_update(self.trainer, trajs, self.cfg.advantage, self.pad_id, self.echo,
                                           updates=self.cfg.updates_per_step, reference=self.reference,
                                           train_on=train_on)
        if self.trainer.device.type == "cuda":  # the update pays for its queued kernels: sync_ms is the sync's
            torch.cuda.synchronize(self.trainer.device)
        sync = self.sync(step)
        memory = self.gather(memory_gb(self.trainer.device))
        if not self.lead:
            return None
        return step_metrics(step, rollout, stale, self.cfg.max_staleness, train, skipped, sync,
                            mem_gb=max(memory), mem_gb_ranks=memory, step_s=time.perf_counter() - t0,
                            world_size=self.world, engine_replicas=len(self.engines.replicas),
                            engine_restarts=self.engines.restarts,
                            true_on_policy=self.cfg.true_on_policy)  # parity_max != 0 is then an error

    def plan(self, step: int, metrics: dict) -> dict:
        """Rank 0, after a step: what every rank does next (export best/, checkpoint, stop, fail). After
        max_infra_failed_steps lost steps the checkpoint is from before them: --resume redoes them."""
        self.lost = self.lost + 1 if metrics["all_lost"] else 0
        best = self.evaluation.new_best(step, metrics, self.run_dir / "best")
        if self.lost >= self.cfg.max_infra_failed_steps:
            before = step - self.lost
            return {"best": best, "checkpoint": before if before > self.checkpointed else None, "stop": False,
                    "failed": f"stopped at step {step}: steps {before + 1}-{step} lost every episode to "
                              f"infrastructure failures, nothing was trained on in them (max_infra_failed_steps="
                              f"{self.cfg.max_infra_failed_steps}). Cause: {'; '.join(metrics['infra_errors']) or 'no message'}. "
                              f"Fix it and continue with --resume {self.run_dir} (from step {before + 1})"}
        due = step == self.cfg.steps or self.checkpointer.due(step)
        return {"best": best, "checkpoint": step if due else None, "failed": None,
                "stop": self.stop_requested and step < self.cfg.steps}


# ----------------------------------------------------------------------------- CLI

CONFIG = TrainConfig


def add_arguments(p) -> None:
    add_config_arguments(p, TrainConfig, {"--engine-url": "engine.url"}, repeatable=("--engine-url",))
    p.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its last checkpoint")


def run(args) -> int:
    cfg = train_config(args)
    if args.print_config:
        print(to_toml(cfg), end="")
        return 0
    world = rank_env()
    if args.resume and (world is None or world[0] == 0) and (ckpt := checkpoint_folder(Path(args.resume))):
        check_resumable(ckpt)  # a checkpoint that cannot be resumed: one line, before any model loads
    try:
        if world is not None and world[1] > 1:  # one of N ranks (torchrun's, or launch_ranks' below)
            check_world(cfg, world[1])
            return main_guard(lambda: run_rank(_train, cfg, args.resume, device_type=rank_device_type(
                cfg.trainer_device), timeout_s=cfg.trainer.dist_timeout_s))()
        if cfg.trainer.nproc > 1 and world is None:  # N ranks of this host, as torchrun would start them
            device_type = rank_device_type(cfg.trainer_device)
            check_nproc(cfg.trainer.nproc, device_type)
            if not args.resume and not cfg.run_dir:  # every rank writes into the same run directory
                cfg = dataclasses.replace(cfg, run_dir=str(Path("runs") / time.strftime("%Y%m%d-%H%M%S", time.gmtime())))
            print(f"starting {cfg.trainer.nproc} trainer ranks ({device_type}) ...")
            return launch_ranks(cfg.trainer.nproc, device_type, "nano_miles.train", to_toml(cfg),
                                ["--resume", args.resume] if args.resume else [])
    except (DistError, ValueError) as e:  # more ranks than GPUs, a setting ranks cannot do yet
        raise ConfigError(str(e)) from None
    return _train(None, cfg, args.resume)


def train_config(args) -> TrainConfig:
    """The command line's config; with --resume, on the run's config.json less its tasks modules (code this
    host would run, which a run directory is not trusted to ask for: the command line must name them)."""
    saved, modules, config_json = None, [], Path(args.resume or ".") / "config.json"
    if args.resume:
        if not config_json.is_file():
            raise ConfigError(f"--resume {args.resume}: not a run directory (no config.json)")
        saved = read_json(config_json, "a run's config")
        modules = saved.pop("tasks_module", None) or []
        modules = [str(m) for m in (modules if isinstance(modules, list) else [modules])]
    cfg = config_from_args(TrainConfig, args, base=saved)
    if unconfirmed := [m for m in modules if m not in cfg.tasks_module]:
        raise ConfigError(f"--resume {args.resume}: its config.json loads tasks_module {', '.join(unconfirmed)}, "
                          "code this host would run, which a run directory is not trusted to ask for: "
                          f"--set tasks_module={','.join(modules)} resumes with it")
    return cfg


def _train(env, cfg: TrainConfig, resume_dir: str | None) -> int:
    """The run's exit code. With N ranks rank 0 says how the run ended and the others end quietly (a
    failure of their own is raised, for run_rank to name the rank)."""
    lead = env is None or env.rank == 0
    if not lead:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's: it tells the others
    try:
        TrainingRun(cfg, resume_dir, env=env).run()
    except KeyboardInterrupt:
        return 130 if lead else 0
    except ConfigError as e:  # a refusal before anything started (a CheckpointError is one)
        if not lead:
            raise
        print(f"nano-miles train: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if env is not None and (is_collective_failure(e) or not (lead or isinstance(e, RunFailed))):
            raise
        if lead:
            print(f"nano-miles train: {e}", file=sys.stderr)
        return 1 if lead else 0
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m nano_miles.train ARGS`: what torchrun and launch_ranks start on every rank."""
    parser = argparse.ArgumentParser(prog="python -m nano_miles.train", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except ConfigError as e:
        print(f"nano-miles train: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
