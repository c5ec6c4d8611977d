"""The prefill of a multi-turn moment: a few long first-turn prompts arrive beside many short
observations (the next turn of episodes already running), as in an agentic rollout step.

Random-initialised weights of the real shapes; all requests are added at once and run to their first
sampled token; reports the engine's prefill steps and seconds (busy_s["prefill"]). One forward pads
every row of a prefill step to its longest chunk, so how the scheduler groups rows decides the work;
with --packed (engine.packed_prefill, GPU) the step is packed, no padding.

  PYTHONPATH=. python3 bench/prefill_mix.py                          # GPU: 0.5B shapes, bf16
  PYTHONPATH=. python3 bench/prefill_mix.py --device cpu --shapes tiny --long 1200 --short 40
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.results import add_dry_run, git_commit, save, scratch_dir, utc_now  # noqa: E402
from bench.train_step import SHAPES, model_config  # noqa: E402
from nano_miles.engine.engine import Engine, EngineConfig  # noqa: E402
from nano_miles.engine.sampling import SamplingParams  # noqa: E402
from transformers import Qwen2ForCausalLM  # noqa: E402


def run(engine: Engine, lengths: list[int], vocab: int) -> tuple[int, float]:
    g = torch.Generator().manual_seed(1)
    for i, n in enumerate(lengths):
        engine.add_request(f"r{i}", torch.randint(3, vocab, (n,), generator=g).tolist(),
                           SamplingParams(max_new_tokens=1, ignore_eos=True))
    before, steps = engine.busy_s["prefill"], 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    return steps, engine.busy_s["prefill"] - before


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--long", type=int, default=1200, help="tokens of each long first-turn prompt")
    ap.add_argument("--longs", type=int, default=4)
    ap.add_argument("--short", type=int, default=60, help="tokens of each short observation")
    ap.add_argument("--shorts", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--packed", action="store_true", help="engine.packed_prefill (GPU): no padding, decoders ride along")
    ap.add_argument("--label", default="")
    add_dry_run(ap)
    args = ap.parse_args(argv)
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    folder = scratch_dir("bench_prefill_mix_")
    torch.manual_seed(0)
    Qwen2ForCausalLM(model_config(args.shapes)).save_pretrained(folder)
    engine = Engine(EngineConfig(model=folder, device=args.device, dtype=dtype, num_kv_blocks=4096,
                                 packed_prefill=args.packed))
    lengths = [args.long] * args.longs + [args.short] * args.shorts
    run(engine, lengths, SHAPES[args.shapes]["vocab_size"])  # warm-up
    seconds, steps = [], 0
    for _ in range(args.repeats):
        engine.flush_cache()  # every repeat prefills all of it
        steps, s = run(engine, lengths, SHAPES[args.shapes]["vocab_size"])
        seconds.append(s)
    record = {"bench": "prefill_mix", "label": args.label, "shapes": args.shapes, "dtype": dtype,
              "attention_backend": engine.attention_backend, "packed": engine.packed_prefill,
              "longs": [args.longs, args.long], "shorts": [args.shorts, args.short], "prefill_steps": steps,
              "prefill_s_median": sorted(seconds)[len(seconds) // 2], "prefill_s": seconds,
              "date": utc_now(), "commit": git_commit(),
              "machine": torch.cuda.get_device_name(0) if args.device.startswith("cuda") else f"cpu x{os.cpu_count()}"}
    print(f"{args.longs} x {args.long} + {args.shorts} x {args.short} tokens: {steps} prefill step(s), "
          f"{record['prefill_s_median'] * 1000:.1f} ms (median of {args.repeats})")
    print(save(record, "prefill_mix.json", dry_run=args.dry_run))
    return 0


if __name__ == "__main__":
    sys.exit(main())
