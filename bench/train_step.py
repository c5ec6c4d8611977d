"""One GRPO train step, 8 sequences x 1000 tokens, random-init Qwen2.5-0.5B shapes, bf16 compute.

Compares, in the same process:
  nano_miles  Trainer(dtype=bfloat16): chunked FP32 log-probs of response tokens, FP32 master
              weights + FP32 AdamW, weights copied back to bf16 after the step
  naive       the usual loop: bf16 model, full-vocab logits -> float32 log_softmax one sequence at
              a time, AdamW straight on the bf16 weights (loses small updates to rounding)
Reports median step time, tokens/s, peak GPU memory, and the share of weights that an lr 1e-6 step
actually changed, after all the steps at lr 1e-6, in what an engine would receive (bf16). Prints a table, appends to
bench/results.jsonl (and $OUT/train_step.json when $OUT is set).

  PYTHONPATH=. python3 bench/train_step.py                 # the GPU figure (cuda)
  PYTHONPATH=. python3 bench/train_step.py --shapes tiny   # a CPU smoke run
  PYTHONPATH=. python3 bench/train_step.py --true-on-policy  # + the same step in true on-policy mode
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from bench.results import git_commit, save, utc_now
from nano_miles.batch import Trajectory, build_rollout_batch
from nano_miles.trainer import OptimConfig, Trainer, TrainerConfig

SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1024),
}


def make_model(shapes: str, device):
    cfg = Qwen2Config(**SHAPES[shapes], tie_word_embeddings=True, max_position_embeddings=4096,
                      rope_theta=1000000.0, rms_norm_eps=1e-6, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(cfg)
    for p in model.parameters():  # parameters only: RoPE's inv_freq buffer must stay float32
        p.data = p.data.to(torch.bfloat16)
    return model


def make_batch(n, seq_len, prompt_len, vocab):
    g = torch.Generator().manual_seed(1)
    trajs = []
    for i in range(n):
        ids = torch.randint(0, vocab, (seq_len,), generator=g).tolist()
        R = seq_len - prompt_len
        trajs.append(Trajectory(prompt_ids=ids[:prompt_len], response_ids=ids[prompt_len:],
                                response_logprobs=[0.0] * R, response_mask=[True] * R,
                                reward=float(i % 2), group_id=f"g{i // 4}"))
    batch = build_rollout_batch(trajs)
    adv = torch.tensor([1.0 if i % 2 else -1.0 for i in range(n)])
    return batch, adv


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def naive_step(model, opt, batch, adv, device):
    """Full logits per sequence, float32 log_softmax, bf16 AdamW: the reference loop."""
    tokens = batch.tokens.to(device)
    mask = batch.loss_mask.to(device)
    n_tok = mask.sum()
    for i in range(tokens.shape[0]):
        logits = model(tokens[i:i + 1]).logits[0, :-1].float()
        logp = logits.log_softmax(-1).gather(-1, tokens[i, 1:, None]).squeeze(-1)
        loss = -(adv[i] * torch.exp(logp - logp.detach()) * mask[i]).sum() / n_tok
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def changed_share(params, before):
    changed = sum(int((p.detach() != b).sum()) for p, b in zip(params, before))
    return changed / sum(b.numel() for b in before)


def timed(fn, device, warmup, steps):
    times = []
    for i in range(warmup + steps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def peak_gib(device):
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def reset(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1000)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true", help="print only; do not append to bench/results.jsonl")
    ap.add_argument("--true-on-policy", action="store_true", help="also time the step in true on-policy mode")
    args = ap.parse_args()
    device = torch.device(args.device)
    batch, adv = make_batch(args.seqs, args.seq_len, args.prompt_len, SHAPES[args.shapes]["vocab_size"])
    tokens = args.seqs * args.seq_len
    rows = []

    # --- nano_miles trainer
    reset(device)
    trainer = Trainer(TrainerConfig(device=args.device, dtype="bfloat16", micro_batch_size=args.micro_batch_size,
                                    logprob_chunk=args.chunk, optim=OptimConfig(lr=1e-6)),
                      model=make_model(args.shapes, device))
    batch.rollout_logprobs = trainer.logprobs(batch)  # on-policy: the engine would have given these
    init = [p.detach().clone() for p in trainer.params]
    ms = timed(lambda: trainer.train_step(batch, adv), device, args.warmup, args.steps)
    m = trainer.train_step(batch, adv)
    rows.append(dict(method="nano_miles (bf16 + fp32 masters)", ms=ms, tokens_per_s=tokens / ms * 1000,
                     peak_gib=peak_gib(device), bf16_changed=changed_share(trainer.params, init),
                     grad_norm=m["grad_norm"], entropy=m.get("entropy"), logprob_diff_mean=m["logprob_diff_mean"]))
    del trainer, init
    reset(device)

    if args.true_on_policy:  # the same step with batch-invariant forward values (nano_miles/batch_invariant.py)
        trainer = Trainer(TrainerConfig(device=args.device, dtype="bfloat16", micro_batch_size=args.micro_batch_size,
                                        logprob_chunk=args.chunk, optim=OptimConfig(lr=1e-6), true_on_policy=True),
                          model=make_model(args.shapes, device))
        batch.rollout_logprobs = trainer.logprobs(batch)  # what a true on-policy engine returns, bit for bit
        init = [p.detach().clone() for p in trainer.params]
        ms = timed(lambda: trainer.train_step(batch, adv), device, args.warmup, args.steps)
        m = trainer.train_step(batch, adv)
        rows.append(dict(method="nano_miles true on-policy", ms=ms, tokens_per_s=tokens / ms * 1000,
                         peak_gib=peak_gib(device), bf16_changed=changed_share(trainer.params, init),
                         grad_norm=m["grad_norm"], entropy=m.get("entropy"), logprob_diff_mean=m["logprob_diff_mean"],
                         slower_pct=100 * (ms / rows[0]["ms"] - 1)))
        del trainer, init
        reset(device)

    # --- naive bf16 loop
    model = make_model(args.shapes, device)
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, foreach=True)
    init = [p.detach().clone() for p in model.parameters()]
    ms = timed(lambda: naive_step(model, opt, batch, adv.to(device), device), device, args.warmup, args.steps)
    naive_step(model, opt, batch, adv.to(device), device)
    rows.append(dict(method="naive bf16 loop", ms=ms, tokens_per_s=tokens / ms * 1000, peak_gib=peak_gib(device),
                     bf16_changed=changed_share(model.parameters(), init)))

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    print(f"\nGRPO train step: {args.seqs} x {args.seq_len} tokens ({args.prompt_len} prompt), "
          f"{args.shapes} shapes, bf16, lr 1e-6, on {name}")
    n_steps = args.warmup + args.steps + 1
    print(f"{'method':36s} {'ms/step':>9s} {'tok/s':>9s} {'peak GiB':>9s} {f'bf16 weights moved in {n_steps} steps':>30s}")
    for r in rows:
        print(f"{r['method']:36s} {r['ms']:9.1f} {r['tokens_per_s']:9.0f} {r['peak_gib']:9.2f} "
              f"{100 * r['bf16_changed']:29.2f}%" + (f"   {r['slower_pct']:+.1f}% vs nano_miles" if "slower_pct" in r else ""))
    record = dict(bench="train_step", date=utc_now(), commit=git_commit(), machine=name, torch=torch.__version__, config=vars(args), results=rows)
    if not args.dry_run:
        save(record, "train_step.json")


if __name__ == "__main__":
    main()
