"""One GRPO train step, 8 sequences x 1000 tokens, random-init Qwen2.5 shapes, bf16 compute.

Without --nproc, compares in the same process:
  nano_miles  Trainer(dtype=bfloat16): chunked FP32 log-probs of response tokens, FP32 master
              weights + FP32 AdamW, weights copied back to bf16 after the step
  naive       the usual loop: bf16 model, full-vocab logits -> float32 log_softmax one sequence at
              a time, AdamW straight on the bf16 weights (loses small updates to rounding)
Reports median step time, tokens/s, peak GPU memory, and the share of weights that an lr 1e-6 step
actually changed, after all the steps at lr 1e-6, in what an engine would receive (bf16).

With --nproc N: the trainer on N ranks (started through torch.distributed.run's agent, one GPU each,
or gloo on CPU; FSDP2 when N > 1, the plain one-process trainer at N = 1), the batch's groups split
between them: ms/step, tokens/s (of the whole batch), peak GiB per rank (GPU: allocated; CPU: the
process's peak RSS), and the state per rank (FP32 masters + FP32 gradients + AdamW moments = 16 bytes
a parameter / N). With --baseline the Trainer runs first in this process on the same batch.
Prints a table, appends to bench/results.jsonl (and $OUT/train_step.json when $OUT is set).

  PYTHONPATH=. python3 bench/train_step.py                                   # the GPU figure (cuda)
  PYTHONPATH=. python3 bench/train_step.py --shapes tiny                     # a CPU smoke run
  PYTHONPATH=. python3 bench/train_step.py --true-on-policy                  # + the same step in true on-policy mode
  PYTHONPATH=. python3 bench/train_step.py --nproc 1 --baseline              # a rank of one vs this process, and the ratio
  PYTHONPATH=. python3 bench/train_step.py --nproc 2 --baseline --profile    # + where each step's time goes
  PYTHONPATH=. python3 bench/train_step.py --nproc 2 --shapes qwen2.5-7b     # 7B on 2 GPUs
  PYTHONPATH=. python3 bench/train_step.py --nproc 1 --shapes qwen2.5-7b --layers 4   # a slice, to project

Projecting a model that does not fit on N=1: the per-rank peak is (state / N) + a working set
(activations, one or two gathered layers, the root's gathered embeddings/lm_head) that does not
shrink with N. Measure N=1 with --layers 4 and --layers 8: both parts are linear in the layer count,
so peak(28 layers, N=1) = p4 + 6 * (p8 - p4) and the 2-rank peak is that minus half the state
(the table's state column at 28 layers / 2); the step time projects the same way. (At N=1 the
whole bf16 compute model is held besides the masters, 2 bytes a parameter that N ranks gather a
layer at a time: the projection above is that much pessimistic for N=2.)
"""
from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity
from transformers import Qwen2Config, Qwen2ForCausalLM

from bench.results import add_dry_run, git_commit, save, utc_now
from nano_miles.rollout.batch import Trajectory, build_rollout_batch
from nano_miles.trainer.distributed import DistError, check_nproc, launch, run_rank
from nano_miles.trainer.trainer import OptimConfig, Trainer, TrainerConfig

# From the models' HF config.json files (Qwen/Qwen2.5-*-Instruct); all use RoPE theta 1e6, RMSNorm eps 1e-6.
SHAPES = {
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         intermediate_size=8960, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-3b": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                       intermediate_size=11008, vocab_size=151936, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=1024, tie_word_embeddings=True),
}


def model_config(shapes: str, layers: int = 0) -> Qwen2Config:
    shape = dict(SHAPES[shapes])
    if layers:
        shape["num_hidden_layers"] = layers
    return Qwen2Config(**shape, max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       attn_implementation="sdpa")


def make_model(shapes: str, device, layers: int = 0):
    cfg = model_config(shapes, layers)
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


def profiled(fn, device) -> str:
    """One more step under torch.profiler: its wall time, how much of it the GPU ran kernels (the union
    of kernel intervals over all streams: the rest the GPU waited for the CPU), and the top ops."""
    try:  # diagnostics only: a profiler that fails must not cost the run its figures
        return _profile(fn, device)
    except Exception as e:
        return f"profile failed: {type(e).__name__}: {e}"


def _profile(fn, device) -> str:
    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn()
        sync(device)
        wall = (time.perf_counter() - t0) * 1000
    line = f"profiled step: {wall:.1f} ms wall"
    if on_gpu:
        spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                       if e.device_type == DeviceType.CUDA)
        busy, end = 0.0, float("-inf")
        for start, stop in spans:
            if stop > end:
                busy += stop - max(start, end)
                end = stop
        line += f", GPU busy {busy / 1000:.1f} ms ({len(spans)} kernels), idle {wall - busy / 1000:.1f} ms"
    key = "self_device_time_total" if on_gpu else "self_cpu_time_total"
    return line + "\n" + prof.key_averages().table(sort_by=key, row_limit=15, max_name_column_width=60)


def peak_gib(device):
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")


def reset(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def single_process(args, device, batch, adv, tokens, with_naive: bool) -> list[dict]:
    """Today's Trainer (bf16 + FP32 masters) and, with_naive, the naive bf16 loop."""
    rows = []
    reset(device)
    trainer = Trainer(TrainerConfig(device=args.device, dtype=args.dtype, micro_batch_size=args.micro_batch_size,
                                    logprob_chunk=args.chunk, optim=OptimConfig(lr=1e-6)),
                      model=make_model(args.shapes, device, args.layers))
    batch.rollout_logprobs = trainer.logprobs(batch)  # on-policy: the engine would have given these
    init = [p.detach().clone() for p in trainer.params]
    ms = timed(lambda: trainer.train_step(batch, adv), device, args.warmup, args.steps)
    m = trainer.train_step(batch, adv)
    rows.append(dict(method=f"nano_miles ({args.dtype} + fp32 masters)", ms=ms, tokens_per_s=tokens / ms * 1000,
                     peak_gib=peak_gib(device), bf16_changed=changed_share(trainer.params, init),
                     grad_norm=m["grad_norm"], entropy=m.get("entropy"), logprob_diff_mean=m["logprob_diff_mean"]))
    if args.profile:
        rows[-1]["profile"] = profiled(lambda: trainer.train_step(batch, adv), device)
    del trainer, init
    reset(device)
    if not with_naive:
        return rows

    if args.true_on_policy:  # the same step with batch-invariant forward values (nano_miles/engine/batch_invariant.py)
        trainer = Trainer(TrainerConfig(device=args.device, dtype=args.dtype, micro_batch_size=args.micro_batch_size,
                                        logprob_chunk=args.chunk, optim=OptimConfig(lr=1e-6), true_on_policy=True),
                          model=make_model(args.shapes, device, args.layers))
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

    model = make_model(args.shapes, device, args.layers)
    model.config.use_cache = False
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0, foreach=True)
    init = [p.detach().clone() for p in model.parameters()]
    ms = timed(lambda: naive_step(model, opt, batch, adv.to(device), device), device, args.warmup, args.steps)
    naive_step(model, opt, batch, adv.to(device), device)
    rows.append(dict(method="naive bf16 loop", ms=ms, tokens_per_s=tokens / ms * 1000, peak_gib=peak_gib(device),
                     bf16_changed=changed_share(model.parameters(), init)))
    return rows


def _rank(env, args: dict) -> dict:
    """One rank of the trainer: build (random weights), warm up, time the steps."""
    device = env.device
    batch, adv = make_batch(args["seqs"], args["seq_len"], args["prompt_len"], SHAPES[args["shapes"]]["vocab_size"])
    trainer = Trainer(TrainerConfig(dtype=args["dtype"], micro_batch_size=args["micro_batch_size"],
                                    logprob_chunk=args["chunk"], optim=OptimConfig(lr=1e-6)),
                      env, config=model_config(args["shapes"], args["layers"]))
    batch.rollout_logprobs = trainer.logprobs(batch)
    reset(device)
    ms = timed(lambda: trainer.train_step(batch, adv), device, args["warmup"], args["steps"])
    m = trainer.train_step(batch, adv)
    params = sum(p.numel() for p in trainer.params)
    peak = peak_gib(device) if device.type == "cuda" else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    profile = profiled(lambda: trainer.train_step(batch, adv), device) if args["profile"] else None
    return dict(ms=ms, peak_gib=peak, params=params, grad_norm=m["grad_norm"], entropy=m.get("entropy"),
                profile=profile)


def rank(args: dict) -> dict:
    return run_rank(_rank, args, device_type=args["device"], timeout_s=600)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=0, help="override the number of decoder layers (projections)")
    ap.add_argument("--dtype", default="", help="compute dtype; default bfloat16, float32 for --nproc on CPU")
    ap.add_argument("--nproc", type=int, default=0,
                    help="0: the Trainer in this process vs a naive loop; N: the trainer on N ranks")
    ap.add_argument("--baseline", action="store_true", help="with --nproc: the single-process Trainer first")
    ap.add_argument("--threads", type=int, default=1, help="CPU: torch threads per process (ranks and baseline)")
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=1000)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    add_dry_run(ap)
    ap.add_argument("--true-on-policy", action="store_true", help="also time the step in true on-policy mode")
    ap.add_argument("--profile", action="store_true",
                    help="profile one more step of each trainer timed (GPU busy vs idle time, top ops)")
    args = ap.parse_args()
    if args.true_on_policy and args.nproc:
        ap.error("--true-on-policy times the Trainer in this process (true on-policy needs one process)")
    try:
        if args.nproc:
            check_nproc(args.nproc, torch.device(args.device).type)
        elif torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
            raise DistError(f"--device {args.device}: no GPU is visible")
    except (DistError, RuntimeError) as e:
        ap.error(str(e))
    args.dtype = args.dtype or ("float32" if args.nproc and args.device == "cpu" else "bfloat16")
    device = torch.device(args.device)
    batch, adv = make_batch(args.seqs, args.seq_len, args.prompt_len, SHAPES[args.shapes]["vocab_size"])
    tokens = args.seqs * args.seq_len
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    n_layers = args.layers or SHAPES[args.shapes]["num_hidden_layers"]
    print(f"\nGRPO train step: {args.seqs} x {args.seq_len} tokens ({args.prompt_len} prompt), {args.shapes} shapes"
          f" ({n_layers} layers), {args.dtype}, micro-batches of {args.micro_batch_size}, lr 1e-6, on {name}")

    if not args.nproc:
        rows = single_process(args, device, batch, adv, tokens, with_naive=True)
        n_steps = args.warmup + args.steps + 1
        print(f"{'method':36s} {'ms/step':>9s} {'tok/s':>9s} {'peak GiB':>9s} "
              f"{f'bf16 weights moved in {n_steps} steps':>30s}")
        for r in rows:
            print(f"{r['method']:36s} {r['ms']:9.1f} {r['tokens_per_s']:9.0f} {r['peak_gib']:9.2f} "
                  f"{100 * r['bf16_changed']:29.2f}%"
                  + (f"   {r['slower_pct']:+.1f}% vs nano_miles" if "slower_pct" in r else ""))
    else:
        if device.type == "cpu":  # every process (ranks and baseline) the same number of threads
            os.environ["OMP_NUM_THREADS"] = str(args.threads)
            torch.set_num_threads(args.threads)
        rows = single_process(args, device, batch, adv, tokens, with_naive=False) if args.baseline else []
        ranks = launch(args.nproc, rank, (vars(args),), device_type=args.device)
        per_rank = [ranks[r] for r in sorted(ranks)]
        ms = max(r["ms"] for r in per_rank)  # the ranks finish each step together; the slowest's median
        state = 16 * per_rank[0]["params"] / args.nproc / 2**30
        rows.append(dict(method=f"{'FSDP2 x ' if args.nproc > 1 else ''}{args.nproc} rank(s) ({args.dtype} + fp32 masters)", ms=ms,
                         tokens_per_s=tokens / ms * 1000, peak_gib=max(r["peak_gib"] for r in per_rank),
                         peak_gib_per_rank=[r["peak_gib"] for r in per_rank], state_gib_per_rank=state,
                         params=per_rank[0]["params"], grad_norm=per_rank[0]["grad_norm"],
                         entropy=per_rank[0]["entropy"], profile=per_rank[0]["profile"]))
        if args.baseline:
            rows[-1]["vs_single_process"] = ms / rows[0]["ms"]
        peak_label = "peak GiB/rank" if device.type == "cuda" else "peak RSS GiB/rank"
        print(f"{'method':40s} {'ms/step':>9s} {'tok/s':>9s} {peak_label:>18s} {'state GiB/rank':>15s}")
        for r in rows:
            state = f"{r['state_gib_per_rank']:15.2f}" if "state_gib_per_rank" in r else f"{'':15s}"
            print(f"{r['method']:40s} {r['ms']:9.1f} {r['tokens_per_s']:9.0f} {r['peak_gib']:18.2f} {state}")
        if args.baseline:
            print(f"{args.nproc} rank(s) / this process, step time: {rows[-1]['vs_single_process']:.3f}"
                  f" (goal at N=1: <= 1.10)")
    profiles = "\n".join(f"--- {r['method']}\n{r.pop('profile')}" for r in rows if r.get("profile"))
    if profiles:
        print(profiles)
    for r in rows:
        r.pop("profile", None)
    record = dict(bench="train_step", date=utc_now(), commit=git_commit(), machine=name, torch=torch.__version__,
                  config=vars(args), results=rows)
    save(record, "train_step.json", extra_text=profiles or None, dry_run=args.dry_run)


if __name__ == "__main__":
    main()
