"""Run checkpoints (trainer state, RNG, data position) and the exported policy (final/, best/).

One process's checkpoint/ is a model folder too (`eval --model RUN/checkpoint`): the FP32 masters as
model.safetensors (final/ hard-links it), config.json, the tokenizer, optimizer.pt and state.json.
N ranks' is a DCP folder (dist_checkpoint.py) with rank 0's state.json. Either loads into any number
of ranks, its files checked by checkpoint_files.py. With N ranks every function here is collective.

A checkpoint is written under checkpoint.tmp/ and renamed into place, so a kill leaves the old one or
the new one. One process's thread writes the live tensors (a copy is what a small machine cannot
spare), which the trainer leaves alone until the write is done (Trainer.wait_for_save).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import struct
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from nano_miles.trainer import dist_checkpoint
from nano_miles.trainer.checkpoint_files import CheckpointError  # noqa: F401 (imported from here too)
from nano_miles.trainer.checkpoint_files import FORMAT, check_resumable, checkpoint_folder, restore_rng
_WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")  # one process's writes
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
              torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(path: Path, named_tensors, metadata: dict | None = None) -> int:
    """Write (name, tensor) pairs as one safetensors file, tensor by tensor (the safetensors package
    first copies every tensor into one buffer: the whole model again). Returns its size in bytes."""
    named = [(n, t.detach()) for n, t in named_tensors]
    header, offset = {}, 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for _, t in named:
            cpu = t.cpu().contiguous()  # no copy for the CPU trainer's tensors; one tensor at a time from a GPU
            if cpu.numel():
                f.write(memoryview(cpu.reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())
    return 8 + len(raw) + offset


def disk_line(num_params: int, run_dir: Path, keep_optimizer: bool) -> str:
    """What the run needs on disk, for the start-up message (and a warning if it is not there)."""
    one = 12 * num_params  # FP32 masters (4 bytes a parameter) and AdamW's two FP32 moments (8)
    end = (one if keep_optimizer else 4 * num_params) + 50_000_000  # + tokenizer, metrics, curves, logs
    line = (f"disk: a checkpoint is {one / 1e9:.1f} GB ({2 * one / 1e9:.1f} GB while one replaces the last); "
            f"the run directory keeps {end / 1e9:.1f} GB at the end (final/ and checkpoint/ share the weights"
            f"{'' if keep_optimizer else '; AdamW state dropped: keep_optimizer_state=false'})")
    try:
        free = shutil.disk_usage(Path(run_dir)).free
    except OSError:
        return line
    if free < 2 * one:
        line += f" -- WARNING: only {free / 1e9:.1f} GB free there"
    return line


class PendingCheckpoint:
    """A checkpoint being written in the background; wait() finishes it (N ranks: every rank calls it,
    and the folder goes into place once all have written) and re-raises its error. seconds: how long
    the write took; waited_s: how long callers of wait() were blocked by it."""

    def __init__(self, written: Future, finish=lambda: None):
        self.written, self.finish = written, finish
        self.started, self.seconds, self.waited_s = time.perf_counter(), None, 0.0
        written.add_done_callback(lambda _: setattr(self, "seconds", time.perf_counter() - self.started))

    def done(self) -> bool:
        return self.written is None or self.written.done()

    def wait(self) -> None:
        written, self.written = self.written, None
        if written is None:
            return
        t = time.perf_counter()
        try:
            if (error := written.exception()) is not None:
                raise RuntimeError(f"writing the checkpoint failed: {error}") from error
            self.finish()
        finally:
            self.waited_s += time.perf_counter() - t


def save_checkpoint(run_dir: Path, trainer, state: dict, background: bool = False,
                    with_optimizer: bool = True) -> PendingCheckpoint:
    """Write checkpoint/; with_optimizer=False leaves AdamW's state out (a completed run's last one)."""
    trainer.wait_for_save()  # one write at a time
    final, tmp = Path(run_dir) / "checkpoint", Path(run_dir) / "checkpoint.tmp"
    state = dict(state, trainer_step=trainer.step, dtype=trainer.cfg.dtype,
                 rng={"python": random.getstate(), "torch": torch.get_rng_state().tolist()})
    if trainer.env is not None:
        group, main = trainer.env.cpu_group, trainer.rank == 0
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier(group=group)  # nobody writes into tmp before rank 0 has cleared it
        written = dist_checkpoint.save(trainer, tmp)
        if main:
            (tmp / "state.json").write_text(json.dumps(dict(state, sharded=True, world_size=trainer.world_size)))

        def finish():
            if main:
                _replace(tmp, final)
            dist.barrier(group=group)  # the checkpoint is in place when any rank goes on

        pending = PendingCheckpoint(written, finish)
    else:
        state = dict(state, format=FORMAT, optimizer=with_optimizer)
        masters = list(zip(trainer.names, trainer.masters))
        optimizer_state = trainer.optimizer.state_dict() if with_optimizer else None  # references, not copies

        def write():
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            try:
                write_safetensors(tmp / "model.safetensors", masters)
                write_model_files(trainer.model.config, trainer.cfg.model, tmp)
                if optimizer_state is not None:
                    torch.save(optimizer_state, tmp / "optimizer.pt")
                (tmp / "state.json").write_text(json.dumps(state))
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)  # a full disk must not keep half a checkpoint around
                raise
            _replace(tmp, final)

        pending = PendingCheckpoint(_WRITER.submit(write))
    if background:
        trainer.pending_save = pending  # no update runs until pending.wait() (Trainer.wait_for_save)
    else:
        pending.wait()
    return pending


class Checkpointer:
    """When a run checkpoints, and what it costs. every_steps > 0: every that many steps; 0: once
    `every_minutes` have passed since the last one (or 10 x what the last one blocked the loop, if that
    is longer: never more than a tenth of the run). The loop saves at the end and on Ctrl-C regardless."""

    def __init__(self, run_dir: Path, trainer, every_steps: int, every_minutes: float, last_step: int = 0,
                 keep_optimizer: bool = True):
        self.run_dir, self.trainer = Path(run_dir), trainer
        self.every_steps, self.every_minutes = every_steps, every_minutes
        # The last step's checkpoint holds no AdamW state unless kept: finish() would drop it anyway.
        self.last_step, self.keep_optimizer = last_step, keep_optimizer
        self.last_time = time.monotonic()
        self.saved: list[tuple[float, PendingCheckpoint]] = []  # (seconds save() blocked, its write)

    def due(self, step: int) -> bool:
        if self.every_steps:
            return step % self.every_steps == 0
        cost = self.saved[-1][0] + self.saved[-1][1].waited_s if self.saved else 0.0
        return time.monotonic() - self.last_time >= max(60.0 * self.every_minutes, 10.0 * cost)

    def save(self, state: dict, background: bool = True) -> None:
        waits = [p.waited_s for _, p in self.saved]
        t = time.perf_counter()
        with_optimizer = self.keep_optimizer or state["step"] != self.last_step
        pending = save_checkpoint(self.run_dir, self.trainer, state, background, with_optimizer)
        # What save() itself blocked, less the waits (for this write, or the previous one) each
        # PendingCheckpoint counts on its own.
        inside = pending.waited_s + sum(p.waited_s - w for (_, p), w in zip(self.saved, waits))
        self.saved.append((time.perf_counter() - t - inside, pending))
        self.last_time = time.monotonic()

    def finish(self) -> str:
        """Join the last write, drop any AdamW state left unless kept; what checkpoints cost (a line)."""
        self.trainer.wait_for_save()
        if self.trainer.rank == 0:
            finish_checkpoint(self.run_dir, self.keep_optimizer)
        if not self.saved:
            return "no checkpoint written"
        written = [p.seconds for _, p in self.saved if p.seconds is not None]
        blocked = sum(b + p.waited_s for b, p in self.saved)
        return (f"{len(self.saved)} checkpoint(s), each written in {max(written, default=0):.1f} s or less in the "
                f"background; the loop waited {blocked:.1f} s for them in all")


def _replace(tmp: Path, final: Path) -> None:
    """Rename tmp over final; a kill between the two renames leaves final.old, which load takes."""
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(run_dir: Path, trainer, echo=print, state: dict | None = None) -> dict | None:
    """Restore the trainer and the RNG from run_dir/checkpoint, whichever number of ranks wrote it;
    returns its state.json (`state`: checked already, by rank 0: check_resumable), or None when there is
    none. A checkpoint that cannot be resumed is a CheckpointError naming the file."""
    ckpt = Path(run_dir) / "checkpoint" if state is not None else checkpoint_folder(Path(run_dir))
    if ckpt is None:
        return None
    state = state or check_resumable(ckpt)
    trainer.wait_for_save()
    if (ckpt / ".metadata").exists():
        dist_checkpoint.load(trainer, ckpt)
    else:
        kept = bool(state.get("optimizer")) and (ckpt / "optimizer.pt").exists()
        if not kept:
            echo("the checkpoint keeps no AdamW state (the run had completed; keep_optimizer_state=true keeps "
                 "it): AdamW's moments restart from zero")
        dist_checkpoint.load_files(trainer, ckpt, state["trainer_step"], with_optimizer=kept)  # each rank its rows
    restore_rng(ckpt, state)
    return state


def finish_checkpoint(run_dir: Path, keep_optimizer: bool) -> None:
    """At the end of a completed run: drop the AdamW state unless asked to keep it."""
    ckpt = Path(run_dir) / "checkpoint"
    if keep_optimizer or not (ckpt / "optimizer.pt").exists():
        return
    state = json.loads((ckpt / "state.json").read_text())
    tmp = ckpt / "state.json.tmp"
    tmp.write_text(json.dumps(dict(state, optimizer=False)))
    os.replace(tmp, ckpt / "state.json")  # first say it is gone, then remove it
    (ckpt / "optimizer.pt").unlink()


def export_model(trainer, tokenizer_dir: str, out_dir: Path, checkpoint_dir: Path | None = None,
                 best: dict | None = None) -> Path:
    """The final policy as a HF folder (for `serve --model DIR`, `eval --model DIR`) of the FP32
    masters (they carry every small update; the bf16 compute copy would round them away), replacing
    the previous folder once whole. checkpoint_dir's weights are hard-linked if they are of this step.
    N ranks gather the weights to rank 0, which writes. best/ has `best` (step, score) as best.json."""
    trainer.wait_for_save()  # the last checkpoint complete (its weights may be linked below)
    out_dir = Path(out_dir)
    gathered = trainer.named_weights(torch.float32) if trainer.env is not None else None  # collective
    if trainer.rank != 0:
        return out_dir
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if gathered is not None or not _link_checkpoint_weights(trainer, checkpoint_dir, tmp / "model.safetensors"):
        write_safetensors(tmp / "model.safetensors", gathered or trainer.named_weights(torch.float32))
    write_model_files(trainer.model.config, tokenizer_dir, tmp)
    if best is not None:
        (tmp / "best.json").write_text(json.dumps(best) + "\n")
    _replace(tmp, out_dir)
    return out_dir


# A tokenizer's files as transformers saves them (a model folder holds some of these)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
                   "chat_template.json", "generation_config.json")


def write_model_files(model_config, tokenizer_dir: str, folder: Path) -> None:
    """Make a folder holding the FP32 masters a HF model folder: config.json (dtype float32) and the
    tokenizer's files copied as they are (loading and re-saving the tokenizer takes seconds)."""
    model_config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["dtype" if "torch_dtype" not in config else "torch_dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (Path(tokenizer_dir) / name).is_file():
            shutil.copy(Path(tokenizer_dir) / name, folder / name)


def _link_checkpoint_weights(trainer, checkpoint_dir: Path | None, target: Path) -> bool:
    if checkpoint_dir is None or not (checkpoint_dir / "state.json").exists():
        return False
    state = json.loads((checkpoint_dir / "state.json").read_text())
    if state.get("format") != FORMAT or state.get("trainer_step") != trainer.step:
        return False
    try:
        os.link(checkpoint_dir / "model.safetensors", target)
        return True
    except OSError:  # a filesystem without hard links: write it
        return False
