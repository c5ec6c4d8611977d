"""The trainer's state through torch.distributed.checkpoint (DCP): sharded, written in the background,
loadable by any number of ranks.

What is saved: the FP32 masters, AdamW's state per parameter (step, exp_avg, exp_avg_sq) and the
step count, keyed by HF parameter names. A sharded trainer's masters and moments are DTensors, so
each rank writes only its own shards (plus DCP's metadata of where every shard lives); loading
reads whatever slices the loading ranks own, whichever N saved it. The single-process Trainer's
plain tensors go through the same functions, so a run saved with 2 ranks resumes in 1 and back.

A save is atomic like nano_miles.checkpoint's: DCP writes into `<dir>.tmp` and rank 0 renames it
over `<dir>` once every rank has written (DCP's coordinator only finishes after all of them).
With background=True the state is first copied to CPU memory (so the next step may change the
parameters at once) and the files are written by a thread; call `.wait()` on the returned handle
before the next save and at the end of the run. The RNG and data position stay with the loop's
own state.json (nano_miles.checkpoint).
"""
from __future__ import annotations

import shutil
from concurrent.futures import Future
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp


def trainer_state(trainer) -> dict:
    """The state DCP saves and loads in place. AdamW's state is created (zeros, step 0) where it
    does not exist yet, so a fresh trainer has every tensor a checkpoint will be loaded into."""
    optim = trainer.optimizer
    moments = {}
    for name, master in zip(trainer.names, trainer.masters):
        state = optim.state[master]
        if not state:  # what AdamW's first step would create (float32 step on the CPU, zero moments)
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        moments[name] = {k: state[k] for k in ("step", "exp_avg", "exp_avg_sq")}
    return {"masters": dict(zip(trainer.names, trainer.masters)), "optim": moments,
            "trainer": {"step": trainer.step}}


class PendingSave:
    """A checkpoint being written in the background; wait() finishes it (every rank must call it)."""

    def __init__(self, future, tmp: Path, final: Path, group):
        self.future, self.tmp, self.final, self.group = future, tmp, final, group

    def done(self) -> bool:
        return self.future is None or self.future.done()

    def wait(self) -> Path:
        if self.future is not None:
            self.future.result()
            self.future = None
            if _is_main():
                _replace(self.tmp, self.final)
            if dist.is_initialized():
                dist.barrier(group=self.group)  # the checkpoint is in place when any rank returns
        return self.final


def _group(trainer):
    env = getattr(trainer, "env", None)
    return env.cpu_group if env is not None else None


def _is_main() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _replace(tmp: Path, final: Path) -> None:
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def save(trainer, path, background: bool = True) -> PendingSave:
    """Write the trainer's state to the folder `path` (collective: every rank calls it)."""
    final = Path(path)
    tmp = final.with_name(final.name + ".tmp")
    group = _group(trainer)
    if _is_main():
        shutil.rmtree(tmp, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier(group=group)  # nobody writes into tmp before rank 0 has cleared it
    state = trainer_state(trainer)
    single = not dist.is_initialized()
    if background:
        future = dcp.async_save(state, checkpoint_id=str(tmp), process_group=group, no_dist=single)
    else:
        future = Future()
        future.set_result(dcp.save(state, checkpoint_id=str(tmp), process_group=group, no_dist=single))
    pending = PendingSave(future, tmp, final, group)
    if not background:
        pending.wait()
    return pending


def load(trainer, path) -> None:
    """Load a checkpoint written by `save` with any number of ranks (collective: every rank calls it)."""
    path = Path(path)
    if not (path / ".metadata").exists():
        raise FileNotFoundError(f"{path} is not a distributed checkpoint (no .metadata)")
    state = trainer_state(trainer)
    dcp.load(state, checkpoint_id=str(path), process_group=_group(trainer), no_dist=not dist.is_initialized())
    trainer.step = int(state["trainer"]["step"])
    trainer._copy_masters_to_model()  # the single-process trainer's bf16 compute copy follows its masters
