"""Run checkpoints (trainer state, RNG, data position) and the exported final policy.

A checkpoint is a folder written whole under a temporary name and renamed into place, so a run
killed at any moment leaves either the previous checkpoint or the new one, never half of one.
"""
from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch
from transformers import AutoTokenizer


def save_checkpoint(run_dir: Path, trainer, state: dict) -> None:
    """Atomic: write checkpoint.tmp/, then rename over checkpoint/ (a kill mid-write keeps the old one)."""
    final, tmp, old = run_dir / "checkpoint", run_dir / "checkpoint.tmp", run_dir / "checkpoint.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    torch.save(trainer.state_dict(), tmp / "trainer.pt")
    state = dict(state, rng={"python": random.getstate(), "torch": torch.get_rng_state().tolist()})
    (tmp / "state.json").write_text(json.dumps(state))
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(run_dir: Path, trainer) -> dict | None:
    ckpt = run_dir / "checkpoint"
    if not (ckpt / "state.json").exists():
        old = run_dir / "checkpoint.old"  # killed between the two renames
        if (old / "state.json").exists():
            old.rename(ckpt)
        else:
            return None
    state = json.loads((ckpt / "state.json").read_text())
    trainer.load_state_dict(torch.load(ckpt / "trainer.pt", map_location=trainer.device, weights_only=False))
    py_state = state["rng"]["python"]
    random.setstate((py_state[0], tuple(py_state[1]), py_state[2]))
    torch.set_rng_state(torch.tensor(state["rng"]["torch"], dtype=torch.uint8))
    return state


def export_model(trainer, tokenizer_dir: str, out_dir: Path) -> Path:
    """The final policy as a HF folder (`nano-miles serve --model DIR` and `eval --model DIR` take it)."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = trainer.model
    # FP32 masters carry every small update; the bf16 compute copy would round them away.
    state = {n: t.detach().float().cpu() for n, t in trainer.named_weights(torch.float32)}
    model.save_pretrained(tmp, state_dict=state)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(tmp)
    gen = Path(tokenizer_dir) / "generation_config.json"
    if gen.exists():
        shutil.copy(gen, tmp / "generation_config.json")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir
