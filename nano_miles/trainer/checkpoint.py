"""Run checkpoints (trainer state, RNG, data position) and the exported final policy.

checkpoint/ holds
  model.safetensors  the FP32 master weights by HF name: exactly the weights final/ exports, so the
                     final/model.safetensors of a finished run is a hard link to it (one copy on disk)
  config.json, the tokenizer's files, generation_config.json: as final/, so that checkpoint/ is a HF
                     model folder too (`nano-miles eval --model RUN/checkpoint` of a run that never ended)
  optimizer.pt       AdamW's state (both moments, step counts): torch.save(optimizer.state_dict()), read
                     back with torch.load(weights_only=True) only
  state.json         step, data position, weight version, RNG states, the trainer's step and dtype
Nothing in a checkpoint is unpickled: a run directory may come from anyone (a shared disk, a download).
A checkpoint of format 1 (the trainer's state as one pickle, trainer.pt) is refused, and a file that
cannot be read is a CheckpointError naming it: `nano-miles train` prints that one line and exits 2.
A checkpoint is a folder written whole under checkpoint.tmp/ and renamed into place, so a run killed at
any moment (even mid-write) leaves either the previous checkpoint or the new one, never half of one.

Written in the background: save_checkpoint() takes the RNG states and the step's record at once, then a
thread writes the trainer's LIVE tensors (no copy: a second 6 GB of FP32 masters and moments is what a
24 GB machine cannot spare). The trainer refuses to change them until the write is done
(Trainer.hold_until_saved: its next update, or a load, waits); in a training loop the write overlaps
the next step's rollout, which does not touch them. `.wait()` on the returned handle joins it (the
loop does at the end of the run, before exporting).

A completed run keeps no optimizer.pt (two thirds of a checkpoint: its last checkpoint is written
without it, and finish_checkpoint drops an older one) unless asked to (keep_optimizer_state): the run
directory then holds the weights once, shared by checkpoint/ and final/. Resuming such a checkpoint to
train further restarts AdamW's moments from zero, and says so.
"""
from __future__ import annotations

import functools
import json
import os
import random
import shutil
import struct
import threading
import time
import zipfile
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoTokenizer

FORMAT = 2  # 1: a single trainer.pt, a pickle: never read (it could run any code)
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
              torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(path: Path, named_tensors, metadata: dict | None = None) -> int:
    """Write (name, tensor) pairs as one safetensors file, tensor by tensor from their own memory (the
    safetensors package first copies every tensor into one buffer: the whole model again). Returns bytes."""
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


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed (corrupt, or of a format that is not read); one line naming the file."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def checkpoint_bytes(num_params: int) -> int:
    """Disk of one checkpoint: FP32 masters (4 bytes a parameter) and AdamW's two FP32 moments (8)."""
    return 12 * num_params


def disk_line(num_params: int, run_dir: Path, keep_optimizer: bool) -> str:
    """What the run needs on disk, for the start-up message (and a warning if it is not there)."""
    one = checkpoint_bytes(num_params)
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
    """A checkpoint being written by a thread; wait() joins it and re-raises its error. seconds: how
    long the write took; waited_s: how long callers of wait() were blocked by it."""

    def __init__(self, run, started: float):
        self.thread = threading.Thread(target=self._run, args=(run,), name="checkpoint", daemon=True)
        self.error, self.started, self.seconds, self.waited_s = None, started, None, 0.0
        self.thread.start()

    def _run(self, run):
        try:
            run()
        except BaseException as e:  # re-raised by wait() in the loop's thread
            self.error = e
        self.seconds = time.perf_counter() - self.started

    def done(self) -> bool:
        return not self.thread.is_alive()

    def wait(self) -> None:
        t = time.perf_counter()
        self.thread.join()
        self.waited_s += time.perf_counter() - t
        if self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"writing the checkpoint failed: {error}") from error


def save_checkpoint(run_dir: Path, trainer, state: dict, background: bool = False,
                    with_optimizer: bool = True) -> PendingCheckpoint:
    """Write checkpoint/ (atomic: checkpoint.tmp/, then renamed over it). With background=True the
    files are written by a thread and the trainer waits for it before its next change.
    with_optimizer=False leaves AdamW's state out (a completed run's last checkpoint)."""
    trainer.wait_for_save()  # one write at a time
    run_dir = Path(run_dir)
    state = dict(state, format=FORMAT, trainer_step=trainer.step, dtype=trainer.cfg.dtype, optimizer=with_optimizer,
                 rng={"python": random.getstate(), "torch": torch.get_rng_state().tolist()})
    masters = list(zip(trainer.names, trainer.masters))
    optimizer_state = trainer.optimizer.state_dict() if with_optimizer else None  # references, not copies

    def write():
        final, tmp = run_dir / "checkpoint", run_dir / "checkpoint.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            write_safetensors(tmp / "model.safetensors", masters)
            write_model_files(trainer.model.config, trainer.cfg.model, tmp)  # `eval --model RUN/checkpoint`
            if optimizer_state is not None:
                torch.save(optimizer_state, tmp / "optimizer.pt")
            (tmp / "state.json").write_text(json.dumps(state))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a full disk must not keep half a checkpoint around
            raise
        _replace(tmp, final)

    pending = PendingCheckpoint(write, time.perf_counter())
    if background:
        trainer.hold_until_saved(pending)
    else:
        pending.wait()
    return pending


class Checkpointer:
    """When a run checkpoints, in the background, and what it costs. every_steps > 0: every that many
    steps; 0: by time, once `every_minutes` have passed since the last one (or 10 x what the last one
    blocked the loop, if that is longer: checkpoints never take more than a tenth of the run). The
    loop saves at the end and on Ctrl-C regardless."""

    def __init__(self, run_dir: Path, trainer, every_steps: int, every_minutes: float, last_step: int = 0,
                 keep_optimizer: bool = True):
        self.run_dir, self.trainer = Path(run_dir), trainer
        self.every_steps, self.every_minutes = every_steps, every_minutes
        # The last step's checkpoint holds no AdamW state unless kept: finish() would drop it anyway.
        self.last_step, self.keep_optimizer = last_step, keep_optimizer
        self.last_time, self.last_cost = time.monotonic(), 0.0
        self.saved: list[tuple[float, PendingCheckpoint]] = []  # (seconds save() blocked, its write)

    def due(self, step: int) -> bool:
        if self.every_steps:
            return step % self.every_steps == 0
        if self.saved:
            blocked, pending = self.saved[-1]
            self.last_cost = blocked + pending.waited_s
        return time.monotonic() - self.last_time >= max(60.0 * self.every_minutes, 10.0 * self.last_cost)

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
        """Join the last write, drop any AdamW state left unless kept; a line saying what checkpoints cost."""
        self.trainer.wait_for_save()
        finish_checkpoint(self.run_dir, self.keep_optimizer)
        return self.summary()

    def summary(self) -> str:
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


def checkpoint_folder(run_dir: Path) -> Path | None:
    """run_dir's checkpoint folder, None when it has none yet."""
    ckpt, old = run_dir / "checkpoint", run_dir / "checkpoint.old"
    if not ckpt.exists() and (old / "state.json").exists():
        old.rename(ckpt)  # killed between the two renames of a save
    if not ckpt.exists():
        return None
    if not (ckpt / "state.json").is_file():  # a checkpoint is renamed into place with it: a damaged one
        raise CheckpointError(f"{ckpt}/state.json is missing: {ckpt} cannot be resumed")
    return ckpt


def read_json(ckpt: Path) -> dict:
    """A checkpoint's state.json as it is."""
    path = Path(ckpt) / "state.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path} cannot be read: {type(e).__name__}: {e}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path} is not a checkpoint's state: a JSON {type(state).__name__}")
    return state


def read_state(ckpt: Path) -> dict:
    """A checkpoint's state.json, checked for what a resume reads (step, data position, RNG)."""
    path, state = Path(ckpt) / "state.json", read_json(ckpt)
    if not (_is_count(state.get("step")) and _is_position(state.get("stream", state.get("data_position")))):
        raise CheckpointError(f"{path} is not a checkpoint's state: no step and data position")
    rng_states(path, state)
    return state


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_position(value) -> bool:
    """The task stream's state() ({"position", "passes"}), or a bare position."""
    if isinstance(value, dict):
        return _is_count(value.get("position")) and isinstance(value.get("passes"), dict)
    return _is_count(value)


def rng_states(path: Path, state: dict) -> tuple:
    """state.json's RNG states, as random.setstate and torch.set_rng_state take them (checked)."""
    try:
        py = state["rng"]["python"]
        py_state = (py[0], tuple(py[1]), py[2])
        random.Random().setstate(py_state)  # refuses a malformed state, leaving ours alone
        torch_state = torch.tensor(state["rng"]["torch"], dtype=torch.uint8)
        if torch_state.shape != torch.get_rng_state().shape:
            raise ValueError(f"{torch_state.numel()} bytes of torch RNG state")
    except (KeyError, IndexError, TypeError, ValueError, OverflowError, RuntimeError) as e:
        raise CheckpointError(f"{path} is not a checkpoint's state: its RNG states do not restore "
                              f"({type(e).__name__}: {e})") from None
    return py_state, torch_state


def restore_rng(ckpt: Path, state: dict) -> None:
    py_state, torch_state = rng_states(Path(ckpt) / "state.json", state)
    random.setstate(py_state)
    torch.set_rng_state(torch_state)


def check_single_process(ckpt: Path, state: dict) -> None:
    """What a resume of a single-process checkpoint reads, checked without reading the tensors: its
    format, the weights file's header and index, the optimizer state's container."""
    if state.get("sharded"):  # N ranks' checkpoint: its shards are indexed by .metadata
        raise CheckpointError(f"{ckpt}/.metadata is missing: {ckpt} cannot be resumed")
    fmt = state.get("format", 1)
    if fmt != FORMAT:
        raise CheckpointError(f"{ckpt} cannot be resumed: its state.json says format {fmt!r}; only format {FORMAT} "
                              "is read (format 1 keeps the trainer's state as a pickle, trainer.pt, which could run "
                              "any code)")
    if not _is_count(state.get("trainer_step")):
        raise CheckpointError(f"{ckpt}/state.json is not a checkpoint's state: no trainer_step")
    weights = ckpt / "model.safetensors"
    try:
        with safe_open(str(weights), framework="pt"):
            pass
    except Exception as e:  # truncated, not safetensors, missing
        raise CheckpointError(f"{weights} cannot be read: {one_line(e)}") from None
    optimizer = ckpt / "optimizer.pt"
    if state.get("optimizer") and optimizer.exists() and not zipfile.is_zipfile(optimizer):
        raise CheckpointError(f"{optimizer} cannot be read: not a whole torch.save file (truncated?)")


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def load_checkpoint(run_dir: Path, trainer, echo=print) -> dict | None:
    """Restore the trainer and the RNG from run_dir/checkpoint; returns its state.json, or None."""
    ckpt = checkpoint_folder(Path(run_dir))
    if ckpt is None:
        return None
    state = read_state(ckpt)
    check_single_process(ckpt, state)
    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:  # tensor by tensor
        masters = {name: f.get_tensor(name) for name in f.keys()}
    optimizer = None
    if state.get("optimizer") and (ckpt / "optimizer.pt").exists():
        optimizer = load_optimizer(ckpt / "optimizer.pt", trainer.device)
    else:
        echo("the checkpoint keeps no AdamW state (the run had completed; keep_optimizer_state=true keeps "
             "it): AdamW's moments restart from zero")
    try:
        trainer.load_state_dict({"masters": masters, "optimizer": optimizer, "step": state["trainer_step"]})
    except (KeyError, TypeError, ValueError) as e:  # a state that does not fit this model or this optimizer
        raise CheckpointError(f"{ckpt} cannot be resumed: {type(e).__name__}: {one_line(e)}") from None
    restore_rng(ckpt, state)
    return state


def load_optimizer(path: Path, device, **kw) -> dict:
    """optimizer.pt: tensors and plain containers only (torch.load's weights_only unpickler)."""
    try:
        saved = torch.load(path, map_location=device, weights_only=True, **kw)
    except Exception as e:  # truncated, or naming something that is not a tensor or a container
        raise CheckpointError(f"{path} cannot be read: {type(e).__name__}: {one_line(e)}") from None
    if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict) and saved.get("param_groups")):
        raise CheckpointError(f"{path} is not an optimizer's state")
    return saved


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


def export_model(trainer, tokenizer_dir: str, out_dir: Path, checkpoint_dir: Path | None = None) -> Path:
    """The final policy as a HF folder (`nano-miles serve --model DIR` and `eval --model DIR` take it):
    the FP32 masters (they carry every small update; the bf16 compute copy would round them away). If
    checkpoint_dir holds the trainer's current step, its weights file is hard-linked, not written again."""
    trainer.wait_for_save()  # the last checkpoint complete (its weights may be linked below)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if not _link_checkpoint_weights(trainer, checkpoint_dir, tmp / "model.safetensors"):
        write_safetensors(tmp / "model.safetensors", trainer.named_weights(torch.float32))
    write_model_files(trainer.model.config, tokenizer_dir, tmp)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


def write_model_files(model_config, tokenizer_dir: str, folder: Path) -> None:
    """What makes a folder holding the FP32 masters as model.safetensors a HF model folder: config.json
    (dtype float32), the tokenizer's files and the generation config."""
    model_config.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["dtype" if "torch_dtype" not in config else "torch_dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    _tokenizer(str(tokenizer_dir)).save_pretrained(folder)
    gen = Path(tokenizer_dir) / "generation_config.json"
    if gen.exists():
        shutil.copy(gen, folder / "generation_config.json")


@functools.lru_cache(maxsize=1)
def _tokenizer(folder: str):
    """The run's tokenizer, loaded once (seconds for a real one): every checkpoint writes it."""
    return AutoTokenizer.from_pretrained(folder)


def export_best(trainer, tokenizer_dir: str, best_dir: Path, checkpoint_dir: Path, best: dict) -> Path:
    """keep_best: the current policy as best/ (a HF folder, as final/), with best.json saying from which
    step and with what score; the previous best/ is replaced only once the new one is complete."""
    export_model(trainer, tokenizer_dir, best_dir, checkpoint_dir)
    (best_dir / "best.json").write_text(json.dumps(best) + "\n")
    return best_dir


def _link_checkpoint_weights(trainer, checkpoint_dir: Path | None, target: Path) -> bool:
    if checkpoint_dir is None or not (checkpoint_dir / "state.json").exists():
        return False
    state = json.loads((checkpoint_dir / "state.json").read_text())
    if state.get("format", 1) < 2 or state.get("trainer_step") != trainer.step:
        return False
    try:
        os.link(checkpoint_dir / "model.safetensors", target)
    except OSError:  # a filesystem without hard links: write it
        return False
    return True
