"""The CPU trainer alone: its resident memory's peak in each phase of two train steps.

    PYTHONPATH=. .venv/bin/python bench/trainer_memory.py [--length 800] [--sequences 4] [--logprob-chunk 0]

The packaged Qwen2.5-Coder-0.5B-Instruct (FP32, every TrainerConfig default on CPU), a batch of
random token sequences of about --length tokens (300 prompt tokens, the rest scored), one sequence
per micro-batch. A thread reads the process's RSS every 10 ms; the phase names are: step N's
micro-batch K (`sN:mbK`, forward and backward), its optimizer step (`sN:optim`) and what stays
resident after it (`sN:after`). Step 0 allocates AdamW's moments; step 1 is what every later step
looks like. Prints one line per phase; nothing is saved (a diagnosis of bench/main_job_memory.py's
trainer figure, not a goal's measurement).
"""
import argparse
import os
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from nano_miles.rollout.batch import Trajectory, build_rollout_batch  # noqa: E402
from nano_miles.models.prepare import resolve_model  # noqa: E402
from nano_miles.trainer.trainer import OptimConfig, Trainer, TrainerConfig  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=800, help="tokens of the longest sequence")
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--logprob-chunk", type=int, default=0, help="trainer.logprob_chunk (0: the default)")
    args = ap.parse_args()

    phase, peaks = ["load"], {}

    def sample():
        while True:
            peaks[phase[0]] = max(peaks.get(phase[0], 0), rss())
            time.sleep(0.01)

    threading.Thread(target=sample, daemon=True).start()
    trainer = Trainer(TrainerConfig(model=str(resolve_model("qwen2.5-coder-0.5b-instruct")), device="cpu",
                                    logprob_chunk=args.logprob_chunk, optim=OptimConfig(lr=1e-6)))
    clip_and_step = trainer._clip_and_step

    def marked_clip_and_step():
        phase[0] = f"s{trainer.step}:optim"
        norm = clip_and_step()
        phase[0] = f"s{trainer.step}:after"
        return norm

    trainer._clip_and_step = marked_clip_and_step
    g = torch.Generator().manual_seed(0)
    trajectories = []
    for i in range(args.sequences):
        response = args.length - 300 - 40 * i
        trajectories.append(Trajectory(
            prompt_ids=torch.randint(3, 150000, (300,), generator=g).tolist(),
            response_ids=torch.randint(3, 150000, (response,), generator=g).tolist(),
            response_logprobs=[-1.0] * response, response_mask=[True] * response,
            reward=float(i % 2), group_id=f"g{i // 2}"))
    batch = build_rollout_batch(trajectories)
    advantages = torch.tensor([1.0, -1.0] * (args.sequences // 2) + [0.0] * (args.sequences % 2))
    for step in range(2):
        phase[0] = f"s{step}:mb1"
        trainer.train_step(batch, advantages,
                           on_micro_batch=lambda done, n: phase.__setitem__(0, f"s{trainer.step}:mb{done + 1}"))
        time.sleep(0.2)
    print(f"trainer alone, {args.sequences} x ~{args.length} tokens, logprob_chunk {trainer.cfg.logprob_chunk}: "
          "peak RSS by phase (GB)")
    for name, value in peaks.items():
        print(f"  {name:10s} {value / 1e9:.2f}")


if __name__ == "__main__":
    main()
